"""Mask rules: which tokens carry loss, and whether the right ones do."""

from __future__ import annotations

import numpy as np

from hf_sanity.catalog import define
from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.measure import frameworks
from hf_sanity.measure.families import NO_TEMPLATE
from hf_sanity.measure.loss_mask import LANGUAGE_MODELLING
from hf_sanity.measure.objective import ANY, SEQUENCES
from hf_sanity.remedies import Remedy, RemedyDoc, display, drop_rows

MISSING_CHAT_TEMPLATE = define(
    "missing-chat-template",
    severity="error",
    stage="tokens",
    objectives=ANY,
    symptom="Conversations cannot be rendered, or are rendered with a format the model has never seen.",
    detects="The dataset holds conversations (messages, or conversational prompt/completion) but the tokenizer has "
    "no `chat_template`.",
    fix="Use the instruct model's tokenizer, or set `tokenizer.chat_template` (and save it with the model) so "
    "training and inference render conversations identically.",
)


@MISSING_CHAT_TEMPLATE.check
def check_missing_chat_template(ctx):
    missing = ctx.col("error") == NO_TEMPLATE
    if missing.any():
        yield MISSING_CHAT_TEMPLATE.finding(
            f"the dataset holds conversations ({int(missing.sum())} rows) but the tokenizer has no chat template",
            evidence={"rows": int(missing.sum()), "tokenizer": type(ctx.tokenizer).__name__},
        )


PROMPT_IN_LOSS = define(
    "prompt-in-loss",
    severity="warning",
    stage="tokens",
    symptom="Model repeats the prompt back; it learns to write the user's side of the conversation.",
    detects="Assistant turns are located from the tokenizer's own chat template; the fraction of supervised tokens "
    "(label != -100) that lie outside them is the prompt share of the loss. The labels are the trainer's (with "
    "`trainer=`) or what TRL's SFTTrainer makes of the format (every token of `messages` and `text` rows, the "
    "completion of prompt-completion rows; `--loss-on` says otherwise). Cause `trainer-default`: the trainer's "
    "default puts the prompt in the loss and nothing says it is intended (a warning); `mask-not-applied`: "
    "completion or assistant loss was asked for (`--loss-on`, the trainer's config) and the prompt still "
    "carries loss (an error); `labels`: the labels the rows or the collator bring; `tool-turns-trained`: where "
    "the loss is meant for some tokens only (a mask asked for, or the rows' or a collator's labels), tokens of "
    "`tool` results carry loss, whatever their share (located by their content in the rendered text, in up to "
    "64 rows with tool turns; an error when a mask was asked for). Silent with `--loss-on all` "
    "(or `completion_only_loss=False`): every token is then intended. A packed row that starts inside an answer "
    "(split across rows by the packing) starts with the rest of that answer, not with a prompt. In a "
    "vision-language run the image placeholders count as neither prompt nor answer (`vision-tokens-in-loss` "
    "judges them).",
    fix="Compute the loss on the answers only: TRL `SFTConfig(assistant_only_loss=True)` with a chat template "
    "that marks them with `{% generation %}` (TRL ships them in trl/chat_templates/ and swaps one in for the "
    "families it knows; else `chat_template_path=`), or prompt-completion rows (completion-only loss by default); "
    "or set the prompt labels to -100 in your own preprocessing. If training on every token is intended, say so: "
    "`--loss-on all`.",
)

PROMPT_SHARE_THRESHOLD = 0.02

