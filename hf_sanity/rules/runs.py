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
from hf_sanity.measure.runs import (
    ARGS_BIN,
    ARGS_FILES,
    Change,
    RunDescription,
    RunSet,
    canonical,
    changes,
    label_key,
    series,
)  # fmt: skip
from hf_sanity.numbers import median, noise

ARGS_NAMES = (ARGS_BIN, *ARGS_FILES)
SEED_MIN_COMMON = 10  # common logged steps needed to compare two curves
SEED_REL = 0.01  # curves differ when the median |difference| at common steps is >= 1% of the level ...
SEED_NOISE = 0.5  # ... and >= half the curves' own step-to-step noise sigma
CHURN_RUNS = 3  # the iron law: three failed runs that differ only in hyperparameters mean it is a bug
SEVERAL_CHANGES = 2  # settings changed at once after a failure: the outcome cannot be attributed
ACCURACY_HIGH = 0.99  # accuracy at or above this is too good to be true: check leakage first
MAJORITY_SE = 2.0  # accuracy within 2 standard errors above the majority-class rate (or below it)
CLASSIFICATION_MAX_LABELS = 20  # the majority baseline applies when labels take at most 20 values
PREDICTIONS_MIN = 20  # rows needed to judge an accuracy
SCORES_MIN = 10  # scores needed to judge their spread
SCORES_CLUSTER = 0.9  # >= 90% of the scores on their two most common values (one, for a 2-value scale)

# Failure classes, shown in hyperparameter-churn's evidence: a hyperparameter change moves a broken run from
# one symptom to its neighbour (a flat loss at one LR, underfitting at the next). The iron law counts failed
# runs whatever their class; the classes say what the failures have in common. A slug in no class is a class
# of its own.
FAILURE_CLASSES: dict[str, tuple[str, ...]] = {
    "not-learning": (
        "loss-flat", "underfitting", "loss-plateau-prior", "lr-too-low", "lr-zero", "predictions-frozen",
    ),
    "diverging": ("nonfinite-loss", "nonfinite-grad", "loss-spike", "loss-oscillation", "grad-explosion"),
    "train-eval-gap": ("overfitting", "memorizing", "val-below-train"),
}  # fmt: skip
_CLASS_OF = {slug: name for name, slugs in FAILURE_CLASSES.items() for slug in slugs}


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
    "nondeterministic kernels) or is unknown; where both runs saved a PEFT adapter (adapter_config.json beside "
    "the state), it names the adapter's weights drawn before the trainer seeds the run (`evidence.adapter`). Where "
    "SanityCallback watched both runs from step 0, its digest of their trainable weights then says which: "
    "different starting weights, or the same start and so the data or the kernels (`evidence.start_weights`).",
    fix="Set the seed (TrainingArguments(seed=..., data_seed=...)) and enable full determinism when comparing runs; "
    "with an adapter, seed before it is built (transformers.set_seed before get_peft_model).",
)

HYPERPARAMETER_CHURN = define(
    "hyperparameter-churn",
    severity="error",
    stage="runs",
    objectives=ANY,
    symptom="Days spent tuning hyperparameters, every run failing.",
    detects=f"The iron law: {CHURN_RUNS} failed runs that differ only in hyperparameters mean it is a bug, not a "
    f"hyperparameter. In the order the runs are given, among the runs of one objective (a DPO run and a GRPO run "
    f"are not one series), {CHURN_RUNS}+ consecutive runs that each fail (an "
    "error or warning finding of any kind: the failure class may change from run to run, a flat loss at one LR "
    "and a spike at the next), each changed from the one before in hyperparameters only (the seed is one, so a "
    "new learning rate with a new seed is still a hyperparameter-only change). Hyperparameters are "
    "the knobs of TrainingArguments/LoRA (learning rate, schedule, warmup, batch size, epochs, seed, rank, ...) "
    "and the peak LR of the logs where no argument records the LR; the setup is everything else readable: the "
    "model's identity in config.json and the other fields of the training arguments beside the state "
    "(training_args.bin, read inert, and a training_args.json or args.json). A setup change breaks the chain "
    "(a fix of the pipeline was tried); a field one run does not record is not a change.",
    fix="Stop tuning: it is a pipeline bug. Run `hf-sanity diagnose` on the setup (overfit one batch, the "
    "step-0 loss, shapes and masks) before the next run.",
)

