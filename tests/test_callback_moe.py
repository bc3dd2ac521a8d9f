"""SanityCallback on mixture-of-experts runs: the first step's load-balancing loss (`moe-aux-loss-off`) and the
routers' load on the probe batch (`expert-collapse`), on the tiny Qwen3-MoE under real `Trainer`/`SFTTrainer`
runs, and `RouterMonitor` driven with numbers."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from moe_setups import (
    BiasRouter,
    load,
    one_thread,  # noqa: F401 - autouse
    plain_trainer,
    sft_trainer,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_sanity.callback import SanityCallback
from hf_sanity.rules.training.moe import RouterMonitor
from hf_sanity.testing.moe import trained_moe_dir

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


MOE_RULES = ("moe-aux-loss-off", "expert-collapse")


def watch(**kwargs) -> SanityCallback:
    return SanityCallback(
        use_config=False, print_findings=False, **{"check_every": 2, "probe_every": 5, **kwargs}
    )


def trained():
    """The tiny MoE trained with the load-balancing loss (routers that spread the tokens), as a checkpoint."""
    folder = trained_moe_dir()
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def router_monitor(cb) -> RouterMonitor:
    return next(m for m in cb.monitors.monitors if isinstance(m, RouterMonitor))


def moe_findings(cb):
    return [f for f in cb.report.findings if f.rule in MOE_RULES]


# -- through real runs ---------------------------------------------------------------------------------------
@pytest.mark.planted("moe-aux-loss-off")
def test_a_plain_trainer_run_is_told_at_its_first_step(tmp_path):
    model, tok = trained()
    cb = watch(select=["moe-aux-loss-off"])
    plain_trainer(tmp_path, model, tok, callbacks=[cb], max_steps=3, learning_rate=1e-3).train()
    (finding,) = cb.report.by_rule("moe-aux-loss-off")
    assert finding.step == 1 and finding.evidence["cause"] == "router-logits-off"
    assert finding.evidence["returned_aux"] is None  # what the first training forward returned
    assert finding.evidence["trainer_class"] == "Trainer" and finding.evidence[
        "coefficient"
    ] == pytest.approx(1e-3)


@pytest.mark.planted("moe-aux-loss-off")
def test_a_grpo_run_told_router_aux_loss_coef_0_is_told_at_its_first_step(tmp_path):
    """An RL run: its first forward generates (no load-balancing loss in any case); GRPOTrainer decided when it
    was built, and that is what is judged."""
    from trl_setups import grpo, length_reward

    from hf_sanity.testing import demo_rl_prompts

    model, tok = trained()
    cb = watch()
    trainer = grpo(tmp_path, demo_rl_prompts(16, seed=3), [length_reward], model=model, tok=tok, callbacks=[cb],
                   max_steps=2, router_aux_loss_coef=0.0)  # fmt: skip
    trainer.train()
    (finding,) = cb.report.by_rule("moe-aux-loss-off")
    assert finding.step == 1 and finding.evidence["cause"] == "coefficient-zero"
    assert finding.evidence["decided_by"] == "trainer" and finding.evidence["trainer_class"] == "GRPOTrainer"
    assert cb.report.by_rule("expert-collapse") == []  # not judged on RL runs: no probe batch of sequences


def needs_trls_aux_loss() -> None:
    """Skip where TRL's SFTTrainer adds the load-balancing loss only when the model's config already has
    ``output_router_logits=True`` (TRL 0.24: no ``router_aux_loss_coef``): these runs are not clean there, and
    ``moe-aux-loss-off`` says so."""
    import trl
    from trl import SFTConfig

    if "router_aux_loss_coef" not in SFTConfig.__dataclass_fields__:
        pytest.skip(
            f"TRL {trl.__version__}'s SFTTrainer has no router_aux_loss_coef (aux loss off by default)"
        )


@pytest.mark.planted("expert-collapse")
def test_a_router_biased_mid_run_towards_one_expert_is_found(tmp_path):
    """The plant: at step 4 one row of every router is pushed along the tokens' mean direction, so expert 0
    takes a slot of most tokens; the probes at steps 5 and 10 see it, the second confirms it."""
    needs_trls_aux_loss()
    model, tok = trained()
    cb = watch()
    trainer = sft_trainer(tmp_path, model, tok, callbacks=[cb, BiasRouter(step=4, scale=100.0)()], max_steps=11,
                          learning_rate=1e-3)  # fmt: skip
    trainer.train()
    (finding,) = cb.report.by_rule("expert-collapse")
    evidence = finding.evidence
    assert finding.step == 5 and evidence["confirmed_at_step"] == 10
    assert evidence["cause"] == "overloaded-expert" and evidence["experts"] == 16
    assert evidence["layers_collapsing"] == 2 and evidence["assignments_per_expert"] >= 4
    layer = evidence["layers"][0]
    assert layer["peak_now"] > 4 and layer["peak_start"] < 3.5  # over 4x its share, from under 3.5x
    assert cb.report.by_rule("moe-aux-loss-off") == []  # SFTTrainer adds the load-balancing loss


@pytest.mark.planted("expert-collapse", "moe-aux-loss-off")
def test_a_random_moe_fine_tuned_without_the_load_balancing_loss_loses_its_experts(tmp_path):
    """Not a plant but what happens: the random tiny MoE under a plain Trainer at a high LR sends most tokens
    to a few experts within ten steps."""
    model, tok = load()
    cb = watch()
    plain_trainer(tmp_path, model, tok, callbacks=[cb], max_steps=11).train()
    assert cb.report.by_rule("moe-aux-loss-off")[0].evidence["cause"] == "router-logits-off"
    (finding,) = cb.report.by_rule("expert-collapse")
    assert finding.evidence["cause"] == "dead-experts"
    worst = finding.evidence["layers"][0]
    assert worst["dead_now"] >= worst["dead_start"] + 0.25  # a quarter of its experts or more went quiet


@pytest.mark.clean("moe-aux-loss-off", "expert-collapse")
def test_a_normal_moe_sft_run_is_silent(tmp_path):
    needs_trls_aux_loss()
    model, tok = trained()
    cb = watch()
    trainer = sft_trainer(tmp_path, model, tok, callbacks=[cb], max_steps=16, learning_rate=1e-3)
    trainer.train()
    assert moe_findings(cb) == []
    others = {(f.rule, f.evidence.get("cause")) for f in cb.report.findings if f.severity != "info"}
    assert others <= {
        ("init-loss-off-chance", "seen-data")
    }  # it continues training on data it was trained on
    monitor = router_monitor(cb)
    assert "hf_sanity.rules.training.moe.RouterMonitor" in cb.monitors.ran
    assert monitor.start["layers"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert monitor.start["ideal"] >= 4 and max(monitor.start["peak"]) < 4  # judged: enough tokens, spread
    assert cb.first.budget.runs >= 3  # three probes after the first batch counted the routers too


@pytest.mark.clean("moe-aux-loss-off", "expert-collapse")
def test_a_moe_lora_run_with_the_router_frozen_is_silent(tmp_path):
    needs_trls_aux_loss()
    from peft import LoraConfig

    model, tok = trained()
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    cb = watch()
    sft_trainer(
        tmp_path, model, tok, callbacks=[cb], max_steps=16, learning_rate=5e-3, peft_config=config
    ).train()
    assert moe_findings(cb) == []
    assert router_monitor(cb).start is not None  # the routers were found under peft's wrappers and counted


def test_the_router_counts_leave_a_moe_run_bit_for_bit_the_run_without(tmp_path):
    def run(out, callbacks):
        model, tok = trained()
        trainer = sft_trainer(out, model, tok, callbacks=callbacks, max_steps=6, learning_rate=1e-3)
        trainer.train()
        return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}

    without = run(tmp_path / "without", [])
    cb = watch(check_every=1, probe_every=2)
    with_cb = run(tmp_path / "with", [cb])
    assert router_monitor(cb).start is not None
    assert all(torch.equal(without[name], with_cb[name]) for name in without)


# -- RouterMonitor with numbers ------------------------------------------------------------------------------
START = {"layers": ["l0", "l1"], "dead": [0.0, 0.0625], "peak": [2.8, 2.9], "ideal": 14.6, "experts": 16}


def probe(dead, peak):
    return {"router_load": {"dead": dead, "peak": peak}}


def fed(monitor, *values):
    found = []
    for step, value in values:
        found += monitor.update(step, value)
    return found


def test_one_quiet_probe_is_noise_two_in_a_row_are_a_collapse():
    monitor = RouterMonitor()
    assert fed(monitor, (1, {"router_load": START}), (5, probe([0.0, 0.25], [3.0, 3.1]))) == []
    assert fed(monitor, (10, probe([0.0, 0.0625], [3.0, 3.1]))) == []  # it recovered: starts over
    (finding,) = fed(monitor, (15, probe([0.0, 0.31], [3.0, 3.5])), (20, probe([0.0, 0.38], [3.0, 3.6])))
    assert finding.step == 15 and finding.evidence["cause"] == "dead-experts"
    assert (
        finding.evidence["layers"][0]["layer"] == "l1" and finding.evidence["layers"][0]["dead_experts"] == 6
    )


def test_small_changes_and_a_busy_expert_that_was_busy_from_the_start_are_not_a_collapse():
    monitor = RouterMonitor()
    busy = {**START, "peak": [4.5, 2.9]}  # a domain batch: one expert busy from the first step on
    values = [(1, {"router_load": busy})] + [(s, probe([0.0, 0.125], [5.0, 3.0])) for s in (5, 10, 15)]
    assert fed(monitor, *values) == []  # 1 -> 2 dead of 16 (6 points), 4.5x -> 5.0x: neither is a collapse


def test_a_probe_batch_too_small_to_judge_is_not_judged():
    monitor = RouterMonitor()
    small = {**START, "ideal": 2.0}
    values = [(1, {"router_load": small})] + [(s, probe([0.5, 0.5], [8.0, 8.0])) for s in (5, 10)]
    assert fed(monitor, *values) == []


def test_a_new_first_batch_is_a_new_baseline_and_the_state_survives_a_checkpoint():
    monitor = RouterMonitor()
    fed(monitor, (1, {"router_load": START}), (5, probe([0.0, 0.0], [6.0, 2.0])))
    state = json.loads(json.dumps(monitor.state()))
    resumed = RouterMonitor()
    resumed.restore(state)
    (finding,) = fed(resumed, (10, probe([0.0, 0.0], [6.5, 2.0])))
    assert finding.evidence["cause"] == "overloaded-expert" and finding.step == 5
    fresh = RouterMonitor()
    fed(fresh, (1, {"router_load": START}), (5, probe([0.0, 0.0], [6.0, 2.0])))
    fed(
        fresh, (7, {"router_load": {**START, "peak": [6.0, 2.0]}})
    )  # a resumed run's first batch: its own probe
    assert fed(fresh, (10, probe([0.0, 0.0], [6.5, 2.0]))) == []


def test_the_load_balancing_facts_fire_once():
    facts = {"model_class": "M", "trainer_class": "Trainer", "decided_by": "model", "returned_aux": None,
             "coefficient": 0.001, "enabled": False}  # fmt: skip
    monitor = RouterMonitor()
    (finding,) = monitor.update(1, {"routing": facts})
    assert finding.evidence["cause"] == "router-logits-off"
    assert monitor.update(1, {"routing": facts}) == []
    assert RouterMonitor().update(1, {"routing": {**facts, "enabled": True}}) == []
    assert RouterMonitor().update(1, {"routing": None}) == []  # a dense model


def test_an_expert_overloaded_past_4x_is_the_cause_of_the_few_it_starves():
    """One expert taking a slot of most tokens leaves two of 16 without a token (as the biased router does on
    the tiny MoE): the overload is named. A quarter of the experts gone quiet is a collapse of its own."""
    overload = RouterMonitor()
    (finding,) = fed(
        overload, (1, {"router_load": START}), *[(s, probe([0.125, 0.1875], [6.8, 7.7])) for s in (5, 10)]
    )
    assert finding.evidence["cause"] == "overloaded-expert"
    assert [h["dead_experts"] for h in finding.evidence["layers"]] == [2, 3]
    collapse = RouterMonitor()
    (finding,) = fed(
        collapse, (1, {"router_load": START}), *[(s, probe([0.0, 0.375], [3.0, 6.5])) for s in (5, 10)]
    )
    assert finding.evidence["cause"] == "dead-experts"
