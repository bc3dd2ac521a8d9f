"""SanityCallback on real TRL RL runs (GRPOTrainer, RLOOTrainer): each training rule planted through the trainer
on the tiny model fine-tuned to answer the demo chats and end its turn (its completions terminate and vary), a
few steps on the CPU, with its cause asserted; the clean runs (text and conversational prompts, a varying reward)
silent with `abort_on="error"`, no SFT rule read into a rollout. The monitors are also driven with numbers."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import sys
import time

import numpy as np
import pytest
import torch
import trl_setups as setups
from test_rules_rl import (  # noqa: F401 - one_thread is autouse
    base_model_stops,
    boxed_answer,
    changed_after_loading,
    constant,
    contains_answer,
    one_thread,
)
from transformers import AutoModelForCausalLM, TrainerCallback

import hf_sanity
from hf_sanity import SanityCallback, catalog
from hf_sanity.rules.rl import RewardFunctionMonitor, TruncationMonitor
from hf_sanity.rules.training.preference import ReferenceMonitor
from hf_sanity.rules.training.rl import (
    AdvantageNoiseMonitor,
    EntropyMonitor,
    KLMonitor,
    RewardHackingMonitor,
    ZeroAdvantageMonitor,
    zero_advantage_cause,
)
from hf_sanity.testing import demo_rl_prompts

RL_MONITORS = (ZeroAdvantageMonitor, RewardFunctionMonitor, TruncationMonitor, KLMonitor, RewardHackingMonitor,
               EntropyMonitor, AdvantageNoiseMonitor, ReferenceMonitor)  # fmt: skip


def watch(select=None, **kwargs) -> SanityCallback:
    kwargs = {"check_every": 1, "probe_every": 2, **kwargs}
    return SanityCallback(select=select, use_config=False, print_findings=False, **kwargs)


def found(callback, slug):
    return [f for f in callback.report.findings if f.rule == slug]


def silent(callback):
    assert [f"{f.rule}@{f.step}: {f.message}" for f in callback.report.findings] == []


def ran(callback, *monitors):
    names = {d.rsplit(".", 1)[-1] for d in callback.monitors.ran}
    assert {m.__name__ for m in monitors} <= names, names


def detector_rules(name: str):
    """The rules of the detector (a monitor or a curve detector) named ``name`` in ``MonitorSet.ran``."""
    return [rule for rule in catalog.load().values() if any(d.name == name for d in rule.detectors)]


def rows(n=32, **kwargs):
    return demo_rl_prompts(n, seed=3, **kwargs)


def logged(trainer, key):
    return [e[key] for e in trainer.state.log_history if key in e]


def not_empty(completions, **kwargs):
    """A binary reward the fine-tuned model passes with every answer it writes."""
    return [float(len(setups.text_of(c)) > 3) for c in completions]


def prompt_length(prompts, completions, **kwargs):
    """Depends on the prompt only."""
    return [float(len(str(p))) for p in prompts]


def rounding_noise(completions, **kwargs):
    """One reward for every answer, give or take a rounding error."""
    return [1.0 + 1e-6 * (sum(map(ord, setups.text_of(c))) % 97) for c in completions]


# -- clean runs: silent, and what must never be flagged ------------------------------------------------------------
@pytest.mark.clean("reward-zero-advantage", "reward-function-broken", "completions-truncated", "kl-spike",
                   "reward-hacking", "entropy-collapse", "length-runaway", "advantage-noise",
                   "reference-mismatch")  # fmt: skip
@pytest.mark.parametrize(("conversational", "seed"), [(True, 0), (True, 1), (False, 0), (False, 2)])
def test_clean_grpo_runs_are_silent_and_never_stopped(tmp_path, conversational, seed):
    cb = watch(abort_on="error")
    data = rows() if conversational else setups.rendered(rows())
    funcs = [setups.length_reward] if conversational else [setups.length_reward, setups.answer_reward]
    trainer = setups.grpo(tmp_path, data, funcs, callbacks=[cb], seed=seed)
    trainer.train()
    silent(cb)
    assert trainer.state.global_step == 6 and trainer.state.hf_sanity_aborted_at_step is None
    assert cb.report.stats["objective"] == "rl" and cb.report.stats["objective_detail"]["variant"] == "grpo"
    assert set(cb.report.stats["reward_dry_run"]["functions"]) == {f.__name__ for f in funcs}
    ran(cb, *RL_MONITORS)
    sft_only = [d for d in cb.monitors.ran if not any(r.applies_to("rl") for r in detector_rules(d))]
    assert sft_only == []  # no SFT detector read a rollout or the RL loss curve
    # What must never be flagged: on-policy GRPO's loss at ~0 with a gradient, negative losses, clip_ratio 0 with
    # one iteration per generation, no `kl` at beta = 0.
    losses, norms = logged(trainer, "loss"), logged(trainer, "grad_norm")
    assert any(abs(loss) < 1e-3 and norm > 0 for loss, norm in zip(losses, norms)) and min(losses) < 0
    assert set(logged(trainer, "clip_ratio/region_mean")) == {0.0} and logged(trainer, "kl") == []
    # A run that learns: its rewards vary within half of the groups or more (one group a step; some seeds start
    # with a few groups of equal-length answers, chance that reward-zero-advantage must not call an error).
    zero_std = logged(trainer, "frac_reward_zero_std")
    assert sum(zero_std) / len(zero_std) <= 0.5 and zero_std[-1] == 0.0


@pytest.mark.clean("reward-zero-advantage", "kl-spike", "reference-mismatch")  # group-too-small: preflight
def test_a_clean_rloo_run_with_its_kl_penalty_is_silent(tmp_path):
    cb = watch(abort_on="error")
    trainer = setups.rloo(tmp_path, rows(), [setups.length_reward], callbacks=[cb])
    trainer.train()
    silent(cb)
    assert logged(trainer, "kl")[0] == 0.0 and cb.report.stats["objective_detail"]["variant"] == "rloo"
    ran(cb, KLMonitor, ReferenceMonitor, ZeroAdvantageMonitor)


# -- reward-function-broken and reward-zero-advantage -------------------------------------------------------------
@pytest.mark.planted("reward-function-broken", "reward-zero-advantage")
def test_a_reward_that_reads_messages_as_strings_stops_the_run(tmp_path):
    cb = watch(abort_on="error")
    trainer = setups.grpo(tmp_path, rows(), [contains_answer], callbacks=[cb])
    trainer.train()
    (broken,) = found(cb, "reward-function-broken")
    assert broken.step == 0 and broken.evidence["cause"] == "completion-type"
    assert trainer.state.hf_sanity_aborted_at_step == 1  # stopped before a second step is wasted


@pytest.mark.planted("reward-zero-advantage")
def test_zero_advantage_named_with_the_completion_type_cause(tmp_path):
    cb = watch()
    setups.grpo(tmp_path, rows(), [contains_answer], callbacks=[cb]).train()
    (zero,) = found(cb, "reward-zero-advantage")
    assert zero.severity == "error" and zero.evidence["cause"] == "completion-type" and zero.step == 3
    assert zero.evidence["grad_norm"] == [0.0, 0.0, 0.0]


@pytest.mark.planted("reward-function-broken")
def test_one_function_constant_while_another_varies(tmp_path):
    cb = watch("reward-function-broken")
    setups.grpo(tmp_path, rows(), [setups.length_reward, constant], callbacks=[cb]).train()
    (broken,) = found(cb, "reward-function-broken")
    assert broken.evidence["function"] == "constant" and broken.evidence["cause"] == "constant"
    assert broken.step == 5 and broken.evidence["logged_steps"] == [1, 2, 3, 4, 5]


@pytest.mark.planted("reward-zero-advantage")
def test_rloo_with_a_constant_reward_and_its_kl_penalty(tmp_path):
    """RLOO folds beta x KL into the reward; with a constant reward the policy never moves, the KL stays 0 and the
    groups have no spread either: the same finding, with RLOO's defaults (beta 0.05) but groups of 4."""
    cb = watch("reward-zero-advantage")
    trainer = setups.rloo(tmp_path, rows(), [constant], callbacks=[cb], num_generations=4)
    trainer.train()
    (zero,) = found(cb, "reward-zero-advantage")
    assert zero.evidence["cause"] == "reward-constant" and zero.step == 3
    assert set(logged(trainer, "kl")) == {0.0}


