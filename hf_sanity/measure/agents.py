"""Measurements for agent and reasoning data (the rules: `hf_sanity.rules.agents`): tool calls rendered as
serving engines render them, tool schemas the template would show, think blocks that truncation leaves open,
reasoning fields the template ignores, and templates that re-render earlier turns differently.

Each reads the conversations as TRL renders them: the rows of a preflight on a dataset, or the columns a TRL
trainer keeps beside its tokens (`SFTTrainer` keeps ``messages`` and ``tools``).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
RENDERED_SAMPLE = 16  # rows rendered twice (each way) by the render comparisons
PREFIX_SAMPLE = 32  # multi-turn rows whose turns are rendered one prefix at a time


@dataclass
class Conversation:
    index: int  # the row of the dataset as given (a trainer's: of its train_dataset)
    messages: list[dict[str, Any]]
    first: int  # the first trained message (prompt-completion rows: the completion's)
    kwargs: dict[str, Any]  # what TRL passes the template besides the messages (tools, chat_template_kwargs)


def conversations(ctx, indices=None) -> Iterator[Conversation]:
    """The conversations of ``ctx`` as TRL renders them (every row, or ``indices``); nothing for plain-text
    or token rows, or a trainer that kept no conversation column."""
    from hf_sanity.measure.encode import template_kwargs
    from hf_sanity.measure.vision import without_pictures

    source = _source(ctx)
    if source is None:
        return
    data, to_trl = source
    data = without_pictures(data)
    # Iterating a dataset reads it in batches; indexing it row by row costs a table lookup per row.
    wanted = range(len(data)) if indices is None else [int(i) for i in indices]
    rows = data if indices is None else data.select(wanted)
    for i, row in zip(wanted, rows):
        row = to_trl(row)
        if not isinstance(row, dict):
            continue
        first = 0
        if isinstance(row.get("messages"), list):
            messages = row["messages"]
        elif isinstance(row.get("prompt"), list) and isinstance(row.get("completion"), list):
            messages, first = row["prompt"] + row["completion"], len(row["prompt"])
        else:
            continue
        if not all(isinstance(m, dict) for m in messages):
            continue
        kwargs = template_kwargs(row)
        yield Conversation(i, list(messages), first, kwargs if isinstance(kwargs, dict) else {})


def _source(ctx):
    """(rows, their conversion to TRL's format) of the context, or None."""
    if ctx.dataset is not None and ctx.fmt in ("messages", "prompt-completion"):
        return ctx.dataset, ctx.encoder.layout.to_trl
    data = getattr(ctx.trainer, "train_dataset", None)
    columns = set(getattr(data, "column_names", None) or ())
    if data is None or not ("messages" in columns or {"prompt", "completion"} <= columns):
        return None
    return data, lambda row: row


@dataclass
class Scan:
    """What one pass over the conversations finds, shared by the rules of this module (rows by index)."""

    with_calls: list[int]
    string_arguments: list[int]  # tool calls with string arguments that hold a JSON object
    without_schema: list[int]  # tool calls and no `tools`
    functions_without_schema: set[str]
    reasoning_field: list[int]  # the last answer carries a non-empty reasoning_content
    multi_turn: list[int]  # two assistant turns or more


_SCANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def scan(ctx) -> Scan:
    """The pass over every conversation of ``ctx`` (once per context: the context is read-only, so the result
    is kept beside it, not on it)."""
    if ctx in _SCANS:
        return _SCANS[ctx]
    out = Scan([], [], [], set(), [], [])
    for conv in conversations(ctx):
        calls = [c for m in conv.messages for c in _calls(m)]
        if calls:
            out.with_calls.append(conv.index)
            if any(_parsed(_function(c).get("arguments")) is not None for c in calls):
                out.string_arguments.append(conv.index)
            if not conv.kwargs.get("tools"):
                out.without_schema.append(conv.index)
                out.functions_without_schema |= {
                    str(_function(c)["name"]) for c in calls if _function(c).get("name")
                }
        answers = [m for m in conv.messages if m.get("role") == "assistant"]
        reasoning = answers[-1].get("reasoning_content") if answers else None
        if isinstance(reasoning, str) and reasoning.strip():
            out.reasoning_field.append(conv.index)
        if len(answers) >= 2:
            out.multi_turn.append(conv.index)
    _SCANS[ctx] = out
    return out


def has_conversations(ctx) -> bool:
    return bool(getattr(ctx.tokenizer, "chat_template", None)) and _source(ctx) is not None


def render(tok, messages, kwargs, **extra) -> str | None:
    """The template's text for ``messages``; None when the template rejects them."""
    try:
        return tok.apply_chat_template(messages, tokenize=False, **{**kwargs, **extra})
    except (
        Exception
    ):  # a template that rejects one form (a dict concatenated to a string) has no opinion on it
        return None


def text_diff(tok, left: str, right: str, context: int = 40) -> dict[str, Any]:
    """Where two renders part, in characters and in tokens, with the text of each around it."""
    at = next((k for k, (a, b) in enumerate(zip(left, right)) if a != b), min(len(left), len(right)))
    left_ids = tok(left, add_special_tokens=False)["input_ids"]
    right_ids = tok(right, add_special_tokens=False)["input_ids"]
    token = next(
        (k for k, (a, b) in enumerate(zip(left_ids, right_ids)) if a != b), min(len(left_ids), len(right_ids))
    )
    line = left.rfind("\n", 0, at) + 1  # from the start of the line they part on, when it is near
    start = line if at - line <= 60 else at - 20
    return {
        "char": at,
        "token": token,
        "tokens": [len(left_ids), len(right_ids)],
        "texts": [left[start : at + context], right[start : at + context]],
    }


# -- tool calls -----------------------------------------------------------------------------------------------
def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]


