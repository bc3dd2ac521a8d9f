"""Adapter rules: a saved PEFT/LoRA adapter against the base model it will be served on."""

from __future__ import annotations

from pathlib import Path

from hf_sanity.catalog import define
from hf_sanity.measure.adapters import adapter_config, adapter_state, lora_keys, module_path
from hf_sanity.measure.objective import ANY


def has_adapter(ctx) -> bool:
    """A saved adapter to check against the model, or a model object that carries one."""
    if not ctx.has_model:
        return False
    return bool(ctx.adapter_path) or (ctx.model_given and bool(getattr(ctx.model, "peft_config", None)))


ADAPTER_EMPTY = define(
    "adapter-empty",
    severity="error",
    stage="model",
    objectives=ANY,
    symptom="The adapter loads without an error and does nothing, or fails to load on another machine: it was "
    "saved without its weights (a 40-byte to 500-KB adapter_model.safetensors under DeepSpeed ZeRO-3).",
    detects="The saved LoRA tensors are read: tensors with no elements (ZeRO-3 partitions saved without "
    "gathering), and A/B matrices whose rank is not the adapter_config's r (or its rank_pattern).",
    fix="Save the adapter with its parameters gathered: `trainer.save_model()` (which gathers under ZeRO-3) or "
    "`accelerator.get_state_dict(model)` passed to `save_pretrained(state_dict=...)`; with DeepSpeed set "
    "`stage3_gather_16bit_weights_on_model_save: true`.",
)


@ADAPTER_EMPTY.check(applies=lambda ctx: bool(ctx.adapter_path))
def check_adapter_empty(ctx):
    if not ctx.adapter_path:
        return
    state = adapter_state(ctx.adapter_path)
    empty = sorted(k for k, t in state.items() if t.numel() == 0)
    config = adapter_config(ctx.adapter_path)
    wrong = [
        {"tensor": key, "shape": list(t.shape), "r": rank}
        for key, t, rank in _lora_ranks(state, config)
        if t.numel() and rank is not None and t.shape[0 if ".lora_A." in key else -1] != rank
    ]
    if not empty and not wrong:
        return
    n = len(state)
    what = f"{len(empty)} of the adapter's {n} tensors have no elements" if empty else ""
    if wrong:
        what += ("; " if what else "") + (
            f"{len(wrong)} LoRA matrices do not have rank r (first: {wrong[0]['tensor']} "
            f"{wrong[0]['shape']}, r={wrong[0]['r']})"
        )
    yield ADAPTER_EMPTY.finding(
        what,
        evidence={
            "adapter": str(ctx.adapter_path),
            "tensors": n,
            "empty": empty[:10],
            "empty_count": len(empty),
            "wrong_rank": wrong[:5],
            "cause": "saved-partitioned" if empty else "rank-mismatch",
        },
        fix=None
        if empty
        else "The adapter's tensors do not match its adapter_config.json: save both from the "
        "same model with save_pretrained, and do not edit r after training.",
    )


def _lora_ranks(state: dict, config: dict):
    """(key, tensor, r) for each LoRA A/B matrix: r from ``rank_pattern`` when a pattern matches its module."""
    import re

    default, pattern = config.get("r"), config.get("rank_pattern") or {}
    for key, tensor in state.items():
        if ".lora_A." not in key and ".lora_B." not in key:
            continue
        path = module_path(key)
        rank = next((r for p, r in pattern.items() if re.search(rf"(^|\.){p}$", path)), default)
        yield key, tensor, rank


