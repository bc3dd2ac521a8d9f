"""`thinking-mode-mismatch`: direct answers trained without the empty think block that a Qwen3-style
template's no-think prefill (`enable_thinking=False`) puts before them, on the tiny tokenizer with Qwen3-style
template strings."""

from __future__ import annotations

import copy

import pytest

from helpers import run
from hf_sanity.testing import build_tokenizer, demo_conversations

PREFILL = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Assistant turns rendered as they are: direct answers reach training with no think block.
PLAIN = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}" + PREFILL
)
# Qwen3's own rendering: the final answer opens with an empty think block when it carries none.
QWEN3_STYLE = (
    "{%- for message in messages %}{%- if message.role == 'assistant' and loop.last "
    "and '<think>' not in message.content %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}" + PREFILL
)
# No thinking mode at all: nothing to compare.
CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tokenizer_with(template: str):
    tok = copy.deepcopy(build_tokenizer("chatml"))
    tok.chat_template = template
    return tok


@pytest.fixture
def measured(monkeypatch):
    from hf_sanity.measure import agents

    calls = []
    real = agents.thinking_parity

    def recording(ctx):
        calls.append(real(ctx))
        return calls[-1]

    monkeypatch.setattr(agents, "thinking_parity", recording)
    return calls


def rows(n=16, **kwargs):
    out = demo_conversations(n, seed=0, multi_turn_every=0)
    return [{**row, **kwargs} for row in out]


@pytest.mark.planted("thinking-mode-mismatch")
def test_direct_answers_without_the_empty_block_the_no_think_prefill_adds():
    report = run(tokenizer_with(PLAIN), rows(), select="thinking-mode-mismatch")
    (finding,) = report.findings
    assert finding.evidence["cause"] == "empty-think-missing" and finding.severity == "warning"
    assert finding.evidence["no_block"] == finding.evidence["turns"] == 16
    assert finding.evidence["no_think_prefill"] == "<think>\n\n</think>\n\n"
    assert "enable_thinking=False" in finding.message


@pytest.mark.planted("thinking-mode-mismatch")
def test_empty_blocks_trained_in_a_declared_thinking_mode():
    data = rows(chat_template_kwargs={"enable_thinking": True})
    report = run(tokenizer_with(QWEN3_STYLE), data, select="thinking-mode-mismatch")
    (finding,) = report.findings
    assert finding.evidence["cause"] == "empty-think-in-thinking-mode"
    assert finding.evidence["empty_block"] == 16 and finding.evidence["declared_enable_thinking"] is True


@pytest.mark.clean("thinking-mode-mismatch")
def test_qwen3s_own_rendering_of_direct_answers_is_silent(measured):
    report = run(tokenizer_with(QWEN3_STYLE), rows(), select="thinking-mode-mismatch")
    assert report.findings == []
    (facts,) = measured
    assert facts["empty_block"] == facts["turns"] == 16 and facts["no_block"] == 0


@pytest.mark.clean("thinking-mode-mismatch")
def test_a_template_without_a_thinking_mode_is_silent(measured):
    report = run(tokenizer_with(CHATML), rows(), select="thinking-mode-mismatch")
    assert report.findings == [] and measured == [None]
