"""`config-not-applied`: a config field that shapes the forward, set on a model already built, which its modules
never read (the measurement: `hf_sanity.measure.config_applied`)."""

from __future__ import annotations

from hf_sanity.catalog import define
from hf_sanity.measure.objective import ANY

CONFIG_NOT_APPLIED = define(
    "config-not-applied",
    severity="error",
    stage="model",
    objectives=ANY,
    symptom="RoPE scaling (or a new rope_theta, or another attention implementation) was set on the model's config "
    "and the context was believed extended: the model trains exactly as before (its logits are byte-identical), "
    "while the saved config.json says otherwise, so the served model, rebuilt from it, is not the trained one "
    "(or does not load).",
    detects="On a model object (given, or a trainer's): each rotary embedding is rebuilt from a copy of its "
    "config and compared with the one in the model (RoPE type, `inv_freq` to rounding, attention scaling): "
    "a difference, or a config that no longer builds one, is an error (cause `rope`). `attn_implementation` set "
    "on the config as a plain attribute that is not the implementation the model runs, and a mixture of "
    "experts' `router_aux_loss_coef` in the config that is not the one its loss uses (read once, when built; "
    "not judged under TRL's trainers, which weigh it themselves), are warnings (`attn-implementation`, "
    "`router-aux-loss-coef`).",
    fix="Pass the field when the model is built: `from_pretrained(path, rope_parameters={'rope_type': 'linear', "
    "'factor': 4.0, 'rope_theta': ...})` (or edit config.json, then load); `attn_implementation=` in "
    "`from_pretrained` or `model.set_attn_implementation(...)`; `router_aux_loss_coef=` in `from_pretrained`.",
)


def has_model_object(ctx) -> bool:
    return ctx.model_given


@CONFIG_NOT_APPLIED.check(applies=has_model_object)
def check_config_not_applied(ctx):
    from hf_sanity.measure.config_applied import (
        attention_not_applied,
        aux_coefficient_not_applied,
        rope_not_applied,
    )

    model = ctx.model
    rope = rope_not_applied(model)
    if rope:
        first = rope[0]
        if "rebuild_error" in first:
            message = (
                f"the model's config no longer builds its rotary embedding ({first['rebuild_error']}): the RoPE "
                f"parameters set after it was built are not what it computes, and the saved model will not load"
            )
        else:
            changed = ", ".join(k for k in ("rope_type", "inv_freq", "attention_scaling") if k in first)
            message = (
                f"the config's RoPE parameters are not the ones {first['module']} was built with ({changed} "
                "differ): set after the model was built, they change nothing it computes, and a reload builds "
                "another model"
            )
        yield CONFIG_NOT_APPLIED.finding(
            message, evidence={"modules": rope[:3], "cause": "rope", "model_class": type(model).__name__}
        )
    attention = attention_not_applied(model)
    if attention:
        yield CONFIG_NOT_APPLIED.finding(
            f"the config says attn_implementation={attention['declared']!r} but the model runs "
            f"{attention['effective']!r}: the attribute set on the config is not read by the model (a reload "
            "from the saved config.json uses it)",
            evidence={**attention, "cause": "attn-implementation"},
            severity="warning",
            fix="Choose the attention implementation when loading (`from_pretrained(..., "
            "attn_implementation=...)`) or with `model.set_attn_implementation(...)`.",
        )
    coefficient = None if hasattr(ctx.trainer, "aux_loss_enabled") else aux_coefficient_not_applied(model)
    if coefficient:
        yield CONFIG_NOT_APPLIED.finding(
            f"the config says router_aux_loss_coef={coefficient['declared']:g} but the model weighs its "
            f"load-balancing loss by {coefficient['built']:g}, the value it was built with",
            evidence={**coefficient, "cause": "router-aux-loss-coef"},
            severity="warning",
            fix="Pass the coefficient when loading (`from_pretrained(..., router_aux_loss_coef=...)`) or set "
            "`model.router_aux_loss_coef`; TRL's trainers take it as `router_aux_loss_coef` in their config.",
        )
