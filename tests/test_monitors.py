"""The monitors behind SanityCallback, driven with plain numbers: each rule fires on its pattern at the step
where it first appears, and stays silent on healthy series."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hf_sanity.rules.training import loss as nonfinite
from hf_sanity.rules.training import shapes as first_batch
from hf_sanity.rules.training import updates
from hf_sanity.rules.training.gradients import GradientMonitor
from hf_sanity.rules.training.loss import LossMonitor
from hf_sanity.rules.training.memory import MemoryMonitor
from hf_sanity.rules.training.mode import TrainModeMonitor
from hf_sanity.rules.training.predictions import PredictionsMonitor
from hf_sanity.rules.training.ranks import RankMonitor
from hf_sanity.rules.training.updates import UpdateMonitor
from hf_sanity.training import memory, replay
from hf_sanity.training.recorder import EarlyFlags, Recorder
from hf_sanity.untouched import untouched

NAN = math.nan


def feed(monitor, records) -> list:
    """``records``: (step, values) pairs; every finding, in order. A monitor fed by hand, outside SanityCallback's
    MonitorSet (which notes what it feeds), watched every one of its rules: noted for the clean markers."""
    from hf_sanity import catalog

    found = [f for step, values in records for f in monitor.update(step, values)]
    catalog.note_ran(rule.slug for rule in monitor.rules)
    return found


def healthy_losses(n=80, start=6.9, end=1.0, seed=0):
    rng = random.Random(seed)
    return [end + (start - end) * math.exp(-i / 15) + rng.uniform(-0.1, 0.1) for i in range(n)]


# -- loss ---------------------------------------------------------------------------------------------
def test_nonfinite_loss_fires_once_at_the_first_nonfinite_step_with_its_cause():
    records = [(s, {"loss": 5.0 - 0.1 * s, "grad_norm": 1.0}) for s in range(1, 5)]
    records += [(5, {"loss": NAN, "losses": [2.0, NAN], "nonfinite": {"input_nonfinite": ["pixel_values"]}})]
    records += [(6, {"loss": NAN, "nonfinite": {}})]
    found = feed(LossMonitor(), records)
    assert [(f.rule, f.step) for f in found] == [("nonfinite-loss", 5)]
    assert found[0].evidence["cause"] == "input" and found[0].evidence["micro_batch"] == 1


def test_healthy_losses_are_silent():
    records = [
        (s, {"loss": v, "grad_norm": 1.0, "label_entropy": 3.0}) for s, v in enumerate(healthy_losses(), 1)
    ]
    assert feed(LossMonitor(), records) == []


def test_negative_loss():
    found = feed(
        LossMonitor(), [(1, {"loss": 0.5}), (2, {"loss": 0.2, "losses": [0.3, -0.1]}), (3, {"loss": -1.0})]
    )
    assert [(f.rule, f.step) for f in found] == [("negative-loss", 2)]


def test_plateau_at_the_label_prior():
    prior = 3.0
    losses = [prior + 3.9 * math.exp(-i / 4) + 0.02 * math.sin(i) for i in range(80)]
    records = [(s, {"loss": v, "label_entropy": prior}) for s, v in enumerate(losses, 1)]
    found = feed(LossMonitor(), records)
    assert [f.rule for f in found] == ["loss-plateau-prior"]
    first_near = next(s for s, v in enumerate(losses, 1) if abs(v - prior) <= 0.05 * prior)
    assert found[0].step == first_near and found[0].evidence["label_entropy"] == prior


def test_a_loss_that_passes_the_prior_on_its_way_down_is_not_a_plateau():
    prior = 3.0
    losses = [6.9 - 0.06 * i for i in range(90)]  # crosses 3.0 around step 65 and keeps going
    assert (
        feed(LossMonitor(), [(s, {"loss": v, "label_entropy": prior}) for s, v in enumerate(losses, 1)]) == []
    )


@pytest.mark.parametrize(
    ("facts", "grads", "losses", "cause"),
    [
        ({"input_nonfinite": ["inputs_embeds"], "supervised_tokens": 0}, [], [], "input"),
        ({"supervised_tokens": 0, "logits_finite": True}, [], [], "empty-loss-mask"),
        ({"logits_finite": True}, [1.0, 1.1, 0.9, 60.0], [3.0, 2.9], "lr-too-high"),
        ({"logits_finite": True}, [1.0, NAN], [3.0, 2.9], "lr-too-high"),
        ({"logits_finite": False}, [1.0], [3.0, 2.9, 80.0], "lr-too-high"),
        ({"nonfinite_weights": ["lm_head.weight"]}, [1.0], [3.0], "lr-too-high"),
        ({"logits_finite": True, "supervised_tokens": 12}, [1.0, 1.2, 0.9], [3.0, 2.9], "unsafe-math"),
        (
            {"logits_finite": False, "half_precision": True, "fp32_finite": True},
            [1.0],
            [3.0],
            "precision-overflow",
        ),
        ({"logits_finite": False, "half_precision": True, "fp32_finite": False}, [1.0], [3.0], "unknown"),
        ({"logits_finite": False, "half_precision": False}, [1.0], [3.0], "unknown"),
    ],
)
def test_nonfinite_causes(facts, grads, losses, cause):
    assert nonfinite.classify(facts, grad_norms=grads, losses=losses)[0] == cause


# -- gradients ---------------------------------------------------------------------------------------------
def test_grad_explosion_at_the_spike():
    norms = [1.0 + 0.1 * math.sin(s) for s in range(1, 12)] + [40.0, 1.0]
    found = feed(
        GradientMonitor(), [(s, {"grad_norm": n, "loss_finite": True}) for s, n in enumerate(norms, 1)]
    )
    assert [(f.rule, f.step) for f in found] == [("grad-explosion", 12)]
    assert found[0].evidence["ratio"] > 30


def _norms(spikes: dict[int, float], n: int = 40) -> list[tuple[int, dict]]:
    return [
        (s, {"grad_norm": spikes.get(s, 1.0 + 0.1 * math.sin(s)), "loss_finite": True})
        for s in range(1, n + 1)
    ]


@pytest.mark.clean("grad-explosion")
def test_one_late_explosion_the_clip_bounded_and_the_run_recovered_from_is_info():
    """The LoRA recipe's case: clipping on, one late batch with a 40x norm, the next step back to normal."""
    found = feed(GradientMonitor(max_grad_norm=1.0, warmup_steps=2), _norms({30: 40.0}))
    (explosion,) = found
    assert (explosion.rule, explosion.step, explosion.severity) == ("grad-explosion", 30, "info")
    assert explosion.evidence["recovered"] is True and explosion.evidence["explosions"] == 1
    assert explosion.evidence["ratio"] > 30 and explosion.evidence["clipping_off"] is False
    assert "bounded that update" in explosion.message and explosion.fix.startswith("Nothing to change")


