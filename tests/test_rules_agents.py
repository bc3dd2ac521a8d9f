"""Agents and reasoners: tool calls as serving engines parse them, tool schemas, think blocks that close,
reasoning fields and templates that keep earlier turns (rules in `hf_sanity.rules.agents`)."""

from __future__ import annotations

import copy
import json

import datasets
import pytest
import trl_setups as setups

from conftest import real_tokenizer
from helpers import cli, run
from hf_sanity.drivers.preflight import preflight
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
    # the loss on the answers (TRL's default, every token, is a prompt-in-loss warning of its own)
    report = run(qwen, rows, model=qwen_model, max_len=512, sample=8, loss_on="completion")
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
    copied.chat_template = setups.trl_template(name)
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
    scans = measured("scan")
    report = preflight(
        trainer=trainer, select=["tools-schema-missing", "tool-args-serialization"], use_config=False
    )
    assert report.findings == []
    (found,) = {id(f): f for f in scans}.values()  # one pass over the trainer's conversations, shared
    assert len(found.with_calls) == 16 and found.without_schema == [] and found.string_arguments == []


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


# -- think-unclosed ---------------------------------------------------------------------------------------------
def thinking_rows(n=40, steps=4, answer="", grow=True):
    """Single-turn reasoning rows whose thinking grows row by row (``steps`` + i sentences; ``grow=False``:
    ``steps``), then the answer (``answer`` appended to it)."""
    from hf_sanity.testing import demo_conversations

    rows = []
    for i, row in enumerate(demo_conversations(n)):
        user, reply = [m for m in row["messages"] if m["role"] != "system"][:2]
        thought = " ".join(f"step {k} checks the question again." for k in range(steps + i * grow))
        content = f"<think>\n{thought}\n</think>\n\n{reply['content']}{answer}"
        rows.append({"messages": [user, {"role": "assistant", "content": content}]})
    return rows


@pytest.mark.planted("think-unclosed")
def test_max_len_inside_the_thinking_of_most_rows_is_an_error(qwen):
    rows = thinking_rows()
    report = run(qwen, rows, max_len=300, select=["think-unclosed", "truncated-completion"])
    (finding,) = report.by_rule("think-unclosed")
    evidence = finding.evidence
    assert finding.severity == "error" and evidence["cause"] == "think-cut"
    assert evidence["rows_unclosed"] == 14 and evidence["fraction"] == pytest.approx(14 / 40)
    assert evidence["max_length"] == 300
    # truncated-completion says it too: of the rows it cuts, those whose think block lost its close
    (cut,) = report.by_rule("truncated-completion")
    assert cut.evidence["think_unclosed"] == 14 and "lose the close of their think block" in cut.message
    # the length the evidence gives keeps every row's close: at it, the rule is silent
    closed = run(qwen, rows, max_len=evidence["max_len_for_99pct_closed"], select="think-unclosed")
    assert closed.findings == []
    rendered = qwen.apply_chat_template(rows[-1]["messages"], tokenize=False)
    ids = qwen(rendered, add_special_tokens=False)["input_ids"]
    assert qwen.decode(ids[: evidence["max_len_for_all_closed"] - 1]).count("</think>") == 0  # the shortest


@pytest.mark.planted("think-unclosed")
def test_a_few_rows_cut_inside_their_thinking_is_a_warning(qwen):
    (finding,) = run(qwen, thinking_rows(), max_len=380, select="think-unclosed").findings
    assert finding.severity == "warning" and finding.evidence["rows_unclosed"] == 5


