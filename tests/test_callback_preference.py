"""SanityCallback on real TRL preference runs (DPO, IPO, KTO, ORPO, SimPO, reward models): each training rule
planted through the trainer, on the tiny model saved to a folder, and the clean runs silent with
`abort_on="error"` (no SFT rule reads their batches)."""

from __future__ import annotations

import pytest
import torch
import trl_setups as setups
from test_rules_preference import shared_prefix_pairs
from transformers import AutoModelForCausalLM, TrainerCallback

from hf_sanity import SanityCallback
from hf_sanity.rules.training.preference import LikelihoodMonitor, PreferenceSignalMonitor, ReferenceMonitor
from hf_sanity.testing import demo_preference_pairs, demo_unpaired, trained_model_dir


def watch(select=None, **kwargs) -> SanityCallback:
    kwargs = {"check_every": 1, "probe_every": 2, **kwargs}
    return SanityCallback(select=select, use_config=False, print_findings=False, **kwargs)


def only(callback, slug):
    found = [f for f in callback.report.findings if f.severity != "info"]
    assert [f.rule for f in found] == [slug], [f"{f.rule}@{f.step}: {f.message}" for f in found]
    return found[0]


def silent(callback):
    assert [f"{f.rule}@{f.step}: {f.message}" for f in callback.report.findings] == []


def ran(callback, *monitors):
    names = {d.rsplit(".", 1)[-1] for d in callback.monitors.ran}
    assert {m.__name__ for m in monitors} <= names, names


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


# -- preference-no-signal -----------------------------------------------------------------------------
@pytest.mark.planted("preference-no-signal")
def test_identical_pairs_leave_the_dpo_loss_at_ln2(tmp_path):
    cb = watch("preference-no-signal")
    setups.dpo(tmp_path, shared_prefix_pairs(), callbacks=[cb], max_length=40, max_steps=8).train()
    found = only(cb, "preference-no-signal")
    assert found.evidence["cause"] == "identical-pairs" and found.evidence["identical_fraction"] == 1.0
    assert "preference-pairs-identical" in found.fix
    assert abs(found.evidence["no_signal_loss"] - 0.6931) < 1e-4 and found.step == 6
    assert cb.report.stats["objective"] == "preference"


def test_no_signal_causes_from_numbers():
    def stuck(**logs):
        monitor = PreferenceSignalMonitor(target=0.6931, beta=0.1)
        monitor.update(0, {"preference_data": {"identical_fraction": 0.0}})
        found = []
        for step in range(1, 8):
            found += monitor.update(step, {"logs": {"loss": 0.6931, "rewards/margins": 0.0, **logs}})
        return found

    assert stuck(grad_norm=0.0)[0].evidence["cause"] == "frozen-parameters"
    empty = stuck(grad_norm=0.0, **{"logps/chosen": 0.0, "logps/rejected": 0.0})
    assert empty[0].evidence["cause"] == "empty-completion-mask"
    assert stuck(grad_norm=0.3) == []  # a gradient flows: not stuck
    assert stuck(grad_norm=0.0)[0].step == 6  # 5 logged steps from step 2


@pytest.mark.clean("preference-no-signal", "reference-mismatch", "likelihood-displacement",
                   "preference-trivially-separable")  # fmt: skip
@pytest.mark.parametrize("seed", [0, 1])
def test_clean_dpo_runs_are_silent_and_never_stopped(tmp_path, seed):
    cb = watch(abort_on="error")
    trainer = setups.dpo(
        tmp_path, demo_preference_pairs(32, seed=seed), callbacks=[cb], max_steps=8, seed=seed
    )
    trainer.train()
    silent(cb)
    assert trainer.state.global_step == 8 and trainer.state.hf_sanity_aborted_at_step is None
    ran(cb, PreferenceSignalMonitor, ReferenceMonitor, LikelihoodMonitor)
    # The pairs' summary names a firing rule's cause: a clean run never computes it (issue 29, item 5).
    (signal,) = [m for m in cb.monitors.monitors if isinstance(m, PreferenceSignalMonitor)]
    assert signal.data.computed is False
    # TRL's step-0 log: loss ln 2 and accuracy 0.0 (ties count as wrong): never flagged.
    first = trainer.state.log_history[0]
    assert abs(first["loss"] - 0.6931) < 1e-3 and first["rewards/accuracies"] == 0.0


@pytest.mark.clean("preference-no-signal", "reference-mismatch")
def test_dpo_at_batch_size_one_and_trls_default_lr_is_silent(tmp_path):
    cb = watch(abort_on="error")
    trainer = setups.dpo(tmp_path, demo_preference_pairs(16), callbacks=[cb], per_device_train_batch_size=1,
                         learning_rate=1e-6, max_steps=10)  # fmt: skip
    trainer.train()
    silent(cb)
    assert {e["rewards/accuracies"] for e in trainer.state.log_history if "rewards/accuracies" in e} <= {
        0.0,
        1.0,
    }


