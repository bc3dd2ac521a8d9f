"""Prompt-only data (TRL's "prompt-only" type: what GRPOTrainer and RLOOTrainer train on) through the CLI, as a
user with a GRPO prompts file runs `hf-sanity preflight --model M --dataset prompts.jsonl`."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import trl_setups as setups
from test_rules_agents import multi_turn_thinking

from conftest import real_tokenizer
from helpers import cli
from hf_sanity.testing import demo_conversations, tiny_model_for

pytestmark = pytest.mark.slow  # subprocesses: `make test-fast` leaves them out


@pytest.fixture(scope="module")
def qwen():
    return real_tokenizer("qwen2.5-instruct")


def model_folder(tmp_path, tok):
    folder = tmp_path / "model"
    tiny_model_for(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def write_prompts(tmp_path, rows) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def preflight_cli(tmp_path, folder, data, *args):
    result = cli("preflight", "--model", folder, "--dataset", data, "--json", tmp_path / "r.json", *args,
                 cwd=tmp_path)  # fmt: skip
    return result, json.loads((tmp_path / "r.json").read_text()) if (tmp_path / "r.json").exists() else None


@pytest.mark.clean("template-not-prefix-preserving")
@pytest.mark.parametrize("conversational", [True, False])
def test_a_clean_prompt_only_file_is_read_as_rl_and_silent(qwen, tmp_path, conversational):
    if conversational:
        rows = [
            {"prompt": [m for m in r["messages"] if m["role"] != "assistant"]} for r in demo_conversations(12)
        ]
    else:
        rows = [{"prompt": f"Question {i}: what is {i} + {i}? Answer:"} for i in range(12)]
    result, report = preflight_cli(tmp_path, model_folder(tmp_path, qwen), write_prompts(tmp_path, rows))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cannot tell the dataset format" not in result.stderr
    assert report["findings"] == []
    stats = report["stats"]
    assert stats["objective"] == "rl" and stats["format"] == "prompt-only" and stats["prompts"] == 12
    assert stats["examples"] == 12 and stats["tokens"] > 12 * 5  # every prompt rendered and read
    assert "loss_mask" not in stats  # no SFT loss mask: the model writes the completions
    assert any("RL prompts" in note and "objective rl" in note for note in report["notes"])
    assert "RL prompts" in result.stdout  # the note is said to the user, not only written to the JSON


@pytest.mark.planted("template-not-prefix-preserving")
def test_multi_turn_prompts_over_a_template_that_strips_past_thinking(qwen, tmp_path):
    """Qwen3's template drops the thinking of past turns: a tool loop re-rendering these prompts scores tokens
    that were never sampled (an error for RL), caught from the file alone."""
    tok = copy.deepcopy(qwen)
    tok.chat_template = setups.trl_template("qwen3")
    rows = [{"prompt": r["messages"][:3]} for r in multi_turn_thinking(8)]
    result, report = preflight_cli(tmp_path, model_folder(tmp_path, tok), write_prompts(tmp_path, rows))
    assert result.returncode == 1, result.stdout + result.stderr
    (finding,) = report["findings"]
    assert finding["rule"] == "template-not-prefix-preserving" and finding["severity"] == "error"
    assert finding["evidence"]["cause"] == "past-turns-rerendered"
    assert finding["evidence"]["rows_broken"] == finding["evidence"]["checked"] == 8
    assert report["stats"]["objective"] == "rl"
