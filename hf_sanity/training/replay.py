"""Why a loss went NaN/Inf, measured on the offending batch: its own non-finite values and supervised tokens,
then a replay of it with a forward hook on every module (the first non-finite output; are the logits finite;
in half precision, is the same forward finite in float32). The batch is saved for reproduction.

The facts go to :func:`hf_sanity.rules.training.loss.classify`, which names the cause. A replay passes the
model only what its forward accepts, and leaves gradients, RNG and every module's train/eval mode as they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.measure.tensors import (
    call_model,
    forward_kwargs,
    logits_of,
    model_device,
    needs_labels,
    to_device,
)
from hf_sanity.untouched import untouched


def tensors(batch: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}


def nonfinite_inputs(batch: Mapping[str, Any]) -> list[str]:
    """Names of the floating-point tensors of ``batch`` that hold NaN or Inf."""
    import torch

    return [
        name
        for name, value in tensors(batch).items()
        if value.is_floating_point() and not bool(torch.isfinite(value).all())
    ]


def supervised_tokens(batch: Mapping[str, Any]) -> int | None:
    """Tokens that carry loss in a causal LM batch (labels are shifted inside the model)."""
    labels = batch.get("labels")
    if labels is None or not hasattr(labels, "shape") or labels.is_floating_point():
        return None
    shifted = labels[..., 1:] if labels.dim() >= 2 else labels
    return int((shifted != IGNORE_INDEX).sum())


def save_batch(batch: Mapping[str, Any], path: str | Path) -> Path | None:
    """The batch's tensors as a safetensors file (None when it holds no tensor)."""
    from safetensors.torch import save_file

    found = {k: v.detach().to("cpu").contiguous() for k, v in tensors(batch).items()}
    if not found:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(found, str(path))
    return path


def _outputs_finite(output) -> bool:
    import torch

    if isinstance(output, torch.Tensor):
        return not output.is_floating_point() or bool(torch.isfinite(output).all())
    if isinstance(output, Mapping):
        return all(_outputs_finite(v) for v in output.values())
    if isinstance(output, (tuple, list)):
        return all(_outputs_finite(v) for v in output)
    if hasattr(output, "to_tuple"):
        return _outputs_finite(output.to_tuple())
    return True


def first_nonfinite_module(model, call) -> tuple[str | None, bool]:
    """Run ``call()`` with a forward hook on every module: the first module (in execution order) whose
    output is non-finite, and whether the final output (its logits) was finite. The model's own output is
    judged by its logits: a forward that computes its loss (given labels it needs) may return a non-finite
    loss from finite logits, which is the loss computation's doing, not a module's."""
    names = {m: n for n, m in model.named_modules()}
    first: list[str] = []

    def hook(module, args, output):
        if not first and not _outputs_finite(_logits_or_all(output) if module is model else output):
            first.append(names.get(module) or type(module).__name__)

    handles = [m.register_forward_hook(hook) for m in names]
    try:
        output = call()
    finally:
        for handle in handles:
            handle.remove()
    return (first[0] if first else None), _outputs_finite(_logits_or_all(output))


def _logits_or_all(output):
    logits = logits_of(output)
    return output if logits is None else logits


def replay(
    model,
    batch: Mapping[str, Any],
    *,
    half_precision: bool,
    autocast: tuple[str, Any] | None = None,
    fp32_limit: int = 200_000_000,
) -> dict[str, Any]:
    """Replay ``batch`` (the model's forward kwargs) under the training forward's autocast and measure what
    went non-finite: the first module, the logits, and (in half precision) the same forward in float32."""
    import torch

    facts: dict[str, Any] = {"replayed": True}
    bad = nonfinite_weights(model)
    if bad:
        facts["nonfinite_weights"] = bad
    cast = torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext()
    with untouched(model):
        with cast:
            module, final_ok = first_nonfinite_module(
                model, lambda: call_model(model, batch, use_cache=False)
            )
        facts["module"] = module
        facts["logits_finite"] = module is None and final_ok
        facts["reproduced"] = not facts["logits_finite"]
        if half_precision and not facts["logits_finite"] and not bad:
            kwargs = forward_kwargs(model, batch, labels=needs_labels(model), use_cache=False)
            facts["fp32_finite"] = _fp32_finite(model, kwargs, fp32_limit)
    return facts


def diagnose(
    batch: Mapping[str, Any], model, *, half_precision: bool, autocast=None, skip: str | None = None
) -> dict[str, Any]:
    """The facts :func:`classify` reads, for one offending batch: its own non-finite values and supervised
    tokens, then (with a ``model``, unless ``skip`` says why not) a replay on the model's device."""
    facts: dict[str, Any] = {
        "input_nonfinite": nonfinite_inputs(batch) or None,
        "supervised_tokens": supervised_tokens(batch),
    }
    if skip or model is None:
        facts["replay_skipped"] = skip or "no model"
        return facts
    moved = to_device(batch, model_device(model))
    try:
        facts.update(replay(model, moved, half_precision=half_precision, autocast=autocast))
    except Exception as exc:
        # What the batch itself showed (a NaN in its inputs) still names the cause; the evidence says why the
        # replay could not tell more.
        facts["replay_failed"] = f"{type(exc).__name__}: {exc}"
    return facts


