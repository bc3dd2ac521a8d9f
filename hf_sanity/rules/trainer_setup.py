"""Trainer setup rules (`preflight(trainer=...)`): packing, gradient accumulation, checkpointing.

Each is measured on the trainer's own model and first batch, not guessed from its arguments
(``measure.trainer_setup``, read through the context's lazy measurements): these rules judge what it found.
"""

from __future__ import annotations

from hf_sanity.catalog import define
from hf_sanity.measure.objective import ANY
from hf_sanity.measure.trainer_setup import checkpointing_on, example_bounds


def has_trainer_batch(ctx) -> bool:
    return ctx.trainer is not None and ctx.first_batch is not None


PACKING_CONTAMINATION = define(
    "packing-contamination",
    severity="error",
    stage="trainer",
    symptom="The model learns to continue one example with another; answers drift into unrelated content.",
    detects="A collated row holding several packed examples is run through the model, and the logits of its "
    "second example are compared with that example run alone: if they differ, packed examples attend to "
    "each other (packing without per-example position ids, or an attention backend that does not isolate them).",
    fix="Use padding-free packing with position_ids that restart per example (TRL packing_strategy='bfd') and an "
    "attention implementation that isolates them (flash_attention_2, or sdpa with transformers' packed masks); "
    "or disable packing.",
    needs=("vocab-size-mismatch",),
)


@PACKING_CONTAMINATION.check(applies=has_trainer_batch)
def check_packing(ctx):
    batch, trainer = ctx.first_batch, ctx.trainer
    if batch is None or trainer is None:
        return
    bounds = example_bounds(batch)
    if bounds is None:
        if getattr(trainer.args, "packing", False):  # packed, and nothing tells the model where examples end
            yield PACKING_CONTAMINATION.finding(
                "packing is on but the batches carry no example boundaries (no position_ids, seq_idx or "
                "cu_seq_lens): packed examples attend to each other",
                evidence={"keys": sorted(batch)},
            )
        return
    measured = ctx.packed_against_alone
    if measured is None:
        return
    row, start, stop, diff = measured.row, measured.start, measured.stop, measured.max_logit_difference
    if diff > 1e-3 * measured.logit_scale:
        backend = measured.attn_implementation
        # transformers isolates packed examples by their position_ids only when no 2-D attention mask is passed.
        with_mask = ctx.attention is not None and ctx.attention.packed_with_mask
        yield PACKING_CONTAMINATION.finding(
            f"packed examples attend to each other: the second example of row {row} gets different logits packed "
            f"than alone (max difference {diff:.3g})"
            + (
                "; the batch carries a 2-D attention_mask beside the restarting position_ids"
                if with_mask
                else ""
            ),
            evidence={
                "row": row,
                "example_tokens": [start, stop],
                "max_logit_difference": diff,
                "position_ids": "position_ids" in batch,
                "attn_implementation": backend,
                "cause": "attention-mask-with-packing" if with_mask else "attention-backend",
            },
            fix=(
                "Drop the attention_mask from packed batches (TRL: padding_free=True, or packing with "
                "packing_strategy='bfd'): transformers builds the per-example mask from position_ids only when "
                "no 2-D attention_mask is given; with one, each example attends to those packed before it."
                if with_mask
                else None
            ),
        )


GRAD_ACCUM_LOSS_SCALING = define(
    "grad-accum-loss-scaling",
    severity="error",
    stage="trainer",
    symptom="Gradient accumulation gives different results than the same effective batch without it; short "
    "examples weigh as much as long ones.",
    detects="With gradient_accumulation_steps > 1, the trainer's compute_loss is called twice on the first batch "
    "with different `num_items_in_batch`: a loss that ignores it is a per-micro-batch mean, which re-weights "
    "tokens across micro-batches.",
    fix="Sum the per-token losses and divide by `num_items_in_batch` in your compute_loss (and set "
    "`self.loss_is_scaled_for_ga = True`), or use the model's built-in loss.",
    needs=("vocab-size-mismatch",),
)


