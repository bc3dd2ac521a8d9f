"""One training step on the examples, as the overfit, its LR search and the LR range test take it: the
weighted loss over the collated batches, backward, gradient clipping as the setup does, the optimizer step."""

from __future__ import annotations

import math

from hf_sanity import progress
from hf_sanity.measure.tensors import model_device, to_device
from hf_sanity.protocol.pipeline import Learner, Pipeline, supervised_count
from hf_sanity.rules.protocol import diverging, on_pace


def micro_weights(batches: list[dict]) -> list[float]:
    """Each micro-batch's share of the supervised tokens: the mean loss over all examples is their weighted sum."""
    counts = [supervised_count(b) for b in batches]
    if any(c is None for c in counts) or sum(counts) == 0:
        return [1.0 / len(batches)] * len(batches)
    total = sum(counts)
    return [c / total for c in counts]


def forward_loss(learner: Learner, batches: list[dict], weights: list[float]):
    """(combined loss, the first micro-batch's loss as returned): the returned one is what grad_fn is read from."""
    device = model_device(learner.model)
    first = None
    total = None
    for batch, weight in zip(batches, weights):
        loss = learner.loss(to_device(batch, device))
        if not hasattr(loss, "requires_grad"):
            raise TypeError(f"the loss is a {type(loss).__name__}, not a tensor")
        if loss.numel() != 1:
            loss = loss.mean()
        first = loss if first is None else first
        term = loss * weight if len(batches) > 1 else loss
        total = term if total is None else total + term
    return total, first


def optimizer_params(optimizer) -> list:
    return [p for group in getattr(optimizer, "param_groups", []) for p in group["params"]]


def clip_grads(params: list, max_norm: float | None) -> None:
    import torch

    with_grad = [p for p in params if p.grad is not None]
    if max_norm and with_grad:
        torch.nn.utils.clip_grad_norm_(with_grad, max_norm)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def signature(p) -> tuple[float, float]:
    """Two numbers that change when a tensor does (no copy of it is made)."""
    import torch

    data = p.detach()
    return float(torch.sum(data, dtype=torch.float64)), float(
        torch.linalg.vector_norm(data, dtype=torch.float64)
    )


def train(
    pipeline: Pipeline,
    learner: Learner,
    weights: list[float],
    losses: list[float],
    steps: int,
    threshold: float,
    *,
    window: int | None = None,
    name: str = "training",
) -> None:
    """Train until ``losses`` holds the loss after each of ``steps`` updates (``losses[i]``: after i updates;
    it may already hold the first ones). Stops once the loss is near zero or non-finite. With ``window`` (the
    LR search's runs) also once it diverges or, read every ``window`` steps, falls too slowly to get near zero:
    more steps at that LR are not going to help. ``name``: the progress phase it shows."""
    with progress.phase(name, total=steps):
        progress.advance(len(losses))
        _train(pipeline, learner, weights, losses, steps, threshold, window)


def _train(pipeline, learner, weights, losses, steps, threshold, window) -> None:
    held = optimizer_params(learner.optimizer)
    best = min((x for x in losses if math.isfinite(x)), default=math.inf)
    for step in progress.each(range(len(losses), steps + 1)):
        learner.optimizer.zero_grad(set_to_none=True)
        for p in learner.model.parameters():
            p.grad = None
        loss, _ = forward_loss(learner, pipeline.batches, weights)
        value = float(loss.detach().float())
        losses.append(value)
        if not math.isfinite(value) or value <= threshold or step == steps:
            return
        if window:
            if step > 0 and diverging(value, best, losses[0]):
                return
            if step >= 2 * window and step % window == 0 and not on_pace(losses, window, threshold):
                return
            best = min(best, value)
        if loss.requires_grad:
            loss.backward()
        clip_grads(held, pipeline.max_grad_norm)
        learner.optimizer.step()
