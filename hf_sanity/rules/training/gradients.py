"""The gradient of every optimizer step: `nonfinite-grad`, `grad-explosion`, `stale-gradients`.

Fed per step: ``grad_norm`` (pre-clip norm of all gradients), ``loss_finite`` (every micro-batch loss of
the step was finite), ``stale_norm`` (norm of the gradients already present when the step began: 0 or
absent when they were cleared) and ``scaler`` (a GradScaler is in use: it skips steps with inf gradients
on purpose while it calibrates).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import ANY
from hf_sanity.numbers import fmt, median
from hf_sanity.rules.training.base import Monitor, TrainingSetup
from hf_sanity.rules.training.divergence import FIX_BY_CAUSE, blowup_cause, guarded_fix, safeguards

NONFINITE_GRAD = define(
    "nonfinite-grad",
    severity="error",
    stage="training",
    objectives=ANY,
    symptom="Weights turn NaN a step later; the loss curve ends abruptly.",
    detects="The gradient norm before the optimizer step is NaN/Inf while the loss is finite.",
    fix="Lower the learning rate, enable gradient clipping (max_grad_norm), or use bf16/fp32 instead of fp16.",
)

GRAD_EXPLOSION = define(
    "grad-explosion",
    severity="warning",
    stage="training",
    objectives=ANY,
    symptom="Loss spikes or diverges after a period of normal training.",
    detects="The gradient norm is far above its running median (x10 by default); names the batch that preceded it. "
    "`evidence.cause` (as for loss-diverged): warmup-ended, lr-too-high (an update/weight ratio far above "
    "healthy, or the LR still rising), bad-batch (that step's loss stands far above the steps before; the batch "
    "is saved) or unknown. The evidence says whether gradient clipping is off (max_grad_norm 0) and whether "
    "there is no warmup, and the fix starts there.",
    fix="Turn gradient clipping back on (max_grad_norm=1.0) if it is off; then follow evidence.cause: lower the "
    "learning rate or lengthen warmup (warmup-ended, lr-too-high), inspect and filter the saved batch (bad-batch).",
)

STALE_GRADIENTS = define(
    "stale-gradients",
    severity="error",
    stage="training",
    objectives=ANY,
    symptom="Loss diverges after a few steps; the gradient norm grows step after step.",
    detects="Gradients are present before the first backward of an optimizer step (not cleared) and the norm "
    "grows steadily.",
    fix="Call optimizer.zero_grad() (or model.zero_grad()) after every optimizer step.",
)

EXPLOSION_FACTOR = 10.0  # a grad norm 10x the running median ...
EXPLOSION_HISTORY = 50  # ... of the last 50 finite norms ...
EXPLOSION_MIN_HISTORY = 5  # ... once there are 5 of them
SCALER_PATIENCE = 10  # with a GradScaler, inf gradients on 10 consecutive steps are no longer calibration
STALE_STEPS = 3  # gradients present at the start of 3 consecutive steps ...
STALE_GROWTH = 1.2  # ... while the norm grew 20% over them


@monitor
class GradientMonitor(Monitor):
    rules = (NONFINITE_GRAD, GRAD_EXPLOSION, STALE_GRADIENTS)
    reads = ("grad_norm", "stale_norm", "loss_finite", "scaler", "update_ratio", "lr", "loss")

    def __init__(
        self,
        *,
        explosion_factor: float = EXPLOSION_FACTOR,
        warmup_steps: int = 0,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__()
        self.explosion_factor = explosion_factor
        self.warmup_steps = warmup_steps
        self.safeguards = safeguards(max_grad_norm, warmup_steps)
        self.history: dict[str, list[tuple[int, float]]] = {"update_ratio": [], "lr": [], "loss": []}
        self.norms: list[float] = []  # finite norms
        self._nonfinite_run = 0
        self._stale: list[
            tuple[int, float]
        ] = []  # (step, grad norm) of consecutive steps that began with stale grads
        self._pending_stale: dict[int, float] = {}

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> GradientMonitor:
        return cls(warmup_steps=setup.warmup_steps, max_grad_norm=setup.max_grad_norm)

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        out: list[Finding] = []
        for key in ("update_ratio", "lr", "loss"):  # what names the cause of an explosion
            value = values.get(key)
            if value is not None and math.isfinite(value):
                self.history[key].append((step, float(value)))
        if values.get("stale_norm") is not None:
            self._pending_stale[step] = float(values["stale_norm"])
        norm = values.get("grad_norm")
        if norm is None:
            return out
        norm = float(norm)
        if not math.isfinite(norm):
            out += self._nonfinite(step, norm, values)
        else:
            self._nonfinite_run = 0
            out += self._explosion(step, norm)
            self.norms.append(norm)
        out += self._stale_check(step, norm)
        return out

    def _nonfinite(self, step: int, norm: float, values: Mapping[str, Any]) -> list[Finding]:
        if values.get("loss_finite") is False:
            return []  # a non-finite loss explains it: nonfinite-loss reports that step
        self._nonfinite_run += 1
        if values.get("scaler") and self._nonfinite_run < SCALER_PATIENCE:
            return []
        first = step - self._nonfinite_run + 1
        return self.fire(
            NONFINITE_GRAD,
            f"the gradient norm is {norm} at step {first} while the loss is finite",
            step=first,
            evidence={
                "grad_norm": norm,
                "consecutive_steps": self._nonfinite_run,
                "last_finite_norm": self.norms[-1] if self.norms else None,
                "grad_scaler": bool(values.get("scaler")),
            },
        )

    def _explosion(self, step: int, norm: float) -> list[Finding]:
        history = self.norms[-EXPLOSION_HISTORY:]
        if len(history) < EXPLOSION_MIN_HISTORY:
            return []
        base = median(history)
        if base <= 0 or norm <= self.explosion_factor * base:
            return []
        cause, why = blowup_cause(
            step,
            warmup_steps=self.warmup_steps,
            ratios=self.history["update_ratio"],
            lrs=self.history["lr"],
            losses=self.history["loss"],
        )
        evidence = {
            "cause": cause,
            "why": why,
            "grad_norm": norm,
            "running_median": base,
            "ratio": norm / base,
            "history": len(history),
            **self.safeguards,
        }
        return self.fire(
            GRAD_EXPLOSION,
            f"the gradient norm is {fmt(norm)} at step {step}, {norm / base:.0f}x its running median {fmt(base)} "
            f"(cause: {cause}: {why})",
            step=step,
            fix=guarded_fix(FIX_BY_CAUSE[cause], evidence),
            evidence=evidence,
        )

    def _stale_check(self, step: int, norm: float) -> list[Finding]:
        stale = self._pending_stale.pop(step, None)
        if stale is None or stale <= 0 or not math.isfinite(norm):
            self._stale = [] if stale is not None else self._stale
            return []
        self._stale.append((step, norm))
        if len(self._stale) < STALE_STEPS:
            return []
        norms = [n for _, n in self._stale]
        rising = sum(b > a for a, b in itertools.pairwise(norms))
        if norms[-1] < STALE_GROWTH * norms[0] or rising < len(norms) // 2:
            return []
        first = self._stale[0][0]
        return self.fire(
            STALE_GRADIENTS,
            f"gradients were not cleared before step {first}: they are still present when each of the "
            f"{len(norms)} steps {first}-{step} begins, and the norm grew from {fmt(norms[0])} to {fmt(norms[-1])}",
            step=first,
            evidence={"first_step": first, "steps": len(norms), "grad_norms": norms, "stale_norm": stale},
        )
