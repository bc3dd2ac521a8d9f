"""`hf-sanity served` / `hf_sanity.served`: the served model against base + trained adapter, and adapter-empty."""

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers import cli
from hf_sanity.drivers.served import served
from hf_sanity.testing import tiny_setup


def train_adapter(model, tok, folder, **lora):
    """A LoRA adapter with every trained tensor moved off its initial value (a stand-in for training)."""
    peft_model = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **lora)
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for param in peft_model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.5)
    peft_model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return peft_model


def merged_copy(peft_model, folder, tok):
    merged = copy.deepcopy(peft_model).merge_and_unload()
    merged.save_pretrained(folder)
    tok.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A base folder, a trained adapter of it, and the correctly merged model, all on disk."""
    root = tmp_path_factory.mktemp("served")
    model, tok = tiny_setup("chatml")
    model.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    model = AutoModelForCausalLM.from_pretrained(
        root / "base"
    )  # the adapter names the base it was trained on
    peft_model = train_adapter(model, tok, root / "adapter")
    merged_copy(peft_model, root / "merged", tok)
    return root, model, tok


def rules_of(report):
    return {f.rule: f for f in report.findings if f.severity != "info"}


@pytest.mark.slow  # a subprocess
@pytest.mark.clean("adapter-not-loaded", "served-model-differs", "adapter-empty")
def test_the_merged_model_reloaded_is_what_was_trained(setup):
    root, _, _ = setup
    result = cli("served", "--model", str(root / "merged"), "--base", str(root / "base"),
                 "--adapter", str(root / "adapter"), "--json", str(root / "clean.json"))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((root / "clean.json").read_text())
    assert report["findings"] == [] and report["stats"]["max_logit_gap"] < 1e-4
    assert report["stats"]["embedding_rows_compared"] == 1000


@pytest.mark.slow  # a subprocess
@pytest.mark.planted("adapter-not-loaded")
def test_serving_the_base_checkpoint(setup):
    root, _, _ = setup
    result = cli("served", "--model", str(root / "base"), "--base", str(root / "base"),
                 "--adapter", str(root / "adapter"), "--json", str(root / "base.json"))  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    (finding,) = [
        f for f in json.loads((root / "base.json").read_text())["findings"] if f["severity"] != "info"
    ]
    assert finding["rule"] == "adapter-not-loaded" and finding["evidence"]["cause"] == "served-base"


@pytest.mark.planted("served-model-differs")
def test_added_token_rows_lost_at_merge(tmp_path):
    """A token added for training, its embedding row trained (modules_to_save): the served model has the row
    the resize gave it, not the trained one."""
    model, tok = tiny_setup("chatml")
    tok.add_tokens(["<|tool_call|>"])
    model = copy.deepcopy(model)
    model.resize_token_embeddings(len(tok))
    peft_model = train_adapter(model, tok, tmp_path / "adapter", modules_to_save=["embed_tokens"])
    good = merged_copy(peft_model, tmp_path / "merged", tok)
    assert served(good, base=copy.deepcopy(model), adapter=tmp_path / "adapter", tokenizer=tok).findings == []
    lost = copy.deepcopy(good)
    with torch.no_grad():  # the new row as the resize initialised it: the trained row never reached the merge
        lost.get_input_embeddings().weight[-1] = model.get_input_embeddings().weight[-1]
    report = served(lost, base=copy.deepcopy(model), adapter=tmp_path / "adapter", tokenizer=tok)
    finding = rules_of(report)["served-model-differs"]
    assert finding.evidence["cause"] == "added-token-rows" and finding.evidence["token_ids"] == [len(tok) - 1]
    assert "<|tool_call|>" in finding.message and "modules_to_save" in finding.fix


@pytest.mark.slow  # a subprocess
def test_the_cli_resizes_the_base_to_an_adapter_that_trained_added_tokens(tmp_path):
    model, tok = tiny_setup("chatml")
    model.save_pretrained(tmp_path / "base")
    tok.add_tokens(["<|tool_call|>"])
    resized = copy.deepcopy(model)
    resized.resize_token_embeddings(len(tok))
    peft_model = train_adapter(resized, tok, tmp_path / "adapter", modules_to_save=["embed_tokens"])
    merged_copy(peft_model, tmp_path / "merged", tok)
    result = cli("served", "--model", str(tmp_path / "merged"), "--base", str(tmp_path / "base"),
                 "--adapter", str(tmp_path / "adapter"))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.planted("served-model-differs")
def test_a_head_served_other_than_trained(setup):
    root, model, tok = setup
    good = AutoModelForCausalLM.from_pretrained(root / "merged")
    bad = copy.deepcopy(good)
    with torch.no_grad():
        bad.lm_head.weight.add_(torch.randn_like(bad.lm_head.weight) * 0.1)
    report = served(bad, base=copy.deepcopy(model), adapter=root / "adapter", tokenizer=tok)
    finding = rules_of(report)["served-model-differs"]
    assert finding.evidence["cause"] == "lm-head" and "head" in finding.fix


@pytest.mark.clean("served-model-differs", "adapter-not-loaded")
def test_a_bf16_merge_is_within_rounding(setup):
    root, model, tok = setup
    base16 = copy.deepcopy(model).to(torch.bfloat16)
    merged16 = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.bfloat16)
    report = served(merged16, base=base16, adapter=root / "adapter", tokenizer=tok)
    assert rules_of(report) == {}, [f.message for f in report.findings]


@pytest.mark.slow  # a subprocess
@pytest.mark.planted("adapter-empty")
def test_an_adapter_saved_from_zero3_partitions(setup, tmp_path):
    """Under ZeRO-3, saving without gathering writes each parameter as a tensor with no elements: the adapter
    file is a few hundred bytes and loads into nothing."""
    root, model, tok = setup
    folder = tmp_path / "zero3"
    folder.mkdir()
    (folder / "adapter_config.json").write_text((root / "adapter" / "adapter_config.json").read_text())
    state = load_file(root / "adapter" / "adapter_model.safetensors")
    save_file({k: torch.empty(0) for k in state}, folder / "adapter_model.safetensors")
    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
        )
        + "\n"
    )
    result = cli("preflight", "--model", str(root / "base"), "--dataset", str(data), "--adapter", str(folder),
                 "--json", str(tmp_path / "r.json"), "--select", "model")  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    found = {
        f["rule"]: f
        for f in json.loads((tmp_path / "r.json").read_text())["findings"]
        if f["severity"] != "info"
    }
    assert set(found) == {"adapter-empty"}  # the rules that read the tensors wait for this one
    assert found["adapter-empty"]["evidence"]["cause"] == "saved-partitioned"
    assert found["adapter-empty"]["evidence"]["empty_count"] == len(state)
    rank = served(copy.deepcopy(model), base=copy.deepcopy(model), adapter=folder, tokenizer=tok)
    assert "adapter-empty" in rules_of(rank)


def test_an_adapter_config_whose_rank_is_not_the_tensors(setup, tmp_path):
    root, model, tok = setup
    folder = tmp_path / "edited"
    folder.mkdir()
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    (folder / "adapter_model.safetensors").write_bytes(
        (root / "adapter" / "adapter_model.safetensors").read_bytes()
    )
    report = served(copy.deepcopy(model), base=copy.deepcopy(model), adapter=folder, tokenizer=tok,
                    select="adapter-empty")  # fmt: skip
    finding = rules_of(report)["adapter-empty"]
    assert finding.evidence["cause"] == "rank-mismatch" and finding.evidence["wrong_rank"][0]["r"] == 8


@pytest.mark.slow  # a subprocess
def test_served_bad_input_is_one_line(setup, tmp_path):
    root, _, _ = setup
    result = cli("served", "--model", str(root / "merged"), "--base", str(root / "base"),
                 "--adapter", str(tmp_path / "nope"))  # fmt: skip
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "not a folder" in result.stderr
