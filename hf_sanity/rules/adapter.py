"""Adapter rules: a saved PEFT/LoRA adapter against the base model it will be served on."""

from __future__ import annotations

from pathlib import Path

from hf_sanity.catalog import define
from hf_sanity.measure.adapters import adapter_config, adapter_state, attached_adapter, lora_keys, module_path
from hf_sanity.measure.tensors import forward_kwargs, model_device, to_device


def has_adapter(ctx) -> bool:
    """A saved adapter to check against the model, or a model object that carries one."""
    if not ctx.has_model:
        return False
    return bool(ctx.adapter_path) or (ctx.model_given and bool(getattr(ctx.model, "peft_config", None)))


ADAPTER_UNTRAINED = define(
    "adapter-untrained",
    severity="error",
    stage="model",
    symptom="Fine-tune produces base-model-quality output: the adapter computes exactly nothing.",
    detects="Every saved LoRA B matrix is zero (its initial value): the adapter was saved before any update, or "
    "its updates never reached it.",
    fix="Check that training ran and updated the adapter (run the overfit test), and that you saved the trained "
    "model, not a fresh get_peft_model copy.",
)


@ADAPTER_UNTRAINED.check(applies=lambda ctx: bool(ctx.adapter_path))
def check_adapter_untrained(ctx):
    if not ctx.adapter_path:
        return
    b = lora_keys(adapter_state(ctx.adapter_path), "B")
    if b and all(float(t.abs().max()) == 0.0 for t in b.values()):
        yield ADAPTER_UNTRAINED.finding(
            f"all {len(b)} LoRA B matrices of the adapter are zero",
            evidence={"adapter": str(ctx.adapter_path), "lora_B_tensors": len(b)},
        )


ADAPTER_BASE_MISMATCH = define(
    "adapter-base-mismatch",
    severity="error",
    stage="model",
    symptom="Garbage output, or a load error, after attaching an adapter to a different base than it was trained on.",
    detects="The adapter's LoRA shapes are compared with the base model's modules (in/out features); the "
    "adapter_config's base_model_name_or_path is compared with the model's name (a warning when only the "
    "name differs).",
    fix="Serve the adapter on the base model it was trained from (adapter_config.json: base_model_name_or_path).",
)


@ADAPTER_BASE_MISMATCH.check(applies=lambda ctx: bool(ctx.adapter_path) and ctx.has_model)
def check_adapter_base(ctx):
    if not ctx.adapter_path or not ctx.has_model:
        return
    state = adapter_state(ctx.adapter_path)
    modules = dict(ctx.model.named_modules())
    wrong = []
    for key, tensor in lora_keys(state, "A").items():
        module = modules.get(module_path(key))
        if module is not None and getattr(module, "in_features", None) not in (None, tensor.shape[1]):
            wrong.append(
                {
                    "module": module_path(key),
                    "adapter_in": int(tensor.shape[1]),
                    "model_in": module.in_features,
                }
            )
    for key, tensor in lora_keys(state, "B").items():
        module = modules.get(module_path(key))
        if module is not None and getattr(module, "out_features", None) not in (None, tensor.shape[0]):
            wrong.append(
                {
                    "module": module_path(key),
                    "adapter_out": int(tensor.shape[0]),
                    "model_out": module.out_features,
                }
            )
    base = adapter_config(ctx.adapter_path).get("base_model_name_or_path")
    name = getattr(ctx.model_config, "_name_or_path", "") or ""
    if wrong:
        yield ADAPTER_BASE_MISMATCH.finding(
            f"{len(wrong)} adapter matrices do not fit the base model's modules (first: {wrong[0]['module']})",
            evidence={"mismatches": wrong[:5], "adapter_base": base, "model": name},
        )
    elif base and name and not (Path(base).name == Path(name).name or base in name or name in base):
        yield ADAPTER_BASE_MISMATCH.finding(
            f"the adapter was trained on {base!r} but is loaded on {name!r}",
            evidence={"adapter_base": base, "model": name},
            severity="warning",
        )


