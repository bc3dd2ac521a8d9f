"""Template parity: what the model is trained on must be what it is served with."""

from __future__ import annotations

from collections import Counter

import numpy as np

from hf_sanity.catalog import define
from hf_sanity.measure.families import FAMILY_OF

TEMPLATE_MISMATCH = define(
    "template-mismatch",
    severity="error",
    stage="template",
    symptom="Output has stray template markers; the model answers in the wrong format at inference.",
    detects="Training tokens are compared with what the inference tokenizer's chat template produces for the same "
    "conversation (--inference-tokenizer, on a sample); a `text` or pre-tokenized dataset is checked for another "
    "chat format's markers (`### Response:`, `[INST]`, `<|im_start|>`, ...) than the tokenizer's own template "
    "renders. Plain prose is not a mismatch.",
    fix="Render training data with the same tokenizer and chat template used at inference (save the tokenizer with "
    "the model), or switch the inference tokenizer to the training one.",
)


@TEMPLATE_MISMATCH.check
def check_template_mismatch(ctx):
    yield from _foreign_markers(ctx)
    yield from _inference_parity(ctx)


def _foreign_markers(ctx):
    if ctx.fmt not in ("text", "tokens") or not ctx.own_families:
        return
    families = _text_families(ctx)
    counts = Counter(f for fams in families.values() for f in fams)
    foreign = {family: n for family, n in counts.items() if family not in ctx.own_families}
    if not foreign:
        return
    foreign_rows = [i for i, fams in families.items() if set(fams) - ctx.own_families]
    rows = foreign_rows[:10]
    family, n = max(foreign.items(), key=lambda kv: kv[1])
    yield TEMPLATE_MISMATCH.finding(
        f"{n} of {len(families)} examples carry {family} chat markers, but the tokenizer's template renders "
        f"{', '.join(sorted(ctx.own_families))}",
        evidence={"foreign_formats": foreign, "template_formats": sorted(ctx.own_families), "rows": rows},
        example=ctx.view(rows[0]),
        rows=foreign_rows if ctx.fmt == "text" else None,  # tokens data is judged on a sample only
    )


def _text_families(ctx) -> dict[int, list[str]]:
    """Marker families per example: from the text (text format) or the decoded tokens of a sample."""
    if ctx.fmt == "text":
        column = ctx.values("text_families")
        return {i: fams for i, fams in enumerate(column) if ctx.valid[i]}
    out = {}
    for i in ctx.sample_indices:
        text = ctx.tokenizer.decode(ctx.row(i)["input_ids"])
        out[i] = sorted({family for marker, family in FAMILY_OF.items() if marker in text})
    return out


def _inference_parity(ctx):
    """Render a sample with the inference tokenizer and compare token by token."""
    infer = ctx.inference_tokenizer
    if infer is None or ctx.fmt not in ("messages", "prompt-completion") or ctx.dataset is None:
        return
    if not getattr(infer, "chat_template", None):
        yield TEMPLATE_MISMATCH.finding(
            "the inference tokenizer has no chat template: conversations will be rendered differently at inference",
            evidence={"inference_tokenizer": type(infer).__name__},
        )
        return
    mismatched, first = [], None
    checked = 0
    for i in ctx.sample_indices:
        messages = ctx.conversation(i)
        if not messages:
            continue
        checked += 1
        try:
            served = infer.apply_chat_template(messages, **ctx.template_kwargs(i))["input_ids"]
        except Exception as exc:
            served, first = [], first or (int(i), 0, f"{type(exc).__name__}: {exc}")
        trained = ctx.row(i)["input_ids"]
        if served != trained:
            pos = next(
                (k for k, (a, b) in enumerate(zip(trained, served)) if a != b), min(len(trained), len(served))
            )
            mismatched.append(int(i))
            if first is None:
                first = (int(i), pos, infer.decode(served[max(0, pos - 8) : pos + 16]))
    if not mismatched:
        return
    index, pos, served_text = first
    yield TEMPLATE_MISMATCH.finding(
        f"{len(mismatched)} of {checked} sampled conversations tokenize differently with the inference tokenizer "
        f"(example {index} differs from token {pos})",
        evidence={
            "mismatched": len(mismatched),
            "checked": checked,
            "rows": mismatched[:10],
            "first_difference": pos,
            "inference_renders": served_text,
        },
        example=ctx.view(index, focus=pos, title=f"example {index} as trained"),
    )


GENERATION_PROMPT_MISMATCH = define(
    "generation-prompt-mismatch",
    severity="error",
    stage="template",
    symptom="Output has stray template markers or a wrong first token: the prompt at inference is not what "
    "training saw before each answer.",
    detects="For every assistant turn, the conversation up to that turn is rendered with the generation prompt "
    "(the inference prompt) and must be a token prefix of the training sequence; in pre-rendered data (text, "
    "tokens) every located assistant turn must start with the generation prompt's tokens (e.g. DeepSeek-R1's "
    "`<think>` that its own template strips from completed turns).",
    fix="Train on sequences rendered the way inference renders them, or serve with a generation prompt that "
    "matches the training turns.",
)


