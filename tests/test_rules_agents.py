"""Agents and reasoners: tool calls as serving engines parse them, tool schemas, think blocks that close,
reasoning fields and templates that keep earlier turns (rules in `hf_sanity.rules.agents`)."""

from __future__ import annotations

import pytest

from conftest import real_tokenizer
from helpers import run
from hf_sanity.testing import TinyConfig, tiny_model_for, tool_conversations

pytestmark = pytest.mark.slow  # real vocabularies of up to 152k tokens

SMALL = TinyConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
)


@pytest.fixture(scope="module")
def qwen():
    return real_tokenizer("qwen2.5-instruct")


@pytest.fixture(scope="module")
def qwen_model(qwen):
    return tiny_model_for(qwen, SMALL)


def null_content(rows):
    """The rows with each call-only assistant turn's content null, as OpenAI-format exports store it."""
    out = []
    for row in rows:
        messages = [
            {**m, "content": None} if m.get("tool_calls") and not m.get("content") else m
            for m in row["messages"]
        ]
        out.append({**row, "messages": messages})
    return out


@pytest.mark.clean("init-loss-above-base", "internal-error")
def test_a_tool_call_turn_with_null_content_is_read_by_every_check(qwen, qwen_model):
    """`content: null` beside `tool_calls` is valid OpenAI format and Qwen2.5's template renders it: every
    check reads it (init-loss-above-base joined the contents as strings), and none fires on it."""
    rows = null_content(tool_conversations(16))
    assert rows[0]["messages"][1]["content"] is None
    report = run(qwen, rows, model=qwen_model, max_len=512, sample=8)
    assert [f"{f.rule}: {f.message}" for f in report.findings if f.severity != "info"] == []
    assert report.stats["supervised_tokens"] > 0
