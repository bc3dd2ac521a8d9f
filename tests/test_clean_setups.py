"""Clean setups on real-world tokenizers and chat templates: full preflight, nothing above info.

Each real tokenizer (../shared/real-tokenizers) is paired with a tiny random model of matching vocabulary.
"""

import pytest

from conftest import real_tokenizer
from helpers import above_info, run
from hf_sanity.testing import TinyConfig, as_prompt_completion, demo_conversations, tiny_model_for

SMALL = TinyConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
)
REAL = [
    "qwen2.5-instruct",
    "smollm2-instruct",
    "llama3-instruct",
    "mistral-instruct",
    "tinyllama-chat",
    "phi3-instruct",
]


def rows_for(name):
    rows = demo_conversations(24)
    if name == "mistral-instruct":  # its template accepts strictly alternating user/assistant turns only
        stripped = [{"messages": [m for m in r["messages"] if m["role"] != "system"]} for r in rows]
        rows = list({repr(r): r for r in stripped}.values())  # without system prompts some rows coincide
    return rows


@pytest.mark.slow  # real vocabularies of up to 152k tokens
@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("fmt", ["messages", "prompt-completion"])
@pytest.mark.clean("data", "tokens", "template", "model", "internal-error")
def test_real_template_clean_setup(name, fmt):
    tok = real_tokenizer(name)
    rows = rows_for(name)
    if fmt == "prompt-completion":
        rows = as_prompt_completion(rows, conversational=True)
    model = tiny_model_for(tok, SMALL)
    # `messages` rows trained on the answers (TRL's default would put every token in the loss: prompt-in-loss
    # warns of that); prompt-completion rows get the loss there by TRL's default.
    options = {"loss_on": "completion"} if fmt == "messages" else {}
    report = run(tok, rows, model=model, max_len=256, sample=16, **options)
    assert above_info(report) == []
    assert report.stats["supervised_tokens"] > 0


@pytest.mark.parametrize("template", ["chatml", "llama3", "generation"])
@pytest.mark.clean(
    "data", "tokens", "template", "model", "internal-error", "checks-skipped", "double-bos",
    "generation-prompt-mismatch", "stray-template-markers", "context-beyond-window",
)  # fmt: skip
def test_embedded_tiny_setups_are_clean(template):
    from hf_sanity.testing import tiny_setup

    model, tok = tiny_setup(template, "distinct")
    # `messages` rows with the loss on the answers; prompt-completion rows get it there by TRL's default
    for rows, options in ((demo_conversations(24), {"loss_on": "completion"}),
                          (as_prompt_completion(demo_conversations(24)), {}),
                          (as_prompt_completion(demo_conversations(24), conversational=True), {})):  # fmt: skip
        report = run(tok, rows, model=model, max_len=256, **options)
        assert above_info(report) == [] and report.by_rule("checks-skipped") == []
