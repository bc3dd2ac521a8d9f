"""A fixed probe batch, run without grad in eval mode (state restored): the argmax predictions at its
supervised positions, compared across the run for `predictions-frozen`; and, on the first batch, the step-0
numbers `init-loss-off-chance` reads (``measure.losses.score_logits``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.measure.losses import score_logits
from hf_sanity.measure.tensors import call_model, logits_of
from hf_sanity.untouched import untouched

PROBE_ROWS = 4  # rows of the first batch kept as the probe


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


def ids_beyond_embedding(model, batch: Mapping[str, Any]) -> tuple[int, int] | None:
    """(the batch's largest token id, the model's input-embedding rows) when an id has no embedding row: a
    forward on it raises an index error (a device-side assert on CUDA), so no probe may run on it. None when
    every id fits, or when the rows cannot be read (a custom module without get_input_embeddings, a sharded
    embedding whose full size is not its local one)."""
    # Read in the training step, outside any guard: whatever it meets (a hand-written module that does not say
    # which layer embeds, ids on a meta device), it answers None and the probes go on as before.
    try:
        ids = batch.get("input_ids")
        if ids is None or not hasattr(ids, "max") or ids.numel() == 0:
            return None
        embeddings = model.get_input_embeddings()
        rows = getattr(embeddings, "num_embeddings", None)
        weight = getattr(embeddings, "weight", None)
        if not isinstance(rows, int) or (weight is None or weight.dim() != 2 or weight.shape[0] != rows):
            return None
        largest = int(ids.max())
    except Exception:
        return None
    return (largest, rows) if largest >= rows else None


def probe(model, batch: Mapping[str, Any], *, stats: bool = False) -> dict[str, Any]:
    """Argmax predictions at the supervised positions of ``batch`` (a device tensor, compared with later probes
    without a transfer) and, with ``stats``, the step-0 numbers preflight's init-loss check reads
    (``Context.init_loss``: loss, the model's predictive entropy, its top-1 hits, the loss under other
    alignments of the labels, label entropy, tokens)."""
    import torch

    from hf_sanity.training.shards import kept_sharded

    labels = batch.get("labels")
    with untouched(model), kept_sharded(model):
        logits = logits_of(call_model(model, batch, use_cache=False))
        out: dict[str, Any] = {"logits_shape": tuple(logits.shape) if logits is not None else None}
        if logits is None or labels is None or logits.dim() != 3 or labels.shape[:2] != logits.shape[:2]:
            return out
        labels = labels.to(logits.device)
        shifted = labels[:, 1:]
        mask = shifted != IGNORE_INDEX
        out["argmax"] = logits[:, :-1][mask].float().argmax(-1)
        if stats:
            targets = shifted[mask]
            if targets.numel():
                _, counts = torch.unique(targets, return_counts=True)
                p = counts.double() / counts.sum()
                out["stats"] = {
                    **score_logits(logits, labels, batch.get("input_ids"), detail=True),
                    "label_entropy": float(-(p * p.log()).sum()),
                }
        return out


def chosen_logp(model, batch: Mapping[str, Any]):
    """The mean log-probability per token the model gives the supervised tokens of ``batch`` (a preference
    batch's chosen rows: their completions), as a device scalar; None without labels that fit the logits."""
    from hf_sanity.training.shards import kept_sharded

    if batch.get("labels") is None:
        return None
    with untouched(model), kept_sharded(model):
        return chosen_logp_of(logits_of(call_model(model, batch, use_cache=False)), batch)


def chosen_logp_of(logits, batch: Mapping[str, Any]):
    """:func:`chosen_logp` from logits already computed for ``batch``'s rows (the first ones of a larger batch:
    the training forward's), without grad; None where they do not fit its labels."""
    import torch
    import torch.nn.functional as F

    labels = batch.get("labels")
    if logits is None or labels is None or logits.dim() != 3 or logits.shape[0] < labels.shape[0]:
        return None
    logits = logits[: labels.shape[0]]
    if labels.shape[:2] != logits.shape[:2]:
        return None
    with torch.no_grad():
        shifted = labels[:, 1:].to(logits.device)
        mask = shifted != IGNORE_INDEX
        if not bool(mask.any()):
            return None
        log_probs = F.log_softmax(logits[:, :-1].detach()[mask].float(), dim=-1)
        return log_probs.gather(-1, shifted[mask].unsqueeze(-1)).mean()


def logits_reusable(model, kwargs: Mapping[str, Any]) -> bool:
    """The training forward about to run gives the logits an eval-mode probe of the same rows would: no dropout
    can act in it (no ``nn.Dropout`` with p > 0, no dropout rate or router jitter in the config, or the model in
    eval mode) and it returns the logits of every position (no ``logits_to_keep``, no fused head)."""
    from hf_sanity.measure.reference import config_dropout, dropout_modules

    # A forward that keeps some logits only, or computes its loss in a fused head without them (TRL's DPO).
    if any(kwargs.get(key) for key in ("logits_to_keep", "num_logits_to_keep", "fused_lm_head")):
        return False
    if not getattr(model, "training", True):
        return True
    settings = getattr(getattr(model, "config", None), "__dict__", {})
    jitter = any(isinstance(v, (int, float)) and v > 0 for k, v in settings.items() if "jitter" in k)
    return not jitter and not config_dropout(model) and not dropout_modules(model)
