"""The protocol's detectors, on numbers: which link of the gradient path is named, near zero, divergence and
precision tolerance. No model needed."""

from __future__ import annotations

import math

import pytest

from hf_sanity.protocol.lr_search import FIRST_RUNG, Search, next_rung
from hf_sanity.protocol.pipeline import data_floor
from hf_sanity.protocol.render import sparkline
from hf_sanity.rules.protocol import (
    CAPACITY_GAP,
    DataFloor,
    GradientPath,
    LRSweep,
    LRTrial,
    OverfitRun,
    PrecisionRun,
    Share,
    capacity_gap,
    check_lr_range,
    check_overfit,
    check_precision,
    divergence_index,
    gradient_path_cause,
    inconclusive,
    near_zero_threshold,
    on_pace,
    overfit_cause,
    still_falling,
)

HEALTHY = dict(
    supervised_tokens=40,
    label_positions=200,
    trainable=4,
    trainable_elements=1000,
    total_elements=1000,
    in_optimizer=4,
    loss=6.9,
    loss_requires_grad=True,
    loss_grad_fn="NllLossBackward0",
    grad_nonzero=4,
    updated=4,
)


def path(**changes) -> GradientPath:
    return GradientPath(**{**HEALTHY, **changes})


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, None),
        ({"supervised_tokens": 0, "loss": math.nan}, "labels-masked"),
        ({"supervised_tokens": 0, "trainable": 0}, "labels-masked"),  # the first broken link wins
        ({"loss_error": "ValueError: shapes"}, "loss-error"),
        ({"trainable": 0, "trainable_elements": 0, "in_optimizer": 0}, "no-trainable-params"),
        ({"in_optimizer": 0, "optimizer_frozen": 3}, "params-not-in-optimizer"),
        ({"loss_grad_fn": None}, "loss-not-connected"),
        ({"loss_requires_grad": False, "loss_grad_fn": None}, "loss-not-connected"),
        ({"grad_nonzero": 0, "grad_none": 4, "updated": None}, "loss-not-connected"),
        ({"grad_nonzero": 0, "grad_zero": 4, "updated": None}, "no-gradient"),
        ({"grad_nonzero": 0, "grad_zero": 2, "grad_none": 2, "updated": None}, "no-gradient"),
        ({"grad_nonzero": 0, "grad_nonfinite": 4, "updated": None}, "no-gradient"),
        ({"updated": 0}, "no-update"),
        ({"not_in_optimizer": ["lm_head.weight"]}, None),  # partial: only a cause when the overfit fails
    ],
)
def test_gradient_path_cause(changes, expected):
    found = gradient_path_cause(path(**changes))
    assert (found.key if found else None) == expected


def run(losses, **changes) -> OverfitRun:
    return OverfitRun(
        path=path(**changes),
        losses=losses,
        threshold=near_zero_threshold(),
        steps=300,
        lr=1e-3,
        examples=8,
        vocab_size=1000,
    )


def test_near_zero_threshold():
    """0.05 nat/token, as the protocol writes "nearly zero" (it used to be 0.1, or 5% of the step-0 loss capped
    at ln V: 0.35 for a fresh 1k vocabulary, 0.52 for 32k); above the floor the data imposes, where it does."""
    assert near_zero_threshold() == 0.05
    assert near_zero_threshold(DataFloor(nats=0.5, positions=8, prefixes=1, tokens=32)) == pytest.approx(0.55)


