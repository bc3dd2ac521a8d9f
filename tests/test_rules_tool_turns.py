"""Tool results carry no loss: `prompt-in-loss` made tool-aware (cause `tool-turns-trained`), through TRL's
SFTTrainer with `assistant_only_loss=True` on Qwen2.5's real tokenizer: TRL's training template leaves the `tool`
turns outside its `{% generation %}` markers (clean); a hand-edited template that wraps them too trains the model
to write what the tools return (planted)."""

from __future__ import annotations

import copy
import warnings

import datasets
import pytest
import trl_setups as setups

from conftest import real_tokenizer
from helpers import run
from hf_sanity.drivers.preflight import preflight
from hf_sanity.testing import TinyConfig, tiny_model_for, tool_conversations

pytestmark = pytest.mark.slow  # a real vocabulary of 152k tokens
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
    """What ``measure.agents.tool_turns_trained`` returned each time the rule called it."""
    from hf_sanity.measure import agents

    calls = []
    real = agents.tool_turns_trained

    def recording(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(agents, "tool_turns_trained", recording)
    return calls


def tool_turns_in_generation(tok):
    """A copy of ``tok`` whose template is TRL's Qwen2.5 training template with the `tool` branch inside
    `{% generation %}` too, as a template hand-written to 'train the agent's side' marks it."""
    planted = (
        setups.trl_template("qwen2_5_training")
        .replace(
            '{%- elif message.role == "tool" %}\n',
            '{%- elif message.role == "tool" %}\n        {%- generation %}\n',
        )
        .replace(
            "        {%- endif %}\n    {%- endif %}\n{%- endfor %}",
            "        {%- endif %}\n        {%- endgeneration %}\n    {%- endif %}\n{%- endfor %}",
        )
    )
    assert planted.count("{%- generation %}") == 2 and planted.count("{%- endgeneration %}") == 2
    copied = copy.deepcopy(tok)
    copied.chat_template = planted
    return copied


def sft(model, tok, rows, tmp_path):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_length=None,
                     per_device_train_batch_size=4, dataset_num_proc=None, assistant_only_loss=True)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SFTTrainer(
            model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok
        )


@pytest.mark.planted("prompt-in-loss")
def test_tool_results_inside_the_generation_markers_are_trained(qwen, qwen_model, tmp_path):
    trainer = sft(qwen_model, tool_turns_in_generation(qwen), tool_conversations(8), tmp_path)
    report = preflight(trainer=trainer, select="prompt-in-loss", use_config=False)
    (finding,) = report.findings
    assert finding.evidence["cause"] == "tool-turns-trained" and finding.severity == "error"
    tools = finding.evidence["tool_turns"]
    assert tools["rows_measured"] == 8 and tools["tool_tokens_supervised"] == tools["tool_tokens"] > 0
    assert "tool results" in finding.message and "assistant_only_loss=True" in finding.message
    assert "-100" in finding.fix


@pytest.mark.clean("prompt-in-loss")
def test_trls_training_template_keeps_tool_results_out_of_the_loss(qwen, qwen_model, tmp_path, measured):
    trainer = sft(qwen_model, qwen, tool_conversations(8), tmp_path)
    report = preflight(trainer=trainer, select="prompt-in-loss", use_config=False)
    assert report.findings == []
    (tools,) = measured  # the check located every tool result, and none carries loss
    assert tools["rows_measured"] == 8 and tools["tool_tokens"] > 0 and tools["tool_tokens_supervised"] == 0


@pytest.mark.clean("prompt-in-loss")
def test_loss_on_assistant_masks_tool_results_in_preflight_on_rows(qwen, qwen_model, measured):
    report = run(qwen, tool_conversations(8), model=qwen_model, select="prompt-in-loss", loss_on="assistant")
    assert report.findings == []
    (tools,) = measured
    assert tools["rows_measured"] == 8 and tools["tool_tokens"] > 0 and tools["tool_tokens_supervised"] == 0
