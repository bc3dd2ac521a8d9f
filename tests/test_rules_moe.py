"""Mixture of experts before training: the load-balancing loss (`moe-aux-loss-off`), what the adapter reaches
(`moe-experts-untouched`), and the existing checks that run a MoE trainer's own compute_loss, on the tiny
Qwen3-MoE (`hf_sanity.testing.moe`) under real `Trainer`s and `SFTTrainer`s."""

from __future__ import annotations

import math
import warnings

import pytest
from moe_setups import (
    load,
    load_for_sft,
    one_thread,  # noqa: F401 - autouse
    plain_trainer,
    sft_trainer,
    sft_turns_the_aux_loss_on,
)

from hf_sanity.drivers.preflight import preflight
from hf_sanity.measure import moe

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


EXPERT_TARGETS = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


def lora(**targets):
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", **targets)


def findings(report, slug):
    return report.by_rule(slug)


# -- the MoE SFTTrainer crash of init-loss-off-chance ---------------------------------------------------------
@pytest.mark.clean("init-loss-off-chance", "grad-accum-loss-scaling")
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_moe_sft_trainer_runs_the_step0_checks_through_its_own_compute_loss(tmp_path, accumulation):
    """TRL 1.16's compute_loss reads `current_gradient_accumulation_steps`, set by transformers' training loop only:
    preflight calls it as the loop would (a batch standing for a whole step), leaves nothing on the trainer, and
    the loss it measures is the model's cross-entropy plus the weighted load-balancing loss (TRL 0.24: the model
    loaded with `output_router_logits=True`, its compute_loss that of `Trainer`)."""
    model, tok = load_for_sft()
    trainer = sft_trainer(tmp_path, model, tok, gradient_accumulation_steps=accumulation)
    assert trainer.aux_loss_enabled  # TRL turned the load-balancing loss on from the config
    metrics = {mode: dict(values) for mode, values in trainer._metrics.items()}
    report = preflight(
        trainer=trainer, use_config=False, select=["init-loss-off-chance", "grad-accum-loss-scaling"]
    )
    assert report.findings == []  # no internal-error (conftest fails the test on one), nothing to report
    assert report.stats["step0_loss"]["tokens"] > 0  # the step-0 check measured
    assert not hasattr(trainer, "current_gradient_accumulation_steps")  # as the training loop will find it
    assert {mode: dict(values) for mode, values in trainer._metrics.items()} == metrics  # no logged trace
    from hf_sanity.measure.batches import trainer_context
    from hf_sanity.measure.forwards import trainer_step

    ctx = trainer_context(trainer)
    step = trainer_step(trainer, ctx.first_batch)
    assert step.aux_loss is not None and step.aux_loss > 0  # the forward returned the load-balancing loss
    assert math.isclose(
        step.loss, ctx.init_loss["loss"], rel_tol=0.05
    )  # CE + 0.001 x aux, on other positions


# -- moe-aux-loss-off ----------------------------------------------------------------------------------------
@pytest.mark.planted("moe-aux-loss-off")
def test_a_plain_trainer_on_a_moe_trains_without_the_load_balancing_loss(tmp_path):
    model, tok = load()
    report = preflight(
        trainer=plain_trainer(tmp_path, model, tok), use_config=False, select=["moe-aux-loss-off"]
    )
    (finding,) = findings(report, "moe-aux-loss-off")
    assert finding.severity == "warning"
    assert finding.evidence["cause"] == "router-logits-off"
    assert finding.evidence["returned_aux"] is None  # measured: the forward inside Trainer.compute_loss
    assert finding.evidence["decided_by"] == "model" and finding.evidence["trainer_class"] == "Trainer"
    assert finding.evidence["model_class"] == "Qwen3MoeForCausalLM"
    assert finding.evidence["coefficient"] == pytest.approx(0.001)
    assert "output_router_logits = True" in finding.fix


@pytest.mark.planted("moe-aux-loss-off")
def test_a_sft_trainer_told_router_aux_loss_coef_0_adds_none(tmp_path):
    from trl import SFTConfig
    from trl_setups import skip_without_config_field

    skip_without_config_field(
        SFTConfig, "router_aux_loss_coef", "SFTTrainer's own MoE load-balancing coefficient"
    )
    model, tok = load()
    trainer = sft_trainer(tmp_path, model, tok, router_aux_loss_coef=0.0)
    report = preflight(trainer=trainer, use_config=False, select=["moe-aux-loss-off"])
    (finding,) = findings(report, "moe-aux-loss-off")
    assert finding.evidence["cause"] == "coefficient-zero"
    assert finding.evidence["decided_by"] == "trainer" and finding.evidence["trainer_class"] == "SFTTrainer"
    assert finding.evidence["coefficient"] == 0.0


