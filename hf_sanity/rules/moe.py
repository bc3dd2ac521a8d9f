"""Mixture-of-experts rules: the load-balancing loss (`moe-aux-loss-off`), what the adapter reaches
(`moe-experts-untouched`) and where the routers send the tokens while training (`expert-collapse`, a Monitor in
`hf_sanity.rules.training.moe`).

A routed model is one transformers records router logits for (`hf_sanity.measure.moe`); a dense model is never
judged here.
"""

from __future__ import annotations

from typing import Any

from hf_sanity.catalog import define
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import ANY, SFT
from hf_sanity.rules.adapter import has_adapter

MOE_AUX_LOSS_OFF = define(
    "moe-aux-loss-off",
    severity="warning",
    stage="trainer",
    objectives=ANY,
    symptom="A mixture-of-experts fine-tune sends more and more tokens to a few experts while the loss looks "
    "normal: the others stop learning, and the model serves with a fraction of its capacity.",
    detects="With a trainer, on a model with routers: whether the loss it trains on carries the router's "
    "load-balancing loss. TRL's trainers decide it when built (`aux_loss_enabled`: on when the config declares "
    "`output_router_logits` and the coefficient is not 0); a plain `Trainer` trains on the model's own loss, "
    "which holds it only when the forward returns one: in transformers 5 only with `output_router_logits=True`. "
    "The trainer's own compute_loss is run on its first batch (in training: the first step's forward) and what "
    "the model's forward returned (`aux_loss`) is read with the coefficient that weighs it. Causes: "
    "`router-logits-off`, `coefficient-zero`. A warning, not an error: a short fine-tune of a balanced router "
    "can do without it, and `expert-collapse` measures whether the router collapses.",
    fix="With `Trainer`: set `model.config.output_router_logits = True` before training (the model then adds "
    "`router_aux_loss_coef` times the load-balancing loss to the loss it returns). TRL's SFT, DPO, KTO, GRPO and "
    "RLOO trainers turn it on themselves with the config's coefficient (their `router_aux_loss_coef`; 0 turns it "
    "off).",
)

MOE_EXPERTS_UNTOUCHED = define(
    "moe-experts-untouched",
    severity="error",
    stage="model",
    objectives=ANY,
    symptom="A LoRA fine-tune of a mixture-of-experts model learns little: the adapter trains the attention "
    "layers while the experts, most of the model, never change.",
    detects="With an adapter (a PEFT model, a trainer's, or a saved one with --adapter) on a model with routers: "
    "the routed experts' share of the base model's parameters and the adapter tensors on them. Experts holding "
    "50% or more of the parameters with no adapter tensor on them (and no parameter of theirs trained in full): "
    "an error, with the names that reach them in the installed peft (tried on a copy of the architecture on the "
    "meta device). An adapter on the routers: info (cause `router-adapted`: it changes which experts a token "
    "goes to).",
    fix="Put the adapter on the experts too: for fused expert weights (transformers 5) "
    "`target_parameters=['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']` in the LoraConfig (peft >= 0.17), "
    "for experts built of linear layers their names in `target_modules`; `target_modules='all-linear'` reaches "
    "the experts and the router in peft 0.21.",
    needs=("adapter-empty",),
)

EXPERT_COLLAPSE = define(
    "expert-collapse",
    severity="warning",
    stage="training",
    objectives=SFT,
    symptom="The router of a mixture of experts sends most tokens to a few experts and none to others: the run "
    "trains a fraction of its experts, and the model loses what the others knew.",
    detects="Per MoE layer, where the router sends the tokens of a fixed probe batch (the first batch's first "
    "rows), at the first step and at each probe of the predictions probe's cadence: the share of experts that get "
    "no token, and the busiest expert's load over its equal share. Dead experts above 10% and up by 10 points "
    "(and two experts) since the first step (cause `dead-experts`), or the busiest expert above 4x its share and "
    "1.5x its first-step load (`overloaded-expert`; also where it starves up to a quarter of the layer's experts "
    "with it). Judged where the probe batch gives each expert 4 assignments or more on average, at two probes "
    "in a row.",
    fix="Turn the load-balancing loss on (see `moe-aux-loss-off`) or raise `router_aux_loss_coef`; lower the "
    "learning rate, or keep the router out of the adapter (no LoRA on `mlp.gate`).",
)

