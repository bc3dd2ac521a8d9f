"""The parent of ``hf-sanity run``/``preflight -- CMD``: runs the command, unchanged, with the bootstrap first on
its ``PYTHONPATH`` and the settings in its environment; forwards the signals sent to hf-sanity; and reads back what
its processes sent (:mod:`hf_sanity.launch.protocol`) as one report.

The parent imports neither torch nor transformers: the command starts at once, and the report is read from the
files rank 0 wrote (the same hf-sanity's objects, with their token views, else the JSON).
"""

from __future__ import annotations

import pickle
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_sanity.launch import protocol

FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class CommandDidNotStart(Exception):
    """The command could not be started: one line, and the shell's status for it (127: not found, 126: not
    executable)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Outcome:
    """What a command did: its exit status (a shell's: 128 + N when signal N ended it), the trainers its
    processes reached (``attached``), the main process's reports in the order their trainers started, and what
    preflight could not check (``failures``)."""

    code: int
    attached: list[dict[str, Any]] = field(default_factory=list)
    reports: list[tuple[dict[str, Any], Any]] = field(default_factory=list)  # (record, Report)
    failures: list[dict[str, Any]] = field(default_factory=list)


def launch(command: list[str], settings: dict[str, Any]) -> Outcome:
    """Run ``command`` with hf-sanity in every Python process it starts (``settings``: the fields of
    :class:`~hf_sanity.launch.protocol.Settings` but ``exchange``); its private folder is removed after."""
    exchange = tempfile.mkdtemp(prefix="hf-sanity-run-")  # mode 0700: only this user's processes write there
    try:
        launch_settings = protocol.Settings(exchange=exchange, **settings)
        launch_settings.site.mkdir()
        bootstrap = Path(__file__).with_name("bootstrap.py").read_text(encoding="utf-8")
        (launch_settings.site / "sitecustomize.py").write_text(bootstrap, encoding="utf-8")
        code = run_forwarding_signals(command, launch_settings.child_environment())
        return Outcome(
            code, attached=protocol.received(exchange, "attached"), reports=_reports(exchange),
            failures=protocol.received(exchange, "failed"),
        )  # fmt: skip
    finally:
        shutil.rmtree(exchange, ignore_errors=True)


def run_forwarding_signals(command: list[str], env: dict[str, str]) -> int:
    """The command's exit status. SIGINT, SIGTERM and SIGHUP sent to hf-sanity by a process (``kill``) go on to the
    command; those a terminal sends (Ctrl-C) reach the command's processes already, and are not sent twice."""
    waits = hasattr(signal, "sigtimedwait") and hasattr(signal, "pthread_sigmask")
    watched = set(FORWARDED) | ({signal.SIGCHLD} if waits else set())
    if waits:  # blocked here, then read one by one with who sent them; the child starts with them unblocked
        signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    try:
        try:
            proc = subprocess.Popen(
                command, env=env, preexec_fn=(lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, watched))
                if waits else None,
            )  # fmt: skip
        except FileNotFoundError:
            raise CommandDidNotStart(f"command not found: {command[0]}", 127) from None
        except PermissionError:
            raise CommandDidNotStart(f"permission denied: {command[0]} is not executable", 126) from None
        except OSError as exc:
            raise CommandDidNotStart(f"cannot run {command[0]}: {exc.strerror or exc}", 126) from None
        if waits:
            while proc.poll() is None:
                info = signal.sigtimedwait(watched, 1.0)
                # si_code <= 0: sent by a process (kill); above 0 by the kernel (the terminal's Ctrl-C)
                if info is not None and info.si_signo in FORWARDED and info.si_code <= 0:
                    _forward(proc, info.si_signo)
        else:  # no siginfo: forward SIGTERM/SIGHUP, and let Ctrl-C reach the command from the terminal alone
            previous = {
                s: signal.signal(s, lambda n, _: n != signal.SIGINT and _forward(proc, n)) for s in FORWARDED
            }
            try:
                proc.wait()
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
    finally:
        if waits:
            pending = signal.sigpending() & set(
                FORWARDED
            )  # unblocked, one would end hf-sanity before its report
            signal.pthread_sigmask(signal.SIG_UNBLOCK, watched - pending)
    code = proc.returncode
    return 128 - code if code < 0 else code


def _forward(proc: subprocess.Popen, signum: int) -> None:
    if proc.poll() is None:
        proc.send_signal(signum)