@pytest.mark.planted("grad-explosion")
def test_an_explosion_the_next_step_does_not_recover_from_is_a_warning():
    found = feed(GradientMonitor(max_grad_norm=1.0, warmup_steps=2), _norms({30: 40.0, 31: 35.0}))
    (explosion,) = found
    assert (explosion.step, explosion.severity, explosion.evidence["recovered"]) == (30, "warning", False)
    assert "still far up" in explosion.message


@pytest.mark.planted("grad-explosion")
def test_repeated_explosions_under_clipping_are_a_warning():
    monitor = GradientMonitor(max_grad_norm=1.0, warmup_steps=2)
    found = feed(monitor, _norms({12: 40.0, 25: 50.0, 33: 45.0}))
    assert [(f.step, f.severity) for f in found] == [(12, "info"), (25, "warning")]
    assert found[1].evidence["explosions"] == 2 and found[1].evidence["explosion_steps"] == [12, 25]
    assert "2 explosions in the run so far (steps 12, 25)" in found[1].message
    assert not monitor.done or monitor._severity == "warning"


def test_an_explosion_with_clipping_off_is_a_warning_at_once():
    found = feed(GradientMonitor(max_grad_norm=0.0, warmup_steps=2), _norms({30: 40.0}, n=30))
    (explosion,) = found
    assert (explosion.step, explosion.severity) == (30, "warning") and explosion.evidence[
        "clipping_off"
    ] is True
    assert explosion.fix.startswith("First turn gradient clipping back on")