@GENERATION_PROMPT_MISMATCH.check
def check_generation_prompt(ctx):
    differs, merges = ctx.col("n_gp_mismatch"), ctx.col("n_gp_merge")
    cause = "text-differs" if (ctx.valid & (differs > 0)).any() else "tokens-merge"
    counts = differs if cause == "text-differs" else merges
    bad = ctx.valid & (counts > 0)
    if not bad.any():
        return
    tok, markers = ctx.tokenizer, ctx.markers
    n = int(ctx.valid.sum())
    rows = ctx.first(bad)
    ids = ctx.row(rows[0])["input_ids"]
    spans = ctx.spans(rows[0])
    prompt = list(markers.generation_ids)
    turn = spans[0].lead if spans else 0
    served = tok.decode(prompt)
    trained = tok.decode(ids[turn : turn + max(len(prompt), 1) + 4])  # the real training text at that place
    shared = next(
        (k for k, (a, b) in enumerate(zip(served, trained)) if a != b), min(len(served), len(trained))
    )
    extra = served[shared:].strip() or served.strip()  # what inference has that the training turn lacks
    evidence = {
        "cause": cause,
        "inference_prompt_ends": served,
        "training_turn_has": trained,
        "rows": rows,
        "turns": int(counts[ctx.valid].sum()),
    }
    if cause == "tokens-merge":  # the same text, tokenized across the boundary: a smaller gap
        yield GENERATION_PROMPT_MISMATCH.finding(
            f"in {int(bad.sum())} of {n} examples the training text starts with the inference prompt but its "
            f"tokens merge across the boundary: inference ends on {served!r}, training has {trained!r}",
            evidence=evidence,
            example=ctx.view(rows[0], focus=spans[0].start if spans else None),
            severity="warning",
            rows=bad,
            fix="The model never sees the inference prompt's last tokens as they are tokenized at inference. End "
            "the generation prompt on a token boundary (a chat template whose turns continue the prompt with a "
            "separate token), or build training sequences from the prompt's own tokens plus the completion's "
            "(TRL does so for prompt/completion data).",
        )
        return
    yield GENERATION_PROMPT_MISMATCH.finding(
        f"in {int(bad.sum())} of {n} examples the inference prompt is not a prefix of the training sequence "
        f"({int(counts[ctx.valid].sum())} assistant turns): inference renders {served!r} where training has "
        f"{trained!r}",
        evidence=evidence,
        example=ctx.view(rows[0], focus=spans[0].start if spans else None),
        fix=_generation_prompt_fix(ctx, rows[0], extra),
        rows=bad,
    )


def _generation_prompt_fix(ctx, row: int, extra: str) -> str:
    """A fix the data can follow: when the data carries what the generation prompt opens (a reasoning block)
    and the rendering drops it, the template is the culprit; otherwise the data lacks it."""
    contents = ""
    if ctx.dataset is not None and ctx.fmt in ("messages", "prompt-completion"):
        messages = ctx.conversation(row)
        if messages:
            contents = " ".join(str(m.get("content") or "") for m in messages if isinstance(m, dict))
    if extra and extra in contents:
        return (
            f"Your data carries {extra!r} but the chat template drops it from the assistant turns it renders (see "
            "template-drops-content): render with a template that keeps it (e.g. TRL's training variant of this "
            "template, trl/chat_templates/*_training.jinja), so training turns start the way inference prompts."
        )
    return (
        f"The training turns lack {extra!r}, which the generation prompt opens at inference: add it to the "
        "training data (e.g. the reasoning block the template expects), or serve with a generation prompt that "
        "matches the training turns (e.g. `enable_thinking=False` where the template has it)."
    )


STRAY_TEMPLATE_MARKERS = define(
    "stray-template-markers",
    severity="warning",
    stage="template",
    symptom="Output has stray template markers; answers stop early or switch speaker mid-text.",
    detects="Special-token strings of the tokenizer, or another chat format's markers, inside message content "
    "(they are tokenized as structure, not text).",
    fix="Strip the markers from the content (they usually come from data rendered with another template), "
    "or escape them.",
)


@STRAY_TEMPLATE_MARKERS.check
def check_stray_markers(ctx):
    column = ctx.values("content_markers")
    hits = {i: m for i, m in enumerate(column) if m and ctx.valid[i]}
    if not hits:
        return
    counts = Counter(marker for markers in hits.values() for marker in markers)
    rows = sorted(hits)[:10]
    n = int(ctx.valid.sum())
    yield STRAY_TEMPLATE_MARKERS.finding(
        f"{len(hits)} of {n} examples have template markers inside message content "
        f"(most common: {counts.most_common(1)[0][0]!r})",
        evidence={"count": len(hits), "markers": dict(counts.most_common(8)), "rows": rows},
        example=ctx.view(rows[0]),
        rows=sorted(hits),
    )


DOUBLE_BOS = define(
    "double-bos",
    severity="error",
    stage="template",
    symptom="Loss much higher than base model at step 0; slightly worse outputs everywhere.",
    detects="Training sequences that start with two BOS tokens: text rendered by a chat template that emits BOS, "
    "then tokenized again with add_special_tokens=True (Llama-2/3, Mistral, DeepSeek templates).",
    fix="Tokenize rendered chat text with add_special_tokens=False, or use apply_chat_template(tokenize=True).",
)


@DOUBLE_BOS.check
def check_double_bos(ctx):
    doubled = ctx.valid & (ctx.col("n_leading_bos") >= 2)
    if not doubled.any():
        return
    n = int(ctx.valid.sum())
    rows = ctx.first(doubled)
    bos = ctx.tokenizer.bos_token
    yield DOUBLE_BOS.finding(
        f"{int(doubled.sum())} of {n} examples ({doubled.sum() / n:.0%}) start with {bos!r} twice",
        evidence={
            "count": int(doubled.sum()),
            "rows": rows,
            "bos_token": bos,
            "max_leading_bos": int(np.max(ctx.col("n_leading_bos"))),
        },
        example=ctx.view(rows[0], focus=1),
        rows=doubled,
    )
