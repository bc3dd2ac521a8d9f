"""Adapter rules on saved LoRA adapters of the tiny model."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from helpers import run, slugs
from hf_sanity.errors import UserInputError
from hf_sanity.testing import TinyConfig, tiny_setup

ADAPTER_RULES = ["adapter-untrained", "adapter-base-mismatch", "adapter-not-loaded"]


def save_adapter(base, folder, *, trained=True):
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    if trained:  # stand-in for training: give every B matrix a value
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base():
    return tiny_setup("chatml", "distinct")


@pytest.mark.clean("adapter-untrained", "adapter-base-mismatch", "adapter-not-loaded")
def test_trained_adapter_on_its_base_is_silent(base, conversations, tmp_path):
    model, tok = base
    adapter = save_adapter(model, tmp_path / "lora")
    assert (
        run(
            tok, conversations[:8], model=copy.deepcopy(model), adapter=str(adapter), select=ADAPTER_RULES
        ).findings
        == []
    )


@pytest.mark.planted("adapter-untrained")
def test_untrained_adapter(base, conversations, tmp_path):
    model, tok = base
    adapter = save_adapter(model, tmp_path / "lora", trained=False)
    report = run(
        tok, conversations[:8], model=copy.deepcopy(model), adapter=str(adapter), select=ADAPTER_RULES
    )
    assert slugs(report) == {"adapter-untrained"}
    assert report.findings[0].evidence["lora_B_tensors"] == 4  # q and v in two layers


@pytest.mark.planted("adapter-base-mismatch")
def test_adapter_on_another_base(base, conversations, tmp_path):
    model, tok = base
    adapter = save_adapter(model, tmp_path / "lora")
    other, _ = tiny_setup("chatml", "distinct", TinyConfig(hidden_size=32, intermediate_size=64))
    (finding,) = run(
        tok, conversations[:8], model=other, adapter=str(adapter), select="adapter-base-mismatch"
    ).findings
    assert finding.severity == "error"
    assert (
        finding.evidence["mismatches"][0]["adapter_in"] == 64
        and finding.evidence["mismatches"][0]["model_in"] == 32
    )
    # adapter-not-loaded would load the adapter into modules of the wrong shape: it is skipped, not crashed.
    report = run(tok, conversations[:8], model=other, adapter=str(adapter), select=ADAPTER_RULES)
    assert {f.rule for f in report.findings} == {"adapter-base-mismatch", "checks-skipped"}
    assert report.by_rule("checks-skipped")[0].evidence["skipped"] == ["adapter-not-loaded"]
    # So would the checks that run the model with the adapter attached.
    report = run(
        tok,
        conversations[:8],
        model=other,
        adapter=str(adapter),
        select=["init-loss-off-chance", "input-ignored"],
    )
    (skipped,) = report.findings
    assert skipped.evidence == {
        "skipped": ["init-loss-off-chance", "input-ignored"],
        "needs": "adapter-base-mismatch",
    }


@pytest.mark.planted("adapter-not-loaded")
def test_adapter_whose_targets_match_nothing(base, conversations, tmp_path):
    model, tok = base
    adapter = save_adapter(model, tmp_path / "lora")
    state = load_file(str(adapter / "adapter_model.safetensors"))
    save_file(
        {k.replace("self_attn", "attention"): v for k, v in state.items()},
        str(adapter / "adapter_model.safetensors"),
    )
    (finding,) = run(
        tok, conversations[:8], model=copy.deepcopy(model), adapter=str(adapter), select="adapter-not-loaded"
    ).findings
    assert "none of the adapter's 4 target modules" in finding.message


@pytest.mark.planted("adapter-not-loaded")
def test_attached_adapter_that_is_not_active(base, conversations):
    model, tok = base
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    assert run(tok, conversations[:8], model=peft_model, select="adapter-not-loaded").findings == []
    peft_model.base_model.disable_adapter_layers()  # what a stray `with model.disable_adapter()` leaves behind
    (finding,) = run(tok, conversations[:8], model=peft_model, select="adapter-not-loaded").findings
    assert "not active" in finding.message


def test_adapter_folder_without_weights_is_bad_input(base, conversations, tmp_path):
    model, tok = base
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserInputError, match=r"no adapter_model\.safetensors"):
        run(tok, conversations[:2], model=model, adapter=str(tmp_path / "empty"), select="adapter-untrained")


@pytest.mark.planted("adapter-not-loaded")
def test_served_model_must_compute_what_was_trained(base, conversations, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_sanity.rules.adapter import served_model_findings

    model, tok = base
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    ids = torch.tensor([tok.apply_chat_template(conversations[0]["messages"])["input_ids"]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    merged = copy.deepcopy(peft_model).merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert served_model_findings(peft_model, served, batch, base=model) == []
    # Serving the base checkpoint by mistake (the adapter never merged or loaded):
    (finding,) = served_model_findings(peft_model, copy.deepcopy(model), batch, base=model)
    assert finding.rule == "adapter-not-loaded" and "base model" in finding.message


@pytest.mark.clean("data", "tokens", "template", "model")
def test_a_trained_adapter_passed_for_inspection_raises_nothing_and_leaves_the_model_trainable(
    base, conversations, tmp_path
):
    """--adapter loads the adapter for inspection: there is no training setup, so trainability is not in
    question, and the user's model keeps every requires_grad it had."""
    model, tok = base
    adapter = save_adapter(model, tmp_path / "lora")
    mine = copy.deepcopy(model)
    before = {name: p.requires_grad for name, p in mine.named_parameters()}
    report = run(tok, conversations[:16], model=mine, adapter=str(adapter), max_len=256, loss_on="completion")
    assert [f"{f.rule}: {f.message}" for f in report.findings if f.severity != "info"] == []
    assert {name: p.requires_grad for name, p in mine.named_parameters()} == before
    assert not any("lora" in name for name, _ in mine.named_modules())


