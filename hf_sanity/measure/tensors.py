"""Tensors in and out of the user's model: one batch padder, device moves, and calls that pass the model only
what its ``forward`` accepts (a custom ``nn.Module`` may take no ``use_cache`` or ``attention_mask``)."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from hf_sanity.constants import IGNORE_INDEX

# Keys of a training batch that only the loss reads: never passed to the model's forward by hf-sanity.
LOSS_ONLY = ("labels", "num_items_in_batch", "return_loss", "completion_mask", "assistant_masks")


def pad_id(tokenizer) -> int:
    """The id that fills padded positions: the tokenizer's pad token, else EOS, else 0 (the attention mask hides
    them either way)."""
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0


def pad_batches(
    seqs: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad: int,
    batch_size: int | None = None,
    device=None,
    *,
    by_length: bool = False,
) -> list[dict[str, Any]]:
    """(input_ids, labels) pairs as right-padded tensor batches: ``pad`` in input_ids, -100 in labels, 0 in
    attention_mask. The one padder of hf-sanity; ``batch_size=None`` puts every pair in one batch.
    ``by_length``: batched in order of length (stable), so that little of a batch is padding, for sums over
    examples whose order does not matter."""
    import torch

    if by_length:
        seqs = sorted(seqs, key=lambda pair: len(pair[0]))
    size = batch_size or max(len(seqs), 1)
    out = []
    for lo in range(0, len(seqs), size):
        chunk = seqs[lo : lo + size]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long, device=device)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long, device=device)
        mask = torch.zeros((len(chunk), width), dtype=torch.long, device=device)
        for j, (ids, labs) in enumerate(chunk):
            input_ids[j, : len(ids)] = torch.tensor(list(ids), dtype=torch.long, device=device)
            labels[j, : len(labs)] = torch.tensor(list(labs), dtype=torch.long, device=device)
            mask[j, : len(ids)] = 1
        out.append({"input_ids": input_ids, "labels": labels, "attention_mask": mask})
    return out


def model_device(model):
    """Where the model's (first) parameters live; the CPU for a model without parameters."""
    import torch

    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def to_device(batch: Mapping[str, Any], device) -> dict[str, Any]:
    """The batch with every tensor moved to ``device`` (other values kept)."""
    return {k: (v.to(device) if hasattr(v, "to") and hasattr(v, "shape") else v) for k, v in batch.items()}


def forward_signature(model) -> tuple[set[str], bool] | None:
    """(the keyword arguments the model's forward names, whether it also takes ``**kwargs``); None when the
    signature cannot be read."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return None
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def forward_kwargs(model, batch: Mapping[str, Any], *, labels: bool = False, **extra) -> dict[str, Any]:
    """The forward kwargs for ``batch``: its tensors (without loss-only keys unless ``labels``) that the forward
    accepts, plus ``extra`` options (e.g. ``use_cache=False``) only where the forward names them: a custom
    ``nn.Module`` with ``forward(x, labels=None)`` is never handed a ``use_cache`` it does not know."""
    import torch

    drop = set(LOSS_ONLY) - ({"labels"} if labels else set())
    kwargs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in drop}
    signature = forward_signature(model)
    if signature is None:
        return {**kwargs, **extra}
    named, open_ended = signature
    if not open_ended:
        kwargs = {k: v for k, v in kwargs.items() if k in named}
    kwargs.update({k: v for k, v in extra.items() if k in named})
    return kwargs


# Models whose forward reads its labels whatever it is given (a custom `forward(x, labels=None)` that computes
# its loss unconditionally): called with them, once one call without them has failed.
_NEEDS_LABELS: weakref.WeakSet = weakref.WeakSet()


def needs_labels(model) -> bool:
    """Whether ``model``'s forward was found to need its labels (see :func:`call_model`)."""
    return model in _NEEDS_LABELS


def call_model(model, batch: Mapping[str, Any], **extra):
    """``model`` on ``batch`` as :func:`forward_kwargs` builds its call: without the labels, so that the model
    computes no loss hf-sanity does not read. A forward that computes its loss whatever it is given fails
    without them: it is called again with them (and with them from then on); if that fails too, the first
    error is raised."""
    try:
        return model(**forward_kwargs(model, batch, labels=needs_labels(model), **extra))
    except Exception as first:
        signature = forward_signature(model)
        takes_labels = signature is not None and ("labels" in signature[0] or signature[1])
        if needs_labels(model) or batch.get("labels") is None or not takes_labels:
            raise
        try:
            output = model(**forward_kwargs(model, batch, labels=True, **extra))
        except Exception:
            raise first from None
    _NEEDS_LABELS.add(model)
    return output


def logits_of(output):
    """The logits of a forward's output: ``.logits``, or the first tensor of a tuple, or the tensor itself."""
    import torch

    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):  # a custom model may return a plain dict
        logits = output.get("logits")
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if logits is None and isinstance(output, torch.Tensor):
        logits = output
    return logits


def strided(tensor, most: int):
    """``tensor`` itself, or an evenly strided view of at most ``most`` of its elements (a contiguous one)."""
    n = tensor.numel()
    if n <= most or not tensor.is_contiguous():
        return tensor
    return tensor.detach().view(-1)[:: -(-n // most)]


FINGERPRINT_ELEMENTS = 16  # elements of each trainable tensor sampled, evenly spaced


def start_fingerprint(model) -> str | None:
    """A short digest of the trainable weights as they are (evenly spaced elements of each and its last one, in
    parameter order; the last catches rows appended to an embedding): two runs whose digests at step 0 differ
    started from different weights (a LoRA drawn before the seed, new embedding rows). None where a trainable
    tensor is not a plain local one (sharded, quantized, on the meta device): no digest rather than one of part
    of the weights."""
    import hashlib

    import torch

    samples = []
    for parameter in model.parameters():
        if not parameter.requires_grad:
            continue
        if type(parameter) is not torch.nn.Parameter or type(parameter.data) is not torch.Tensor:
            return None
        if parameter.is_meta or parameter.numel() == 0:
            return None
        # A view, never a copy of a large tensor: a non-contiguous one (rare) is sampled along its first row.
        flat = parameter.detach()
        flat = flat.view(-1) if flat.is_contiguous() else flat[(0,) * (flat.dim() - 1)]
        samples += [strided(flat, FINGERPRINT_ELEMENTS).float(), flat[-1:].float()]
    if not samples:
        return None
    values = torch.cat([s.to(samples[0].device) for s in samples]).cpu().numpy().tobytes()
    return hashlib.blake2b(values, digest_size=8).hexdigest()