def _function(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function", call)
    return function if isinstance(function, dict) else {}


def _parsed(arguments) -> dict | None:
    """The object a string of arguments holds (None: not a string, or not a JSON object)."""
    if not isinstance(arguments, str):
        return None
    try:
        value = json.loads(arguments)
    except (json.JSONDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def with_parsed_arguments(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The messages with every tool call's string arguments that hold a JSON object parsed into it, as serving
    engines parse them before rendering; and how many calls changed."""
    out, changed = [], 0
    for message in messages:
        calls = _calls(message)
        if not calls or not isinstance(message, dict):
            out.append(message)
            continue
        new_calls = []
        for call in calls:
            function = _function(call)
            value = _parsed(function.get("arguments"))
            if value is None:
                new_calls.append(call)
                continue
            changed += 1
            if "function" in call:
                new_calls.append({**call, "function": {**function, "arguments": value}})
            else:
                new_calls.append({**call, "arguments": value})
        out.append({**message, "tool_calls": new_calls})
    return out, changed


def tool_args_serialization(ctx) -> dict[str, Any] | None:
    """Rows whose tool calls carry their arguments as JSON strings, and how the template renders a sample of
    them against the object form (None when no row has string arguments that hold an object)."""
    tok = ctx.tokenizer
    found = scan(ctx)
    rows, with_calls = found.string_arguments, len(found.with_calls)
    if not rows:
        return None
    differ, rendered, example = [], 0, None
    for conv in conversations(ctx, rows[:RENDERED_SAMPLE]):
        as_objects, _ = with_parsed_arguments(conv.messages)
        as_strings = render(tok, conv.messages, conv.kwargs)
        served = render(tok, as_objects, conv.kwargs)
        if as_strings is None or served is None:
            continue
        rendered += 1
        if as_strings != served:
            differ.append(conv.index)
            if example is None:
                diff = text_diff(tok, as_strings, served)
                call = next(
                    c for m in conv.messages for c in _calls(m) if _parsed(_function(c).get("arguments"))
                )
                example = {
                    "row": conv.index,
                    "arguments": _function(call).get("arguments"),
                    "trained": diff["texts"][0],
                    "served": diff["texts"][1],
                    "first_token_differing": diff["token"],
                    "tokens": {"trained": diff["tokens"][0], "served": diff["tokens"][1]},
                    "double_encoded": '\\"' in diff["texts"][0] and '\\"' not in diff["texts"][1],
                }
    return {
        "rows": rows,
        "rows_with_calls": with_calls,
        "rendered": rendered,
        "rendered_differently": differ,
        "example": example,
    }


def tools_schema_missing(ctx) -> dict[str, Any] | None:
    """Rows with tool calls and no ``tools`` schema, and whether the template renders a tools block when it
    gets one (the row rendered with a schema of the functions it calls, and without)."""
    tok = ctx.tokenizer
    found = scan(ctx)
    rows, names, with_calls = found.without_schema, found.functions_without_schema, len(found.with_calls)
    if not rows:
        return None
    block = None
    for conv in conversations(ctx, rows[:RENDERED_SAMPLE]):
        called = sorted({str(_function(c).get("name")) for m in conv.messages for c in _calls(m)})
        schema = [
            {"type": "function", "function": {"name": name, "description": f"{name}.",
             "parameters": {"type": "object", "properties": {}}}}
            for name in called
        ]  # fmt: skip
        bare = render(tok, conv.messages, conv.kwargs)
        shown = render(tok, conv.messages, {**conv.kwargs, "tools": schema})
        if bare is None or shown is None:
            continue
        if bare != shown:
            diff = text_diff(tok, bare, shown, context=120)
            block = {"row": conv.index, "tokens_without": diff["tokens"][0], "tokens_with": diff["tokens"][1],
                     "schema_block": diff["texts"][1]}  # fmt: skip
            break
    return {"rows": rows, "rows_with_calls": with_calls, "functions": sorted(names), "template_block": block}


# -- reasoning --------------------------------------------------------------------------------------------------
def think_unclosed(ctx) -> dict[str, Any] | None:
    """Rows whose supervised span opens a think block before max_len and closes it after: truncation keeps
    the thinking and cuts its close. For each, the length that keeps the close (None without max_len, or on a
    trainer's rows, which arrive cut: there the rows as long as max_length with an open think block)."""
    import numpy as np

    max_len = ctx.options.max_len or ctx.options.arrived_cut_at
    if not max_len or ctx.options.packed_cut_at:
        return None
    tok = ctx.tokenizer
    arrived = bool(ctx.options.arrived_cut_at)
    long = np.flatnonzero(
        ctx.valid & (ctx.col("n_tokens") >= max_len if arrived else ctx.col("n_tokens") > max_len)
    )
    unclosed: dict[int, int | None] = {}  # row -> the length that keeps its close (None: unknown)
    never_closed = 0
    for i in long:
        row = ctx.row(int(i))
        ids = row["input_ids"]
        for span in ctx.spans(int(i)):
            if not span.start < max_len < span.stop + (1 if arrived else 0):
                continue
            kept = tok.decode(ids[span.lead : max_len])
            opened = kept.rfind(THINK_OPEN)
            if opened < 0 or THINK_CLOSE in kept[opened:]:
                continue
            if arrived:
                unclosed[int(i)] = None
                continue
            whole = tok.decode(ids[span.lead : span.stop])
            if THINK_CLOSE not in whole[whole.rfind(THINK_OPEN) :]:
                never_closed += 1  # the data never closes it: not truncation's doing
                continue
            low, high = max_len, span.stop  # the shortest prefix whose text holds the close
            while low < high:
                mid = (low + high) // 2
                text = tok.decode(ids[span.lead : mid])
                if THINK_CLOSE in text[opened:]:
                    high = mid
                else:
                    low = mid + 1
            unclosed[int(i)] = low
    if not unclosed:
        return None
    n = int(ctx.valid.sum())
    needed = sorted(v for v in unclosed.values() if v is not None)
    allowed = int(0.01 * n)  # rows that may stay unclosed at the 99% length
    for_99 = needed[len(needed) - allowed - 1] if needed and len(needed) > allowed else None
    if (
        arrived
    ):  # the rows came cut: the lengths that keep the closes, from the conversations the trainer kept
        closes = sorted(_close_lengths(ctx))
        if closes and closes[-1] > max_len:
            for_99 = closes[int(np.ceil(0.99 * len(closes))) - 1]
            for_99 = for_99 if for_99 > max_len else None
            needed = [closes[-1]]
    return {
        "rows": sorted(unclosed),
        "examples": n,
        "fraction": len(unclosed) / max(n, 1),
        "max_len": max_len,
        "max_len_for_99pct_closed": for_99,
        "max_len_for_all_closed": needed[-1] if needed else None,
        "never_closed": never_closed,
    }


def _close_lengths(ctx) -> list[int]:
    """For a sample of the conversations (a trainer's, whose token rows arrive cut): the tokens up to the end
    of each one's last `</think>` as rendered (0 without one)."""
    tok = ctx.tokenizer
    source = _source(ctx)
    if source is None:
        return []
    out = []
    for conv in conversations(ctx, range(min(len(source[0]), ctx.sample))):
        text = render(tok, conv.messages, conv.kwargs)
        if text is None:
            continue
        end = text.rfind(THINK_CLOSE)
        if end < 0:
            out.append(0)
            continue
        end += len(THINK_CLOSE)
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        out.append(sum(1 for start, _ in offsets if start < end))
    return out


def reasoning_field_dropped(ctx) -> dict[str, Any] | None:
    """Rows whose last assistant message carries a ``reasoning_content`` the template does not render (the
    answer trained without its reasoning)."""
    tok = ctx.tokenizer
    rows, dropped, example = scan(ctx).reasoning_field, [], None
    if not rows:
        return None
    checked = 0
    for conv in conversations(ctx, rows[:RENDERED_SAMPLE]):
        text = render(tok, conv.messages, conv.kwargs)
        if text is None:
            continue
        checked += 1
        last = next(m for m in reversed(conv.messages) if m.get("role") == "assistant")
        lines = [line.strip() for line in last["reasoning_content"].splitlines() if line.strip()]
        if not any(line in text for line in lines):
            dropped.append(conv.index)
            example = example or {"row": conv.index, "reasoning_content": last["reasoning_content"][:200]}
    return {"rows": rows, "rendered": checked, "dropped": dropped, "example": example}


# -- multi-turn -------------------------------------------------------------------------------------------------
def prefix_break(tok, messages, kwargs) -> dict[str, Any] | None:
    """The first assistant turn whose conversation, rendered up to it, is not how the longer conversation
    (up to the next assistant turn) renders its start: the template re-renders earlier turns (Qwen3 strips
    their thinking)."""
    ends = [j + 1 for j, m in enumerate(messages) if m.get("role") == "assistant"]
    previous, previous_end = None, None
    for end in ends:
        text = render(tok, messages[:end], kwargs)
        if text is None:
            return None
        if previous is not None and not text.startswith(previous) and not _closes_both(tok, previous, text):
            diff = text_diff(tok, previous, text)
            turn = sum(1 for m in messages[:previous_end] if m.get("role") == "assistant")
            return {"turn": turn, "message": previous_end - 1, "diff": diff}
        previous, previous_end = text, end
    return None


def _closes_both(tok, shorter: str, longer: str) -> bool:
    """The shorter render parts from the longer only by special tokens that close the longer one too: a suffix
    the template puts after the whole conversation (Phi-3's `<|endoftext|>`), not an earlier turn re-rendered."""
    at = next((k for k, (a, b) in enumerate(zip(shorter, longer)) if a != b), len(shorter))
    specials = sorted(
        {str(t) for t in tok.all_special_tokens}
        | {str(t) for t in (getattr(tok, "added_tokens_decoder", {}) or {}).values()},
        key=len,
        reverse=True,
    )
    longest = len(specials[0]) if specials else 0
    # They may part inside a special token's text (`<|endoftext|>` against `<|user|>`): start up to one
    # token's length earlier.
    for start in range(at, max(0, at - longest) - 1, -1):
        suffix = shorter[start:]
        if not suffix or not longer.endswith(suffix):
            continue
        rest = suffix
        for token in specials:
            rest = rest.replace(token, "") if token else rest
        if not rest.strip():
            return True
    return False


def prefix_preserving(ctx) -> dict[str, Any] | None:
    """Multi-turn rows (two assistant turns or more) rendered one turn at a time: those whose earlier render is
    not a prefix of the later one, with the first break (None without multi-turn rows)."""
    tok = ctx.tokenizer
    multi = scan(ctx).multi_turn
    if not multi:
        return None
    broken, first = [], None
    checked = 0
    for conv in conversations(ctx, multi[:PREFIX_SAMPLE]):
        checked += 1
        found = prefix_break(tok, conv.messages, conv.kwargs)
        if found:
            broken.append(conv.index)
            first = first or {"row": conv.index, **found}
    return {"multi_turn_rows": len(multi), "checked": checked, "broken": broken, "first": first}


# -- tool results in the loss ----------------------------------------------------------------------------------
TOOL_ROLES = ("tool", "ipython", "function")  # the roles of a tool's result (formats.ROLES' aliases)
TOOL_SAMPLE = 64  # rows with tool turns measured
TOOL_SCAN = 512  # rows looked at for them


def tool_turns_trained(ctx, indices) -> dict[str, Any] | None:
    """Of the encoded rows ``indices`` (the trainer's, with a trainer: its batches, in the order its loader drew
    them), those that render from a conversation with tool results (the first :data:`TOOL_SAMPLE` of the first
    :data:`TOOL_SCAN` conversations): the tokens of those results and how many of them carry loss. A row is
    matched to its conversation by its ids (the rendered text tokenized, a leading BOS aside), a result located by
    its content in that text and mapped to tokens by the tokenizer's offsets. None when no conversation has a
    tool turn."""
    from hf_sanity.constants import IGNORE_INDEX

    source = _source(ctx)
    if source is None:
        return None
    convs = [
        c
        for c in conversations(ctx, range(min(TOOL_SCAN, len(source[0]))))
        if any(m.get("role") in TOOL_ROLES for m in c.messages)
    ][:TOOL_SAMPLE]
    if not convs:
        return None
    by_ids: dict[tuple[int, ...], int] = {}
    for i in [int(i) for i in list(indices)[:TOOL_SCAN]]:
        ids = tuple(ctx.row(i)["input_ids"])
        by_ids.setdefault(ids, i)
        by_ids.setdefault(ids[1:], i)  # a BOS the encoder put before the template's text
    measured = tokens = supervised = 0
    trained: list[int] = []
    first: tuple[int, int] | None = None
    for conv in convs:
        found = tool_positions(ctx.tokenizer, conv)
        if found is None or tuple(found[0]) not in by_ids:
            continue
        own, positions = found
        index = by_ids[tuple(own)]
        row = ctx.row(index)
        shift = len(row["input_ids"]) - len(own)
        measured += 1
        tokens += len(positions)
        carried = [p + shift for p in positions if row["labels"][p + shift] != IGNORE_INDEX]
        supervised += len(carried)
        if carried:
            trained.append(index)
            first = first or (index, carried[0])
    return {
        "rows_with_tool_turns": len(convs),
        "rows_measured": measured,
        "tool_tokens": tokens,
        "tool_tokens_supervised": supervised,
        "rows_trained": trained[:10],
        "rows_trained_count": len(trained),
        "first": list(first) if first else None,
    }


def tool_positions(tok, conv: Conversation) -> tuple[list[int], list[int]] | None:
    """(the ids of ``conv`` as its template renders it, the positions among them of its tool results' tokens);
    None when the template rejects it or the tokenizer gives no offsets."""
    text = render(tok, conv.messages, conv.kwargs)
    if not text:
        return None
    try:
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError):  # a slow tokenizer has no offsets
        return None
    spans, cursor = [], 0
    for message in conv.messages:
        content = message.get("content")
        if not isinstance(content, str) or not content:
            continue
        at = text.find(content, cursor)
        if at < 0:
            continue
        if message.get("role") in TOOL_ROLES:
            spans.append((at, at + len(content)))
        cursor = at + len(content)
    positions = [
        i
        for i, (start, end) in enumerate(encoded["offset_mapping"])
        if end > start and any(start < stop and end > begin for begin, stop in spans)
    ]
    return list(encoded["input_ids"]), positions


# -- thinking-mode parity ----------------------------------------------------------------------------------------
THINKING_SAMPLE = 64  # conversations whose last answer is rendered
_EMPTY_THINK = None


def _empty_think(text: str) -> bool:
    """``text`` opens with an empty think block (``<think>`` and ``</think>`` with only whitespace between)."""
    import re

    global _EMPTY_THINK
    _EMPTY_THINK = _EMPTY_THINK or re.compile(r"\s*<think>\s*</think>")
    return bool(_EMPTY_THINK.match(text))


def no_think_prefill(tok) -> str | None:
    """What the template's generation prompt adds with ``enable_thinking=False`` beyond the thinking one (Qwen3's
    ``<think>\\n\\n</think>\\n\\n``); None for a template without such a mode or whose addition is not an empty
    think block."""
    template = getattr(tok, "chat_template", None)
    if not isinstance(template, str) or "enable_thinking" not in template:
        return None
    probe = [{"role": "user", "content": "Hi"}]
    off = render(tok, probe, {}, add_generation_prompt=True, enable_thinking=False)
    on = render(tok, probe, {}, add_generation_prompt=True, enable_thinking=True)
    if not off or not on or off == on or not off.startswith(on):
        return None
    block = off[len(on) :]
    return block if _empty_think(block) else None


def thinking_parity(ctx) -> dict[str, Any] | None:
    """The training targets' think blocks against the serving prefill, on the last answer of the first
    :data:`THINKING_SAMPLE` conversations (rendered as training renders them, with the row's kwargs): how many
    start with an empty think block, with a thinking one, with none; the block the no-think prefill adds; the
    mode the rows declare (``enable_thinking`` in their ``chat_template_kwargs``, else None). None when the
    template has no no-think prefill with an empty block."""
    tok = ctx.tokenizer
    block = no_think_prefill(tok)
    if block is None:
        return None
    counts = {"empty": 0, "thinking": 0, "none": 0}
    rows: dict[str, list[int]] = {key: [] for key in counts}
    declared: set[Any] = set()
    for conv in conversations(ctx, range(min(THINKING_SAMPLE, _rows(ctx)))):
        last = max((k for k, m in enumerate(conv.messages) if m.get("role") == "assistant"), default=None)
        if last is None or last < conv.first:
            continue
        if "enable_thinking" in conv.kwargs:
            declared.add(conv.kwargs["enable_thinking"])
        kwargs = conv.kwargs
        whole = render(tok, conv.messages[: last + 1], kwargs)
        head = render(
            tok, conv.messages[:last], {**kwargs, "enable_thinking": True}, add_generation_prompt=True
        )
        if not whole or not head or not whole.startswith(head):
            continue
        turn = whole[len(head) :]
        kind = (
            "empty" if _empty_think(turn) else "thinking" if turn.lstrip().startswith(THINK_OPEN) else "none"
        )
        counts[kind] += 1
        rows[kind].append(conv.index)
    judged = sum(counts.values())
    if not judged:
        return None
    return {
        "no_think_prefill": block,
        "turns": judged,
        "empty_block": counts["empty"],
        "thinking": counts["thinking"],
        "no_block": counts["none"],
        "rows_no_block": rows["none"][:10],
        "rows_empty_block": rows["empty"][:10],
        "declared_enable_thinking": sorted(declared, key=str)[0] if len(declared) == 1 else None,
    }


def _rows(ctx) -> int:
    source = _source(ctx)
    return len(source[0]) if source is not None else 0
