"""A loss that blows up without going NaN: `loss-diverged`; and the cause of a blow-up, shared with
`grad-explosion`.

:class:`DivergenceMonitor` is fed per step ``loss``, ``lr``, ``grad_norm`` and, on measured steps,
``update_ratio`` (|Δw|/|w| of a few sampled tensors). :func:`blowup_cause` names why a step blew up from what
was measured before it: the end of warmup, an update/weight ratio far above healthy (or an LR still rising),
or one batch that carried it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import NOT_RL
from hf_sanity.numbers import fmt, median
from hf_sanity.rules.training.base import Monitor, TrainingSetup

# The starting level: the lowest of the first 3 step losses (a blow-up at step 2 must not raise its own bar;
# chance ln(V) is a floor of the threshold, so a low pick cannot make noise look like divergence).
START_POINTS = 3
DIVERGE_FACTOR = 2.0  # diverged: above 2x the start ...
DIVERGE_MARGIN = 1.0  # ... and 1 nat above it ...
# ... and above chance, ln(V), when the vocabulary is known: worse than a uniform guess is confidently wrong
DIVERGE_STEPS = 3  # ... at 3 consecutive steps
HEALTHY_RATIO = 1e-2  # healthy AdamW updates move weights by ~1e-4..1e-2 of their norm per step
WARMUP_WINDOW = 10  # a blow-up within 10 steps after warmup ends follows the end of warmup
BAD_BATCH_FACTOR = (
    3.0  # one batch carries it: its loss is 3x the median of the steps before, which were healthy
)
DEAD_STEPS = 3  # a blow-up that kills the network: on the 3 steps after it the gradient norm is exactly 0 ...
DEAD_REL = 1e-6  # ... or, where no gradient norm is measured, the loss repeats to 1e-6 (float32 rounding)

CAUSES = ("warmup-ended", "lr-too-high", "bad-batch", "unknown")
FIX_BY_CAUSE = {
    "warmup-ended": "The blow-up follows the end of warmup, when the LR reaches its peak: lower the peak learning "
    "rate or lengthen the warmup (warmup_ratio / warmup_steps); keep gradient clipping on (max_grad_norm).",
    "lr-too-high": "Each update moves the weights far more than healthy training does (update/weight ratio above "
    "1e-2 per step): lower the learning rate (by 10x as a start; `hf-sanity diagnose` runs an LR range test) and "
    "keep gradient clipping on (max_grad_norm).",
    "bad-batch": "One batch carried the blow-up (its loss stands far above the steps before it): inspect the saved "
    "batch (evidence.batch_file) for broken rows (huge or garbled inputs, wrong labels) and filter them out.",
    "unknown": "Nothing measured names the cause: check the learning rate and its schedule, keep gradient clipping "
    "on, and inspect the batch at that step.",
}


def safeguards(max_grad_norm: float | None, warmup_steps: int | None) -> dict[str, Any]:
    """What the run had against a blow-up, for the evidence: gradient clipping (off at max_grad_norm 0 or
    None) and warmup (none at 0 steps). Empty where the trainer's arguments were not seen (nothing is claimed)."""
    out: dict[str, Any] = {}
    if max_grad_norm is not None:
        out.update(max_grad_norm=max_grad_norm, clipping_off=not max_grad_norm > 0)
    if max_grad_norm is not None and warmup_steps is not None:
        out.update(warmup_steps=warmup_steps, no_warmup=warmup_steps == 0)
    return out


def guarded_fix(fix: str, evidence: Mapping[str, Any]) -> str:
    """``fix``, led by what the run turned off: clipping first (one bad step then moves the weights without
    bound), then warmup where the learning rate is the cause."""
    first = []
    if evidence.get("clipping_off"):
        first.append("turn gradient clipping back on (max_grad_norm=1.0): it is off")
    if evidence.get("no_warmup") and evidence.get("cause") in ("lr-too-high", "unknown", None):
        first.append("add a warmup (warmup_steps=0.05: the first 5% of the steps): there is none")
    return f"First {' and '.join(first)}. Then: {fix}" if first else fix


