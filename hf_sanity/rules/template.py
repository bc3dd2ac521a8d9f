"""Template parity: what the model is trained on must be what it is served with."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from hf_sanity.catalog import define
from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.measure import frameworks
from hf_sanity.measure.chat_templates import (
    has_generation_markers,
    mask_problems,
    training_twin,
    wrap_assistant_content,
)
from hf_sanity.measure.families import FAMILY_OF
from hf_sanity.measure.markers import Span
from hf_sanity.measure.objective import ANY
from hf_sanity.remedies import Remedy, RemedyDoc, merge_system_turns, set_chat_template

TEMPLATE_MISMATCH = define(
    "template-mismatch",
    severity="error",
    stage="template",
    objectives=ANY,
    symptom="Output has stray template markers; the model answers in the wrong format at inference.",
    detects="Training tokens are compared with what the inference tokenizer's chat template produces for the same "
    "conversation (--inference-tokenizer, on a sample); a `text` or pre-tokenized dataset is checked for another "
    "chat format's markers (`### Response:`, `[INST]`, `<|im_start|>`, ...) than the tokenizer's own template "
    "renders. Plain prose is not a mismatch.",
    fix="Render training data with the same tokenizer and chat template used at inference (save the tokenizer with "
    "the model), or switch the inference tokenizer to the training one.",
)


# A framework renders the rows with a template of its own choosing (the fix names the setting).
FRAMEWORK_TEMPLATE_FIX = {
    "LLaMA-Factory": "Set `template:` in the LLaMA-Factory config to the model's own family (its tokenizer renders "
    "{own}: e.g. `qwen` for ChatML Qwen models), or save the tokenizer with the template you trained on (a server "
    "renders the saved tokenizer's chat template).",
    "Axolotl": "Set `chat_template: tokenizer_default` in the Axolotl config (the tokenizer's own template: {own}), "
    "or save the tokenizer with the template you trained on (a server renders the saved tokenizer's chat template).",
}


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
    framework = frameworks.of_trainer(ctx.trainer).name if ctx.trainer is not None else None
    fix = FRAMEWORK_TEMPLATE_FIX.get(framework)
    yield TEMPLATE_MISMATCH.finding(
        f"{n} of {len(families)} examples carry {family} chat markers, but the tokenizer's template renders "
        f"{', '.join(sorted(ctx.own_families))}",
        evidence={"foreign_formats": foreign, "template_formats": sorted(ctx.own_families), "rows": rows},
        example=ctx.view(rows[0]),
        rows=foreign_rows if ctx.fmt == "text" else None,  # tokens data is judged on a sample only
        fix=fix.format(own=", ".join(sorted(ctx.own_families))) if fix else None,
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
    remedy=RemedyDoc(
        "safe or unsafe",
        "Sets `add_bos_token=False` on the tokenizer when its text rows already start with the BOS their chat "
        "template emits: safe when every row does (no row loses its only BOS), unsafe otherwise; in "
        "pre-tokenized rows, drops the repeated BOS (unsafe: dataset.jsonl).",
    ),
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
        remedy=_double_bos_remedy(ctx, doubled),
    )


def _double_bos_remedy(ctx, doubled) -> Remedy | None:
    """Text the tokenizer prefixes with a BOS it already starts with: the tokenizer stops adding one. Rows
    that arrive tokenized: the repeated BOS goes."""
    if not ctx.rows_are_dataset:
        return None
    tok = ctx.tokenizer
    if ctx.source_format == "tokens":
        indices = [int(i) for i in np.flatnonzero(doubled)]

        def strip(repair) -> None:
            for i in indices:
                row = without_repeated_bos(repair.rows()[i], tok.bos_token_id)
                if row is not None:
                    repair.replace(i, row, DOUBLE_BOS.slug)

        return Remedy(
            f"drop the repeated BOS from the {len(indices)} pre-tokenized rows that start with it twice",
            "unsafe",
            ("dataset",),
            strip,
            detail={"rows_edited": len(indices)},
        )
    if ctx.fmt not in ("text", "prompt-completion"):
        return None
    emitted = bool(tok.bos_token) and ctx.markers.probe_render.startswith(tok.bos_token)
    every_row = int(doubled.sum()) == int(ctx.valid.sum())

    def no_bos(repair) -> None:
        repair.tokenizer.add_bos_token = False

    return Remedy(
        "set add_bos_token=False: the rows already start with BOS"
        + (" (the chat template emits it)" if emitted else "")
        + ("" if every_row else f"; the {int(ctx.valid.sum() - doubled.sum())} other rows lose their BOS"),
        "safe" if emitted and every_row else "unsafe",
        ("tokenizer",),
        no_bos,
        detail={"add_bos_token": False},
    )


def without_repeated_bos(row: dict, bos: int) -> dict | None:
    """A pre-tokenized row with one BOS where it starts with several (after left padding); its labels and
    attention mask kept aligned. None when it has no repeated BOS."""
    ids = list(row["input_ids"])
    mask = row.get("attention_mask")
    start = next((k for k, m in enumerate(mask) if int(m)), len(ids)) if mask is not None else 0
    end = start
    while end < len(ids) and ids[end] == bos:
        end += 1
    if end - start < 2:
        return None
    repeated = range(start + 1, end)
    out = dict(row)
    for key in ("input_ids", "labels", "attention_mask"):
        values = row.get(key)
        if isinstance(values, list) and len(values) == len(ids):
            out[key] = [v for k, v in enumerate(values) if k not in repeated]
    return out


STOP_TOKEN_MISMATCH = define(
    "stop-token-mismatch",
    severity="error",
    stage="template",
    objectives=ANY,
    symptom="Model never stops at inference although training taught it to end its turns: generation runs past "
    "the answer into a new turn (the early Llama-3 endless-generation bug).",
    detects="The token that closes an assistant turn in the training renders (derived from the chat template, as "
    "token ids: a special end of turn that decoding strips counts as a plain one) is not among the ids that stop "
    "generation: `generation_config.eos_token_id` (from the model, or its folder's generation_config.json), what "
    "`model.generate` stops on; the tokenizer's EOS is not one unless the config names it (a Llama-3 tokenizer "
    "whose EOS is `<|eot_id|>` with a config naming `<|end_of_text|>` only never stops). Not judged when no "
    "generation config is known. `outputs` runs the same check on the generation config it generates with, and "
    "counts the generations that ended on the end-of-turn token (served, they would not have stopped). With an RL "
    "trainer (GRPO, RLOO): the ids its rollouts stop on (the `eos_token_id` of the generation config it passes "
    "`generate`: TRL's `eos_token_ids`, the model's generation config's EOS and the tokenizer's).",
    fix="Add the end-of-turn token to `generation_config.eos_token_id` (and save it with the model), or serve with "
    "`eos_token_id=[...]` including it.",
    remedy=RemedyDoc("safe", "Adds the end-of-turn id to `eos_token_id` in generation_config.json."),
)


@STOP_TOKEN_MISMATCH.check(applies=lambda ctx: ctx.markers.has_template and bool(ctx.markers.end_of_turn))
def check_stop_token(ctx):
    stops = ctx.generation_stop_ids
    if stops is None:
        return
    tok = ctx.tokenizer
    closing = ctx.markers.end_of_turn[-1]
    if closing in stops:
        return
    names = dict(zip(sorted(stops), tok.convert_ids_to_tokens(sorted(stops))))
    rollouts = type(ctx.trainer).__name__ if ctx.objective.kind == "rl" and ctx.trainer is not None else None
    turn_end = tok.decode(list(ctx.markers.end_of_turn))
    finding = _stop_token_mismatch(turn_end, closing, stops, names, rollouts=rollouts)
    if rollouts is None:  # an RL trainer's rollouts stop on its own arguments, not on a generation config
        finding.remedy = _add_stop_id(turn_end, closing, tok.eos_token_id)
    yield finding


def _add_stop_id(turn_end: str, closing: int, eos: int | None) -> Remedy:
    """The end-of-turn id appended to the generation config's eos_token_id (its EOS kept, or the tokenizer's
    where it names none): generation that stopped before still stops."""

    def apply(repair) -> None:
        config = repair.generation_config
        ids = config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        ids = ids or ([eos] if eos is not None else [])
        config.eos_token_id = ids if closing in ids else [*ids, closing]

    return Remedy(
        f"add {turn_end!r} (id {closing}) to generation_config.eos_token_id",
        "safe",
        ("generation-config",),
        apply,
        detail={"eos_token_id_added": closing},
    )


@STOP_TOKEN_MISMATCH.detector(
    "outputs", applies=lambda gens: gens.served_stop_ids is not None and bool(gens.end_of_turn_ids)
)
def outputs_stop_token(gens):
    """The same check on the generation config `outputs` ran with, with what the model did there: each
    generation that ended on the end-of-turn token would run on when served."""
    closing = gens.end_of_turn_ids[-1]
    stops = gens.served_stop_ids
    if closing in stops:
        return
    from hf_sanity.outputview import side_by_side

    ended = [s for s in gens.samples if s.stopped and s.ids[-1] == closing]
    finding = _stop_token_mismatch(
        gens.end_of_turn,
        closing,
        stops,
        {i: gens.token_names.get(i, str(i)) for i in stops},
        ended=(len(ended), len(gens.samples)),
    )
    if ended:
        finding.example = side_by_side(gens, "ends on a token the served config does not stop on", ended)
    yield finding


def _stop_token_mismatch(
    turn_end: str, closing: int, stops, names: dict, ended=None, rollouts: str | None = None
):
    """The finding: ``turn_end`` (id ``closing``) closes the trained turns but is not among ``stops``;
    ``ended``: (generations that ended on it, generations) where the model was run; ``rollouts``: the RL trainer
    whose generation stops on ``stops``."""
    stop_names = [names[i] for i in sorted(stops)]
    stopping = (
        f"only on {', '.join(map(repr, stop_names))}" if stop_names else "on no token (no eos_token_id)"
    )
    message = (
        f"assistant turns end with {turn_end!r} in training, but generation stops {stopping} "
        "(the generation config's eos_token_id, what generate stops on): the model will write its end of turn and "
        "go on"
        if rollouts is None
        else f"the chat template ends a turn with {turn_end!r}, but {rollouts} stops its completions {stopping} "
        "(the eos_token_id it generates with: the generation config's EOS and the tokenizer's): each completion "
        "runs past its end of turn to max_completion_length and is scored as truncated"
    )
    evidence = {
        "end_of_turn": turn_end,
        "end_of_turn_id": closing,
        "stop_ids": sorted(stops),
        "stop_tokens": stop_names,
    }
    if ended is not None:
        message += (
            f" ({ended[0]} of {ended[1]} generations here ended on {turn_end!r}: served, they would not stop)"
        )
        evidence.update(ended_on_end_of_turn=ended[0], generations=ended[1])
    return STOP_TOKEN_MISMATCH.finding(
        message,
        evidence=evidence,
        fix=f"Add {turn_end!r} (id {closing}) to `model.generation_config.eos_token_id` and save it with the model "
        f"(e.g. `eos_token_id=[{', '.join(str(i) for i in sorted(set(stops) | {closing}))}]`), or pass it to "
        "generate().",
    )


MARKERS_NOT_ATOMIC = define(
    "markers-not-atomic",
    severity="error",
    stage="template",
    objectives=ANY,
    symptom="Output has stray template markers or never stops: the template's turn markers are not tokens of this "
    "tokenizer, so the model learns them as several plain tokens (a ChatML template on a Llama-3 tokenizer).",
    detects="Each special-looking turn marker the chat template renders (`<|im_start|>`, `<start_of_turn>`, "
    "`<｜User｜>`, ...) must be one token of the tokenizer, when the tokenizer's own family speaks in such tokens "
    "(it has special tokens of that form). A family trained on plain-text markers (TinyLlama's Zephyr "
    "`<|user|>`) is left alone.",
    fix="Use the chat template that belongs to this tokenizer, or add the markers as special tokens "
    "(`tokenizer.add_special_tokens({'additional_special_tokens': [...]})`, then `model.resize_token_embeddings` "
    "and train the new rows).",
)

_SPECIAL_LOOKING = re.compile(r"<[|｜][^\s<>]{1,40}?[|｜]>|<(?:start|end)_of_turn>")


@MARKERS_NOT_ATOMIC.check(applies=lambda ctx: ctx.markers.has_template)
def check_markers_atomic(ctx):
    tok = ctx.tokenizer
    added = {str(t) for t in (getattr(tok, "added_tokens_decoder", {}) or {}).values()}
    if not any(_SPECIAL_LOOKING.fullmatch(t) for t in added):
        return  # this family writes its turn markers as plain text: several tokens is how it was trained
    rendered = ctx.markers.probe_render
    pieces = {}
    for marker in sorted(set(_SPECIAL_LOOKING.findall(rendered))):
        ids = tok(marker, add_special_tokens=False)["input_ids"]
        if len(ids) > 1:
            pieces[marker] = tok.convert_ids_to_tokens(ids)
    if not pieces:
        return
    marker, split = next(iter(pieces.items()))
    yield MARKERS_NOT_ATOMIC.finding(
        f"{len(pieces)} turn markers of the chat template are not tokens of this tokenizer: {marker!r} becomes "
        f"{len(split)} pieces {split}",
        evidence={"markers": {k: v for k, v in pieces.items()}, "tokenizer": type(tok).__name__},
    )


TEMPLATE_DROPS_CONTENT = define(
    "template-drops-content",
    severity="error",
    stage="template",
    symptom="The model never learns part of what the data teaches (its reasoning, its tool calls): the chat "
    "template deletes it while rendering, silently.",
    detects="Each message's content (and each tool call's function name) is looked for in the rendered "
    "conversation, line by line with whitespace stripped: what is not there was dropped by the template "
    "(DeepSeek-R1's template keeps only what follows `</think>`; templates without tool support drop the "
    "calls). An error when trained (assistant) content is dropped, a warning for the rest; when only system "
    "messages are gone, the cause is `system-role-dropped` (a template without a system role).",
    fix="Render with a template that keeps the content: TRL's training variant of the template "
    "(trl/chat_templates/*_training.jinja) or a format that carries it explicitly (e.g. the reasoning in the "
    "answer text, tools in a template that supports them).",
    remedy=RemedyDoc(
        "unsafe",
        "Sets the chat template to TRL's training twin of this template when it renders every affected row "
        "whole (the reasoning kept); when only system prompts are dropped, merges them into the first user turn "
        "(dataset.jsonl).",
    ),
)

SYSTEM_DROPPED_FIX = (
    "This chat template has no system role and drops the system turn silently: the model never sees the "
    "system prompt in training (nor at inference with this template). Merge the system prompt into the first "
    "user turn (`[{'role': 'user', 'content': system + '\\n\\n' + first_user}, ...]`), or train and serve with a "
    "chat template that has a system role."
)


@TEMPLATE_DROPS_CONTENT.check(applies=lambda ctx: ctx.fmt in ("messages", "prompt-completion"))
def check_template_drops_content(ctx):
    trained, other = ctx.col("n_dropped_supervised"), ctx.col("n_dropped_other")
    bad = ctx.valid & ((trained > 0) | (other > 0))
    if not bad.any():
        return
    rows = ctx.first(bad)
    chars = int(ctx.col("n_supervised_chars")[ctx.valid].sum())
    lost = int(trained[ctx.valid].sum())
    share = lost / max(chars, 1)
    n = int(ctx.valid.sum())
    in_trained = bool((ctx.valid & (trained > 0)).any())
    example = ctx.values("dropped_text")[rows[0]]
    other_lost = int(other[ctx.valid].sum())
    # Only system prompts are gone: the template has no system role.
    system = not in_trained and int(ctx.col("n_dropped_system")[ctx.valid].sum()) == other_lost
    if system:
        what = f"the chat template drops the system turn of {int(bad.sum())} of {n} examples"
    else:
        what = f"the chat template drops content from {int(bad.sum())} of {n} examples" + (
            f": {share:.0%} of the trained characters ({lost:,} of {chars:,})"
            if in_trained
            else " (prompt side)"
        )
    yield TEMPLATE_DROPS_CONTENT.finding(
        what + f"; e.g. {example[:80]!r} is not in the rendered text",
        evidence={
            "rows": rows,
            "examples": int(bad.sum()),
            "trained_chars_dropped": lost,
            "trained_chars": chars,
            "fraction": share,
            "other_chars_dropped": other_lost,
            "first_dropped": example,
            **({"cause": "system-role-dropped"} if system else {}),
        },
        example=ctx.view(rows[0]),
        severity="error" if in_trained else "warning",
        fix=SYSTEM_DROPPED_FIX if system else None,
        remedy=(
            merge_system_turns(
                np.flatnonzero(bad),
                TEMPLATE_DROPS_CONTENT.slug,
                ctx.source_format,
                "whose system turn the template drops",
            )
            if system
            else _keeping_twin(ctx, np.flatnonzero(bad))
        )
        if ctx.rows_are_dataset
        else None,
    )


def _conversations(ctx, indices=None):
    """(row, messages, index of the first trained message, template kwargs) of the valid rows (or
    ``indices``), read as TRL renders them."""
    from hf_sanity.measure.encode import template_kwargs
    from hf_sanity.measure.formats import conversation_of

    layout = ctx.encoder.layout
    wanted = [int(i) for i in (np.flatnonzero(ctx.valid) if indices is None else indices)]
    for i, row in zip(wanted, ctx.dataset.select(wanted)):
        row = layout.to_trl(row)
        messages = conversation_of(row) if isinstance(row, dict) else None
        if not messages:
            continue
        kwargs = template_kwargs(row)
        first = len(row["prompt"]) if isinstance(row.get("prompt"), list) else 0
        yield i, messages, first, kwargs if isinstance(kwargs, dict) else {}


def _keeping_twin(ctx, bad) -> Remedy | None:
    """TRL's training twin of the template, when it renders every affected row without dropping what the data
    trains on (DeepSeek-R1's twin keeps the reasoning); the text changes, so unsafe."""
    from hf_sanity.measure.encode import dropped_content

    tok = ctx.tokenizer
    twin = training_twin(tok.chat_template)
    if twin is None:
        return None
    name, template = twin
    checked = 0
    for _, messages, first, kwargs in _conversations(ctx, bad):
        full = tok.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs)
        if dropped_content(messages, first, full)["n_dropped_supervised"]:
            return None
        checked += 1
    return set_chat_template(
        template, f"TRL's training twin {name}", differs=checked, rows=checked,
        why=f"the {checked} rows it dropped content from render whole",
    )  # fmt: skip


