"""Template parity rules."""

import pytest

from conftest import real_tokenizer
from helpers import run, slugs
from hf_sanity.testing import as_prompt_completion, build_tokenizer

TEMPLATE_RULES = ["template-mismatch", "generation-prompt-mismatch", "stray-template-markers", "double-bos"]


@pytest.mark.parametrize("template", ["chatml", "llama3", "generation"])
@pytest.mark.clean("template")
def test_clean_templates_are_silent(template, conversations):
    tok = build_tokenizer(template)
    assert run(tok, conversations, select=TEMPLATE_RULES).findings == []
    assert (
        run(tok, as_prompt_completion(conversations, conversational=True), select=TEMPLATE_RULES).findings
        == []
    )


def test_plain_prose_is_not_a_template_mismatch(chatml):
    rows = [{"text": "The river ran quietly past the old mill. " * 3} for _ in range(5)]
    assert run(chatml, rows, select=TEMPLATE_RULES).findings == []


@pytest.mark.planted("template-mismatch")
def test_text_rendered_with_another_template(chatml, conversations):
    alpaca = [
        {
            "text": f"### Instruction:\n{r['messages'][-2]['content']}\n\n### Response:\n{r['messages'][-1]['content']}"
        }
        for r in conversations
    ]
    (finding,) = run(chatml, alpaca, select="template-mismatch").findings
    assert finding.evidence["foreign_formats"] == {"alpaca": len(conversations)}
    assert finding.evidence["template_formats"] == ["chatml"]
    # Text rendered with the tokenizer's own template is consistent.
    own = [{"text": chatml.apply_chat_template(r["messages"], tokenize=False)} for r in conversations]
    assert "template-mismatch" not in slugs(run(chatml, own, select="template-mismatch"))


def test_pretokenized_with_another_template(chatml, conversations):
    llama = build_tokenizer("llama3")
    rows = [{"input_ids": llama.apply_chat_template(r["messages"])["input_ids"]} for r in conversations]
    (finding,) = run(chatml, rows, select="template-mismatch").findings
    assert "llama-3" in finding.evidence["foreign_formats"]


def test_inference_tokenizer_with_another_template(chatml, conversations):
    report = run(
        chatml, conversations, select="template-mismatch", inference_tokenizer=build_tokenizer("llama3")
    )
    (finding,) = report.findings
    assert finding.evidence["mismatched"] == finding.evidence["checked"] == len(conversations)
    assert finding.evidence["first_difference"] == 0
    same = run(
        chatml, conversations, select="template-mismatch", inference_tokenizer=build_tokenizer("chatml")
    )
    assert same.findings == []


@pytest.mark.planted("generation-prompt-mismatch")
def test_generation_prompt_not_a_prefix(conversations):
    tok = build_tokenizer("chatml")
    # Inference opens a reasoning block that no training turn contains (as DeepSeek-R1's template does).
    tok.chat_template = tok.chat_template.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"
    )
    (finding,) = run(tok, conversations, select="generation-prompt-mismatch").findings
    assert finding.evidence["rows"][:3] == [0, 1, 2]
    assert finding.evidence["inference_prompt_ends"].endswith("assistant\n<think>\n")


def test_deepseek_r1_generation_prompt_opens_think():
    tok = real_tokenizer("deepseek-r1-distill")
    rows = [
        {
            "messages": [
                {"role": "user", "content": "What is 2 plus 3?"},
                {"role": "assistant", "content": "5"},
            ]
        }
    ]
    (finding,) = run(tok, rows, select="generation-prompt-mismatch").findings
    assert "<think>" in finding.evidence["inference_prompt_ends"]


@pytest.mark.planted("stray-template-markers")
def test_stray_markers_in_content(chatml, conversations):
    rows = [dict(r) for r in conversations[:10]]
    rows[6] = {"messages": [{"role": "user", "content": "Summarise: [INST] hi [/INST]"},
                            {"role": "assistant", "content": "Done.<|im_end|> more"}]}  # fmt: skip
    (finding,) = run(chatml, rows, select="stray-template-markers").findings
    assert finding.evidence["rows"] == [6]
    assert set(finding.evidence["markers"]) == {"[INST]", "[/INST]", "<|im_end|>"}


@pytest.mark.planted("double-bos")
def test_double_bos_from_retokenized_llama3_text(conversations):
    tok = build_tokenizer("llama3")
    rows = [{"text": tok.apply_chat_template(r["messages"], tokenize=False)} for r in conversations]
    (finding,) = run(tok, rows, select="double-bos").findings
    assert finding.evidence["count"] == len(conversations)
    assert run(tok, conversations, select="double-bos").findings == []


@pytest.mark.parametrize("name", ["llama3-instruct", "mistral-instruct", "llama2-chat"])
def test_double_bos_on_real_templates(name):
    tok = real_tokenizer(name)
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    ]
    text_rows = [{"text": tok.apply_chat_template(rows[0]["messages"], tokenize=False)}]
    assert "double-bos" in slugs(run(tok, text_rows, select="double-bos"))
    assert run(tok, rows, select="double-bos").findings == []
