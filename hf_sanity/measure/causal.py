"""Whether the model's predictions at a position depend on the tokens after it: the causal mask, measured.

A causal LM's logits at position t are a function of tokens 0..t only. A collator that builds its own 4-D
attention mask (bidirectional by mistake), or a model whose attention is not causal (an encoder used as a
decoder, a custom module without a causal mask), lets every position read the answer it is trained to
predict: the loss falls to ~0 and the model is useless at generation, where the future is not there.

The measurement: on a few rows of a batch, the tokens after position t (the middle of each row's real
tokens) are replaced by other tokens of the same row, everything else (attention mask, position ids) kept;
the logits at positions <= t are compared. Under a causal model they are identical (the masked keys add
exact zeros): the comparison's own noise is measured by running the unchanged batch twice.

The logits compared are those of an evenly spread subset of the vocabulary (``HEAD_ROWS`` rows of the LM head,
applied to the hidden states it receives): the head is a per-position map, so whatever moves a position's hidden
state moves its logits on these rows too, and with a 152k vocabulary the full projection of every position was
most of the measurement's cost. A model whose head is not a plain linear layer is compared on its full logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LEAK_ROWS = 4  # rows of the batch whose future is changed
HEAD_ROWS = 2048  # vocabulary rows the logits are compared on (all of them below twice as many)
NO_MASK_KEYS = ("attention_mask",)


def _real_positions(batch: Mapping[str, Any], row: int) -> list[int]:
    """The row's attended positions by its 2-D attention mask; every position without one (or with a 4-D
    mask, which marks no padding by itself)."""
    mask = batch.get("attention_mask")
    width = int(batch["input_ids"].shape[1])
    if mask is not None and mask.dim() == 2:
        return [i for i, m in enumerate(mask[row].tolist()) if int(m) != 0]
    return list(range(width))


def changed_future(ids, positions: list[int], t: int, keep_ids: frozenset[int] = frozenset()):
    """``ids`` (one row) with every real token after position ``t`` replaced by a different token of the same
    row (so no id the model has never been fed): deterministic, no RNG. Tokens in ``keep_ids`` (a VLM's image
    placeholders, which must stay as many as its image features) are neither replaced nor drawn."""
    row = ids.clone()
    before = [int(ids[i]) for i in positions if i <= t and int(ids[i]) not in keep_ids and int(ids[i]) >= 0]
    for k, i in enumerate(p for p in positions if p > t):
        old = int(ids[i])
        if old in keep_ids or old < 0:
            continue
        pool = [x for x in before if x != old]
        if pool:
            row[i] = pool[(7 * k + 3) % len(pool)]
    return row


def _logits(model, batch: Mapping[str, Any]):
    """The logits of ``batch`` on ``HEAD_ROWS`` rows of the vocabulary (the LM head's input captured by a
    pre-hook, which lets the head itself run on one position per row), or the full logits where the head is not
    a plain linear layer or never sees this batch's hidden states."""
    from hf_sanity.measure.tensors import forward_kwargs, logits_of

    kwargs = forward_kwargs(model, batch, use_cache=False)
    head = _linear_head(model)
    if head is None:
        return logits_of(model(**kwargs))
    shape = tuple(batch["input_ids"].shape[:2])
    captured = []

    def take_input(module, args):
        hidden = args[0] if args else None
        if captured or hidden is None or hidden.dim() != 3 or tuple(hidden.shape[:2]) != shape:
            return None
        captured.append(hidden)
        return (hidden[:, -1:],)

    handle = head.register_forward_pre_hook(take_input)
    try:
        output = model(**kwargs)
    finally:
        handle.remove()
    if not captured:
        return logits_of(output)
    return _head_rows(model, head, captured[0])


def _linear_head(model):
    """The model's output embeddings when they are a plain ``nn.Linear`` (weights the subset can be read from),
    else None."""
    import torch

    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not torch.nn.Linear or head.weight.dim() != 2:
        return None
    return head


def _head_rows(model, head, hidden):
    """``hidden`` projected on ``HEAD_ROWS`` evenly spread rows of ``head`` (all rows of a small vocabulary),
    finished as the model finishes its logits (soft-capping, a logit scale)."""
    import torch

    from hf_sanity.measure.losses import finish_logits

    vocab = int(head.weight.shape[0])
    weight, bias = head.weight, head.bias
    if vocab > 2 * HEAD_ROWS:
        rows = torch.linspace(0, vocab - 1, HEAD_ROWS, device=weight.device).round().long()
        weight = weight[rows]
        bias = bias[rows] if bias is not None else None
    return finish_logits(model, torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias))


