"""`doctor`: runs read from disk (synthetic trainer_state.json files and real tiny Trainer runs, one of them
watched by SanityCallback), the run rules across runs, the prediction rules, the plot, and the command line
through a subprocess."""

from __future__ import annotations

import itertools
import json
import math
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

from helpers import assert_one_line_error, cli
from hf_sanity import catalog
from hf_sanity.drivers.curves import analyze
from hf_sanity.drivers.doctor import doctor
from hf_sanity.errors import UserInputError
from hf_sanity.measure.curves import Curves
from hf_sanity.measure.runs import describe, find_state, read_run
from hf_sanity.measure.training_args import read_training_args_bin
from hf_sanity.rules import curves as C
from hf_sanity.rules import runs as R

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

catalog.load()  # at import, on a shallow stack: define() inspects the caller's stack, slow deep in a test


# -- synthetic runs ----------------------------------------------------------------------------------
def series(n=200, *, seed=0, noise=0.04, start=2.4, floor=0.9, tau=50.0, peak=2e-4, flat=None):
    rng = np.random.default_rng(seed)
    t = np.arange(1, n + 1)
    level = np.full(n, flat) if flat is not None else floor + (start - floor) * np.exp(-t / tau)
    loss = level * (1 + noise * rng.standard_normal(n))
    lr = np.where(t <= 10, peak * t / 10, peak * (n - t) / (n - 10))
    es = t[19::20]
    ev = (level[es - 1] * 1.05).tolist()
    return Curves(t.tolist(), loss.tolist(), es.tolist(), ev, lr.tolist())


def log_history(curves: Curves) -> list[dict]:
    """A log_history the way Trainer writes it: train entries, eval entries after the train entry of
    their step, the end-of-training summary."""
    log = []
    evals = dict(zip(curves.eval_steps, curves.eval_loss))
    for i, (step, loss) in enumerate(zip(curves.train_steps, curves.train_loss)):
        entry = {"epoch": step / 100, "grad_norm": 1.0, "loss": loss, "step": step}
        if curves.lr:
            entry["learning_rate"] = curves.lr[i]
        log.append(entry)
        if step in evals:
            log.append({"epoch": step / 100, "eval_loss": evals[step], "eval_runtime": 0.1, "step": step})
    last = curves.train_steps[-1] if curves.train_steps else 0
    log.append({"train_loss": 1.0, "train_runtime": 2.0, "total_flos": 1.0, "step": last})
    return log


def write_run(folder: Path, curves: Curves, *, config=None, args=None, checkpoint=None) -> Path:
    """An output_dir with the state at top level (or in checkpoint-N) and optional side files."""
    where = folder / f"checkpoint-{checkpoint}" if checkpoint else folder
    where.mkdir(parents=True, exist_ok=True)
    state = {
        "global_step": curves.train_steps[-1] if curves.train_steps else 0,
        "max_steps": curves.train_steps[-1] if curves.train_steps else 0,
        "train_batch_size": 8,
        "logging_steps": 1,
        "eval_steps": 20,
        "num_train_epochs": 2,
        "log_history": log_history(curves),
    }
    (where / "trainer_state.json").write_text(json.dumps(state, indent=2))
    if config is not None:
        (where / "config.json").write_text(json.dumps(config))
    if args is not None:
        (folder / "training_args.json").write_text(json.dumps(args))
    return folder


LLAMA = {"_name_or_path": "meta-llama/Llama-3.2-1B", "model_type": "llama", "vocab_size": 128256,
         "hidden_size": 2048, "num_hidden_layers": 16, "architectures": ["LlamaForCausalLM"]}  # fmt: skip


def rules(report) -> set[str]:
    return {f.rule for f in report.findings}


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


# -- reading runs ----------------------------------------------------------------------------------
@pytest.mark.clean("curves", "runs", "nonfinite-loss", "negative-loss", "lr-zero", "loss-flat")
def test_clean_run_has_no_findings(tmp_path):
    report = doctor([write_run(tmp_path / "run", series(), config=LLAMA)], use_config=False)
    assert report.findings == []
    assert report.exit_code == 0
    assert report.stats["runs"][0]["vocab_size"] == 128256
    assert report.stats["runs"][0]["train_points"] == 200 and report.stats["runs"][0]["evaluations"] == 10


def test_a_run_is_a_file_a_checkpoint_or_an_output_dir(tmp_path):
    out = tmp_path / "out"
    write_run(out, series(n=100), checkpoint=9)
    write_run(out, series(n=200), checkpoint=10)  # numerically the latest, though "9" > "10" as text
    assert find_state(out) == out / "checkpoint-10" / "trainer_state.json"
    assert find_state(out / "checkpoint-9") == out / "checkpoint-9" / "trainer_state.json"
    state = out / "checkpoint-9" / "trainer_state.json"
    assert find_state(state) == state
    write_run(out, series(n=150))  # a top-level state (save_state) behind the latest checkpoint
    assert find_state(out) == out / "checkpoint-10" / "trainer_state.json"
    write_run(out, series(n=200))  # as far as the checkpoint: the final save_state wins
    assert find_state(out) == out / "trainer_state.json"


def test_findings_name_their_run(tmp_path):
    spiky = series(seed=1)
    spiky.train_loss[150] = 3 * spiky.train_loss[149]
    one = doctor([write_run(tmp_path / "spiky", spiky)], use_config=False)
    (spike,) = one.by_rule("loss-spike")
    assert spike.step == 151 and spike.evidence["run"] == str(tmp_path / "spiky")
    assert not spike.message.startswith(str(tmp_path))
    two = doctor([tmp_path / "spiky", write_run(tmp_path / "clean", series(seed=2))], use_config=False)
    (spike,) = two.by_rule("loss-spike")  # the two also differ beyond noise: seed-unfixed, not checked here
    assert spike.message.startswith(f"{tmp_path / 'spiky'}: train loss jumped")