GENERATION_MARKERS_MISSING = define(
    "generation-markers-missing",
    severity="error",
    stage="template",
    symptom="Assistant-only loss trains on nothing (or on the wrong tokens), or TRL refuses the template: "
    "`return_assistant_tokens_mask` marks what the chat template puts between `{% generation %}` markers, and "
    "this template has none around the answers.",
    detects='With assistant-only loss asked (`--loss-on assistant`, `loss_on="assistant"`: TRL\'s '
    "`assistant_only_loss=True`), the chat template must mark the answers with `{% generation %}`...`{% "
    "endgeneration %}`: without markers the mask is empty (cause `no-markers`); with them, on a sample, the "
    "mask must cover each answer and its end-of-turn token and nothing of the prompt (cause "
    "`markers-misplaced`). An error where the trainer's config asks for it (`assistant_only_loss=True`); a "
    "warning where only `--loss-on assistant` says the assistant turns train, since Axolotl and LLaMA-Factory "
    "mask them by their own template strategies and need no markers.",
    fix="Train with a template that marks the answers: TRL's training twin of this template "
    "(trl/chat_templates/*_training.jinja; SFTTrainer swaps it in for the templates it knows and raises for the "
    "others), or this template with each answer and its end-of-turn token wrapped in `{% generation %}`...`{% "
    "endgeneration %}`.",
    remedy=RemedyDoc(
        "safe or unsafe",
        "Sets the chat template to TRL's training twin of this template when it is one of TRL's originals, "
        "character for character, else to this template with the expression that prints a message's content "
        "wrapped in `{% generation %}` for assistant messages; every row is rendered with both templates: safe "
        "when the text is identical, unsafe when it differs (a twin that keeps reasoning the original drops), "
        "no remedy when the new mask would not cover the answers.",
    ),
)
MASK_SAMPLE = 32  # conversations whose assistant mask is compared with the located answers


