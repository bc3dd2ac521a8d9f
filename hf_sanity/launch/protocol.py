"""What ``hf-sanity run``/``preflight -- CMD`` tells the processes of the command, and what they send back.

Down: one environment variable, :data:`ENV`, holding the :class:`Settings` as JSON (every child inherits it:
launchers copy the environment), and the folder holding the bootstrap ``sitecustomize.py`` first on
``PYTHONPATH``. Up: files in the private folder the settings name (``exchange``), one JSON record per event,
written atomically and named by process and trainer so that processes never write the same file:

* ``attached-<pid>-<n>.json``: the process's n-th trainer was reached (its class, rank, world size, whether
  hf-sanity added the callback or found the user's);
* ``report-<pid>-<n>.json``: the main process's report of that trainer (``report``: the JSON of
  :meth:`hf_sanity.report.Report.to_dict`; ``state``: the trainer's state, what ``trainer_state.json`` holds),
  with ``report-<pid>-<n>.pickle`` beside it, the report's objects (its token views), which the parent reads
  when it runs the same hf-sanity;
* ``failed-<pid>-<n>.json``: ``preflight`` could not check the trainer (``message``: one line).

Plain Python only: the parent imports this before anything else and must start fast.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ENV = "HF_SANITY_LAUNCH"
VERSION = 1  # of this protocol: a child of another hf-sanity says so and stays out of the command's way
MODES = ("run", "preflight")
SITE = "site"  # the subfolder put first on PYTHONPATH: it holds only the bootstrap's sitecustomize.py
KINDS = ("attached", "report", "failed")


@dataclass(frozen=True)
class Settings:
    """What every process of the command needs to know: the mode, where to send results, and the callback's
    options (``run``) or preflight's (``preflight``)."""

    mode: str
    exchange: str
    abort_on: str = "never"
    select: tuple[str, ...] | None = None
    ignore: tuple[str, ...] | None = None
    sample: int = 256  # preflight: examples for the model-side checks
    show: int | None = None  # preflight: rows of the first batch to show decoded

    def to_env(self) -> str:
        return json.dumps({"version": VERSION, **asdict(self)})

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings | None:
        """The settings this process was started with; None outside ``hf-sanity run``/``preflight``. A value
        this version cannot read raises ``ValueError`` with the reason in one line."""
        raw = (os.environ if environ is None else environ).get(ENV)
        if not raw:
            return None
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            found = data.get("version") if isinstance(data, dict) else None
            raise ValueError(f"{ENV} is of launch protocol {found!r}, this hf-sanity reads {VERSION}")
        data.pop("version")
        for key in ("select", "ignore"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)

    @property
    def site(self) -> Path:
        return Path(self.exchange) / SITE

    def child_environment(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        """``environ`` (default: this process's) with the settings and the bootstrap's folder first on
        PYTHONPATH (the user's entries kept after it, in their order)."""
        env = dict(os.environ if environ is None else environ)
        env[ENV] = self.to_env()
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join([str(self.site), *([path] if path else [])])
        return env


def record_path(exchange: str | os.PathLike, kind: str, n: int, suffix: str = ".json") -> Path:
    """This process's file of ``kind`` for its ``n``-th trainer."""
    return Path(exchange) / f"{kind}-{os.getpid()}-{n}{suffix}"


def send(path: Path, data: dict[str, Any] | bytes) -> None:
    """Write a record so that the parent reads all of it or nothing (a process killed mid-write leaves a
    temporary file, never half a record)."""
    payload = data if isinstance(data, bytes) else json.dumps(data, default=str).encode("utf-8")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, path)


def received(exchange: str | os.PathLike, kind: str) -> list[dict[str, Any]]:
    """Every record of ``kind`` the children sent, each with ``path`` (where it was read from); unreadable
    ones are left out (a child of another version, a disk that filled up)."""
    out = []
    for path in sorted(Path(exchange).glob(f"{kind}-*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            out.append({**record, "path": str(path)})
    return out