def test_a_spike_says_whether_the_run_clipped_gradients_and_warmed_up(tmp_path):
    spiky = series(seed=1)
    spiky.train_loss[150] = 3 * spiky.train_loss[149]
    off = write_run(
        tmp_path / "off", spiky, args={"max_grad_norm": 0.0, "warmup_steps": 0, "learning_rate": 2e-4}
    )
    (spike,) = doctor([off], use_config=False).by_rule("loss-spike")
    assert spike.evidence["clipping_off"] is True and spike.evidence["no_warmup"] is True
    assert spike.fix.startswith("First turn gradient clipping back on (max_grad_norm=1.0): it is off")
    on = write_run(
        tmp_path / "on", spiky, args={"max_grad_norm": 1.0, "warmup_steps": 0.05, "learning_rate": 2e-4}
    )
    (spike,) = doctor([on], use_config=False).by_rule("loss-spike")
    assert (spike.evidence["clipping_off"], spike.evidence["warmup_steps"]) == (False, 10)  # 5% of 200 steps
    # One batch the run recovered from at the next step, clipping on: info, and nothing to change.
    assert spike.severity == "info" and spike.evidence["cause"] == "transient"
    assert spike.fix == C.TRANSIENT_FIX
    (spike,) = doctor([write_run(tmp_path / "unknown", spiky)], use_config=False).by_rule("loss-spike")
    assert "clipping_off" not in spike.evidence  # no training arguments: nothing claimed


def test_underfitting_is_judged_against_the_planned_steps_in_the_trainer_state(tmp_path):
    barely = series(start=2.4, floor=2.25, noise=0.003, seed=2, peak=1e-3)
    run = write_run(tmp_path / "run", barely)
    assert rules(doctor([run], use_config=False)) == {"underfitting"}
    state = json.loads((run / "trainer_state.json").read_text())
    state["max_steps"] = 2000  # the run stopped at step 200 of 2000: it is not over, not judged
    (run / "trainer_state.json").write_text(json.dumps(state))
    assert rules(doctor([run], use_config=False)) == set()


def test_vocab_size_from_config_json_makes_flat_at_chance(tmp_path):
    run = write_run(tmp_path / "run", series(flat=math.log(1000), noise=0.002), config={"vocab_size": 1000})
    report = doctor([run], use_config=False)
    (flat,) = report.by_rule("loss-flat")
    assert flat.evidence["at_chance"] is True and report.exit_code == 1


@pytest.mark.parametrize(
    "make_bad, needle",
    [
        (lambda d: d / "missing", "does not exist"),
        (lambda d: d, "no trainer_state.json in"),
        (lambda d: (d / "trainer_state.json").write_text('{"log_history": [') and d, "malformed JSON"),
        (lambda d: (d / "trainer_state.json").write_text('{"global_step": 3}') and d, "no log_history"),
        (lambda d: (d / "trainer_state.json").write_text('{"log_history": []}') and d, "logs no loss"),
    ],
    ids=["missing", "no-state", "malformed", "not-a-state", "no-loss"],
)
def test_bad_runs_are_user_errors(tmp_path, make_bad, needle):
    folder = tmp_path / "run"
    folder.mkdir()
    with pytest.raises(UserInputError, match=needle) as info:
        doctor([make_bad(folder)], use_config=False)
    assert "\n" not in str(info.value)


def test_a_folder_of_runs_says_to_pass_them(tmp_path):
    write_run(tmp_path / "sweep" / "a", series(), checkpoint=5)
    write_run(tmp_path / "sweep" / "b", series())
    with pytest.raises(UserInputError, match=r"holds 2 .* pass them one by one"):
        doctor([tmp_path / "sweep"], use_config=False)


def test_malformed_side_file_is_a_user_error(tmp_path):
    run = write_run(tmp_path / "run", series())
    (run / "config.json").write_text("{nope")
    with pytest.raises(UserInputError, match=r"config\.json: malformed JSON"):
        doctor([run], use_config=False)


def test_select_and_ignore(tmp_path):
    bad = series(flat=2.0, noise=0.002)
    bad.lr = [0.0] * len(bad.lr)
    run = write_run(tmp_path / "run", bad)
    assert rules(doctor([run], use_config=False)) == {"loss-flat", "lr-zero"}
    assert rules(doctor([run], select="lr-zero", use_config=False)) == {"lr-zero"}
    assert rules(doctor([run], ignore=["curves", "lr-zero", "loss-flat"], use_config=False)) == set()


# -- hyperparameter-churn and seed-unfixed -------------------------------------------------------------
CHURN_LRS = (1e-5, 1e-4, 1e-3, 1e-2)


def churn_runs(folder: Path, *, configs=(LLAMA,) * 4) -> list[Path]:
    """Four runs of one setup, flat at 2.1, the LR (read from the logs) raised from one to the next: three
    failed hyperparameter changes."""
    paths = []
    for i, (peak, config) in enumerate(zip(CHURN_LRS, configs)):
        curves = series(flat=2.1, noise=0.003, seed=i, peak=peak)
        paths.append(write_run(folder / f"{i}-lr{peak:g}", curves, config=config))
    return paths


@pytest.mark.planted("hyperparameter-churn")
def test_hyperparameter_churn(tmp_path):
    report = doctor(churn_runs(tmp_path), use_config=False)
    (churn,) = report.by_rule("hyperparameter-churn")
    assert churn.severity == "error" and "hf-sanity diagnose" in churn.message
    assert "4 runs in a row fail" in churn.message and "3 hyperparameter-only changes" in churn.message
    assert churn.evidence["failures"] == ["loss-flat"]
    assert churn.evidence["differing_hyperparameters"]["peak_learning_rate"] == list(CHURN_LRS)
    assert [c["changed"] for c in churn.evidence["changes"]] == [
        {"learning rate": [a, b]} for a, b in itertools.pairwise(CHURN_LRS)
    ]
    assert "model.model_type" in churn.evidence["setup_fields_compared"]
    assert report.by_rule("seed-unfixed") == []  # different LRs: not one configuration
    # one change at a time after each failure: no change was made several at once
    assert report.by_rule("several-changes-at-once") == []
    assert [r["changed"] for r in report.stats["runs"]] == [None] + [
        [f"learning rate {a:.3g} → {b:.3g}"] for a, b in itertools.pairwise(CHURN_LRS)
    ]