@GENERATION_MARKERS_MISSING.check(
    applies=lambda ctx: (
        ctx.options.loss_on == "assistant" and ctx.fmt == "messages" and ctx.markers.has_template
    )
)
def check_generation_markers(ctx):
    template = ctx.tokenizer.chat_template
    n = int(ctx.valid.sum())
    # Only TRL's assistant_only_loss reads the markers: a flag alone may describe an Axolotl or LLaMA-Factory run,
    # whose own template strategies mask the turns without them.
    by_trainer = ctx.loss_mask.source == "trainer"
    severity = None if by_trainer else "warning"
    whose = (
        ""
        if by_trainer
        else " if TRL's assistant_only_loss=True masks the turns (Axolotl and LLaMA-Factory need no markers)"
    )
    if not has_generation_markers(template):
        yield GENERATION_MARKERS_MISSING.finding(
            f"assistant-only loss is asked but the chat template has no {{% generation %}} markers: the "
            f"assistant mask of all {n} conversations is empty{whose}",
            evidence={"cause": "no-markers", "conversations": n, "asked_by": ctx.loss_mask.source},
            severity=severity,
            remedy=_marked_template(ctx) if ctx.rows_are_dataset else None,
        )
        return
    missed, extra, rows = _mask_against_spans(ctx, ctx.tokenizer, ctx.sample_indices[:MASK_SAMPLE])
    if rows:
        yield GENERATION_MARKERS_MISSING.finding(
            f"the {{% generation %}} markers of the chat template leave {missed} answer tokens out of the "
            f"assistant mask and take {extra} other tokens in, in {len(rows)} of "
            f"{min(len(ctx.sample_indices), MASK_SAMPLE)} sampled conversations",
            evidence={
                "cause": "markers-misplaced",
                "answer_tokens_left_out": missed,
                "other_tokens_in": extra,
                "rows": rows[:10],
            },
            example=ctx.view(rows[0]),
            severity=severity,
            fix="Move the markers so that each answer and its end-of-turn token, and nothing of the prompt, lie "
            "between `{% generation %}` and `{% endgeneration %}`.",
        )