def autocast_state(module) -> tuple[str, Any] | None:
    """(device type, dtype) of a half-precision autocast active around this forward, else None."""
    import torch

    param = next(module.parameters(), None)
    device_type = param.device.type if param is not None else "cpu"
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return (device_type, dtype) if dtype in (torch.float16, torch.bfloat16) else None


def weights_finite(model) -> bool:
    import torch

    return all(bool(torch.isfinite(p).all()) for p in model.parameters() if p.is_floating_point())


def nonfinite_weights(model, limit: int = 5) -> list[str]:
    """Names of (up to ``limit``) parameters that already hold NaN/Inf."""
    import torch

    out = []
    for name, param in model.named_parameters():
        if param.is_floating_point() and not bool(torch.isfinite(param).all()):
            out.append(name)
            if len(out) >= limit:
                break
    return out


def _fp32_finite(model, kwargs: dict[str, Any], limit: int) -> bool | None:
    """The same forward in float32: autocast off (mixed precision), or a float32 copy of a small half model."""
    import copy

    import torch

    device_type = model_device(model).type
    forward = getattr(model, "_original_forward", None)  # accelerate's forward without its autocast
    params_half = any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
    with torch.autocast(device_type=device_type, enabled=False):
        if not params_half:
            call = forward if forward is not None else model
            out = call(**kwargs)
            return _outputs_finite(_logits_or_all(out))
        if sum(p.numel() for p in model.parameters()) > limit:
            return None
        copy32 = copy.deepcopy(model).float()
        if hasattr(copy32, "_original_forward"):
            copy32.forward = copy32._original_forward
        floats = {
            k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in kwargs.items()
        }
        out = copy32(**floats)
        del copy32
        return _outputs_finite(_logits_or_all(out))


def nonfinite_facts(
    step: int, micro: list[float], held, model, *, now: int, weights_step: int | None, half: bool, autocast,
    replay_skip: str | None, save,
) -> dict[str, Any]:  # fmt: skip
    """The facts of a non-finite step for :func:`hf_sanity.rules.training.loss.classify`: the offending batch
    (saved with ``save(batch, name)``), then its replay on the model, unless ``replay_skip`` says why not (a
    sharded model: a one-rank forward would deadlock, see :mod:`hf_sanity.training.shards`) or its weights went
    non-finite since (the values were read at step ``now``)."""
    import math

    facts: dict[str, Any] = {"half_precision": half}
    index = next((i for i, x in enumerate(micro) if not math.isfinite(x)), 0)
    batch = held.get(step, index)
    if batch is None:
        facts["replay_skipped"] = "the batch is no longer held"
        return facts
    facts["batch_file"] = save(batch, f"nonfinite-loss-step{step}")
    skip = replay_skip or (None if model is not None else "no model")
    if skip is None and weights_step != step and not weights_finite(model):
        skip = f"the weights are non-finite by step {now} (read later than step {step})"
    facts.update(diagnose(batch, None if skip else model, half_precision=half, autocast=autocast, skip=skip))
    if not skip:
        facts["replay_weights"] = "same step" if weights_step == step else f"step {now}"
    return facts


def first_nonfinite(
    sink, sampler, held, model, *, step: int, micro: list[float], now: int, weights_step: int | None, autocast
) -> dict[str, Any]:
    """The facts of the run's first non-finite loss (:func:`nonfinite_facts`); {} once it is reported, or
    with `nonfinite-loss` off. ``sampler`` tells the precision and whether a replay may run on this layout."""
    if "nonfinite-loss" in sink.counts or not sink.measures("nonfinite"):
        return {}
    half, skip = (sampler.half, sampler.sharding.replay_skip) if sampler is not None else (False, None)
    return nonfinite_facts(
        step, micro, held, model, now=now, weights_step=weights_step, half=half or bool(autocast),
        autocast=autocast or None, replay_skip=skip, save=sink.save_batch,
    )  # fmt: skip


KEEP_STEPS = 3  # = DIVERGE_STEPS of loss-diverged


class HeldBatches:
    """The batches of the steps not read yet, so that a non-finite step can be replayed and saved. A step's
    batches are released once it has been read (the current step's once it is complete)."""

    def __init__(self) -> None:
        self._by_step: dict[int, list[dict[str, Any]]] = {}

    def hold(self, step: int, batch: dict[str, Any]) -> None:
        self._by_step.setdefault(step, []).append(batch)

    def get(self, step: int, micro: int = 0) -> dict[str, Any] | None:
        batches = self._by_step.get(step, [])
        return batches[micro] if micro < len(batches) else None

    def attach(self, finding, save) -> None:
        """A blow-up names the batch at its step: saved with ``save(batch, name)``, its file in the evidence."""
        blowup = finding.rule == "grad-explosion" or finding.evidence.get("cause") == "bad-batch"
        batch = self.get(finding.step) if blowup and finding.step is not None else None
        if batch is not None:
            finding.evidence["batch_file"] = save(batch, f"{finding.rule}-step{finding.step}")

    def release(self, now: int) -> None:
        """Forget the batches of steps read by ``now``, but for the last few: a blow-up is confirmed a few steps
        after it started and names that step's batch (and the current step may still be running)."""
        for step in [s for s in self._by_step if s < now - KEEP_STEPS]:
            del self._by_step[step]
