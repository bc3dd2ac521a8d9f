"""Preference fine-tuning's costs: preflight of a DPO trainer against the trainer's own preparation of the same
pairs, and SanityCallback on a DPO run against the same run without it.

* ``preparation``: `DPOTrainer._prepare_dataset` (TRL's tokenization of the pairs, what every DPO run pays
  once) against ``hf_sanity.preflight(trainer=...)`` on the prepared trainer (the pairs measured, each chosen
  side encoded for the sequence rules, a sample re-tokenized for TRL's prompt-prefix condition). Median of
  ``repeats``, alternating.
* ``callback``: a DPO run on the tiny model (the model saved to a folder, as TRL needs), ``steps`` steps (160 by
  default, issue 29's row), ``pairs`` pairs of runs with and without the callback in ABBA order, from the same
  weights and seed; the whole ``train()`` wall clock of each, the median of the per-pair ratios and their range,
  and the callback's own clock (``stats.callback_seconds``, ``stats.callback_share``: median and range).
"""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from pathlib import Path


def _pairs(n: int, seed: int = 0) -> list[dict]:
    from hf_sanity.testing import demo_preference_pairs

    rows = []
    while len(rows) < n:  # demo_preference_pairs has a bounded number of distinct rows: vary the seed
        rows += demo_preference_pairs(min(200, n - len(rows)), seed=seed + len(rows))
    return rows[:n]


def _trainer(folder: Path, out: Path, rows: list[dict], *, steps: int, callbacks=()):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    warnings.filterwarnings("ignore")
    args = DPOConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, logging_steps=10, report_to=[],
        save_strategy="no", bf16=False, gradient_checkpointing=False, learning_rate=1e-4, max_length=256,
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    return DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(folder),
        callbacks=list(callbacks),
    )


def preparation(sizes=(500, 2_000), repeats: int = 3) -> list[dict]:
    import datasets

    import hf_sanity
    from hf_sanity.testing import tiny_model_dir

    folder = tiny_model_dir("chatml", "distinct")
    out = []
    for n in sizes:
        rows = _pairs(n)
        trl_s, ours_s = [], []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                trainer = _trainer(
                    folder, Path(tmp), rows[:8], steps=1
                )  # built on a few rows: then timed alone
                raw = datasets.Dataset.from_list(rows)
                started = time.perf_counter()
                trainer.train_dataset = trainer._prepare_dataset(
                    raw, trainer.processing_class, trainer.args, "train"
                )
                trl_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                report = hf_sanity.preflight(trainer=trainer, use_config=False)
                ours_s.append(time.perf_counter() - started)
        trl, ours = statistics.median(trl_s), statistics.median(ours_s)
        out.append({"pairs": n, "trl_prepare_s": trl, "preflight_s": ours, "ratio": ours / trl,
                    "findings": len(report.findings)})  # fmt: skip
    return out


def callback(steps: int = 160, pairs: int = 8) -> list[dict]:
    import torch

    from hf_sanity import SanityCallback
    from hf_sanity.testing import tiny_model_dir

    torch.set_num_threads(1)
    folder = tiny_model_dir("chatml", "distinct")
    rows = _pairs(400)
    shares, own, findings = [], [], set()

    def run(with_callback: bool) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            cb = [SanityCallback(use_config=False, print_findings=False)] if with_callback else []
            trainer = _trainer(folder, Path(tmp), rows, steps=steps, callbacks=cb)
            started = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - started
        if cb:
            shares.append(cb[0].report.stats.get("callback_share") or 0.0)
            own.append(cb[0].report.stats.get("callback_seconds", 0.0))
            findings.update(f.rule for f in cb[0].report.findings)
        return wall

    run(True)  # warm-up
    shares.clear(), own.clear()
    ratios, bare, watched = [], [], []
    for i in range(pairs):  # ABBA: pair i runs bare first when i is even, watched first when odd
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {flag: run(flag) for flag in order}
        bare.append(got[False])
        watched.append(got[True])
        ratios.append(got[True] / got[False])
    return [{
        "setup": f"DPO, tiny model, batch 8, {steps} steps, 1 thread",
        "pairs": pairs,
        "bare_s": statistics.median(bare),
        "with_callback_s": statistics.median(watched),
        "wall_ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "callback_s": statistics.median(own),
        "callback_share": statistics.median(shares),  # its own clock over the run's wall (report stats)
        "share_min_max": f"{min(shares):.4f}-{max(shares):.4f}",
        "findings": ", ".join(sorted(findings)) or "none",
    }]  # fmt: skip