@pytest.mark.planted("reward-zero-advantage")
@pytest.mark.parametrize(
    ("cause", "funcs", "config"),
    [
        ("completions-truncated", [setups.answer_reward], {"max_completion_length": 3}),
        ("reward-constant", [constant], {}),
        ("reward-prompt-only", [prompt_length], {"per_device_train_batch_size": 8}),
        ("sampling-cold", [setups.length_reward], {"temperature": 0.2}),
        ("group-too-small", [not_empty], {}),
    ],
)
def test_zero_advantage_causes_are_measured(tmp_path, cause, funcs, config):
    cb = watch("reward-zero-advantage")
    setups.grpo(tmp_path, rows(), funcs, callbacks=[cb], **config).train()
    (zero,) = found(cb, "reward-zero-advantage")
    assert zero.evidence["cause"] == cause, (zero.message, zero.evidence)


def test_zero_advantage_from_numbers():
    dead = {"frac_reward_zero_std": 1.0, "grad_norm": 0.0}
    monitor = ZeroAdvantageMonitor(temperature=1.0, group_size=4)
    assert [monitor.update(s, {"logs": dead}) for s in (1, 2)] == [[], []]
    (finding,) = monitor.update(3, {"logs": dead})
    assert finding.severity == "error" and finding.evidence["cause"] == "unknown"
    # loss 0 with a gradient (on-policy GRPO) is never flagged; nor is a zero-std share of 0.7
    quiet = ZeroAdvantageMonitor(1.0, 4)
    for step in range(1, 30):
        assert (
            quiet.update(step, {"logs": {"loss": 0.0, "grad_norm": 1.3, "frac_reward_zero_std": 0.7}}) == []
        )
    # a 10-step mean of 0.8 with a gradient: a warning
    warm = ZeroAdvantageMonitor(1.0, 4)
    out = [warm.update(s, {"logs": {"frac_reward_zero_std": 0.9, "grad_norm": 0.5}}) for s in range(1, 11)]
    assert out[-1][0].severity == "warning" and not any(out[:-1])


