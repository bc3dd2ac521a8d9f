"""The loss of the first real training step, as the trainer computes it: `init-loss-off-chance` (the loss a
custom compute_loss returns, far above chance) and `grad-accum-loss-scaling` (the logged loss is the
accumulation factor times the model's own cross-entropy: each micro-batch averaged on its own).

:class:`Step0Monitor` is fed ``step0`` (the model's own cross-entropy on the first batch, measured by the
callback's probe before the first step) and then the first step's ``loss`` (what ``training_step`` returned,
summed over micro-batches: what Trainer logs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hf_sanity.catalog import monitor
from hf_sanity.findings import Finding
from hf_sanity.numbers import fmt
from hf_sanity.rules.model import INIT_LOSS_OFF_CHANCE, far_above_chance
from hf_sanity.rules.trainer_setup import GRAD_ACCUM_LOSS_SCALING
from hf_sanity.rules.training.base import Monitor, TrainingSetup

FACTOR_TOLERANCE = 0.25  # the step loss is the accumulation factor times the model's loss, to 25%
SCALED = 1.5  # a trainer loss 1.5x the model's own cross-entropy is scaled, not noise


@monitor
class Step0Monitor(Monitor):
    rules = (INIT_LOSS_OFF_CHANCE, GRAD_ACCUM_LOSS_SCALING)
    reads = ("step0", "loss")

    def __init__(self, *, vocab_size: int | None = None, accumulation: int = 1) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.accumulation = accumulation
        self.model_loss: float | None = None
        self._judged = False

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> Step0Monitor:
        return cls(vocab_size=setup.vocab_size, accumulation=setup.accumulation)

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        if values.get("step0"):
            self.model_loss = values["step0"].get("loss")
        loss = values.get("loss")
        if loss is None or self._judged or not math.isfinite(loss):
            return []
        self._judged = True  # the first step only
        ratio = loss / self.model_loss if self.model_loss else None
        evidence = {
            "step_loss": loss,
            "model_loss": self.model_loss,
            "ratio": ratio,
            "gradient_accumulation_steps": self.accumulation,
            "ln_vocab": math.log(self.vocab_size) if self.vocab_size else None,
        }
        k = self.accumulation
        if ratio is not None and k > 1 and abs(ratio - k) <= FACTOR_TOLERANCE * k:
            return self.fire(
                GRAD_ACCUM_LOSS_SCALING,
                f"the first step's loss {fmt(loss)} is {ratio:.1f}x the model's own cross-entropy "
                f"{fmt(self.model_loss)}, with gradient_accumulation_steps={k}: compute_loss averages each "
                "micro-batch on its own and Trainer sums them",
                step=step,
                evidence=evidence,
            )
        if not self.vocab_size or not far_above_chance(loss, math.log(self.vocab_size)):
            return []
        if ratio is not None and ratio < SCALED:
            return []  # the model itself starts that high: the first-batch check reports it with its cause
        if ratio is None and not self.start_known:
            return []  # a resumed run's model is trained: chance alone says nothing of its loss
        return self.fire(
            INIT_LOSS_OFF_CHANCE,
            f"the first step's loss {fmt(loss)} is far above chance ln(V)={math.log(self.vocab_size):.2f}"
            + (f", {ratio:.1f}x the model's own cross-entropy {fmt(self.model_loss)}" if ratio else ""),
            step=step,
            evidence={**evidence, "direction": "above", "cause": "trainer-loss" if ratio else "unknown"},
            fix="The loss your training step computes is not the model's cross-entropy: check the custom "
            "compute_loss (a scale factor, a sum where a mean belongs, the reduction over micro-batches)."
            if ratio
            else None,
        )
