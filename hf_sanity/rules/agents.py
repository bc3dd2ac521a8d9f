"""Agents and reasoners: tool calls trained as servers render them, tool schemas the template shows, think
blocks that close, reasoning fields that are rendered, and templates that keep earlier turns as they were
(the measurements: `hf_sanity.measure.agents`)."""

from __future__ import annotations

from hf_sanity.catalog import define
from hf_sanity.measure.objective import RL, SFT
from hf_sanity.remedies import Remedy, RemedyDoc


def _has_conversations(ctx) -> bool:
    from hf_sanity.measure.agents import has_conversations

    return has_conversations(ctx)


def _share(part: int, whole: int) -> str:
    return f"{part} of {whole} rows ({part / max(whole, 1):.0%})"


TOOL_ARGS_SERIALIZATION = define(
    "tool-args-serialization",
    severity="error",
    stage="template",
    objectives=SFT,
    symptom="The model learns to write tool-call arguments as an escaped JSON string "
    '(`"{\\"city\\": \\"SF\\"}"`) that no server produces: the data stores `function.arguments` as a string '
    "(as OpenAI-format exports do), the chat template applies `tojson` to it, and serving engines parse the "
    "arguments into an object before rendering.",
    detects="Rows whose tool calls carry `arguments` as a string that parses to a JSON object; a sample of them "
    "is rendered as it is and with the arguments parsed (as vLLM and TGI render them): any difference is an "
    "error, with the token where they part; escaped quotes in the training text say `double-encoded`. A "
    "template that prints string arguments as they are (Qwen3's) renders both the same: silent.",
    fix="Parse the arguments into objects before training: `call['function']['arguments'] = "
    "json.loads(call['function']['arguments'])` for every tool call (datasets' `map`).",
    remedy=RemedyDoc(
        "unsafe", "Parses each tool call's string arguments into the object they hold (dataset.jsonl)."
    ),
)


@TOOL_ARGS_SERIALIZATION.check(applies=_has_conversations)
def check_tool_args_serialization(ctx):
    from hf_sanity.measure.agents import tool_args_serialization

    measured = tool_args_serialization(ctx)
    if not measured or not measured["rendered_differently"]:
        return
    rows, example = measured["rows"], measured["example"]
    double = example["double_encoded"]
    yield TOOL_ARGS_SERIALIZATION.finding(
        f"{_share(len(rows), measured['rows_with_calls'])} with tool calls store their arguments as JSON strings, "
        f"and the chat template renders them {'double-encoded' if double else 'differently'}, not as the object "
        f"a server parses them into ({len(measured['rendered_differently'])} of {measured['rendered']} rendered): trained "
        f"{example['trained']!r}, served {example['served']!r}",
        evidence={
            "rows_string_arguments": len(rows),
            "rows_with_tool_calls": measured["rows_with_calls"],
            "fraction": round(len(rows) / max(measured["rows_with_calls"], 1), 4),
            "rendered": measured["rendered"],
            "rendered_differently": len(measured["rendered_differently"]),
            "example": example,
            "rows": rows[:10],
            "cause": "double-encoded" if double else "string-arguments",
        },
        rows=rows if ctx.rows_are_dataset else None,
        remedy=_parse_arguments(ctx, rows),
    )


def _parse_arguments(ctx, rows) -> Remedy | None:
    """The rows' string arguments parsed into objects (unsafe: the training text changes)."""
    if not ctx.rows_are_dataset or ctx.source_format not in ("messages", "prompt-completion"):
        return None
    keys = ("messages",) if ctx.source_format == "messages" else ("prompt", "completion")
    indices = sorted(int(i) for i in rows)

    def apply(repair) -> None:
        import json

        from hf_sanity.measure.agents import with_parsed_arguments

        for i in indices:
            row = dict(repair.rows()[i])
            for key in keys:
                value = row.get(key)
                messages = json.loads(value) if isinstance(value, str) else value
                if isinstance(messages, list):
                    parsed, _ = with_parsed_arguments(messages)
                    row[key] = json.dumps(parsed, ensure_ascii=False) if isinstance(value, str) else parsed
            repair.replace(i, row, TOOL_ARGS_SERIALIZATION.slug)

    n = len(indices)
    return Remedy(
        f"parse the tool-call arguments of the {n} row{'s' if n != 1 else ''} that store them as JSON strings",
        "unsafe",
        ("dataset",),
        apply,
        detail={"rows_edited": n},
    )


