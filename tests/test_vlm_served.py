"""`processor-not-saved` beyond train end: at each checkpoint the Trainer saves (SanityCallback.on_save), and on
the folder `hf-sanity outputs` / `hf-sanity served` load a vision-language model from, run as a user runs them
(a fresh process) on a tiny LLaVA saved the way a merge script saves it."""

from __future__ import annotations

import json

import pytest

from hf_sanity.testing import vlm
from tests.conftest import REAL_TOKENIZERS
from tests.helpers import cli
from tests.test_vlm import checkpointed_run

pytestmark = pytest.mark.skipif(
    not (REAL_TOKENIZERS / "qwen2.5-instruct").is_dir(),
    reason="needs ../shared/real-tokenizers/qwen2.5-instruct",
)

IMAGE_PROCESSOR = "the image processor's config (preprocessor_config.json)"


def rules(report) -> set[str]:
    return {f["rule"] if isinstance(f, dict) else f.rule for f in report["findings"]}


def found(report) -> list[dict]:
    assert "internal-error" not in rules(report), report["findings"]
    return [f for f in report["findings"] if f["rule"] == "processor-not-saved"]


def save_folder(folder, *, model=None, saves: str) -> str:
    """The tiny LLaVA (or ``model``) saved to ``folder`` with ``saves``: "tokenizer" (the tokenizer alone, as a
    merge script that only had it saves), "processor" (the whole processor), "processor-no-template" (the
    processor without its chat template)."""
    base, processor = vlm.load_tiny_llava()
    (model or base).save_pretrained(folder)
    if saves == "tokenizer":
        processor.tokenizer.save_pretrained(folder)
    else:
        processor.save_pretrained(folder)
    if saves == "processor-no-template":
        for path in folder.glob("chat_template.*"):
            path.unlink()
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def prompts(folder) -> str:
    path = folder / "prompts.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
        for q, a in zip(vlm.QUESTIONS, vlm.ANSWERS, strict=False)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def outputs(tmp_path, model_folder, *options):
    out = tmp_path / "outputs.json"
    proc = cli(
        "outputs", "--model", model_folder, "--dataset", prompts(tmp_path), "--n", "2", "--max-new-tokens", "4",
        *options, "--json", out,
    )  # fmt: skip
    assert out.is_file(), proc.stderr
    return json.loads(out.read_text())


# -- outputs ---------------------------------------------------------------------------------------------------
@pytest.mark.slow  # a subprocess
@pytest.mark.planted("processor-not-saved")
@pytest.mark.parametrize(
    "saves, missing",
    [("tokenizer", [IMAGE_PROCESSOR]), ("processor-no-template", ["the chat template"])],
)
def test_outputs_on_a_vlm_folder_without_its_processor_says_so(tmp_path, saves, missing):
    folder = save_folder(tmp_path / "merged", saves=saves)
    (finding,) = found(outputs(tmp_path, folder, "--inference-tokenizer", vlm.tiny_llava_dir()))
    assert finding["severity"] == "error"
    assert finding["evidence"]["cause"] == "not-saved"
    assert finding["evidence"]["folder"] == folder
    assert finding["evidence"]["missing"] == missing
    assert "save_pretrained" in finding["fix"]


@pytest.mark.slow  # a subprocess
@pytest.mark.clean("processor-not-saved")
def test_outputs_on_a_vlm_folder_with_its_processor_is_silent(tmp_path):
    report = outputs(tmp_path, save_folder(tmp_path / "merged", saves="processor"))
    assert found(report) == []
    assert (
        report["stats"]["prompts"] == 2 and report["stats"]["generated_tokens"] > 0
    )  # it loaded and generated


# -- served ----------------------------------------------------------------------------------------------------
def merged_and_adapter(tmp_path, saves: str) -> tuple[str, str]:
    """A LoRA on the language model of the tiny LLaVA (non-zero, as after training), saved; the model merged
    with it and saved as a merge script does, with ``saves`` beside it."""
    from peft import LoraConfig, get_peft_model

    model, _ = vlm.load_tiny_llava()
    lora = LoraConfig(
        r=4, target_modules=r"model\.language_model\..*\.(q_proj|v_proj)", init_lora_weights=False
    )
    peft_model = get_peft_model(model, lora)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = save_folder(tmp_path / "merged", model=peft_model.merge_and_unload(), saves=saves)
    return merged, str(tmp_path / "adapter")


def served(tmp_path, saves: str):
    merged, adapter = merged_and_adapter(tmp_path, saves)
    out = tmp_path / "served.json"
    proc = cli(
        "served", "--model", merged, "--base", vlm.tiny_llava_dir(), "--adapter", adapter, "--json", out
    )
    assert out.is_file(), proc.stderr
    return merged, json.loads(out.read_text())


@pytest.mark.slow  # a subprocess
@pytest.mark.planted("processor-not-saved")
def test_served_on_a_merged_vlm_saved_with_the_tokenizer_alone(tmp_path):
    merged, report = served(tmp_path, "tokenizer")
    (finding,) = found(report)
    assert finding["evidence"]["folder"] == merged
    assert finding["evidence"]["missing"] == [IMAGE_PROCESSOR]
    assert "served-model-differs" not in rules(report)  # the merge itself is right


