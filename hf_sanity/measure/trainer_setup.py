"""What a trainer does with its own model and first batch, measured by running them (`preflight(trainer=...)`):
packed examples run packed and alone, the trainer's compute_loss with two item counts, one forward/backward
under activation checkpointing. Each pass runs in `untouched` (RNG states, modes and gradients as they were);
the context runs each once, when a rule first reads it, and the rules in ``rules/trainer_setup`` judge them."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.measure.tensors import model_device, to_device
from hf_sanity.untouched import untouched


def example_bounds(batch) -> list[list[int]] | None:
    """Start positions of the examples packed into each row, from ``position_ids`` restarts, ``seq_idx``
    changes or ``cu_seq_lens_q``; None when the batch says nothing about example boundaries."""
    import torch

    if batch.get("position_ids") is not None:
        positions = batch["position_ids"]
        return [(positions[r] == 0).nonzero().flatten().tolist() for r in range(positions.shape[0])]
    if batch.get("seq_idx") is not None:
        seq = batch["seq_idx"]
        return [
            [0, *((seq[r, 1:] != seq[r, :-1]).nonzero().flatten() + 1).tolist()] for r in range(seq.shape[0])
        ]
    if isinstance(batch.get("cu_seq_lens_q"), torch.Tensor) and batch["input_ids"].shape[0] == 1:
        return [batch["cu_seq_lens_q"][:-1].tolist()]
    return None


@dataclass(frozen=True)
class PackedAlone:
    """The second example of the first packed row, its logits packed against alone."""

    row: int
    start: int
    stop: int
    max_logit_difference: float
    logit_scale: float  # the largest logit alone (1.0 when all are 0)
    attn_implementation: str | None


def packed_against_alone(model, batch) -> PackedAlone | None:
    """The second example of the first row that packs several (by :func:`example_bounds`), run inside its
    packed row and alone; None when no row packs an example of at least two tokens after another."""
    bounds = example_bounds(batch)
    packed = [(r, starts) for r, starts in enumerate(bounds or []) if len(starts) >= 2]
    if not packed:
        return None
    row, starts = packed[0]
    start = starts[1]
    stop = starts[2] if len(starts) > 2 else int(batch["input_ids"].shape[1])
    if stop - start < 2:
        return None
    inputs = to_device({k: v for k, v in batch.items() if k != "labels"}, model_device(model))
    with untouched(model):
        packed_logits = model(**inputs).logits[row, start:stop].float()
        alone_logits = model(input_ids=inputs["input_ids"][row : row + 1, start:stop]).logits[0].float()
    return PackedAlone(
        row=row,
        start=start,
        stop=stop,
        max_logit_difference=float((packed_logits - alone_logits).abs().max()),
        logit_scale=float(alone_logits.abs().max()) or 1.0,
        attn_implementation=getattr(getattr(model, "config", None), "_attn_implementation", None),
    )


@dataclass(frozen=True)
class ItemsScaling:
    """Whether the trainer's compute_loss takes ``num_items_in_batch`` and whether its loss changes with it."""

    accepts_num_items: bool
    ignores_num_items: bool


def takes_num_items(trainer) -> bool:
    parameters = inspect.signature(trainer.compute_loss).parameters
    return "num_items_in_batch" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def items_scaling(trainer, batch) -> ItemsScaling:
    """The trainer's compute_loss on ``batch`` (with labels) called with its supervised token count and with
    twice it: a loss that does not change ignores ``num_items_in_batch`` (a per-micro-batch mean). Not called
    when compute_loss cannot take the count."""
    import torch

    from hf_sanity.measure.forwards import as_in_a_step

    if not takes_num_items(trainer):
        return ItemsScaling(accepts_num_items=False, ignores_num_items=True)
    model = trainer.model
    device = model_device(model)
    inputs = to_device(batch, device)
    items = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    with untouched(model), as_in_a_step(trainer):  # transformers' loop sets what compute_loss reads
        one = float(
            trainer.compute_loss(model, dict(inputs), num_items_in_batch=torch.tensor(items, device=device))
        )
        two = float(
            trainer.compute_loss(
                model, dict(inputs), num_items_in_batch=torch.tensor(2 * items, device=device)
            )
        )
    return ItemsScaling(
        accepts_num_items=True, ignores_num_items=abs(one - two) <= 1e-6 * max(abs(one), 1e-12)
    )


def checkpointing_on(model) -> bool:
    """Whether activation (gradient) checkpointing is on. transformers 5 renamed `is_gradient_checkpointing`
    to `is_activation_checkpointing` and warns on the old name: read the new one where it exists."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        value = getattr(model, name, None)
        if value is not None:
            return bool(value)
    return False


@dataclass(frozen=True)
class GradsReached:
    """The trainable tensors of one forward/backward, and those that received no gradient."""

    trainable: tuple[str, ...]
    without_grad: tuple[str, ...]


def grads_reached(model, batch) -> GradsReached | None:
    """One forward/backward of ``model`` on ``batch`` (with labels), in train mode with gradients, as a training
    step runs it: which trainable tensors get a gradient. None when nothing trains."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        return None
    inputs = to_device(batch, model_device(model))
    with untouched(model, train=True, grad=True):
        loss = model(**inputs).loss
        if loss is not None and loss.requires_grad:
            loss.backward()
        missing = tuple(n for n, p in trainable if p.grad is None)
    return GradsReached(trainable=tuple(n for n, _ in trainable), without_grad=missing)
