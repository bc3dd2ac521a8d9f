"""`doctor RUN...` across runs, on real tiny Trainer runs saved to output dirs (each 120 steps, a checkpoint
with its training_args.bin at the end): the table of the runs, `several-changes-at-once` and the iron law
(`hyperparameter-churn`), planted and clean, in Python and from the command line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from helpers import cli
from hf_sanity.drivers.doctor import doctor

SLOW_SEEDS = [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]


def random_labels(tok, seed: int):
    """The planted bug: the collator draws every supervised label at random, so no hyperparameter can make the
    model learn (the loss stays flat at chance, ln V). Nothing of it is recorded in the training arguments."""
    import torch
    from transformers import DataCollatorForSeq2Seq

    base = DataCollatorForSeq2Seq(tok)
    generator = torch.Generator().manual_seed(seed)

    def collate(features):
        batch = base(features)
        labels = batch["labels"]
        kept = labels != -100
        labels[kept] = torch.randint(4, len(tok), (int(kept.sum()),), generator=generator)
        return batch

    return collate


# name -> (the bug planted?, TrainingArguments that differ from tinytrain's defaults). Every run has a warmup-
# aware constant schedule (tinytrain's "constant" ignores warmup_steps). The bug's LRs stay at or below 3e-3:
# higher, the model fits the noise of its random labels and the loss drifts up instead of staying flat.
RUNS = {
    "low": (False, {"learning_rate": 1e-7}),  # too low an LR: flat
    "fixed": (False, {"learning_rate": 3e-3}),  # one change after "low": it learns
    "fixed-three": (False, {"learning_rate": 3e-3, "per_device_train_batch_size": 8, "warmup_steps": 5}),
    "bug": (True, {"learning_rate": 1e-3}),
    "bug-lr": (True, {"learning_rate": 3e-3}),
    "bug-warmup": (True, {"learning_rate": 3e-3, "warmup_steps": 5}),
    "bug-batch": (True, {"learning_rate": 3e-3, "warmup_steps": 5, "per_device_train_batch_size": 8}),
    "bug-two": (True, {"learning_rate": 3e-4, "per_device_train_batch_size": 8}),  # two changes after "bug"
    # the held-out case: flat at chance at three LRs (each with another seed), a warmup that starts the logged
    # LR near 0
    **{f"chance-{lr:g}": (True, {"learning_rate": lr, "warmup_steps": 30}) for lr in (1e-5, 1e-4, 1e-3)},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """train(name, seed) -> the output dir of that run, trained once per module."""
    import torch
    from dist import tinytrain as tt

    root = tmp_path_factory.mktemp("runs")
    done: dict[tuple[str, int], Path] = {}
    model, tok = tt.setup()

    def train(name: str, seed: int = 0) -> Path:
        if (name, seed) not in done:
            bug, overrides = RUNS[name]
            out = root / f"seed{seed}" / name
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # a 0.2M-parameter model: threads only add contention
            try:
                tt.trainer(
                    out, model=copy.deepcopy(model), tok=tok, collator=random_labels(tok, seed) if bug else None,
                    max_steps=120, logging_steps=1, save_strategy="steps", save_steps=120, save_only_model=True,
                    seed=seed, data_seed=seed, lr_scheduler_type="constant_with_warmup", **overrides,
                ).train()  # fmt: skip
            finally:
                torch.set_num_threads(threads)
            done[(name, seed)] = out
        return done[(name, seed)]

    return train


def table(report) -> list[tuple]:
    return [(row["changed"], row["outcome"]) for row in report.stats["runs"]]


# -- several-changes-at-once -------------------------------------------------------------------------
@pytest.mark.planted("several-changes-at-once")
def test_two_changes_after_a_failure_that_still_fails(trained):
    runs = [trained("bug"), trained("bug-two")]
    report = doctor(runs, use_config=False)
    (finding,) = report.by_rule("several-changes-at-once")
    assert finding.severity == "warning"
    assert finding.evidence["changed"] == {"batch size": [4, 8], "learning rate": [1e-3, 3e-4]}
    assert finding.evidence["previous_failures"] == ["loss-flat"] and finding.evidence["outcome"].startswith(
        "fails"
    )
    assert "changed 2 settings at once" in finding.message and "still fails" in finding.message
    assert "confounded" not in finding.evidence
    assert table(report) == [
        (None, "loss-flat"),
        (["batch size 4 → 8", "learning rate 0.001 → 0.0003"], "loss-flat"),
    ]


@pytest.mark.planted("several-changes-at-once")
def test_a_success_after_several_changes_names_the_confounded_ones(trained):
    """It works now, but why? The LR was the problem; the batch size and the warmup changed with it."""
    report = doctor([trained("low"), trained("fixed-three")], use_config=False)
    (finding,) = report.by_rule("several-changes-at-once")
    assert finding.evidence["outcome"] == "no failure"
    assert finding.evidence["confounded"] == ["batch size", "learning rate", "warmup"]
    assert "works after" in finding.message and "confounded" in finding.message
    assert report.exit_code == 1  # "low" itself is flat: an error of its own


@pytest.mark.clean("several-changes-at-once")
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_one_change_at_a_time_after_a_failure_is_silent(trained, seed):
    """One change after the failed run (it works: the LR did it), then two at once after a success (exploring,
    not debugging): nothing to say. The table shows the detector compared each pair."""
    runs = [trained("low", seed), trained("fixed", seed), trained("fixed-three", seed)]
    report = doctor(runs, use_config=False)
    assert report.by_rule("several-changes-at-once") == []
    assert table(report) == [
        (None, "loss-flat"),
        (["learning rate 1e-07 → 0.003"], "no failure"),
        (["batch size 4 → 8", "warmup 0 → 5"], "no failure"),
    ]


# -- the iron law ----------------------------------------------------------------------------------
CHURN = ["bug", "bug-lr", "bug-warmup", "bug-batch"]


@pytest.mark.planted("hyperparameter-churn")
def test_three_failed_hyperparameter_changes_mean_a_bug(trained):
    report = doctor([trained(name) for name in CHURN], use_config=False)
    (churn,) = report.by_rule("hyperparameter-churn")
    assert churn.severity == "error" and "4 runs in a row fail" in churn.message
    assert [c["changed"] for c in churn.evidence["changes"]] == [
        {"learning rate": [1e-3, 3e-3]},
        {"warmup": [0, 5]},
        {"batch size": [4, 8]},
    ]
    assert churn.evidence["failures"] == ["loss-flat"]
    assert report.by_rule("several-changes-at-once") == []  # one change at a time: the law, not stacking


@pytest.mark.planted("hyperparameter-churn")
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_three_failed_runs_two_hyperparameter_changes_are_the_iron_law(trained, seed):
    report = doctor([trained(name, seed) for name in CHURN[:3]], use_config=False)
    (churn,) = report.by_rule("hyperparameter-churn")
    assert "3 runs in a row fail" in churn.message and "2 hyperparameter-only changes" in churn.message
    # Each run fails (flat, or underfitting where a seed's noise lets the loss drift): the class does not matter.
    assert [outcome != "no failure" for _, outcome in table(report)] == [True] * 3
    assert table(report)[2][0] == ["warmup 0 → 5"]


@pytest.mark.clean("hyperparameter-churn")
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_two_failed_runs_are_not_yet_the_iron_law(trained, seed):
    report = doctor([trained(name, seed) for name in CHURN[:2]], use_config=False)
    assert report.by_rule("hyperparameter-churn") == []
    assert [outcome != "no failure" for _, outcome in table(report)] == [True] * 2
    assert table(report)[1][0] == ["learning rate 0.001 → 0.003"]  # the detector compared them


@pytest.mark.planted("hyperparameter-churn")
@pytest.mark.slow
def test_cli_three_runs_flat_at_chance_at_three_lrs_and_seeds_are_the_iron_law(trained, tmp_path):
    """The held-out case through the command line: three runs that each sit flat at chance, at learning rates
    1e-5, 1e-4 and 1e-3, each with another seed (the seed is a hyperparameter too). doctor said loss-flat per run
    and nothing of the law; its table showed no learning rate, where the logs' first one is ~0 (warmup)."""
    runs = [trained(f"chance-{lr:g}", seed) for seed, lr in enumerate((1e-5, 1e-4, 1e-3))]
    out = tmp_path / "r.json"
    result = cli("doctor", *runs, "--json", out, cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(out.read_text())
    (churn,) = [f for f in report["findings"] if f["rule"] == "hyperparameter-churn"]
    assert churn["severity"] == "error" and "3 runs in a row fail" in churn["message"]
    assert [c["changed"] for c in churn["evidence"]["changes"]] == [
        {"learning rate": [1e-5, 1e-4], "seed": [0, 1]},
        {"learning rate": [1e-4, 1e-3], "seed": [1, 2]},
    ]
    assert list(churn["evidence"]["learning_rates"].values()) == [1e-5, 1e-4, 1e-3]
    rows = report["stats"]["runs"]
    assert [(row["learning_rate"], row["learning_rate_source"]) for row in rows] == [
        (lr, "arguments") for lr in (1e-5, 1e-4, 1e-3)
    ]
    first_logged = [json.loads((run / "checkpoint-120" / "trainer_state.json").read_text())["log_history"][0]
                    ["learning_rate"] for run in runs]  # fmt: skip
    assert first_logged[2] <= 1e-3 / 30 + 1e-12  # warmup: the first logged LR is not the configured one
    shown = " ".join(result.stdout.split())
    assert "learning rate" in shown and "1e-05" in shown and "0.001 " in shown


@pytest.mark.clean("hyperparameter-churn")
def test_a_run_that_works_breaks_the_chain(trained):
    report = doctor([trained(name) for name in ("bug", "bug-lr", "fixed", "bug-warmup", "bug-batch")])
    assert report.by_rule("hyperparameter-churn") == []
    assert [outcome != "no failure" for _, outcome in table(report)] == [True, True, False, True, True]


@pytest.mark.slow
def test_cli_prints_the_runs_table(trained, tmp_path):
    runs = [trained(name) for name in CHURN]
    out = tmp_path / "r.json"
    result = cli("doctor", *runs, "--json", out, cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    shown = " ".join(result.stdout.split())
    assert "runs, in the order given" in shown and "warmup 0 → 5" in shown and "(first)" in shown
    report = json.loads(out.read_text())
    assert "hyperparameter-churn" in {f["rule"] for f in report["findings"]}
    assert all(row["outcome"] != "no failure" for row in report["stats"]["runs"])
    assert [row["changed"] for row in report["stats"]["runs"]][1:] == [
        ["learning rate 0.001 → 0.003"],
        ["warmup 0 → 5"],
        ["batch size 4 → 8"],
    ]