@pytest.mark.slow
def test_cli_with_a_trained_adapter_is_clean(base, conversations, tmp_path):
    import json

    from helpers import cli
    from hf_sanity.testing import tiny_model_dir

    model, _ = base
    adapter = save_adapter(model, tmp_path / "lora")
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in conversations[:16]) + "\n")
    result = cli("preflight", "--model", tiny_model_dir("chatml", "distinct"), "--dataset", data,
                 "--adapter", adapter, "--max-len", 256, "--loss-on", "completion", "--json", tmp_path / "r.json",
                 cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Warning" not in result.stderr, result.stderr  # peft's read of a deprecated transformers name
    findings = json.loads((tmp_path / "r.json").read_text())["findings"]
    assert [f["rule"] for f in findings if f["severity"] != "info"] == []


# -- --adapter in the checks that run the model --------------------------------------------------------------
def adapter_rows_file(folder):
    """The rows the fixture adapter was trained on (every answer opens with "Sure."), as JSONL."""
    import json

    from hf_sanity.testing.trained import training_conversations

    path = folder / "sure.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in training_conversations("adapter")[:32]))
    return path


def folder_digest(folder):
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.clean("init-loss-off-chance", "input-ignored", "adapter-not-loaded")
def test_the_step_0_loss_is_measured_with_the_adapter_attached_and_the_model_left_as_it_was(tmp_path):
    """An adapter trained on exactly these rows lowers their step-0 loss: the checks that run the model run it
    with the adapter, and the user's model object and the adapter folder are left as they were."""
    import datasets

    from hf_sanity.drivers.preflight import preflight
    from hf_sanity.testing import trained_adapter_dir, trained_setup

    model, tok = trained_setup("clean")
    adapter = trained_adapter_dir()
    data = datasets.load_dataset("json", data_files=str(adapter_rows_file(tmp_path)), split="train")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modules, digest = [n for n, _ in model.named_modules()], folder_digest(adapter)
    rules = ["init-loss-off-chance", "input-ignored", "adapter-not-loaded"]
    # the adapter and the model were trained on the answers: their step-0 loss is read there
    without = preflight(
        model=model, tokenizer=tok, dataset=data, select=rules, use_config=False, loss_on="completion"
    )
    attached = preflight(model=model, tokenizer=tok, dataset=data, adapter=str(adapter), select=rules,
                         use_config=False, loss_on="completion")  # fmt: skip
    base_loss, adapted = without.stats["step0_loss"], attached.stats["step0_loss"]
    assert adapted["adapter"] == str(adapter) and base_loss["adapter"] is None
    assert adapted["loss"] < 0.5 * base_loss["loss"], (adapted, base_loss)
    assert adapted["top1"] > base_loss["top1"] + 0.3  # "Sure." is what the adapter says first
    assert [f.rule for f in attached.findings] == []  # it fits its own training rows: nothing to say
    assert [n for n, _ in model.named_modules()] == modules and not hasattr(model, "peft_config")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert folder_digest(adapter) == digest


@pytest.mark.slow
@pytest.mark.clean("init-loss-off-chance")
def test_cli_adapter_is_applied_in_the_step_0_loss(tmp_path):
    import json

    from helpers import cli
    from hf_sanity.testing import trained_adapter_dir, trained_model_dir

    model, adapter, data = trained_model_dir("clean"), trained_adapter_dir(), adapter_rows_file(tmp_path)
    digests = folder_digest(model), folder_digest(adapter)
    losses = {}
    for name, extra in (("base", []), ("adapter", ["--adapter", adapter])):
        out = tmp_path / f"{name}.json"
        # the step-0 loss on the answers the adapter was trained on (TRL's default would add the prompts)
        done = cli("preflight", "--model", model, "--dataset", data, "--select", "model", *extra,
                   "--loss-on", "completion", "--json", out)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(out.read_text())
        assert [f["rule"] for f in report["findings"] if f["severity"] != "info"] == []
        losses[name] = report["stats"]["step0_loss"]
    assert losses["adapter"]["adapter"] == str(adapter) and losses["base"]["adapter"] is None
    assert losses["adapter"]["loss"] < 0.5 * losses["base"]["loss"], losses
    assert (folder_digest(model), folder_digest(adapter)) == digests
