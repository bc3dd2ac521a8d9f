"""`hf-sanity preflight --model DIR --dataset rows.jsonl` on vision-language rows: a saved tiny LLaVA folder (its
processor beside it) and rows whose `images` column holds picture paths relative to the data file (or a saved
dataset with TRL's image column), run as a user runs it, in a fresh process."""

from __future__ import annotations

import json

import pytest

from hf_sanity.testing import vlm
from tests.conftest import REAL_TOKENIZERS
from tests.helpers import cli

pytestmark = [
    pytest.mark.skipif(
        not (REAL_TOKENIZERS / "qwen2.5-instruct").is_dir(),
        reason="needs ../shared/real-tokenizers/qwen2.5-instruct",
    ),
    pytest.mark.slow,  # subprocesses (20-45 s each): `make test-fast` leaves them out; tests/test_vlm.py runs in-process
]


def write_rows(folder, *, rows: int = 8, images_in=None, prompt_completion: bool = False) -> str:
    """rows.jsonl in ``folder`` with its pictures as PNG files under pics/, named relative to the file."""
    (folder / "pics").mkdir(parents=True)
    images_in = images_in or {}
    lines = []
    for row in range(rows):
        paths = []
        for k in range(images_in.get(row, 1)):
            paths.append(f"pics/{row}-{k}.png")
            vlm.image(row * 4 + k).save(folder / paths[-1])
        user = {"role": "user", "content": [{"type": "image"} for _ in paths]}
        user["content"].append({"type": "text", "text": vlm.QUESTIONS[row % len(vlm.QUESTIONS)]})
        answer = {
            "role": "assistant",
            "content": [{"type": "text", "text": vlm.ANSWERS[row % len(vlm.ANSWERS)]}],
        }
        if prompt_completion:
            lines.append({"prompt": [user], "completion": [answer], "images": paths})
        else:
            lines.append({"messages": [user, answer], "images": paths})
    path = folder / "rows.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return str(path)


def preflight(tmp_path, dataset, *options):
    out = tmp_path / "report.json"
    proc = cli("preflight", "--model", vlm.tiny_llava_dir(), "--dataset", dataset, *options, "--json", out)
    report = json.loads(out.read_text()) if out.is_file() else None
    return proc, report


def findings(report, rule):
    return [f for f in report["findings"] if f["rule"] == rule]