def test_overfit_verdicts():
    assert overfit_cause(run([6.9, 3.0, 0.04])) is None and check_overfit(run([6.9, 3.0, 0.04])) == []
    assert overfit_cause(run([6.9, 3.0, 0.2])).key == "not-converged"  # 0.2 nat/token is not near zero
    stalled = run([6.9, 5.0, 4.0], never_updated=["model.norm.weight"])
    assert (
        overfit_cause(stalled).key == "not-converged"
        and "model.norm.weight" in overfit_cause(stalled).message
    )
    partial = run([6.9, 5.0], not_in_optimizer=["lm_head.weight"], not_in_optimizer_elements=640)
    assert overfit_cause(partial).key == "params-not-in-optimizer" and "64%" in overfit_cause(partial).message
    assert overfit_cause(run([6.9, 8.0, math.inf])).key == "loss-nonfinite"
    # near zero at step 0 with no label carrying loss is not a pass (SFTTrainer's loss is 0 on such batches)
    [finding] = check_overfit(run([0.0], supervised_tokens=0))
    assert finding.evidence["cause"] == "labels-masked" and finding.severity == "error"


def test_step1_without_a_cause_is_not_yet_a_verdict():
    """The path intact and the loss finite but not near zero: steps 2 and 3 come next (inconclusive); a broken
    path, a non-finite loss or an input that does not reach the model decide at step 1."""
    assert inconclusive(run([6.9, 5.0, 3.0]))
    assert not inconclusive(run([6.9, 3.0, 0.04]))  # passed
    assert not inconclusive(run([6.9, 6.9], updated=0))  # no-update
    assert not inconclusive(run([6.9, math.nan]))
    assert not inconclusive(run([6.9, 6.9], input_ignored=True))
    blocked = run([6.9, 5.0, 3.0])
    blocked.blocked_by = ["empty-loss-mask"]
    assert not inconclusive(blocked)
    cause = overfit_cause(blocked)
    assert (
        cause.key == "not-converged"
        and "empty-loss-mask" in cause.message
        and "not searched" in cause.message
    )


def batch(rows, labels=None, **extra):
    import torch

    ids = torch.tensor(rows)
    return {"input_ids": ids, "labels": torch.tensor(labels) if labels is not None else ids.clone(), **extra}


def test_data_floor():
    """Identical prefixes followed by different targets: the entropy of those targets, per supervised token."""
    # two rows share "1 2" then go on with 3 and 4: at position 1 the targets are {3, 4}, ln 2 over 4 targets
    floor = data_floor([batch([[1, 2, 3], [1, 2, 4]], [[-100, 2, 3], [-100, 2, 4]])])
    assert floor.positions == 2 and floor.prefixes == 1 and floor.tokens == 4
    assert floor.nats == pytest.approx(2 * math.log(2) / 4)
    # after "1" the targets are 2 and 5: a floor too; rows that differ from their first token have none
    assert data_floor([batch([[1, 2, 3], [1, 5, 4]], [[-100, 2, 3], [-100, 5, 4]])]).positions == 2
    assert data_floor([batch([[1, 2, 3], [6, 5, 4]], [[-100, 2, 3], [-100, 5, 4]])]).nats == 0
    # left padding is not part of the prefix; packed rows restart it where position_ids do
    import torch

    padded = batch([[0, 1, 2, 3], [1, 2, 4, 0]], [[-100, -100, 2, 3], [-100, 2, 4, -100]],
                   attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]]))  # fmt: skip
    assert data_floor([padded]).nats == pytest.approx(2 * math.log(2) / 4)
    packed = batch([[1, 2, 3, 1, 2, 4]], [[-100, 2, 3, -100, 2, 4]],
                   position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))  # fmt: skip
    assert data_floor([packed]).nats == pytest.approx(2 * math.log(2) / 4)
    assert data_floor([{"input_ids": torch.tensor([[1, 2]])}]) is None  # no labels: not measurable


