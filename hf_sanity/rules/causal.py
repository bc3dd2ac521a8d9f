"""The causal mask, checked by what the model computes: `future-token-leak` (the protocol's "shapes and masks"
layer, for the mask nobody prints: the one that keeps each position from reading the tokens after it)."""

from __future__ import annotations

from hf_sanity.catalog import define
from hf_sanity.measure.causal import LEAK_ROWS
from hf_sanity.tokenview import TokenView

# The logits at positions <= t may move by this share of their scale when only later tokens change: a causal
# model computes them from tokens 0..t alone, and the masked keys add exact zeros, so they do not move at all
# (0.0 on every causal model measured, float32 and half); a leak moves them by 0.1% (a random-init encoder
# used as a decoder) to tens of percent (a bidirectional mask on a trained model). Or 10x the noise of the
# same batch run twice, where kernels are not deterministic.
LEAK_TOLERANCE = {False: 1e-4, True: 1e-2}  # by half precision
NOISE_FACTOR = 10.0

FUTURE_TOKEN_LEAK = define(
    "future-token-leak",
    severity="error",
    stage="model",
    symptom="The loss falls to near 0 within a few steps and the model is useless at generation: every "
    "position can read the token it is trained to predict.",
    detects=f"On up to {LEAK_ROWS} rows of the first batch the trainer builds (with `trainer=`, after its "
    "collator; else of the sampled examples, right-padded), the tokens after position t (the middle of each "
    "row's real tokens) are replaced by other tokens of the same row, the attention mask and position ids "
    "kept, and the logits at positions <= t compared. A causal model computes them from tokens 0..t alone: "
    f"they may not move by more than {LEAK_TOLERANCE[False]:g} of the logits' scale ({LEAK_TOLERANCE[True]:g} "
    f"in half precision), or {NOISE_FACTOR:g}x what running the same batch twice moves them. Its cause: "
    "`attention-mask` (the batch carries its own 4-D attention mask and it lets positions see ahead: without "
    "it the model is causal) or `model` (the model's attention is not causal whatever the mask: an encoder "
    "used as a decoder, a custom module without a causal mask). Packed rows with a correct mask (position ids "
    "that restart, a block-diagonal causal mask) are causal and pass.",
    fix="Make the attention causal: pass a 2-D padding mask (1 on real tokens) and let the model build the "
    "causal mask, or build the 4-D mask lower-triangular (and block-diagonal across packed sequences).",
    needs=("vocab-size-mismatch",),
)

MASK_FIX = (
    "The collator's 4-D attention mask lets each position attend to the tokens after it. Build it causal: "
    "`mask = torch.tril(torch.ones(T, T, dtype=torch.bool))` (True = attend), combined with the padding mask "
    "and, for packed rows, with a block-diagonal mask (`seq_id[:, None] == seq_id[None, :]`); or return the 2-D "
    "padding mask and let the model build the causal one."
)
MODEL_FIX = (
    "The model's attention is not causal: {why}. Train a causal LM (`AutoModelForCausalLM` of a decoder); an "
    "encoder used as a decoder needs `config.is_decoder=True`; a custom module must pass a causal mask "
    "(`is_causal=True` to `scaled_dot_product_attention`, `mask=nn.Transformer.generate_square_subsequent_mask(T)`)."
)


def _moved_beyond(measured, tolerance: float) -> list[dict]:
    return [row for row in measured["rows"] if max(row["moved"], default=0.0) > tolerance]


def _why_not_causal(model) -> str:
    config = getattr(model, "config", None)
    if getattr(config, "is_decoder", None) is False and not getattr(config, "is_encoder_decoder", False):
        return f"{type(model).__name__} with config.is_decoder=False attends to the whole sequence"
    return f"{type(model).__name__} attends to the whole sequence"


@FUTURE_TOKEN_LEAK.check(applies=lambda ctx: ctx.has_model)
def check_future_token_leak(ctx):
    measured = ctx.future_leak
    if measured is None:
        return
    tolerance = max(LEAK_TOLERANCE[measured["half"]], NOISE_FACTOR * measured["noise"])
    leaking = _moved_beyond(measured, tolerance)
    if not leaking:
        return
    without = measured.get("without_mask")
    by_mask = without is not None and not _moved_beyond(without, tolerance)
    cause = "attention-mask" if by_mask else "model"
    worst = max(leaking, key=lambda row: max(row["moved"]))
    first = next(j for j, moved in enumerate(worst["moved"]) if moved > tolerance)
    share = max(worst["moved"])
    where = "the first batch" if ctx.first_batch is not None else "a batch of the sampled examples"
    checked = len(measured["rows"])
    head = (
        f"the logits at positions <= t move when only the tokens after t change, in {len(leaking)} of {checked} "
        f"rows of {where} (by up to {share:.2%} of their scale; row {worst['row']}, t={worst['t']}, from "
        f"position {first} on)"
    )
    if by_mask:
        message = f"{head}: its 4-D attention mask lets positions see the tokens after them (without it the model is causal)"
        fix = MASK_FIX
    else:
        why = _why_not_causal(ctx.model)
        message = f"{head}: the model's attention is not causal ({why})"
        fix = MODEL_FIX.format(why=why)
    config = getattr(ctx.model, "config", None)
    yield FUTURE_TOKEN_LEAK.finding(
        message,
        evidence={
            "cause": cause,
            "rows": [row["row"] for row in leaking],
            "rows_checked": [row["row"] for row in measured["rows"]],
            "t": [row["t"] for row in measured["rows"]],
            "relative_difference": share,
            "first_moved": {"row": worst["row"], "t": worst["t"], "position": first},
            "tolerance": tolerance,
            "noise": measured["noise"],
            "mask_dims": measured["mask_dims"],
            "model": type(ctx.model).__name__,
            "attn_implementation": getattr(config, "_attn_implementation", None),
        },
        fix=fix,
        example=_view(ctx, worst["row"], worst["t"]),
    )


def _view(ctx, row: int, t: int) -> TokenView | None:
    """The leaking row as the model got it, the focus on t (the last position whose future was kept)."""
    batch = ctx.first_batch
    if batch is not None:
        ids = batch["input_ids"][row].tolist()
        labels = batch["labels"][row].tolist() if hasattr(batch.get("labels"), "shape") else None
        mask = batch.get("attention_mask")
        mask = mask[row].tolist() if mask is not None and mask.dim() == 2 else None
    else:
        ids, labels = ctx.sample_seqs(LEAK_ROWS)[row]
        mask = None
    return TokenView.from_ids(
        ctx.tokenizer,
        ids,
        labels,
        focus=t,
        attention_mask=mask,
        title=f"row {row} (t={t}: the tokens after it changed)",
    )