# The fix for each cause, by what the rows are (the context's format, as TRL reads it).
TRAINER_DEFAULT_FIX = {
    "messages": "TRL's SFTTrainer trains on every token of `messages` rows by default. For the assistant turns "
    "only: `SFTConfig(assistant_only_loss=True)` with a chat template that marks them with `{% generation %}` "
    "(TRL ships them in trl/chat_templates/, e.g. qwen2_5_training.jinja, and swaps one in for the families it "
    "knows; else pass `chat_template_path=`), or turn each row into prompt-completion (`prompt`: the turns "
    "before the last answer, `completion`: the answer; completion-only loss by default). If every token is "
    'intended, say so: `--loss-on all` (`loss_on="all"`).',
    "text": "TRL's SFTTrainer trains on every token of `text` rows, and cannot mask a conversation rendered into "
    "text: keep the conversations as `messages` with `SFTConfig(assistant_only_loss=True)` (a template with "
    "`{% generation %}`, trl/chat_templates/), or as prompt-completion rows (completion-only loss by default). "
    "If every token is intended (language modelling), say so: `--loss-on all`.",
}
# The labels of a framework that masks the prompt by its own settings (the fix names them).
FRAMEWORK_PROMPT_FIX = {
    "LLaMA-Factory": "LLaMA-Factory masks the prompt unless `train_on_prompt: true`: set `train_on_prompt: false` "
    "(its default) in the config, and check the dataset's `formatting`/`columns` in dataset_info.json put the "
    "prompt in the user turn (`mask_history: true` also keeps earlier answers of multi-turn rows out of the loss).",
    "Axolotl": "Axolotl masks the prompt unless `train_on_inputs: true`: set `train_on_inputs: false` (its "
    'default) in the config; for `type: chat_template` datasets, `roles_to_train: ["assistant"]` (the default) '
    "trains the assistant turns only.",
}
NOT_APPLIED_FIX = (
    "The loss mask asked for ({asked}) is not what the labels carry. TRL applies `completion_only_loss` to "
    "prompt-completion rows only and `assistant_only_loss` to conversational rows only (with `{{% generation %}}` "
    "markers in the template); `text` rows always train on every token. Give the rows the format the mask "
    "applies to, or build the labels yourself (prompt tokens -100)."
)


@PROMPT_IN_LOSS.check
def check_prompt_in_loss(ctx):
    mask = ctx.loss_mask
    prompt_sup = ctx.col("n_prompt_supervised")
    located = ctx.valid & (prompt_sup >= 0)
    if not located.any() or mask.intended_all:  # every token carries loss, as the user said it should
        return
    supervised_by_row = ctx.col("n_supervised")
    if ctx.modality.is_vision:  # image placeholders are neither prompt nor completion (vision-tokens-in-loss)
        vision = ctx.vision_tokens.supervised
        prompt_sup = np.where(prompt_sup >= 0, np.maximum(prompt_sup - vision, 0), prompt_sup)
        supervised_by_row = supervised_by_row - vision
    prompt_tokens = int(prompt_sup[located].sum())
    supervised = int(supervised_by_row[located].sum())
    share = prompt_tokens / max(supervised, 1)
    tools = _tool_turns(ctx, mask, located)
    tool_trained = bool(tools and tools["tool_tokens_supervised"])
    if share <= PROMPT_SHARE_THRESHOLD and not tool_trained:
        return
    affected = located & (prompt_sup > 0)
    if not affected.any():
        return
    rows = ctx.first(affected)
    if tool_trained:
        cause, severity = "tool-turns-trained", "error" if mask.asked else None
        fix = TOOL_TURNS_FIX
        said = (
            f": {tools['tool_tokens_supervised']:,} of them in tool results ({tools['rows_trained_count']} of "
            f"{tools['rows_measured']} rows with tool turns measured)"
            + (f", although {mask.mode} loss was asked for ({mask.why})" if mask.asked else "")
            + ": the model learns to write what the tools return"
        )
        rows = tools["rows_trained"] or rows
    elif mask.trainer_default_all:
        cause, severity = "trainer-default", "warning"
        fix = TRAINER_DEFAULT_FIX.get(ctx.fmt, TRAINER_DEFAULT_FIX["text"])
        said = (
            f" (TRL's default for `{ctx.fmt}` rows: every token)"
            if ctx.fmt in LANGUAGE_MODELLING
            else (" (the trainer's default)")
        )
    elif mask.asked:
        cause, severity = "mask-not-applied", "error"
        fix = NOT_APPLIED_FIX.format(asked=f"{mask.mode}: {mask.why}")
        said = f" although {mask.mode} loss was asked for ({mask.why})"
    else:
        cause, severity, said = "labels", None, ""
        fix = (
            FRAMEWORK_PROMPT_FIX.get(frameworks.of_trainer(ctx.trainer).name)
            if ctx.trainer is not None
            else None
        )
    yield PROMPT_IN_LOSS.finding(
        f"{share:.0%} of supervised tokens are prompt tokens ({prompt_tokens:,} of {supervised:,}){said}",
        evidence={
            "cause": cause,
            "prompt_tokens": prompt_tokens,
            "supervised_tokens": supervised,
            "fraction": share,
            "rows": rows,
            "examples_affected": int((prompt_sup[located] > 0).sum()),
            "loss_mask": mask.describe(),
            **({"tool_turns": tools} if tools else {}),
        },
        example=ctx.view(rows[0], focus=_first_prompt_loss(ctx, rows[0])),
        rows=affected,
        severity=severity,
        fix=fix,
    )