def test_noisy_healthy_grad_norms_are_silent():
    rng = random.Random(1)
    norms = [2.0 * math.exp(-s / 50) * rng.uniform(0.5, 2.0) for s in range(200)]
    records = [(s, {"grad_norm": n, "loss_finite": True, "stale_norm": 0.0}) for s, n in enumerate(norms, 1)]
    assert feed(GradientMonitor(), records) == []


def test_nonfinite_grad_only_when_the_loss_is_finite():
    records = [(1, {"grad_norm": 1.0, "loss_finite": True}), (2, {"grad_norm": NAN, "loss_finite": False})]
    assert feed(GradientMonitor(), records) == []
    found = feed(
        GradientMonitor(),
        [(1, {"grad_norm": 1.0, "loss_finite": True}), (2, {"grad_norm": math.inf, "loss_finite": True})],
    )
    assert [(f.rule, f.step) for f in found] == [("nonfinite-grad", 2)]


def test_a_grad_scaler_calibrating_is_not_nonfinite_grad_until_it_persists():
    calibrating = [(s, {"grad_norm": math.inf, "loss_finite": True, "scaler": True}) for s in range(1, 6)]
    assert feed(GradientMonitor(), calibrating + [(6, {"grad_norm": 1.0, "scaler": True})]) == []
    stuck = [(s, {"grad_norm": math.inf, "loss_finite": True, "scaler": True}) for s in range(1, 13)]
    found = feed(GradientMonitor(), stuck)
    assert [(f.rule, f.step) for f in found] == [("nonfinite-grad", 1)]


def test_stale_gradients_grow_step_after_step():
    records = [(1, {"grad_norm": 1.0, "stale_norm": 0.0})]
    records += [(s, {"grad_norm": float(s), "stale_norm": float(s - 1)}) for s in range(2, 7)]
    found = feed(GradientMonitor(), records)
    assert [(f.rule, f.step) for f in found] == [("stale-gradients", 2)]


def test_gradients_left_over_but_not_growing_are_not_stale_gradients():
    records = [(s, {"grad_norm": 1.0 + 0.01 * (s % 2), "stale_norm": 0.5}) for s in range(1, 10)]
    assert feed(GradientMonitor(), records) == []


# -- the gradient path ------------------------------------------------------------------------------------
def path(step, **values):
    base = {
        "n_trainable": 10,
        "n_with_grad": 10,
        "n_in_optimizer": 10,
        "lr": 1e-3,
        "loss": 6.9,
        "loss_finite": True,
    }
    return (step, {**base, **values})


@pytest.mark.parametrize(
    ("values", "cause"),
    [
        ({"n_trainable": 0, "n_with_grad": 0, "n_in_optimizer": 0}, "frozen"),
        ({"n_with_grad": 0, "n_in_optimizer": 0}, "no-grad"),
        ({"n_in_optimizer": 0}, "not-in-optimizer"),
        ({"lr": 0.0}, "lr-zero"),
        ({"updated": False}, "no-update"),
    ],
)
def test_loss_flat_names_the_measured_cause(values, cause):
    records = [path(1, updated=True), *[path(s, **values) for s in range(2, 8)]]
    found = [f for f in feed(UpdateMonitor(), records) if f.rule == "loss-flat"]
    assert [(f.step, f.evidence["cause"]) for f in found] == [(2, cause)]


def test_a_constant_loss_with_no_other_cause_is_loss_flat_unknown():
    found = feed(UpdateMonitor(), [path(s, loss=2.5, updated=True) for s in range(1, 12)])
    assert [(f.rule, f.step, f.evidence["cause"]) for f in found] == [("loss-flat", 1, "unknown")]


