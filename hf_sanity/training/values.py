"""From what the recorder read for one step to the values the step detectors read (no torch, no Trainer).

The recorder returns, per step, every value pushed under each name (``{"loss": [micro-batch losses], ...}``);
:meth:`StepHistory.values` turns them into one record: the step's loss (the sum of its micro-batch losses,
as Trainer logs it), the last value of each single measurement, whether the step ran in train mode, and, at a
probe, the predictions-probe numbers. It remembers the finite step losses, the learning rate of each step and
the evaluation steps, for the curve detectors and the messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hf_sanity.measure.curves import Curves
from hf_sanity.numbers import median

SINGLE = ("grad_norm", "stale_norm", "label_entropy", "update_ratio", "lr", "n_trainable", "n_with_grad",
          "n_in_optimizer", "chosen_logp")  # fmt: skip
LEVEL_POINTS = 5  # the loss level around a probe: median of the last (and first) 5 step losses


@dataclass
class StepHistory:
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) of finite steps
    lr: dict[int, float] = field(default_factory=dict)
    evaluations: list[int] = field(default_factory=list)

    def values(self, step: int, raw: dict[str, list[Any]], *, scaler: bool = False) -> dict[str, Any]:
        values: dict[str, Any] = {"scaler": scaler}
        if "loss" in raw:
            micro = raw["loss"]
            values["losses"] = micro
            values["loss"] = float(sum(micro))
            values["loss_finite"] = all(math.isfinite(x) for x in micro)
            if values["loss_finite"]:
                self.losses.append((step, values["loss"]))
        for key in SINGLE:
            if key in raw:
                values[key] = raw[key][-1]
        if "lr" in raw:
            self.lr[step] = raw["lr"][-1]
        if "updated" in raw:
            values["updated"] = raw["updated"][-1] > 0.5
        if "training" in raw:
            values["training"] = all(raw["training"])
            if not values["training"]:
                values["after_eval"] = max((s for s in self.evaluations if s < step), default=None)
        if "router_peak" in raw:  # a probe's load of each MoE layer, in layer order (training.routing)
            values["router_load"] = {"peak": raw["router_peak"], "dead": raw.get("router_dead", [])}
        if "probe_changed" in raw:
            level = [v for _, v in self.losses[-LEVEL_POINTS:]]
            start = [v for _, v in self.losses[:LEVEL_POINTS]]
            values["changed"] = raw["probe_changed"][-1]
            values["loss_level"] = median(level) if level else None
            values["loss_start"] = median(start) if start else None
        return values

    def curves(self, log_history: list[dict], *, vocab_size: int | None, per_step: bool = True) -> Curves:
        """The run's curves for the curve detectors: the logged ones, with the exact per-step train losses (and
        learning rates) in place of the logged averages when ``per_step``. Under DDP they are not: a rank's
        own losses are not the loss the user sees (the mean over ranks that Trainer logs), and one rank's
        batch-to-batch noise is not an oscillation of the run."""
        curves = Curves.from_log_history(log_history, vocab_size=vocab_size)
        if self.losses and per_step:
            curves.train_steps = [s for s, _ in self.losses]
            curves.train_loss = [v for _, v in self.losses]
            curves.lr = [self.lr.get(s, math.nan) for s in curves.train_steps] if self.lr else []
        return curves
