"""A fixed probe batch run every few steps: `predictions-frozen`.

:class:`PredictionsMonitor` is fed, at each probe, ``changed`` (fraction of the probe's supervised positions
whose argmax prediction differs from the first probe), ``loss_level`` (the recent training loss) and
``loss_start`` (the loss of the first steps). The probe forward itself is `hf_sanity.training.probe`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.numbers import fmt
from hf_sanity.rules.training.base import Monitor

PREDICTIONS_FROZEN = define(
    "predictions-frozen",
    severity="warning",
    stage="training",
    symptom="Loss decreases but generations never change.",
    detects="Argmax predictions on a fixed probe batch never change, from the first probe on, while the loss "
    "moves. (Predictions that changed and then settled are a run converging, not this.)",
    fix="Check what is being optimised (the loss may be connected to something other than the served weights, "
    "e.g. an adapter that is not active).",
)

FROZEN_PROBES = 3  # identical argmax at 3 consecutive probes after the first ...
LOSS_MOVED = 0.05  # ... while the training loss moved >= 5% since the first probe


@monitor
class PredictionsMonitor(Monitor):
    rules = (PREDICTIONS_FROZEN,)
    reads = ("changed", "loss_level", "loss_start")

    def __init__(self, *, probes: int = FROZEN_PROBES) -> None:
        super().__init__()
        self.probes = probes
        self.first_loss: float | None = None
        self._frozen: list[int] = []
        self._ever_changed = False  # once predictions moved, the weights that are served are being trained

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        if not self.start_known:
            return []  # resumed without a saved state: whether predictions moved before is not known
        start = values.get("loss_start", values.get("loss_level"))
        if self.first_loss is None and start is not None:
            self.first_loss = float(start)
        changed = values.get("changed")
        if changed is None:
            return []
        if changed > 0 or self._ever_changed:
            self._ever_changed = True
            return []
        self._frozen.append(step)
        level = values.get("loss_level")
        if len(self._frozen) < self.probes or level is None or not self.first_loss:
            return []
        moved = (self.first_loss - float(level)) / abs(self.first_loss)
        if abs(moved) < LOSS_MOVED:
            return []
        first = self._frozen[0]
        return self.fire(
            PREDICTIONS_FROZEN,
            f"the loss went from {fmt(self.first_loss)} to {fmt(float(level))} ({-moved:+.0%}) but the argmax "
            f"predictions on the probe batch did not change at any of the {len(self._frozen)} probes from step "
            f"{first} to {step}",
            step=first,
            evidence={
                "probes": self._frozen,
                "loss_start": self.first_loss,
                "loss_now": float(level),
                "loss_change": -moved,
            },
        )