def test_no_loss_flat_when_the_loss_falls_or_the_run_is_healthy():
    falling = [
        path(s, n_trainable=0, n_with_grad=0, n_in_optimizer=0, loss=7 - 0.2 * s) for s in range(1, 10)
    ]
    assert [
        f for f in feed(UpdateMonitor(), falling) if f.rule == "loss-flat"
    ] == []  # an outside parameter learns
    healthy = [path(s, loss=v, updated=True, update_ratio=1e-3) for s, v in enumerate(healthy_losses(), 1)]
    assert feed(UpdateMonitor(), healthy) == []


def losses_with_updates(losses, ratio, *, first=1):
    """(step, values) records as the callback feeds them: the update ratio at the first 10 steps, then every 10th."""
    return [(s, {"loss": v, "loss_finite": True, "lr": 1e-4, **({"update_ratio": ratio} if s <= 10 or s % 10 == 0
             else {})}) for s, v in enumerate(losses, first)]  # fmt: skip


def slow_start(kind: str, seed: int, n: int = 150) -> tuple[list[float], float]:
    """(losses, update ratio) of slow, steady starts measured in real tiny-model runs (rate, noise and update
    ratio as measured there): LoRA r=8 on q/v at lr 5e-3 (6.9 -> 6.6 in 40 steps, noise 0.02, updates 1e-2);
    transformers' defaults from scratch, LR 1e-4 with V=4096 (8.34 -> 8.32 over the first 30 steps, then on to
    8.25 by step 100, noise 0.008, updates 1e-3); a full fine-tune at 1e-5 of a trained model on a new answer
    style (loss 5 falling 10% per 100 steps, noise 10%, updates 5e-5: below 1e-4, yet learning)."""
    rng = random.Random(seed)
    if kind == "lora":
        return [6.6 + 0.3 * math.exp(-s / 25) - 0.0015 * s + rng.gauss(0, 0.02) for s in range(n)], 1e-2
    if kind == "scratch-defaults":
        return [8.34 - 0.09 / (1 + math.exp(-(s - 40) / 8)) + rng.gauss(0, 0.008) for s in range(n)], 1e-3
    if kind == "full-ft-1e-5":
        return [5.0 * (1 - 1e-3 * s) * (1 + rng.gauss(0, 0.1)) for s in range(n)], 5e-5
    raise ValueError(kind)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", ["lora", "scratch-defaults", "full-ft-1e-5"])
def test_a_slow_steady_start_is_not_a_flat_loss(kind, seed):
    losses, ratio = slow_start(kind, seed)
    vocab = 4096 if kind == "scratch-defaults" else 1000
    for warmup in (0, 10):
        monitor = UpdateMonitor(warmup_steps=warmup, vocab_size=vocab)
        assert [f.rule for f in feed(monitor, losses_with_updates(losses, ratio))] == [], warmup
        assert monitor._trend.n == len(losses) - warmup  # it did fit every step after warmup


def flat_at(level: float, noise: float, seed: int, *, drift: float = 0.0, n: int = 80) -> list[float]:
    rng = random.Random(seed)
    return [level + drift * s + rng.gauss(0, noise) for s in range(n)]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    ("losses", "ratio", "cause", "by_step"),
    [
        # LR 3e-7 from scratch: the loss sits at ln V with its batch noise; updates 1e-5 of the weights
        (lambda seed: flat_at(6.9, 0.025, seed), 1e-5, "lr-too-low", 75),
        # targets drawn at random every step: the loss creeps up from chance while the weights move healthily
        (lambda seed: flat_at(6.92, 0.04, seed, drift=1.5e-3), 3e-2, "loss-not-learnable", 60),
        # a double softmax at LR 3e-4: smooth, at chance, 0.1% per 100 steps
        (lambda seed: flat_at(6.908, 3e-5, seed, drift=-7e-5), 9e-3, "loss-not-learnable", 30),
        # updates at the low end of healthy, a loss that does not follow
        (lambda seed: flat_at(6.9, 0.01, seed), 3e-4, "lr-too-low-or-not-learnable", 70),
    ],
    ids=["lr-far-too-low", "random-targets", "double-softmax", "low-end-of-healthy"],
)
def test_a_flat_loss_is_still_loss_flat_with_its_cause(losses, ratio, cause, by_step, seed):
    (finding,) = feed(UpdateMonitor(vocab_size=1000), losses_with_updates(losses(seed), ratio))
    assert (finding.rule, finding.step, finding.evidence["cause"]) == ("loss-flat", 1, cause)
    assert finding.evidence["confirmed_step"] <= by_step
    assert abs(finding.evidence["change_per_100_steps"]) < 0.1  # what it measured is in the evidence