TOOLS_SCHEMA_MISSING = define(
    "tools-schema-missing",
    severity="warning",
    stage="template",
    objectives=SFT,
    symptom="The model learns to call functions it was never shown: rows make tool calls without a `tools` "
    "schema, while the chat template renders a tools block from the schema (at inference the functions are "
    "listed, in training they never were), so it learns to invent names and arguments.",
    detects="Rows with tool calls and no `tools` (column or JSON string); the template is asked to render one of "
    "them with a schema of the functions it calls and without: a difference means the template shows a "
    "schema these rows lack.",
    fix="Add a `tools` column with the JSON schemas of the functions each row calls (TRL passes it to the chat "
    "template, as servers do), e.g. from `transformers.utils.get_json_schema(fn)`.",
)


@TOOLS_SCHEMA_MISSING.check(applies=_has_conversations)
def check_tools_schema_missing(ctx):
    from hf_sanity.measure.agents import tools_schema_missing

    measured = tools_schema_missing(ctx)
    if not measured or not measured["template_block"]:
        return
    rows, block = measured["rows"], measured["template_block"]
    names = measured["functions"]
    yield TOOLS_SCHEMA_MISSING.finding(
        f"{_share(len(rows), measured['rows_with_calls'])} with tool calls have no `tools` schema, and the chat "
        f"template renders one when given it ({block['tokens_with'] - block['tokens_without']} tokens more for "
        f"row {block['row']}): the model is trained to call {', '.join(map(repr, names[:4]))} without seeing "
        "them listed",
        evidence={
            "rows_without_schema": len(rows),
            "rows_with_tool_calls": measured["rows_with_calls"],
            "fraction": round(len(rows) / max(measured["rows_with_calls"], 1), 4),
            "functions": names[:20],
            "template_block": block,
            "rows": rows[:10],
            "cause": "no-tools-schema",
        },
        rows=rows if ctx.rows_are_dataset else None,
    )


THINK_WARNING, THINK_ERROR = 0.01, 0.20

THINK_UNCLOSED = define(
    "think-unclosed",
    severity="warning",
    stage="tokens",
    objectives=SFT,
    symptom="The reasoning model never learns to end its thinking: max_len cuts the supervised answers inside "
    "their `<think>` block, so they are trained on thinking that never closes and it rambles at inference.",
    detects="Supervised spans that open `<think>` before max_len and close it (`</think>`) after: the cut keeps "
    "the thinking and drops its close. Warning above 1% of the rows, error above 20%; the evidence gives the "
    "max_length that keeps 99% of the rows closed. On a trainer's rows (already cut): rows as long as "
    "max_length whose answer opened a think block and holds no close.",
    fix="Raise max_length to the length that keeps the think blocks closed (evidence.max_len_for_99pct_closed), "
    "or drop or shorten the rows whose reasoning does not fit.",
)


@THINK_UNCLOSED.check
def check_think_unclosed(ctx):
    from hf_sanity.measure.agents import think_unclosed

    measured = think_unclosed(ctx)
    if not measured or measured["fraction"] <= THINK_WARNING:
        return
    rows, n = measured["rows"], measured["examples"]
    for_99 = measured["max_len_for_99pct_closed"]
    keep = f"; max_length={for_99:,} keeps 99% of the rows closed" if for_99 else ""
    yield THINK_UNCLOSED.finding(
        f"max_len={measured['max_len']:,} cuts the answers of {_share(len(rows), n)} inside their think block: "
        f"they are trained on `<think>` without its `</think>`{keep}",
        evidence={
            "rows_unclosed": len(rows),
            "examples": n,
            "fraction": round(measured["fraction"], 4),
            "max_length": measured["max_len"],
            "max_len_for_99pct_closed": for_99,
            "max_len_for_all_closed": measured["max_len_for_all_closed"],
            "never_closed": measured["never_closed"],
            "rows": rows[:10],
            "cause": "think-cut",
        },
        example=ctx.view(rows[0], focus=measured["max_len"] - 1),
        severity="error" if measured["fraction"] > THINK_ERROR else "warning",
        rows=rows if ctx.rows_are_dataset else None,
    )


REASONING_FIELD_DROPPED = define(
    "reasoning-field-dropped",
    severity="warning",
    stage="template",
    objectives=SFT,
    symptom="The reasoning in the data never reaches training: assistant messages carry a `reasoning_content` "
    "field and the chat template ignores it, so the model learns the answers without the thinking.",
    detects="Rows whose last assistant message has a non-empty `reasoning_content`: a sample is rendered and "
    "the reasoning looked for in the text, line by line; rows where none of it is there.",
    fix="Render with a template that prints `reasoning_content` (Qwen3's, or TRL's training twin of your "
    "model's template), or move the reasoning into the content as `<think>\\n...\\n</think>\\n\\n` + answer.",
)


