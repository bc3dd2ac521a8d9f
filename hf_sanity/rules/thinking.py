"""Thinking-mode parity: the training targets against the serving prefill of a template with a no-think mode
(`thinking-mode-mismatch`; the measurement: `hf_sanity.measure.agents.thinking_parity`).

Qwen3-style templates serve without thinking by prefilling an empty think block (``enable_thinking=False``
makes the generation prompt end on ``<think>\\n\\n</think>\\n\\n``); their own rendering of a final answer without
reasoning adds the same block. Targets rendered without it (hand-written templates, pre-rendered text, a
template that drops it) train answers the serving prefill never leads into.
"""

from __future__ import annotations

from hf_sanity.catalog import define

THINKING_MODE_MISMATCH = define(
    "thinking-mode-mismatch",
    severity="warning",
    stage="template",
    symptom="A reasoning model fine-tuned on direct answers keeps thinking, or answers worse when served without "
    "thinking: its serving prefill carries an empty think block the training answers never followed.",
    detects="Where the template's generation prompt with `enable_thinking=False` adds an empty think block to "
    "the thinking one (Qwen3's `<think>\\n\\n</think>\\n\\n`): the last answer of up to 64 conversations, rendered "
    "as training renders it (the row's `chat_template_kwargs`), classified as opening with an empty think block, "
    "a thinking one, or none. Cause `empty-think-missing`: 10% or more of them (2 rows at least) open with no "
    "block while the rows do not declare `enable_thinking=True`: served without thinking, the prefill puts "
    "before the answer a block training never showed; served in thinking mode, the model learns never to think. "
    "Cause `empty-think-in-thinking-mode`: the rows declare `enable_thinking=True` and 10% or more of the "
    "answers open with an empty block, which the model then learns to write itself (it stops thinking).",
    fix="Render the direct answers the way the no-think prefill leads into them: with the template's own "
    "rendering of a final answer (Qwen3's adds the empty block), or put `<think>\\n\\n</think>\\n\\n` before "
    "each answer, and serve with `enable_thinking=False`; or train on answers with their reasoning for thinking "
    "mode.",
)

SHARE, MIN_ROWS = 0.10, 2


def _has_conversations(ctx) -> bool:
    from hf_sanity.measure.agents import has_conversations

    return has_conversations(ctx)


@THINKING_MODE_MISMATCH.check(applies=_has_conversations)
def check_thinking_mode(ctx):
    from hf_sanity.measure.agents import thinking_parity

    facts = thinking_parity(ctx)
    if facts is None:
        return
    turns, declared, block = facts["turns"], facts["declared_enable_thinking"], facts["no_think_prefill"]
    missing, empty = facts["no_block"], facts["empty_block"]
    if declared is not True and missing >= max(MIN_ROWS, SHARE * turns):
        yield THINKING_MODE_MISMATCH.finding(
            f"{missing} of {turns} trained answers open with no think block, and the template's no-think prefill "
            f"(enable_thinking=False) ends on {block!r}: served without thinking, the model meets a block "
            "training never put before an answer; served in thinking mode, it is trained never to think",
            evidence={**facts, "cause": "empty-think-missing"},
            rows=facts["rows_no_block"],
        )
    elif declared is True and empty >= max(MIN_ROWS, SHARE * turns):
        yield THINKING_MODE_MISMATCH.finding(
            f"{empty} of {turns} trained answers open with an empty think block ({block!r}) although the rows "
            "declare enable_thinking=True: the thinking-mode prefill leaves the block to the model, which learns "
            "to write it empty and stop thinking",
            evidence={**facts, "cause": "empty-think-in-thinking-mode"},
            rows=facts["rows_empty_block"],
            fix="Declare the mode the answers are in: `enable_thinking=False` for direct answers (at training and "
            "at serving, whose prefill then carries the empty block), or give the answers their reasoning.",
        )