def test_lr_zero_at_the_first_step_is_confirmed_by_the_next_and_after_warmup_is_at_once():
    zero = [path(1, lr=0.0), path(2, lr=0.0)]
    assert [(f.rule, f.step) for f in feed(UpdateMonitor(), zero)] == [("lr-zero", 1)]
    assert feed(UpdateMonitor(), zero[:1]) == []  # a warmup from 0 the arguments do not tell of ...
    assert feed(UpdateMonitor(warmup_steps=None), [*zero[:1], path(2, lr=1e-4)]) == []  # ... moves on
    with_warmup = [path(1, lr=0.0), path(2, lr=1e-4), path(3, lr=2e-4)]
    assert feed(UpdateMonitor(warmup_steps=3), with_warmup) == []
    decayed = [*with_warmup, path(4, lr=0.0)]
    assert [(f.rule, f.step) for f in feed(UpdateMonitor(warmup_steps=3), decayed)] == [("lr-zero", 4)]


def test_lr_too_low_after_warmup():
    records = [path(s, update_ratio=1e-7, lr=1e-9, updated=True, loss=6.9 - 0.001 * s) for s in range(1, 20)]
    found = feed(UpdateMonitor(warmup_steps=5), records)
    assert [(f.rule, f.step) for f in found] == [("lr-too-low", 6)]
    assert found[0].evidence["measurements"] == 8


def test_setup_findings():
    none = updates.setup_findings(total_params=100, trainable=[], in_optimizer=set())
    assert [f.rule for f in none] == ["no-trainable-params"]
    missing = updates.setup_findings(
        total_params=100, trainable=["a", "b", "lora_B"], in_optimizer={"a", "b"}
    )
    assert [(f.rule, f.evidence["names"]) for f in missing] == [("optimizer-missing-params", ["lora_B"])]
    assert updates.setup_findings(total_params=100, trainable=["a"], in_optimizer={"a"}) == []


# -- mode, predictions, ranks -------------------------------------------------------------------------------
def test_train_mode_off():
    found = feed(TrainModeMonitor(), [(s, {"training": s < 7, "after_eval": 6}) for s in range(1, 10)])
    assert [(f.rule, f.step) for f in found] == [("train-mode-off", 7)]


def test_predictions_frozen_while_the_loss_moves():
    records = [
        (s, {"changed": 0.0, "loss_start": 6.9, "loss_level": 6.9 - 0.02 * s}) for s in (10, 20, 30, 40)
    ]
    found = feed(PredictionsMonitor(), records)
    assert [(f.rule, f.step) for f in found] == [("predictions-frozen", 10)]
    changing = [(s, {"changed": 0.1, "loss_start": 6.9, "loss_level": 3.0}) for s in (10, 20, 30, 40)]
    assert feed(PredictionsMonitor(), changing) == []
    still = [(s, {"changed": 0.0, "loss_start": 6.9, "loss_level": 6.88}) for s in (10, 20, 30, 40)]
    assert feed(PredictionsMonitor(), still) == []  # nothing moves at all: that is loss-flat's business
    # A run that converges: predictions change, then settle while the loss keeps falling as confidence grows.
    settled = [
        (s, {"changed": 0.3 if s <= 20 else 0.0, "loss_start": 6.9, "loss_level": 6.9 / s})
        for s in range(10, 90, 10)
    ]
    assert feed(PredictionsMonitor(), settled) == []


def test_ranks_diverged():
    same = {"checksum_max": [1.5, -2.0], "checksum_min": [1.5, -2.0], "names": ["a", "b"]}
    drifted = {"checksum_max": [1.5, -1.9], "checksum_min": [1.5, -2.0], "names": ["a", "b"]}
    found = feed(RankMonitor(world_size=2), [(10, same), (20, drifted)])
    assert [(f.rule, f.step, f.evidence["names"]) for f in found] == [("ranks-diverged", 20, ["b"])]


