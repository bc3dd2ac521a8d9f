"""Protocol rules: the ordered debugging protocol of `overfit` and `diagnose`."""

from __future__ import annotations

from hf_sanity.catalog import define

OVERFIT_FAILED = define(
    "overfit-failed",
    severity="error",
    stage="protocol",
    symptom="The model cannot overfit a handful of examples: the pipeline is broken, not the hyperparameters.",
    detects="Training on 2-10 examples with regularisation off does not bring their loss near zero; the "
    "gradient path is then measured: no trainable params, params not in the optimizer, no gradient reaching "
    "them, labels all masked, loss not connected to the parameters being updated.",
    fix="Fix the broken part of the gradient path named in the evidence before tuning anything.",
)

LR_RANGE = define(
    "lr-range",
    severity="info",
    stage="protocol",
    symptom="Which learning rate to use.",
    detects="A short exponential LR sweep; the loss is tracked until it diverges, and a base LR is suggested "
    "below the divergence point.",
    fix="Use the suggested learning rate as a starting point.",
)

PRECISION_MISMATCH = define(
    "precision-mismatch",
    severity="error",
    stage="protocol",
    symptom="Training in half precision diverges or behaves differently than in float32.",
    detects="The same batch in float32 against bf16/fp16 where available: the loss differs beyond tolerance or "
    "turns non-finite.",
    fix="Train in bf16 (wider range than fp16), keep the loss and norms in fp32, or use fp32 for the unstable modules.",
)
