"""`doctor --predictions`: the per-class table (support, accuracy, most confused with) and `--baseline ACC`, a
human baseline a model should not beat by much, or a majority baseline it must beat; from the CLI and Python."""

from __future__ import annotations

import json
import random

import pytest
from test_doctor import series, write_jsonl, write_run

from helpers import cli
from hf_sanity.drivers.doctor import doctor
from hf_sanity.errors import UserInputError


def predictions(n: int, accuracy: float, *, seed: int = 0, labels=("pos", "neg", "neu")) -> list[dict]:
    """``n`` rows with balanced labels, exactly ``accuracy`` of them predicted right (which ones: by ``seed``),
    the others as another label."""
    rng = random.Random(seed)
    right = set(rng.sample(range(n), round(n * accuracy)))
    rows = []
    for i in range(n):
        label = labels[i % len(labels)]
        wrong = rng.choice([x for x in labels if x != label])
        rows.append({"prediction": label if i in right else wrong, "label": label})
    return rows


def suspicious(report):
    return report.by_rule("metric-suspicious")


def test_the_per_class_table(tmp_path):
    run = write_run(tmp_path / "run", series())
    rows = [{"prediction": "a", "label": "a"}] * 30 + [{"prediction": "a", "label": "b"}] * 8
    rows += [{"prediction": "b", "label": "b"}] * 12 + [{"prediction": "c", "label": "b"}] * 2
    rows += [{"prediction": "b", "label": "c"}] * 5
    report = doctor([run], predictions=write_jsonl(tmp_path / "p.jsonl", rows), use_config=False)
    [view] = report.to_dict()["views"]
    assert view["kind"] == "per-class"
    assert view["rows"] == [
        {
            "label": "a",
            "support": 30,
            "accuracy": 1.0,
            "predicted": 38,
            "most_confused_with": None,
            "confused": 0,
        },
        {
            "label": "b",
            "support": 22,
            "accuracy": 0.5455,
            "predicted": 17,
            "most_confused_with": "a",
            "confused": 8,
        },
        {
            "label": "c",
            "support": 5,
            "accuracy": 0.0,
            "predicted": 2,
            "most_confused_with": "b",
            "confused": 5,
        },
    ]
    from hf_sanity.html import render_html

    page = render_html(report)
    assert "per class (3 labels)" in page and "<td>54.5%</td>" in page


@pytest.mark.slow
@pytest.mark.planted("metric-suspicious")
def test_cli_above_a_human_baseline(tmp_path):
    run = write_run(tmp_path / "run", series())
    preds = write_jsonl(tmp_path / "p.jsonl", predictions(200, 0.96))
    out = tmp_path / "report.json"
    result = cli("doctor", run, "--predictions", preds, "--baseline", "0.85", "--json", out)
    assert result.returncode == 0, result.stderr  # a warning
    [finding] = [f for f in json.loads(out.read_text())["findings"] if f["rule"] == "metric-suspicious"]
    assert finding["evidence"]["cause"] == "above-human-baseline" and finding["evidence"]["baseline"] == 0.85
    assert "most confused with" in result.stdout and "per class" in result.stdout


@pytest.mark.planted("metric-suspicious")
@pytest.mark.parametrize("seed", [0, 1])
def test_above_a_human_baseline(tmp_path, seed):
    run = write_run(tmp_path / "run", series())
    preds = write_jsonl(tmp_path / "p.jsonl", predictions(300, 0.95, seed=seed))
    [found] = suspicious(doctor([run], predictions=preds, baseline=0.8, use_config=False))
    assert found.evidence["cause"] == "above-human-baseline" and "leakage" in found.message
    assert "by hand" in found.fix


@pytest.mark.planted("metric-suspicious")
def test_no_better_than_a_majority_baseline(tmp_path):
    run = write_run(tmp_path / "run", series())
    preds = write_jsonl(tmp_path / "p.jsonl", predictions(300, 0.62, labels=("a", "b", "c", "d", "e")))
    report = doctor([run], predictions=preds, baseline=0.6, baseline_kind="majority", use_config=False)
    [found] = suspicious(report)
    assert found.evidence["cause"] == "at-majority-baseline" and found.evidence["baseline_kind"] == "majority"


@pytest.mark.clean("metric-suspicious")
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n", [40, 200, 1000])
def test_accuracies_that_fit_their_baselines_are_silent(tmp_path, seed, n):
    """A model at 75% on a balanced 3-class task: below a human baseline of 80%, well above a majority baseline
    of 40%."""
    run = write_run(tmp_path / "run", series())
    preds = write_jsonl(tmp_path / "p.jsonl", predictions(n, 0.75, seed=seed))
    for baseline, kind in ((0.8, "human"), (0.4, "majority"), (0.75, "human")):
        report = doctor([run], predictions=preds, baseline=baseline, baseline_kind=kind, use_config=False)
        assert suspicious(report) == [], (baseline, kind)
        assert report.to_dict()["views"][0]["rows"]  # the table is there


@pytest.mark.parametrize(
    "args, needle",
    [((1.5, "human", True), "between 0 and 1"), ((0.9, "expert", True), "--baseline-kind"),
     ((0.9, "human", False), "pass them with --predictions")],
)  # fmt: skip
def test_bad_baselines_are_user_errors(tmp_path, args, needle):
    run = write_run(tmp_path / "run", series())
    baseline, kind, with_predictions = args
    preds = write_jsonl(tmp_path / "p.jsonl", predictions(50, 0.7)) if with_predictions else None
    with pytest.raises(UserInputError, match=needle):
        doctor([run], predictions=preds, baseline=baseline, baseline_kind=kind, use_config=False)


@pytest.mark.slow
def test_cli_bad_baseline_is_one_line_exit_2(tmp_path):
    run = write_run(tmp_path / "run", series())
    result = cli("doctor", run, "--baseline", "0.9")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--predictions" in result.stderr