EXPERT_SHARE = 0.5  # experts holding this share of the parameters or more must be reached by the adapter


# -- moe-aux-loss-off --------------------------------------------------------------------------------------
def has_routed_trainer(ctx) -> bool:
    return ctx.trainer is not None and ctx.has_model


@MOE_AUX_LOSS_OFF.check(applies=has_routed_trainer)
def check_moe_aux_loss_off(ctx):
    from hf_sanity.measure.moe import aux_term, routers_of

    if routers_of(ctx.model) is None:
        return  # a dense model: its trainer's compute_loss need not run for this
    step = ctx.trainer_step
    facts = aux_term(ctx.trainer, ctx.model, step.aux_loss if step is not None else "unknown")
    finding = aux_loss_off(facts)
    if finding is not None:
        yield finding


AUX_FIX = {
    (
        "router-logits-off",
        "model",
    ): "Set `model.config.output_router_logits = True` before training: the model "
    "then adds `router_aux_loss_coef` times its load-balancing loss to the loss `Trainer` trains on (TRL's "
    "SFTTrainer turns it on itself where its SFTConfig has `router_aux_loss_coef`).",
    (
        "router-logits-off",
        "trainer",
    ): "Set `model.config.output_router_logits = True` before building the trainer "
    "(it reads the config once, when built).",
    (
        "coefficient-zero",
        "model",
    ): "The model was built with `router_aux_loss_coef=0` (it reads the coefficient "
    "from its config once, when built): load it with `from_pretrained(..., router_aux_loss_coef=0.001)` (the "
    "Qwen3-MoE default; Mixtral's is 0.02), or set `model.router_aux_loss_coef`.",
    (
        "coefficient-zero",
        "trainer",
    ): "Set `router_aux_loss_coef` in the trainer's config to a positive value, or "
    "leave it unset to use the model config's (0.001 for Qwen3-MoE, 0.02 for Mixtral).",
    # A TRL whose config has no `router_aux_loss_coef` (TRL 0.x) weighs the loss by the model config's.
    (
        "coefficient-zero",
        "trainer-model-config",
    ): "This TRL's trainer config has no `router_aux_loss_coef`: the loss is weighed by the model config's. "
    "Load the model with `from_pretrained(..., router_aux_loss_coef=0.001)` (the Qwen3-MoE default; Mixtral's is "
    "0.02) before building the trainer.",
}


def aux_loss_off(facts: dict[str, Any] | None, *, step: int | None = None) -> Finding | None:
    """`moe-aux-loss-off` from the facts of ``measure.moe.aux_term`` (preflight and the callback's first step
    judge alike); None when the load-balancing loss is on, or when it was not measured."""
    if not facts or facts.get("enabled") is not False:
        return None
    who = facts["decided_by"]
    trainer = facts.get("trainer_class") or "the trainer"
    coefficient = facts.get("coefficient")
    if who == "trainer":
        cause = "coefficient-zero" if not coefficient else "router-logits-off"
    else:
        cause = "router-logits-off" if facts.get("returned_aux") is None else "coefficient-zero"
    if cause == "coefficient-zero":
        message = (
            f"the load-balancing loss of {facts['model_class']}'s routers is weighed by router_aux_loss_coef=0 in "
            f"{trainer}: the routers train on the language-model loss alone"
        )
    elif who == "trainer":
        message = (
            f"{trainer} adds no load-balancing loss: output_router_logits is off in {facts['model_class']}'s "
            "config, so the routers train on the language-model loss alone"
        )
    else:
        message = (
            f"{facts['model_class']}'s forward returned no load-balancing loss (aux_loss=None) in {trainer}'s "
            "compute_loss: output_router_logits is off, so the routers train on the language-model loss alone"
        )
    key = (cause, who)
    if key == ("coefficient-zero", "trainer") and facts.get("coefficient_set_in") == "model-config":
        key = (cause, "trainer-model-config")
    return MOE_AUX_LOSS_OFF.finding(message, evidence={**facts, "cause": cause}, fix=AUX_FIX[key], step=step)


