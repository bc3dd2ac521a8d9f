"""Small helpers for rule tests: run preflight with only the rules under test selected."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys

import datasets

from hf_sanity.drivers.preflight import preflight
from hf_sanity.testing.data import CAPITALS


def trainer_args(tmp_path, **kwargs):
    """TrainingArguments for a 2-step CPU run of a Trainer built to check its first batches."""
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                save_strategy="no", seed=0, disable_tqdm=True)  # fmt: skip
    return TrainingArguments(**{**base, **kwargs})


def token_rows(tok, n: int = 16) -> datasets.Dataset:
    """``n`` demo conversations rendered with ``tok``'s chat template, as ``input_ids`` only."""
    from hf_sanity.testing import demo_conversations

    return datasets.Dataset.from_list(
        [{"input_ids": tok.apply_chat_template(r["messages"])["input_ids"]} for r in demo_conversations(n)]
    )


def sft_online_detectors() -> set[str]:
    """The online detectors an SFT run builds: the step detectors and the curve detectors SanityCallback runs
    of the SFT rules (the preference and RL monitors are for their own objectives)."""
    from hf_sanity import catalog
    from hf_sanity.selection import Selection

    sft = Selection().for_objective("sft").enabled
    return {
        d.name
        for d in catalog.detectors("step", enabled=sft) + catalog.detectors("curve", online=True, enabled=sft)
    }


def run(tokenizer, rows, *, select=None, **kwargs):
    data = rows if isinstance(rows, datasets.Dataset) else datasets.Dataset.from_list(rows)
    return preflight(tokenizer=tokenizer, dataset=data, select=select, use_config=False, **kwargs)


def slugs(report) -> set[str]:
    return {f.rule for f in report.findings}


def above_info(report) -> list[str]:
    return [f"{f.rule}: {f.message}" for f in report.findings if f.severity != "info"]


def cli(
    *args, cwd=None, timeout: int = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`hf-sanity ARGS...` in a fresh process, as a user runs it (``env``: variables to set for it)."""
    # The tiny models are overhead-bound; one thread is steadier.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "hf_sanity.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env=env,
    )


def cli_on_terminal(*args, cwd=None, timeout: int = 300) -> tuple[int, str, str]:
    """`hf-sanity ARGS...` with its stderr on a pseudo-terminal (as in an interactive shell) and its stdout on a
    pipe: (exit code, stdout, what the terminal showed on stderr, escape codes removed, one entry per redraw
    on its own line)."""
    import pty
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160", "TERM": "xterm"}
    env.pop("RANK", None)
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hf_sanity.cli", *map(str, args)], stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=slave, cwd=cwd, env=env,
    )  # fmt: skip
    os.close(slave)
    out_fd = proc.stdout.fileno()
    got = {master: b"", out_fd: b""}
    open_fds, deadline = set(got), time.monotonic() + timeout
    while open_fds and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_fds), [], [], 0.2)
        for fd in ready:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:  # the terminal's other end is closed: the process exited
                chunk = b""
            if chunk:
                got[fd] += chunk
            else:
                open_fds.discard(fd)
    os.close(master)
    proc.stdout.close()
    code = proc.wait(timeout=10)
    out, shown = got[out_fd].decode(), got[master]
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode("utf-8", "replace"))
    return code, out, "\n".join(line.strip() for line in re.split(r"[\r\n]", text) if line.strip())


def assert_one_line_error(result, *needles) -> None:
    """Bad input: exit code 2 and one line on stderr naming the problem, never a traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def extractive_qa(n: int = 30) -> list[dict]:
    """Extractive QA rows: a long context of several facts, a question, and the fact that answers it quoted."""
    facts = [
        f"The capital of {country} is {capital}, a city of many bridges." for country, capital in CAPITALS
    ]
    rows = []
    for i in range(n):
        context = " ".join(facts[(i + k) % len(facts)] for k in range(8))
        country = CAPITALS[(i + 3) % len(CAPITALS)][0]
        rows.append({
            "prompt": f"Context: {context}\nQuestion ({i}): quote the sentence about {country}.\nAnswer:",
            "completion": " " + facts[(i + 3) % len(facts)],
        })  # fmt: skip
    return rows


def torchrun(script, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    """``script`` under ``torchrun --nproc_per_node 2`` on this machine (gloo, one thread a process)."""
    import socket

    with socket.socket() as sock:  # a free port, so that parallel runs do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(port), str(script), *map(str, args),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def load_tiny_idefics3():
    """The tiny Idefics3 and its processor (``hf_sanity.testing.vlm``), or the test skipped, naming the version,
    where transformers' Idefics3 image processor needs torchvision and it is not installed (transformers 5.6 and
    5.16, CI's lower lanes; 5.25's does not need it, and there a failure to build is a failure). Decided before
    loading: the cached folder is shared by the lanes, and one saved by 5.25 (its PIL processor) fails otherwise
    under 5.6 and 5.16."""
    import importlib.util

    import pytest
    import transformers
    from packaging.version import Version

    from hf_sanity.testing import vlm

    if (
        Version(transformers.__version__) < Version("5.25")
        and importlib.util.find_spec("torchvision") is None
    ):
        pytest.skip(f"transformers {transformers.__version__}'s Idefics3 image processor needs torchvision")
    return vlm.load_tiny_idefics3()