@REASONING_FIELD_DROPPED.check(applies=_has_conversations)
def check_reasoning_field_dropped(ctx):
    from hf_sanity.measure.agents import reasoning_field_dropped

    measured = reasoning_field_dropped(ctx)
    if not measured or not measured["dropped"]:
        return
    example = measured["example"]
    yield REASONING_FIELD_DROPPED.finding(
        f"{len(measured['rows'])} rows carry `reasoning_content` on their answer and the chat template renders "
        f"none of it ({len(measured['dropped'])} of {measured['rendered']} rendered); e.g. "
        f"{example['reasoning_content'][:60]!r} is not in the training text",
        evidence={
            "rows_with_reasoning": len(measured["rows"]),
            "rendered": measured["rendered"],
            "dropped": len(measured["dropped"]),
            "example": example,
            "rows": measured["dropped"][:10],
            "cause": "template-ignores-reasoning-content",
        },
    )


PREFIX_NOT_PRESERVED = define(
    "template-not-prefix-preserving",
    severity="warning",
    stage="template",
    objectives=SFT | RL,
    symptom="Multi-turn training sees earlier turns in a form they never had when they were generated: the chat "
    "template renders turn k differently once turn k+1 follows (Qwen3-style templates strip the thinking of "
    "past turns), so SFT trains the earlier answers without their reasoning, and an RL tool loop that "
    "re-renders the conversation scores tokens that were never sampled.",
    detects="Multi-turn rows (two assistant turns or more; for RL, prompts with assistant turns) rendered up to "
    "each assistant turn: the render up to turn k must be a prefix of the render up to turn k+1. The first turn "
    "where it is not, with the diff. Warning for SFT, error for RL.",
    fix="Use a template that keeps past turns as they were (TRL's training twin, e.g. qwen3_training.jinja, "
    "keeps the thinking), or train on one row per assistant turn, each rendered as it was generated.",
)


def _rl_prompts(ctx):
    """(index, messages) of the RL prompts (a trainer's, or a prompt-only file's) with assistant turns in them."""
    data = ctx.prompts
    if data is None or "prompt" not in (getattr(data, "column_names", None) or ()):
        return
    for i in range(min(len(data), 64)):
        prompt = data[i]["prompt"]
        if isinstance(prompt, list) and sum(
            isinstance(m, dict) and m.get("role") == "assistant" for m in prompt
        ):
            yield i, prompt


@PREFIX_NOT_PRESERVED.check(applies=lambda ctx: bool(getattr(ctx.tokenizer, "chat_template", None)))
def check_prefix_preserving(ctx):
    from hf_sanity.measure.agents import has_conversations, prefix_break, prefix_preserving

    rl = ctx.objective.kind == "rl"
    if rl:
        checked, broken, first = 0, [], None
        for i, prompt in _rl_prompts(ctx):
            checked += 1
            # The prompt's history and one answer after it, as a tool loop renders the conversation again.
            found = prefix_break(ctx.tokenizer, [*prompt, {"role": "assistant", "content": "."}], {})
            if found:
                broken.append(i)
                first = first or {"row": i, **found}
        measured = {"multi_turn_rows": checked, "checked": checked, "broken": broken, "first": first}
    elif has_conversations(ctx):
        measured = prefix_preserving(ctx)
    else:
        return
    if not measured or not measured["broken"]:
        return
    first = measured["first"]
    diff = first["diff"]
    yield PREFIX_NOT_PRESERVED.finding(
        f"the chat template re-renders earlier turns: in {len(measured['broken'])} of {measured['checked']} "
        f"multi-turn rows the conversation up to assistant turn {first['turn']} is not the start of the "
        f"conversation one turn later (row {first['row']}: {diff['texts'][0]!r} becomes {diff['texts'][1]!r})",
        evidence={
            "rows_broken": len(measured["broken"]),
            "checked": measured["checked"],
            "multi_turn_rows": measured["multi_turn_rows"],
            "first_turn": first["turn"],
            "first_row": first["row"],
            "diff": diff,
            "rows": measured["broken"][:10],
            "cause": "past-turns-rerendered",
        },
        severity="error" if rl else "warning",
    )