# -- moe-experts-untouched ---------------------------------------------------------------------------------
@MOE_EXPERTS_UNTOUCHED.check(applies=has_adapter)
def check_moe_experts_untouched(ctx):
    from hf_sanity.measure import moe
    from hf_sanity.measure.adapters import adapter_config, adapter_state

    route = moe.routing(ctx.model)
    if route is None:
        return
    if ctx.adapter_path:
        config = adapter_config(ctx.adapter_path)
        reach = moe.saved_reach(adapter_state(ctx.adapter_path), config, route)
        existing = None
    else:
        reach = moe.model_reach(ctx.model, route)
        existing = moe.peft_config_of(ctx.model)
    if reach is None or not reach.total:
        return
    evidence = {
        "model_class": route.model_class,
        "expert_share": route.expert_share,
        "expert_parameters": route.expert_parameters,
        "parameters": route.parameters,
        "moe_layers": len(route.routers),
        "experts_per_layer": route.num_experts,
        "adapter_tensors": reach.total,
        "adapter_tensors_on_experts": reach.on_experts,
        "adapter_tensors_on_routers": reach.on_routers,
        "routers_adapted": list(reach.router_layers[:5]),
        "target_modules": reach.target_modules,
        "target_parameters": reach.target_parameters,
        "adapter": str(ctx.adapter_path) if ctx.adapter_path else "attached",
    }
    if reach.on_experts == 0 and route.expert_share >= EXPERT_SHARE:
        targets = moe.expert_targets(ctx.model, route)
        verified = moe.reaches_experts(ctx.model, route, targets, existing) if targets else None
        evidence.update(
            suggested=targets,
            suggested_verified=verified,
            peft_version=_peft_version(),
            cause="experts-untouched",
        )
        yield MOE_EXPERTS_UNTOUCHED.finding(
            f"the routed experts hold {route.expert_share:.0%} of the parameters ({route.expert_parameters:,} of "
            f"{route.parameters:,}) and the adapter puts none of its {reach.total} tensors on them "
            f"(target_modules={reach.target_modules})",
            evidence=evidence,
            fix=_experts_fix(targets, verified),
        )
    elif reach.on_routers:
        evidence["cause"] = "router-adapted"
        yield MOE_EXPERTS_UNTOUCHED.finding(
            f"the adapter trains the routers of {len(reach.router_layers)} MoE layers (first: "
            f"{reach.router_layers[0]}): it changes which experts each token goes to",
            evidence=evidence,
            severity="info",
            fix="Keep the routers out of the adapter unless re-routing is the point (list the targets without "
            "the router: no `gate`, no `gate.weight` in `target_parameters`); with them in, keep the "
            "load-balancing loss on and watch `expert-collapse`.",
        )


def _experts_fix(targets: dict[str, list[str]], verified: bool | None) -> str:
    if not targets:
        return MOE_EXPERTS_UNTOUCHED.fix
    parts = ", ".join(f"{key}={value}" for key, value in targets.items())
    checked = (
        f" (checked with peft {_peft_version()}: it puts LoRA tensors on the experts)" if verified else ""
    )
    return f"Add the experts to the adapter: LoraConfig(..., {parts}){checked}, beside the modules it targets now."


def _peft_version() -> str | None:
    try:
        import peft
    except ImportError:
        return None
    return peft.__version__
