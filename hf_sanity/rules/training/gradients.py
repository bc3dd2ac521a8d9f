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
    "there is no warmup, and the fix starts there. With clipping on, a first explosion is judged at the next "
    "step: back under the bar there, the clip bounded one batch's update and the run recovered, so it is `info` "
    "(cause kept, `recovered: true`); one the next step does not recover from, a second one (`explosions`, "
    "`explosion_steps`), or any with clipping off is a warning. A first explosion at the very last step is not "
    "judged.",
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
TRANSIENT_FIX = (
    "Nothing to change for one batch whose update the clip bounded; if it recurs, inspect the saved batch "
    "(evidence.batch_file) and the learning rate."
)


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
        self.explosions: list[int] = []  # the steps whose norm exploded
        self._pending: dict[str, Any] | None = (
            None  # a first explosion under clipping, judged at the next step
        )
        self._severity = ""  # of the grad-explosion finding reported so far

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
        """A norm far above the running median. With clipping on, the first one is judged a step later: back
        under the bar at once, it was one batch the clip bounded (info); still up, or a second one, a warning."""
        out: list[Finding] = []
        pending, self._pending = self._pending, None
        history = self.norms[-EXPLOSION_HISTORY:]
        base = median(history) if len(history) >= EXPLOSION_MIN_HISTORY else 0.0
        exploded = base > 0 and norm > self.explosion_factor * base
        if pending is not None:
            # The step after the first explosion: its norm against the median from before that explosion.
            recovered = not exploded and norm <= self.explosion_factor * pending["running_median"]
            self.explosions.append(pending["step"])
            out += self._report(pending, recovered=recovered)
            if recovered:
                return out
        if not exploded:
            return out
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
        if self.safeguards.get("clipping_off") is False and not self.explosions:
            self._pending = {"step": step, **evidence}  # counted once judged
            return out
        self.explosions.append(step)
        return out + self._report({"step": step, **evidence}, recovered=None)

    def _report(self, explosion: dict[str, Any], *, recovered: bool | None) -> list[Finding]:
        """A grad-explosion finding: info for one the clip bounded and the next step recovered from, else a
        warning (a rule fires once, but an info can be followed by a warning when the explosions repeat)."""
        evidence = dict(explosion)
        step = evidence.pop("step")
        norm, base = evidence["grad_norm"], evidence["running_median"]
        repeated = len(self.explosions) > 1
        transient = recovered is True and not repeated
        severity = "info" if transient else "warning"
        if GRAD_EXPLOSION.slug in self.fired and (severity == "info" or self._severity == "warning"):
            return []
        self.fired.add(GRAD_EXPLOSION.slug)
        self._severity = severity
        evidence.update(
            recovered=recovered, explosions=len(self.explosions), explosion_steps=self.explosions[-10:]
        )
        what = (
            f"the gradient norm is {fmt(norm)} at step {step}, {norm / base:.0f}x its running median {fmt(base)} "
            f"(cause: {evidence['cause']}: {evidence['why']})"
        )
        if transient:
            what += (
                f"; gradient clipping (max_grad_norm={evidence['max_grad_norm']:g}) bounded that update and the "
                "next step's norm is back down: one batch, recovered"
            )
            fix = TRANSIENT_FIX
        else:
            if repeated:
                listed = ", ".join(map(str, self.explosions[-10:]))
                what += f"; {len(self.explosions)} explosions in the run so far (steps {listed})"
            elif recovered is False:
                what += "; the next step's norm is still far up"
            fix = guarded_fix(FIX_BY_CAUSE[evidence["cause"]], evidence)
        return [GRAD_EXPLOSION.finding(what, step=step, fix=fix, evidence=evidence, severity=severity)]

    @property
    def done(self) -> bool:
        # An info grad-explosion still watches: a second explosion makes it a warning.
        return super().done and self._severity != "info"

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