TOOL_TURNS_FIX = (
    "Keep the tool results out of the loss: with `assistant_only_loss=True` the template's `{% generation %}` "
    "markers must wrap the assistant's turns only (TRL's training templates in trl/chat_templates/ leave the "
    "`tool` turns outside them); with your own labels or collator, set the labels of every `tool` turn to -100."
)


def _tool_turns(ctx, mask, located) -> dict | None:
    """The tool results' tokens and their loss, where the loss is meant for some tokens only (a mask asked for, or
    the labels the rows or a collator bring): `hf_sanity.measure.agents.tool_turns_trained`."""
    if mask.mode == "all":
        return None
    from hf_sanity.measure import agents

    return agents.tool_turns_trained(ctx, np.flatnonzero(located))


def _first_prompt_loss(ctx, index: int) -> int | None:
    row = ctx.row(index)
    labels = row["labels"]
    inside = np.zeros(len(labels), dtype=bool)
    for span in ctx.spans(index):
        inside[span.start : span.end] = True
    for pos, label in enumerate(labels):
        if label != IGNORE_INDEX and not inside[pos] and not ctx.modality.is_vision_id(row["input_ids"][pos]):
            return pos
    return None


EMPTY_LOSS_MASK = define(
    "empty-loss-mask",
    severity="error",
    stage="tokens",
    symptom="Fine-tune produces base-model-quality output; loss is NaN or 0 on some batches.",
    detects="Examples with zero supervised tokens after truncation to max_len (all labels -100); a piece of an "
    "example a packing split across rows (its prompt alone) is not an example.",
    fix="Check the response template / assistant mask (it must match the rendered text), and raise max_len or drop "
    "examples whose completion starts after it.",
    remedy=RemedyDoc("unsafe", "Drops the rows that carry no loss (dataset.jsonl)."),
)


@EMPTY_LOSS_MASK.check
def check_empty_loss_mask(ctx):
    # A piece of an example cut by the packing (its prompt alone, the answer in the next row) is not one.
    empty = ctx.valid & (ctx.col("n_supervised_kept") == 0) & ~ctx.col("piece").astype(bool)
    if not empty.any():
        return
    n = int(ctx.valid.sum())
    rows = ctx.first(empty)
    cut = bool(ctx.col("n_supervised")[rows[0]] > 0)
    why = f" (its completion starts after max_len={ctx.options.max_len})" if cut else ""
    yield EMPTY_LOSS_MASK.finding(
        f"{int(empty.sum())} of {n} examples ({empty.sum() / n:.1%}) carry no loss at all; example {rows[0]}{why}",
        evidence={
            "count": int(empty.sum()),
            "fraction": float(empty.sum() / n),
            "rows": rows,
            "cut_by_max_len": int((empty & (ctx.col("n_supervised") > 0)).sum()),
        },
        example=ctx.view(rows[0]),
        rows=empty,
        remedy=drop_rows(np.flatnonzero(empty), EMPTY_LOSS_MASK.slug, "carrying no loss")
        if ctx.rows_are_dataset
        else None,
    )


COMPLETION_MASKED = define(
    "completion-masked",
    severity="error",
    stage="tokens",
    symptom="Fine-tune produces base-model-quality output: the answers the model should learn carry no loss.",
    detects="Completion tokens (located from the chat template) whose label is -100, e.g. a response template "
    "that was not found in the tokenized text, or a mask built with an off-by-one.",
    fix="Build the labels from the tokenizer's own template (TRL `assistant_only_loss` / `completion_only_loss`); "
    "if you use a response template, tokenize it in context (the token ids differ at the start of a text).",
)

