"""The measurements behind the protocol's steps 2-5 (`diagnose` reports them as layers), each on a fresh
working copy of the model:

2. the step-0 loss against chance (the preflight rule ``init-loss-off-chance`` on a context over the batch);
3. shapes and masks: every module's input and output shape during one forward pass (forward hooks), and
   the preflight mask rules on the batch exactly as collated;
4. an LR range test: an exponential sweep with the setup's optimizer class;
5. precision: the batch's loss in float32 against bf16 and fp16 autocast.
"""

from __future__ import annotations

import math
import re
from typing import Any

from hf_sanity import catalog, progress
from hf_sanity.measure.tensors import forward_kwargs, model_device, to_device
from hf_sanity.protocol.loop import clip_grads, forward_loss, micro_weights, optimizer_params
from hf_sanity.protocol.pipeline import Pipeline
from hf_sanity.rules.protocol import LRSweep, PrecisionRun, check_precision
from hf_sanity.selection import Selection
from hf_sanity.untouched import preserved_rng, untouched

LR_MIN, LR_MAX, LR_PER_DECADE = 1e-7, 1.0, 8
MASK_STAGE = "tokens"
VOCAB_RULE = "vocab-size-mismatch"
INIT_RULE = "init-loss-off-chance"
INPUT_RULE = "input-ignored"  # both flat at chance: does the input reach the model at all?
LEAK_RULE = "future-token-leak"  # the causal mask, by what the model computes on the batch as collated


# -- 2. step-0 loss --------------------------------------------------------------------------------
def batch_context(pipeline: Pipeline, model=None, *, as_fed: bool = False):
    """A context over the pipeline's batches; ``as_fed``: with the first one as the model receives it (its
    own attention mask and position ids), for the checks that run the model on it."""
    from hf_sanity.measure.batches import batches_context

    tensors = [{k: v for k, v in b.items() if hasattr(v, "shape")} for b in pipeline.batches]
    first = tensors[0] if as_fed and tensors else None
    return batches_context(
        pipeline.tokenizer, tensors, model=model, max_len=pipeline.max_len, first_batch=first
    )


def run_init_loss(pipeline: Pipeline, model) -> tuple[list, dict[str, Any]]:
    if pipeline.tokenizer is None:
        return [], {"loss": None, "note": "no tokenizer: the step-0 loss check needs one"}
    ctx = batch_context(pipeline, model)
    findings = catalog.run_all("context", ctx, Selection(select=frozenset({INIT_RULE, INPUT_RULE})))
    measured = ctx.init_loss or {}
    vocab = pipeline.vocab_size or len(pipeline.tokenizer)
    stats = {
        "loss": measured.get("loss"),
        "ln_vocab": math.log(vocab),
        "model_entropy": measured.get("entropy"),
        "tokens": measured.get("tokens", 0),
    }
    if not measured:
        stats["note"] = "no supervised tokens to measure"
    return findings, stats


# -- 3. shapes and masks ---------------------------------------------------------------------------
def _describe(value) -> tuple[str, str] | None:
    """(shape, dtype) of the first tensor in a module's input or output."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return "(" + ", ".join(str(int(d)) for d in value.shape) + ")", str(value.dtype).replace("torch.", "")
    if isinstance(value, dict) or hasattr(value, "keys"):
        for key in ("logits", "last_hidden_state", "hidden_states", "input_ids", "inputs_embeds"):
            if key in value and value[key] is not None:
                found = _describe(value[key])
                if found:
                    return found
        values = list(value.values())
    elif isinstance(value, (tuple, list)):
        values = list(value)
    else:
        return None
    for item in values:
        found = _describe(item)
        if found:
            return found
    return None


def _pattern(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp``: repeated blocks fold into one row."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def shape_rows(model, batch: dict) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every module's input and output shape in one forward pass, repeated blocks folded, in call order."""
    calls: list[dict[str, Any]] = []
    open_calls: dict[int, list[int]] = {}
    handles = []

    def pre(name):
        def hook(module, args, kwargs):
            found = None
            for key in ("hidden_states", "input_ids", "inputs_embeds"):
                if kwargs.get(key) is not None:
                    found = _describe(kwargs[key])
                    break
            found = found or _describe(args) or _describe(kwargs)
            calls.append({"module": name, "type": type(module).__name__, "input": found[0] if found else "-"})
            open_calls.setdefault(id(module), []).append(len(calls) - 1)

        return hook

    def post(module, args, kwargs, output):
        stack = open_calls.get(id(module))
        if not stack:
            return
        call = calls[stack.pop()]
        found = _describe(output)
        call["output"], call["dtype"] = found if found else ("-", "-")

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name or "(model)"), with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    inputs = forward_kwargs(model, to_device(batch, model_device(model)), labels=True)
    try:
        with untouched(model):
            out = model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    rows: dict[tuple, dict[str, Any]] = {}
    for call in calls:
        key = (
            _pattern(call["module"]),
            call["type"],
            call["input"],
            call.get("output", "-"),
            call.get("dtype", "-"),
        )
        if key in rows:
            rows[key]["calls"] += 1
        else:
            rows[key] = {
                "module": key[0],
                "type": key[1],
                "input": key[2],
                "output": key[3],
                "dtype": key[4],
                "calls": 1,
            }
    ids = batch.get("input_ids")
    logits = getattr(out, "logits", None)
    summary = {
        "input_ids": list(ids.shape) if ids is not None else None,
        "labels": list(batch["labels"].shape) if hasattr(batch.get("labels"), "shape") else None,
        "logits": list(logits.shape) if logits is not None else None,
    }
    summary["consistent"] = bool(
        summary["input_ids"] is not None
        and (summary["labels"] is None or summary["labels"] == summary["input_ids"])
        and (summary["logits"] is None or summary["logits"][:2] == summary["input_ids"][:2])
    )
    return list(rows.values()), summary


