"""Attention-mask rules, on the first batches the trainer builds (`preflight(trainer=...)`, `SanityCallback`).

Each reads ``ctx.attention`` (measure/attention.py): what the batch's ``attention_mask`` says against its
tokens, labels and position ids. Right padding a causal model never looks at is harmless and not reported;
only what changes the loss is.
"""

from __future__ import annotations

from hf_sanity.catalog import define


def has_attention_mask(ctx) -> bool:
    return ctx.attention is not None and ctx.attention.mask_given


def _rows(rows: list[int]) -> str:
    shown = ", ".join(map(str, rows[:8]))
    return f"row{'s' if len(rows) != 1 else ''} {shown}{', ...' if len(rows) > 8 else ''}"


PADDING_ATTENDED = define(
    "padding-attended",
    severity="error",
    stage="tokens",
    symptom="Loss higher than it should be and outputs that drift with the batch they were trained in: real "
    "tokens attend to padding, or the model learns to emit padding.",
    detects="In the first collated batch, runs of the pad token at the start or end of a row whose "
    "attention_mask is 1: leading padding is attended by every real token after it; trailing padding is "
    "reported when it carries loss. (Trailing padding with no loss is invisible to a causal model.)",
    fix="Build attention_mask as 0 on the padding the collator adds (transformers' DataCollatorWithPadding or "
    "TRL's collator do), not as ones_like(input_ids); and labels -100 there.",
)


@PADDING_ATTENDED.check(applies=has_attention_mask)
def check_padding_attended(ctx):
    facts = ctx.attention
    if facts is None or not facts.pad_seen:
        return
    tok = ctx.tokenizer
    rows = facts.pad_seen_rows
    trained = f", {facts.pad_trained} of them with loss" if facts.pad_trained else ""
    yield PADDING_ATTENDED.finding(
        f"{facts.pad_seen} padding positions ({tok.pad_token!r}) have attention_mask 1 in {len(rows)} of "
        f"{facts.rows} rows of the first batch{trained}: {_rows(rows)}",
        evidence={
            "positions": facts.pad_seen,
            "with_loss": facts.pad_trained,
            "rows": rows,
            "batch_rows": facts.rows,
            "pad_token": tok.pad_token,
        },
    )


TOKENS_MASKED_OUT = define(
    "tokens-masked-out",
    severity="error",
    stage="tokens",
    symptom="The model trains on text it cannot see: loss on tokens hidden from attention, examples with holes "
    "in them, or a loss averaged over the padding.",
    detects="In the first collated batch, positions whose attention_mask is 0 between attended tokens of the "
    "same row, or that carry loss (a label other than -100). Its cause: `content-hidden` (real tokens hidden "
    "inside a row: the mask is wrong) or `labels-padded` (only the padding the collator added carries loss, "
    "its labels the pad id instead of -100: the mask is right, the labels are wrong).",
    fix="Build attention_mask from the padding alone (1 on every real token, 0 on what the collator added), "
    "not from the token ids (pad == EOS hides every EOS), and give padding the label -100.",
)

LABELS_PADDED_FIX = (
    "Pad the labels with -100, not with the pad id: `DataCollatorForSeq2Seq(tokenizer)` does "
    "(`label_pad_token_id=-100`), or in your own collator `pad_sequence(labels, batch_first=True, "
    "padding_value=-100)`. The attention mask is right; keep it. As it is, the loss is averaged over the "
    "padding too (a short row's padding weighs as much as its answer) and the model is trained to write "
    "{pad} after its end."
)


@TOKENS_MASKED_OUT.check(applies=has_attention_mask)
def check_tokens_masked_out(ctx):
    facts = ctx.attention
    if facts is None or not facts.hidden:
        return
    evidence = {"batch_rows": facts.rows, "pad_token": ctx.tokenizer.pad_token}
    if facts.padding_in_loss == facts.hidden:  # nothing real is hidden: the padding carries loss
        rows = facts.padding_in_loss_rows
        labels = sorted(facts.padding_labels, key=facts.padding_labels.get, reverse=True)
        pad_id = ctx.tokenizer.pad_token_id
        as_pad = labels == [pad_id]
        what = (
            f"their labels are the pad id {pad_id} ({ctx.tokenizer.pad_token!r}), not -100"
            if as_pad
            else f"their labels are {labels[:4]}, not -100"
        )
        yield TOKENS_MASKED_OUT.finding(
            f"{facts.padding_in_loss} padding positions carry loss in {len(rows)} of {facts.rows} rows of the "
            f"first batch: {what}; attention_mask is 0 there, as it should be: the labels are padded wrong "
            f"({_rows(rows)})",
            evidence={
                "cause": "labels-padded",
                "positions": facts.padding_in_loss,
                "with_loss": facts.padding_in_loss,
                "padding_labels": {str(k): v for k, v in facts.padding_labels.items()},
                "rows": rows,
                **evidence,
            },
            fix=LABELS_PADDED_FIX.format(pad="padding" if not as_pad else repr(ctx.tokenizer.pad_token)),
        )
        return
    rows = facts.hidden_rows
    with_loss = f", {facts.hidden_supervised} of them with loss" if facts.hidden_supervised else ""
    padded = (
        f" ({facts.padding_in_loss} of them padding whose labels are not -100)"
        if facts.padding_in_loss
        else ""
    )
    yield TOKENS_MASKED_OUT.finding(
        f"{facts.hidden} positions of real content have attention_mask 0 in {len(rows)} of {facts.rows} rows "
        f"of the first batch{with_loss}{padded}: {_rows(rows)}",
        evidence={
            "cause": "content-hidden",
            "positions": facts.hidden,
            "with_loss": facts.hidden_supervised,
            "padding_in_loss": facts.padding_in_loss,
            "rows": rows,
            **evidence,
        },
    )


LEFT_PADDING_SHIFTS_POSITIONS = define(
    "left-padding-shifts-positions",
    severity="error",
    stage="tokens",
    symptom="Left-padded examples are trained at the wrong positions: a loss that depends on the batch an "
    "example lands in, and a model that has learned positions it will not see at inference.",
    detects="The first batch is left-padded and carries no position_ids: the first left-padded example is run "
    "as the batch holds it and alone, without its padding, and their logits compared. With rotary embeddings "
    "they agree (positions are relative) and nothing is reported; with absolute position embeddings they differ.",
    fix="Pad on the right for training (`tokenizer.padding_side = 'right'`; left padding is for batched "
    "generation), or pass position_ids that start at 0 on the first real token.",
    needs=("vocab-size-mismatch",),
)

# Relative logit differences: float32 rounding is ~1e-6 of the scale, one bf16/fp16 forward ~1e-2.
SHIFT_TOLERANCE = {False: 1e-3, True: 5e-2}


@LEFT_PADDING_SHIFTS_POSITIONS.check(
    applies=lambda ctx: ctx.attention is not None and bool(ctx.attention.left_padded_rows)
)
def check_left_padding(ctx):
    shift = ctx.left_padding_shift
    if shift is None:
        return
    relative = shift["max_logit_difference"] / shift["logit_scale"]
    if relative <= SHIFT_TOLERANCE[shift["half"]]:
        return
    rows = ctx.attention.left_padded_rows
    yield LEFT_PADDING_SHIFTS_POSITIONS.finding(
        f"{len(rows)} of {ctx.attention.rows} rows of the first batch are left-padded without position_ids, and "
        f"the model's positions count the padding: the first one's logits differ batched and alone by "
        f"{relative:.1%} of their scale ({shift['pads']} pad tokens before it)",
        evidence={"rows": rows, **shift, "relative_difference": relative},
    )