@pytest.mark.planted("think-unclosed")
def test_sft_trainer_max_length_inside_the_thinking(qwen, qwen_model, tmp_path):
    """preflight(trainer=SFTTrainer(...)): the rows arrive cut; the length that keeps the closes comes from the
    conversations the trainer kept beside its tokens, and is the one preflight on the dataset gives."""
    from trl import SFTConfig, SFTTrainer

    rows = thinking_rows()
    config = SFTConfig(output_dir=str(tmp_path / "out"), max_length=300, per_device_train_batch_size=4,
                       report_to=[], use_cpu=True)  # fmt: skip
    trainer = SFTTrainer(
        model=qwen_model, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=qwen
    )
    report = preflight(trainer=trainer, select=["think-unclosed", "truncated-completion"], use_config=False)
    (finding,) = report.by_rule("think-unclosed")
    assert finding.severity == "error" and finding.evidence["rows_unclosed"] == 14
    (on_rows,) = run(qwen, rows, max_len=300, select="think-unclosed").findings
    assert finding.evidence["max_len_for_99pct_closed"] == on_rows.evidence["max_len_for_99pct_closed"]
    assert report.by_rule("truncated-completion")[0].evidence["think_unclosed"] == 14


@pytest.mark.clean("think-unclosed")
def test_answers_cut_after_their_thinking_closed_are_not_unclosed(qwen, measured):
    """Short thinking, long answers: max_len cuts the answers (truncated-completion) after `</think>`."""
    rows = thinking_rows(
        steps=2, grow=False, answer=" " + "And that is the whole answer, said once more." * 12
    )
    calls = measured("think_unclosed")
    report = run(qwen, rows, max_len=120, select=["think-unclosed", "truncated-completion"])
    assert report.by_rule("think-unclosed") == [] and calls[0] is None
    assert report.by_rule("truncated-completion")[0].evidence["cut"] == 40
    assert "think_unclosed" not in report.by_rule("truncated-completion")[0].evidence


@pytest.mark.clean("think-unclosed")
def test_reasoning_rows_that_fit_are_silent_with_deepseek_r1s_training_template(measured):
    """DeepSeek-R1's tokenizer, whose `<think>` is one token, with TRL's training twin (it keeps the reasoning)."""
    tok = with_template(real_tokenizer("deepseek-r1-distill"), "deepseek_r1_distill_training")
    rows = thinking_rows(12)
    calls = measured("think_unclosed")
    longest = max(len(tok.apply_chat_template(r["messages"], return_dict=True)["input_ids"]) for r in rows)
    assert run(tok, rows, max_len=longest, select="think-unclosed").findings == []
    assert calls == [None]
    (finding,) = run(tok, rows, max_len=longest - 40, select="think-unclosed").findings  # and it reads them
    assert finding.evidence["rows_unclosed"] >= 1


# -- reasoning-field-dropped ------------------------------------------------------------------------------------
def reasoning_field_rows(n=16):
    """Rows whose answers carry their reasoning in a `reasoning_content` field (as DeepSeek's and Qwen3's APIs
    return it), not in the content."""
    from hf_sanity.testing import demo_conversations

    rows = []
    for row in demo_conversations(n):
        user, reply = [m for m in row["messages"] if m["role"] != "system"][:2]
        thought = f"The user asks: {user['content']}\nI know this one."
        rows.append({"messages": [user, {**reply, "reasoning_content": thought}]})
    return rows


@pytest.mark.planted("reasoning-field-dropped")
def test_reasoning_content_that_the_template_ignores(qwen, qwen_model, tmp_path):
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=str(tmp_path / "out"), max_length=256, per_device_train_batch_size=4,
                       report_to=[], use_cpu=True)  # fmt: skip
    data = datasets.Dataset.from_list(reasoning_field_rows())
    trainer = SFTTrainer(model=qwen_model, args=config, train_dataset=data, processing_class=qwen)
    report = preflight(trainer=trainer, select="reasoning-field-dropped", use_config=False)
    (finding,) = report.findings
    evidence = finding.evidence
    assert finding.severity == "warning" and evidence["cause"] == "template-ignores-reasoning-content"
    assert evidence["rows_with_reasoning"] == 16 and evidence["dropped"] == evidence["rendered"] == 16
    assert evidence["example"]["reasoning_content"].startswith("The user asks:")
    assert "The user asks" not in qwen.decode(trainer.train_dataset[0]["input_ids"])  # what it trains on


