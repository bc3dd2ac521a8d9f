"""Run rules: what several finished runs (and their predictions) say together (`doctor`)."""

from __future__ import annotations

from hf_sanity.catalog import define

SEED_UNFIXED = define(
    "seed-unfixed",
    severity="warning",
    stage="runs",
    symptom="The same configuration gives different curves from run to run.",
    detects="Runs with the same configuration whose loss curves differ beyond numerical noise.",
    fix="Set the seed (TrainingArguments(seed=..., data_seed=...)) and enable full determinism when comparing runs.",
)

HYPERPARAMETER_CHURN = define(
    "hyperparameter-churn",
    severity="error",
    stage="runs",
    symptom="Days spent tuning hyperparameters, every run failing the same way.",
    detects="Three or more runs that differ only in hyperparameters and show the same failure.",
    fix="Stop tuning: it is a pipeline bug. Run `hf-sanity diagnose` on the setup.",
)

METRIC_SUSPICIOUS = define(
    "metric-suspicious",
    severity="warning",
    stage="runs",
    symptom="Accuracy looks fine but the model is useless, or looks too good to be true.",
    detects="Accuracy at the majority-class rate, or implausibly high.",
    fix="Compare with the majority-class baseline; check split-leakage and label-leakage.",
)

EVAL_SCORES_CLUSTER = define(
    "eval-scores-cluster",
    severity="warning",
    stage="runs",
    symptom="Judge or rubric scores tell nothing: almost all identical.",
    detects="Judge/rubric scores collapsed onto one or two values.",
    fix="Fix the judge prompt or rubric (make it discriminate), or use a pairwise comparison.",
)
