"""Model rules: the model's vocabulary, embeddings, trainable parameters and step-0 loss."""

from __future__ import annotations

from hf_sanity.catalog import define

INIT_LOSS_OFF_CHANCE = define(
    "init-loss-off-chance",
    severity="error",
    stage="model",
    symptom="Loss starts far above or far below expected.",
    detects="The step-0 loss on a sample of supervised tokens, against what the model and vocabulary predict: "
    "for a fresh head ln(V). Far above ln(V) points at misaligned labels or a broken init; far below at "
    "leakage (the answer is in the input) or labels that are trivially predictable.",
    fix="Far above: check the labels (not shifted by hand, right tokens) and the init. Far below: check "
    "label-leakage and what the labels contain.",
)

NO_TRAINABLE_PARAMS = define(
    "no-trainable-params",
    severity="error",
    stage="model",
    symptom="Fine-tune produces base-model-quality output: nothing was trained.",
    detects="No parameter of the model requires grad (a frozen model, or an adapter that was not attached).",
    fix="Attach the adapter with peft.get_peft_model (or unfreeze the layers to train) before building the trainer.",
)
