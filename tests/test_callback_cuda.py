"""SanityCallback on CUDA: the paths the CPU cannot exercise (pinned copies and events for the early NaN
check, allocator memory). Skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch
from dist import tinytrain as tt

from hf_sanity.callback import SanityCallback
from hf_sanity.training.recorder import EarlyFlags, Recorder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_early_flags_read_without_waiting_once_the_copy_landed():
    flags = EarlyFlags()
    flags.mark(7, 0, torch.tensor(1.0, device="cuda"))
    flags.mark(7, 1, torch.tensor(math.inf, device="cuda"))
    torch.cuda.synchronize()
    assert flags.nonfinite() == (7, 1)


def test_recorder_on_cuda_reads_in_one_transfer():
    recorder = Recorder(capacity=1)
    for step in range(1, 4):
        recorder.push(step, "loss", torch.tensor(float(step), device="cuda"))
    assert recorder.read() == {1: {"loss": [1.0]}, 2: {"loss": [2.0]}, 3: {"loss": [3.0]}}
    assert recorder.transfers == 1


def test_nan_input_on_cuda_is_diagnosed_with_the_weights_of_its_step(tmp_path):
    model, tok = tt.setup()
    cb = SanityCallback(select=["nonfinite-loss"], use_config=False, print_findings=False)
    trainer = tt.trainer(
        tmp_path,
        callbacks=[cb],
        model=model,
        tok=tok,
        collator=tt.embeds_collator(tok, model, 3),
        use_cpu=False,
    )
    trainer.train()
    finding = cb.report.by_rule("nonfinite-loss")[0]
    assert (finding.step, finding.evidence["cause"]) == (3, "input")
    assert finding.evidence["replay_weights"] == "same step"  # known before the optimizer step, no extra sync


def test_clean_run_on_cuda_is_silent(tmp_path):
    cb = SanityCallback(use_config=False, print_findings=False)
    trainer = tt.trainer(tmp_path, callbacks=[cb], max_steps=30, use_cpu=False)
    trainer.train()
    assert [f.rule for f in cb.report.findings if f.severity != "info"] == []
    assert cb.report.stats["transfers"] <= cb.report.stats["reads"] <= 30 // 10 + 30 // 5 + 2