def _reports(exchange: str) -> list[tuple[dict[str, Any], Any]]:
    """The main process's reports, oldest trainer first: the objects where this hf-sanity can read them, else
    the JSON (the token views then shown as text)."""
    out = []
    for record in protocol.received(exchange, "report"):
        report = None
        objects = Path(record["path"]).with_suffix(".pickle")
        if objects.is_file():
            try:  # written by the command's processes, into this run's private folder
                report = pickle.loads(objects.read_bytes())
            except Exception:
                report = None
        if report is None or type(report).__name__ != "Report":
            report = from_json(record.get("report") or {})
        out.append((record, report))
    return sorted(
        out, key=lambda item: (item[0].get("started") or 0.0, item[0].get("pid", 0), item[0].get("n", 0))
    )


def from_json(data: dict[str, Any]):
    """A :class:`~hf_sanity.report.Report` from its JSON (``Report.to_dict``), read through the report's schema;
    one this hf-sanity cannot read is said in the report's notes rather than misread."""
    from hf_sanity.errors import UserInputError
    from hf_sanity.report import Report
    from hf_sanity.report_schema import ReportRecord

    try:
        return Report.from_record(ReportRecord.from_dict(data, "a launched process's report"))
    except UserInputError as exc:
        return Report(title="hf-sanity", notes=[str(exc)])


def combined(outcome: Outcome, command: list[str]):
    """One report for the command: its one trainer's, or each trainer's findings together (each marked with
    ``trainer``: its number and class); None when no trainer was checked. ``stats.launch`` says what was
    watched: the command, its trainers and the processes that reached them."""
    if not outcome.reports:
        return None
    trainers = [
        {
            "trainer": record.get("trainer"),
            "output_dir": record.get("output_dir"),
            "finished": record.get("finished"),
        }
        for record, _ in outcome.reports
    ]
    launch = {
        "command": list(command), "exit_code": outcome.code, "trainers": trainers,
        "processes": len({a.get("pid") for a in outcome.attached}) or 1,
        "ranks": sorted({a.get("rank") for a in outcome.attached if isinstance(a.get("rank"), int)}),
    }  # fmt: skip
    if len(outcome.reports) == 1:
        report = outcome.reports[0][1]
        report.stats["launch"] = launch
        return report
    from hf_sanity.report import Report

    first = outcome.reports[0][1]
    report = Report(title=first.title)
    names = ", ".join(f"{i}. {t['trainer']} ({t['output_dir']})" for i, t in enumerate(trainers, 1))
    report.notes.append(
        f"the command trained {len(trainers)} trainers: {names}; each finding names its trainer"
    )
    for i, (record, part) in enumerate(outcome.reports, 1):
        for finding in part.findings:
            finding.evidence = {"trainer": f"{i}: {record.get('trainer')}", **finding.evidence}
            report.add(finding)
        report.notes.extend(part.notes)
        report.views.extend(part.views)
        trainers[i - 1]["stats"] = part.stats
    report.stats["launch"] = launch
    return report


def write_run_folder(folder: Path, outcome: Outcome) -> list[Path]:
    """``--report DIR``: each trainer as a run ``hf-sanity doctor`` reads (``trainer_state.json`` and
    ``hf-sanity/report.json``): DIR itself for one trainer, ``DIR/trainer-<i>`` for several. The folders
    written."""
    import json

    from hf_sanity.report import write_atomic

    runs = []
    many = len(outcome.reports) > 1
    for i, (record, report) in enumerate(outcome.reports, 1):
        run = folder / f"trainer-{i}" if many else folder
        if record.get("state") is not None:
            write_atomic(
                run / "trainer_state.json", json.dumps(record["state"], indent=2, sort_keys=True) + "\n"
            )
        report.write_json(run / "hf-sanity" / "report.json")
        runs.append(run)
    return runs


def stopping_rules(select, ignore, abort_on: str = "error") -> list[str]:
    """The rules whose findings stop a run at ``abort_on="error"``: those of severity error under this selection
    (the catalog's, with the severities ``[tool.hf-sanity]`` sets); none under ``abort_on="never"``. The selection
    is checked either way (an unknown slug is bad input); the catalog, whose rule modules take ~0.5 s to import,
    is read only where a selector or the list needs it."""
    from hf_sanity import catalog
    from hf_sanity.selection import resolve

    selection = resolve(select, ignore)
    if abort_on != "error":
        return []
    return sorted(
        rule.slug
        for rule in catalog.all_rules()
        if selection.enabled(rule.slug)
        and selection.severity.get(rule.slug, rule.severity) == "error"
        and rule.slug != "internal-error"
    )
