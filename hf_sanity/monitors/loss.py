"""The loss of every training step: `nonfinite-loss`, `negative-loss`, `loss-plateau-prior`.

Fed one record per optimizer step: ``loss`` (the step's loss as Trainer logs it), ``losses`` (its
micro-batches), ``grad_norm`` (the step's pre-clip gradient norm), ``label_entropy`` (the entropy of the
labels seen so far) and, for a non-finite step, ``nonfinite`` (the facts the callback measured on the
offending batch; see :func:`hf_sanity.monitors.nonfinite.classify`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hf_sanity.findings import Finding
from hf_sanity.monitors.base import Monitor, fmt, is_finite, median
from hf_sanity.monitors.nonfinite import FIX_BY_CAUSE, classify
from hf_sanity.rules.training import LOSS_PLATEAU_PRIOR, NEGATIVE_LOSS, NONFINITE_LOSS

PLATEAU_WINDOW = 30  # steps the loss must sit at the label prior ...
PLATEAU_TOLERANCE = 0.05  # ... within 5% of the label entropy ...
PLATEAU_FLAT = 0.01  # ... without the second half of the window improving by 1% of it
PLATEAU_START_ABOVE = 0.10  # and the loss started >= 10% above the prior (it came down to it)


class LossMonitor(Monitor):
    rules = (NONFINITE_LOSS, NEGATIVE_LOSS, LOSS_PLATEAU_PRIOR)

    def __init__(self, *, plateau_window: int = PLATEAU_WINDOW) -> None:
        super().__init__()
        self.plateau_window = plateau_window
        self.losses: list[tuple[int, float]] = []  # finite step losses
        self.grad_norms: list[float] = []  # every step's grad norm, finite or not, before the current step
        self.label_entropy: float | None = None
        self._near_since: int | None = None

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        out: list[Finding] = []
        if values.get("label_entropy") is not None:
            self.label_entropy = float(values["label_entropy"])
        loss = values.get("loss")
        if loss is not None:
            micro = [float(x) for x in values.get("losses") or [loss]]
            if not all(math.isfinite(x) for x in [*micro, float(loss)]):
                out += self._nonfinite(step, float(loss), micro, values.get("nonfinite") or {})
            else:
                if min(micro) < 0 or loss < 0:
                    lowest = min(min(micro), float(loss))
                    out += self.fire(
                        NEGATIVE_LOSS,
                        f"the training loss is negative ({fmt(lowest)}) at step {step}",
                        step=step,
                        evidence={"loss": lowest, "micro_batch_losses": micro},
                    )
                self.losses.append((step, float(loss)))
                out += self._plateau(step)
        if "grad_norm" in values and values["grad_norm"] is not None:
            self.grad_norms.append(float(values["grad_norm"]))
        return out

    def _nonfinite(
        self, step: int, loss: float, micro: list[float], facts: Mapping[str, Any]
    ) -> list[Finding]:
        if NONFINITE_LOSS.slug in self.fired:
            return []
        cause, why = classify(facts, grad_norms=self.grad_norms, losses=[v for _, v in self.losses])
        bad = next((i for i, x in enumerate(micro) if not math.isfinite(x)), 0)
        evidence = {
            "cause": cause,
            "why": why,
            "loss": loss,
            "micro_batch": bad,
            "module": facts.get("module"),
            "last_finite_loss": self.losses[-1][1] if self.losses else None,
            "grad_norms_before": self.grad_norms[-5:],
        }
        evidence.update({k: v for k, v in facts.items() if k not in evidence and v is not None})
        where = f" in {facts['module']}" if facts.get("module") else ""
        return self.fire(
            NONFINITE_LOSS,
            f"the loss is {loss} at step {step} (first non-finite step; cause: {cause}){where}",
            step=step,
            evidence=evidence,
            fix=FIX_BY_CAUSE.get(cause),
        )

    def _plateau(self, step: int) -> list[Finding]:
        prior = self.label_entropy
        if prior is None or prior <= 0 or LOSS_PLATEAU_PRIOR.slug in self.fired:
            return []
        loss = self.losses[-1][1]
        if abs(loss - prior) <= PLATEAU_TOLERANCE * prior:
            if self._near_since is None:
                self._near_since = step
        else:
            self._near_since = None
        w = self.plateau_window
        if len(self.losses) < 2 * w:
            return []
        window = [v for _, v in self.losses[-w:]]
        level = median(window)
        start = median([v for _, v in self.losses[:5]])
        improving = median(window[: w // 2]) - median(window[w // 2 :]) > PLATEAU_FLAT * prior
        if (
            abs(level - prior) > PLATEAU_TOLERANCE * prior
            or improving
            or start < (1 + PLATEAU_START_ABOVE) * prior
        ):
            return []
        since = self._near_since if self._near_since is not None else self.losses[-w][0]
        return self.fire(
            LOSS_PLATEAU_PRIOR,
            f"the loss sits at {fmt(level)}, the entropy of the label distribution ({fmt(prior)}), "
            f"over the last {w} steps: the model predicts the token prior only",
            step=since,
            evidence={
                "loss_level": level,
                "label_entropy": prior,
                "start_loss": start,
                "window_steps": w,
                "since_step": since,
            },
        )


def loss_level(losses: list[tuple[int, float]], last: int = 5) -> float | None:
    values = [v for _, v in losses[-last:] if is_finite(v)]
    return median(values) if values else None
