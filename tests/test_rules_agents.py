"""Agents and reasoners: tool calls as serving engines parse them, tool schemas, think blocks that close,
reasoning fields and templates that keep earlier turns (rules in `hf_sanity.rules.agents`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import datasets
import pytest
import trl

from conftest import real_tokenizer
from helpers import cli, run
from hf_sanity.drivers.preflight import preflight
from hf_sanity.testing import TinyConfig, tiny_model_for, tool_conversations

pytestmark = pytest.mark.slow  # real vocabularies of up to 152k tokens
TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"

SMALL = TinyConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
)


@pytest.fixture(scope="module")
def qwen():
    return real_tokenizer("qwen2.5-instruct")


@pytest.fixture(scope="module")
def qwen_model(qwen):
    return tiny_model_for(qwen, SMALL)


@pytest.fixture
def measured(monkeypatch):
    """``measured(name)``: what the measurement ``hf_sanity.measure.agents.<name>`` returned each time a rule
    called it (so a silent test shows its detector ran, and on what)."""
    from hf_sanity.measure import agents

    def spy(name):
        calls = []
        real = getattr(agents, name)

        def recording(*args, **kwargs):
            calls.append(real(*args, **kwargs))
            return calls[-1]

        monkeypatch.setattr(agents, name, recording)
        return calls

    return spy


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


# -- tool-args-serialization ------------------------------------------------------------------------------------
def string_arguments(rows):
    """The rows with each tool call's arguments stored as a JSON string, as OpenAI-format exports store them."""
    out = []
    for row in rows:
        messages = []
        for m in row["messages"]:
            if m.get("tool_calls"):
                calls = [
                    {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ]
                m = {**m, "tool_calls": calls}
            messages.append(m)
        out.append({**row, "messages": messages})
    return out


def with_template(tok, name):
    """A copy of ``tok`` with TRL's ``name``.jinja as its chat template."""
    copied = copy.deepcopy(tok)
    copied.chat_template = (TRL_TEMPLATES / f"{name}.jinja").read_text()
    return copied


@pytest.mark.planted("tool-args-serialization")
def test_string_arguments_through_a_tojson_template_are_double_encoded(qwen, qwen_model, tmp_path):
    rows = string_arguments(tool_conversations(16))
    data = tmp_path / "tools.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    folder = tmp_path / "model"
    qwen_model.save_pretrained(folder)
    qwen.save_pretrained(folder)
    result = cli("preflight", "--model", folder, "--dataset", data, "--select", "tool-args-serialization",
                 "--json", tmp_path / "r.json", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    (finding,) = json.loads((tmp_path / "r.json").read_text())["findings"]
    evidence = finding["evidence"]
    assert finding["severity"] == "error" and evidence["cause"] == "double-encoded"
    assert evidence["rows_string_arguments"] == 16 and evidence["fraction"] == 1.0
    example = evidence["example"]
    assert '"{\\"city\\": \\"Paris\\"}"' in example["trained"] and '{"city": "Paris"}}' in example["served"]
    assert example["tokens"]["trained"] > example["tokens"]["served"]  # the escapes cost tokens


@pytest.mark.planted("tool-args-serialization")
def test_fix_parses_the_arguments_and_the_rule_is_silent_after(qwen):
    import hf_sanity

    rows = string_arguments(tool_conversations(8))
    data = datasets.Dataset.from_list(rows)
    fixed = hf_sanity.fix(tokenizer=qwen, dataset=data, unsafe=True, select="tool-args-serialization",
                          use_config=False)  # fmt: skip
    (outcome,) = fixed.outcomes
    assert outcome.status == "fixed" and fixed.report.findings == []
    call = fixed.dataset[0]["messages"][1]["tool_calls"][0]
    assert call["function"]["arguments"] == {"city": "Paris"}
    assert isinstance(
        data[0]["messages"][1]["tool_calls"][0]["function"]["arguments"], str
    )  # yours untouched


@pytest.mark.clean("tool-args-serialization")
def test_object_arguments_are_silent(qwen, measured):
    rows = tool_conversations(16)
    calls = measured("tool_args_serialization")
    report = run(qwen, rows, select="tool-args-serialization")
    assert report.findings == [] and calls == [None]


@pytest.mark.clean("tool-args-serialization")
def test_a_template_that_prints_string_arguments_as_they_are_is_silent(qwen, measured):
    """Qwen3's template prints string arguments verbatim and tojson's objects: both forms render the same."""
    from hf_sanity.measure.agents import render, with_parsed_arguments

    tok = with_template(qwen, "qwen3")
    rows = string_arguments(tool_conversations(16))
    messages = rows[0]["messages"]
    tools = {"tools": rows[0]["tools"]}
    assert render(tok, messages, tools) == render(tok, with_parsed_arguments(messages)[0], tools)
    calls = measured("tool_args_serialization")
    assert run(tok, rows, select="tool-args-serialization").findings == []
    ((seen,),) = [calls]
    assert len(seen["rows"]) == 16 and seen["rendered"] == 16 and seen["rendered_differently"] == []


# -- tools-schema-missing ---------------------------------------------------------------------------------------
@pytest.mark.planted("tools-schema-missing")
def test_tool_calls_without_a_schema_where_the_template_renders_one(qwen, qwen_model, tmp_path):
    from trl import SFTConfig, SFTTrainer

    rows = [{"messages": r["messages"]} for r in tool_conversations(16)]
    config = SFTConfig(output_dir=str(tmp_path / "out"), max_length=512, per_device_train_batch_size=4,
                       report_to=[], use_cpu=True)  # fmt: skip
    trainer = SFTTrainer(
        model=qwen_model, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=qwen
    )
    report = preflight(trainer=trainer, select=["tools-schema-missing"], use_config=False)
    (finding,) = report.by_rule("tools-schema-missing")
    evidence = finding.evidence
    assert finding.severity == "warning" and evidence["cause"] == "no-tools-schema"
    assert evidence["rows_without_schema"] == 16 and evidence["functions"] == ["get_weather"]
    assert "# Tools" in evidence["template_block"]["schema_block"]


@pytest.mark.clean("tools-schema-missing")
def test_tool_calls_with_their_schema_are_silent(qwen, qwen_model, tmp_path, measured):
    from trl import SFTConfig, SFTTrainer

    rows = tool_conversations(16, tools_as_json=True)
    config = SFTConfig(output_dir=str(tmp_path / "out"), max_length=512, per_device_train_batch_size=4,
                       report_to=[], use_cpu=True)  # fmt: skip
    trainer = SFTTrainer(
        model=qwen_model, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=qwen
    )
    conversations = measured("conversations")
    report = preflight(
        trainer=trainer, select=["tools-schema-missing", "tool-args-serialization"], use_config=False
    )
    assert report.findings == []
    assert len(conversations) == 2  # each rule read the trainer's conversations (generators: one record each)


@pytest.mark.clean("tools-schema-missing")
def test_a_template_without_a_tools_block_is_silent(measured):
    """DeepSeek-R1's template renders no schema (and prints string arguments as they are): rows without one
    lose nothing."""
    tok = real_tokenizer("deepseek-r1-distill")
    rows = [{"messages": r["messages"]} for r in null_content(string_arguments(tool_conversations(8)))]
    calls = measured("tools_schema_missing")
    report = run(tok, rows, select=["tools-schema-missing", "tool-args-serialization"])
    assert report.findings == []
    ((seen,),) = [calls]
    assert len(seen["rows"]) == 8 and seen["template_block"] is None