def test_a_graded_reward_without_a_spread_in_a_few_groups_is_not_yet_an_error():
    """A reward the dry run saw vary (7 values), one group a step: 3 logged steps without a spread are 3 groups,
    chance for a confident model; the error waits for 8 groups in a row, and is then named group-too-small. A
    step with a spread starts the count over. A reward the dry run found constant is an error at 3 logs, as
    before."""
    graded = {"length_reward": {"constant": False, "distinct": 7, "reads_completions": None, "cause": None}}
    dead = {"frac_reward_zero_std": 1.0, "grad_norm": 0.0}
    rollouts = {"groups": 1, "group_size": 4, "zero_std_groups": 1.0, "identical_groups": 0.0}

    def fed(monitor, step, logs, dry=None):
        return monitor.update(
            step, {"logs": logs, "rollouts": rollouts, **({"reward_dry_run": dry} if dry else {})}
        )

    monitor = ZeroAdvantageMonitor(temperature=1.2, group_size=4)
    out = [fed(monitor, 1, {**dead, "rewards/length_reward/std": 0.0}, {"functions": graded})]
    out += [fed(monitor, s, {**dead, "rewards/length_reward/std": 0.0}) for s in range(2, 8)]
    assert not any(out)  # 7 groups
    (error,) = fed(monitor, 8, {**dead, "rewards/length_reward/std": 0.0})
    assert error.severity == "error" and error.evidence["cause"] == "group-too-small"
    assert error.evidence["reward_varies"] and "varied on the dry run" in error.message
    assert "sample hotter" in error.fix and "graded reward" not in error.fix
    recovers = ZeroAdvantageMonitor(temperature=1.2, group_size=4)
    fed(recovers, 1, {**dead, "rewards/length_reward/std": 0.0}, {"functions": graded})
    steps = [fed(recovers, s, {**dead, "rewards/length_reward/std": 0.0}) for s in range(2, 6)]
    steps.append(fed(recovers, 6, {"frac_reward_zero_std": 0.0, "grad_norm": 1.4}))
    steps += [fed(recovers, s, {**dead, "rewards/length_reward/std": 0.0}) for s in range(7, 10)]
    assert not any(steps) and recovers.zero_groups == 3
    constant = {
        "constant": {"constant": True, "distinct": 1, "reads_completions": False, "cause": "constant"}
    }
    flat = ZeroAdvantageMonitor(temperature=1.2, group_size=4)
    fed(flat, 1, {**dead, "rewards/constant/std": 0.0}, {"functions": constant})
    assert fed(flat, 2, {**dead, "rewards/constant/std": 0.0}) == []
    (error,) = fed(flat, 3, {**dead, "rewards/constant/std": 0.0})
    assert error.evidence["cause"] == "reward-constant"


def test_zero_advantage_causes_from_numbers():
    logs = [{"frac_reward_zero_std": 0.7, "rewards/r/std": 0.4, "entropy": 0.8}]
    binary = [{"binary": True, "pass_rate": 0.9, "zero_std_groups": 0.6, "identical_groups": 0.0}]
    cause, _, numbers = zero_advantage_cause(logs, binary, {}, 1.0, 4)
    assert cause == "group-too-small" and math.isclose(numbers["expected_zero_std"], 0.9**4 + 0.1**4)
    cold = zero_advantage_cause(logs, [{"zero_std_groups": 1.0, "identical_groups": 0.0}], {}, 0.3, 4)
    assert cold[0] == "sampling-cold"
    prompt_only = [
        {"zero_std_groups": 1.0, "identical_groups": 0.0, "zero_std_differing": 1.0, "batch_std": 2.0}
    ]
    assert zero_advantage_cause(logs, prompt_only, {}, 1.0, 4)[0] == "reward-prompt-only"


@pytest.mark.planted("reward-zero-advantage")
@pytest.mark.clean("reward-function-broken")
def test_a_sparse_reward_at_rloo_default_groups_is_named_group_too_small(tmp_path):
    """RLOO's G=2 with a correct reward the policy never passes: no group varies. The dry run saw the function read
    its completions, so it is not broken: the message gives the rate seen and the group size that would help."""
    cb = watch(["reward-zero-advantage", "reward-function-broken"])
    setups.rloo(tmp_path, rows(), [boxed_answer], callbacks=[cb]).train()
    assert found(cb, "reward-function-broken") == []
    assert cb.report.stats["reward_dry_run"]["functions"]["boxed_answer"]["sparse"] is True
    (zero,) = found(cb, "reward-zero-advantage")
    evidence = zero.evidence
    assert (evidence["cause"], evidence["pass_rate"], evidence["expected_zero_std"]) == (
        "group-too-small",
        0.0,
        1.0,
    )
    seen, needed = evidence["completions_seen"], evidence["group_size_for_signal_at_bound"]
    assert seen == 3 * 4 and needed > 2  # the rollouts of the 3 logged steps, 4 completions each
    assert f"none of the {seen} completions seen passed" in zero.message and f"G={needed}" in zero.message
    assert f"(to {needed} or more)" in zero.fix