@pytest.mark.planted("vision-tokens-in-loss")
def test_conversations_under_trls_default_mask_train_the_image_placeholders(tmp_path):
    proc, report = preflight(tmp_path, write_rows(tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert report["stats"]["modality"] == "vision-language"
    [finding] = findings(report, "vision-tokens-in-loss")
    assert finding["severity"] == "error"
    assert finding["evidence"]["cause"] == "conversational-default"
    assert finding["evidence"]["vision_tokens_supervised"] == 8 * vlm.IMAGE_TOKENS  # one picture a row
    assert "internal-error" not in {f["rule"] for f in report["findings"]}
    assert "vision-tokens-in-loss" in proc.stdout and "<image>×16" in proc.stdout


@pytest.mark.clean("vision-tokens-in-loss", "prompt-in-loss", "duplicate-examples")
def test_prompt_completion_rows_are_silent(tmp_path):
    proc, report = preflight(tmp_path, write_rows(tmp_path, prompt_completion=True))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["stats"]["modality"] == "vision-language"
    assert report["stats"]["supervised_tokens"] > 0  # the token rules read the trainer's real batches
    assert [f["rule"] for f in report["findings"] if f["severity"] != "info"] == []


@pytest.mark.planted("image-span-truncated", "vision-token-budget")
def test_max_len_cuts_the_image_span_of_the_row_with_three_pictures(tmp_path):
    data = write_rows(tmp_path, images_in={5: 3}, prompt_completion=True)
    proc, report = preflight(tmp_path, data, "--max-len", "40")
    assert proc.returncode == 1
    [cut] = findings(report, "image-span-truncated")
    assert cut["evidence"]["rows"] == [5]
    assert cut["evidence"]["cut"][0]["expected"] == 3 * vlm.IMAGE_TOKENS
    assert "internal-error" not in {f["rule"] for f in report["findings"]}
    # Under --max-len 18 every picture's 16 tokens take 89% of it: no room for text.
    proc, report = preflight(tmp_path, data, "--max-len", "18")
    assert "internal-error" not in {f["rule"] for f in report["findings"]}
    [budget] = findings(report, "vision-token-budget")
    assert budget["evidence"]["max_length"] == 18
    assert set(budget["evidence"]["tokens_per_image"].values()) == {vlm.IMAGE_TOKENS}


@pytest.mark.clean("image-span-truncated", "vision-token-budget")
def test_a_max_len_above_every_row_cuts_no_image(tmp_path):
    data = write_rows(tmp_path, images_in={5: 3}, prompt_completion=True)
    proc, report = preflight(tmp_path, data, "--max-len", "256")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["stats"]["modality"] == "vision-language"
    assert [f["rule"] for f in report["findings"] if f["severity"] != "info"] == []


def test_a_saved_dataset_with_trls_image_column_is_read(tmp_path):
    data = vlm.vlm_messages(8)
    data.save_to_disk(str(tmp_path / "saved"))
    proc, report = preflight(tmp_path, str(tmp_path / "saved"))
    assert report["stats"]["modality"] == "vision-language", proc.stdout + proc.stderr
    assert [f["evidence"]["cause"] for f in findings(report, "vision-tokens-in-loss")] == [
        "conversational-default"
    ]


def test_a_missing_picture_is_one_line_and_exit_2(tmp_path):
    data = write_rows(tmp_path)
    (tmp_path / "pics" / "3-0.png").unlink()
    proc = cli("preflight", "--model", vlm.tiny_llava_dir(), "--dataset", data)
    assert proc.returncode == 2
    message = proc.stderr.strip()
    assert len(message.splitlines()) == 1 and "row 3" in message and "pics/3-0.png" in message
    assert "Traceback" not in proc.stderr + proc.stdout


def saved_lora(folder, target_modules) -> str:
    """A LoRA adapter saved by peft from the tiny LLaVA, as a user's vision-language LoRA run leaves it."""
    from peft import LoraConfig, get_peft_model

    model, _ = vlm.load_tiny_llava()
    get_peft_model(model, LoraConfig(r=4, target_modules=target_modules)).save_pretrained(str(folder))
    return str(folder)


@pytest.mark.slow
@pytest.mark.planted("vision-tower-adapters")
def test_a_saved_all_linear_adapter_has_layers_on_the_vision_tower(tmp_path):
    """`--adapter` on a vision-language model: the saved adapter goes onto the model as a training that goes on
    with it loads it, so its vision-side layers are found."""
    data = write_rows(tmp_path, prompt_completion=True)
    adapter = saved_lora(tmp_path / "lora", "all-linear")
    proc, report = preflight(tmp_path, data, "--adapter", adapter)
    assert report is not None, proc.stdout + proc.stderr
    assert "internal-error" not in {f["rule"] for f in report["findings"]}
    [finding] = findings(report, "vision-tower-adapters")
    assert finding["evidence"]["cause"] == "untargeted"
    assert "model.vision_tower.encoder.layers.0.self_attn.q_proj" in finding["evidence"]["vision_layers"]
    assert finding["evidence"]["language_only_target"] in finding["fix"]


@pytest.mark.slow
@pytest.mark.clean("vision-tower-adapters")
def test_a_saved_adapter_on_the_language_model_alone_is_silent(tmp_path):
    data = write_rows(tmp_path, prompt_completion=True)
    adapter = saved_lora(tmp_path / "lora", r"model\.language_model\..*\.(q_proj|v_proj)")
    proc, report = preflight(tmp_path, data, "--adapter", adapter)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [f["rule"] for f in report["findings"] if f["severity"] != "info"] == []


@pytest.mark.slow
def test_an_adapter_of_another_model_is_one_line_and_exit_2(tmp_path):
    """A text model's adapter (its layers named for a model without a vision tower) on the LLaVA folder."""
    import json as json_lib

    data = write_rows(tmp_path, prompt_completion=True)
    adapter = saved_lora(tmp_path / "lora", "all-linear")
    config = tmp_path / "lora" / "adapter_config.json"
    settings = json_lib.loads(config.read_text())
    settings["target_modules"] = ["no_such_layer"]
    config.write_text(json_lib.dumps(settings))
    proc = cli("preflight", "--model", vlm.tiny_llava_dir(), "--dataset", data, "--adapter", adapter)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "adapter" in proc.stderr