def test_capacity_is_named_only_when_every_weight_trainable_gets_there():
    share = Share(trainable=256, total=202_048, adapter="LoRA r=1 on q_proj", frozen_tensors=21)
    setup_runs = [trial(SLOW, lr=1e-2), trial(WOBBLE, lr=3e-2)]
    held_back = searched(setup_runs, share=share, relaxed=trial(FAST, lr=3e-3))
    [finding] = check_overfit(held_back)
    assert finding.evidence["cause"] == "capacity" and finding.evidence["adapter"] == "LoRA r=1 on q_proj"
    assert finding.evidence["trainable_elements"] == 256 and finding.evidence[
        "trainable_share"
    ] == pytest.approx(256 / 202_048, rel=1e-3)
    assert "256 of 202,048 weights train (0.13%: LoRA r=1 on q_proj)" in finding.message
    assert "raise the LoRA rank" in finding.fix
    # 90% of the way from the setup's best (1.5) to near zero without reaching it: still the share
    assert capacity_gap(searched(setup_runs, share=share, relaxed=trial([6.9, 0.2], lr=3e-3))) >= CAPACITY_GAP
    assert overfit_cause(searched(setup_runs, share=share, relaxed=trial([6.9, 0.2]))).key == "capacity"
    # every weight trainable gets no nearer: labels that cannot be learned, not capacity
    neither = searched(setup_runs, share=share, relaxed=trial([6.9, 1.6, 1.45]))
    cause = overfit_cause(neither)
    assert cause.key == "not-converged" and "not a matter of capacity" in cause.message
    assert overfit_cause(searched(setup_runs, share=share)).key == "not-converged"  # not checked: not claimed


# -- the overfit's LR search -----------------------------------------------------------------------
SLOW = [6.9 - 0.01 * i for i in range(100)]  # falls steadily, far too slowly to get near zero in the budget
WOBBLE = [6.9, 3.0] + [
    2.0 + 0.5 * (-1) ** i for i in range(98)
]  # fast at first, then oscillates on a plateau
FAST = [6.9 * 0.9**i for i in range(40)]


def trial(losses, lr=1e-3, window=20) -> LRTrial:
    return LRTrial(lr=lr, losses=list(losses), threshold=0.35, window=window)


def test_a_run_s_trend():
    assert still_falling(SLOW, 20) and not on_pace(SLOW, 20, 0.35)  # falls, too slowly to be worth more steps
    assert not still_falling(WOBBLE, 20) and not on_pace(WOBBLE, 20, 0.35)
    assert still_falling(FAST, 20) and on_pace(FAST, 20, 0.35)
    assert still_falling(SLOW[:30], 20) and on_pace(
        SLOW[:30], 20, 0.35
    )  # shorter than two windows: no verdict
    assert not trial(SLOW).too_high and trial(WOBBLE).too_high  # too low an LR / too high
    assert trial([6.9, 5.0, 1.0, 30.0]).too_high and trial([6.9, 5.0, math.nan]).too_high  # diverged
    assert trial(FAST).reached and not trial(SLOW).reached


def test_the_next_lr_is_higher_while_every_run_was_too_low_else_lower():
    assert next_rung({FIRST_RUNG: trial(SLOW)}) == FIRST_RUNG - 1  # a higher LR (rung k: top / sqrt(10)**k)
    assert next_rung({FIRST_RUNG: trial(WOBBLE)}) == FIRST_RUNG + 1
    assert next_rung({2: trial(SLOW), 1: trial(WOBBLE)}) == 3  # bracketed: below the lowest tried
    assert next_rung({0: trial(SLOW)}) == 1  # nothing above where the range test diverges
    search = Search(tried=[trial(WOBBLE, lr=1e-2), trial(SLOW, lr=1e-3), trial([6.9, math.inf], lr=1e-1)])
    assert search.reported().lr == 1e-2  # the lowest loss among the runs that ended finite
    search.tried.append(trial(FAST, lr=3e-3))
    assert search.reported().lr == 3e-3  # the one that reached near zero


def searched(trials, share=None, relaxed=None, **changes) -> OverfitRun:
    best = min(trials, key=lambda t: t.best)
    return OverfitRun(
        share=share,
        relaxed=relaxed,
        path=path(**changes),
        losses=best.losses,
        threshold=0.35,
        steps=100,
        lr=best.lr,
        examples=8,
        vocab_size=1000,
        lr_source="search",
        tried=trials,
        sweep_diverges_at=0.3,
    )