# -- memory -----------------------------------------------------------------------------------------------
def test_memory_growth_of_held_graphs_names_the_holder():
    records = [(s, {"graph_tensors": s, "holders": {"trainer.losses": s} if s else {}}) for s in range(0, 5)]
    found = feed(MemoryMonitor(), records)
    assert [(f.rule, f.step, f.evidence["holder"]) for f in found] == [("memory-growth", 1, "trainer.losses")]


def test_allocated_memory_growth_and_noise():
    mib = 1 << 20
    noisy = [(s, {"allocated": 100 * mib + (s % 3) * mib // 2}) for s in range(0, 40, 5)]
    assert feed(MemoryMonitor(), noisy) == []
    leak = [(s, {"allocated": 100 * mib + s * 20 * mib}) for s in range(0, 40, 5)]
    found = feed(MemoryMonitor(), leak)
    assert [(f.rule, f.step) for f in found] == [("memory-growth", 10)]  # steps <= 2 are the optimizer's
    assert found[0].evidence["per_step"] == pytest.approx(20 * mib)


def test_oom_says_whether_memory_grew_before():
    grew = MemoryMonitor()
    feed(grew, [(s, {"graph_tensors": s}) for s in range(4)])
    assert grew.update(4, {"oom": {"error": "CUDA out of memory"}})[0].evidence["growth_before"] is True
    flat = MemoryMonitor()
    feed(flat, [(s, {"graph_tensors": 0}) for s in range(4)])
    finding = flat.update(4, {"oom": {"error": "CUDA out of memory"}})[0]
    assert finding.rule == "oom" and finding.evidence["growth_before"] is False


def test_graph_tensors_are_found_where_they_are_held():
    class Holder:
        def __init__(self):
            self.kept = []
            self.fine = []

    weight = torch.ones(3, requires_grad=True)
    holder = Holder()
    for _ in range(3):
        holder.kept.append((weight * 2).sum())
        holder.fine.append((weight * 2).sum().detach())
    assert memory.graph_tensors([("trainer", holder)]) == {"trainer.kept": 3}
    assert memory.graph_tensors([("model", torch.nn.Linear(2, 2))]) == {}


# -- first batch ------------------------------------------------------------------------------------------
def test_shape_mismatch():
    ok = {"input_ids": (4, 30), "labels": (4, 30), "attention_mask": (4, 30)}
    assert first_batch.shape_findings(ok, (4, 30, 1000)) == []
    wrong = first_batch.shape_findings({**ok, "labels": (4, 31)})
    assert [(f.rule, f.step) for f in wrong] == [("shape-mismatch", 1)]
    assert [f.rule for f in first_batch.shape_findings(ok, (4, 29, 1000))] == ["shape-mismatch"]


# -- plumbing -----------------------------------------------------------------------------------------------
def test_recorder_reads_everything_in_one_transfer():
    recorder = Recorder(capacity=2)
    for step in (1, 2, 3):
        recorder.push(step, "loss", torch.tensor(float(step)))
        recorder.push(step, "lr", 0.1 * step)
    recorder.push(3, "loss", torch.tensor(7.0))  # a second micro-batch; the buffer grows on the device
    records = recorder.read()
    assert recorder.transfers == 1
    assert records == {
        1: {"loss": [1.0], "lr": [0.1]},
        2: {"loss": [2.0], "lr": [0.2]},
        3: {"loss": [3.0, 7.0], "lr": [0.30000000000000004]},
    }
    assert recorder.read() == {} and recorder.transfers == 1


def test_early_flags_on_cpu():
    flags = EarlyFlags()
    flags.mark(4, 0, torch.tensor(1.0))
    assert flags.nonfinite() is None
    flags.mark(5, 0, torch.tensor(1.0))
    flags.mark(5, 1, torch.tensor(math.nan))
    assert flags.nonfinite() == (5, 1)
    assert flags.nonfinite() is None


def test_replay_names_the_first_nonfinite_module_and_changes_nothing():
    class Blow(torch.nn.Module):
        def forward(self, x):
            return torch.where(x > 0, x * math.inf, x)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), Blow(), torch.nn.Linear(4, 2))
    model.train()
    model[3].eval()  # a module the user keeps in eval mode must stay so
    rng = torch.get_rng_state()
    with untouched(model):
        assert not model.training
        first, final_ok = replay.first_nonfinite_module(model, lambda: model(torch.ones(2, 4)))
        torch.rand(3)  # even RNG drawn inside is given back
    assert (first, final_ok) == ("2", False)
    assert model.training and model[1].training and not model[3].training
    assert torch.equal(torch.get_rng_state(), rng)


def test_nonfinite_fix_follows_the_cause():
    from hf_sanity.rules.training.loss import CAUSES, FIX_BY_CAUSE

    assert set(FIX_BY_CAUSE) == set(CAUSES) - {"unknown"}
    assert "log_softmax" in FIX_BY_CAUSE["unsafe-math"] and "bf16" in FIX_BY_CAUSE["precision-overflow"]


# -- causes of a blow-up, and a network a divergence killed ----------------------------------------------
def test_blowup_causes_from_numbers():
    from hf_sanity.rules.training.divergence import blowup_cause

    losses = [(s, 3.0 - 0.01 * s) for s in range(1, 30)]
    assert blowup_cause(12, warmup_steps=10, ratios=[], lrs=[], losses=losses)[0] == "warmup-ended"
    assert blowup_cause(20, warmup_steps=0, ratios=[(19, 0.5)], lrs=[], losses=losses)[0] == "lr-too-high"
    rising = [(s, 1e-4 * s) for s in range(15, 21)]
    assert (
        blowup_cause(20, warmup_steps=0, ratios=[(19, 1e-3)], lrs=rising, losses=losses)[0] == "lr-too-high"
    )
    spiked = [*losses[:19], (20, 40.0)]
    assert blowup_cause(20, warmup_steps=0, ratios=[(19, 1e-3)], lrs=[], losses=spiked)[0] == "bad-batch"
    assert blowup_cause(20, warmup_steps=0, ratios=[(19, 1e-3)], lrs=[], losses=losses)[0] == "unknown"


@pytest.mark.planted("loss-diverged")
def test_a_blow_up_at_the_second_step_is_divergence_from_the_first():
    """LR 50 with AdamW: the loss leaves 6.9 for 10^4 at step 2. The starting level is the lowest of the first
    steps, so the blow-up does not raise its own bar, and it is dated at step 2."""
    from hf_sanity.rules.training.divergence import DivergenceMonitor

    losses = [6.9, 1.2e4, 8.5e4, 9.1e4, 7.7e4, 8.8e4, 9.9e4, 8.1e4]
    found = feed(DivergenceMonitor(vocab_size=1000), [(s, {"loss": v}) for s, v in enumerate(losses, 1)])
    assert [(f.rule, f.step, f.evidence["start_loss"]) for f in found] == [("loss-diverged", 2, 6.9)]
    healthy = feed(
        DivergenceMonitor(vocab_size=1000), [(s, {"loss": v}) for s, v in enumerate(healthy_losses(), 1)]
    )
    assert healthy == []


def test_one_blow_up_that_kills_the_network_is_divergence_at_the_blow_up():
    """SGD at LR 1e4 without clipping: 6.93, then 1.1e6, then the dead network's ln(V) with zero gradients. The
    loss is back under the threshold at once, yet the run diverged at step 2; a blow-up the run recovers from
    (gradients flow again, the loss moves) is not divergence."""
    from hf_sanity.rules.training.divergence import DivergenceMonitor

    dead = [
        (1, {"loss": 6.93, "grad_norm": 3.15, "update_ratio": 2e-3}),
        (2, {"loss": 1.1e6, "grad_norm": 8.6e5}),
    ]
    dead += [(s, {"loss": math.log(1000), "grad_norm": 0.0}) for s in range(3, 9)]
    monitor = DivergenceMonitor(vocab_size=1000, max_grad_norm=0.0)
    (found,) = feed(monitor, dead)
    assert (found.rule, found.step, found.evidence["dead_from_step"]) == ("loss-diverged", 2, 3)
    assert found.evidence["clipping_off"] is True and found.evidence["no_warmup"] is True
    assert found.fix.startswith("First turn gradient clipping back on (max_grad_norm=1.0): it is off")
    assert "died" in found.message and "gradient norm is 0" in found.message
    # Without gradient norms, the dead network's loss repeating to float32 rounding tells the same.
    no_norms = [(s, {k: v for k, v in values.items() if k != "grad_norm"}) for s, values in dead]
    no_norms = [
        (s, {**v, "loss": v["loss"] * (1 + 1e-7 * (s % 2))}) if s > 2 else (s, v) for s, v in no_norms
    ]
    assert [
        (f.step, f.evidence["dead_from_step"]) for f in feed(DivergenceMonitor(vocab_size=1000), no_norms)
    ] == [(2, 3)]
    # One bad batch the run survives: gradients and the loss move again after it.
    recovered = [*dead[:2], *[(s, {"loss": 6.5 - 0.05 * s, "grad_norm": 2.0}) for s in range(3, 12)]]
    assert feed(DivergenceMonitor(vocab_size=1000), recovered) == []
    moving = [(s, {k: v for k, v in values.items() if k != "grad_norm"}) for s, values in recovered]
    assert feed(DivergenceMonitor(vocab_size=1000), moving) == []


@pytest.mark.parametrize(("max_grad_norm", "warmup", "first"), [(1.0, 10, "Each update"), (0.0, 10, "First turn gradient"),
                         (1.0, 0, "First add a warmup"), (None, 0, "Each update")])  # fmt: skip
def test_blow_ups_say_whether_clipping_is_off_and_warmup_absent(max_grad_norm, warmup, first):
    from hf_sanity.rules.training.divergence import DivergenceMonitor

    records = [(s, {"loss": 6.9 if s < 30 else 60.0, "update_ratio": 5e-2, "grad_norm": 1.0 if s < 30 else 900.0})
               for s in range(1, 40)]  # fmt: skip
    for monitor in (
        DivergenceMonitor(vocab_size=1000, warmup_steps=warmup, max_grad_norm=max_grad_norm),
        GradientMonitor(warmup_steps=warmup, max_grad_norm=max_grad_norm),
    ):
        (found,) = feed(monitor, records)
        assert found.evidence["cause"] == "lr-too-high" and found.fix.startswith(first), found.fix
        if max_grad_norm is None:  # the trainer's arguments were not seen: nothing is claimed about them
            assert "clipping_off" not in found.evidence and "no_warmup" not in found.evidence
        else:
            assert found.evidence["clipping_off"] is (max_grad_norm == 0)
            assert found.evidence["no_warmup"] is (warmup == 0)


def test_a_flat_loss_after_a_divergence_is_blamed_on_the_divergence_not_the_gradient_path():
    """SGD at a huge LR: the loss explodes, activations saturate, gradients become exactly 0 and the loss sits
    at chance. The optimizer then "updates nothing", but the road is the LR, not the gradient path."""
    monitor = UpdateMonitor(vocab_size=1000)
    records = [(1, {"loss": 6.9, "updated": True}), (2, {"loss": 6.8, "updated": True}),
               (3, {"loss": 6.8, "updated": True}), (4, {"loss": 900.0, "updated": True})]  # fmt: skip
    records += [(s, {"loss": math.log(1000), "updated": False, "n_trainable": 5, "n_with_grad": 5})
                for s in range(5, 15)]  # fmt: skip
    (finding,) = feed(monitor, records)
    assert finding.evidence["cause"] == "diverged" and finding.evidence["measured_cause"] == "no-update"
    assert finding.evidence["diverged_at_step"] == 4 and "lower the learning rate" in finding.fix


def test_a_run_that_learned_then_levelled_off_is_not_flat():
    losses = [6.9 * math.exp(-s / 5) + 0.5 for s in range(60)]
    monitor = UpdateMonitor(vocab_size=1000)
    assert feed(monitor, [(s, {"loss": v, "update_ratio": 1e-3}) for s, v in enumerate(losses, 1)]) == []
