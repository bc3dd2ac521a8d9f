"""Loss spikes in real Trainer runs, through SanityCallback: a run whose every 10th batch has shuffled labels
spikes again and again at a height it never learns down (a warning), its twin with one such batch late in the
run recovers at the next step (info at most)."""

from __future__ import annotations

import pytest
import torch
from dist import tinytrain as tt
from transformers import DataCollatorForSeq2Seq

from hf_sanity.callback import SanityCallback

pytestmark = pytest.mark.slow  # 100-step Trainer runs


def shuffling_collator(tok, batches: set[int] | None = None, every: int | None = None):
    """DataCollatorForSeq2Seq whose listed batches (1-based, or every ``every``-th) get their label tokens
    shuffled across the batch: the same inputs, labels the model cannot learn."""
    base = DataCollatorForSeq2Seq(tok)
    generator = torch.Generator().manual_seed(0)
    calls = [0]

    def collate(features):
        batch = base(features)
        calls[0] += 1
        if (every and calls[0] % every == 0) or calls[0] in (batches or ()):
            labels = batch["labels"]
            supervised = labels != -100
            values = labels[supervised]
            labels[supervised] = values[torch.randperm(len(values), generator=generator)]
        return batch

    return collate


def run(tmp_path, collator):
    model, tok = tt.setup()
    cb = SanityCallback(use_config=False, print_findings=False)
    trainer = tt.trainer(
        tmp_path, callbacks=[cb], model=model, tok=tok, data=tt.rows(tok, 64), max_steps=100,
        per_device_train_batch_size=8, logging_steps=1, seed=2, data_seed=2, collator=collator(tok),
    )  # fmt: skip
    trainer.train()
    return cb, tt.step_losses(trainer)


@pytest.mark.planted("loss-spike")
def test_every_10th_batch_with_shuffled_labels_is_a_repeated_loss_spike(tmp_path):
    cb, losses = run(tmp_path, lambda tok: shuffling_collator(tok, every=10))
    assert losses[0] > 6 and sum(losses[-5:]) / 5 < 2  # it converges between the shuffled batches
    (spike,) = [f for f in cb.report.by_rule("loss-spike") if f.severity != "info"]
    assert spike.severity == "warning" and spike.evidence["cause"] == "repeated"
    assert spike.evidence["spikes"] >= 6 and spike.evidence["every_steps"] == 10
    assert all(step % 10 == 0 for step in spike.evidence["steps"])
    assert spike.evidence["max_ratio"] > 5 and spike.evidence["recovered"] is True
    assert "every 10 steps" in spike.message


@pytest.mark.clean("loss-spike")
def test_one_late_batch_with_shuffled_labels_is_at_most_info(tmp_path):
    """The clean twin: the same run with one shuffled batch at step 70, back down at step 71."""
    cb, losses = run(tmp_path, lambda tok: shuffling_collator(tok, batches={70}))
    assert losses[69] > 3 * losses[68]  # the jump is there
    assert [f"{f.rule}: {f.message}" for f in cb.report.findings if f.severity != "info"] == []
    (spike,) = cb.report.by_rule("loss-spike")  # the detector judged it
    assert (spike.step, spike.severity, spike.evidence["cause"]) == (70, "info", "transient")
    assert spike.evidence["recovered"] is True
