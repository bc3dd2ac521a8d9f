"""`hf-sanity overfit`: its own clock against a bare PyTorch loop doing the same steps, and how soon the command
shows something.

The tiny model (``hf_sanity.testing.tiny_model_dir``: Llama, hidden 64, 2 layers) on 8 short demo
conversations, ``--lr`` given (no LR search), one CPU thread on both sides (the tiny model is overhead-bound).
The command runs in a subprocess with its stderr on a pseudo-terminal, as a user sees it (progress is drawn
only on a terminal); first output is the time from the process start to its first byte on stderr or stdout.
The bare loop trains a fresh copy of the same model on the same collated batches the command built (the
pipeline of ``hf_sanity.protocol.build.from_paths``), for as many steps as the command ran: zero_grad, the
loss over the micro-batches, ``loss.item()`` (the command reads every step's loss to stop at near zero),
backward, clipping as the setup does, AdamW step.
"""

from __future__ import annotations

import json
import os
import pty
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLES = 8


def _data_file(folder: Path) -> Path:
    from hf_sanity.testing import demo_conversations

    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in demo_conversations(EXAMPLES)), encoding="utf-8")
    return path


def cli_run(model: Path, data: Path, steps: int, lr: float, out: Path) -> dict:
    """The command in a subprocess, stderr on a pseudo-terminal: (first output s, wall s, its report)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "xterm", "COLUMNS": "120", "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "hf_sanity.cli", "overfit", "--model", str(model), "--dataset", str(data),
            "--n", str(EXAMPLES), "--steps", str(steps), "--lr", str(lr), "--json", str(out)]  # fmt: skip
    master, slave = pty.openpty()
    started = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    first = None
    streams = [master, proc.stdout.fileno()]
    while streams:
        ready, _, _ = select.select(streams, [], [], 1.0)
        for fd in ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the pseudo-terminal closes with the process
                chunk = b""
            if not chunk:
                streams.remove(fd)
            elif first is None:
                first = time.perf_counter() - started
        if not ready and proc.poll() is not None:
            break
    proc.wait()
    wall = time.perf_counter() - started
    os.close(master)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"hf-sanity overfit exited with {proc.returncode}")
    report = json.loads(out.read_text(encoding="utf-8"))
    return {"first_output_s": first, "wall_s": wall, "report": report}


def bare_loop(model_dir: Path, data: Path, steps: int, lr: float, pipeline=None) -> float:
    """Seconds of a plain training loop over the batches the command trains on."""
    import torch

    from hf_sanity.protocol.build import from_paths
    from hf_sanity.protocol.loop import micro_weights
    from hf_sanity.protocol.options import ProtocolOptions
    from hf_sanity.testing.factory import build_model  # noqa: F401  (the same weights: loaded from the folder)

    if pipeline is None:
        pipeline = from_paths(
            str(model_dir), str(data), options=ProtocolOptions(n=EXAMPLES, steps=steps, lr=lr)
        )
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        model.train()
        batches = pipeline.batches
        weights = micro_weights(batches)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        params = [p for p in model.parameters() if p.requires_grad]
        started = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            total = None
            for batch, weight in zip(batches, weights):
                loss = model(**batch).loss
                term = loss * weight if len(batches) > 1 else loss
                total = term if total is None else total + term
            total.item()
            total.backward()
            if pipeline.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, pipeline.max_grad_norm)
            optimizer.step()
        return time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)


def run(*, quick: bool = False, repeats: int | None = None) -> list[dict]:
    from hf_sanity.testing import tiny_model_dir

    steps = 100 if quick else 300
    repeats = repeats or (1 if quick else 3)
    lr = 1e-4  # low enough that the loss does not reach near zero early: every step of the budget runs
    model = tiny_model_dir("chatml")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf-sanity-bench-") as tmp:
        data = _data_file(Path(tmp))
        runs, bare = [], []
        for i in range(repeats):
            runs.append(cli_run(model, data, steps, lr, Path(tmp) / f"out{i}.json"))
            ran = runs[-1]["report"]["stats"]["overfit"]["steps_run"]
            bare.append(bare_loop(model, data, ran, lr))
    stats = [r["report"]["stats"] for r in runs]
    own = statistics.median(s["seconds"] for s in stats)
    loop = statistics.median(s["overfit"]["seconds"] for s in stats)
    base = statistics.median(bare)
    rows.append(
        {
            "model": "tiny (0.2M)",
            "examples": EXAMPLES,
            "steps_run": stats[0]["overfit"]["steps_run"],
            "repeats": repeats,
            "first_output_s": statistics.median(r["first_output_s"] for r in runs),
            "cli_wall_s": statistics.median(r["wall_s"] for r in runs),
            "overfit_own_s": own,
            "overfit_run_s": loop,
            "bare_loop_s": base,
            "ratio": own / base,
        }
    )
    return rows