MASKED_SHARE_THRESHOLD = 0.02


@COMPLETION_MASKED.check
def check_completion_masked(ctx):
    located = ctx.valid & (ctx.col("n_turns") > 0)
    if not located.any():
        return
    masked_col = ctx.col("n_completion_unsupervised")
    masked = int(masked_col[located].sum())
    total = int(ctx.col("n_completion")[located].sum())
    share = masked / max(total, 1)
    if share <= MASKED_SHARE_THRESHOLD:
        return
    affected = located & (masked_col > 0)
    rows = ctx.first(affected)
    first = rows[0]
    labels = ctx.row(first)["labels"]
    focus = next(
        (p for s in ctx.spans(first) for p in range(s.start, s.stop) if labels[p] == IGNORE_INDEX), None
    )
    yield COMPLETION_MASKED.finding(
        f"{share:.0%} of completion tokens carry no loss ({masked:,} of {total:,})",
        evidence={
            "masked_tokens": masked,
            "completion_tokens": total,
            "fraction": share,
            "rows": rows,
            "examples_affected": int((masked_col[located] > 0).sum()),
        },
        example=ctx.view(first, focus=focus),
        rows=affected,
    )


LABELS_MISALIGNED = define(
    "labels-misaligned",
    severity="error",
    stage="tokens",
    symptom="Loss starts far above or below expected; the model learns to predict two tokens ahead.",
    detects="Given labels equal the *next* input token (labels[i] == input_ids[i+1]) rather than the same "
    "position: the labels were shifted by hand although Hugging Face causal LMs shift them internally.",
    fix="Pass labels aligned with input_ids (labels = input_ids.clone(), prompt positions -100); do not shift them.",
)


@LABELS_MISALIGNED.check
def check_labels_misaligned(ctx):
    eq_next = ctx.col("n_label_eq_next")[ctx.valid]
    eq_same = ctx.col("n_label_eq_same")[ctx.valid]
    supervised = ctx.col("n_supervised")[ctx.valid]
    nxt, same, sup = int(eq_next.sum()), int(eq_same.sum()), int(supervised.sum())
    if sup == 0 or nxt <= 0.5 * sup or nxt <= 2 * same:
        return
    shifted = ctx.valid & (ctx.col("n_label_eq_next") > ctx.col("n_label_eq_same"))
    rows = ctx.first(shifted)
    yield LABELS_MISALIGNED.finding(
        f"{nxt / sup:.0%} of supervised labels equal the next input token, {same / sup:.0%} the same position: "
        "the labels are shifted by one",
        evidence={"equal_next": nxt, "equal_same": same, "supervised": sup, "rows": rows},
        example=ctx.view(rows[0]) if rows else None,
        rows=shifted,
    )


# Added tokens named like a pad that are not one: multimodal and fill-in-the-middle placeholders.
_NOT_A_PAD = ("vision", "image", "video", "audio", "fim")


def pad_candidate(tokenizer, avoid=()) -> str | None:
    """A token of this tokenizer that can pad without harm: one made to pad (Llama-3's
    `<|finetune_right_pad_id|>`, `<pad>`), Qwen's `<|endoftext|>` where it is not EOS, a reserved or unused one,
    else `<unk>`; never EOS, BOS or an id in ``avoid`` (what the data or the template uses)."""
    specials = {tokenizer.eos_token, tokenizer.bos_token}
    avoided = {int(i) for i in avoid}
    added = [
        str(t)
        for i, t in sorted((getattr(tokenizer, "added_tokens_decoder", {}) or {}).items())
        if str(t) not in specials and i not in avoided
    ]
    named = [t for t in added if "pad" in t.lower() and not any(w in t.lower() for w in _NOT_A_PAD)]
    named += [t for t in added if t == "<|endoftext|>"]
    named += [t for hint in ("reserved", "unused") for t in added if hint in t.lower()]
    if named:
        return named[0]
    unk = getattr(tokenizer, "unk_token", None)
    unk_id = getattr(tokenizer, "unk_token_id", None)
    return unk if unk and unk not in specials and unk_id not in avoided else None