@pytest.mark.slow  # a subprocess
@pytest.mark.clean("processor-not-saved", "served-model-differs")
def test_served_on_a_merged_vlm_saved_with_its_processor_is_silent(tmp_path):
    _, report = served(tmp_path, "processor")
    assert found(report) == []
    assert [f["rule"] for f in report["findings"] if f["severity"] != "info"] == []


# -- each checkpoint -------------------------------------------------------------------------------------------
@pytest.mark.slow  # a VLM Trainer run; test_vlm.py's checkpoint tests are the fast lane's
@pytest.mark.planted("processor-not-saved")
def test_the_first_checkpoint_without_the_image_processor_is_reported_when_it_is_saved(tmp_path):
    report, _ = checkpointed_run(tmp_path, lambda processor: processor.tokenizer, save_steps=1)
    (finding,) = [f for f in report.findings if f.rule == "processor-not-saved"]
    assert finding.step == 1  # read at on_save of checkpoint-1, not at train end (step 2)
    assert finding.evidence["folder"] == str(tmp_path / "checkpoint-1")
    assert finding.evidence["cause"] == "tokenizer-only"


# -- image-settings-drift --------------------------------------------------------------------------------------
def idefics3_folders(tmp_path, **serving_settings) -> tuple[str, str]:
    """The tiny Idefics3 saved with its training processor (pictures split into 32x32 tiles, longest edge 64),
    and a serving processor's folder: the same processor with ``serving_settings`` on its image processor."""
    from helpers import load_tiny_idefics3

    model, processor = load_tiny_idefics3()  # skipped where transformers needs torchvision for it (5.6, 5.16)
    trained = tmp_path / "trained"
    model.save_pretrained(trained)
    processor.save_pretrained(trained)
    for name, value in serving_settings.items():
        setattr(processor.image_processor, name, value)
    processor.save_pretrained(tmp_path / "serving")
    return str(trained), str(tmp_path / "serving")


def drift(report) -> list[dict]:
    assert "internal-error" not in rules(report), report["findings"]
    return [f for f in report["findings"] if f["rule"] == "image-settings-drift"]


@pytest.mark.slow  # a subprocess
@pytest.mark.planted("image-settings-drift")
@pytest.mark.parametrize(
    "serving, cause, tokens",
    [
        ({"do_image_splitting": False}, "do_image_splitting", {"training": 20, "serving": 4}),
        ({"size": {"longest_edge": 128}}, "size", {"training": 20, "serving": 68}),
    ],
)
def test_a_server_that_splits_or_resizes_pictures_otherwise_sees_other_tokens(
    tmp_path, serving, cause, tokens
):
    trained, serving_folder = idefics3_folders(tmp_path, **serving)
    (finding,) = drift(outputs(tmp_path, trained, "--inference-tokenizer", serving_folder))
    assert finding["severity"] == "warning"
    evidence = finding["evidence"]
    assert evidence["cause"] == cause
    # 512x512: resized to the longest edge, cut into 32x32 tiles of 4 tokens, and a global image
    assert evidence["tokens_per_image"] == tokens
    assert evidence["reference"] == "512x512"
    assert list(evidence["differing"]) == [cause]
    assert evidence["differing"][cause]["serving"] == serving[cause]
    assert trained in finding["fix"]


@pytest.mark.slow  # a subprocess
@pytest.mark.clean("image-settings-drift")
def test_a_server_with_the_training_image_settings_is_silent(tmp_path):
    trained, serving_folder = idefics3_folders(tmp_path, image_mean=[0.5, 0.5, 0.5])  # no token count changes
    report = outputs(tmp_path, trained, "--inference-tokenizer", serving_folder)
    assert drift(report) == []
    assert found(report) == []


@pytest.mark.planted("image-settings-drift")
def test_outputs_given_the_serving_processor_object(tmp_path):
    import datasets
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from hf_sanity import outputs as run_outputs

    trained, serving_folder = idefics3_folders(tmp_path, do_image_splitting=False)
    model = AutoModelForImageTextToText.from_pretrained(trained)
    processor = AutoProcessor.from_pretrained(trained)
    serving = AutoProcessor.from_pretrained(serving_folder)
    data = datasets.Dataset.from_json(prompts(tmp_path))
    report = run_outputs(model, processor.tokenizer, data, n=2, max_new_tokens=4, processor=serving)
    (finding,) = [f for f in report.findings if f.rule == "image-settings-drift"]
    assert finding.evidence["cause"] == "do_image_splitting"
    assert list(finding.evidence["differing"]) == ["do_image_splitting"]  # as saved: nothing else differs
    # the training processor itself as the serving one: nothing differs
    same = run_outputs(model, processor.tokenizer, data, n=2, max_new_tokens=4, processor=processor)
    assert not [f for f in same.findings if f.rule in ("image-settings-drift", "internal-error")]
