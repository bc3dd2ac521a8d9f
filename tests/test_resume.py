"""Resuming from a checkpoint. The monitors, driven with numbers: one stopped at any step, saved as JSON and
restored, goes on exactly as one that never stopped; without a saved state it does not judge what it would
judge against a start it did not see. Then real Trainer runs: 20 steps with a checkpoint, resumed by a fresh
Trainer and a fresh SanityCallback, with and without hf-sanity's state in the checkpoint."""

from __future__ import annotations

import json
import math
import random
import shutil
from types import SimpleNamespace

import pytest
import torch
from dist import tinytrain as tt
from transformers import Trainer, TrainerCallback

from hf_sanity import catalog
from hf_sanity.callback import SanityCallback
from hf_sanity.rules.training.base import SAVED_HEAD, SAVED_TAIL, TrainingSetup
from hf_sanity.rules.training.divergence import DivergenceMonitor
from hf_sanity.rules.training.gradients import GradientMonitor
from hf_sanity.rules.training.loss import LossMonitor
from hf_sanity.rules.training.memory import MemoryMonitor
from hf_sanity.rules.training.predictions import PredictionsMonitor
from hf_sanity.rules.training.step0 import Step0Monitor
from hf_sanity.rules.training.updates import UpdateMonitor
from hf_sanity.training.measures import warmup_steps

SETUP = TrainingSetup(warmup_steps=5, vocab_size=1000, accumulation=1)