ADAPTER_NOT_LOADED = define(
    "adapter-not-loaded",
    severity="error",
    stage="model",
    symptom="Fine-tune produces base-model-quality output: the adapter is not applied at inference.",
    detects="The adapter's target modules match nothing in the base model, or — with a trained adapter — the "
    "model's outputs with the adapter attached equal the base model's on a sample batch.",
    fix="Load with PeftModel.from_pretrained(base, adapter) (or merge_and_unload() and save the merged model) and "
    "serve that model; check target_modules against the base model's module names.",
    needs=("adapter-base-mismatch", "vocab-size-mismatch"),
)


@ADAPTER_NOT_LOADED.check(applies=has_adapter)
def check_adapter_not_loaded(ctx):
    if not ctx.has_model:
        return
    if ctx.adapter_path:
        yield from _saved_adapter_applies(ctx)
    elif getattr(ctx.model, "peft_config", None):
        yield from _attached_adapter_active(ctx)


def _saved_adapter_applies(ctx):
    import torch

    state = adapter_state(ctx.adapter_path)
    modules = {name for name, _ in ctx.model.named_modules()}
    targets = {module_path(k) for k in lora_keys(state, "A")}
    matched = targets & modules
    if targets and not matched:
        yield ADAPTER_NOT_LOADED.finding(
            f"none of the adapter's {len(targets)} target modules exists in the base model",
            evidence={"adapter_modules": sorted(targets)[:5], "model_modules": sorted(modules)[:5]},
        )
        return
    trained = any(float(t.abs().max()) > 0 for t in lora_keys(state, "B").values())
    batch = _probe_batch(ctx)
    if not trained or batch is None:
        return  # an untrained adapter equals the base by construction: adapter-untrained says so
    base_logits = _logits(ctx.model, batch)
    with attached_adapter(ctx.model, ctx.adapter_path) as peft_model:
        adapted = _logits(peft_model, batch)
    if torch.equal(base_logits, adapted):
        yield ADAPTER_NOT_LOADED.finding(
            "with the adapter attached the model's outputs equal the base model's exactly",
            evidence={"adapter": str(ctx.adapter_path), "matched_modules": len(matched)},
        )


def _attached_adapter_active(ctx):
    import torch

    model = ctx.model
    trained = any(float(p.detach().abs().max()) > 0 for n, p in model.named_parameters() if "lora_B" in n)
    batch = _probe_batch(ctx)
    if not trained or batch is None or not hasattr(model, "disable_adapter"):
        return
    adapted = _logits(model, batch)
    with model.disable_adapter():
        base = _logits(model, batch)
    if torch.equal(base, adapted):
        yield ADAPTER_NOT_LOADED.finding(
            "the model carries a trained adapter, but its outputs equal the base model's: the adapter is not active",
            evidence={"active_adapter": getattr(model, "active_adapter", None)},
        )


def _probe_batch(ctx):
    batches = ctx.sample_batches(batch_size=4)
    return batches[0] if batches else None


def _logits(model, batch):

    from hf_sanity.untouched import untouched

    with untouched(model):
        inputs = forward_kwargs(model, to_device(batch, model_device(model)))
        return model(**inputs).logits.float().cpu()


def served_model_findings(trained, served, batch, *, base=None, atol: float = 1e-3):
    """What is served must compute what was trained. Compares the logits of the served model (e.g. merged
    and reloaded from disk) with the trained adapter model's on ``batch``, and with the base model's when
    given: ``adapter-not-loaded`` when the served model is the base model in disguise or differs from the
    trained one."""
    import torch

    trained_logits = _logits(trained, batch)
    served_logits = _logits(served, batch)
    scale = float(trained_logits.abs().max()) or 1.0
    gap = float((served_logits - trained_logits).abs().max())
    findings = []
    if base is not None:
        base_logits = _logits(base, batch)
        if torch.allclose(served_logits, base_logits, atol=atol * scale) and not torch.allclose(
            trained_logits, base_logits, atol=atol * scale
        ):
            findings.append(
                ADAPTER_NOT_LOADED.finding(
                    "the served model computes the base model's outputs, not the trained adapter's",
                    evidence={"max_logit_gap_to_trained": gap, "served": type(served).__name__},
                )
            )
            return findings
    if gap > atol * scale:
        findings.append(
            ADAPTER_NOT_LOADED.finding(
                f"the served model's logits differ from the trained model's by up to {gap:.3g}",
                evidence={"max_logit_gap_to_trained": gap, "tolerance": atol * scale},
            )
        )
    return findings