@pytest.mark.clean("reasoning-field-dropped")
def test_a_template_that_renders_reasoning_content_is_silent(qwen, measured):
    """Qwen3's template prints the answer's `reasoning_content` in a think block."""
    tok = with_template(qwen, "qwen3")
    rows = reasoning_field_rows()
    assert "I know this one." in tok.apply_chat_template(rows[0]["messages"], tokenize=False)
    calls = measured("reasoning_field_dropped")
    assert run(tok, rows, select="reasoning-field-dropped").findings == []
    ((seen,),) = [calls]
    assert seen["rendered"] == 16 and seen["dropped"] == []


# -- template-not-prefix-preserving -----------------------------------------------------------------------------
def multi_turn_thinking(n=12):
    """Two-turn conversations whose answers think first (`<think>...</think>` in the content)."""
    from hf_sanity.testing import demo_conversations

    rows = []
    for i, row in enumerate(demo_conversations(n)):
        user, reply = [m for m in row["messages"] if m["role"] != "system"][:2]
        first = {
            "role": "assistant",
            "content": f"<think>\nThe user asks {i}.\n</think>\n\n{reply['content']}",
        }
        follow = {"role": "user", "content": "Say it again, shorter."}
        second = {"role": "assistant", "content": f"<think>\nShorter.\n</think>\n\n{reply['content'][:12]}"}
        rows.append({"messages": [user, first, follow, second]})
    return rows


@pytest.mark.planted("template-not-prefix-preserving")
def test_a_template_that_strips_past_thinking_is_not_prefix_preserving(qwen):
    tok = with_template(qwen, "qwen3")
    (finding,) = run(tok, multi_turn_thinking(), select="template-not-prefix-preserving").findings
    evidence = finding.evidence
    assert finding.severity == "warning" and evidence["cause"] == "past-turns-rerendered"
    assert evidence["rows_broken"] == evidence["checked"] == 12 and evidence["first_turn"] == 1
    earlier, later = evidence["diff"]["texts"]
    assert earlier.startswith("<think>") or "<think>" in earlier  # turn 1 as generated: with its thinking
    assert "<think>" not in later.split("<|im_end|>")[0]  # turn 1 once turn 2 follows: without


@pytest.mark.planted("template-not-prefix-preserving")
def test_an_rl_tool_loop_over_a_template_that_strips_past_thinking_is_an_error(qwen, qwen_model, tmp_path):
    from trl_setups import grpo, length_reward

    tok = with_template(qwen, "qwen3")
    rows = [{"prompt": r["messages"][:3]} for r in multi_turn_thinking(8)]
    trainer = grpo(tmp_path, rows, [length_reward], model=qwen_model, tok=tok)
    report = preflight(trainer=trainer, select="template-not-prefix-preserving", reward_dry_run=False,
                       use_config=False)  # fmt: skip
    (finding,) = report.findings
    assert finding.severity == "error" and finding.evidence["rows_broken"] == 8


@pytest.mark.clean("template-not-prefix-preserving")
@pytest.mark.parametrize("template", [None, "qwen3_training"])
def test_templates_that_keep_past_turns_are_silent(qwen, template, measured):
    """Qwen2.5's template renders each turn as it is; TRL's training twin of Qwen3's keeps the thinking."""
    tok = qwen if template is None else with_template(qwen, template)
    calls = measured("prefix_preserving")
    assert run(tok, multi_turn_thinking(), select="template-not-prefix-preserving").findings == []
    ((seen,),) = [calls]
    assert seen["checked"] == 12 and seen["broken"] == []


@pytest.mark.clean("template-not-prefix-preserving")
def test_an_rl_run_over_qwen25s_template_is_silent(qwen, qwen_model, tmp_path, measured):
    from trl_setups import grpo, length_reward

    rows = [{"prompt": r["messages"][:3]} for r in multi_turn_thinking(8)]
    trainer = grpo(tmp_path, rows, [length_reward], model=qwen_model, tok=qwen)
    calls = measured("prefix_break")
    report = preflight(trainer=trainer, select="template-not-prefix-preserving", reward_dry_run=False,
                       use_config=False)  # fmt: skip
    assert report.findings == [] and report.stats["objective"] == "rl"
    assert calls == [None] * 8  # every prompt's history rendered turn by turn
