"""What `hf-sanity run -- CMD` and `hf-sanity preflight -- CMD` cost beyond the command itself.

A user's training script (the tiny model saved to a folder, `Trainer` over the demo conversations, 60 steps) run
as separate processes, whole-process wall time:

- ``run``: `python train.py` with `SanityCallback` attached in the script against `hf-sanity run -- python
  train.py` (the import hook attaches the same callback): what the hook and the launcher add beyond the
  callback's own share. ABBA pairs; the median ratio and its spread.
- ``preflight``: `hf-sanity preflight -- python train.py` against the command's own start-up (the script run
  until it would call `train()`, then exiting) plus the in-process `preflight(trainer=)` on the same trainer
  (timed inside that script): the target is the first at most the sum.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import os, sys, time
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
import datasets
from hf_sanity.testing import demo_conversations

folder, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
mode = sys.argv[4] if len(sys.argv) > 4 else "train"
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder)
rows = []
for row in demo_conversations(64):
    ids = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
    rows.append({"input_ids": ids, "labels": ids})
args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4, report_to=[],
                         save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, logging_steps=10)
from transformers import DataCollatorForSeq2Seq
callbacks = []
if mode == "callback":
    from hf_sanity import SanityCallback
    callbacks = [SanityCallback(print_findings=False)]
trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                  data_collator=DataCollatorForSeq2Seq(tok, padding=True), callbacks=callbacks)
if mode == "until-train":
    raise SystemExit(0)
if mode == "inline-preflight":
    import hf_sanity
    started = time.perf_counter()
    hf_sanity.preflight(trainer=trainer)
    print(f"PREFLIGHT_SECONDS={time.perf_counter() - started:.3f}")
    raise SystemExit(0)
trainer.train()
"""


def _timed(cmd: list[str], env: dict) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - started
    if result.returncode not in (0, 1):  # preflight exits 1 when it finds an error
        raise RuntimeError(f"{cmd} exited {result.returncode}: {result.stderr[-2000:]}")
    return wall, result.stdout


def run(*, quick: bool = False) -> tuple[dict, dict]:
    from hf_sanity.testing import tiny_model_dir

    folder = str(tiny_model_dir("chatml", "distinct"))
    root = Path(tempfile.mkdtemp(prefix="hf-sanity-launch-"))
    script = root / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # fmt: skip
    steps = 20 if quick else 60
    pairs = 1 if quick else 4
    python = [sys.executable, str(script), folder]
    hf_sanity = [sys.executable, "-m", "hf_sanity.cli"]
    ratios, walls = [], {"callback": [], "run": []}
    for i in range(pairs):  # ABBA: A B, then B A
        order = ("callback", "run") if i % 2 == 0 else ("run", "callback")
        for kind in order:
            out = str(root / f"{kind}-{i}")
            cmd = [*python, out, str(steps), "callback"] if kind == "callback" else [
                *hf_sanity, "run", "--", *python, out, str(steps)]  # fmt: skip
            walls[kind].append(_timed(cmd, env)[0])
        ratios.append(walls["run"][-1] / walls["callback"][-1])
    attached = {
        "setup": f"Trainer, tiny model, {steps} steps, {pairs} ABBA pairs",
        "in_script_callback_s": round(statistics.median(walls["callback"]), 2),
        "run_dash_dash_s": round(statistics.median(walls["run"]), 2),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_range": f"{min(ratios):.3f}-{max(ratios):.3f}",
    }  # fmt: skip
    startups, inline, checked = [], [], []
    for i in range(pairs):
        startups.append(_timed([*python, str(root / f"s-{i}"), "1", "until-train"], env)[0])
        _, printed = _timed([*python, str(root / f"p-{i}"), "1", "inline-preflight"], env)
        inline.append(float(printed.split("PREFLIGHT_SECONDS=")[1].split()[0]))
        checked.append(_timed([*hf_sanity, "preflight", "--", *python, str(root / f"h-{i}"), "1"], env)[0])
    budget = statistics.median(startups) + statistics.median(inline)
    checked_row = {
        "setup": f"preflight -- python train.py, {pairs} repeats (medians)",
        "command_startup_s": round(statistics.median(startups), 2),
        "inline_preflight_s": round(statistics.median(inline), 2),
        "preflight_dash_dash_s": round(statistics.median(checked), 2),
        "of_budget": f"{statistics.median(checked) / budget:.3f}x",
    }  # fmt: skip
    return attached, checked_row