@pytest.mark.clean("reward-function-broken")
def test_a_sparse_reward_beside_a_graded_one_is_not_broken(tmp_path):
    """Flat for every logged step while the graded one varies: the dry run saw it read its completions."""
    cb = watch("reward-function-broken")
    setups.grpo(tmp_path, rows(), [setups.length_reward, boxed_answer], callbacks=[cb]).train()
    silent(cb)
    ran(cb, RewardFunctionMonitor)
    (monitor,) = [m for m in cb.monitors.monitors if isinstance(m, RewardFunctionMonitor)]
    assert monitor.flat["boxed_answer"] == [1, 2, 3, 4, 5, 6]  # flat at every logged step, and not flagged


def format_credit(completions, **kwargs):
    """A graded format reward: a quarter for any answer, all of it for the <think>/<answer> format, which the
    fine-tuned model never writes (the dry run's reasoning-format completion gets it)."""
    texts = [setups.text_of(c).strip() for c in completions]
    return [0.0 if not t else 1.0 if "<think>" in t and "<answer>" in t else 0.25 for t in texts]


@pytest.mark.planted("reward-zero-advantage")
def test_a_graded_reward_that_scores_every_answer_alike_is_an_error_after_eight_groups(tmp_path):
    """One group a step (batch 4, G=4): the reward varied on the dry run (3 values), then gives every completion
    the policy writes 0.25. Not an error at 3 groups (a graded reward leaves a few groups flat by chance): at 8."""
    cb = watch("reward-zero-advantage")
    trainer = setups.grpo(tmp_path, rows(), [format_credit], callbacks=[cb], max_steps=9)
    trainer.train()
    assert set(logged(trainer, "rewards/format_credit/std")) == {0.0}
    (zero,) = found(cb, "reward-zero-advantage")
    assert zero.severity == "error" and zero.step == 8
    assert zero.evidence["cause"] == "group-too-small" and zero.evidence["reward_varies"] is True
    assert "varied on the dry run" in zero.message and "sample hotter" in zero.fix


# -- completions-truncated ------------------------------------------------------------------------------------------
@pytest.mark.planted("completions-truncated")
def test_completions_that_never_end_because_the_trainer_does_not_stop_on_the_end_of_turn(tmp_path):
    model, tok = base_model_stops()
    cb = watch("completions-truncated")
    trainer = setups.grpo(tmp_path, rows(), [setups.length_reward], callbacks=[cb], model=model, tok=tok,
                          max_steps=3)  # fmt: skip
    trainer.train()
    (truncated,) = found(cb, "completions-truncated")
    assert truncated.severity == "error" and truncated.evidence["cause"] == "stop-token-mismatch"
    assert set(logged(trainer, "completions/mean_terminated_length")) == {0.0}


@pytest.mark.planted("completions-truncated")
def test_a_policy_writing_random_tokens_is_not_blamed_on_the_cap(tmp_path):
    """The random tiny model: its logged entropy is ln(V); a completion that ends, ends by chance."""
    model = AutoModelForCausalLM.from_pretrained(setups.folder())
    cb = watch("completions-truncated")
    setups.grpo(tmp_path, rows(), [setups.length_reward], callbacks=[cb], model=model, tok=setups.tokenizer(),
                max_steps=3).train()  # fmt: skip
    (truncated,) = found(cb, "completions-truncated")
    assert truncated.evidence["cause"] == "no-end-of-turn", truncated.message
    assert truncated.evidence["entropy"] > 0.75 * math.log(len(setups.tokenizer()))
    assert "a longer cap would not help" in truncated.fix


@pytest.mark.planted("completions-truncated")
def test_answers_longer_than_the_cap_are_the_budget(tmp_path):
    cb = watch("completions-truncated")
    setups.grpo(tmp_path, rows(), [setups.length_reward], callbacks=[cb], max_completion_length=3,
                max_steps=3).train()  # fmt: skip
    (truncated,) = found(cb, "completions-truncated")
    assert truncated.evidence["cause"] == "budget" and "Raise `max_completion_length`" in truncated.fix


def test_truncation_monitor_warns_on_a_mean_and_errs_when_nothing_ends():
    monitor = TruncationMonitor(64)
    outs = [monitor.update(s, {"logs": {"completions/clipped_ratio": 0.6, "completions/mean_terminated_length": 30.0}})
            for s in (1, 2, 3)]  # fmt: skip
    assert outs[-1][0].severity == "warning" and outs[-1][0].evidence["cause"] == "budget"
    monitor = TruncationMonitor(64)
    monitor.update(0, {"rl_setup": {"stop_mismatch": {"end_of_turn": "<|im_end|>", "stop_tokens": ["</s>"]}}})
    logs = {"logs": {"completions/clipped_ratio": 1.0, "completions/mean_terminated_length": 0.0}}
    assert monitor.update(1, logs) == [] and monitor.update(2, logs) == []
    (finding,) = monitor.update(3, logs)
    assert finding.severity == "error" and finding.evidence["cause"] == "stop-token-mismatch"


def test_reward_function_monitor_reports_only_certain_dry_run_verdicts():
    dry = {"functions": {"c": {"cause": "constant", "constant": True}, "t": {"cause": "timeout"}}}
    assert RewardFunctionMonitor().update(0, {"reward_dry_run": dry}) == []
    dry = {"functions": {"r": {"cause": "raises", "why": "ValueError: x"}}}
    assert RewardFunctionMonitor().update(0, {"reward_dry_run": dry})[0].evidence["cause"] == "raises"