def run_masks(pipeline: Pipeline, model) -> tuple[list, dict[str, Any]]:
    if pipeline.tokenizer is None:
        return [], {"note": "no tokenizer: the mask checks need one"}
    ctx = batch_context(pipeline, model)
    findings = catalog.run_all("context", ctx, Selection(), stages=(MASK_STAGE,))
    findings += catalog.run_all("context", ctx, Selection(select=frozenset({VOCAB_RULE})))
    as_fed = batch_context(pipeline, model, as_fed=True)
    findings += catalog.run_all("context", as_fed, Selection(select=frozenset({LEAK_RULE})))
    leak = as_fed.future_leak
    return findings, {
        "examples": len(ctx),
        "tokens": int(ctx.col("n_tokens").sum()),
        "supervised_tokens": int(ctx.col("n_supervised_kept").sum()),
        "rules": sorted({f.rule for f in findings}),
        "causal_rows_checked": len(leak["rows"]) if leak else 0,
    }


# -- 4. LR range -----------------------------------------------------------------------------------
def lr_grid(low: float = LR_MIN, high: float = LR_MAX, per_decade: int = LR_PER_DECADE) -> list[float]:
    count = max(1, round(math.log10(high / low) * per_decade))
    return [low * (high / low) ** (i / count) for i in range(count + 1)]


def run_lr_range(pipeline: Pipeline, lrs: list[float] | None = None) -> tuple[LRSweep, dict[str, Any]]:
    """The sweep: one optimizer step per LR on the examples, stopping once the loss diverges."""
    import torch

    from hf_sanity.rules.protocol import divergence_index

    lrs = lrs or lr_grid()
    seen_lrs: list[float] = []
    losses: list[float] = []
    error = None
    with preserved_rng():
        torch.manual_seed(0)
        model = pipeline.working_copy()
        learner = pipeline.bind(model, lrs[0])
        weights = micro_weights(pipeline.batches)
        held = optimizer_params(learner.optimizer)
        with progress.phase("LR range test", total=len(lrs)):
            for lr in progress.each(lrs):
                for group in learner.optimizer.param_groups:
                    group["lr"] = lr
                for p in model.parameters():
                    p.grad = None
                try:
                    loss, _ = forward_loss(learner, pipeline.batches, weights)
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    break
                seen_lrs.append(lr)
                losses.append(float(loss.detach().float()))
                if divergence_index(losses) is not None:
                    break
                if loss.requires_grad:
                    loss.backward()
                clip_grads(held, pipeline.max_grad_norm)
                learner.optimizer.step()
        del model, learner
    sweep = LRSweep(
        lrs=seen_lrs, losses=losses, lr_min=lrs[0], lr_max=lrs[-1], configured_lr=pipeline.configured_lr
    )
    i = sweep.divergence
    stats = {
        "lr_min": lrs[0],
        "lr_max": lrs[-1],
        "steps": len(losses),
        "diverges_at": seen_lrs[i] if i is not None else None,
        "suggested_lr": sweep.suggestion,
        "configured_lr": pipeline.configured_lr,
        "lrs": [float(f"{lr:.4g}") for lr in seen_lrs],
        "losses": [round(x, 5) if math.isfinite(x) else str(x) for x in losses],
    }
    if error:
        stats["error"] = error
    return sweep, stats