@pytest.mark.planted("moe-aux-loss-off")
def test_a_sft_trainer_on_a_moe_whose_config_weighs_the_loss_by_0_adds_none(tmp_path):
    """The model config asks for router logits and weighs them by 0: TRL 1.16's SFTTrainer (its coefficient unset:
    the model config's) turns the loss off, TRL 0.24's adds it times 0; either way the routers train on the
    language-model loss alone, and the fix says where this TRL reads the coefficient. TRL 1.9's SFTConfig
    defaults its own coefficient (0.001) and writes it over the model config's: the loss is on, nothing to say."""
    import dataclasses

    from trl import SFTConfig

    model, tok = load(output_router_logits=True, router_aux_loss_coef=0.0)
    trainer = sft_trainer(tmp_path, model, tok)
    report = preflight(trainer=trainer, use_config=False, select=["moe-aux-loss-off"])
    own = {f.name: f.default for f in dataclasses.fields(SFTConfig)}.get("router_aux_loss_coef")
    if own:  # TRL 1.9
        assert findings(report, "moe-aux-loss-off") == [] and trainer.aux_loss_enabled
        return
    (finding,) = findings(report, "moe-aux-loss-off")
    assert finding.evidence["cause"] == "coefficient-zero" and finding.evidence["coefficient"] == 0.0
    assert finding.evidence["decided_by"] == "trainer" and finding.evidence["trainer_class"] == "SFTTrainer"
    if sft_turns_the_aux_loss_on():
        assert "`router_aux_loss_coef` in the trainer's config" in finding.fix
    else:
        assert "from_pretrained(..., router_aux_loss_coef=0.001)" in finding.fix


@pytest.mark.planted("moe-aux-loss-off")
def test_a_moe_built_with_coefficient_0_returns_a_loss_it_weighs_by_nothing(tmp_path):
    model, tok = load(output_router_logits=True, router_aux_loss_coef=0.0)
    report = preflight(
        trainer=plain_trainer(tmp_path, model, tok), use_config=False, select=["moe-aux-loss-off"]
    )
    (finding,) = findings(report, "moe-aux-loss-off")
    assert finding.evidence["cause"] == "coefficient-zero"
    assert finding.evidence["returned_aux"] > 0  # the forward computed it; the loss weighs it by 0
    assert "from_pretrained(..., router_aux_loss_coef=" in finding.fix


@pytest.mark.clean("moe-aux-loss-off")
@pytest.mark.parametrize("setup", ["sft-trainer", "trainer-with-router-logits"])
def test_moe_trainers_with_the_load_balancing_loss_are_silent(tmp_path, setup):
    from hf_sanity.measure.batches import trainer_context
    from hf_sanity.measure.forwards import trainer_step

    if setup == "sft-trainer":
        model, tok = load_for_sft()
        trainer = sft_trainer(tmp_path, model, tok)
    else:
        model, tok = load(output_router_logits=True)
        trainer = plain_trainer(tmp_path, model, tok)
    report = preflight(trainer=trainer, use_config=False, select=["moe-aux-loss-off"])
    assert report.findings == []
    step = trainer_step(trainer, trainer_context(trainer).first_batch)
    facts = moe.aux_term(trainer, trainer.model, step.aux_loss)  # what the rule read: on, and weighed
    assert facts["enabled"] is True and facts["coefficient"] > 0 and step.aux_loss > 0


@pytest.mark.planted("moe-aux-loss-off")
@pytest.mark.parametrize("coefficient", [0.0, None], ids=["coefficient-0", "default"])
def test_a_grpo_trainer_on_a_moe_adds_the_load_balancing_loss_unless_told_0(tmp_path, coefficient):
    """An RL run: TRL's GRPOTrainer decides when built (`aux_loss_enabled`), from the config's coefficient unless
    its own `router_aux_loss_coef` is given (0 turns it off)."""
    from trl_setups import grpo, length_reward

    from hf_sanity.testing import demo_rl_prompts

    model, tok = load()
    config = {} if coefficient is None else {"router_aux_loss_coef": coefficient}
    trainer = grpo(tmp_path, demo_rl_prompts(16, seed=3), [length_reward], model=model, tok=tok, **config)
    report = preflight(trainer=trainer, use_config=False, select=["moe-aux-loss-off"], reward_dry_run=False)
    assert report.stats["objective"] == "rl"
    if coefficient is None:  # the clean twin
        assert report.findings == [] and trainer.aux_loss_enabled
        return
    (finding,) = findings(report, "moe-aux-loss-off")
    assert (
        finding.evidence["cause"] == "coefficient-zero" and finding.evidence["trainer_class"] == "GRPOTrainer"
    )


@pytest.mark.clean("moe-aux-loss-off", "moe-experts-untouched", "config-not-applied")
def test_a_dense_model_is_not_judged_as_a_mixture_of_experts(tmp_path):
    from dist import tinytrain as tt
    from peft import get_peft_model

    model, tok = tt.setup()
    model = get_peft_model(model, lora(target_modules=["q_proj", "v_proj"]))
    assert moe.routing(model) is None
    report = preflight(
        trainer=plain_trainer(tmp_path, model, tok), use_config=False,
        select=["moe-aux-loss-off", "moe-experts-untouched", "config-not-applied"],
    )  # fmt: skip
    assert report.findings == []