ADAPTER_UNTRAINED = define(
    "adapter-untrained",
    severity="error",
    stage="model",
    objectives=ANY,
    symptom="Fine-tune produces base-model-quality output: the adapter computes exactly nothing.",
    detects="Every saved LoRA B matrix is zero (its initial value): the adapter was saved before any update, or "
    "its updates never reached it.",
    fix="Check that training ran and updated the adapter (run the overfit test), and that you saved the trained "
    "model, not a fresh get_peft_model copy.",
    needs=("adapter-empty",),
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
    objectives=ANY,
    symptom="Garbage output, or a load error, after attaching an adapter to a different base than it was trained on.",
    detects="The adapter's LoRA shapes are compared with the base model's modules (in/out features); the "
    "adapter_config's base_model_name_or_path is compared with the model's name (a warning when only the "
    "name differs).",
    fix="Serve the adapter on the base model it was trained from (adapter_config.json: base_model_name_or_path).",
    needs=("adapter-empty",),
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
    objectives=ANY,
    symptom="Fine-tune produces base-model-quality output: the adapter is not applied at inference.",
    detects="The adapter's target modules match nothing in the base model, or — with a trained adapter — the "
    "model's outputs with the adapter attached equal the base model's on a sample batch.",
    fix="Load with PeftModel.from_pretrained(base, adapter) (or merge_and_unload() and save the merged model) and "
    "serve that model; check target_modules against the base model's module names.",
    needs=("adapter-empty", "adapter-base-mismatch", "vocab-size-mismatch"),
)


@ADAPTER_NOT_LOADED.check(applies=has_adapter)
def check_adapter_not_loaded(ctx):
    if not ctx.has_model:
        return
    if ctx.served_model is not None:
        yield from served_base_findings(ctx.served)
    elif ctx.adapter_path:
        yield from _saved_adapter_applies(ctx)
    elif getattr(ctx.model, "peft_config", None):
        yield from _attached_adapter_active(ctx)


def _saved_adapter_applies(ctx):

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
    # An untrained adapter equals the base by construction: adapter-untrained says so.
    if trained and ctx.adapter_changes_outputs is False:
        yield ADAPTER_NOT_LOADED.finding(
            "with the adapter attached the model's outputs equal the base model's exactly",
            evidence={"adapter": str(ctx.adapter_path), "matched_modules": len(matched)},
        )


def _attached_adapter_active(ctx):
    model = ctx.model
    trained = any(float(p.detach().abs().max()) > 0 for n, p in model.named_parameters() if "lora_B" in n)
    if trained and ctx.adapter_changes_outputs is False:
        yield ADAPTER_NOT_LOADED.finding(
            "the model carries a trained adapter, but its outputs equal the base model's: the adapter is not active",
            evidence={"active_adapter": getattr(model, "active_adapter", None)},
        )


def served_base_findings(served):
    """``adapter-not-loaded`` when the served model computes the base model's outputs, not the trained ones."""
    if served is None or served.served_vs_base is None or served.trained_vs_base is None:
        return
    limit = served.tolerance * served.logit_scale
    if served.served_vs_base <= limit < served.trained_vs_base and served.served_vs_trained > limit:
        yield ADAPTER_NOT_LOADED.finding(
            "the served model computes the base model's outputs, not the trained adapter's",
            evidence={
                "max_logit_gap_to_trained": served.served_vs_trained,
                "max_logit_gap_to_base": served.served_vs_base,
                "cause": "served-base",
            },
        )


SERVED_MODEL_DIFFERS = define(
    "served-model-differs",
    severity="error",
    stage="model",
    objectives=ANY,
    symptom="The model in production is worse than the one evaluated after training, or garbles the tokens "
    "added for fine-tuning: the merge, the save or the reload lost part of what was trained.",
    detects="The served model (merged and reloaded, e.g. `hf-sanity served --model MERGED`) is compared with "
    "the trained one (the base with the adapter attached): logits on a sample batch, every input-embedding row "
    "(rows of added tokens trained but not saved) and the LM head (a tied head untied, or a saved head lost). "
    "Differences above rounding (1e-3 of the logits' scale; in bf16/fp16 3e-2 of it, or a tenth of what the "
    "adapter changes) are reported with their cause.",
    fix="Merge the model the adapter was trained on (the same resized embeddings, the same dtype), save with "
    "`save_pretrained` after `merge_and_unload()`, and save trained embeddings with the adapter "
    "(`modules_to_save=['embed_tokens', 'lm_head']` or `save_embedding_layers=True`).",
    needs=("adapter-not-loaded",),
)


