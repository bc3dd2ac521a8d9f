"""Training rules: per-step signals of a running Trainer, watched by `SanityCallback`.

Each rule's detector is a plain monitor in `hf_sanity.monitors` (driven by numbers in tests); the
callback only forwards Trainer events to them.
"""

from __future__ import annotations

from hf_sanity.catalog import define

NONFINITE_LOSS = define(
    "nonfinite-loss",
    severity="error",
    stage="training",
    symptom="Loss becomes NaN/Inf (often logged as 0.0 because `logging_nan_inf_filter` hides it).",
    detects="The per-step loss is kept on the device and read once per logging step, so the exact first "
    "non-finite step is found; the batch is replayed with forward hooks to name the first module whose "
    "output went non-finite, and `evidence.cause` is one of input, lr-too-high, unsafe-math, "
    "precision-overflow, empty-loss-mask or unknown. The batch is saved under output_dir/hf-sanity/.",
    fix="Follow evidence.cause: clean the inputs (input), lower the LR or clip gradients (lr-too-high), guard "
    "log/exp/division in the custom loss (unsafe-math), train in bf16 or fp32 (precision-overflow), fix the "
    "labels mask (empty-loss-mask); reproduce on the saved batch.",
)

NONFINITE_GRAD = define(
    "nonfinite-grad",
    severity="error",
    stage="training",
    symptom="Weights turn NaN a step later; the loss curve ends abruptly.",
    detects="The gradient norm before the optimizer step is NaN/Inf while the loss is finite.",
    fix="Lower the learning rate, enable gradient clipping (max_grad_norm), or use bf16/fp32 instead of fp16.",
)

GRAD_EXPLOSION = define(
    "grad-explosion",
    severity="warning",
    stage="training",
    symptom="Loss spikes or diverges after a period of normal training.",
    detects="The gradient norm is far above its running median (x10 by default); names the batch that preceded it.",
    fix="Lower the learning rate or lengthen warmup, keep max_grad_norm clipping on, and inspect the named batch.",
)

LOSS_FLAT = define(
    "loss-flat",
    severity="error",
    stage="training",
    symptom="The loss does not move from step 0: nothing is being learned.",
    detects="During training, `evidence.cause` is measured: no-grad (parameters that require grad receive none: "
    "detached graph or missing backward), not-in-optimizer, lr-zero, frozen (nothing requires grad), "
    "no-update (parameters unchanged by the optimizer step) or unknown. In `doctor`, a logged loss curve "
    "that stays flat (compared with ln(V) where the vocabulary is known).",
    fix="Fix the gradient path named by evidence.cause: keep the loss attached to the graph, build the "
    "optimizer over the trainable parameters, set a non-zero LR, unfreeze/attach the adapter, call "
    "optimizer.step().",
)

LR_ZERO = define(
    "lr-zero",
    severity="error",
    stage="training",
    symptom="Training runs but the model never changes (or stops changing early).",
    detects="The learning rate is 0 at a training step (outside the first warmup step): warmup or decay "
    "misconfigured, or the schedule decayed to 0 early.",
    fix="Check learning_rate, warmup_steps/ratio and the scheduler's num_training_steps (max_steps vs epochs).",
)

LR_TOO_LOW = define(
    "lr-too-low",
    severity="warning",
    stage="training",
    symptom="Fine-tune produces base-model-quality output: weights barely move.",
    detects="The update-to-weight ratio (|Δw|/|w| per step) stays orders of magnitude below ~1e-3 for many steps.",
    fix="Raise the learning rate (LoRA typically 1e-4..3e-4, full fine-tune 1e-5..5e-5) or run the LR range test "
    "(`hf-sanity diagnose`).",
)

STALE_GRADIENTS = define(
    "stale-gradients",
    severity="error",
    stage="training",
    symptom="Loss diverges after a few steps; the gradient norm grows step after step.",
    detects="Gradients are present before the first backward of an optimizer step (not cleared) and the norm "
    "grows steadily.",
    fix="Call optimizer.zero_grad() (or model.zero_grad()) after every optimizer step.",
)

TRAIN_MODE_OFF = define(
    "train-mode-off",
    severity="error",
    stage="training",
    symptom="Training looks fine but generalises worse: dropout and other train-only behaviour is silently off.",
    detects="The model runs its training forward with `model.training == False`, e.g. left in eval mode after "
    "an evaluation.",
    fix="Call model.train() before the training forward (after every evaluation).",
)

RANKS_DIVERGED = define(
    "ranks-diverged",
    severity="error",
    stage="training",
    symptom="Under DDP, replicas drift apart; checkpoints from different ranks differ.",
    detects="Cheap per-parameter checksums are compared across ranks every few steps.",
    fix="Make every rank go through the DDP-wrapped model for forward/backward, clip on every rank, and do not "
    "skip steps on one rank only.",
)

LOSS_PLATEAU_PRIOR = define(
    "loss-plateau-prior",
    severity="warning",
    stage="training",
    symptom="The loss plateaus early at a value that never improves; outputs are generic.",
    detects="The loss sits at the entropy of the label distribution: the model learned the token prior only.",
    fix="Check that inputs reach the model (attention mask, position ids, the inputs actually vary) and that "
    "the LR is not too low; run the overfit test.",
)

PREDICTIONS_FROZEN = define(
    "predictions-frozen",
    severity="warning",
    stage="training",
    symptom="Loss decreases but generations never change.",
    detects="Argmax predictions on a fixed probe batch are identical across checks while the loss moves.",
    fix="Check what is being optimised (the loss may be connected to something other than the served weights, "
    "e.g. an adapter that is not active).",
)

MEMORY_GROWTH = define(
    "memory-growth",
    severity="warning",
    stage="training",
    symptom="Out-of-memory after hours of training; memory rises step after step.",
    detects="Memory held across steps keeps growing: on GPU, allocated memory; on CPU, live tensors that "
    "carry autograd history. Names the growth per step and, where possible, the attribute or list holding them.",
    fix="Store `loss.item()` or `loss.detach()`, never the loss tensor itself, in lists and metrics.",
)

OOM = define(
    "oom",
    severity="error",
    stage="training",
    symptom="CUDA out of memory.",
    detects="An out-of-memory error during training; reports the memory breakdown and whether memory grew "
    "before it, so a leak is not 'fixed' by shrinking the batch.",
    fix="If memory grew before the OOM, fix the leak (memory-growth); otherwise lower the batch size, enable "
    "gradient checkpointing, or use a smaller max_len.",
)

SHAPE_MISMATCH = define(
    "shape-mismatch",
    severity="error",
    stage="training",
    symptom="Crashes on a shape error, or broadcasting silently computes the wrong loss.",
    detects="input_ids, labels and attention_mask of the first real batch must have the same shape; logits "
    "must match labels on the sequence dimension.",
    fix="Pad labels with the same collator as input_ids (-100 for padding) and return them at the same length.",
)

OPTIMIZER_MISSING_PARAMS = define(
    "optimizer-missing-params",
    severity="error",
    stage="training",
    symptom="Part of the model (often the adapter or new embeddings) never trains.",
    detects="Parameters that require grad but are in no optimizer param group.",
    fix="Build the optimizer after the model is final (after get_peft_model/resize), over all trainable parameters.",
)

NEGATIVE_LOSS = define(
    "negative-loss",
    severity="error",
    stage="training",
    symptom="The loss goes below zero.",
    detects="A cross-entropy loss is never negative: a negative value means a wrong reduction or a sign error.",
    fix="Check the custom loss: sign, reduction, and that it is a proper negative log-likelihood.",
)