def test_the_iron_law_counts_failed_runs_whatever_their_failure_class(tmp_path):
    """Three LRs that fail to learn (flat at two, underfitting at the third: it moved, by 6%), then a fourth
    that spikes: four failures of three kinds across three LR changes. The iron law counts failed changes, not
    one symptom (it used to group runs by failure class and fire on three)."""
    paths = churn_runs(tmp_path)
    write_run(paths[2], series(start=2.4, floor=2.25, noise=0.003, seed=2, peak=1e-3), config=LLAMA)
    spiky = series(seed=5, peak=1e-2)
    for i in range(120, 200, 10):  # a spike every 10th step the run never learns down: repeated
        spiky.train_loss[i] = 3 * spiky.train_loss[119]
    write_run(paths[3], spiky, config=LLAMA)
    report = doctor(paths, use_config=False)
    (churn,) = report.by_rule("hyperparameter-churn")
    assert churn.evidence["failures_by_run"] == {
        str(paths[0]): ["loss-flat"],
        str(paths[1]): ["loss-flat"],
        str(paths[2]): ["underfitting"],
        str(paths[3]): ["loss-spike"],
    }
    assert churn.evidence["failure_classes"] == ["diverging", "not-learning"]
    assert "loss-flat in 2, loss-spike in 1, underfitting in 1" in churn.message


@pytest.mark.clean("hyperparameter-churn")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_failed_runs_are_not_yet_the_iron_law(tmp_path, seed):
    """Two failed runs (one change) do not make the law; a run that works, or a change of the setup (a fix of
    the pipeline was tried), breaks the chain of three. The runs table shows what each run changed: the
    detector compared them."""
    paths = churn_runs(tmp_path / "a")[:2]
    report = doctor(paths, use_config=False)
    assert report.by_rule("hyperparameter-churn") == [] and len(report.by_rule("loss-flat")) == 2
    assert [r["changed"] for r in report.stats["runs"]][1:] == [["learning rate 1e-05 → 0.0001"]]
    paths = churn_runs(tmp_path / "b")
    write_run(paths[2], series(seed=seed, peak=1e-3), config=LLAMA)  # the third run learns
    report = doctor(paths, use_config=False)
    assert report.by_rule("hyperparameter-churn") == []
    assert [r["outcome"] for r in report.stats["runs"]] == [
        "loss-flat",
        "loss-flat",
        "no failure",
        "loss-flat",
    ]


def objective_run(folder: Path, curves: Curves, logged: dict, **kwargs) -> Path:
    """A run whose every train entry also logs ``logged`` (the metrics by which doctor reads its objective:
    TRL's DPO logs rewards/chosen, GRPO frac_reward_zero_std)."""
    write_run(folder, curves, **kwargs)
    state_file = folder / "trainer_state.json"
    state = json.loads(state_file.read_text())
    for entry in state["log_history"]:
        if "loss" in entry:
            entry.update(logged)
    state_file.write_text(json.dumps(state))
    return folder


DPO_LOGS = {"rewards/chosen": 0.0, "rewards/rejected": 0.0, "rewards/accuracies": 0.5}
GRPO_LOGS = {"frac_reward_zero_std": 0.0, "reward": 0.3}


def test_cli_compares_runs_within_one_objective(tmp_path):
    """An SFT series of three failed LRs with a DPO run and a GRPO run between them: the SFT runs are one
    series (the law holds across the others), the DPO and the GRPO run are the first of their own, compared with
    nothing (they used to be one series: 'changed 2 settings at once' between a DPO and a GRPO run)."""
    flat = dict(flat=2.1, noise=0.003)
    runs = [
        write_run(tmp_path / "sft-1", series(seed=0, peak=1e-5, **flat), config=LLAMA, args={"learning_rate": 1e-5}),
        objective_run(tmp_path / "dpo", series(seed=3, peak=5e-7, flat=0.693, noise=0.003), DPO_LOGS,
                      config=LLAMA, args={"learning_rate": 5e-7, "beta": 0.1}),
        write_run(tmp_path / "sft-2", series(seed=1, peak=1e-4, **flat), config=LLAMA, args={"learning_rate": 1e-4}),
        objective_run(tmp_path / "grpo", series(seed=4, peak=1e-6, flat=0.01, noise=0.003), GRPO_LOGS,
                      config=LLAMA, args={"learning_rate": 1e-6, "num_generations": 8}),
        write_run(tmp_path / "sft-3", series(seed=2, peak=1e-3, **flat), config=LLAMA, args={"learning_rate": 1e-3}),
    ]  # fmt: skip
    out = tmp_path / "r.json"
    result = doctor_cli(*runs, "--json", out, cwd=tmp_path)
    report = json.loads(out.read_text())
    rows = {Path(row["run"]).name: row for row in report["stats"]["runs"]}
    assert [rows[name]["objective"] for name in ("sft-1", "dpo", "sft-2", "grpo", "sft-3")] == [
        "sft", "preference", "sft", "rl", "sft"
    ]  # fmt: skip
    assert rows["dpo"]["changed"] is None and rows["grpo"]["changed"] is None  # compared with no other run
    assert rows["sft-2"]["changed"] == ["learning rate 1e-05 → 0.0001"]  # with sft-1, over the DPO run
    assert rows["sft-3"]["changed"] == ["learning rate 0.0001 → 0.001"]
    assert {name: rows[name]["learning_rate"] for name in rows} == {
        "sft-1": 1e-5, "dpo": 5e-7, "sft-2": 1e-4, "grpo": 1e-6, "sft-3": 1e-3
    }  # fmt: skip
    (churn,) = [f for f in report["findings"] if f["rule"] == "hyperparameter-churn"]
    assert [Path(r).name for r in churn["evidence"]["runs"]] == ["sft-1", "sft-2", "sft-3"]
    assert churn["evidence"]["objective"] == "sft"
    named = [f["evidence"].get("run") for f in report["findings"] if f["rule"] == "several-changes-at-once"]
    assert named == []  # one change at a time within each objective
    shown = " ".join(result.stdout.split())
    assert "(first preference run)" in shown and "(first rl run)" in shown and "objective" in shown