LOSS_DIVERGED = define(
    "loss-diverged",
    severity="error",
    stage="training",
    objectives=NOT_RL,
    symptom="The loss climbs far above where it started and stays there: training diverged (without a NaN).",
    detects=f"The step loss stays above {DIVERGE_FACTOR:g}x its starting level (the lowest of the first "
    f"{START_POINTS} steps), {DIVERGE_MARGIN:g} nat above it and above chance ln(V) for {DIVERGE_STEPS} "
    f"consecutive steps; or it blows up above that and the network dies there (a gradient norm of exactly 0, "
    f"or without one the same loss to {DEAD_REL:g}, on the {DEAD_STEPS} steps after). `evidence.cause`: "
    "warmup-ended (within "
    f"{WARMUP_WINDOW} steps after warmup ends), lr-too-high (an update/weight ratio above {HEALTHY_RATIO:g} per "
    "step, or the LR still rising), bad-batch (the first diverged step's loss stands far above the healthy steps "
    "before it; the batch is saved), or unknown. The evidence says whether gradient clipping is off "
    "(max_grad_norm 0) and whether there is no warmup, and the fix starts there. In doctor, the same on a "
    "logged curve.",
    fix="Turn gradient clipping back on (max_grad_norm=1.0) if it is off; then follow evidence.cause: lower the "
    "peak learning rate or lengthen warmup (warmup-ended, lr-too-high), drop the broken rows of the saved batch "
    "(bad-batch).",
)


def diverge_threshold(start: float, vocab_size: int | None) -> float:
    chance = math.log(vocab_size) if vocab_size and vocab_size > 1 else 0.0
    return max(DIVERGE_FACTOR * start, start + DIVERGE_MARGIN, chance)


def blowup_cause(
    step: int,
    *,
    warmup_steps: int,
    ratios: Sequence[tuple[int, float]],
    lrs: Sequence[tuple[int, float]],
    losses: Sequence[tuple[int, float]],
) -> tuple[str, str]:
    """(cause, why) of a blow-up at ``step``, from what was measured at and before it: ``ratios`` (step,
    update/weight ratio), ``lrs`` (step, learning rate) and ``losses`` (step, finite loss)."""
    if warmup_steps and warmup_steps < step <= warmup_steps + WARMUP_WINDOW:
        return (
            "warmup-ended",
            f"it starts {step - warmup_steps} steps after warmup ended (step {warmup_steps})",
        )
    recent = [r for s, r in ratios if s <= step][-5:]
    if recent and max(recent) > HEALTHY_RATIO:
        return "lr-too-high", (
            f"updates moved the weights by {fmt(max(recent))} of their norm in a step (healthy: below "
            f"{HEALTHY_RATIO:g})"
        )
    rates = [lr for s, lr in lrs if s <= step][-3:]
    if len(rates) >= 2 and rates[-1] > rates[0] * 1.01:
        return "lr-too-high", f"the learning rate was still rising ({fmt(rates[0])} -> {fmt(rates[-1])})"
    before = [v for s, v in losses if s < step][-10:]
    here = next((v for s, v in losses if s == step), None)
    if here is not None and len(before) >= 3 and here > BAD_BATCH_FACTOR * median(before):
        return (
            "bad-batch",
            f"its loss {fmt(here)} stands {here / median(before):.0f}x above the steps before it",
        )
    return "unknown", "no measured cause"