def future_token_leak(
    model, batch: Mapping[str, Any], *, rows: int = LEAK_ROWS, vision_ids: frozenset[int] = frozenset()
) -> dict[str, Any] | None:
    """On up to ``rows`` rows of ``batch`` (2 real tokens or more): how far the logits at positions <= t move
    when only the tokens after t change, against the noise of running the same batch twice. With the batch's
    own 4-D attention mask, the same is measured without any attention mask (the model's own causal mask):
    whether the mask or the model lets the future in. None when no row can be checked."""
    import torch

    from hf_sanity.measure.tensors import model_device, to_device
    from hf_sanity.untouched import untouched

    ids = batch.get("input_ids")
    if ids is None or getattr(ids, "dim", lambda: 0)() != 2:
        return None
    picked: list[tuple[int, int, list[int]]] = []  # (row, t, real positions)
    for r in range(int(ids.shape[0])):
        positions = _real_positions(batch, r)
        if len(positions) >= 2:
            picked.append((r, positions[len(positions) // 2 - 1], positions))
        if len(picked) == rows:
            break
    if not picked:
        return None
    # A VLM batch's pictures are not per row (LLaVA: one entry per picture; Qwen2-VL: flattened patches):
    # every row goes in, so that the placeholders and the image features still match.
    keep = list(range(int(ids.shape[0]))) if vision_ids else [r for r, _, _ in picked]
    plan = {r: (positions, t) for r, t, positions in picked}
    slot = {r: i for i, r in enumerate(keep)}  # each checked row's place in the forwarded batch
    device = model_device(model)

    def select(tensors: Mapping[str, Any], drop=()) -> dict[str, Any]:
        out = {}
        for key, value in tensors.items():
            if key in drop or not hasattr(value, "shape"):
                continue
            per_row = value.dim() >= 2 and value.shape[0] == ids.shape[0]  # not cu_seq_lens and the like
            out[key] = value[keep] if per_row else value
        return to_device(out, device)

    base = select(batch)
    changed = dict(base)
    changed["input_ids"] = torch.stack(
        [changed_future(ids[r], *plan[r], vision_ids) if r in plan else ids[r] for r in keep]
    ).to(device)
    mask = batch.get("attention_mask")
    mask_dims = int(mask.dim()) if mask is not None else 0
    with untouched(model):
        first, again, moved = _logits(model, base), _logits(model, base), _logits(model, changed)
        measured = _compare(first, again, moved, picked, slot)
        if mask_dims == 4:  # the collator's own mask: the same without it tells the mask from the model
            plain = select(batch, drop=NO_MASK_KEYS)
            plain_changed = {**plain, "input_ids": changed["input_ids"]}
            measured["without_mask"] = _compare(
                _logits(model, plain), _logits(model, plain), _logits(model, plain_changed), picked, slot
            )
    half = first.dtype in (torch.float16, torch.bfloat16)
    return {**measured, "mask_dims": mask_dims, "half": half}


def _compare(first, again, moved, picked, slot) -> dict[str, Any]:
    """Per checked row: how far the logits at each position <= t moved, relative to the row's logit scale
    (their largest |value|); and the noise, the same batch run twice, the same way."""
    import torch

    per_row = []
    noise = 0.0
    for r, t, _ in picked:
        k = slot[r]
        x, y, z = first[k, : t + 1].float(), again[k, : t + 1].float(), moved[k, : t + 1].float()
        finite = torch.isfinite(x) & torch.isfinite(y) & torch.isfinite(z)
        zero = torch.zeros_like(x)
        scale = float(torch.where(finite, x.abs(), zero).max()) or 1.0
        moved_by = torch.where(finite, (x - z).abs(), zero).reshape(t + 1, -1).amax(dim=1) / scale
        noise = max(noise, float(torch.where(finite, (x - y).abs(), zero).max()) / scale)
        per_row.append({"row": r, "t": t, "moved": [float(v) for v in moved_by]})
    return {"rows": per_row, "noise": noise}
