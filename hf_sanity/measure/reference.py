"""Whether a preference or RL trainer's reference model is its initial policy, and what would make it differ.

DPO, KTO and GRPO with beta > 0 measure the policy against a reference that must equal the policy at step 0
(the implicit rewards are then exactly 0). What TRL 1.16 does: a PEFT model's reference is the model with its
adapter disabled (or a frozen copy named ``"ref"`` of a pretrained adapter); a full fine-tune's reference is
reloaded from ``model.config._name_or_path``, so an in-memory change to the policy (SFT in the same process,
edited weights) is not in it; dropout makes the policy's forward (train mode) differ from the reference's
(eval mode), and TRL's ``disable_dropout`` zeroes ``nn.Dropout`` modules only, not a config's functional
``attention_dropout``. These facts are read without a forward pass.
"""

from __future__ import annotations

from typing import Any

DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                "hidden_dropout_prob", "attention_probs_dropout_prob", "activation_dropout")  # fmt: skip
COMPARED_TENSORS = 16  # parameters compared between policy and reference, spread over the model


def _unwrap(model):
    inner = getattr(model, "module", None)  # DDP / accelerate wrappers
    return inner if inner is not None and hasattr(inner, "named_parameters") else model


def config_dropout(model) -> dict[str, float]:
    """Dropout rates a model's config sets (applied functionally by many architectures, e.g. Llama's
    ``attention_dropout``: no ``nn.Dropout`` module holds them)."""
    config = getattr(_unwrap(model), "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = {}
    for key in DROPOUT_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, (int, float)) and value > 0:
            out[key] = float(value)
    return out


def dropout_modules(model) -> list[str]:
    import torch

    return [
        name
        for name, module in _unwrap(model).named_modules()
        if isinstance(module, torch.nn.Dropout) and module.p > 0
    ]


def parameter_distance(policy, reference) -> float | None:
    """The largest absolute difference between same-named parameters of the two models, over a spread of
    :data:`COMPARED_TENSORS` tensors (None when they share none, or a tensor is sharded: numel 0)."""
    import torch

    mine = dict(_unwrap(policy).named_parameters())
    theirs = dict(_unwrap(reference).named_parameters())
    shared = [n for n in mine if n in theirs and mine[n].shape == theirs[n].shape]
    if not shared:
        return None
    step = max(1, len(shared) // COMPARED_TENSORS)
    worst = 0.0
    with torch.no_grad():
        for name in shared[::step][:COMPARED_TENSORS] + shared[-1:]:
            a, b = mine[name], theirs[name]
            if a.numel() == 0 or b.numel() == 0:
                return None
            worst = max(worst, float((a.detach().float() - b.detach().to(a.device).float()).abs().max()))
    return worst


def adapter_state(model) -> dict[str, Any]:
    """A PEFT policy: whether its adapter is already trained (some ``lora_B`` is not zero: a new LoRA adapter
    starts with B = 0) and whether TRL gave it a frozen ``"ref"`` copy."""
    import torch

    peft_config = getattr(_unwrap(model), "peft_config", None)
    if not isinstance(peft_config, dict):
        return {}
    trained = False
    with torch.no_grad():
        for name, p in _unwrap(model).named_parameters():
            if "lora_B" in name and ".ref." not in name and p.numel() and bool(p.detach().abs().max() > 0):
                trained = True
                break
    return {"peft": True, "adapter_pretrained": trained, "ref_adapter": "ref" in peft_config}


def reference_facts(trainer) -> dict[str, Any]:
    """What could make ``trainer``'s reference differ from its policy, measured on the weights as they are."""
    model = trainer.model
    args = getattr(trainer, "args", None)
    ref = getattr(trainer, "ref_model", None)
    facts: dict[str, Any] = {
        "dropout_modules": dropout_modules(model)[:5],
        "config_dropout": config_dropout(model),
        "disable_dropout": getattr(args, "disable_dropout", None),
        "precompute_ref_log_probs": bool(getattr(args, "precompute_ref_log_probs", False)),
        "ref_model": ref is not None,
        **adapter_state(model),
    }
    if ref is not None and ref is not model:
        facts["ref_distance"] = parameter_distance(model, ref)
        path = lambda m: getattr(getattr(_unwrap(m), "config", None), "_name_or_path", None)  # noqa: E731
        facts["ref_path"], facts["policy_path"] = path(ref), path(model)
    return facts


def mismatch_cause(facts: dict[str, Any]) -> tuple[str, str]:
    """(cause, why) of a reference that is not the initial policy, from :func:`reference_facts`."""
    distance = facts.get("ref_distance")
    if distance:
        if facts.get("ref_path") and facts.get("ref_path") == facts.get("policy_path"):
            return "reloaded-from-path", (
                f"the reference was loaded from {facts['ref_path']!r} and differs from the policy in memory by up "
                f"to {distance:.3g} per weight: the policy was changed after it was loaded"
            )
        return (
            "explicit-ref",
            f"the reference model differs from the policy by up to {distance:.3g} per weight",
        )
    if facts.get("adapter_pretrained") and not facts.get("ref_adapter"):
        return (
            "adapter-reference",
            "the policy's adapter is already trained and the reference is the base model",
        )
    if facts.get("dropout_modules") or facts.get("config_dropout"):
        active = facts.get("dropout_modules") or [f"{k}={v}" for k, v in facts["config_dropout"].items()]
        return (
            "dropout",
            f"dropout is active in the policy ({', '.join(active[:3])}) and not in the reference",
        )
    if facts.get("precompute_ref_log_probs"):
        return (
            "stale-precompute",
            "the reference log-probs were precomputed and a live forward no longer gives them",
        )
    return "unknown", "no measured cause"
