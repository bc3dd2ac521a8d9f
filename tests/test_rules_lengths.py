"""Length rules: max_len against the data and against the model."""

import pytest
from transformers import LlamaConfig

from helpers import run
from hf_sanity.testing import demo_conversations


@pytest.mark.planted("truncated-completion")
def test_truncated_completion_severity_and_suggestion(chatml, conversations):
    report = run(chatml, conversations, select="truncated-completion", max_len=40)
    (finding,) = report.findings
    lengths = sorted(len(chatml.apply_chat_template(r["messages"])["input_ids"]) for r in conversations)
    cut = sum(length > 40 for length in lengths)
    assert finding.evidence["cut"] > 0 and finding.evidence["cut"] <= cut
    assert finding.evidence["length_max"] == lengths[-1]
    assert finding.evidence["max_len_for_99pct"] >= lengths[int(0.99 * (len(lengths) - 1))]
    expected = "error" if finding.evidence["fraction"] >= 0.10 else "warning"
    assert finding.severity == expected
    assert finding.example.cut == 40


def test_truncated_completion_is_a_warning_when_few_are_cut(chatml, conversations):
    long_one = {
        "messages": [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "word " * 200}]
    }
    report = run(chatml, [*conversations, long_one], select="truncated-completion", max_len=128)
    (finding,) = report.findings
    assert finding.severity == "warning" and finding.evidence["rows"] == [len(conversations)]


def test_truncated_completion_never_suggests_a_smaller_max_len(chatml):
    """One very long row: 99% of the examples fit in far less than max_len, so the fix is to drop that row or
    to raise max_len to its length, each with its cost; never "raise" max_len to a smaller value."""
    long_one = {
        "messages": [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "word " * 300}]
    }
    rows = [*demo_conversations(199), long_one]
    (finding,) = run(chatml, rows, select="truncated-completion", max_len=128).findings
    longest = len(chatml.apply_chat_template(long_one["messages"])["input_ids"])
    assert finding.evidence["max_len_for_99pct"] < 128 < longest == finding.evidence["max_len_for_all"]
    assert finding.message.endswith(f"the longest is {longest:,} tokens")
    assert "keeps 99%" not in finding.message + finding.fix
    assert finding.fix.startswith("Drop or split the 1 example longer than max_len (0.5% of the examples, ")
    assert f"or raise max_len to {longest:,} to keep every completion whole" in finding.fix
    assert 0.1 < finding.evidence["cut_supervised_fraction"] < 1


@pytest.mark.clean("truncated-completion")
def test_no_truncation_no_finding(chatml, conversations):
    assert run(chatml, conversations, select="truncated-completion", max_len=512).findings == []


@pytest.mark.planted("max-len-exceeds-model")
def test_max_len_exceeds_model(chatml, conversations):
    config = LlamaConfig(max_position_embeddings=256)
    (finding,) = run(
        chatml, conversations[:4], select="max-len-exceeds-model", max_len=1024, model_config=config
    ).findings
    assert finding.evidence == {"max_len": 1024, "max_position_embeddings": 256}
    assert (
        run(
            chatml, conversations[:4], select="max-len-exceeds-model", max_len=256, model_config=config
        ).findings
        == []
    )


@pytest.mark.planted("context-beyond-window")
def test_context_beyond_sliding_window(chatml, conversations):
    config = LlamaConfig(max_position_embeddings=4096)
    config.sliding_window = 32
    (finding,) = run(chatml, conversations, select="context-beyond-window", model_config=config).findings
    assert finding.severity == "warning" and finding.evidence["window"] == 32
    assert finding.evidence["kind"] == "sliding window"
    config.sliding_window = None
    assert run(chatml, conversations, select="context-beyond-window", model_config=config).findings == []