@monitor
class DivergenceMonitor(Monitor):
    rules = (LOSS_DIVERGED,)
    reads = ("loss", "update_ratio", "lr", "grad_norm")

    def __init__(
        self, *, warmup_steps: int = 0, vocab_size: int | None = None, max_grad_norm: float | None = None
    ) -> None:
        super().__init__()
        self.warmup_steps = warmup_steps
        self.vocab_size = vocab_size
        self.safeguards = safeguards(max_grad_norm, warmup_steps)
        self.losses: list[tuple[int, float]] = []
        self.ratios: list[tuple[int, float]] = []
        self.lrs: list[tuple[int, float]] = []
        self.norms: dict[int, float] = {}
        self._above: list[int] = []  # consecutive steps above the threshold
        self._blowup: int | None = None  # the last step above it, while the steps after it look dead
        self._dead: list[tuple[int, float]] = []  # (step, loss) of the dead-looking steps after that blow-up

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> DivergenceMonitor:
        return cls(
            warmup_steps=setup.warmup_steps, vocab_size=setup.vocab_size, max_grad_norm=setup.max_grad_norm
        )

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        if values.get("update_ratio") is not None and math.isfinite(values["update_ratio"]):
            self.ratios.append((step, float(values["update_ratio"])))
        if values.get("lr") is not None:
            self.lrs.append((step, float(values["lr"])))
        if values.get("grad_norm") is not None:
            self.norms[step] = float(values["grad_norm"])
        loss = values.get("loss")
        if loss is None or not math.isfinite(loss):
            return []
        self.losses.append((step, float(loss)))
        if len(self.losses) <= START_POINTS:
            return []
        start = min(v for _, v in self.losses[:START_POINTS])
        threshold = diverge_threshold(start, self.vocab_size)
        if len(self.losses) == START_POINTS + 1:  # a blow-up inside the starting steps counts from its step
            for s, v in self.losses[:START_POINTS]:
                self._track(s, v, threshold)
        return self._track(step, float(loss), threshold, start=start)

    def _track(
        self, step: int, loss: float, threshold: float, *, start: float | None = None
    ) -> list[Finding]:
        """Follow one step: a run of steps above the threshold, or a blow-up followed by a dead network."""
        if loss > threshold:
            self._above.append(step)
            self._blowup, self._dead = step, []
            if len(self._above) >= DIVERGE_STEPS and start is not None:
                return self._fire(self._above[0], start, threshold)
            return []
        self._above = []
        if self._blowup is None:
            return []
        grad = self.norms.get(step)
        if grad is not None:
            dead = grad == 0
        else:
            dead = not self._dead or abs(loss - self._dead[0][1]) <= DEAD_REL * abs(loss)
        self._dead = [*self._dead, (step, loss)] if dead else []
        if not dead:
            self._blowup = None  # it came back to life: a spike, not a divergence
            return []
        if len(self._dead) < DEAD_STEPS or start is None:
            return []
        return self._fire(self._blowup, start, threshold, dead_from=self._dead[0][0])

    def _fire(
        self, first: int, start: float, threshold: float, *, dead_from: int | None = None
    ) -> list[Finding]:
        cause, why = blowup_cause(
            first, warmup_steps=self.warmup_steps, ratios=self.ratios, lrs=self.lrs, losses=self.losses
        )
        here = next(v for s, v in self.losses if s == first)
        peak = max(v for s, v in self.losses if s >= first)
        lr = next((v for s, v in reversed(self.lrs) if s <= first), None)
        evidence = {
            "cause": cause,
            "why": why,
            "start_loss": start,
            "loss": here,
            "peak_loss": peak,
            "threshold": threshold,
            "lr": lr,
            "update_ratio": max((r for s, r in self.ratios if s <= first), default=None),
            "grad_norm": self.norms.get(first),
            "chance_ln_vocab": math.log(self.vocab_size) if self.vocab_size else None,
            **({"dead_from_step": dead_from} if dead_from is not None else {}),
            **self.safeguards,
        }
        if dead_from is None:
            what = f"the loss diverged at step {first}: {fmt(here)} and up to {fmt(peak)}"
        else:
            then = (
                "the gradient norm is 0" if self.norms.get(dead_from) == 0 else "the loss no longer changes"
            )
            what = (
                f"the loss blew up at step {first} to {fmt(here)} and the network died there ({then} from step "
                f"{dead_from} on)"
            )
        return self.fire(
            LOSS_DIVERGED,
            f"{what}, from {fmt(start)} at the start (cause: {cause}: {why})",
            step=first,
            evidence=evidence,
            fix=guarded_fix(FIX_BY_CAUSE[cause], evidence),
        )


@LOSS_DIVERGED.detector("curve")  # online, the monitor sees every step
def loss_diverged(curves) -> list[Finding]:
    """The same test on a logged curve: the logged loss stays far above where it started."""
    from hf_sanity.measure.curves import train_points

    steps, loss, lr = train_points(curves)
    if len(loss) <= START_POINTS + DIVERGE_STEPS:
        return []
    start = float(min(loss[:START_POINTS]))
    threshold = diverge_threshold(start, curves.vocab_size)
    above = 0
    for i in range(START_POINTS, len(loss)):
        above = above + 1 if loss[i] > threshold else 0
        if above < DIVERGE_STEPS:
            continue
        first = i - DIVERGE_STEPS + 1
        pairs = [(int(s), float(v)) for s, v in zip(steps, loss)]
        rates = [(int(s), float(r)) for s, r in zip(steps, lr) if math.isfinite(r)]
        cause, why = blowup_cause(int(steps[first]), warmup_steps=0, ratios=[], lrs=rates, losses=pairs)
        return [
            LOSS_DIVERGED.finding(
                f"the logged loss diverged at step {int(steps[first])}: {fmt(float(loss[first]))} and up to "
                f"{fmt(float(loss[first:].max()))}, from {fmt(start)} at the start (cause: {cause}: {why})",
                evidence={
                    "cause": cause,
                    "why": why,
                    "start_loss": start,
                    "loss": float(loss[first]),
                    "peak_loss": float(loss[first:].max()),
                    "threshold": threshold,
                },
                step=int(steps[first]),
                fix=FIX_BY_CAUSE[cause],
            )
        ]
    return []