def test_failure_classes_name_rules_of_the_catalog():
    rules_known = catalog.load()
    assert [s for slugs in R.FAILURE_CLASSES.values() for s in slugs if s not in rules_known] == []
    assert R.failure_class("underfitting") == R.failure_class("loss-flat") == "not-learning"
    assert R.failure_class("negative-loss") == "negative-loss"  # in no class: a class of its own


def test_a_setup_change_breaks_the_chain(tmp_path):
    """Another model for the third run: a change of the setup, not a hyperparameter; the chain restarts."""
    other = {**LLAMA, "_name_or_path": "Qwen/Qwen2.5-0.5B", "model_type": "qwen2"}
    report = doctor(churn_runs(tmp_path, configs=(LLAMA, LLAMA, other, other)), use_config=False)
    assert report.by_rule("hyperparameter-churn") == []
    assert len(report.by_rule("loss-flat")) == 4
    # the model and the LR changed together after a failure: several at once
    (several,) = report.by_rule("several-changes-at-once")
    assert several.evidence["changed"]["model"] == ["meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B"]
    assert set(several.evidence["changed"]) == {"model", "learning rate"}


def test_training_args_json_separates_setups(tmp_path):
    paths = churn_runs(tmp_path)
    for i, path in enumerate(paths):
        (path / "training_args.json").write_text(
            json.dumps(
                {"dataset_name": "a" if i % 2 else "b", "learning_rate": 1e-4, "output_dir": str(path)}
            )
        )
    assert doctor(paths, use_config=False).by_rule("hyperparameter-churn") == []


@pytest.mark.planted("seed-unfixed")
def test_seed_unfixed(tmp_path):
    a = write_run(tmp_path / "a", series(seed=1), config=LLAMA)
    b = write_run(tmp_path / "b", series(seed=2), config=LLAMA)
    (finding,) = doctor([a, b], use_config=False).by_rule("seed-unfixed")
    assert finding.evidence["pair"] == [str(a), str(b)]
    assert finding.evidence["seeds"] == {str(a): None, str(b): None}
    assert "their seeds are unknown" in finding.message and "no recorded seed" not in finding.message


def test_seed_unfixed_needs_the_same_recorded_fields(tmp_path):
    a = write_run(tmp_path / "a", series(seed=1), config=LLAMA)
    b = write_run(tmp_path / "b", series(seed=2))  # no config.json: not known to be the same configuration
    assert doctor([a, b], use_config=False).by_rule("seed-unfixed") == []


@pytest.mark.clean("seed-unfixed")
def test_same_seed_same_curves_is_fine(tmp_path):
    a = write_run(tmp_path / "a", series(seed=1), config=LLAMA)
    b = write_run(tmp_path / "b", series(seed=1), config=LLAMA)
    assert doctor([a, b], use_config=False).findings == []


def test_different_recorded_seeds_are_meant_to_differ(tmp_path):
    a = write_run(tmp_path / "a", series(seed=1), config=LLAMA, args={"seed": 1})
    b = write_run(tmp_path / "b", series(seed=2), config=LLAMA, args={"seed": 2})
    assert doctor([a, b], use_config=False).by_rule("seed-unfixed") == []
    (b / "training_args.json").write_text(json.dumps({"seed": 1}))
    (finding,) = doctor([a, b], use_config=False).by_rule("seed-unfixed")
    assert "same seed 1" in finding.message and "full_determinism=True" in finding.fix


@pytest.mark.planted("seed-unfixed")
def test_same_seed_runs_that_trained_an_adapter_name_its_weights_drawn_before_the_seed(tmp_path):
    """Both runs saved a PEFT adapter beside their state: the cause named first is its LoRA weights, drawn when it
    is built, before Trainer seeds the run; one run without an adapter config gets the message as before."""
    a = write_run(tmp_path / "a", series(seed=1), args={"seed": 0})
    b = write_run(tmp_path / "b", series(seed=2), args={"seed": 0})
    for run in (a, b):
        (run / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (finding,) = doctor([a, b], use_config=False).by_rule("seed-unfixed")
    assert finding.evidence["adapter"] is True and "same seed 0" in finding.message
    assert "LoRA weights are drawn when it is built" in finding.message
    assert (
        finding.fix.startswith("Seed before the adapter is built") and "full_determinism=True" in finding.fix
    )
    (b / "adapter_config.json").unlink()
    (finding,) = doctor([a, b], use_config=False).by_rule("seed-unfixed")
    assert finding.evidence["adapter"] is False and "LoRA" not in finding.message


def test_model_configs_that_differ_anywhere_are_different_setups(tmp_path):
    """Two checkpoints of one architecture told apart by their token ids only; dtype and dropout are not
    the model's identity."""
    a = write_run(tmp_path / "a", series(seed=1), config={**LLAMA, "eos_token_id": 2}, args={"seed": 0})
    b = write_run(tmp_path / "b", series(seed=2), config={**LLAMA, "eos_token_id": 7}, args={"seed": 0})
    assert doctor([a, b], use_config=False).by_rule("seed-unfixed") == []
    (b / "config.json").write_text(json.dumps({**LLAMA, "eos_token_id": 2, "dtype": "bfloat16"}))
    assert doctor([a, b], use_config=False).by_rule("seed-unfixed")


# -- predictions -----------------------------------------------------------------------------------
def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_accuracy_at_the_majority_rate(tmp_path):
    rows = [{"prediction": "no", "label": "no" if i % 10 < 7 else "yes"} for i in range(100)]
    (finding,) = R.metric_suspicious(rows)
    assert finding.evidence["majority_rate"] == 0.7 and "majority-class rate" in finding.message


def test_accuracy_implausibly_high(tmp_path):
    rows = [{"prediction": str(i % 3), "label": str(i % 3)} for i in range(200)]
    (finding,) = R.metric_suspicious(rows)
    assert "leakage" in finding.message


def predictions_of(rows):
    """The registered detector's input: a RunSet holding only eval predictions."""
    from hf_sanity.measure.runs import RunSet

    return RunSet(descriptions=[], failures=[], predictions=rows)


@pytest.mark.clean("metric-suspicious")
def test_honest_accuracy_is_fine():
    labels = ["a", "b", "c", "d"] * 25
    rows = [{"prediction": y if i % 5 else "a", "label": y} for i, y in enumerate(labels)]  # ~80%
    assert R.detect_metric_suspicious(predictions_of(rows)) == []


@pytest.mark.clean("eval-scores-cluster")
def test_scores_cluster():
    clusters = R.detect_eval_scores_cluster
    assert clusters(predictions_of([{"score": 7 if i % 2 else 8} for i in range(50)] + [{"score": 3}]))
    assert clusters(predictions_of([{"score": 1}] * 48 + [{"score": 0}] * 2))
    assert clusters(predictions_of([{"score": 1 + i % 10} for i in range(50)])) == []
    assert clusters(predictions_of([{"score": i % 2} for i in range(50)])) == []  # a balanced pass/fail


@pytest.mark.planted("metric-suspicious", "eval-scores-cluster")
def test_predictions_through_doctor(tmp_path):
    run = write_run(tmp_path / "run", series())
    preds = write_jsonl(tmp_path / "p.jsonl", [{"prediction": "no", "label": "no"}] * 70
                        + [{"prediction": "no", "label": "yes"}] * 30 + [{"score": 4}] * 20)  # fmt: skip
    report = doctor([run], predictions=preds, use_config=False)
    assert (
        rules(report) == {"metric-suspicious", "eval-scores-cluster"} and report.stats["predictions"] == 120
    )


@pytest.mark.parametrize(
    "text, needle",
    [(None, "does not exist"), ('{"prediction": 1, "label"\n', "line 1 is not JSON"),
     ("[1, 2]\n", "not a JSON object"), ('{"text": "x"}\n', "no row with both")],
    ids=["missing", "malformed", "not-object", "no-keys"],
)  # fmt: skip
def test_bad_predictions_are_user_errors(tmp_path, text, needle):
    run = write_run(tmp_path / "run", series())
    path = tmp_path / "p.jsonl"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UserInputError, match=needle):
        doctor([run], predictions=path, use_config=False)