# -- kl-spike and reward-hacking --------------------------------------------------------------------------------------
@pytest.mark.planted("kl-spike")
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_policy_runs_away_from_its_start(tmp_path, beta):
    """An LR 100x too high: with beta > 0 TRL's logged kl shows it; with beta = 0 hf-sanity's own estimate."""
    cb = watch("kl-spike")
    setups.grpo(tmp_path, rows(), [setups.length_reward], callbacks=[cb], learning_rate=1e-2, beta=beta,
                max_steps=8).train()  # fmt: skip
    (spike,) = found(cb, "kl-spike")
    assert spike.evidence["source"] == ("kl" if beta else "policy_kl") and spike.evidence["kl"] > 0.1


def test_kl_monitor_from_numbers():
    monitor = KLMonitor(max_steps=100, beta=0.04)
    for step, kl in enumerate([0.0, 0.002, 0.003, 0.004, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08], start=1):
        assert monitor.update(step, {"logs": {"kl": kl}}) == []  # a slow, normal rise stays under 0.1
    (finding,) = monitor.update(20, {"logs": {"kl": 0.4}})
    assert finding.severity == "warning" and finding.evidence["early_median"] > 0
    assert KLMonitor(100, 0.04).update(1, {"logs": {"kl": 1.5}})[0].severity == "error"
    assert (
        KLMonitor(100, 0.0).update(5, {"logs": {"loss": 0.0}}) == []
    )  # beta = 0: nothing logged, nothing said


def test_kl_probe_is_quiet_on_a_clean_run_and_no_dry_run_when_asked(tmp_path):
    """beta = 0: no reference, no `kl` logged; hf-sanity's own estimate stays small on a clean run (its cost: one
    forward of 8 rollouts per probe, docs/benchmarks.md). With reward_dry_run=False the callback calls no reward function (TRL's own calls score
    4 completions at a time; the dry run's 16) and the report says so."""
    sizes = []

    def counted(completions, **kwargs):
        sizes.append(len(completions))
        return setups.length_reward(completions)

    cb = watch(reward_dry_run=False)
    trainer = setups.grpo(tmp_path, rows(), [counted], callbacks=[cb], max_steps=4)
    trainer.train()
    silent(cb)
    assert logged(trainer, "kl") == [] and cb.trl.drift.initial is not None
    assert -0.05 < cb.trl.drift.measure() < 0.5  # four small steps; the rollouts it re-scores were trained on
    ran(cb, KLMonitor)
    assert set(sizes) == {4} and cb.report.stats["reward_dry_run"].startswith("skipped: reward_dry_run=False")
    assert cb.report.stats["kl_probe"] is True


def test_no_kl_baseline_where_no_probe_step_follows(tmp_path):
    """beta = 0 and fewer steps than probe_every: no step would measure the KL, so its baseline forward is not
    run either (issue 29's 40-step GRPO row, probed every 50 steps)."""
    cb = watch("kl-spike", probe_every=50, reward_dry_run=False)
    setups.grpo(tmp_path, rows(), [setups.length_reward], callbacks=[cb], max_steps=2).train()
    assert cb.trl.drift is None and cb.report.stats["kl_probe"] is False
    silent(cb)


def format_then_saturate(completions, trainer_state, **kwargs):
    """A format reward that every completion meets from step 3 on."""
    return [1.0 if trainer_state.global_step >= 2 or i % 2 else 0.0 for i, _ in enumerate(completions)]


def accuracy_that_falls(completions, trainer_state, **kwargs):
    """An accuracy reward that falls as the run goes on."""
    share = max(0.0, 0.9 - 0.2 * trainer_state.global_step)
    return [1.0 if (i % 10) < share * 10 else 0.0 for i, _ in enumerate(completions)]


@pytest.mark.planted("reward-hacking")
def test_a_format_reward_saturates_while_accuracy_falls(tmp_path):
    cb = watch("reward-hacking")
    setups.grpo(tmp_path, rows(), [format_then_saturate, accuracy_that_falls], callbacks=[cb],
                per_device_train_batch_size=8, num_generations=8).train()  # fmt: skip
    (hacking,) = found(cb, "reward-hacking")
    assert hacking.evidence["saturated"] == "format_then_saturate"
    assert hacking.evidence["falling"] == "accuracy_that_falls" and hacking.evidence["kl"] is not None


def test_reward_hacking_monitor_from_numbers():
    monitor = RewardHackingMonitor()
    seen = {"functions": {"fmt": {"min": 0.0, "max": 1.0}, "acc": {"min": 0.0, "max": 1.0}}}
    means = [(0.4, 0.5), (0.6, 0.55), (0.8, 0.5), (1.0, 0.45), (1.0, 0.3), (1.0, 0.2), (1.0, 0.2)]
    outs = [
        monitor.update(step, {"rollouts": seen, "logs": {"rewards/fmt/mean": f, "rewards/acc/mean": a}})
        for step, (f, a) in enumerate(means, start=1)
    ]
    assert not any(outs[:-2]) and outs[-2][0].evidence["falling"] == "acc"
    both_rise = RewardHackingMonitor()
    for step in range(1, 8):
        logs = {"rewards/fmt/mean": 1.0, "rewards/acc/mean": min(1.0, 0.1 * step)}
        assert both_rise.update(step, {"rollouts": seen, "logs": logs}) == []


