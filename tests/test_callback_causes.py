"""The cause, not just the symptom, in real Trainer runs: a blow-up without NaN, a flat loss with a healthy
gradient path, the loss the trainer really computes at step 1. Each planted bug is named with the cause whose
fix is the right road, and the symptoms it explains are not reported beside it."""

from __future__ import annotations

import pytest
import torch
from dist import tinytrain as tt
from transformers import Trainer

from hf_sanity.callback import SanityCallback


def run(tmp_path, *, select=None, cls=None, **overrides):
    callback = SanityCallback(
        select=select, use_config=False, print_findings=False, check_every=5, probe_every=5
    )
    trainer = tt.trainer(tmp_path / "out", callbacks=[callback], cls=cls, **overrides)
    trainer.train()
    return trainer, callback


def rules(callback) -> list[tuple[str, int | None, str | None]]:
    return [(f.rule, f.step, f.evidence.get("cause")) for f in callback.report.findings]


class DoubleSoftmax(Trainer):
    """Cross-entropy over probabilities instead of logits: flat at about ln(V), whatever the LR."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        probs = torch.softmax(model(**inputs).logits[:, :-1], -1)
        return torch.nn.functional.cross_entropy(
            probs.reshape(-1, probs.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100
        )


class MeanPerMicroBatch(Trainer):
    """A compute_loss that ignores num_items_in_batch: every micro-batch averaged on its own."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        return (loss, outputs) if return_outputs else loss