EOS_NOT_LEARNED = define(
    "eos-not-learned",
    severity="error",
    stage="tokens",
    objectives=SEQUENCES,
    symptom="Model never stops: answers run on until max_new_tokens, or continue with a new turn.",
    detects="Each completion must end with the template's end-of-turn token (or EOS) carrying loss. Flags "
    "completions without it and end tokens whose label is -100 — the classic trap is pad == EOS with a "
    "collator that masks every pad token, EOS included. On a trainer's batches, an answer its max_length cut "
    "is truncated-completion's, and one a packing split across rows (TRL's wrapped or bfd_split packing: it "
    "ends in the next row) is not judged. `evidence.cause`, and the fix that follows it: pad-is-eos (pad == EOS "
    "and the end tokens masked: a pad token of its own), completion-masked (pad is not EOS and half or more of "
    "those answers' own tokens carry no loss too: the labels mask the answers, e.g. a collator that keeps one "
    "label per row), end-masked (only the end token is masked: labels built one token short), no-end-token "
    "(the completions do not end with one).",
    fix="Keep the end-of-turn/EOS token in the labels: use a pad token distinct from EOS (an unused reserved "
    "token of this tokenizer, or add one), or a collator that masks padding by attention_mask rather than by "
    "token id; for text data append EOS.",
    remedy=RemedyDoc(
        "unsafe",
        "Restores the labels of the end-of-turn tokens that pre-tokenized rows mask (dataset.jsonl) and, with pad "
        "== EOS, sets the tokenizer's pad token to one of its own tokens the data does not use (Llama-3's "
        "`<|finetune_right_pad_id|>`, Qwen's `<|endoftext|>`), or adds `<pad>` and resizes the embeddings. On a "
        "trainer's batches the labels are your collator's: display only.",
    ),
)


@EOS_NOT_LEARNED.check
def check_eos_not_learned(ctx):
    missing = ctx.col("n_eot_missing")
    unsup = ctx.col("n_eot_unsupervised")
    turns = ctx.col("n_turns")
    # Rows without located turns are single completions (language modelling); count them once.
    completions = int(np.where(turns > 0, turns, 1)[ctx.valid].sum())
    n_missing, n_unsup = int(missing[ctx.valid].sum()), int(unsup[ctx.valid].sum())
    if n_missing == 0 and n_unsup == 0:
        return
    bad = ctx.valid & ((missing > 0) | (unsup > 0))
    rows = ctx.first(bad)
    first = rows[0]
    spans = ctx.spans(first)
    focus = spans[0].stop - 1 if spans else len(ctx.row(first)["input_ids"]) - 1
    tok = ctx.tokenizer
    trap = tok.pad_token_id is not None and tok.pad_token_id == tok.eos_token_id and n_unsup > 0
    what = []
    if n_unsup:
        what.append(f"{n_unsup:,} end-of-turn tokens carry no loss")
    if n_missing:
        what.append(f"{n_missing:,} completions do not end with an end-of-turn token")
    candidate = pad_candidate(tok, _in_use(ctx)) if trap else None
    # What the labels show beside the end token: the completions of the rows whose end carries no loss, and how
    # much of them is masked too (a collator that keeps one label per answer masks the answer, not padding).
    masked_rows = ctx.valid & (unsup > 0)
    completion = int(ctx.col("n_completion")[masked_rows].sum())
    completion_masked = int(ctx.col("n_completion_unsupervised")[masked_rows].sum())
    masked_share = completion_masked / completion if completion else 0.0
    if trap:
        cause = "pad-is-eos"
    elif n_unsup and masked_share >= EOS_COMPLETION_MASKED:
        cause = "completion-masked"
    elif n_unsup:
        cause = "end-masked"
    else:
        cause = "no-end-token"
    if trap:
        fix = (
            f"Keep the end-of-turn/EOS token in the labels: set a pad token distinct from EOS ({tok.eos_token!r}), "
            f"e.g. `tokenizer.pad_token = {candidate!r}` (unused by this tokenizer's template), or use a collator "
            "that masks padding by attention_mask rather than by token id."
            if candidate
            else None
        )
    else:
        fix = _EOS_FIX_BY_CAUSE[cause].format(
            pad=tok.pad_token, eos=tok.eos_token, masked=completion_masked, completion=completion
        )
    yield EOS_NOT_LEARNED.finding(
        f"{' and '.join(what)} (of {completions:,} completions)"
        + (
            " — pad == EOS"
            if trap
            else f" — {completion_masked:,} of the {completion:,} completion tokens of those answers carry no loss"
            " either: the labels mask the answers, not padding"
            if cause == "completion-masked"
            else ""
        ),
        fix=fix,
        evidence={
            "cause": cause,
            "end_tokens_without_loss": n_unsup,
            "completions_without_end": n_missing,
            "completions": completions,
            "rows": rows,
            "pad_is_eos": trap,
            "completion_tokens_masked": completion_masked,
            "completion_tokens": completion,
            "end_tokens": sorted(tok.convert_ids_to_tokens(sorted(ctx.markers.stop_ids))),
        },
        example=ctx.view(first, focus=focus),
        rows=bad,
        remedy=_end_labels_remedy(ctx, masked_rows, trap, candidate, cause) if n_unsup else None,
    )


