"""Train/eval mode of the training forward: `train-mode-off`.

Fed per training forward: ``training`` (``model.training`` when the forward ran) and ``train_only_modules``
(dropout and batch-norm modules whose behaviour differs between the modes, for the message).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import NOT_RL
from hf_sanity.rules.training.base import Monitor

TRAIN_MODE_OFF = define(
    "train-mode-off",
    severity="error",
    stage="training",
    objectives=NOT_RL,
    symptom="Training looks fine but generalises worse: dropout and other train-only behaviour is silently off.",
    detects="The model runs its training forward with `model.training == False`, e.g. left in eval mode after "
    "an evaluation.",
    fix="Call model.train() before the training forward (after every evaluation).",
)


@monitor
class TrainModeMonitor(Monitor):
    rules = (TRAIN_MODE_OFF,)
    reads = ("training", "train_only_modules", "after_eval")

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        if values.get("training") is not False:
            return []
        modules = values.get("train_only_modules")
        what = f"; {modules} dropout/batch-norm modules behave as at inference" if modules else ""
        return self.fire(
            TRAIN_MODE_OFF,
            f"the training forward of step {step} ran in eval mode (model.training is False){what}",
            step=step,
            evidence={
                "training": False,
                "train_only_modules": modules,
                "after_evaluation": values.get("after_eval"),
            },
        )