SEVERAL_CHANGES_AT_ONCE = define(
    "several-changes-at-once",
    severity="warning",
    stage="runs",
    objectives=ANY,
    symptom="A run after a failure changed several things: it still fails and nothing was learned, or it works "
    "and nobody knows why.",
    detects=f"In the order the runs are given, a run that follows a failed run (an error or warning finding) "
    f"and differs from it in {SEVERAL_CHANGES} or more settings readable in both (one setting per knob: the "
    "learning rate recorded as an argument and as the peak LR of the logs is one; a new model is one; how often "
    "a run logs, evaluates or saves is none). Its outcome cannot be attributed to one change: a run that still "
    "fails rules out none of them, and a run that works names the changes that are confounded.",
    fix="Change one thing at a time after a failure: rerun from the failed run with one of the changes, and keep "
    "the one that explains the outcome.",
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


def _differing(items: list[RunDescription]) -> dict[str, list[Any]]:
    keys = sorted({k for item in items for k in item.hyperparameters})
    out = {}
    for key in keys:
        values = [item.hyperparameters.get(key) for item in items]
        if len({canonical(v) for v in values}) > 1:
            out[key] = values
    return out


def _failed(slugs: frozenset[str]) -> str:
    return "fails (" + ", ".join(sorted(slugs)) + ")" if slugs else "no failure"


def _changed(found: list[Change]) -> dict[str, list[Any]]:
    """The changes as evidence: {setting: [before, after]} (the first field each is recorded under)."""
    return {c.setting: next(iter(c.fields.values())) for c in found}


def hyperparameter_churn(runs: list[RunDescription], failures: list[frozenset[str]]) -> list[Finding]:
    """Chains of consecutive failed runs, each a hyperparameter-only change of the one before; one finding
    per chain of CHURN_CHANGES changes or more."""
    findings = []
    chain: list[int] = []
    steps: dict[int, list[Change]] = {}

    def close() -> None:
        if len(chain) >= CHURN_RUNS:
            findings.append(_churn_finding(runs, failures, list(chain), steps))

    for i in range(len(runs)):
        found = changes(runs[i - 1], runs[i]) if i else []
        hyper_only = bool(found) and all(c.kind == "hyperparameter" for c in found)
        if chain and failures[i] and hyper_only:  # the chain ends at i - 1: it goes on
            chain.append(i)
            steps[i] = found
            continue
        close()
        chain = [i] if failures[i] else []
    close()
    return findings


def _churn_finding(
    runs: list[RunDescription],
    failures: list[frozenset[str]],
    chain: list[int],
    steps: dict[int, list[Change]],
) -> Finding:
    items = [runs[i] for i in chain]
    per_run = {runs[i].label: sorted(failures[i]) for i in chain}
    slugs = Counter(slug for found in per_run.values() for slug in found)
    classes = sorted({failure_class(slug) for slug in slugs})
    how = ", ".join(f"{slug} in {slugs[slug]}" for slug in sorted(slugs))
    tried = "; ".join(", ".join(c.describe() for c in steps[i]) for i in chain[1:])
    compared = sorted({k for item in items for k in item.setup})
    return HYPERPARAMETER_CHURN.finding(
        f"{len(items)} runs in a row fail ({how}) across {len(chain) - 1} hyperparameter-only changes "
        f"({tried}): {CHURN_RUNS} failed runs that differ only in hyperparameters mean it is a bug, not a "
        "hyperparameter — stop tuning, run `hf-sanity diagnose`",
        evidence={
            "runs": [item.label for item in items],
            "changes": [{"run": runs[i].label, "changed": _changed(steps[i])} for i in chain[1:]],
            "failures": sorted(slugs),
            "failure_classes": classes,
            "failures_by_run": per_run,
            "differing_hyperparameters": _differing(items),
            "learning_rates": {item.label: item.learning_rate[0] for item in items},
            "objective": items[0].objective,
            "setup_fields_compared": compared or "none readable (no config.json or args file)",
        },
    )


def several_changes_at_once(runs: list[RunDescription], failures: list[frozenset[str]]) -> list[Finding]:
    """A run after a failed one that changed SEVERAL_CHANGES or more settings."""
    findings = []
    for i in range(1, len(runs)):
        if not failures[i - 1]:
            continue
        found = changes(runs[i - 1], runs[i])
        if len(found) < SEVERAL_CHANGES:
            continue
        before, run = runs[i - 1].label, runs[i].label
        listed = ", ".join(c.describe() for c in found)
        names = [c.setting for c in found]
        evidence = {
            "run": run,
            "previous": before,
            "previous_failures": sorted(failures[i - 1]),
            "changed": _changed(found),
            "outcome": _failed(failures[i]),
        }
        if failures[i]:
            message = (
                f"{run} changed {len(found)} settings at once after {before} failed ({listed}) and still "
                f"{_failed(failures[i])}: none of the changes is ruled out, none is learned from"
            )
        else:
            evidence["confounded"] = names
            message = (
                f"{run} works after {before} failed, but it changed {len(found)} settings at once ({listed}): "
                f"which of them fixed it is confounded ({', '.join(names)})"
            )
        findings.append(SEVERAL_CHANGES_AT_ONCE.finding(message, evidence=evidence))
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


# Both runs trained a PEFT adapter: its weights are drawn when it is built, and built before the trainer seeds the
# run (get_peft_model before Trainer(...): Trainer seeds in its __init__) they come from torch's generator as the
# process left it, which torch seeds differently in every process.
ADAPTER_CAUSE = (
    "both trained an adapter, whose LoRA weights are drawn when it is built: built before the trainer seeds the "
    "run (get_peft_model before Trainer(...), or TRL 0.24's peft_config), they differ from process to process"
)
ADAPTER_FIX = (
    "Seed before the adapter is built: transformers.set_seed(seed) before get_peft_model, or "
    "Trainer(model_init=...)."
)


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
        adapter = a.adapter and b.adapter
        starts = {a.start_weights, b.start_weights}
        if None not in starts:  # SanityCallback watched both from step 0: where they started is measured
            same_start = len(starts) == 1
            message = (
                f"{a.label} and {b.label} have one readable configuration"
                + (f" and the same seed {seed}" if seed is not None else "")
                + f", yet {differ}: "
                + (
                    "they started from the same trainable weights (SanityCallback's digest at step 0), so the "
                    "data they read, its order, or nondeterministic kernels differ"
                    if same_start
                    else "their trainable weights differed at step 0 (SanityCallback's digests "
                    f"{a.start_weights} and {b.start_weights}): they started from different weights"
                    + (f"; {ADAPTER_CAUSE}" if adapter else "")
                )
            )
            if same_start:
                fix = (
                    "Check that both runs read the same data in the same order (data_seed), and set "
                    "TrainingArguments(full_determinism=True) for deterministic kernels."
                )
            elif adapter:
                fix = ADAPTER_FIX
            else:
                fix = (
                    "Seed before any weight is drawn (transformers.set_seed before building an adapter, a new "
                    "head or new embedding rows), or load the same starting weights in both runs."
                )
        elif seed is not None:
            message = (
                f"{a.label} and {b.label} have one readable configuration and the same seed {seed}, yet {differ}: "
                + (ADAPTER_CAUSE + "; else " if adapter else "")
                + "something the files do not record differs (the data, the initial weights) or the kernels "
                "are not deterministic"
            )
            fix = (
                f"The seed is fixed ({seed}): set TrainingArguments(full_determinism=True) for deterministic "
                "kernels, and check that both runs read the same data and start from the same weights."
            )
            if adapter:
                fix = f"{ADAPTER_FIX} {fix}"
        else:
            message = (
                f"{a.label} and {b.label} have one readable configuration but {differ}; their seeds are unknown "
                f"(none of {', '.join(ARGS_NAMES)} beside the state records one), so an unfixed seed is one "
                "possible cause" + (f"; {ADAPTER_CAUSE}" if adapter else "")
            )
            fix = ADAPTER_FIX if adapter else None
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
                    "adapter": adapter,
                    "start_weights": {run.label: run.start_weights for run in (a, b)},
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
def _per_series(rule, runs: RunSet) -> list[Finding]:
    """``rule(descriptions, failures)`` on each objective's runs, in the order given."""
    return [
        finding
        for group in series(runs.descriptions)
        for finding in rule([runs.descriptions[i] for i in group], [runs.failures[i] for i in group])
    ]


@HYPERPARAMETER_CHURN.detector("runs")
def detect_hyperparameter_churn(runs: RunSet) -> list[Finding]:
    return _per_series(hyperparameter_churn, runs)


@SEVERAL_CHANGES_AT_ONCE.detector("runs")
def detect_several_changes_at_once(runs: RunSet) -> list[Finding]:
    return _per_series(several_changes_at_once, runs)


@SEED_UNFIXED.detector("runs")
def detect_seed_unfixed(runs: RunSet) -> list[Finding]:
    return _per_series(lambda descriptions, _: seed_unfixed(descriptions), runs)


@METRIC_SUSPICIOUS.detector("runs")
def detect_metric_suspicious(runs: RunSet) -> list[Finding]:
    if runs.predictions is None:
        return []
    return metric_suspicious(runs.predictions, runs.baseline, runs.baseline_kind)


@EVAL_SCORES_CLUSTER.detector("runs")
def detect_eval_scores_cluster(runs: RunSet) -> list[Finding]:
    return eval_scores_cluster(runs.predictions) if runs.predictions is not None else []
