"""Vision-language fine-tuning through TRL's real SFTTrainer on the tiny LLaVA (1-layer CLIP tower, 2-layer Qwen2
on the real Qwen2.5 tokenizer with `<image>`): the modality measured, the text rules vision-aware, the image
tokens in the loss, the image spans max_length cuts."""

from __future__ import annotations

import pytest

from hf_sanity import SanityCallback, preflight
from hf_sanity.testing import vlm
from tests.conftest import REAL_TOKENIZERS

pytestmark = pytest.mark.skipif(
    not (REAL_TOKENIZERS / "qwen2.5-instruct").is_dir(),
    reason="needs ../shared/real-tokenizers/qwen2.5-instruct",
)

TEXT_RULES_ON_VLM = ("duplicate-examples", "prompt-in-loss", "future-token-leak", "internal-error")


def rules(report) -> set[str]:
    return {f.rule for f in report.findings}


def above_info(report) -> list[str]:
    return [f"{f.rule}: {f.message}" for f in report.findings if f.severity != "info"]


def run(trainer) -> SanityCallback:
    """The trainer's short real run with a SanityCallback added; the callback's report back."""
    callback = SanityCallback()
    trainer.add_callback(callback)
    trainer.train()
    return callback


# -- the modality, and the text rules on VLM data ------------------------------------------------------------
@pytest.mark.clean("duplicate-examples", "prompt-in-loss", "future-token-leak")
def test_prompt_completion_vlm_data_with_completion_only_loss_is_silent(tmp_path):
    trainer = vlm.vlm_sft_trainer(tmp_path, vlm.vlm_prompt_completion(16))
    report = preflight(trainer=trainer)
    assert report.stats["modality"] == "vision-language"
    assert above_info(report) == []
    assert report.stats["supervised_tokens"] > 0  # the token rules read real batches
    callback = run(trainer)
    assert above_info(callback.report) == []
    assert callback.first.done  # the first-batch checks ran on the VLM batch


@pytest.mark.clean("duplicate-examples", "prompt-in-loss", "empty-loss-mask")
def test_a_collator_that_masks_the_vision_tokens_and_the_prompt_is_silent(tmp_path):
    model, processor = vlm.load_tiny_llava()
    collator = vlm.MaskingCollator(processor)
    trainer = vlm.vlm_sft_trainer(
        tmp_path, vlm.vlm_messages(16), model=model, processor=processor, collator=collator
    )
    report = preflight(trainer=trainer)
    assert report.stats["modality"] == "vision-language"
    assert above_info(report) == []
    callback = run(trainer)
    assert above_info(callback.report) == []


def test_a_text_run_says_text(tmp_path):
    from hf_sanity.testing import tiny_setup
    from tests.moe_setups import sft_trainer

    model, tok = tiny_setup()
    report = preflight(trainer=sft_trainer(tmp_path, model, tok, max_steps=1))
    assert report.stats["modality"] == "text"


@pytest.mark.planted("duplicate-examples")
def test_the_same_question_about_the_same_picture_twice_is_a_duplicate(tmp_path):
    data = vlm.vlm_prompt_completion(13)  # rows 0 and 12: the same question and answer, other pictures
    assert data[0]["prompt"] == data[12]["prompt"] and data[0]["completion"] == data[12]["completion"]
    data = data.select([*range(13), 2])  # row 2 again, same picture: a real duplicate
    trainer = vlm.vlm_sft_trainer(tmp_path, data, per_device_train_batch_size=7)
    report = preflight(trainer=trainer)
    found = [f for f in report.findings if f.rule == "duplicate-examples"]
    # The other rows repeat questions and answers over different pictures: only the true repeat is one.
    assert [f.evidence["duplicates"] for f in found] == [1]
