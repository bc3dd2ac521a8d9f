"""A fixed probe batch run every few steps: `predictions-frozen`; and the step-0 numbers of the first batch.

:class:`PredictionsMonitor` is fed, at each probe, ``changed`` (fraction of the probe's supervised positions
whose argmax prediction differs from the first probe) and ``loss_level`` (the recent training loss).
:func:`probe` runs the forward (no grad, eval mode, RNG restored) and measures the loss, the model's own
predictive entropy and the label entropy at the supervised positions, and the argmax predictions there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_sanity.findings import Finding
from hf_sanity.monitors.base import Monitor, fmt
from hf_sanity.rules.training import PREDICTIONS_FROZEN

FROZEN_PROBES = 3  # identical argmax at 3 consecutive probes after the first ...
LOSS_MOVED = 0.05  # ... while the training loss moved >= 5% since the first probe
PROBE_ROWS = 4  # rows of the first batch kept as the probe
IGNORE_INDEX = -100


class PredictionsMonitor(Monitor):
    rules = (PREDICTIONS_FROZEN,)

    def __init__(self, *, probes: int = FROZEN_PROBES) -> None:
        super().__init__()
        self.probes = probes
        self.first_loss: float | None = None
        self._frozen: list[int] = []

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        start = values.get("loss_start", values.get("loss_level"))
        if self.first_loss is None and start is not None:
            self.first_loss = float(start)
        changed = values.get("changed")
        if changed is None:
            return []
        if changed > 0:
            self._frozen = []
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


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The forward kwargs of a training batch: its tensors, without labels and loss-only keys."""
    import torch

    drop = {"labels", "num_items_in_batch", "return_loss", "completion_mask", "assistant_masks"}
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in drop}


def probe_batch(batch: Mapping[str, Any], rows: int = PROBE_ROWS) -> dict[str, Any]:
    """The first ``rows`` rows of a batch (detached, kept for the whole run)."""
    import torch

    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[key] = (
                value[:rows].detach().clone()
                if value.dim() > 0 and value.shape[0] > 1
                else value.detach().clone()
            )
    return out


def probe(model, batch: Mapping[str, Any], *, stats: bool = False) -> dict[str, Any]:
    """Argmax predictions at the supervised positions of ``batch`` (a device tensor, compared with later probes
    without a transfer) and, with ``stats``, the step-0 numbers preflight's init-loss check reads
    (``Context.init_loss``: loss, the model's predictive entropy, label entropy, tokens)."""
    import torch
    import torch.nn.functional as F

    from hf_sanity.monitors.nonfinite import quiet_forward

    labels = batch.get("labels")
    with quiet_forward(model):
        kwargs = model_inputs(batch)
        kwargs["use_cache"] = False
        output = model(**kwargs)
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, (tuple, list)):
            logits = output[0]
        out: dict[str, Any] = {"logits_shape": tuple(logits.shape) if logits is not None else None}
        if logits is None or labels is None or logits.dim() != 3 or labels.shape[:2] != logits.shape[:2]:
            return out
        shifted = labels[:, 1:].to(logits.device)
        mask = shifted != IGNORE_INDEX
        picked = logits[:, :-1][mask].float()
        out["argmax"] = picked.argmax(-1)
        if stats:
            targets = shifted[mask]
            if targets.numel():
                log_probs = F.log_softmax(picked, dim=-1)
                _, counts = torch.unique(targets, return_counts=True)
                p = counts.double() / counts.sum()
                out["stats"] = {
                    "loss": float(F.nll_loss(log_probs, targets)),
                    "entropy": float(-(log_probs.exp() * log_probs).sum(-1).mean()),
                    "tokens": int(targets.numel()),
                    "label_entropy": float(-(p * p.log()).sum()),
                }
        return out
