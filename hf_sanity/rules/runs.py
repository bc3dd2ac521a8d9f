"""Run rules: what several finished runs (and their predictions) say together (`doctor`)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from hf_sanity.catalog import define
from hf_sanity.findings import Finding
from hf_sanity.measure.curves import Curves
from hf_sanity.measure.objective import ANY
from hf_sanity.measure.runs import ARGS_BIN, ARGS_FILES, RunDescription, RunSet, canonical, label_key
from hf_sanity.numbers import median, noise

ARGS_NAMES = (ARGS_BIN, *ARGS_FILES)
SEED_MIN_COMMON = 10  # common logged steps needed to compare two curves
SEED_REL = 0.01  # curves differ when the median |difference| at common steps is >= 1% of the level ...
SEED_NOISE = 0.5  # ... and >= half the curves' own step-to-step noise sigma
CHURN_MIN_RUNS = 3
ACCURACY_HIGH = 0.99  # accuracy at or above this is too good to be true: check leakage first
MAJORITY_SE = 2.0  # accuracy within 2 standard errors above the majority-class rate (or below it)
CLASSIFICATION_MAX_LABELS = 20  # the majority baseline applies when labels take at most 20 values
PREDICTIONS_MIN = 20  # rows needed to judge an accuracy
SCORES_MIN = 10  # scores needed to judge their spread
SCORES_CLUSTER = 0.9  # >= 90% of the scores on their two most common values (one, for a 2-value scale)

# Failure classes, for hyperparameter-churn: a hyperparameter change moves a broken run from one symptom to
# its neighbour (a flat loss at one LR, underfitting at the next), so runs are grouped by what kind of failure
# they show, not by the exact slugs. A slug in no class is a class of its own.
FAILURE_CLASSES: dict[str, tuple[str, ...]] = {
    "not-learning": (
        "loss-flat", "underfitting", "loss-plateau-prior", "lr-too-low", "lr-zero", "predictions-frozen",
    ),
    "diverging": ("nonfinite-loss", "nonfinite-grad", "loss-spike", "loss-oscillation", "grad-explosion"),
    "train-eval-gap": ("overfitting", "memorizing", "val-below-train"),
}  # fmt: skip
_CLASS_OF = {slug: name for name, slugs in FAILURE_CLASSES.items() for slug in slugs}
_CLASSES_TEXT = "; ".join(f"{name}: {', '.join(slugs)}" for name, slugs in FAILURE_CLASSES.items())


def failure_class(slug: str) -> str:
    return _CLASS_OF.get(slug, slug)


SEED_UNFIXED = define(
    "seed-unfixed",
    severity="warning",
    stage="runs",
    objectives=ANY,
    symptom="The same configuration gives different curves from run to run.",
    detects="Runs with one configuration (the same readable setup and hyperparameters, the same fields "
    "recorded, the peak LR read from the logs included) whose train losses, at the steps both logged "
    f"({SEED_MIN_COMMON}+), differ by a median >= {SEED_REL:.0%} of the level and >= {SEED_NOISE:g}x their own "
    "step-to-step noise sigma (numerical noise alone stays far below both). The seed and the other arguments "
    "are read from training_args.bin (inert: no code of the file runs) and a training_args.json / args.json; "
    "runs whose recorded seeds differ are not compared, runs whose model configs differ are different setups. "
    "The message says whether the seed was the same (then the cause is unrecorded data or weights, or "
    "nondeterministic kernels) or is unknown.",
    fix="Set the seed (TrainingArguments(seed=..., data_seed=...)) and enable full determinism when comparing runs.",
)

HYPERPARAMETER_CHURN = define(
    "hyperparameter-churn",
    severity="error",
    stage="runs",
    objectives=ANY,
    symptom="Days spent tuning hyperparameters, every run failing the same way.",
    detects=f"{CHURN_MIN_RUNS}+ runs that differ only in hyperparameters and fail the same way: each shows an "
    f"error/warning of one failure class ({_CLASSES_TEXT}; a slug in no class is a class of its own), "
    "whichever slug of it (a flat loss at one LR, underfitting at the next). Hyperparameters are the knobs of "
    "TrainingArguments/LoRA (learning rate, schedule, warmup, batch size, epochs, seed, rank, ...) and the peak "
    "LR of the logs; the setup is everything else readable: the model's identity in config.json and the other "
    "fields of the training arguments beside the state (training_args.bin, read inert, and a "
    "training_args.json or args.json). A field one run does not record does not separate it from the others.",
    fix="Stop tuning: it is a pipeline bug. Run `hf-sanity diagnose` on the setup.",
)

METRIC_SUSPICIOUS = define(
    "metric-suspicious",
    severity="warning",
    stage="runs",
    objectives=ANY,
    symptom="Accuracy looks fine but the model is useless, or looks too good to be true.",
    detects=f"From a predictions JSONL ({PREDICTIONS_MIN}+ rows with prediction and label; exact match after "
    f"stripping whitespace): accuracy >= {ACCURACY_HIGH:.0%}, or, with at most {CLASSIFICATION_MAX_LABELS} "
    f"distinct labels, no more than {MAJORITY_SE:g} standard errors above the majority-class rate; or a "
    "single label in the whole set. With `--baseline ACC` (`--baseline-kind human`, the default): above that "
    f"human baseline by more than {MAJORITY_SE:g} standard errors (cause `above-human-baseline`); with "
    "`--baseline-kind majority`: not above it by that much (cause `at-majority-baseline`). The report's per-class "
    "table (support, accuracy, most confused with) shows where the accuracy comes from.",
    fix="Compare with the majority-class baseline; check split-leakage and label-leakage.",
)

EVAL_SCORES_CLUSTER = define(
    "eval-scores-cluster",
    severity="warning",
    stage="runs",
    objectives=ANY,
    symptom="Judge or rubric scores tell nothing: almost all identical.",
    detects=f"From a predictions JSONL ({SCORES_MIN}+ rows with a score): >= {SCORES_CLUSTER:.0%} of the "
    "scores on their two most common values, or on one value when the scores take only two (a pass/fail "
    "scale legitimately has two).",
    fix="Fix the judge prompt or rubric (make it discriminate), or use a pairwise comparison.",
)


def _compatible(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(canonical(a[k]) == canonical(b[k]) for k in a.keys() & b.keys())


def _group(items: list[RunDescription], fields) -> list[list[int]]:
    """Indices grouped by compatible fields (unknown fields do not separate); greedy, in order."""
    groups: list[tuple[dict[str, Any], list[int]]] = []
    for i, item in enumerate(items):
        values = fields(item)
        for known, members in groups:
            if _compatible(known, values):
                members.append(i)
                known.update(values)
                break
        else:
            groups.append((dict(values), [i]))
    return [members for _, members in groups]


def _differing(items: list[RunDescription]) -> dict[str, list[Any]]:
    keys = sorted({k for item in items for k in item.hyperparameters})
    out = {}
    for key in keys:
        values = [item.hyperparameters.get(key) for item in items]
        if len({canonical(v) for v in values}) > 1:
            out[key] = values
    return out


def _class_counts(name: str, slugs: Counter) -> str:
    """ "not-learning: loss-flat in 2, underfitting in 1"; a slug in no class: "negative-loss in 3"."""
    counts = ", ".join(f"{slug} in {slugs[slug]}" for slug in sorted(slugs) if failure_class(slug) == name)
    return counts if name in slugs else f"{name}: {counts}"


def hyperparameter_churn(runs: list[RunDescription], failures: list[frozenset[str]]) -> list[Finding]:
    """Three or more runs of one setup that each fail with a slug of the same failure class."""
    findings = []
    for members in _group(runs, lambda r: r.setup):
        by_class: dict[str, list[int]] = {}
        for i in members:
            for name in sorted({failure_class(slug) for slug in failures[i]}):
                by_class.setdefault(name, []).append(i)
        # Classes shown by the very same runs make one finding (runs both flat and spiking: one churn).
        by_members: dict[tuple[int, ...], list[str]] = {}
        for name, same in by_class.items():
            if len(same) >= CHURN_MIN_RUNS:
                by_members.setdefault(tuple(same), []).append(name)
        for same, classes in by_members.items():
            items = [runs[i] for i in same]
            per_run = {
                runs[i].label: sorted(s for s in failures[i] if failure_class(s) in classes) for i in same
            }
            slugs = Counter(slug for found in per_run.values() for slug in found)
            differing = _differing(items)
            compared = sorted({k for item in items for k in item.setup})
            how = "; ".join(_class_counts(name, slugs) for name in classes)
            shown = "; ".join(
                f"{key}: {', '.join(str(v) for v in values)}" for key, values in list(differing.items())[:3]
            )
            findings.append(
                HYPERPARAMETER_CHURN.finding(
                    f"{len(items)} runs of one setup fail the same way ({how}) "
                    + (f"across different hyperparameters ({shown})" if differing else "with no readable "
                       "hyperparameter telling them apart")
                    + ": stop tuning, run `hf-sanity diagnose`",
                    evidence={
                        "runs": [item.label for item in items],
                        "failure_classes": classes,
                        "failures": sorted(slugs),
                        "failures_by_run": per_run,
                        "differing_hyperparameters": differing,
                        "setup_fields_compared": compared or "none readable (no config.json or args file)",
                    },
                )
            )  # fmt: skip
    return findings


def _curve_gap(a: Curves, b: Curves) -> dict[str, float] | None:
    """How far two train curves are apart at their common steps, against their own noise."""
    pa = {s: v for s, v in zip(a.train_steps, a.train_loss) if math.isfinite(v)}
    pb = {s: v for s, v in zip(b.train_steps, b.train_loss) if math.isfinite(v)}
    common = sorted(pa.keys() & pb.keys())
    if len(common) < SEED_MIN_COMMON:
        return None
    va = np.array([pa[s] for s in common])
    vb = np.array([pb[s] for s in common])
    gap = median(np.abs(va - vb))
    level = median(np.concatenate([va, vb]))
    spread = (noise(va) + noise(vb)) / 2
    differs = level > 0 and gap >= SEED_REL * level and gap >= SEED_NOISE * spread
    return {"gap": gap, "level": level, "noise": spread, "common_steps": len(common), "differs": differs}


def seed_unfixed(runs: list[RunDescription]) -> list[Finding]:
    """Runs with one configuration (the same readable setup and hyperparameters, every field recorded by
    one recorded by the other) whose train curves differ beyond noise. Runs whose recorded seeds differ
    are meant to differ and are not compared."""
    findings = []
    groups: dict[str, list[int]] = {}
    for i, run in enumerate(runs):  # one configuration: the very same readable description
        groups.setdefault(canonical([run.setup, run.hyperparameters]), []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        pairs = []
        for x in range(len(members)):
            for y in range(x + 1, len(members)):
                a, b = runs[members[x]], runs[members[y]]
                gap = _curve_gap(a.curves, b.curves)
                if gap and gap["differs"]:
                    pairs.append((a, b, gap))
        if not pairs:
            continue
        a, b, gap = max(pairs, key=lambda p: p[2]["gap"] / p[2]["level"])
        seeds = {item.label: item.hyperparameters.get("seed") for item in (runs[i] for i in members)}
        seed = runs[members[0]].hyperparameters.get("seed")  # one configuration: the same seed, or none read
        differ = f"their train losses differ by {gap['gap'] / gap['level']:.1%} of the level at the median common step"
        if gap["noise"] > 0:
            differ += f" ({gap['gap'] / gap['noise']:.1f}x the step-to-step noise)"
        if seed is not None:
            message = (
                f"{a.label} and {b.label} have one readable configuration and the same seed {seed}, yet {differ}: "
                "something the files do not record differs (the data, the initial weights) or the kernels "
                "are not deterministic"
            )
            fix = (
                f"The seed is fixed ({seed}): set TrainingArguments(full_determinism=True) for deterministic "
                "kernels, and check that both runs read the same data and start from the same weights."
            )
        else:
            message = (
                f"{a.label} and {b.label} have one readable configuration but {differ}; their seeds are unknown "
                f"(none of {', '.join(ARGS_NAMES)} beside the state records one), so an unfixed seed is one "
                "possible cause"
            )
            fix = None
        findings.append(
            SEED_UNFIXED.finding(
                message,
                fix=fix,
                evidence={
                    "runs": [runs[i].label for i in members],
                    "pair": [a.label, b.label],
                    "median_gap": float(f"{gap['gap']:.4g}"),
                    "relative_gap": float(f"{gap['gap'] / gap['level']:.3g}"),
                    "noise": float(f"{gap['noise']:.4g}"),
                    "common_steps": gap["common_steps"],
                    "seeds": seeds,
                    "differing_pairs": len(pairs),
                },
            )
        )
    return findings


# -- predictions -----------------------------------------------------------------------------------


_key = label_key


def metric_suspicious(
    rows: list[dict[str, Any]], baseline: float | None = None, baseline_kind: str = "human"
) -> list[Finding]:
    """Accuracy (exact match after stripping whitespace) at the majority-class rate, or >= 0.99; against a
    given ``baseline``: above a human one, or not above a majority one."""
    pairs = [(_key(r["prediction"]), _key(r["label"])) for r in rows if "prediction" in r and "label" in r]
    n = len(pairs)
    if n < PREDICTIONS_MIN:
        return []
    accuracy = sum(p == y for p, y in pairs) / n
    labels = Counter(y for _, y in pairs)
    predicted = Counter(p for p, _ in pairs)
    majority_label, majority_count = labels.most_common(1)[0]
    majority = majority_count / n
    top_prediction, top_count = predicted.most_common(1)[0]
    evidence = {
        "accuracy": round(accuracy, 4),
        "rows": n,
        "majority_label": majority_label,
        "majority_rate": round(majority, 4),
        "distinct_labels": len(labels),
        "most_predicted": top_prediction,
        "most_predicted_rate": round(top_count / n, 4),
    }
    if len(labels) == 1:
        return [
            METRIC_SUSPICIOUS.finding(
                f"every one of the {n} labels is {majority_label}: accuracy {accuracy:.1%} says nothing",
                evidence=evidence,
                fix="Evaluate on a set with more than one class (check the label column and the split).",
            )
        ]
    if accuracy >= ACCURACY_HIGH:
        return [
            METRIC_SUSPICIOUS.finding(
                f"accuracy {accuracy:.1%} on {n} rows is implausibly high: check leakage before trusting it",
                evidence=evidence,
            )
        ]
    if len(labels) <= CLASSIFICATION_MAX_LABELS:
        se = math.sqrt(majority * (1 - majority) / n)
        if accuracy <= majority + MAJORITY_SE * se:
            return [
                METRIC_SUSPICIOUS.finding(
                    f"accuracy {accuracy:.1%} is at the majority-class rate {majority:.1%} (always answering "
                    f"{majority_label}); {top_count / n:.0%} of the predictions are {top_prediction}",
                    evidence={**evidence, "majority_margin": round(MAJORITY_SE * se, 4)},
                )
            ]
    return _against_baseline(accuracy, n, baseline, baseline_kind, evidence) if baseline is not None else []


def _against_baseline(accuracy: float, n: int, baseline: float, kind: str, evidence: dict) -> list[Finding]:
    """A human baseline beaten, or a majority baseline not beaten, by more than sampling noise allows."""
    margin = MAJORITY_SE * math.sqrt(max(accuracy * (1 - accuracy), 1 / n) / n)
    evidence = {**evidence, "baseline": baseline, "baseline_kind": kind, "margin": round(margin, 4)}
    if kind == "human" and accuracy > baseline + margin:
        return [
            METRIC_SUSPICIOUS.finding(
                f"accuracy {accuracy:.1%} on {n} rows is above the human baseline {baseline:.1%} (by "
                f"{accuracy - baseline:.1%}, beyond {MAJORITY_SE:g} standard errors): better than people is almost "
                "always leakage or a broken metric",
                evidence={**evidence, "cause": "above-human-baseline"},
                fix="Grade 20 predictions by hand; check split-leakage and label-leakage, and that the metric "
                "compares the prediction with the label (not the label with itself).",
            )
        ]
    if kind == "majority" and accuracy <= baseline + margin:
        return [
            METRIC_SUSPICIOUS.finding(
                f"accuracy {accuracy:.1%} on {n} rows is no better than the majority baseline {baseline:.1%}: "
                "the model adds nothing to always answering the most common label",
                evidence={**evidence, "cause": "at-majority-baseline"},
            )
        ]
    return []


def eval_scores_cluster(rows: list[dict[str, Any]]) -> list[Finding]:
    """Scores collapsed onto one or two values."""
    scores = [_key(r["score"]) for r in rows if "score" in r and r["score"] is not None]
    n = len(scores)
    if n < SCORES_MIN:
        return []
    counts = Counter(scores)
    top = counts.most_common(2)
    on_one = top[0][1] / n
    on_two = sum(c for _, c in top) / n
    binary = len(counts) <= 2
    if binary and on_one < SCORES_CLUSTER:
        return []
    if not binary and on_two < SCORES_CLUSTER:
        return []
    values = [v for v, _ in top[: 1 if binary or on_one >= SCORES_CLUSTER else 2]]
    share = on_one if len(values) == 1 else on_two
    return [
        EVAL_SCORES_CLUSTER.finding(
            f"{share:.0%} of the {n} scores are {' or '.join(values)} "
            f"({len(counts)} distinct values): the scores do not discriminate",
            evidence={
                "scores": n,
                "distinct": len(counts),
                "top_values": dict(counts.most_common(5)),
                "share_on_top": round(share, 4),
            },
        )
    ]


# -- registered detectors: what doctor runs on the set of runs ---------------------------------------
@HYPERPARAMETER_CHURN.detector("runs")
def detect_hyperparameter_churn(runs: RunSet) -> list[Finding]:
    return hyperparameter_churn(runs.descriptions, runs.failures)


@SEED_UNFIXED.detector("runs")
def detect_seed_unfixed(runs: RunSet) -> list[Finding]:
    return seed_unfixed(runs.descriptions)


@METRIC_SUSPICIOUS.detector("runs")
def detect_metric_suspicious(runs: RunSet) -> list[Finding]:
    if runs.predictions is None:
        return []
    return metric_suspicious(runs.predictions, runs.baseline, runs.baseline_kind)


@EVAL_SCORES_CLUSTER.detector("runs")
def detect_eval_scores_cluster(runs: RunSet) -> list[Finding]:
    return eval_scores_cluster(runs.predictions) if runs.predictions is not None else []