def falling(n: int, start: float = 6.9, end: float = 2.0, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [end + (start - end) * math.exp(-i / 20) + rng.uniform(-0.05, 0.05) for i in range(n)]


def step_records(n: int, *, seed: int = 0, **planted) -> list[tuple[int, dict]]:
    """What the callback feeds per step on a healthy run (loss, grad norm, LR, update ratio, gradient path),
    with ``planted``: {key: (from_step, value)}."""
    rng = random.Random(seed)
    out = []
    for step, loss in enumerate(falling(n, seed=seed), 1):
        values = {
            "loss": loss, "losses": [loss], "loss_finite": True, "scaler": False,
            "grad_norm": 1.0 + rng.uniform(-0.1, 0.1), "lr": 1e-3, "update_ratio": 1e-3 * rng.uniform(0.8, 1.2),
            "updated": True, "n_trainable": 10, "n_with_grad": 10, "n_in_optimizer": 10, "stale_norm": 0.0,
        }  # fmt: skip
        for key, (first, value) in planted.items():
            if step >= first:
                values[key] = value(step, values) if callable(value) else value
        if not math.isfinite(values["loss"]):
            values.update(loss_finite=False, losses=[values["loss"]], nonfinite={"logits_finite": True})
        out.append((step, values))
    return out


def flat_at(level):
    return lambda step, values: level + 0.001 * (step % 3)


# Each monitor on a healthy run and on its planted bugs; the long ones outgrow a saved series' ends.
SCENARIOS = {
    "healthy": step_records(300),
    "nan": step_records(90, loss=(70, math.nan)),
    "negative": step_records(60, loss=(50, -0.5)),
    "no-grad": step_records(80, n_with_grad=(60, 0), n_in_optimizer=(60, 0), loss=(60, flat_at(3.0))),
    "lr-zero": step_records(80, lr=(61, 0.0)),
    "lr-too-low": step_records(200, update_ratio=(150, 1e-8)),
    "not-learnable": [(s, {**v, "loss": 6.0 + 0.001 * (s % 4)}) for s, v in step_records(120)],
    "explosion": step_records(260, grad_norm=(250, 40.0)),
    "stale": step_records(60, stale_norm=(40, 1.0), grad_norm=(40, lambda s, v: 1.2 ** (s - 39))),
    "diverged": step_records(200, loss=(180, 30.0)),
    "plateau": [(s, {**v, "label_entropy": 4.0}) for s, v in step_records(120, loss=(40, flat_at(4.0)))],
    "frozen-probes": [
        (s, {"changed": 0.0, "loss_start": 6.9, "loss_level": 6.9 - 0.02 * s}) for s in range(10, 200, 10)
    ],
    "memory": [(s, {"graph_tensors": 0, "holders": {}}) for s in range(0, 60, 5)],
    "step0": [(1, {"step0": {"loss": 6.9}}), *step_records(30)],
}
RUNS = [
    (cls, name) for cls in catalog.monitors() for name in SCENARIOS
    if not set(cls.reads).isdisjoint({k for _, values in SCENARIOS[name] for k in values})
]  # fmt: skip


def findings(found) -> list[tuple]:
    return [(f.rule, f.step, f.message, json.dumps(f.evidence, sort_keys=True)) for f in found]


@pytest.mark.parametrize(("cls", "scenario"), RUNS, ids=[f"{c.__name__}-{s}" for c, s in RUNS])
def test_a_monitor_restored_from_its_saved_state_goes_on_as_if_it_never_stopped(cls, scenario):
    records = SCENARIOS[scenario]
    whole = cls.from_setup(SETUP)
    expected = findings(f for step, values in records for f in whole.update(step, values))
    for cut in sorted({1, len(records) // 3, len(records) // 2, len(records) - 5, len(records) - 1}):
        before = cls.from_setup(SETUP)
        found = [f for step, values in records[:cut] for f in before.update(step, values)]
        saved = json.loads(json.dumps(before.state()))  # what trainer_state.json keeps
        after = cls.from_setup(SETUP)
        after.restore(saved)
        after.first_step = records[cut][0]
        found += [f for step, values in records[cut:] for f in after.update(step, values)]
        assert findings(found) == expected, f"cut at record {cut}"


def test_the_scenarios_plant_what_they_say():
    """The equivalence above means something: the planted scenarios do fire, the healthy one does not."""

    def rules(cls, name):
        monitor = cls.from_setup(SETUP)
        return {f.rule for step, values in SCENARIOS[name] for f in monitor.update(step, values)}

    assert rules(LossMonitor, "nan") == {"nonfinite-loss"}
    assert rules(UpdateMonitor, "no-grad") == {"loss-flat"}
    assert rules(UpdateMonitor, "lr-zero") >= {"lr-zero"}
    assert rules(UpdateMonitor, "lr-too-low") == {"lr-too-low"}
    assert rules(UpdateMonitor, "not-learnable") == {"loss-flat"}
    assert rules(GradientMonitor, "explosion") == {"grad-explosion"}
    assert rules(GradientMonitor, "stale") >= {"stale-gradients"}
    assert rules(DivergenceMonitor, "diverged") == {"loss-diverged"}
    assert rules(LossMonitor, "plateau") == {"loss-plateau-prior"}
    assert rules(PredictionsMonitor, "frozen-probes") == {"predictions-frozen"}
    assert all(rules(cls, "healthy") == set() for cls in catalog.monitors())


def test_a_saved_state_keeps_the_ends_of_a_long_series_and_stays_small():
    monitor = UpdateMonitor.from_setup(SETUP)
    for step, values in step_records(5000):
        monitor.update(step, values)
    saved = monitor.state()
    steps = [s for s, _ in saved["_losses"]]
    assert steps == [*range(1, SAVED_HEAD + 1), *range(5001 - SAVED_TAIL, 5001)]
    assert "warmup_steps" not in saved and "vocab_size" not in saved  # the resumed run's setup gives them
    restored = UpdateMonitor.from_setup(SETUP)
    restored.restore(json.loads(json.dumps(saved)))
    assert restored._losses[0] == monitor._losses[0] and isinstance(restored._losses[0], tuple)
    everything = {}
    for cls in catalog.monitors():
        every = cls.from_setup(SETUP)
        for step, values in step_records(5000):
            every.update(step, values)
        everything[cls.__name__] = every.state()
    assert len(json.dumps(everything)) < 120_000


def test_memory_is_measured_afresh_by_a_resumed_process():
    before = MemoryMonitor()
    for step in range(0, 20, 5):
        before.update(step, {"graph_tensors": step, "holders": {"trainer.kept": step}})
    assert before.fired == {"memory-growth"}
    saved = before.state()
    assert sorted(saved) == ["fired"]


def test_a_monitor_that_did_not_see_the_start_does_not_judge_against_it():
    """A run resumed from a checkpoint without hf-sanity's state: the model is trained and the windows begin
    at the resume. A loss flat at a level well above half of ln(V) with healthy updates is loss-not-learnable
    only against the start of the run; predictions that do not change since the first probe are frozen only if
    they never changed; a first loss far above chance is a broken init only at step 0."""
    flat = [(s + 100, {**v, "loss": 6.0 + 0.001 * (s % 4)}) for s, v in step_records(60)]
    fresh = UpdateMonitor.from_setup(SETUP)
    assert {f.rule for s, v in flat for f in fresh.update(s, v)} == {
        "loss-flat"
    }  # it does judge, from the start
    resumed = UpdateMonitor.from_setup(SETUP)
    resumed.start_known, resumed.first_step = False, 101
    assert [f for s, v in flat for f in resumed.update(s, v)] == []
    broken = [(101, {**flat[0][1], "n_with_grad": 0, "n_in_optimizer": 0})]
    broken += [(s, {**v, "n_with_grad": 0, "n_in_optimizer": 0}) for s, v in flat[1:8]]
    assert [(f.rule, f.step) for s, v in broken for f in resumed.update(s, v)] == [("loss-flat", 101)]

    probes = SCENARIOS["frozen-probes"]
    predictions = PredictionsMonitor()
    predictions.start_known = False
    assert [f for s, v in probes for f in predictions.update(s, v)] == []

    step0 = Step0Monitor(vocab_size=1000)
    step0.start_known = False
    assert step0.update(101, {"loss": 12.0}) == []  # no measured ratio: chance alone says nothing
    scaled = Step0Monitor(vocab_size=1000)
    scaled.start_known = False
    scaled.update(101, {"step0": {"loss": 2.0}})
    found = scaled.update(101, {"loss": 12.0})  # 6x the model's own loss on the same batch: still a bug
    assert [(f.rule, f.evidence["cause"]) for f in found] == [("init-loss-off-chance", "trainer-loss")]


def test_lr_zero_at_the_first_step_of_a_resumed_run_is_confirmed_by_the_next():
    """A linear schedule that ended at 0 (max_steps=20) resumed with max_steps=40 steps its first step with
    the 0 the checkpoint left in the optimizer; the next step has the new schedule's LR."""
    monitor = UpdateMonitor.from_setup(SETUP)
    monitor.first_step = 21
    records = [(s, v) for s, v in step_records(40, lr=(21, lambda s, v: 0.0 if s == 21 else 1e-3))][20:]
    assert [f for s, v in records for f in monitor.update(s, v)] == []
    monitor = UpdateMonitor.from_setup(SETUP)
    monitor.first_step = 21
    zero = step_records(40, lr=(21, 0.0))[20:]
    found = [f for s, v in zero for f in monitor.update(s, v) if f.rule == "lr-zero"]
    assert [(f.step, f.evidence["confirmed_step"]) for f in found] == [(21, 22)]


def test_an_unknown_warmup_is_read_from_the_lr_itself():
    """A warmup the arguments do not tell (a scheduler passed in): while the LR rises, a flat loss and tiny
    updates are the warmup; after it they are judged."""
    rising = step_records(120, lr=(1, lambda s, v: 1e-3 * min(1.0, s / 60)), update_ratio=(1, 1e-8))
    rising = [(s, {**v, "loss": 6.0 + 0.001 * (s % 4)}) for s, v in rising]
    unknown = UpdateMonitor(warmup_steps=None, vocab_size=1000)
    found = [f for s, v in rising for f in unknown.update(s, v)]
    assert {f.rule for f in found} == {"loss-flat", "lr-too-low"}
    assert min(f.step for f in found) > 60  # nothing judged during the warmup
    told_none = UpdateMonitor(warmup_steps=0, vocab_size=1000)  # what the old reading took an unknown for
    assert min(f.step for s, v in rising for f in told_none.update(s, v)) <= 20


def test_warmup_steps_are_read_as_trainer_builds_its_schedule():
    from transformers import TrainingArguments

    def args(**kw):
        return TrainingArguments(output_dir="/tmp/unused", report_to=[], use_cpu=True, **kw)

    assert warmup_steps(None, args(warmup_steps=7), 100) == (7, None)
    assert warmup_steps(None, args(warmup_steps=0.1), 200) == (20, None)  # v5: below 1 is a ratio
    assert warmup_steps(None, SimpleNamespace(warmup_steps=0, warmup_ratio=0.05), 200) == (10, None)  # v4
    steps, why = warmup_steps(None, SimpleNamespace(), 200)
    assert steps is None and "no warmup_steps" in why
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    passed_in = SimpleNamespace(
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / 10)),
        _created_lr_scheduler=False,
    )
    steps, why = warmup_steps(passed_in, args(warmup_steps=0), 200)
    assert steps is None and "LambdaLR" in why


@pytest.mark.internal_error_expected
def test_a_state_that_cannot_be_made_never_fails_the_checkpoint(monkeypatch):
    """Trainer asks for the state inside its checkpoint save: a broken state is an internal-error finding and
    a checkpoint without it (the resumed run then starts afresh), never an exception in the user's save."""
    callback = watch()
    callback.sampler = SimpleNamespace()  # a run under way
    monkeypatch.setattr(callback.monitors, "state", lambda: 1 / 0)
    exported = json.loads(json.dumps(callback.state()))
    assert exported["attributes"] == {"saved_state": None} and exported["args"]["check_every"] == 5
    assert [f.evidence["check"] for f in callback.report.by_rule("internal-error")] == ["checkpoint-state"]


# -- real Trainer runs -----------------------------------------------------------------------------------
FIRST_STEPS, PLANTED_AT = 20, 25
# A linear decay to 0 at step 20, resumed with more steps: the run (lr-zero at step 21 before).
SCHEDULE = dict(learning_rate=5e-4, lr_scheduler_type="linear", save_strategy="steps", save_steps=FIRST_STEPS)


def watch(**kwargs) -> SanityCallback:
    return SanityCallback(use_config=False, print_findings=False, **{"check_every": 5, **kwargs})


class NanAfterResume(Trainer):
    """compute_loss returns NaN at step PLANTED_AT (the model's outputs are finite: unsafe math)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * math.nan if self.state.global_step + 1 == PLANTED_AT else loss


class DetachedFrom15(Trainer):
    """The loss leaves the graph from step 15 on: no parameter gets a gradient (loss-flat, cause no-grad)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss.detach().requires_grad_() if self.state.global_step + 1 >= 15 else loss


class ZeroLR(TrainerCallback):
    """The resumed part trains at LR 0 (code that zeroes the param groups' LR at every step)."""

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        for group in optimizer.param_groups:
            group["lr"] = 0.0


def first_run(folder, *, with_sanity: bool, cls=None, loss_on: str = "completion"):
    """20 steps, a checkpoint at step 20; returns the callback (None without one)."""
    model, tok = tt.setup()
    callback = watch() if with_sanity else None
    trainer = tt.trainer(
        folder, callbacks=[callback] if callback else [], model=model, tok=tok, cls=cls,
        data=tt.rows(tok, loss_on=loss_on), max_steps=FIRST_STEPS, **SCHEDULE,
    )  # fmt: skip
    trainer.train()
    assert (folder / f"checkpoint-{FIRST_STEPS}" / "trainer_state.json").is_file()
    return callback


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Output folders after 20 steps: with hf-sanity's state in the checkpoint, and written without it."""
    root = tmp_path_factory.mktemp("first-runs")
    first_run(root / "with", with_sanity=True)
    first_run(root / "without", with_sanity=False)
    return root


def resume(
    source, tmp_path, *, max_steps=35, callbacks=(), cls=None, loss_on="completion", args=None, **kwargs
):
    """A fresh Trainer and a fresh SanityCallback (``kwargs``) on a copy of ``source``, resumed from its
    checkpoint (``args``: TrainingArguments overrides)."""
    folder = tmp_path / "out"
    shutil.copytree(source, folder)
    callback = watch(**kwargs)
    model, tok = tt.setup()
    trainer = tt.trainer(
        folder, callbacks=[callback, *callbacks], model=model, tok=tok, cls=cls,
        data=tt.rows(tok, loss_on=loss_on), max_steps=max_steps, **SCHEDULE, **(args or {}),
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=True)
    return trainer, callback


def above_info(callback) -> list[str]:
    return [f"{f.rule}@{f.step}: {f.message}" for f in callback.report.findings if f.severity != "info"]


# The step detectors an SFT run builds (the preference and RL monitors are for their own objectives).
STEP_DETECTORS = {
    d.name for r in catalog.load().values() if r.applies_to("sft") for d in r.detectors if d.kind == "step"
}


@pytest.mark.clean("lr-zero", "init-loss-off-chance", "loss-flat", "predictions-frozen", "internal-error")
@pytest.mark.parametrize("saved", ["with", "without"])
def test_a_clean_resumed_run_is_silent_and_its_monitors_go_on(checkpoints, tmp_path, saved):
    trainer, cb = resume(checkpoints / saved, tmp_path, max_steps=40, abort_on="error", probe_every=5)
    assert above_info(cb) == []
    assert trainer.state.global_step == 40 and trainer.state.hf_sanity_aborted_at_step is None
    stats = json.loads((tmp_path / "out" / "hf-sanity" / "report.json").read_text())["stats"]
    assert stats["resumed_from_step"] == FIRST_STEPS and stats["steps"] == 40
    assert (
        stats["resumed_state"] == "restored"
        if saved == "with"
        else stats["resumed_state"].startswith("not restored: the checkpoint holds no hf-sanity state")
    )
    assert sorted(STEP_DETECTORS - cb.monitors.ran) == ["hf_sanity.rules.training.ranks.RankMonitor"]
    update = next(m for m in cb.monitors.monitors if isinstance(m, UpdateMonitor))
    first = 1 if saved == "with" else FIRST_STEPS + 1  # the windows go on from step 1, or start at the resume
    assert update._losses[0][0] == first and update._losses[-1][0] == 40
    assert update.start_known is (saved == "with")
    # The next checkpoint is written and holds this run's state (a checkpoint without one made Trainer's save
    # raise KeyError: it looks each stateful callback up by name in the state it loaded).
    state = json.loads((tmp_path / "out" / "checkpoint-40" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["SanityCallback"]["attributes"]["saved_state"]["step"] == 40


@pytest.mark.planted("lr-zero")
@pytest.mark.parametrize("saved", ["with", "without"])
def test_lr_zero_in_the_resumed_part_is_caught_at_its_first_step(checkpoints, tmp_path, saved):
    trainer, cb = resume(checkpoints / saved, tmp_path, callbacks=[ZeroLR()], abort_on="error")
    found = cb.report.by_rule("lr-zero")
    assert [(f.step, f.severity) for f in found] == [(FIRST_STEPS + 1, "error")]
    assert trainer.state.hf_sanity_aborted_at_step == 25  # the first read after it (check_every=5)


@pytest.mark.planted("nonfinite-loss")
@pytest.mark.parametrize("saved", ["with", "without"])
def test_a_nan_after_the_resume_is_caught_at_its_step(checkpoints, tmp_path, saved):
    trainer, cb = resume(checkpoints / saved, tmp_path, cls=NanAfterResume, abort_on="error")
    finding = cb.report.by_rule("nonfinite-loss")[0]
    assert (finding.step, finding.evidence["cause"]) == (PLANTED_AT, "unsafe-math")
    assert trainer.state.hf_sanity_aborted_at_step == PLANTED_AT


@pytest.mark.planted("loss-flat")
def test_a_bug_that_spans_the_checkpoint_is_dated_from_before_it(tmp_path):
    """The loss leaves the graph at step 15; the checkpoint is at 20. The saved state holds the gradient path
    measured at steps 15 and 20 (after the first 10, every check), so the resumed run names step 15 as the first
    once the cause has held on 5 measurements (23); without the state it could only date it from the resume."""
    first_run(tmp_path / "first", with_sanity=True, cls=DetachedFrom15)
    _, cb = resume(tmp_path / "first", tmp_path, cls=DetachedFrom15, max_steps=30)
    finding = cb.report.by_rule("loss-flat")[0]
    assert (finding.step, finding.evidence["cause"], finding.evidence["confirmed_step"]) == (
        15,
        "no-grad",
        23,
    )


def test_findings_before_the_checkpoint_stay_in_the_report_once(tmp_path):
    """The loss on the prompts (every token supervised) is found on the first batch, before the checkpoint;
    the resumed run keeps that finding (step 1) and does not report it again on its own first batch."""
    before = first_run(tmp_path / "first", with_sanity=True, loss_on="all")
    assert [f.step for f in before.report.by_rule("prompt-in-loss")] == [1]
    trainer, cb = resume(tmp_path / "first", tmp_path, loss_on="all")
    assert [f.step for f in cb.report.by_rule("prompt-in-loss")] == [1]
    logged = [h for h in trainer.state.log_history if h.get("step", 0) > FIRST_STEPS and "loss" in h]
    assert logged and all(h["hf_sanity/prompt-in-loss"] == 1 for h in logged)


def test_trainer_rebuilding_the_callback_hands_the_run_back_to_the_users_instance(checkpoints, tmp_path):
    """With restore_callback_states_from_checkpoint=True Trainer replaces the callback passed to it by one of
    the same class name rebuilt from the checkpoint; the instance the user holds must still be the one that
    watches the run (its report, its settings)."""
    trainer, cb = resume(
        checkpoints / "with", tmp_path, cls=NanAfterResume, abort_on="error",
        args={"restore_callback_states_from_checkpoint": True},
    )  # fmt: skip
    assert [c for c in trainer.callback_handler.callbacks if isinstance(c, SanityCallback)] == [cb]
    assert [f.step for f in cb.report.by_rule("nonfinite-loss")] == [PLANTED_AT]
    assert cb.report.stats["resumed_state"] == "restored"
