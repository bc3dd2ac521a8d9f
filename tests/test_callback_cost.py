"""The callback's own clock accounts for everything it adds to a run (issue 22): each Trainer event, each call
of its instruments inside the step (the wrapped training_step, the forward hooks, the gradient-norm wrapper),
and nothing of Trainer's own work. A known delay planted in what each entry point runs must show up in
``stats.callback_seconds`` and ``stats.callback_share``; the model's own time must not."""

from __future__ import annotations

import time

import pytest
from dist import tinytrain as tt

from hf_sanity.callback import SanityCallback
from hf_sanity.training import broadcast, outcome, replay, shards
from hf_sanity.training.first_batch import FirstBatch
from hf_sanity.training.instrument import OwnClock
from hf_sanity.training.measures import StepSampler
from hf_sanity.training.recorder import EarlyFlags
from hf_sanity.training.trl_metrics import ObjectiveFeed

DELAY = 0.002  # seconds planted in each call

# (object, attribute): what each entry point runs, one per entry (the hooks, the wrappers, the events).
PLANTED = {
    "training_step wrapper, before": (replay.HeldBatches, "hold"),
    "training_step wrapper, after": (EarlyFlags, "mark"),
    "gradient-norm wrapper": (shards, "plain"),
    "forward pre-hook": (StepSampler, "forward"),
    "forward hook": (FirstBatch, "logits_pending"),
    "the first step's loss watch, on each torch operation": (broadcast.LossWatch, "observe"),
    "on_pre_optimizer_step": (StepSampler, "before_optimizer"),
    "on_optimizer_step": (StepSampler, "after_optimizer"),
    "on_step_end": (ObjectiveFeed, "step_end"),  # not inside any check's guard
    "on_log": (outcome, "log_counts"),
}


def plant(monkeypatch, clock: OwnClock, calls: dict[str, list[bool]]) -> None:
    """Each planted call sleeps DELAY and records whether the callback's clock was running."""
    for entry, (owner, name) in PLANTED.items():
        original = getattr(owner, name)

        def slowed(*args, _original=original, _entry=entry, **kwargs):
            calls.setdefault(_entry, []).append(clock.running)
            time.sleep(DELAY)
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, slowed)


def test_every_entry_point_is_on_the_clock(tmp_path, monkeypatch):
    calls: dict[str, list[bool]] = {}
    cb = SanityCallback(use_config=False, print_findings=False)
    plant(monkeypatch, cb.clock, calls)
    trainer = tt.trainer(tmp_path, callbacks=[cb], max_steps=12, logging_steps=2)
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    assert set(calls) == set(PLANTED), set(PLANTED) - set(calls)  # every entry point ran ...
    assert {entry: all(on) for entry, on in calls.items()} == dict.fromkeys(PLANTED, True)  # ... on the clock
    planted = DELAY * sum(len(on) for on in calls.values())
    stats = cb.report.stats
    assert stats["callback_seconds"] >= planted, (stats["callback_seconds"], calls)
    # The share is of the run the callback saw (train begin to end: within train()), so not below this.
    assert stats["callback_seconds"] / wall <= stats["callback_share"] <= 1.0


def test_the_models_own_work_is_not_on_the_clock(tmp_path):
    """A model whose every training forward takes 0.2 s more: the clock stays far below what the steps took."""
    import torch

    def slow(*args):  # the model's own work, inside Trainer's step (the callback's probes run without grad)
        if torch.is_grad_enabled():
            time.sleep(0.2)

    model, tok = tt.setup()
    model.register_forward_hook(slow)
    cb = SanityCallback(use_config=False, print_findings=False)
    tt.trainer(tmp_path, callbacks=[cb], model=model, tok=tok, max_steps=6).train()
    assert cb.report.stats["callback_seconds"] < 0.2 * 6 / 2
    assert cb.report.stats["callback_share"] < 0.5


def test_the_clock_counts_nested_entries_once_and_not_the_paused_part():
    clock = OwnClock()
    clock.restart()
    with clock:
        time.sleep(0.02)
        with clock:  # a guard inside an event: already on the clock
            time.sleep(0.02)
        with clock.pause():  # Trainer's step inside the wrapper
            time.sleep(0.1)
            with clock:  # a forward hook inside Trainer's step: on the clock again
                time.sleep(0.02)
    assert 0.06 <= clock.seconds < 0.1
    assert clock.share() == pytest.approx(clock.seconds / (time.perf_counter() - clock.started), rel=0.05)


def test_forwards_without_a_graph_after_the_first_reach_no_check(tmp_path, monkeypatch):
    """A trainer whose step also runs the model without a graph (a reference's forward, generation's forwards:
    one per token): after the run's first forward, whatever it was, the callback's checks see the training
    forwards only. The first one (here a no-grad one) is still the first batch's; a training forward in eval
    mode is still train-mode-off."""
    import torch
    from transformers import Trainer

    class WithReference(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            with torch.no_grad():
                for _ in range(3):  # a reference's, and generation's one-a-token forwards
                    model(**inputs)
            if self.state.global_step == 4:
                model.eval()  # planted: the fifth training forward runs in eval mode
            return super().compute_loss(model, inputs, *args, **kwargs)

    seen: list[bool] = []
    original = SanityCallback.pre_forward

    def counted(self, module, args, kwargs):
        seen.append(torch.is_grad_enabled())
        return original(self, module, args, kwargs)

    monkeypatch.setattr(SanityCallback, "pre_forward", counted)
    cb = SanityCallback(use_config=False, print_findings=False)
    tt.trainer(tmp_path, callbacks=[cb], cls=WithReference, max_steps=6).train()
    # 6 steps of 4 forwards each: the first (no grad: the first batch's) and the 6 training forwards.
    assert seen == [False] + [True] * 6
    assert cb.first.done
    found = {f.rule: f for f in cb.report.findings}
    assert "train-mode-off" in found and found["train-mode-off"].step == 5