@SERVED_MODEL_DIFFERS.check(applies=lambda ctx: ctx.served_model is not None and bool(ctx.adapter_path))
def check_served_model(ctx):
    yield from served_differs_findings(ctx.served, ctx.tokenizer)


def served_differs_findings(served, tokenizer=None):
    """``served-model-differs`` with its cause: the rows of the input embedding that changed (added tokens, or
    others), the LM head, or the logits alone (the weights of the merged layers)."""
    if served is None or list(served_base_findings(served)):
        return  # served == base is adapter-not-loaded's finding
    logit_limit = served.logit_limit
    rows = served.embedding_rows_differ
    head = served.head_difference
    head_off = head is not None and head > served.tolerance * served.head_scale
    sizes_differ = served.embedding_rows[0] != served.embedding_rows[1]
    if not rows and not head_off and not sizes_differ and served.served_vs_trained <= logit_limit:
        return
    added = _added_ids(tokenizer)
    evidence = {
        "max_logit_gap": served.served_vs_trained,
        "tolerance": logit_limit,
        "embedding_rows_differ": len(rows),
        "embedding_rows": list(served.embedding_rows),
        "head_difference": head,
        "tied": {"trained": served.tied[0], "served": served.tied[1]},
    }
    if sizes_differ:
        cause = "embedding-size"
        message = (
            f"the served model has {served.embedding_rows[1]:,} embedding rows, the trained one "
            f"{served.embedding_rows[0]:,}"
        )
    elif rows:
        cause = "added-token-rows" if added and set(rows) <= added else "embedding-rows"
        tokens = tokenizer.convert_ids_to_tokens(rows[:5]) if tokenizer is not None else rows[:5]
        message = (
            f"{len(rows)} input-embedding rows of the served model differ from the trained ones: {tokens}"
        )
        evidence["token_ids"] = rows[:20]
    elif head_off:
        cause = "lm-head"
        message = f"the served model's LM head differs from the trained one by up to {head:.3g}"
        if served.tied[0] != served.tied[1]:
            message += f" (tied in {'training' if served.tied[0] else 'serving'} only)"
    else:
        cause = "weights"
        message = (
            f"the served model's logits differ from the trained model's by up to {served.served_vs_trained:.3g} "
            f"({served.served_vs_trained / served.logit_scale:.1%} of their scale)"
        )
    evidence["cause"] = cause
    yield SERVED_MODEL_DIFFERS.finding(message, evidence=evidence, fix=SERVED_FIX.get(cause))


SERVED_FIX = {
    "added-token-rows": "The rows of the tokens added for training were not saved or not merged: save the "
    "trained embeddings with the adapter (`modules_to_save=['embed_tokens', 'lm_head']`, or "
    "`save_embedding_layers=True` in save_pretrained), and resize the base to the tokenizer before merging.",
    "embedding-size": "Resize the base model to the trained tokenizer (`resize_token_embeddings(len(tokenizer))`) "
    "before attaching the adapter and merging, and save that model.",
    "lm-head": "The head served is not the head trained: keep `tie_word_embeddings` as in training, and save a "
    "trained head with the adapter (`modules_to_save=['lm_head']`) so the merge includes it.",
    "weights": "Merge in the dtype the adapter was trained in (merging LoRA into a 4-bit or bf16 base rounds "
    "the update), then save with save_pretrained; check that the merged adapter is the trained one.",
}


def _added_ids(tokenizer) -> set[int]:
    if tokenizer is None:
        return set()
    base = getattr(tokenizer, "vocab_size", None)
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return {i for i in added if base is None or i >= base}


def served_model_findings(trained, served, batch, *, base=None):
    """What is served must compute what was trained: the served model (e.g. merged and reloaded from disk)
    against the trained adapter model on ``batch``, and against the base model's outputs when given, with
    the same judgement as ``hf-sanity served`` (``adapter-not-loaded``, ``served-model-differs``)."""
    from hf_sanity.measure.served import compare_served

    comparison = compare_served(trained, served, batch, base=base)
    return [*served_base_findings(comparison), *served_differs_findings(comparison)]