# -- plot ------------------------------------------------------------------------------------------
def test_plot_is_a_png_and_nothing_is_written_into_runs(tmp_path):
    spiky = series(seed=1)
    spiky.train_loss[150] = 3 * spiky.train_loss[149]
    runs = [write_run(tmp_path / "runs" / "a", spiky, config=LLAMA), *churn_runs(tmp_path / "runs")]
    before = snapshot(tmp_path / "runs")
    out = tmp_path / "plots" / "curves.png"
    report = doctor(runs, plot=out, use_config=False)
    assert snapshot(tmp_path / "runs") == before
    assert report.stats["plot"] == str(out)
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width == 1000 and height > 4 * 300  # one panel per run
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[:2] == (height, width)


# -- a real Trainer run ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A tiny Llama trained for 12 steps by transformers.Trainer: the files Trainer really writes."""
    import torch
    from transformers import Trainer, TrainingArguments

    from hf_sanity.testing import demo_conversations, tiny_setup

    model, tok = tiny_setup("chatml", "distinct")
    rows = [tok.apply_chat_template(r["messages"], tokenize=False) for r in demo_conversations(32)]
    encoded = [tok(text, truncation=True, max_length=64)["input_ids"] for text in rows]

    def collate(batch):
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, : len(ids)] = labels[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 0.2M-parameter model: threads only add contention on a shared machine
    out = tmp_path_factory.mktemp("real") / "out"
    args = TrainingArguments(
        output_dir=str(out), max_steps=12, logging_steps=1, eval_strategy="steps", eval_steps=4,
        save_steps=6, per_device_train_batch_size=4, learning_rate=1e-3, report_to=[], use_cpu=True,
        disable_tqdm=True, save_only_model=True,
    )  # fmt: skip
    try:
        Trainer(
            model=model, args=args, train_dataset=encoded, eval_dataset=encoded, data_collator=collate
        ).train()
    finally:
        torch.set_num_threads(threads)
    return out


def test_real_trainer_run(real_run):
    report = doctor([real_run], use_config=False)
    (stats,) = report.stats["runs"]
    assert stats["state"] == str(real_run / "checkpoint-12" / "trainer_state.json")
    assert stats["vocab_size"] == 1000 and stats["train_points"] == 12 and stats["evaluations"] == 3
    # 12 steps of a random tiny model: still close to chance ln(1000)
    assert rules(report) <= {"underfitting"}
    same = doctor([real_run / "checkpoint-12" / "trainer_state.json"], use_config=False)
    assert [f.to_dict() for f in same.findings] == [
        {**f.to_dict(), "evidence": {**f.evidence, "run": same.stats["runs"][0]["run"]}}
        for f in report.findings
    ]


def lora_runs(root: Path, *, seeded: bool, watched: bool = False, reordered: bool = False) -> list[Path]:
    """Two LoRA runs of one command on the fine-tuned tiny model (a plain Trainer, the adapter built with
    get_peft_model before it, as most scripts do), each with a checkpoint. ``seeded``: transformers.set_seed(0)
    right before get_peft_model (between the runs the process's generator moves on, as a new process's differs);
    ``watched``: a SanityCallback on each; ``reordered``: the second reads the same rows in another order (the
    files record nothing of the data)."""
    import torch
    from dist import tinytrain as tt
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from hf_sanity.callback import SanityCallback
    from hf_sanity.testing import trained_model_dir

    folder = trained_model_dir("clean")  # a model that already answers: the adapter moves its loss
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    outs = []
    try:
        for name in ("first", "second"):
            model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
            if seeded:
                set_seed(0)
            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
            data = tt.rows(tok)
            if reordered and name == "second":
                data = data[16:] + data[:16]
            callbacks = [SanityCallback(use_config=False, print_findings=False)] if watched else []
            out = root / name
            trainer = tt.trainer(out, model=model, tok=tok, data=data, callbacks=callbacks, max_steps=30,
                                 logging_steps=1, learning_rate=2e-2, save_strategy="steps", save_steps=30,
                                 save_only_model=True)  # fmt: skip
            trainer.train()
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    return outs


@pytest.mark.planted("seed-unfixed")
def test_two_lora_runs_of_one_command_differ_when_the_adapter_is_built_unseeded(tmp_path):
    first, second = lora_runs(tmp_path, seeded=False)
    (finding,) = doctor([first, second], use_config=False).by_rule("seed-unfixed")
    assert finding.evidence["adapter"] is True and finding.evidence["seeds"] == {
        str(first): 0,
        str(second): 0,
    }
    assert "LoRA weights are drawn when it is built" in finding.message
    assert finding.evidence["start_weights"] == {
        str(first): None,
        str(second): None,
    }  # not watched: not measured


@pytest.mark.planted("seed-unfixed")
def test_watched_runs_say_whether_they_started_from_the_same_weights(tmp_path):
    """SanityCallback's digest of the trainable weights at step 0 turns the likely cause into a measured one:
    unseeded adapters start apart; seeded ones start alike, and a second run that reads the rows in another
    order still differs, with the data named."""
    first, second = lora_runs(tmp_path / "unseeded", seeded=False, watched=True)
    (finding,) = doctor([first, second], use_config=False).by_rule("seed-unfixed")
    starts = finding.evidence["start_weights"]
    assert None not in starts.values() and len(set(starts.values())) == 2
    assert "their trainable weights differed at step 0" in finding.message and "LoRA" in finding.message
    assert finding.fix.startswith("Seed before the adapter is built")
    first, second = lora_runs(tmp_path / "reordered", seeded=True, watched=True, reordered=True)
    (finding,) = doctor([first, second], use_config=False).by_rule("seed-unfixed")
    assert len(set(finding.evidence["start_weights"].values())) == 1
    assert "started from the same trainable weights" in finding.message and "LoRA" not in finding.message
    assert "same data in the same order" in finding.fix


@pytest.mark.clean("seed-unfixed")
def test_two_lora_runs_seeded_before_the_adapter_is_built_agree(tmp_path):
    first, second = lora_runs(tmp_path, seeded=True, watched=True)
    report = doctor([first, second], use_config=False)
    assert report.by_rule("seed-unfixed") == [] and all(read_run(r).adapter for r in (first, second))
    assert read_run(first).start_weights == read_run(second).start_weights is not None


def test_the_start_weights_digest_tells_weights_apart_and_never_digests_part_of_them():
    import torch

    from hf_sanity.measure.tensors import start_fingerprint

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(1000, 8)
    same = torch.nn.Embedding(1000, 8)
    same.load_state_dict(embedding.state_dict())
    assert start_fingerprint(embedding) == start_fingerprint(same) is not None
    with torch.no_grad():
        same.weight[-1, -1] += 1.0  # a row appended at the end, as resize_token_embeddings draws it
    assert start_fingerprint(same) != start_fingerprint(embedding)
    assert start_fingerprint(torch.nn.Linear(4, 3, device="meta")) is None  # not materialised
    assert start_fingerprint(torch.nn.Linear(4, 3).requires_grad_(False)) is None  # nothing trainable


def test_real_trainer_run_records_its_arguments(real_run):
    run = read_run(real_run)
    assert str(real_run / "checkpoint-12" / "training_args.bin") in run.files
    description = describe(run)
    hyper = description.hyperparameters
    assert (hyper["seed"], hyper["learning_rate"], hyper["per_device_train_batch_size"]) == (42, 1e-3, 4)
    assert hyper["lr_scheduler_type"] == "linear"  # an enum, read as its value
    assert "output_dir" not in description.setup and "distributed_state" not in description.setup


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two tiny models of one architecture (ChatML and Llama-3 special tokens: other token ids), each trained
    by a plain Trainer with seed=0 for 30 logged steps, a checkpoint at the end."""
    import torch
    from dist import tinytrain as tt

    from hf_sanity.testing import tiny_setup

    out = tmp_path_factory.mktemp("two-models")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for template in ("chatml", "llama3"):
            model, tok = tiny_setup(template, "distinct")
            tt.trainer(
                out / template, model=model, tok=tok, max_steps=30, logging_steps=1, save_strategy="steps",
                save_steps=30, save_only_model=True, seed=0,
            ).train()  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return [out / "chatml", out / "llama3"]


@pytest.mark.clean("seed-unfixed")
def test_two_models_trained_with_one_seed_are_not_seed_unfixed(two_models):
    a, b = (describe(read_run(path)) for path in two_models)
    assert a.hyperparameters["seed"] == 0 and a.hyperparameters == b.hyperparameters
    assert R._curve_gap(a.curves, b.curves)["differs"]  # the curves differ: only the model tells them apart
    assert a.setup["model.eos_token_id"] != b.setup["model.eos_token_id"]
    assert doctor(two_models, use_config=False).by_rule("seed-unfixed") == []


class TrainingArguments:  # named like the real class, so that the reader reads its fields
    def __init__(self, payload):
        self.seed = 7
        self.hub_token = "hf_not_to_be_read"
        self.payload = payload


class MakeDir:
    """Unpickled, it makes a directory: the shape of every malicious pickle (a callable and its arguments)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def torch_saved(path: Path, obj) -> Path:
    """A file laid out as torch.save writes it: a zip with the pickle at <name>/data.pkl."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("training_args/data.pkl", pickle.dumps(obj, protocol=2))
    return path


def test_training_args_bin_runs_no_code_of_the_file(tmp_path):
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(MakeDir(str(proof))))
    assert proof.is_dir()  # the payload does run when the pickle is loaded
    marker = tmp_path / "ran"
    fields = read_training_args_bin(torch_saved(tmp_path / "a.bin", TrainingArguments(MakeDir(str(marker)))))
    assert not marker.exists()
    assert fields == {"seed": 7, "payload": str(marker)}  # the call is only recorded; the token is dropped
    assert read_training_args_bin(torch_saved(tmp_path / "b.bin", MakeDir(str(marker)))) is None
    assert not marker.exists()
    (tmp_path / "c.bin").write_bytes(pickle.dumps(TrainingArguments(None)))  # not torch.save's zip
    assert read_training_args_bin(tmp_path / "c.bin") is None


# -- SanityCallback's report -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """A plain Trainer run watched by SanityCallback, a NaN in the input of its 3rd batch, a checkpoint at the
    end: the callback names the cause, the logs only show 0.0 losses (logging_nan_inf_filter)."""
    import torch
    from dist import tinytrain as tt

    from hf_sanity.callback import SanityCallback

    out = tmp_path_factory.mktemp("nan") / "out"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = tt.setup()
        tt.trainer(
            out, model=model, tok=tok, callbacks=[SanityCallback(use_config=False, print_findings=False)],
            collator=tt.embeds_collator(tok, model, nan_at_batch=3), logging_steps=1, save_strategy="steps",
            save_steps=12, save_only_model=True,
        ).train()  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return out


def test_doctor_reads_the_callback_report(nan_run):
    from_curves = analyze(read_run(nan_run).curves, final=True)
    assert [f.evidence.get("hidden_by") for f in from_curves if f.rule == "nonfinite-loss"] == [
        "logging_nan_inf_filter"
    ]  # the logs alone: a hidden NaN, no cause
    written = json.loads((nan_run / "hf-sanity" / "report.json").read_text())["findings"]
    for run in (nan_run, nan_run / "checkpoint-12"):  # the report sits in the output_dir above the checkpoint
        report = doctor([run], use_config=False)
        (nan,) = report.by_rule("nonfinite-loss")  # the callback's, not both
        assert (nan.step, nan.evidence["cause"], nan.evidence["source"]) == (3, "input", "SanityCallback")
        assert nan.evidence["run"] == str(run) and "found by SanityCallback" in nan.message
        assert report.stats["runs"][0]["callback_findings"] == len(written)
        assert report.exit_code == 1


def test_without_the_report_doctor_reads_what_the_callback_counted(nan_run, tmp_path):
    """A trainer_state.json copied away from its run (no report.json beside it): the hf_sanity/<rule> counters
    in log_history still say what the callback found, and from which step."""
    lone = tmp_path / "lone"
    lone.mkdir()
    state = json.loads((nan_run / "checkpoint-12" / "trainer_state.json").read_text())
    (lone / "trainer_state.json").write_text(json.dumps(state))
    (nan,) = doctor([lone], use_config=False).by_rule("nonfinite-loss")  # the curves' own, annotated
    assert (nan.evidence["callback_counted"], nan.evidence["callback_first_step"]) == (1, 3)
    assert "SanityCallback counted it from step 3" in nan.message
    state["log_history"][5]["hf_sanity/stale-gradients"] = 2  # a rule no curve detector can see
    (lone / "trainer_state.json").write_text(json.dumps(state))
    (stale,) = doctor([lone], use_config=False).by_rule("stale-gradients")
    assert stale.severity == "error" and stale.step == state["log_history"][5]["step"]
    assert stale.evidence == {
        "run": str(lone),
        "source": "SanityCallback",
        "counted": 2,
        "first_logged_step": 6,
    }


def write_callback_report(folder: Path, *findings: dict) -> Path:
    (folder / "hf-sanity").mkdir(parents=True, exist_ok=True)
    path = folder / "hf-sanity" / "report.json"
    path.write_text(json.dumps({"title": "hf-sanity training", "findings": list(findings), "stats": {}}))
    return path


LR_TOO_LOW = {"rule": "lr-too-low", "severity": "warning", "message": "updates are 1e-9 of the weights",
              "evidence": {"update_ratio": 1e-9}, "fix": "Raise the learning rate.", "step": 40}  # fmt: skip


def test_a_callback_finding_the_curves_give_is_not_repeated(tmp_path):
    spiky = series(seed=1)
    spiky.train_loss[150] = 3 * spiky.train_loss[149]
    run = write_run(tmp_path / "run", spiky)
    (from_curves,) = doctor([run], use_config=False).by_rule("loss-spike")
    write_callback_report(
        run, from_curves.to_dict(), LR_TOO_LOW, {"rule": "loss-flat"}
    )  # the last: malformed
    report = doctor([run], use_config=False)
    (spike,) = report.by_rule("loss-spike")
    assert "source" not in spike.evidence
    (low,) = report.by_rule("lr-too-low")
    assert (low.evidence["source"], low.evidence["update_ratio"], low.step) == ("SanityCallback", 1e-9, 40)
    assert rules(report) == {"loss-spike", "lr-too-low"}
    assert rules(doctor([run], ignore="lr-too-low", use_config=False)) == {"loss-spike"}


def test_callback_findings_count_in_the_churn(tmp_path):
    paths = churn_runs(tmp_path)
    write_run(paths[2], series(seed=3, peak=1e-3), config=LLAMA)  # its logs look fine ...
    write_callback_report(paths[2], LR_TOO_LOW)  # ... the callback saw updates too small to learn
    (churn,) = doctor(paths, use_config=False).by_rule("hyperparameter-churn")
    assert churn.evidence["failure_classes"] == ["not-learning"]
    assert churn.evidence["failures_by_run"][str(paths[2])] == ["lr-too-low"]
    assert len(churn.evidence["runs"]) == 4


def test_malformed_callback_report_is_a_user_error(tmp_path):
    run = write_run(tmp_path / "run", series())
    (run / "hf-sanity").mkdir()
    (run / "hf-sanity" / "report.json").write_text('{"findings": [')
    with pytest.raises(UserInputError, match=r"SanityCallback report .* malformed JSON"):
        doctor([run], use_config=False)


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory):
    """Two runs that SanityCallback(abort_on="error") stopped at step 1 (a NaN in the first batch), before any
    step was logged: one saved its state (trainer.save_state(): a log_history with no loss), one saved nothing
    but the callback's report."""
    import torch
    from dist import tinytrain as tt

    from hf_sanity.callback import SanityCallback

    root = tmp_path_factory.mktemp("stopped")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, save_state in (("saved-state", True), ("report-only", False)):
            model, tok = tt.setup()
            trainer = tt.trainer(
                root / name, model=model, tok=tok, collator=tt.embeds_collator(tok, model, nan_at_batch=1),
                callbacks=[SanityCallback(abort_on="error", use_config=False, print_findings=False)],
            )  # fmt: skip
            trainer.train()
            assert trainer.state.hf_sanity_aborted_at_step == 1
            if save_state:
                trainer.save_state()
    finally:
        torch.set_num_threads(threads)
    assert not (root / "report-only" / "trainer_state.json").exists()
    return root / "saved-state", root / "report-only"


def test_doctor_shows_the_report_of_a_run_stopped_before_any_loss_was_logged(stopped_runs):
    for run in stopped_runs:
        report = doctor([run], use_config=False)
        (nan,) = report.by_rule("nonfinite-loss")
        assert (nan.step, nan.evidence["cause"], nan.evidence["source"]) == (1, "input", "SanityCallback")
        (note,) = report.notes
        assert note.startswith(f"{run}: ") and "its curves were not" in note
        assert report.exit_code == 1


def test_a_run_with_nothing_to_read_is_skipped_among_others_and_bad_input_alone(stopped_runs, tmp_path):
    clean = write_run(tmp_path / "clean", series(), config=LLAMA)
    report = doctor([*stopped_runs, clean, tmp_path / "typo"], use_config=False)
    assert [r["run"] for r in report.stats["runs"]] == [*map(str, stopped_runs), str(clean)]
    assert report.notes[-1] == (
        f"{tmp_path / 'typo'}: skipped, run {tmp_path / 'typo'} does not exist; pass a trainer_state.json, a "
        "checkpoint folder or a Trainer output_dir"
    )
    with pytest.raises(UserInputError, match="does not exist"):
        doctor([tmp_path / "typo"], use_config=False)


# -- the command line ------------------------------------------------------------------------------
def doctor_cli(*args, cwd=None):
    return cli("doctor", *args, cwd=cwd, timeout=120)


@pytest.mark.slow
def test_cli_clean_run_exits_0_and_writes_json(tmp_path):
    out = tmp_path / "report.json"
    result = doctor_cli(write_run(tmp_path / "run", series(), config=LLAMA), "--json", out, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["findings"] == [] and report["title"] == "hf-sanity doctor"


@pytest.mark.slow
def test_cli_errors_exit_1_with_plot_and_predictions(tmp_path):
    runs = churn_runs(tmp_path / "runs")
    preds = write_jsonl(tmp_path / "p.jsonl", [{"score": 4}] * 20)
    out, png = tmp_path / "r.json", tmp_path / "curves.png"
    result = doctor_cli(*runs, "--json", out, "--plot", png, "--predictions", preds, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "hyperparameter-churn" in result.stdout and "plot written to" in result.stdout
    found = {f["rule"] for f in json.loads(out.read_text())["findings"]}
    assert found == {"loss-flat", "hyperparameter-churn", "eval-scores-cluster"}
    assert png.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.slow
def test_cli_shows_the_cause_the_callback_found(nan_run, tmp_path):
    out = tmp_path / "report.json"
    result = doctor_cli(nan_run, "--json", out, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "nonfinite-loss" in result.stdout and "SanityCallback" in result.stdout
    (nan,) = [f for f in json.loads(out.read_text())["findings"] if f["rule"] == "nonfinite-loss"]
    assert (nan["step"], nan["evidence"]["cause"], nan["evidence"]["source"]) == (
        3,
        "input",
        "SanityCallback",
    )


@pytest.mark.slow
def test_cli_ignore_turns_exit_1_into_0(tmp_path):
    runs = churn_runs(tmp_path / "runs")
    result = doctor_cli(*runs, "--ignore", "loss-flat,hyperparameter-churn", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_cli_bad_input_is_one_line(tmp_path):
    assert_one_line_error(doctor_cli(tmp_path / "nope", cwd=tmp_path), "does not exist", "trainer_state.json")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(doctor_cli(tmp_path / "empty", cwd=tmp_path), "no trainer_state.json")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "trainer_state.json").write_text('{"log_history": [')
    assert_one_line_error(doctor_cli(bad, cwd=tmp_path), "malformed JSON")
    assert_one_line_error(doctor_cli(write_run(tmp_path / "run", series()), "--select", "nope", cwd=tmp_path),
                          "unknown rule or stage 'nope'")  # fmt: skip


@pytest.mark.slow
def test_cli_needs_a_run(tmp_path):
    result = doctor_cli(cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_cli_html_page_embeds_the_curves(tmp_path):
    runs = churn_runs(tmp_path / "runs")
    page = tmp_path / "doctor.html"
    result = doctor_cli(*runs, "--html", page, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    text = page.read_text()
    assert 'data-rule="hyperparameter-churn"' in text
    assert "data:image/png;base64," in text and "loss curves" in text


@pytest.mark.slow
def test_cli_shows_what_a_stopped_run_left_and_skips_what_is_not_there(stopped_runs, tmp_path):
    """`hf-sanity doctor` on the runs SanityCallback stopped at step 1 (one without trainer_state.json) and a
    path that is not a run: the callback's finding is shown, each missing part said in one line."""
    saved, report_only = stopped_runs
    out = tmp_path / "report.json"
    result = doctor_cli(saved, report_only, tmp_path / "typo", "--json", out, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert [f["evidence"]["cause"] for f in report["findings"] if f["rule"] == "nonfinite-loss"] == [
        "input"
    ] * 2
    assert report["notes"] == [
        f"{saved}: {saved / 'trainer_state.json'} logs no loss (log_history has no 'loss' nor 'eval_loss' "
        "entry): its curves were not analysed",
        f"{report_only}: no trainer_state.json (the run saved no checkpoint and did not call "
        "trainer.save_state()): its curves were not read",
        f"{tmp_path / 'typo'}: skipped, run {tmp_path / 'typo'} does not exist; pass a trainer_state.json, a "
        "checkpoint folder or a Trainer output_dir",
    ]
    shown = " ".join(result.stdout.split())
    assert all(f"note: {note}" in shown for note in report["notes"]), result.stdout