EOS_COMPLETION_MASKED = 0.5  # half the answers' tokens masked too: the labels mask the answers, not the end
# The fix by the measured cause where pad is not EOS (padding is then not what masks the end).
_EOS_FIX_BY_CAUSE = {
    "completion-masked": "The labels mask the answers themselves, not padding (pad {pad!r} is not EOS {eos!r}): "
    "{masked:,} of {completion:,} completion tokens carry no loss. Build labels that cover the whole completion and "
    "its end-of-turn token: TRL's completion_only_loss / assistant_only_loss, or a collator that masks the prompt "
    "and the padding only (a response-template mask runs from the template to the end of the answer).",
    "end-masked": "The end-of-turn token's label is -100 while the rest of the answer carries loss, and pad {pad!r} "
    "is not EOS {eos!r}: the labels were built to stop one token short (an off-by-one at the end of each span), or "
    "a collator masks special tokens by id. Keep the end-of-turn token in each answer's labels.",
    "no-end-token": "Append the end-of-turn/EOS token ({eos!r}) to every completion: text data needs "
    "tokenizer.eos_token at the end of each example, and a template that renders no end of turn needs one.",
}


def _in_use(ctx) -> set[int]:
    """Token ids a pad token must not be: those the data uses and the template's markers."""
    used = set(ctx.distinct("special_ids"))
    return used | set(ctx.markers.turn_marker_ids) | set(ctx.markers.stop_ids)


def _end_labels_remedy(
    ctx, masked, pad_is_eos: bool, candidate: str | None, cause: str = "pad-is-eos"
) -> Remedy | None:
    """Pre-tokenized rows whose end-of-turn tokens carry no loss get those labels back; with pad == EOS the
    tokenizer gets a pad token of its own (``candidate``), or ``<pad>`` and resized embeddings, so that a
    collator that masks pad ids no longer masks EOS. On a trainer's batches the labels are the collator's."""
    if ctx.trainer is not None:
        if cause == "completion-masked":
            return display(
                "build labels that cover each whole completion and its end-of-turn token in your collator"
            )
        if cause != "pad-is-eos":
            return display("keep the end-of-turn token's label in your collator")
        return display(
            "mask padding by attention_mask in your collator"
            + (f", or set `tokenizer.pad_token = {candidate!r}` before building it" if candidate else "")
        )
    if cause == "completion-masked":
        return None  # the answers' labels are not this repair's to guess
    if ctx.source_format != "tokens" or not ctx.rows_are_dataset:
        return None
    rows = [int(i) for i in np.flatnonzero(masked)]
    add_pad = pad_is_eos and candidate is None and ctx.has_model
    slug = EOS_NOT_LEARNED.slug

    def apply(repair) -> None:
        if pad_is_eos and candidate:
            repair.tokenizer.pad_token = candidate
        elif add_pad:
            repair.tokenizer.add_special_tokens({"pad_token": "<pad>"})
            repair.model.resize_token_embeddings(len(repair.tokenizer))
        encoder = repair.encoder()
        for i in rows:
            row = repair.rows()[i]
            labels = restored_end_labels(encoder, row)
            if labels is not None:
                repair.replace(i, {**row, "labels": labels}, slug)

    pad = (
        [f"set the pad token to {candidate!r} (a token of this tokenizer the data does not use)"]
        if pad_is_eos and candidate
        else ["add the pad token '<pad>' and resize the embeddings"]
        if add_pad
        else []
    )
    labels = f"restore the labels of the end-of-turn tokens masked in {len(rows)} pre-tokenized rows"
    changes = ("tokenizer",) * bool(pad) + ("model",) * add_pad + ("dataset",)
    return Remedy(
        " and ".join([*pad, labels]),
        "unsafe",
        changes,
        apply,
        detail={"rows_relabelled": len(rows), "pad_token": candidate or ("<pad>" if add_pad else None)},
    )