# -- 5. precision ----------------------------------------------------------------------------------
HALF_FORMATS = ("bfloat16", "float16")
STATUS_OF = {"error": "failed", "warning": "warning", "info": "warning"}


def half_support(device) -> dict[str, str | None]:
    """For each half format: None when autocast runs it on this device, else why not."""
    import torch

    out: dict[str, str | None] = {}
    for name in HALF_FORMATS:
        dtype = getattr(torch, name)
        if device.type == "cuda" and name == "bfloat16" and not torch.cuda.is_bf16_supported():
            out[name] = "this GPU has no bf16"
            continue
        try:
            x = torch.ones(2, 2, device=device)
            with torch.autocast(device.type, dtype=dtype):
                y = x @ x
            out[name] = None if y.dtype == dtype else f"autocast on {device.type} does not compute in {name}"
        except Exception as exc:
            out[name] = f"autocast on {device.type} does not support {name} ({type(exc).__name__})"
    return out


def _overflow_scan(model, batches, learner, weights, limit: float) -> tuple[str | None, float]:
    """The first weight (autocast casts it) or, in a float32 pass, the first module output that exceeds
    ``limit`` in magnitude; and the largest magnitude seen anywhere."""
    import torch

    state: dict[str, Any] = {"first": None, "max": 0.0}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.numel():
                peak = float(p.detach().abs().max())
                state["max"] = max(state["max"], peak)
                if state["first"] is None and peak > limit:
                    state["first"] = f"{name} (a weight, max |w| = {peak:.3g})"

    def make(name):
        def hook(module, args, output):
            found = output if hasattr(output, "abs") else None
            if found is None and isinstance(output, (tuple, list)) and output and hasattr(output[0], "abs"):
                found = output[0]
            if found is None or not found.is_floating_point() or found.numel() == 0:
                return
            peak = float(found.detach().abs().max())
            state["max"] = max(state["max"], peak) if math.isfinite(peak) else state["max"]
            if state["first"] is None and (peak > limit or not math.isfinite(peak)):
                state["first"] = f"{name} ({type(module).__name__}, max |x| = {peak:.3g})"

        return hook

    handles = [m.register_forward_hook(make(n or "(model)")) for n, m in model.named_modules()]
    try:
        with torch.no_grad():
            forward_loss(learner, batches, weights)
    finally:
        for handle in handles:
            handle.remove()
    return state["first"], state["max"]


def run_precision(pipeline: Pipeline) -> tuple[PrecisionRun, dict[str, Any]]:
    import torch

    from hf_sanity.rules.protocol import precision_tolerance

    with preserved_rng():
        torch.manual_seed(0)
        model = pipeline.working_copy(dtype=torch.float32)
        learner = pipeline.bind(model, pipeline.lr)
        weights = micro_weights(pipeline.batches)
        device = model_device(model)
        with torch.no_grad():
            fp32 = float(forward_loss(learner, pipeline.batches, weights)[0].float())
        run = PrecisionRun(
            fp32=fp32,
            half={},
            used=pipeline.precision and {"bf16": "bfloat16", "fp16": "float16"}[pipeline.precision],
        )
        for name, why in half_support(device).items():
            if why is not None:
                run.skipped[name] = why
                continue
            if not math.isfinite(fp32):
                run.skipped[name] = "the float32 loss itself is not finite"
                continue
            with torch.no_grad(), torch.autocast(device.type, dtype=getattr(torch, name)):
                run.half[name] = float(forward_loss(learner, pipeline.batches, weights)[0].float())
            loss = run.half[name]
            if not math.isfinite(loss) or abs(loss - fp32) > precision_tolerance(name, fp32):
                first, peak = _overflow_scan(
                    model, pipeline.batches, learner, weights, torch.finfo(getattr(torch, name)).max
                )
                run.max_abs[name] = peak
                if first:
                    run.overflow[name] = first
        del model, learner
    findings = check_precision(run)
    flagged = {f.evidence["dtype"]: f.severity for f in findings}
    stats = {
        "fp32": fp32,
        "half": {
            name: {
                "loss": loss,
                "difference": abs(loss - fp32) if math.isfinite(loss) else None,
                "tolerance": round(precision_tolerance(name, fp32), 5),
                "status": STATUS_OF.get(flagged.get(name), "passed"),
            }
            for name, loss in run.half.items()
        },
        "skipped": run.skipped,
        "trainer_precision": run.used,
    }
    return run, stats