def _mask_against_spans(ctx, tok, indices, template=None) -> tuple[int, int, list[int]]:
    """(answer tokens left out, other tokens taken in, rows with either) of the assistant mask ``template``
    (default: the tokenizer's) gives ``indices``, against the answers located from that template."""
    from hf_sanity.measure.encode import Encoder

    encoder = ctx.encoder
    if template is not None:
        import copy

        tok = copy.copy(tok)
        tok.chat_template = template
        encoder = Encoder(tok, ctx.options)
    missed = extra = 0
    rows = []
    for i, messages, _, kwargs in _conversations(ctx, indices):
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True, **kwargs)  # fmt: skip
        row = encoder.encode(ctx.dataset[i]) if template is not None else ctx.row(i)
        if list(out["input_ids"]) != list(row["input_ids"]):
            continue  # tokenized otherwise (a BOS added): positions do not compare
        flat = row["spans"]
        spans = [Span(*flat[k : k + 4]) for k in range(0, len(flat), 4)]
        left_out, taken_in = mask_problems(list(out["assistant_masks"]), spans, row["labels"], IGNORE_INDEX)
        missed, extra = missed + left_out, extra + taken_in
        if left_out or taken_in:
            rows.append(i)
    return missed, extra, rows


def _marked_template(ctx) -> Remedy | None:
    """A template with markers: TRL's twin of this one, else this one with its content expressions wrapped;
    every row rendered with both (safe only if the text is identical), the new mask checked on a sample."""
    tok = ctx.tokenizer
    twin = training_twin(tok.chat_template)
    candidates = [(f"TRL's training twin {twin[0]}", twin[1])] if twin else []
    wrapped = wrap_assistant_content(tok.chat_template)
    if wrapped:
        candidates.append(("this template with each answer wrapped in {% generation %}", wrapped))
    for name, template in candidates:
        _, _, broken = _mask_against_spans(ctx, tok, ctx.sample_indices[:MASK_SAMPLE], template)
        if broken:
            continue
        differs = rendered = 0
        for _, messages, _, kwargs in _conversations(ctx):
            before = tok.apply_chat_template(messages, tokenize=False, **kwargs)
            after = tok.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs)
            differs, rendered = differs + (before != after), rendered + 1
        return set_chat_template(template, name, differs=differs, rows=rendered)
    return None
