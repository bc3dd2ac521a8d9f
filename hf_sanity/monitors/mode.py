"""Train/eval mode of the training forward: `train-mode-off`.

Fed per training forward: ``training`` (``model.training`` when the forward ran) and ``train_only_modules``
(dropout and batch-norm modules whose behaviour differs between the modes, for the message).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_sanity.findings import Finding
from hf_sanity.monitors.base import Monitor
from hf_sanity.rules.training import TRAIN_MODE_OFF


class TrainModeMonitor(Monitor):
    rules = (TRAIN_MODE_OFF,)

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


def train_only_modules(model) -> int:
    """Modules that behave differently in train and eval mode: dropout with p > 0, batch norm."""
    import torch

    count = 0
    for module in model.modules():
        if (isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0) or isinstance(
            module, torch.nn.modules.batchnorm._BatchNorm
        ):
            count += 1
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "attn_pdrop", "resid_pdrop"):
        if isinstance(getattr(config, key, None), (int, float)) and getattr(config, key) > 0:
            count += 1
    return count