class TenTimes(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return 10 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.planted("loss-diverged")
def test_adamw_at_a_huge_lr_diverges_without_nan_and_says_why(tmp_path):
    _, callback = run(tmp_path, learning_rate=50.0, max_steps=30)
    diverged = callback.report.by_rule("loss-diverged")[0]
    assert diverged.evidence["cause"] == "lr-too-high" and diverged.step <= 5
    for key in ("loss", "lr", "update_ratio", "grad_norm", "start_loss"):
        assert diverged.evidence[key] is not None, key
    assert diverged.evidence["loss"] > 2 * diverged.evidence["start_loss"]
    assert "lower the learning rate" in diverged.fix.lower()
    explosion = callback.report.by_rule("grad-explosion")
    assert not explosion or explosion[0].evidence["cause"] == "lr-too-high"
    # The symptoms the divergence explains are not reported as causes of their own.
    assert not {"underfitting", "loss-oscillation"} & {f.rule for f in callback.report.findings}


@pytest.mark.planted("loss-diverged")
def test_sgd_at_a_huge_lr_without_clipping_blows_up_once_kills_the_network_and_is_loss_diverged(tmp_path):
    """SGD at LR 1e4 with clipping off: the loss jumps to ~1e6 at step 2, the network dies (zero gradients, the
    loss sits at ln V) and never rises again. It diverged at step 2 because the LR is far too high; the flat
    loss that follows is explained by it, not a second error."""
    _, callback = run(tmp_path, learning_rate=1e4, optim="sgd", max_grad_norm=0.0, max_steps=15)
    assert dict(callback.history.losses)[2] > 1e5  # the blow-up really is at step 2
    assert [(rule, step, cause) for rule, step, cause in rules(callback) if rule.startswith("loss-")] == [
        ("loss-diverged", 2, "lr-too-high")
    ]
    (diverged,) = callback.report.by_rule("loss-diverged")
    assert diverged.evidence["dead_from_step"] == 3 and "died" in diverged.message
    assert diverged.evidence["clipping_off"] is True and diverged.evidence["no_warmup"] is True
    assert diverged.fix.startswith("First turn gradient clipping back on (max_grad_norm=1.0)")


def test_a_learning_rate_far_too_low_is_loss_flat_with_cause_lr_too_low(tmp_path):
    _, callback = run(tmp_path, select=["loss-flat"], learning_rate=3e-7, max_steps=80)
    (finding,) = callback.report.findings
    assert finding.evidence["cause"] == "lr-too-low" and finding.evidence["update_ratio"] < 1e-4
    assert abs(finding.evidence["change_per_100_steps"]) < 0.01  # the loss does not fall: measured
    assert "Raise the learning rate" in finding.fix


class RandomTargets(Trainer):
    """Labels drawn anew at every step: nothing in the inputs predicts them, whatever the LR."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        drawn = torch.randint(0, model.config.vocab_size, labels.shape, device=labels.device)
        inputs["labels"] = torch.where(labels != -100, drawn, labels)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.planted("loss-flat")
def test_targets_that_cannot_be_learned_are_loss_flat_with_cause_loss_not_learnable(tmp_path):
    _, callback = run(tmp_path, cls=RandomTargets, max_steps=60)
    flat = callback.report.by_rule("loss-flat")[0]
    assert flat.evidence["cause"] == "loss-not-learnable" and flat.evidence["update_ratio"] > 1e-3
    assert "hf-sanity overfit" in flat.fix
    assert not callback.report.by_rule("underfitting")  # explained by the flat loss


def test_a_double_softmax_at_a_small_lr_is_loss_flat_with_cause_loss_not_learnable(tmp_path):
    """Cross-entropy over probabilities: the loss cannot go below ln(V) - 1 and its gradient is ~1/V of the real
    one. At LR 3e-4 it stays at chance (0.1% per 100 steps) while the weights move healthily."""
    _, callback = run(tmp_path, cls=DoubleSoftmax, learning_rate=3e-4, max_steps=40)
    flat = callback.report.by_rule("loss-flat")[0]
    assert flat.evidence["cause"] == "loss-not-learnable"
    assert "double softmax" in flat.fix and "hf-sanity overfit" in flat.fix


def test_a_double_softmax_at_a_working_lr_is_underfitting_near_chance_not_a_flat_loss(tmp_path):
    """At LR 3e-3 the same loss falls 9% in 40 steps (its floor is ln(V) - 1): not flat. At the end of the run it
    is still near chance, and underfitting says so, with the overfit test first in its fix."""
    _, callback = run(tmp_path, cls=DoubleSoftmax, max_steps=60)
    assert not callback.report.by_rule("loss-flat")
    (under,) = callback.report.by_rule("underfitting")
    assert "near-chance" in under.evidence["reasons"] and "hf-sanity overfit" in under.fix


def test_a_compute_loss_that_scales_the_loss_is_init_loss_off_chance_at_step_1(tmp_path):
    _, callback = run(tmp_path, select=["init-loss-off-chance"], cls=TenTimes, max_steps=3)
    (finding,) = callback.report.findings
    assert (finding.step, finding.evidence["cause"]) == (1, "trainer-loss")
    assert 8 < finding.evidence["ratio"] < 12  # 10x the model's own cross-entropy
    assert "compute_loss" in finding.fix


def test_a_compute_loss_that_ignores_num_items_is_grad_accum_loss_scaling_not_val_below_train(tmp_path):
    rows = tt.rows(tt.setup()[1], 16)
    _, callback = run(
        tmp_path, cls=MeanPerMicroBatch, gradient_accumulation_steps=4, per_device_train_batch_size=2,
        max_steps=12, eval_strategy="steps", eval_steps=3, eval_dataset=rows,
    )  # fmt: skip
    found = rules(callback)
    assert ("grad-accum-loss-scaling", 1, None) in found
    scaling = callback.report.by_rule("grad-accum-loss-scaling")[0]
    assert 3 < scaling.evidence["ratio"] < 5 and scaling.evidence["gradient_accumulation_steps"] == 4
    assert "val-below-train" not in [
        rule for rule, *_ in found
    ]  # the train loss is inflated 4x, not better eval


@pytest.mark.clean("loss-diverged", "grad-accum-loss-scaling", "init-loss-off-chance", "loss-flat")
def test_the_correct_twins_are_silent(tmp_path):
    """The same trainer code, written correctly: an LR that learns, the built-in loss under accumulation."""
    _, callback = run(tmp_path, max_steps=30, gradient_accumulation_steps=2)
    assert [f"{f.rule}: {f.message}" for f in callback.report.findings if f.severity != "info"] == []