def restored_end_labels(encoder, row: dict) -> list[int] | None:
    """The row's labels with each trained turn's end-of-turn token carrying loss again (positions of the row
    as given: padding left out by its attention mask is kept where it is); None when there is nothing to
    restore."""
    ids, labels = list(row["input_ids"]), row.get("labels")
    if labels is None:
        return None
    encoded = encoder.encode(row)
    kept = [i for i, m in enumerate(row.get("attention_mask") or [1] * len(ids)) if int(m)]
    enc_ids, enc_labels, flat = encoded["input_ids"], encoded["labels"], encoded["spans"]
    out = list(labels)
    for k in range(0, len(flat), 4):
        start, stop = flat[k + 1], flat[k + 2]
        last = stop - 1
        trained = any(label != IGNORE_INDEX for label in enc_labels[start:last])
        if (
            stop > start
            and enc_ids[last] in encoder.markers.stop_ids
            and enc_labels[last] == IGNORE_INDEX
            and trained
        ):
            out[kept[last]] = ids[kept[last]]
    return out if out != list(labels) else None


PAD_TOKEN_MISSING = define(
    "pad-token-missing",
    severity="warning",
    stage="tokens",
    symptom="Batching fails ('Asking to pad but the tokenizer does not have a padding token'), or a hasty fix sets pad = EOS and masks EOS.",
    detects="`tokenizer.pad_token` is None and no trainer is there to show the collator. A warning: TRL's "
    "SFTTrainer sets a pad token itself and masks padding by attention mask; a plain collator fails loudly. "
    "When the data shows the mis-masking (an end-of-turn token without loss), that is `eos-not-learned`.",
    fix="Set a pad token that is not EOS: an unused reserved token of this tokenizer, or "
    "`tokenizer.add_special_tokens({'pad_token': '<|pad|>'})` followed by `model.resize_token_embeddings(len(tokenizer))`.",
    remedy=RemedyDoc(
        "safe",
        "Sets the pad token to a token of this tokenizer the data does not use (tokenizer_config.json).",
    ),
)


@PAD_TOKEN_MISSING.check
def check_pad_token(ctx):
    tok = ctx.tokenizer
    if tok.pad_token is not None or ctx.trainer is not None:
        return
    candidate = pad_candidate(tok, _in_use(ctx))
    fix = (
        f"Set a pad token that is not EOS ({tok.eos_token!r}): this tokenizer has {candidate!r} "
        f"(`tokenizer.pad_token = {candidate!r}`); or add one with `tokenizer.add_special_tokens({{'pad_token': "
        "'<|pad|>'})` and `model.resize_token_embeddings(len(tokenizer))`. TRL's SFTTrainer does this for you."
        if candidate
        else None
    )
    yield PAD_TOKEN_MISSING.finding(
        "the tokenizer has no pad token: a plain collator cannot batch, and pad = EOS with a collator that masks "
        "pad ids would mask EOS too",
        evidence={"tokenizer": type(tok).__name__, "eos_token": tok.eos_token, "pad_candidate": candidate},
        fix=fix,
        remedy=_set_pad(candidate) if candidate else None,
    )


def _set_pad(token: str) -> Remedy:
    def apply(repair) -> None:
        repair.tokenizer.pad_token = token

    return Remedy(
        f"set the pad token to {token!r}", "safe", ("tokenizer",), apply, detail={"pad_token": token}
    )
