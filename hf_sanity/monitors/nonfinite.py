"""Why a loss went NaN/Inf: the facts measured on the offending batch, and the verdict.

:func:`classify` is pure (facts and numbers in, a cause out). The callback gathers the facts with the
helpers below: non-finite values in the batch itself, its supervised tokens, and a replay of the batch with
a forward hook on every module (first non-finite output; are the logits finite; in half precision, is the
same forward finite in float32). A replay never touches gradients, RNG or train/eval modes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_sanity.monitors.base import finite, median

CAUSES = ("input", "empty-loss-mask", "lr-too-high", "unsafe-math", "precision-overflow", "unknown")
# The fix for each cause; the catalog's fix lists them all.
FIX_BY_CAUSE = {
    "input": "Find where the non-finite values enter the batch (the saved batch shows them) and clean or drop them.",
    "empty-loss-mask": "Drop batches without supervised tokens or fix the labels mask (empty-loss-mask shows which "
    "examples carry no loss); a mean over zero tokens is 0/0.",
    "lr-too-high": "Lower the learning rate or lengthen the warmup, and keep gradient clipping on (max_grad_norm).",
    "unsafe-math": "The model's outputs are finite; the loss computation is not. Use log_softmax / "
    "F.cross_entropy instead of log(softmax(...)), and guard log(0), exp overflow and division by zero.",
    "precision-overflow": "The same batch is finite in float32: train in bf16 instead of fp16, or keep the "
    "overflowing module (evidence.module) in float32.",
}
BLOW_UP = 10.0  # a grad norm (or loss) 10x its earlier median: the run was diverging
IGNORE_INDEX = -100


def blew_up(grad_norms: Sequence[float], losses: Sequence[float], recent: int = 3) -> str | None:
    """Why the steps before a non-finite loss look like divergence (None when they do not)."""
    if any(not math.isfinite(g) for g in grad_norms[-recent:]):
        return "the gradient norm was already non-finite on the steps before"
    gn = finite(grad_norms)
    if len(gn) >= 2:
        earlier = gn[:-recent] if len(gn) > recent else gn[:1]
        base = median(earlier)
        peak = max(gn[-recent:])
        if base > 0 and peak > BLOW_UP * base:
            return f"the gradient norm rose to {peak:.3g}, {peak / base:.0f}x its earlier median {base:.3g}"
    ls = finite(losses)
    if len(ls) >= 2:
        start = min(ls[: max(1, len(ls) - recent)])
        peak = max(ls[-recent:])
        if start > 0 and peak > BLOW_UP * start:
            return f"the loss rose to {peak:.3g}, {peak / start:.0f}x its earlier minimum {start:.3g}"
    return None


def classify(
    facts: Mapping[str, Any], *, grad_norms: Sequence[float] = (), losses: Sequence[float] = ()
) -> tuple[str, str]:
    """The cause of a non-finite loss and the reason, from what was measured on the offending batch.

    ``facts``: ``input_nonfinite`` (names of batch tensors holding NaN/Inf), ``supervised_tokens``,
    ``logits_finite`` (the replayed forward's outputs were all finite), ``half_precision`` and
    ``fp32_finite`` (the same batch recomputed in float32 gave a finite loss). ``grad_norms``/``losses`` are
    the steps before.
    """
    if facts.get("input_nonfinite"):
        names = ", ".join(facts["input_nonfinite"])
        return "input", f"the batch itself holds non-finite values ({names})"
    if facts.get("supervised_tokens") == 0:
        return (
            "empty-loss-mask",
            "the batch has no supervised token (every label is -100): the mean loss is 0/0",
        )
    diverging = blew_up(grad_norms, losses)
    if diverging:
        return "lr-too-high", diverging
    if facts.get("nonfinite_weights"):
        return (
            "lr-too-high",
            f"the weights were already non-finite ({facts['nonfinite_weights'][0]}, ...) after an update",
        )
    if facts.get("logits_finite") is True:
        return (
            "unsafe-math",
            "every module output and the logits are finite: the loss computation made the NaN/Inf",
        )
    if facts.get("half_precision") and facts.get("fp32_finite") is True:
        return "precision-overflow", "the forward is non-finite in half precision but finite in float32"
    return "unknown", "no measured cause; reproduce on the saved batch"


# -- facts about a batch (torch) ---------------------------------------------------------------------
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


@contextlib.contextmanager
def quiet_forward(model):
    """No grad, eval mode (restored module by module), RNG states restored: a forward that changes nothing."""
    import torch

    from hf_sanity.rng import preserved_rng

    modes = [(m, m.training) for m in model.modules()]
    try:
        with preserved_rng(), torch.no_grad():
            model.eval()
            yield
    finally:
        for module, mode in modes:
            module.training = mode


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
    output is non-finite, and whether the final output was finite."""
    names = {m: n for n, m in model.named_modules()}
    first: list[str] = []

    def hook(module, args, output):
        if not first and not _outputs_finite(output):
            first.append(names.get(module) or type(module).__name__)

    handles = [m.register_forward_hook(hook) for m in names]
    try:
        output = call()
    finally:
        for handle in handles:
            handle.remove()
    final_ok = _outputs_finite(getattr(output, "logits", output))
    return (first[0] if first else None), final_ok


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

    kwargs = {k: v for k, v in batch.items() if k not in ("labels", "num_items_in_batch")}
    kwargs["use_cache"] = False
    facts: dict[str, Any] = {"replayed": True}
    bad = nonfinite_weights(model)
    if bad:
        facts["nonfinite_weights"] = bad
    cast = torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext()
    with quiet_forward(model):
        with cast:
            module, final_ok = first_nonfinite_module(model, lambda: model(**kwargs))
        facts["module"] = module
        facts["logits_finite"] = module is None and final_ok
        facts["reproduced"] = not facts["logits_finite"]
        if half_precision and not facts["logits_finite"] and not bad:
            facts["fp32_finite"] = _fp32_finite(model, kwargs, fp32_limit)
    return facts


def diagnose(
    batch: Mapping[str, Any], model, *, half_precision: bool, autocast=None, skip: str | None = None
) -> dict[str, Any]:
    """The facts :func:`classify` reads, for one offending batch: its own non-finite values and supervised
    tokens, then (with a ``model``, unless ``skip`` says why not) a replay on the model's device."""
    from hf_sanity.monitors.probe import model_inputs

    facts: dict[str, Any] = {
        "input_nonfinite": nonfinite_inputs(batch) or None,
        "supervised_tokens": supervised_tokens(batch),
    }
    if skip or model is None:
        facts["replay_skipped"] = skip or "no model"
        return facts
    device = next(model.parameters()).device
    moved = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
    facts.update(replay(model, model_inputs(moved), half_precision=half_precision, autocast=autocast))
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

    device_type = next(model.parameters()).device.type
    forward = getattr(model, "_original_forward", None)  # accelerate's forward without its autocast
    params_half = any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
    with torch.autocast(device_type=device_type, enabled=False):
        if not params_half:
            call = forward if forward is not None else model
            out = call(**kwargs)
            return _outputs_finite(getattr(out, "logits", out))
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
        return _outputs_finite(getattr(out, "logits", out))
