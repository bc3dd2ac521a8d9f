"""`hf-sanity outputs` as a user runs it: exit codes, the report in the terminal, JSON and HTML, one-line
errors for bad input. The models are the cached fine-tuned fixtures of `hf_sanity.testing.trained`."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import assert_one_line_error, cli
from hf_sanity.testing import (
    as_prompt_completion,
    held_out_conversations,
    tiny_model_dir,
    trained_adapter_dir,
    trained_model_dir,
)

pytestmark = pytest.mark.slow  # subprocesses: `make test-fast` leaves them out


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "held_out.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in held_out_conversations(16)) + "\n")
    return str(path)


def test_a_clean_model_exits_0(held_out):
    result = cli("outputs", "--model", trained_model_dir("clean"), "--dataset", held_out, "--n", "16")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hf-sanity outputs: no findings" in result.stdout
    assert "prompts=16" in result.stdout and "stopped=16" in result.stdout


def test_a_model_that_never_stops_exits_1_with_the_side_by_side_in_every_format(held_out, tmp_path):
    out, page = tmp_path / "outputs.json", tmp_path / "outputs.html"
    result = cli(
        "outputs", "--model", trained_model_dir("eos-masked"), "--dataset", held_out, "--max-new-tokens", "64",
        "--select", "never-stops", "--json", out, "--html", page,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "error   never-stops" in result.stdout and "eos-not-learned" in result.stdout
    for column in ("prompt", "generation", "reference"):
        assert column in result.stdout
    (finding,) = json.loads(out.read_text())["findings"]
    assert finding["rule"] == "never-stops" and finding["evidence"]["never_stopped"] == 16
    first = finding["side_by_side"][0]
    assert set(first) == {"row", "prompt", "generation", "reference", "note"}
    assert "max_new_tokens reached" in first["note"]
    assert '<table class="sidebyside"' in page.read_text()


@pytest.mark.planted("never-stops")
@pytest.mark.parametrize("variant", ["eos-masked", "pad-eos"])
def test_a_model_served_with_its_own_template_that_never_stops_did_not_learn_its_end_of_turn(
    held_out, tmp_path, variant
):
    """The classic pad == EOS bug, trained and served with the same template: a model that runs on into its
    own next turn (`pad-eos` writes `<|im_start|>user ...`) is eos-not-learned, and the fix does not tell the
    user to stop on `<|im_start|>` (which would hide the bug)."""
    out = tmp_path / "outputs.json"
    result = cli(
        "outputs", "--model", trained_model_dir(variant), "--dataset", held_out, "--max-new-tokens", "64",
        "--select", "never-stops", "--json", out,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    (finding,) = json.loads(out.read_text())["findings"]
    assert finding["evidence"]["cause"] == "eos-not-learned"
    assert "eos_token_id" not in finding["fix"] and "eos-not-learned" in finding["fix"]
    if variant == "pad-eos":  # it writes its own template's turn-start marker in most generations
        assert finding["evidence"]["markers_written"]["<|im_start|>"] >= 8
        assert "runs on into the next turn" in finding["message"]


def test_stray_markers_of_a_model_saved_with_another_tokenizer(held_out, tmp_path):
    out = tmp_path / "outputs.json"
    result = cli(
        "outputs", "--model", trained_model_dir("wrong-template"), "--dataset", held_out,
        "--max-new-tokens", "48", "--select", "outputs", "--json", out,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "stray-markers-in-output" in result.stdout and "<|im_end|>" in result.stdout
    # It writes the end of turn of the template it was trained with (ChatML), not of the served one (Llama-3).
    never = next(f for f in json.loads(out.read_text())["findings"] if f["rule"] == "never-stops")
    assert never["evidence"]["cause"] == "template-mismatch" and "'<|im_end|>'" in never["fix"]
    # Rendered with the tokenizer it was trained with, it answers and ends its turns; but the folder's
    # generation_config.json stops on <|eot_id|> only, and generate does not read the tokenizer: stop-token-mismatch.
    own = cli(
        "outputs", "--model", trained_model_dir("wrong-template"), "--dataset", held_out,
        "--inference-tokenizer", trained_model_dir("clean"), "--max-new-tokens", "48", "--json", out,
    )  # fmt: skip
    assert own.returncode == 1, own.stdout + own.stderr
    (stop,) = json.loads(out.read_text())["findings"]
    assert stop["rule"] == "stop-token-mismatch" and stop["evidence"]["ended_on_end_of_turn"] == 16
    # With a generation config that stops on it too, the same weights are clean.
    fixed = tmp_path / "fixed"
    shutil.copytree(trained_model_dir("wrong-template"), fixed)
    config = json.loads((fixed / "generation_config.json").read_text())
    # <|eot_id|>, as the Llama-3 folder ships it
    assert config["eos_token_id"] == stop["evidence"]["stop_ids"][0]
    config["eos_token_id"] = [config["eos_token_id"], stop["evidence"]["end_of_turn_id"]]
    (fixed / "generation_config.json").write_text(json.dumps(config))
    clean = cli(
        "outputs", "--model", fixed, "--dataset", held_out, "--inference-tokenizer", trained_model_dir("clean"),
        "--max-new-tokens", "48",
    )  # fmt: skip
    assert clean.returncode == 0, clean.stdout + clean.stderr


def test_an_adapter_compared_with_its_base(held_out):
    base, adapter = trained_model_dir("clean"), trained_adapter_dir()
    applied = cli("outputs", "--model", base, "--adapter", adapter, "--base", base, "--dataset", held_out)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "base_generation_seconds" in applied.stdout
    # The "fine-tuned" folder is the base itself: the adapter was never loaded into it.
    missing = cli("outputs", "--model", base, "--base", base, "--dataset", held_out)
    assert missing.returncode == 1, missing.stdout + missing.stderr
    assert "adapter-no-effect" in missing.stdout and "identical" in missing.stdout


def test_bad_input_is_one_line_and_exit_2(held_out, tmp_path):
    model = trained_model_dir("clean")
    assert_one_line_error(
        cli("outputs", "--model", model, "--dataset", held_out, "--n", "0"), "--n must be a positive integer"
    )
    prose = tmp_path / "prose.jsonl"
    prose.write_text(json.dumps({"text": "Just some prose."}) + "\n")
    assert_one_line_error(cli("outputs", "--model", model, "--dataset", prose), "has no prompts")
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"messages": [{"role": "assistant", "content": "Hi"}]}) + "\n")
    assert_one_line_error(cli("outputs", "--model", model, "--dataset", answers), "has no prompts")
    no_template = str(tiny_model_dir("base", "distinct"))
    assert_one_line_error(cli("outputs", "--model", no_template, "--dataset", held_out), "no chat template")
    assert_one_line_error(
        cli("outputs", "--model", model, "--dataset", held_out, "--adapter", tmp_path / "nope"),
        "not a folder",
    )
    # A base model with plain-text prompts needs no template.
    text = tmp_path / "text_prompts.jsonl"
    text.write_text("\n".join(json.dumps(r) for r in as_prompt_completion(held_out_conversations(4))) + "\n")
    result = cli("outputs", "--model", no_template, "--dataset", text, "--max-new-tokens", "8", "--select",
                 "stray-markers-in-output")  # fmt: skip
    assert result.returncode in (0, 1) and "prompts=4" in result.stdout, result.stdout + result.stderr
