"""Real chat templates, real tokenizers, real data shapes.

TRL ships the original chat templates of many model families beside their training twins, which wrap each
assistant turn in ``{% generation %}``: the twins' ``assistant_masks`` are an independent oracle for where a
completion starts and ends. Data labelled by those masks (what `SFTTrainer(assistant_only_loss=True)` trains on)
must pass preflight silently, and the turns preflight locates must agree with the masks. Tool-call
conversations and reasoning data are rendered as TRL renders them.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import trl
import trl_setups as setups

from conftest import real_tokenizer
from helpers import run
from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.measure.context import Context
from hf_sanity.measure.encode import EncodeOptions
from hf_sanity.testing import (
    TinyConfig,
    demo_conversations,
    reasoning_conversations,
    tiny_model_for,
    tool_conversations,
)

pytestmark = pytest.mark.slow  # real vocabularies of up to 152k tokens: `make test-fast` leaves them out
TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
SMALL = TinyConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
)
# (TRL template, a tokenizer whose vocabulary it fits)
PAIRS = [
    ("qwen2_5", "qwen2.5-instruct"),
    ("qwen3", "qwen2.5-instruct"),
    ("qwen3_instruct_2507", "qwen2.5-instruct"),
    ("llama3", "llama3-instruct"),
    ("llama3_1", "llama3-instruct"),
    ("llama3_2", "llama3-instruct"),
    ("phi3", "phi3-instruct"),
    ("phi3_5", "phi3-instruct"),
    ("deepseek_r1_distill", "deepseek-r1-distill"),
]
MASK_AND_TEMPLATE_RULES = ["tokens", "template"]


def template(name: str) -> str:
    return setups.trl_template(name)


def training_twin(name: str) -> str:
    path = TRL_TEMPLATES / f"{name}_training.jinja"
    return (
        path.read_text(encoding="utf-8") if path.exists() else template(f"{name.rsplit('_', 1)[0]}_training")
    )


def masked_rows(tok, conversations, name):
    """Pre-tokenized rows labelled exactly as TRL's training twin masks them, and the masks."""
    rows, masks = [], []
    for row in conversations:
        out = tok.apply_chat_template(
            row["messages"],
            chat_template=training_twin(name),
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids, mask = out["input_ids"], out["assistant_masks"]
        rows.append({"input_ids": ids, "labels": [i if m else IGNORE_INDEX for i, m in zip(ids, mask)]})
        masks.append(mask)
    return rows, masks


def data_for(name: str) -> list[dict]:
    # Reasoning models' generation prompt opens <think>: their training data carries the reasoning.
    return reasoning_conversations(24) if name.startswith("deepseek") else demo_conversations(24)


@pytest.mark.parametrize(("name", "tokenizer"), PAIRS)
@pytest.mark.clean("tokens", "template")
def test_data_labelled_by_trl_assistant_masks_passes(name, tokenizer):
    tok = real_tokenizer(tokenizer)
    rows, _ = masked_rows(tok, data_for(name), name)
    tok.chat_template = template(name)  # the template the model is served with
    report = run(tok, rows, select=MASK_AND_TEMPLATE_RULES)
    assert [f"{f.rule}: {f.message}" for f in report.findings] == []


@pytest.mark.parametrize(("name", "tokenizer"), PAIRS)
def test_located_turns_agree_with_trl_assistant_masks(name, tokenizer):
    """Every token TRL's mask supervises lies inside a turn preflight located (its scaffolding included), and
    every completion token preflight located is one TRL supervises."""
    tok = real_tokenizer(tokenizer)
    rows, masks = masked_rows(tok, data_for(name), name)
    tok.chat_template = template(name)
    ctx = Context(tokenizer=tok, dataset=datasets.Dataset.from_list(rows), fmt="tokens",
                  options=EncodeOptions(fmt="tokens"))  # fmt: skip
    for index, mask in enumerate(masks):
        spans = ctx.spans(index)
        assert spans, f"row {index}: no turn located"
        turns = {p for s in spans for p in range(s.lead, s.end)}
        completions = {p for s in spans for p in range(s.start, s.stop)}
        supervised = {p for p, m in enumerate(mask) if m}
        assert supervised <= turns, (index, sorted(supervised - turns))
        assert completions <= supervised, (index, sorted(completions - supervised))


def test_a_thinking_template_whose_prompt_tokens_merge_is_a_warning_with_its_cause():
    """Qwen3's thinking-by-default template ends the inference prompt on ``<think>\\n`` while its training turns
    carry ``<think>\\n\\n</think>``: the same text, but "\\n\\n" is one token. Worth knowing, not an error."""
    tok = real_tokenizer("qwen2.5-instruct")
    rows, _ = masked_rows(tok, demo_conversations(8), "qwen3_8")
    tok.chat_template = template("qwen3_8")
    (finding,) = run(tok, rows, select="generation-prompt-mismatch").findings
    assert finding.severity == "warning" and finding.evidence["cause"] == "tokens-merge"
    assert "<think>" in finding.evidence["inference_prompt_ends"]


def test_reasoning_data_through_a_template_that_strips_it():
    """DeepSeek-R1's own template drops everything before ``</think>`` from assistant turns while its
    generation prompt opens ``<think>``. The data carries the reasoning: the fix points at the template, never
    at the data (no "add the reasoning", no "strip </think>"), and the reasoning markers are not stray."""
    tok = real_tokenizer("deepseek-r1-distill")
    report = run(tok, reasoning_conversations(16), select=["template", "tokens"])
    rules = {f.rule for f in report.findings}
    assert "stray-template-markers" not in rules
    finding = report.by_rule("generation-prompt-mismatch")[0]
    assert finding.severity == "error" and finding.evidence["cause"] == "text-differs"
    assert "drops it" in finding.fix and "training variant" in finding.fix
    assert "Probe" not in json.dumps(finding.evidence)  # real rendered text, not an internal probe string
    # Without reasoning in the data, the same finding says the data lacks it.
    plain = run(tok, demo_conversations(16), select="generation-prompt-mismatch").findings[0]
    assert "training turns lack" in plain.fix


# -- tool calls --------------------------------------------------------------------------------------------
TOOL_TEMPLATES = ["qwen2.5-instruct", "llama3-instruct"]  # the shared tokenizers whose templates render tools


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
@pytest.mark.parametrize("tools_as_json", [False, True])
@pytest.mark.clean("data", "tokens", "template", "model")
def test_tool_call_conversations_are_read_as_trl_renders_them(name, tools_as_json):
    """An assistant turn that is only a call (content "" plus tool_calls), tool results, and a `tools` column:
    rendered with the tools as TRL does, the tool-call turn supervised, nothing flagged."""
    tok = real_tokenizer(name)
    rows = tool_conversations(16, tools_as_json=tools_as_json)
    # the loss on the answers, the tool-call turn among them (TRL's default for messages: every token)
    report = run(tok, rows, model=tiny_model_for(tok, SMALL), max_len=512, sample=8, loss_on="completion")
    assert [f"{f.rule}: {f.message}" for f in report.findings if f.severity != "info"] == []
    tools = json.loads(rows[0]["tools"]) if tools_as_json else rows[0]["tools"]
    trl_tokens = [
        tok.apply_chat_template(r["messages"], tools=tools, return_dict=True)["input_ids"] for r in rows
    ]
    assert report.stats["tokens"] == sum(map(len, trl_tokens))  # every row as long as TRL makes it


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_truncation_of_tool_call_conversations_counts_the_tools(name):
    """The tool schema takes tokens too: a max_len that fits the messages alone cuts what TRL trains on."""
    tok = real_tokenizer(name)
    rows = tool_conversations(16)
    full = len(
        tok.apply_chat_template(rows[0]["messages"], tools=rows[0]["tools"], return_dict=True)["input_ids"]
    )
    bare = len(tok.apply_chat_template(rows[0]["messages"], return_dict=True)["input_ids"])
    max_len = (full + bare) // 2
    assert bare < max_len < full
    (finding,) = run(tok, rows, max_len=max_len, select="truncated-completion").findings
    assert finding.evidence["cut"] == len(rows)


def test_tool_call_turns_are_supervised_and_tools_reach_the_template():
    tok = real_tokenizer("qwen2.5-instruct")
    rows = tool_conversations(4)
    ctx = Context(
        tokenizer=tok,
        dataset=datasets.Dataset.from_list(rows),
        options=EncodeOptions(fmt="messages", loss_on="assistant"),
    )
    row = ctx.row(0)
    text = tok.decode(row["input_ids"])
    assert '"name": "get_weather"' in text.split("<|im_start|>user")[0]  # the schema, in the system turn
    supervised = tok.decode([i for i in row["labels"] if i != IGNORE_INDEX])
    assert "<tool_call>" in supervised and '"city": "Paris"' in supervised  # the call is a completion
    assert "celsius" not in supervised.split("</tool_call>")[0]  # the tool's result is not


@pytest.mark.slow
def test_sft_trainer_and_the_cli_agree_on_tool_call_data(tmp_path):
    from trl import SFTConfig, SFTTrainer

    from helpers import cli

    tok = real_tokenizer("qwen2.5-instruct")
    rows = tool_conversations(16, tools_as_json=True)
    model = tiny_model_for(tok, SMALL)
    # assistant_only_loss needs a template with {% generation %}: TRL's training twin of Qwen2.5's.
    config = SFTConfig(output_dir=str(tmp_path / "out"), max_length=512, per_device_train_batch_size=4,
                       report_to=[], use_cpu=True, assistant_only_loss=True,
                       chat_template_path=str(TRL_TEMPLATES / "qwen2_5_training.jinja"))  # fmt: skip
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok
    )
    from hf_sanity.drivers.preflight import preflight

    with_trainer = preflight(trainer=trainer, use_config=False)
    assert [f.rule for f in with_trainer.findings if f.severity != "info"] == []
    data = tmp_path / "tools.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    # the trainer's assistant_only_loss, said to the CLI (its default is TRL's for messages rows: every token)
    result = cli("preflight", "--model", folder, "--dataset", data, "--max-len", 512, "--loss-on", "completion",
                 "--json", tmp_path / "r.json", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert [f["rule"] for f in report["findings"] if f["severity"] != "info"] == []
    assert report["stats"]["tokens"] == sum(
        len(trainer.train_dataset[i]["input_ids"]) for i in range(len(rows))
    )