@GRAD_ACCUM_LOSS_SCALING.check(applies=has_trainer_batch)
def check_grad_accum(ctx):
    trainer, measured = ctx.trainer, ctx.items_scaling
    if measured is None:
        return
    if measured.ignores_num_items:
        yield GRAD_ACCUM_LOSS_SCALING.finding(
            f"compute_loss ignores num_items_in_batch under gradient_accumulation_steps="
            f"{trainer.args.gradient_accumulation_steps}: each micro-batch is averaged on its own",
            evidence={
                "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
                "compute_loss": f"{type(trainer).__name__}.compute_loss",
                "accepts_num_items": measured.accepts_num_items,
            },
        )


CHECKPOINTING_BLOCKS_GRADS = define(
    "checkpointing-blocks-grads",
    severity="error",
    stage="trainer",
    objectives=ANY,
    symptom="LoRA weights never move although the loss is computed and backward runs.",
    detects="With gradient checkpointing on, one forward/backward on the first batch: trainable parameters "
    "that receive no gradient (reentrant checkpointing with frozen input embeddings cuts the graph).",
    fix="Call `model.enable_input_require_grads()` before training, or use non-reentrant checkpointing "
    "(gradient_checkpointing_kwargs={'use_reentrant': False}).",
    needs=("vocab-size-mismatch",),
)


def _checkpointing_batch(ctx) -> bool:
    """A trainer's batch, with activation checkpointing on: what the check replays."""
    return has_trainer_batch(ctx) and "labels" in ctx.first_batch and checkpointing_on(ctx.trainer.model)


@CHECKPOINTING_BLOCKS_GRADS.check(applies=_checkpointing_batch)
def check_checkpointing(ctx):
    measured = ctx.checkpointing_grads
    if measured is None:
        return
    trainable, missing = measured.trainable, measured.without_grad
    if len(missing) == len(trainable):
        yield CHECKPOINTING_BLOCKS_GRADS.finding(
            f"with gradient checkpointing on, none of the {len(trainable)} trainable tensors receives a gradient",
            evidence={"trainable_tensors": len(trainable), "without_grad": list(missing[:5])},
        )


CLIPPING_OFF_HALF_PRECISION = define(
    "clipping-off-half-precision",
    severity="warning",
    stage="trainer",
    objectives=ANY,
    symptom="A half-precision run diverges or spikes on one large gradient; nothing caps the step it takes.",
    detects="The trainer's arguments turn gradient clipping off (max_grad_norm 0 or None: Trainer clips only "
    "when it is above 0) while it trains in half precision: bf16 or fp16 mixed precision, or trainable "
    "weights held in bfloat16/float16. Half precision narrows the range a gradient and an update have, so one "
    "outlier batch moves the weights without bound; with clipping off that is the first thing a divergence "
    "points at (loss-diverged, grad-explosion and loss-spike say so during training).",
    fix="Keep gradient clipping on: TrainingArguments(max_grad_norm=1.0), Trainer's default.",
)


def half_precision(trainer) -> dict[str, str] | None:
    """How the trainer trains in half precision (the mixed-precision flag, or the trainable weights' dtype),
    or None when it does not."""
    import torch

    args = trainer.args
    flags = [name for name in ("bf16", "fp16") if getattr(args, name, False)]
    if flags:
        return {"mixed_precision": flags[0]}
    half = (torch.bfloat16, torch.float16)
    dtypes = {p.dtype for p in trainer.model.parameters() if p.requires_grad and p.dtype in half}
    if dtypes:
        return {"trainable_dtype": str(sorted(dtypes, key=str)[0]).replace("torch.", "")}
    return None


@CLIPPING_OFF_HALF_PRECISION.check(applies=lambda ctx: ctx.trainer is not None)
def check_clipping_off_half_precision(ctx):
    trainer = ctx.trainer
    clip = getattr(trainer.args, "max_grad_norm", None)
    if clip is not None and clip > 0:
        return
    precision = half_precision(trainer)
    if precision is None:
        return
    how = next(iter(precision.values()))
    yield CLIPPING_OFF_HALF_PRECISION.finding(
        f"gradient clipping is off (max_grad_norm={clip}) in a {how} run: one outlier gradient moves the "
        "half-precision weights without bound",
        evidence={"max_grad_norm": clip, **precision},
    )