# -- reference-mismatch ---------------------------------------------------------------------------------
@pytest.mark.planted("reference-mismatch")
def test_a_policy_changed_after_loading_is_not_its_reloaded_reference(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(setups.folder())
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    cb = watch(abort_on="error")
    trainer = setups.dpo(tmp_path, demo_preference_pairs(16), callbacks=[cb], model=model)
    # preflight says it first, as a warning, with the cause
    import hf_sanity

    before = hf_sanity.preflight(trainer=trainer, use_config=False, select="reference-mismatch")
    assert [f.evidence["cause"] for f in before.findings] == ["reloaded-from-path"]
    assert before.findings[0].severity == "warning"
    trainer.train()
    found = only(cb, "reference-mismatch")
    assert found.step == 1 and found.severity == "error"
    assert found.evidence["cause"] == "reloaded-from-path" and found.evidence["ref_distance"] > 0.01
    assert "save the changed policy" in found.fix and "dropout" not in found.fix
    assert abs(found.evidence["rewards/chosen"]) > 1e-3
    assert trainer.state.hf_sanity_aborted_at_step == 1


@pytest.mark.planted("reference-mismatch")
def test_attention_dropout_that_disable_dropout_does_not_reach(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(setups.folder(), attention_dropout=0.3)
    cb = watch("reference-mismatch")
    setups.dpo(tmp_path, demo_preference_pairs(16), callbacks=[cb], model=model).train()
    found = only(cb, "reference-mismatch")
    assert found.evidence["cause"] == "dropout"
    assert (
        found.evidence["config_dropout"] == {"attention_dropout": 0.3} and found.evidence["disable_dropout"]
    )


def test_reference_tolerance_in_half_precision():
    metrics = {"step0_metrics": {"rewards/chosen": 0.02, "rewards/rejected": -0.01}}
    assert ReferenceMonitor(half_precision=True).update(1, metrics) == []
    assert ReferenceMonitor(half_precision=False).update(1, metrics)[0].evidence["cause"] == "unknown"


# -- likelihood-displacement -----------------------------------------------------------------------------
@pytest.mark.planted("likelihood-displacement")
def test_chosen_likelihood_falls_on_a_model_that_answered_well(tmp_path):
    """DPO after SFT (the tiny model fine-tuned on the demo chats: its chosen answers cost ~0.02 nats a token) at
    an LR far too high: the chosen answers' likelihood falls with the rejected ones'. (At 5e-3 the fall over 12
    steps sat at the error threshold, 1.4-1.6 nats a token by machine; at 1e-2 it is ~2.5 by the second step.)"""
    model = AutoModelForCausalLM.from_pretrained(trained_model_dir("clean"))
    cb = watch("likelihood-displacement")
    trainer = setups.dpo(tmp_path, demo_preference_pairs(32, seed=3), callbacks=[cb], model=model,
                         learning_rate=1e-2, max_steps=12)  # fmt: skip
    trainer.train()
    found = only(cb, "likelihood-displacement")
    assert found.severity == "error" and found.evidence["drop_nats_per_token"] > 1.5
    assert found.evidence["chosen_logp_start"] > -0.1


def test_likelihood_monitor_needs_rising_margins_for_a_warning():
    monitor = LikelihoodMonitor()
    assert monitor.update(1, {"chosen_logp": -2.0}) == []
    assert monitor.update(2, {"logs": {"rewards/margins": 0.1}}) == []
    assert (
        monitor.update(4, {"logs": {"rewards/margins": 0.05}, "chosen_logp": -2.8}) == []
    )  # falling margins
    found = monitor.update(6, {"logs": {"rewards/margins": 0.4}, "chosen_logp": -2.9})
    assert found[0].severity == "warning" and round(found[0].evidence["drop_nats_per_token"], 3) == 0.9


# -- preference-trivially-separable (training) ------------------------------------------------------------
@pytest.mark.planted("preference-trivially-separable")
def test_accuracy_at_one_within_the_first_tenth_explained_by_length(tmp_path):
    rows = demo_preference_pairs(48)
    for row in rows:
        row["chosen"][0]["content"] += " I hope this helps, and let me know if you need more."
    cb = watch("preference-trivially-separable")
    setups.dpo(tmp_path, rows, callbacks=[cb, StopAt(6)], max_steps=60).train()
    found = only(cb, "preference-trivially-separable")
    assert found.evidence["cause"] == "length" and found.step <= 6
    assert found.evidence["separable"]["rule"] == "longer-wins"


# -- the other preference trainers --------------------------------------------------------------------------
@pytest.mark.clean("ALL")
def test_clean_kto_orpo_simpo_ipo_and_reward_runs_are_silent(tmp_path):
    from peft import LoraConfig

    pairs = demo_preference_pairs(32)
    runs = {
        "preference-unpaired": lambda cb: setups.kto(tmp_path, demo_unpaired(32), callbacks=[cb]),
        "orpo": lambda cb: setups.orpo(tmp_path, pairs, callbacks=[cb]),
        "simpo": lambda cb: setups.cpo(
            tmp_path, pairs, callbacks=[cb], loss_type="simpo", beta=2.5, simpo_gamma=1.375
        ),
        "ipo": lambda cb: setups.dpo(tmp_path, pairs, callbacks=[cb], loss_type=["ipo"], beta=0.5),
        "reward": lambda cb: setups.reward(
            tmp_path,
            pairs,
            callbacks=[cb],
            peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="SEQ_CLS"),
        ),
    }
    for name, build in runs.items():
        cb = watch(abort_on="error")
        trainer = build(cb)
        trainer.train()
        silent(cb)
        assert trainer.state.global_step == 6, name
    assert cb.report.stats["objective"] == "reward"


# -- doctor on a finished preference run -----------------------------------------------------------------------
@pytest.mark.clean("loss-flat", "underfitting", "curves")
def test_doctor_reads_a_dpo_run_as_one_not_as_a_flat_sft_loss(tmp_path):
    """A DPO run whose loss stayed at ln 2 (its pairs identical): read as SFT, its curve is `loss-flat` at
    0.6931; doctor reads the objective from TRL's logged metrics and runs no SFT curve rule on it."""
    import hf_sanity
    from hf_sanity.drivers.curves import analyze
    from hf_sanity.measure.runs import read_run

    trainer = setups.dpo(tmp_path, shared_prefix_pairs(), max_length=40, max_steps=12)
    trainer.train()
    trainer.save_state()
    assert [f.rule for f in analyze(read_run(tmp_path / "out").curves, final=True)] == ["loss-flat"]
    report = hf_sanity.doctor([tmp_path / "out"], use_config=False)
    assert report.stats["runs"][0]["objective"] == "preference"
    assert report.findings == []


def test_the_step0_likelihood_is_read_from_the_training_forward_where_no_dropout_acts():
    """Without dropout the training forward's logits are the probe's: the first batch's chosen log-probability is
    read from them (no forward of ours), the same number as a probe forward gives; with dropout in the config or in
    a module, or a forward that keeps only some logits, the probe runs its own forward."""
    from hf_sanity.training import probe

    model = AutoModelForCausalLM.from_pretrained(setups.folder())
    model.train()
    torch.manual_seed(0)
    ids = torch.randint(5, 100, (4, 12))
    labels = ids.masked_fill(torch.arange(12) < 5, -100)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    assert probe.logits_reusable(model, {"input_ids": ids})
    assert not probe.logits_reusable(model, {"input_ids": ids, "logits_to_keep": 3})
    with torch.no_grad():
        training_logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    rows = probe.probe_batch(batch, 2)  # the chosen rows: the first ones of the training batch
    assert (
        abs(float(probe.chosen_logp_of(training_logits, rows)) - float(probe.chosen_logp(model, rows))) < 1e-5
    )
    assert probe.chosen_logp_of(training_logits[:, :5], rows) is None  # logits that do not fit: not read
    dropped = AutoModelForCausalLM.from_pretrained(setups.folder(), attention_dropout=0.3)
    assert not probe.logits_reusable(dropped.train(), {}) and probe.logits_reusable(dropped.eval(), {})
    model.model.layers[0].mlp.add_module("dropout", torch.nn.Dropout(0.1))  # a LoRA dropout, say
    assert not probe.logits_reusable(model.train(), {})


def test_a_dpo_runs_step0_likelihood_is_measured_before_its_first_update(tmp_path, monkeypatch):
    """TRL's DPO computes its loss in a fused head (``fused_lm_head=True``: no logits returned), so the step-0
    number comes from one forward of ours on the chosen rows at the first batch, before any update; the later
    probes compare with it."""
    from hf_sanity.training import probe

    reused = []
    real = probe.logits_reusable

    def seen(model, kwargs):
        reused.append(real(model, kwargs))
        return reused[-1]

    monkeypatch.setattr(probe, "logits_reusable", seen)
    cb = watch("likelihood-displacement", probe_every=2)
    setups.dpo(tmp_path, demo_preference_pairs(16), callbacks=[cb], max_steps=4).train()
    (monitor,) = [m for m in cb.monitors.monitors if isinstance(m, LikelihoodMonitor)]
    assert monitor.start is not None and monitor.start[0] == 1 and monitor.start[1] < 0
    assert reused == [False]  # asked once, at the first batch: the fused head returns no logits
    silent(cb)