# -- entropy-collapse, length-runaway, advantage-noise ------------------------------------------------------------------
class ScaleLogits(TrainerCallback):
    """From step 2 on, multiply the output layer by ``factor`` after every step: > 1 sharpens the policy (a stand-in
    for updates that collapse it onto one answer), < 1 flattens it (updates that run it into gibberish)."""

    def __init__(self, model, factor: float) -> None:
        self.model, self.factor = model, factor

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= 2:
            with torch.no_grad():
                self.model.lm_head.weight.mul_(self.factor)


def relative_length(completions, **kwargs):
    """Each completion's length against its group's mean (groups of 4): the batch's mean reward is always 0."""
    lengths = [len(setups.text_of(c)) for c in completions]
    out = []
    for lo in range(0, len(lengths), 4):
        group = lengths[lo : lo + 4]
        out += [(n - sum(group) / len(group)) / 30 for n in group]
    return out


@pytest.mark.planted("entropy-collapse")
def test_a_policy_that_collapses_onto_one_answer(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(setups.trained_folder())
    cb = watch("entropy-collapse")
    setups.grpo(tmp_path, rows(), [setups.length_reward], callbacks=[cb, ScaleLogits(model, 2.0)], model=model,
                max_steps=6).train()  # fmt: skip
    (collapse,) = found(cb, "entropy-collapse")
    assert collapse.evidence["entropy"][-1] < 0.2 * collapse.evidence["entropy_start"]
    assert collapse.evidence["frac_reward_zero_std"] > collapse.evidence["frac_reward_zero_std_start"]


@pytest.mark.planted("length-runaway")
def test_completions_that_grow_into_gibberish_while_the_reward_stays_flat(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(setups.trained_folder())
    cb = watch("length-runaway")
    setups.grpo(tmp_path, rows(64), [relative_length], callbacks=[cb, ScaleLogits(model, 0.8)], model=model,
                per_device_train_batch_size=8, max_completion_length=192, max_steps=8).train()  # fmt: skip
    (runaway,) = found(cb, "length-runaway")
    lengths = runaway.evidence["mean_length"]
    assert all(b > a for a, b in itertools.pairwise(lengths)) and runaway.evidence["entropy"][-1] > 2


def test_entropy_monitor_from_numbers():
    collapse = EntropyMonitor()
    rows_ = [(0.8, 0.0), (0.9, 0.0), (0.7, 0.25), (0.3, 0.5), (0.1, 0.75), (0.1, 1.0), (0.08, 1.0)]
    outs = [
        collapse.update(s, {"logs": {"entropy": e, "frac_reward_zero_std": z}})
        for s, (e, z) in enumerate(rows_, 1)
    ]
    assert [f.rule for out in outs for f in out] == ["entropy-collapse"] and outs[-1]
    runaway = EntropyMonitor()
    series = [(0.5, 10), (0.6, 11), (0.5, 12), (1.2, 14), (1.5, 17), (1.8, 21), (2.0, 26)]
    outs = [
        runaway.update(
            s, {"logs": {"entropy": e, "completions/mean_length": n, "reward": 0.3, "reward_std": 0.2}}
        )
        for s, (e, n) in enumerate(series, 1)
    ]
    assert [f.rule for out in outs for f in out] == ["length-runaway"]
    rising_reward = EntropyMonitor()
    for s, (e, n) in enumerate(series, 1):
        logs = {"entropy": e, "completions/mean_length": n, "reward": 0.1 * s, "reward_std": 0.2}
        assert rising_reward.update(s, {"logs": logs}) == []  # longer and better: not a runaway


@pytest.mark.planted("advantage-noise")
def test_rewards_that_differ_by_a_rounding_error_become_advantages(tmp_path):
    cb = watch("advantage-noise")
    setups.grpo(tmp_path, rows(), [rounding_noise], callbacks=[cb], per_device_train_batch_size=8,
                max_steps=4).train()  # fmt: skip
    (noise,) = found(cb, "advantage-noise")
    assert noise.evidence["tiny_std_share"] > 0.2 and noise.evidence["groups"] >= 8


@pytest.mark.clean("advantage-noise")
def test_the_same_rewards_scaled_over_the_batch_are_not_noise(tmp_path):
    cb = watch("advantage-noise")
    setups.grpo(tmp_path, rows(), [rounding_noise], callbacks=[cb], per_device_train_batch_size=8,
                max_steps=4, scale_rewards="batch").train()  # fmt: skip
    silent(cb)
    ran(cb, AdvantageNoiseMonitor)


# -- reference-mismatch (beta > 0) ---------------------------------------------------------------------------------------
@pytest.mark.planted("reference-mismatch")
def test_grpo_with_beta_whose_policy_changed_after_loading(tmp_path):
    model = changed_after_loading()
    cb = watch("reference-mismatch", abort_on="error")
    trainer = setups.grpo(tmp_path, rows(), [setups.length_reward], callbacks=[cb], model=model, beta=0.04)
    trainer.train()
    (mismatch,) = found(cb, "reference-mismatch")
    assert (
        mismatch.step == 1
        and mismatch.evidence["cause"] == "reloaded-from-path"
        and mismatch.evidence["kl"] > 1e-4
    )
    assert trainer.state.hf_sanity_aborted_at_step == 1


def test_rl_monitors_resume_from_their_saved_state():
    monitor = ZeroAdvantageMonitor(1.0, 4)
    for step in (1, 2):
        monitor.update(
            step, {"logs": {"frac_reward_zero_std": 1.0, "grad_norm": 0.0}, "rollouts": {"groups": 1}}
        )
    resumed = ZeroAdvantageMonitor(1.0, 4)
    resumed.restore(json.loads(json.dumps(monitor.state())))
    assert resumed.update(3, {"logs": {"frac_reward_zero_std": 1.0, "grad_norm": 0.0}})[0].step == 3


# -- the reward dry run changes nothing ------------------------------------------------------------------------------
def drawing_reward(completions, **kwargs):
    """A graded reward with a tie-break drawn from Python's, NumPy's and torch's generators, as users write them: the
    dry run must not move any of them, or TRL's own calls draw other numbers and the run ends elsewhere."""
    noise = [random.random() + float(np.random.rand()) + float(torch.rand(())) for _ in completions]
    return [r + 0.05 * n for r, n in zip(setups.length_reward(completions), noise)]


def final_weights(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def rng_states():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def test_a_grpo_run_whose_reward_draws_random_numbers_is_bit_for_bit_the_run_without(tmp_path):
    """With the callback, and with preflight(trainer=...) run before training too: the same weights, rewards and
    RNG states at the end as the run without hf-sanity (the dry run called the function, and it drew)."""
    runs = {}
    for name in ("without", "callback", "preflight"):
        cb = watch(abort_on="error") if name != "without" else None
        trainer = setups.grpo(
            tmp_path / name, rows(), [drawing_reward], callbacks=[cb] if cb else [], max_steps=3
        )
        if name == "preflight":
            report = hf_sanity.preflight(trainer=trainer, use_config=False)
            assert report.stats["reward_dry_run"]["functions"]["drawing_reward"]["cause"] is None
        trainer.train()
        if cb is not None:
            silent(cb)
            assert cb.report.stats["reward_dry_run"]["completions"] == {"synthetic": 16}  # it did call it
        runs[name] = (final_weights(trainer), logged(trainer, "reward"), rng_states())
    weights, rewards, rng = runs["without"]
    for name in ("callback", "preflight"):
        other_weights, other_rewards, other_rng = runs[name]
        assert other_rewards == rewards, name
        assert all(torch.equal(weights[k], other_weights[k]) for k in weights), name
        assert (
            torch.equal(rng[0], other_rng[0])
            and rng[1] == other_rng[1]
            and np.array_equal(rng[2], other_rng[2])
        )


# -- preflight's dry run carried over to the callback ---------------------------------------------------------------
def counting_forks(monkeypatch) -> list[int]:
    """Every os.fork of this process from now on (the dry run's child is one)."""
    forks, fork = [], os.fork

    def counted():
        pid = fork()
        if pid:  # the parent's side: the child's would be counted in a list the test never reads
            forks.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", counted)
    return forks


def without_seconds(dry_run):
    return {
        name: {k: v for k, v in verdict.items() if k != "seconds"}
        for name, verdict in dry_run["functions"].items()
    }


@pytest.mark.planted("reward-function-broken")
def test_preflights_dry_run_is_the_callbacks_verdict_without_a_fork_of_its_own(tmp_path, monkeypatch):
    """preflight(trainer=...) then train(): the callback reads preflight's verdict on the synthetic completions
    (the same calls), forks nothing at train begin, and says the same as its own dry run would: the broken
    function named with its cause at step 0, the run stopped at step 1."""
    verdicts = {}
    for name in ("own", "carried"):
        cb = watch(abort_on="error")
        trainer = setups.grpo(
            tmp_path / name, rows(), [setups.length_reward, contains_answer], callbacks=[cb]
        )
        if name == "carried":
            hf_sanity.preflight(trainer=trainer, use_config=False)
        forks = counting_forks(monkeypatch)
        trainer.train()
        monkeypatch.undo()
        (broken,) = found(cb, "reward-function-broken")
        assert broken.step == 0 and broken.evidence["cause"] == "completion-type", name
        assert trainer.state.hf_sanity_aborted_at_step == 1, name
        dry_run = cb.report.stats["reward_dry_run"]
        assert dry_run["completions"] == {"synthetic": 16}, name
        assert (len(forks), dry_run.get("from")) == ((1, None) if name == "own" else (0, "preflight"))
        verdicts[name] = without_seconds(dry_run)
    assert verdicts["carried"] == verdicts["own"]
    assert verdicts["own"]["length_reward"]["cause"] is None


def reads_the_step(completions, trainer_state, **kwargs):
    """A curriculum: its reward depends on the run's progress, which preflight's state does not have."""
    return [len(setups.text_of(c)) / 30 * (1 + trainer_state.global_step / max(trainer_state.max_steps, 1))
            for c in completions]  # fmt: skip


@pytest.mark.clean("reward-function-broken")
def test_the_callback_judges_again_what_changed_since_preflight_or_reads_the_runs_state(
    tmp_path, monkeypatch
):
    """Not carried over: a reward function that reads ``trainer_state`` (preflight's has max_steps 0), and a
    trainer whose reward functions were replaced after preflight (the new one is judged, not the old verdict)."""
    cb = watch(abort_on="error")
    trainer = setups.grpo(tmp_path / "state", rows(), [reads_the_step], callbacks=[cb], max_steps=2)
    hf_sanity.preflight(trainer=trainer, use_config=False)
    forks = counting_forks(monkeypatch)
    trainer.train()
    monkeypatch.undo()
    silent(cb)
    assert len(forks) == 1 and "from" not in cb.report.stats["reward_dry_run"]
    assert cb.report.stats["reward_dry_run"]["functions"]["reads_the_step"]["cause"] is None

    cb = watch(abort_on="error")
    trainer = setups.grpo(tmp_path / "swapped", rows(), [contains_answer], callbacks=[cb], max_steps=2)
    report = hf_sanity.preflight(trainer=trainer, use_config=False)
    assert report.stats["reward_dry_run"]["functions"]["contains_answer"]["cause"] == "completion-type"
    trainer.reward_funcs = [setups.length_reward]  # mended after preflight's report, before training
    trainer.reward_func_names = ["length_reward"]  # (TRL logs by these names)
    trainer.train()
    silent(cb)
    dry_run = cb.report.stats["reward_dry_run"]
    assert set(dry_run["functions"]) == {"length_reward"} and "from" not in dry_run
    assert trainer.state.global_step == 2


def test_a_kept_verdict_is_read_only_while_what_it_was_judged_on_is_the_same():
    """The keys of the carry-over, on a stand-in trainer: the same reward function objects, dataset, tokenizer and
    remove_unused_columns; a new object or setting, a function that reads trainer_state, or a trainer that
    preflight never saw: nothing carried (the callback makes its own dry run)."""
    from types import SimpleNamespace

    from hf_sanity.measure import rl

    class Trainer:  # what the keys read of a GRPOTrainer
        def __init__(self):
            self.reward_funcs, self.reward_func_names = [setups.length_reward], ["length_reward"]
            self.train_dataset, self.processing_class = object(), object()
            self.args = SimpleNamespace(remove_unused_columns=False)

    verdict = rl.DryRun(batches={"synthetic": 16})
    changes = {
        "function": lambda t: setattr(t, "reward_funcs", [constant]),
        "dataset": lambda t: setattr(t, "train_dataset", object()),
        "tokenizer": lambda t: setattr(t, "processing_class", object()),
        "columns": lambda t: setattr(t.args, "remove_unused_columns", True),
    }
    for what, change in changes.items():
        trainer = Trainer()
        rl.keep_for_training(trainer, verdict)
        carried = rl.carried_dry_run(trainer)
        assert carried is not None and carried.describe()["from"] == "preflight"
        assert carried.describe()["completions"] == {"synthetic": 16}
        change(trainer)
        assert rl.carried_dry_run(trainer) is None, what
    assert rl.carried_dry_run(Trainer()) is None  # never preflighted
    trainer = Trainer()
    trainer.reward_funcs = [reads_the_step]
    rl.keep_for_training(trainer, verdict)
    assert rl.carried_dry_run(trainer) is None


def test_a_dpo_run_with_the_callback_is_bit_for_bit_the_run_without(tmp_path):
    from hf_sanity.testing import demo_preference_pairs

    runs = {}
    for name in ("without", "callback"):
        cb = watch(abort_on="error") if name == "callback" else None
        trainer = setups.dpo(
            tmp_path / name, demo_preference_pairs(16), callbacks=[cb] if cb else [], max_steps=4
        )
        trainer.train()
        if cb is not None:
            silent(cb)
            ran(cb, ReferenceMonitor)
        runs[name] = (final_weights(trainer), logged(trainer, "loss"), rng_states())
    (weights, losses, rng), (weights_cb, losses_cb, rng_cb) = runs["without"], runs["callback"]
    assert losses_cb == losses and all(torch.equal(weights[k], weights_cb[k]) for k in weights)
    assert torch.equal(rng[0], rng_cb[0]) and rng[1] == rng_cb[1] and np.array_equal(rng[2], rng_cb[2])


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for the state of the processes")
def test_a_dry_run_call_that_outlives_its_limit_is_stopped_before_the_first_step(tmp_path, monkeypatch):
    """The callback's dry run at train begin: the call that hangs (only there: TRL's own calls return) is killed at
    its limit, the report says it was not judged, and the run trains as it would have."""
    from test_rules_rl import running

    from hf_sanity.measure import rl

    main, pids = os.getpid(), tmp_path / "pid"

    def hangs_in_the_dry_run(completions, **kwargs):
        if os.getpid() != main:  # the dry run's child process
            pids.write_text(str(os.getpid()))
            time.sleep(60)
        return setups.length_reward(completions)

    monkeypatch.setattr(rl, "REWARD_TIMEOUT", 1.0)
    cb = watch(abort_on="error")
    trainer = setups.grpo(tmp_path, rows(), [hangs_in_the_dry_run], callbacks=[cb], max_steps=2)
    trainer.train()
    silent(cb)  # a timeout is not a verdict
    assert trainer.state.global_step == 2
    verdict = cb.report.stats["reward_dry_run"]["functions"]["hangs_in_the_dry_run"]
    assert verdict["cause"] == "timeout" and verdict["errors"] == {"synthetic": "did not return within 1 s"}
    assert not running(int(pids.read_text()))
