"""Curve rules: shapes of the loss and eval curves, shared by `SanityCallback` (online) and `doctor`
(on logged histories). Detectors are pure functions over series of numbers."""

from __future__ import annotations

from hf_sanity.catalog import define

LOSS_SPIKE = define(
    "loss-spike",
    severity="warning",
    stage="curves",
    symptom="The loss suddenly jumps after it had been decreasing.",
    detects="A step whose loss is far above the recent running level after a decrease; reports the step, the "
    "learning rate there and the batch that preceded it.",
    fix="Lower the LR or lengthen warmup, keep gradient clipping on, inspect the batch that preceded the spike.",
)

LOSS_OSCILLATION = define(
    "loss-oscillation",
    severity="warning",
    stage="curves",
    symptom="The loss zig-zags without trending down.",
    detects="Many sign changes of the step-to-step loss difference with an amplitude large against the trend.",
    fix="Lower the learning rate, raise the batch size (or gradient accumulation), check data shuffling.",
)

OVERFITTING = define(
    "overfitting",
    severity="warning",
    stage="curves",
    symptom="Eval loss rises while the training loss keeps falling.",
    detects="The eval loss went down and then rose by a margin while the train loss fell; reports the best step.",
    fix="Keep the checkpoint of the best step (load_best_model_at_end), train fewer epochs, add data or "
    "regularisation (dropout, weight decay, smaller LoRA rank).",
)

UNDERFITTING = define(
    "underfitting",
    severity="warning",
    stage="curves",
    symptom="Both train and eval loss stay high.",
    detects="Train and eval loss remain close to their starting values at the end of training.",
    fix="First run the overfit test (`hf-sanity overfit`): if a single batch cannot be overfit it is a pipeline "
    "bug; otherwise raise the LR, train longer, or use a larger adapter.",
)

VAL_BELOW_TRAIN = define(
    "val-below-train",
    severity="warning",
    stage="curves",
    symptom="Eval loss is consistently below the train loss.",
    detects="The eval loss stays below the train loss by a margin over several evaluations.",
    fix="Check for leakage between splits (split-leakage), an easier eval set, or dropout making train loss "
    "higher; make sure both losses are computed over the same tokens.",
)

EVAL_CONSTANT = define(
    "eval-constant",
    severity="warning",
    stage="curves",
    symptom="Eval metrics are identical at every evaluation.",
    detects="The eval metric (or predictions) does not change across evaluations while training proceeds.",
    fix="Check that evaluation uses the current weights (not a stale copy), that the adapter is active, and "
    "that the metric reads the predictions.",
)

MEMORIZING = define(
    "memorizing",
    severity="warning",
    stage="curves",
    symptom="Training loss falls fast towards 0 while eval does not improve.",
    detects="Train loss drops steeply while the eval loss stays flat.",
    fix="Deduplicate the training data, lower the LR or epochs, add data; check label-leakage.",
)