# -- moe-experts-untouched -----------------------------------------------------------------------------------
@pytest.mark.planted("moe-experts-untouched")
def test_an_attention_only_lora_on_a_moe_trains_none_of_its_experts(tmp_path):
    model, tok = load()
    trainer = sft_trainer(tmp_path, model, tok, peft_config=lora(target_modules=["q_proj", "v_proj"]))
    report = preflight(trainer=trainer, use_config=False, select=["moe-experts-untouched"])
    (finding,) = findings(report, "moe-experts-untouched")
    evidence = finding.evidence
    assert finding.severity == "error" and evidence["cause"] == "experts-untouched"
    assert 0.7 < evidence["expert_share"] < 0.75  # 16 experts x 2 layers: 72% of the tiny MoE
    assert evidence["adapter_tensors_on_experts"] == 0 and evidence["adapter_tensors"] == 8
    assert evidence["target_modules"] == ["q_proj", "v_proj"]
    assert evidence["suggested"] == {"target_parameters": EXPERT_TARGETS}
    assert evidence["suggested_verified"] is True  # tried with the installed peft, on a meta-device copy
    assert "target_parameters=" in finding.fix and "mlp.experts.gate_up_proj" in finding.fix


@pytest.mark.planted("moe-experts-untouched")
def test_a_saved_attention_only_adapter_on_a_moe_reaches_no_expert(tmp_path):
    from peft import get_peft_model

    model, tok = load()
    get_peft_model(model, lora(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])).save_pretrained(
        tmp_path / "a"
    )
    base, _ = load()
    from hf_sanity.testing import demo_conversations

    report = preflight(
        model=base, tokenizer=tok, dataset=demo_conversations(8), adapter=str(tmp_path / "a"), use_config=False,
        select=["moe-experts-untouched"],
    )  # fmt: skip
    (finding,) = findings(report, "moe-experts-untouched")
    assert finding.evidence["cause"] == "experts-untouched" and finding.evidence["adapter_tensors"] == 16
    assert finding.evidence["suggested"] == {"target_parameters": EXPERT_TARGETS}


@pytest.mark.clean("moe-experts-untouched")
def test_a_lora_on_the_experts_is_silent(tmp_path):
    model, tok = load()
    config = lora(target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_TARGETS)
    trainer = sft_trainer(tmp_path, model, tok, peft_config=config)
    report = preflight(trainer=trainer, use_config=False, select=["moe-experts-untouched"])
    assert report.findings == []
    reach = moe.model_reach(trainer.model, moe.routing(trainer.model))  # what the rule read
    assert (
        reach.on_experts == 8 and reach.on_routers == 0
    )  # A and B of 2 parameters x 2 layers, none on a router


@pytest.mark.planted("moe-experts-untouched")
def test_all_linear_reaches_the_experts_and_the_router_which_is_info(tmp_path):
    """peft 0.21 puts `all-linear` LoRA on the fused experts and the routers: only the routers are left to say
    (info). peft 0.18 (LLaMA-Factory's pin) reaches the attention alone: experts-untouched."""
    model, tok = load()
    trainer = sft_trainer(tmp_path, model, tok, peft_config=lora(target_modules="all-linear"))
    report = preflight(trainer=trainer, use_config=False, select=["moe-experts-untouched"])
    (finding,) = findings(report, "moe-experts-untouched")
    # what peft did, read from its layers (not from hf-sanity): LoRA layers on the `mlp.experts`, the `mlp.gate`
    adapted = [name for name, module in trainer.model.named_modules() if hasattr(module, "lora_A")]
    experts_adapted = any(name.endswith("mlp.experts") for name in adapted)
    routers = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    if experts_adapted:
        assert finding.severity == "info" and finding.evidence["cause"] == "router-adapted"
        assert finding.evidence["adapter_tensors_on_experts"] > 0
    else:
        assert finding.severity == "error" and finding.evidence["cause"] == "experts-untouched"
        assert finding.evidence["adapter_tensors_on_experts"] == 0
    routers_adapted = any(name.endswith("mlp.gate") for name in adapted)
    assert finding.evidence["routers_adapted"] == (routers if routers_adapted else [])


def test_the_routing_facts_of_a_mixtral_built_from_config():
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = MixtralForCausalLM(config)
    route = moe.routing(model)
    assert route.routers == ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate")
    assert route.num_experts == 4 and route.top_k == 2 and route.aux_capable
    assert moe.expert_targets(model, route) == {"target_parameters": EXPERT_TARGETS}
    ids = torch.randint(0, 64, (2, 12))
    with moe.routed(moe.routers_of(model), torch.ones_like(ids)) as counted:
        model(input_ids=ids)
    (load_,) = counted
    assert load_.plain()["ideal"] == pytest.approx(2 * 12 * 2 / 4)  # tokens x top-k over the experts