def test_overfit_verdicts_after_an_lr_search():
    run = searched([trial(SLOW, lr=1e-2), trial(WOBBLE, lr=3e-2), trial(SLOW, lr=3e-3)])
    [finding] = check_overfit(run)
    assert finding.evidence["cause"] == "not-converged" and finding.evidence["lr_chosen_by"] == "search"
    assert finding.evidence["lrs_tried"] == [[0.01, 5.91], [0.03, 1.5], [0.003, 5.91]]
    assert finding.evidence["lr"] == 3e-2 and finding.evidence["sweep_diverges_at"] == 0.3
    assert "3 LRs tried (3.0e-03 to 3.0e-02)" in finding.message and "cannot be memorised" in finding.fix
    assert check_overfit(searched([trial(SLOW), trial(FAST, lr=3e-3)])) == []
    nonfinite = searched([trial([6.9, math.nan], lr=1e-2), trial([6.9, 5.0, math.inf], lr=3e-3)])
    assert overfit_cause(nonfinite).key == "loss-nonfinite" and "every LR the search tried" in (
        overfit_cause(nonfinite).message
    )
    # a broken gradient path is named as before, whatever the search
    assert overfit_cause(searched([trial(SLOW)], updated=0)).key == "no-update"


def test_divergence_index():
    assert divergence_index([6.9, 6.9, 6.0, 3.0, 1.0, 0.5]) is None
    assert divergence_index([6.9, 6.0, 1.0, 5.0]) == 3  # > 4 x best and > best + 0.25 x start
    assert divergence_index([6.9, 6.0, math.nan]) == 2
    # a memorised loss wobbling from 0.01 to 0.05 (5x, but 0.04 nat) is not a divergence
    assert divergence_index([6.9, 1.0, 0.01, 0.05, 0.02]) is None


def test_lr_range_suggests_an_order_of_magnitude_below_divergence():
    lrs = [1e-4, 1e-3, 1e-2, 1e-1]
    sweep = LRSweep(lrs=lrs, losses=[6.9, 5.0, 1.0, 9.0], lr_min=1e-4, lr_max=1.0, configured_lr=2e-4)
    [finding] = check_lr_range(sweep)
    assert finding.severity == "info" and sweep.suggestion == pytest.approx(1e-2)
    assert finding.evidence["diverges_at"] == pytest.approx(1e-1)
    too_high = LRSweep(lrs=lrs, losses=[6.9, 5.0, 1.0, 9.0], lr_min=1e-4, lr_max=1.0, configured_lr=0.5)
    [warning] = check_lr_range(too_high)
    assert warning.severity == "warning" and "past where the loss diverges" in warning.message
    broken = LRSweep(lrs=[1e-7], losses=[math.nan], lr_min=1e-7, lr_max=1.0)
    assert broken.suggestion is None and check_lr_range(broken)[0].severity == "warning"


def test_precision_tolerance():
    assert check_precision(PrecisionRun(fp32=2.0, half={"bfloat16": 2.05, "float16": 2.02})) == []
    [finding] = check_precision(PrecisionRun(fp32=2.0, half={"bfloat16": 2.3}))
    assert finding.severity == "error" and finding.evidence["tolerance"] == pytest.approx(
        0.02 + 8 * 2**-8 * 2.0
    )
    [overflow] = check_precision(
        PrecisionRun(fp32=2.0, half={"float16": math.nan}, overflow={"float16": "x.mlp"})
    )
    assert "turns nan in float16" in overflow.message and "x.mlp" in overflow.message
    # a trainer configured for bf16 is told about fp16, not failed by it
    [note] = check_precision(
        PrecisionRun(fp32=2.0, half={"bfloat16": 2.0, "float16": math.inf}, used="bfloat16")
    )
    assert note.severity == "info" and note.evidence["trainer_precision"] == "bfloat16"


def test_sparkline():
    assert sparkline([3, 2, 1]) == "█▅▁"
    assert sparkline([1, math.nan, "nan"]) == "▁××"
    assert len(sparkline(list(range(500)), width=40)) == 40
