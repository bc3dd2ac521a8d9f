"""Whether the weights move, and why not: `loss-flat`, `lr-zero`, `lr-too-low`; and the gradient path
checked once at train begin: `no-trainable-params`, `optimizer-missing-params`.

Fed per step: ``lr`` (the largest learning rate of the optimizer's groups at that step), ``n_trainable``
(parameters that require grad), ``n_with_grad`` (of those, how many received a gradient),
``n_in_optimizer`` (of those with a gradient, how many the optimizer steps), ``loss`` and, on steps where it
was measured, ``update_ratio`` (median |Δw|/|w| of a few sampled tensors) and ``updated`` (whether any sampled
weight changed at all).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.curves import Trend
from hf_sanity.measure.objective import ANY
from hf_sanity.numbers import fmt, median, noise
from hf_sanity.rules.model import NO_TRAINABLE_PARAMS
from hf_sanity.rules.training.base import Monitor, TrainingSetup

# Flat, with the gradient path intact: 30+ step losses after warmup, the last of them at the start level ...
ONLINE_FLAT_STEPS = 30
STARTING_LEVEL = 0.05  # ... (their median within 5% of the first steps' median) ...
FLAT_SE = 3.0  # ... and a trend since warmup that, even 3 standard errors towards falling ...
FLAT_RATE = 5e-5  # ... falls by less than 0.5% of the level per 100 steps (a slow start falls faster) ...
FLAT_RATE_STILL = 1e-4  # ... (1% per 100 steps where the updates are below 1e-4 of the weights)
FLAT_LOW_RATIO = 1e-4  # updates below 1e-4 of the weights per step (under the healthy band): LR too low
HEALTHY_RATIO = 1e-3  # updates of 1e-3 and more per step (well inside it): the loss is not learnable ...
NOT_LEARNABLE_LEVEL = 0.5  # ... when it sits at half of chance ln(V) or above (low: data already known)
# The curve form (doctor): the medians of the first points and of each third lie within 2% of each other ...
FLAT_REL = 0.02
FLAT_SWING = 0.10  # ... and the typical step-to-step swing is under 10% of the level
FLAT_MIN_POINTS = 10

LOSS_FLAT = define(
    "loss-flat",
    severity="error",
    stage="training",
    symptom="The loss does not move from step 0: nothing is being learned.",
    detects="During training, whatever the cause, with `evidence.cause` measured: a broken gradient path on 5 "
    "consecutive steps (no-grad: parameters that require grad receive none; not-in-optimizer; lr-zero; "
    "frozen; no-update: the optimizer step changes nothing); or, with the path intact, a step loss that does not "
    f"fall: after {ONLINE_FLAT_STEPS}+ steps past warmup its recent median is within {STARTING_LEVEL:.0%} of the "
    "first steps' and the least-squares trend of every loss since warmup, moved "
    f"{FLAT_SE:g} standard errors towards falling (from the loss's own step-to-step noise), still falls by less "
    f"than {100 * FLAT_RATE:.1%} of its level per 100 steps ({100 * FLAT_RATE_STILL:.0%} where the updates are "
    "below 1e-4 of the weights): a slow, steady start is not flat, and a loss too noisy to tell waits for more "
    "steps. Named lr-too-low (most updates since warmup below 1e-4 of the weights per step; healthy AdamW moves "
    "them 1e-4..1e-2), loss-not-learnable (most updates of 1e-3 and more, yet the loss sits at "
    f"{NOT_LEARNABLE_LEVEL:g} of chance ln(V) or above: the loss or the targets cannot be "
    "learned as computed), lr-too-low-or-not-learnable (in between) or diverged (the loss blew up first and "
    "the network died there; when loss-diverged reports that, this is not reported). "
    "In `doctor`, a logged loss curve that stays flat by the same trend test and its thirds' medians within "
    f"{FLAT_REL:.0%} (compared with ln(V) where the vocabulary is known).",
    fix="Follow evidence.cause: fix the gradient path it names (keep the loss attached to the graph, build the "
    "optimizer over the trainable parameters, set a non-zero LR, unfreeze/attach the adapter, call "
    "optimizer.step()); raise the LR (lr-too-low); check the loss function and the targets, then run "
    "`hf-sanity overfit` (loss-not-learnable); lower the LR (diverged).",
    explained_by=("loss-diverged",),
)

LR_ZERO = define(
    "lr-zero",
    severity="error",
    stage="training",
    objectives=ANY,
    symptom="Training runs but the model never changes (or stops changing early).",
    detects="The learning rate is 0 at a training step: warmup or decay misconfigured, or the schedule decayed "
    "to 0 early. At the first step a process trains (step 1, or the first after a resume) it is confirmed by the "
    "next step: a warmup starts at 0, and a schedule that ended at 0 leaves its 0 for the first step of a run "
    "resumed with more steps.",
    fix="Check learning_rate, warmup_steps/ratio and the scheduler's num_training_steps (max_steps vs epochs).",
)

LR_TOO_LOW = define(
    "lr-too-low",
    severity="warning",
    stage="training",
    symptom="Fine-tune produces base-model-quality output: weights barely move.",
    detects="The update-to-weight ratio (|Δw|/|w| per step) stays orders of magnitude below ~1e-3 for many steps.",
    fix="Raise the learning rate (LoRA typically 1e-4..3e-4, full fine-tune 1e-5..5e-5) or run the LR range test "
    "(`hf-sanity diagnose`).",
)

OPTIMIZER_MISSING_PARAMS = define(
    "optimizer-missing-params",
    severity="error",
    stage="training",
    objectives=ANY,
    symptom="Part of the model (often the adapter or new embeddings) never trains.",
    detects="Parameters that require grad but are in no optimizer param group.",
    fix="Build the optimizer after the model is final (after get_peft_model/resize), over all trainable parameters.",
)

FLAT_STEPS = 5  # a cause measured on 5 consecutive steps makes the loss flat
LOW_RATIO = (
    1e-6  # |Δw|/|w| three orders of magnitude below the healthy ~1e-3 (DPO-style 5e-7 LRs stay above) ...
)
LOW_MEASURES = 8  # ... on 8 consecutive measurements after warmup
LOSS_FELL = 0.02  # ... unless the loss fell 2% over those steps (then something does learn)
CONSTANT_REL = 1e-7  # losses equal to 1e-7 relative are the same number


def flat_causes(values: Mapping[str, Any]) -> dict[str, bool]:
    """For each cause that was measured in ``values``: does it hold at this step (the weights cannot move)?"""
    held: dict[str, bool] = {}
    if "n_trainable" in values:
        held["frozen"] = values["n_trainable"] == 0
    if "n_with_grad" in values:
        held["no-grad"] = values.get("n_trainable") != 0 and values["n_with_grad"] == 0
    if "n_in_optimizer" in values:
        held["not-in-optimizer"] = bool(values.get("n_with_grad")) and values["n_in_optimizer"] == 0
    if values.get("lr") is not None:
        held["lr-zero"] = values["lr"] == 0
    if values.get("updated") is not None:
        held["no-update"] = values["updated"] is False
    return held


CAUSES = ("frozen", "no-grad", "not-in-optimizer", "lr-zero", "no-update")  # most specific first

CAUSE_TEXT = {
    "frozen": "no parameter requires grad",
    "no-grad": "no trainable parameter receives a gradient (the loss is detached from the graph, or backward "
    "was not called)",
    "not-in-optimizer": "the parameters that receive gradients are in no optimizer param group",
    "lr-zero": "the learning rate is 0",
    "no-update": "the optimizer step leaves every sampled weight unchanged",
    "unknown": "the loss is the same number at every step",
    "lr-too-low": "the gradient path is intact but the updates move the weights imperceptibly",
    "loss-not-learnable": "gradients and updates are healthy, yet the loss does not move",
    "lr-too-low-or-not-learnable": "the weights move, at the low end of healthy, and the loss does not follow",
    "diverged": "the loss blew up first and the network died there",
}
FIX_BY_CAUSE = {
    "lr-too-low": "Raise the learning rate (LoRA typically 1e-4..3e-4, full fine-tune 1e-5..5e-5), or run the LR "
    "range test (`hf-sanity diagnose`).",
    "loss-not-learnable": "The weights move but the loss cannot follow: check the loss function (e.g. "
    "cross_entropy applied to probabilities instead of logits: a double softmax) and that the targets follow "
    "from the inputs; `hf-sanity overfit` tells whether a handful of examples can be learned at all.",
    "diverged": "The divergence killed the network (saturated activations, zero gradients) at the step in "
    "evidence.diverged_at_step: lower the learning rate or lengthen warmup and keep gradient clipping on.",
    "lr-too-low-or-not-learnable": "Run `hf-sanity overfit` on a few examples: if they can be memorised at a "
    "higher LR, raise the learning rate; if not, check the loss function (a double softmax) and the targets.",
}


def flat(losses: Sequence[float]) -> bool:
    """A loss that does not move (the curve form of loss-flat; doctor's detector uses the same test)."""
    from hf_sanity.measure.curves import is_flat

    return is_flat([float(v) for v in losses], rel=FLAT_REL, swing=FLAT_SWING, min_points=FLAT_MIN_POINTS)


def falling(slope: float, error: float, level: float, rate: float = FLAT_RATE) -> bool:
    """The loss may still be falling by ``rate`` of its ``level`` per step: its fitted ``slope`` (per step),
    moved ``FLAT_SE`` standard errors (``error``, from the loss's own step-to-step noise) towards falling, is
    below ``-rate x |level|``. Only a loss whose trend is known to be near zero (or rising) is flat; a slow,
    steady start is not, and neither is a loss too noisy to tell yet."""
    return not math.isfinite(slope) or slope - FLAT_SE * error <= -rate * abs(level)


def slope_error(values: Sequence[float], spread: float) -> float:
    """The standard error of a fitted slope: the robust step-to-step noise of ``values`` (see
    :func:`hf_sanity.numbers.noise`) over the root of the steps' spread."""
    return noise(values) / math.sqrt(spread) if spread > 0 else math.inf


@monitor
class UpdateMonitor(Monitor):
    rules = (LOSS_FLAT, LR_ZERO, LR_TOO_LOW)
    reads = (
        "loss",
        "loss_finite",
        "lr",
        "update_ratio",
        "updated",
        "n_trainable",
        "n_with_grad",
        "n_in_optimizer",
    )

    def __init__(
        self,
        *,
        warmup_steps: int | None = 0,
        flat_steps: int = FLAT_STEPS,
        low_measures: int = LOW_MEASURES,
        vocab_size: int | None = None,
    ):
        super().__init__()
        self.warmup_steps = warmup_steps
        self.vocab_size = vocab_size
        self._ratios: list[tuple[int, float]] = []
        self.flat_steps = flat_steps
        self.low_measures = low_measures
        self._nonfinite_steps: set[int] = set()
        self._runs: dict[str, list[int]] = {}  # cause -> consecutive steps where it held
        self._losses: list[tuple[int, float]] = []  # (step, loss), in step order
        self._blowup: int | None = None  # the first step whose loss stood above the divergence threshold
        self._threshold: float | None = None  # ... set once the starting steps are in
        self._low: list[tuple[int, float, float]] = []  # (step, ratio, lr) of consecutive low measurements
        self._lr_zero_from: int | None = None  # the first step of the current run of steps at LR 0
        self._lr: float | None = None  # the last LR seen ...
        self._lr_rose_at: int | None = (
            None  # ... and the last step it rose: warmup, when its length is unknown
        )
        self._trend = Trend()  # the finite losses after warmup, fitted as they arrive
        # Update ratios after warmup: how many were measured, below FLAT_LOW_RATIO, below HEALTHY_RATIO.
        self._ratio_counts = [0, 0, 0]

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> UpdateMonitor:
        return cls(warmup_steps=setup.warmup_steps, vocab_size=setup.vocab_size)

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        out: list[Finding] = []
        lr = values.get("lr")
        if lr is not None:
            out += self._lr_zero(step, float(lr))
        out += self._flat(step, values)
        out += self._too_low(step, values)
        return out

    def _lr_zero(self, step: int, lr: float) -> list[Finding]:
        """LR 0 at a step. At the first step this process trains (step 1, or the first after a resume) it is
        judged with the next step: a warmup starts at 0, and a schedule that ended at 0 leaves its 0 in the
        optimizer for the first step of a run resumed with more steps; both move on."""
        if self._lr is not None and lr > self._lr:  # still warming up: what was fitted so far says nothing
            self._lr_rose_at, self._low = step, []
            if self.warmup_steps is None:
                self._trend, self._ratio_counts = Trend(), [0, 0, 0]
        self._lr = lr
        if lr != 0:
            self._lr_zero_from = None
            return []
        if self._lr_zero_from is None:
            self._lr_zero_from = step
        if step == self.first_step:
            return []
        first = self._lr_zero_from
        when = {None: "", 0: " (no warmup is configured)"}.get(self.warmup_steps, " (after warmup)")
        return self.fire(
            LR_ZERO,
            f"the learning rate is 0 at step {first}{when}"
            + (f" (steps {first}-{step})" if step > first else ""),
            step=first,
            evidence={
                "lr": lr,
                "warmup_steps": self.warmup_steps,
                "first_step": first,
                "confirmed_step": step,
            },
        )

    def _after_warmup(self, step: int) -> bool:
        """``step`` is past the warmup: its known length, or, unknown, the last step the LR rose."""
        if self.warmup_steps is not None:
            return step > self.warmup_steps
        return self._lr_rose_at is None or step > self._lr_rose_at

    def _flat(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        if LOSS_FLAT.slug in self.fired:
            return []  # it fires once: nothing left to keep (the per-step work must not grow with the run)
        loss = values.get("loss")
        if loss is not None and math.isfinite(loss):
            self._losses.append((step, float(loss)))
            self._watch_blowup(step, float(loss))
            if self._after_warmup(step):
                self._trend.add(step, float(loss))
        ratio = values.get("update_ratio")
        if ratio is not None and math.isfinite(ratio):
            self._ratios.append((step, float(ratio)))
            if self._after_warmup(step):
                counts = self._ratio_counts
                counts[0] += 1
                counts[1] += ratio < FLAT_LOW_RATIO
                counts[2] += ratio < HEALTHY_RATIO
        if values.get("loss_finite") is False:
            self._nonfinite_steps.add(step)
        if step in self._nonfinite_steps:
            return []  # a NaN/Inf step is nonfinite-loss's; whether the weights moved then says nothing more
        for cause, holds in flat_causes(values).items():
            run = self._runs.setdefault(cause, [])
            if not holds:
                run.clear()
            elif not run or run[-1] != step:
                run.append(step)
        for cause in CAUSES:
            run = self._runs.get(cause, [])
            if len(run) >= self.flat_steps and not self._fell(run[0], step):
                return self._fire_flat(run[0], step, cause)
        return self._constant_loss(step) or self._flat_curve(step)

    def _fell(self, first: int, last: int) -> bool:
        """The loss fell clearly over these steps (something else is learning: not a flat loss)."""
        losses = [v for s, v in self._since(self._losses, first) if s <= last]
        if len(losses) < 4:
            return False
        head, tail = median(losses[:2]), median(losses[-2:])
        return head > 0 and (head - tail) / head > LOSS_FELL

    def _constant_loss(self, step: int) -> list[Finding]:
        recent = [v for _, v in self._losses[-self.flat_steps * 2 :]]
        if len(recent) < self.flat_steps * 2:
            return []
        scale = max(abs(recent[0]), 1e-12)
        if max(recent) - min(recent) > CONSTANT_REL * scale:
            return []
        return self._fire_flat(self._losses[-len(recent)][0], step, "unknown")

    def _flat_curve(self, step: int) -> list[Finding]:
        """The gradient path is intact but the loss stays where it started (or where a divergence left it)."""
        if not self.start_known:
            return []  # resumed without a saved state: where the loss started is not known
        trend = self._trend  # every finite loss after warmup, as running sums
        window = self._losses[-ONLINE_FLAT_STEPS:]  # the last of them (the losses come in step order)
        if trend.n < ONLINE_FLAT_STEPS or trend.origin is None:
            return []
        values = [v for _, v in window]
        if self._diverged_before(window[0][0]) is not None:
            return self._fire_flat(window[0][0], step, "diverged") if flat(values) else []
        start = median([v for _, v in self._losses[:3]])
        level = median(values)
        if abs(level - start) > STARTING_LEVEL * abs(start):
            return []  # it learned, or levelled off after learning: not a loss that never moved
        measured, low, below_healthy = self._ratio_counts
        if not measured:
            return []
        still = 2 * low > measured  # most updates since warmup were below FLAT_LOW_RATIO (their median is)
        slope, error = trend.slope, slope_error(values, trend.spread)
        if falling(slope, error, level, FLAT_RATE_STILL if still else FLAT_RATE):
            return []  # a slow, steady start (or too noisy to tell yet): not a flat loss
        first = trend.origin
        ratio = median([r for _, r in self._since(self._ratios, first)])
        fitted = {"change_per_100_steps": 100 * slope / abs(level) if level else None, "slope_error": error}
        if still:
            return self._fire_flat(first, step, "lr-too-low", update_ratio=ratio, **fitted)
        chance = math.log(self.vocab_size) if self.vocab_size and self.vocab_size > 1 else None
        if chance is None or level < NOT_LEARNABLE_LEVEL * chance:
            return []  # flat, low and moving weights: data the model already knows
        cause = "lr-too-low-or-not-learnable" if 2 * below_healthy > measured else "loss-not-learnable"
        return self._fire_flat(first, step, cause, update_ratio=ratio, chance=chance, **fitted)

    def _watch_blowup(self, step: int, loss: float) -> None:
        """Keep the first step whose loss stood above the divergence threshold (set from the starting steps'
        median once they are in), as the losses arrive: no pass over the whole history at each step."""
        from hf_sanity.rules.training.divergence import START_POINTS, diverge_threshold

        if self._blowup is not None or len(self._losses) <= START_POINTS:
            return
        if self._threshold is None:
            start = median([v for _, v in self._losses[:START_POINTS]])
            self._threshold = diverge_threshold(start, self.vocab_size)
            self._blowup = next((s for s, v in self._losses if v > self._threshold), None)
        elif loss > self._threshold:
            self._blowup = step

    def _diverged_before(self, first: int) -> int | None:
        """The step where the loss blew up before ``first`` (None when it did not)."""
        return self._blowup if self._blowup is not None and self._blowup < first else None

    @staticmethod
    def _since(points: list[tuple[int, float]], first: int) -> list[tuple[int, float]]:
        """The (step, value) points from step ``first`` on (points come in step order)."""
        return points[bisect_left(points, first, key=_STEP) :]

    def _fire_flat(self, first: int, step: int, cause: str, **measured) -> list[Finding]:
        diverged = self._diverged_before(first) if cause != "diverged" else None
        then = None
        if diverged is not None:  # a dead network after a blow-up: the blow-up is the cause
            cause, then = "diverged", cause
        losses = [v for s, v in self._since(self._losses, first) if s <= step]
        text = CAUSE_TEXT[cause]
        if cause == "diverged":
            at = diverged if diverged is not None else self._diverged_before(first)
            text = f"the loss blew up at step {at} and the network died there" + (
                f" ({CAUSE_TEXT[then]})" if then else ""
            )
            measured["diverged_at_step"] = at
        change = measured.get("change_per_100_steps")
        trend = f"; fitted trend {change:+.2%} of the loss per 100 steps" if change is not None else ""
        return self.fire(
            LOSS_FLAT,
            f"nothing is being learned from step {first}: {text} (steps {first}-{step}{trend})",
            step=first,
            evidence={
                "cause": cause,
                "first_step": first,
                "confirmed_step": step,
                "first_loss": losses[0] if losses else None,
                "last_loss": losses[-1] if losses else None,
                **({"measured_cause": then} if then else {}),
                **measured,
            },
            fix=FIX_BY_CAUSE.get(cause),
        )

    def _too_low(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        ratio, lr = values.get("update_ratio"), values.get("lr")
        if ratio is None or not math.isfinite(ratio) or not self._after_warmup(step):
            return []
        if ratio <= 0 or (lr is not None and lr == 0):
            return []  # no update at all is loss-flat (no-update / lr-zero), not a small one
        if ratio >= LOW_RATIO:
            self._low = []
            return []
        self._low.append((step, float(ratio), lr if lr is not None else math.nan))
        if len(self._low) < self.low_measures:
            return []
        ratios = [r for _, r, _ in self._low]
        first = self._low[0][0]
        level = median(ratios)
        return self.fire(
            LR_TOO_LOW,
            f"the weights barely move: update/weight ratio {fmt(level)} per step (healthy is ~1e-3) over "
            f"{len(ratios)} measurements from step {first}, at lr={fmt(self._low[-1][2])}",
            step=first,
            evidence={
                "update_ratio": level,
                "measurements": len(ratios),
                "lr": self._low[-1][2],
                "threshold": LOW_RATIO,
                "steps": [s for s, _, _ in self._low],
            },
        )


_STEP = itemgetter(0)


def setup_findings(
    *, total_params: int, trainable: Sequence[str], in_optimizer: Sequence[str] | set[str] | None
) -> list[Finding]:
    """The gradient path at train begin: something trains, and the optimizer steps all of it.

    ``trainable``: names of the parameters that require grad; ``in_optimizer``: those of them found in an
    optimizer param group (None when there is no optimizer to look at).
    """
    out: list[Finding] = []
    if total_params and not trainable:
        out.append(
            NO_TRAINABLE_PARAMS.finding(
                f"none of the model's {total_params:,} parameters requires grad",
                evidence={"parameters": total_params, "trainable": 0},
                step=0,
            )
        )
        return out
    if in_optimizer is None:
        return out
    inside = set(in_optimizer)
    missing = [name for name in trainable if name not in inside]
    if missing:
        out.append(
            OPTIMIZER_MISSING_PARAMS.finding(
                f"{len(missing)} of {len(trainable)} trainable parameters are in no optimizer param group "
                f"(first: {missing[0]})",
                evidence={"missing": len(missing), "trainable": len(trainable), "names": missing[:10]},
                step=0,
            )
        )
    return out


@monitor
class SetupMonitor(Monitor):
    """The gradient path at train begin, fed once: ``total_params``, ``trainable`` (names of the parameters
    that require grad) and ``in_optimizer`` (those of them in an optimizer param group; None when there is no
    optimizer to look at, or a sharded one)."""

    rules = (NO_TRAINABLE_PARAMS, OPTIMIZER_MISSING_PARAMS)
    reads = ("trainable", "total_params", "in_optimizer")

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        if "trainable" not in values:
            return []
        found = setup_findings(
            total_params=values["total_params"],
            trainable=values["trainable"],
            in_optimizer=values.get("in_optimizer"),
        )
        found = [f for f in found if f.rule not in self.fired]
        self.fired.update(f.rule for f in found)
        return found
