"""Vision-language fine-tuning through TRL's real SFTTrainer on the tiny LLaVA (1-layer CLIP tower, 2-layer Qwen2
on the real Qwen2.5 tokenizer with `<image>`): the modality measured, the text rules vision-aware, the image
tokens in the loss, the image spans max_length cuts."""

from __future__ import annotations

import pytest

from hf_sanity import SanityCallback, preflight
from hf_sanity.testing import vlm
from tests.conftest import REAL_TOKENIZERS

pytestmark = [
    pytest.mark.skipif(
        not (REAL_TOKENIZERS / "qwen2.5-instruct").is_dir(),
        reason="needs ../shared/real-tokenizers/qwen2.5-instruct",
    ),
    pytest.mark.usefixtures("shared_llava_processor"),
]

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
@pytest.mark.clean("duplicate-examples", "prompt-in-loss", "future-token-leak", "vision-tokens-in-loss")
def test_prompt_completion_vlm_data_with_completion_only_loss_is_silent(tmp_path):
    trainer = vlm.vlm_sft_trainer(tmp_path, vlm.vlm_prompt_completion(16))
    report = preflight(trainer=trainer)
    assert report.stats["modality"] == "vision-language"
    assert above_info(report) == []
    assert report.stats["supervised_tokens"] > 0  # the token rules read real batches
    callback = run(trainer)
    assert above_info(callback.report) == []
    assert callback.first.done  # the first-batch checks ran on the VLM batch


@pytest.mark.slow  # another VLM case of a rule the fast lane runs here (5-12 s)
@pytest.mark.clean("duplicate-examples", "prompt-in-loss", "vision-tokens-in-loss", "empty-loss-mask")
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


@pytest.mark.slow  # another VLM case of a rule the fast lane runs here (5-12 s)
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


# -- vision-tokens-in-loss ------------------------------------------------------------------------------------
def vision_finding(report):
    found = [f for f in report.findings if f.rule == "vision-tokens-in-loss"]
    assert len(found) == 1, rules(report)
    return found[0]


@pytest.mark.planted("vision-tokens-in-loss")
def test_trls_default_collator_on_conversations_trains_the_image_placeholders(tmp_path):
    trainer = vlm.vlm_sft_trainer(tmp_path, vlm.vlm_messages(16))
    report = preflight(trainer=trainer)
    finding = vision_finding(report)
    assert finding.severity == "error"
    assert finding.evidence["cause"] == "conversational-default"
    # Every row holds one picture of 16 placeholders, every one of them labelled.
    assert finding.evidence["vision_tokens_supervised"] == finding.evidence["vision_tokens"] == 16 * 16
    assert finding.evidence["rows_affected"] == 16
    assert "assistant_only_loss=True" in finding.fix
    cells = finding.example.cells
    assert cells[finding.example.focus].text == "<image>" and cells[finding.example.focus].loss
    assert "duplicate-examples" not in rules(report)  # same questions, other pictures
    # The callback's first batch: the same error, on the 4 rows it saw.
    callback = run(trainer)
    on_batch = vision_finding(callback.report)
    assert on_batch.step == 1 and on_batch.evidence["vision_tokens_supervised"] == 4 * 16
    assert "internal-error" not in rules(callback.report)


@pytest.mark.slow  # another VLM case of a rule the fast lane runs here (5-12 s)
@pytest.mark.planted("vision-tokens-in-loss")
def test_a_tutorial_collator_that_copies_input_ids_to_labels_gets_the_masking_diff(tmp_path):
    model, processor = vlm.load_tiny_llava()
    # The tutorials' collator: labels = input_ids, the padding masked, nothing else.
    collator = vlm.MaskingCollator(processor, mask_vision=False, mask_prompt=False)
    trainer = vlm.vlm_sft_trainer(
        tmp_path, vlm.vlm_messages(8), model=model, processor=processor, collator=collator
    )
    report = preflight(trainer=trainer)
    finding = vision_finding(report)
    assert finding.evidence["cause"] == "collator"
    assert finding.evidence["vision_tokens_supervised"] == 8 * 16
    assert "+labels[torch.isin(labels, vision_ids)] = -100" in finding.fix
    # The user turn's text trains too: prompt-in-loss, counted without the placeholders.
    prompt = next(f for f in report.findings if f.rule == "prompt-in-loss")
    assert prompt.evidence["supervised_tokens"] == report.stats["supervised_tokens"] - 8 * 16


@pytest.mark.slow  # another VLM case of a rule the fast lane runs here (5-12 s)
@pytest.mark.planted("vision-tokens-in-loss")
def test_prompt_completion_rows_with_completion_only_loss_off(tmp_path):
    trainer = vlm.vlm_sft_trainer(tmp_path, vlm.vlm_prompt_completion(8), completion_only_loss=False)
    finding = vision_finding(preflight(trainer=trainer))
    assert finding.evidence["cause"] == "completion-only-loss-off"
    assert "completion_only_loss=True" in finding.fix


@pytest.mark.slow  # another VLM case of a rule the fast lane runs here (5-12 s)
@pytest.mark.clean("vision-tokens-in-loss", "prompt-in-loss")
def test_assistant_only_loss_with_a_generation_marked_template_is_silent(tmp_path):
    trainer = assistant_only_trainer(tmp_path, vlm.vlm_messages(16))
    report = preflight(trainer=trainer)
    assert report.stats["modality"] == "vision-language"
    assert above_info(report) == []
    assert report.stats["supervised_tokens"] > 0
    assert above_info(run(trainer).report) == []


def assistant_only_trainer(tmp_path, data, **config):
    """The VLM SFTTrainer with assistant-only loss; the test skipped, naming TRL's version, where an older TRL
    refuses it for vision-language models (TRL 1.9)."""
    import trl
    import trl_setups as setups
    from packaging.version import Version

    try:
        return vlm.vlm_sft_trainer(tmp_path, data, assistant_only_loss=True, **config)
    except ValueError as exc:
        if "not yet supported for vision-language" not in str(exc):
            raise
        if Version(trl.__version__) >= Version(setups.NEWEST_TRL):
            raise
        pytest.skip(f"TRL {trl.__version__} has no assistant-only loss for vision-language models")


# -- the trainer's own loss on the first rows of its first batch ------------------------------------------------
@pytest.mark.parametrize("images_in", [{}, {0: 2, 1: 3}], ids=["one-each", "two-and-three"])
def test_the_first_rows_of_a_llava_batch_carry_their_own_pictures(tmp_path, images_in):
    """`trainer_step` runs the trainer's compute_loss on the first rows of its first batch: taken with their
    pictures, the model computes for them what it computes for them inside the whole batch."""
    import torch

    from hf_sanity.measure.vision import leading_rows, measure_modality

    trainer = vlm.vlm_sft_trainer(
        tmp_path, vlm.vlm_prompt_completion(8, images_in=images_in), max_length=None
    )
    batch = trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(8)])  # rows in order
    modality = measure_modality(trainer.processing_class, trainer.model, batch)
    rows = leading_rows(batch, 2, modality.placeholder_ids)
    assert rows is not None and rows["input_ids"].shape[0] == 2
    assert rows["pixel_values"].shape[0] == 2 + sum(images_in.values()) - len(images_in)
    model = trainer.model.eval()
    with torch.no_grad():
        whole = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:2]
        alone = model(**{k: v for k, v in rows.items() if k != "labels"}).logits
    torch.testing.assert_close(alone, whole, rtol=1e-4, atol=1e-4)


def test_rows_whose_pictures_cannot_be_told_apart_are_not_cut(tmp_path):
    """Idefics3's batches hold each row's tiles in tensors of their own shape: no rows are taken from them."""
    from helpers import load_tiny_idefics3
    from hf_sanity.measure.vision import leading_rows, measure_modality

    model, processor = load_tiny_idefics3()  # skipped where transformers needs torchvision for it (5.6, 5.16)
    trainer = vlm.vlm_sft_trainer(tmp_path, vlm.vlm_prompt_completion(8), model=model, processor=processor)
    batch = next(iter(trainer.get_train_dataloader()))
    modality = measure_modality(trainer.processing_class, trainer.model, batch)
    assert leading_rows(batch, 2, modality.placeholder_ids) is None


# -- image-span-truncated -------------------------------------------------------------------------------------
@pytest.mark.planted("image-span-truncated")
@pytest.mark.parametrize(
    "make",
    [pytest.param(vlm.vlm_messages, marks=pytest.mark.slow), vlm.vlm_prompt_completion],
    ids=["messages", "prompt-completion"],
)
def test_max_length_cuts_the_placeholders_of_the_one_row_with_three_images(tmp_path, make):
    # Rows 5 and 11 carry three pictures (48 placeholders): max_length=40 cuts them; the others fit.
    data = make(16, images_in={5: 3, 11: 3})
    if make is vlm.vlm_messages:
        trainer = assistant_only_trainer(tmp_path, data, max_length=40)
    else:
        trainer = vlm.vlm_sft_trainer(tmp_path, data, max_length=40)
    report = preflight(trainer=trainer)  # TRL's collator refuses the messages batch: preflight goes on
    found = [f for f in report.findings if f.rule == "image-span-truncated"]
    assert len(found) == 1, rules(report)
    finding = found[0]
    assert finding.severity == "error"
    assert finding.evidence["rows"] == [5, 11]
    assert {c["expected"] for c in finding.evidence["cut"]} == {48}
    assert all(c["surviving"] < 48 for c in finding.evidence["cut"])
    expected_cause = "collator-refuses" if make is vlm.vlm_messages else "features-mismatch"
    assert finding.evidence["cause"] == expected_cause
    assert "max_length" in finding.fix
    assert "internal-error" not in rules(report)


@pytest.mark.clean("image-span-truncated")
def test_max_length_above_every_row_cuts_no_image(tmp_path):
    data = vlm.vlm_prompt_completion(16, images_in={5: 3})
    trainer = vlm.vlm_sft_trainer(tmp_path, data, max_length=128)
    report = preflight(trainer=trainer)
    assert above_info(report) == []
    assert report.stats["modality"] == "vision-language"
    from hf_sanity.measure.vision import image_spans, measure_modality

    spans = image_spans(trainer, measure_modality(trainer.processing_class, trainer.model), [])
    assert spans.rows_checked == 16 and spans.cut == []  # the detector ran over every row


# -- vision-token-budget --------------------------------------------------------------------------------------
@pytest.mark.planted("vision-token-budget")
def test_pictures_that_fill_max_length_leave_no_room_for_text(tmp_path):
    # Every row carries three pictures (48 placeholders) under max_length=56: 86% of it, text gets 8 tokens.
    data = vlm.vlm_prompt_completion(8, images_in=dict.fromkeys(range(8), 3))
    trainer = vlm.vlm_sft_trainer(tmp_path, data, max_length=56)
    found = [f for f in preflight(trainer=trainer).findings if f.rule == "vision-token-budget"]
    assert len(found) == 1
    evidence = found[0].evidence
    assert evidence["p95_share"] == pytest.approx(48 / 56, abs=1e-3)
    assert set(evidence["tokens_per_image"].values()) == {16}  # every resolution: 16 tokens a picture
    assert len(evidence["rows"]) == 8


@pytest.mark.clean("vision-token-budget")
def test_one_picture_a_row_in_a_roomy_max_length_is_within_budget(tmp_path):
    trainer = vlm.vlm_sft_trainer(tmp_path, vlm.vlm_prompt_completion(8), max_length=128)
    report = preflight(trainer=trainer)
    assert "vision-token-budget" not in rules(report)
    assert above_info(report) == []


# -- show -----------------------------------------------------------------------------------------------------
@pytest.mark.slow  # another VLM case of a rule the fast lane runs here (5-12 s)
def test_show_folds_each_pictures_placeholder_run(tmp_path):
    trainer = vlm.vlm_sft_trainer(tmp_path, vlm.vlm_prompt_completion(4, images_in={1: 2}), max_length=None)
    report = preflight(trainer=trainer, show=4)
    text = "\n".join(view.plain() if hasattr(view, "plain") else str(view) for view in report.views)
    assert "<image>×16" in text  # one picture: one run of 16
    assert "<image>×32" in text  # two adjacent pictures: one run of 32
    assert "<image><image>" not in text


# -- a dynamic image-token count: Idefics3 (SmolVLM), pictures split into tiles ---------------------------------
@pytest.mark.slow  # another VLM case of a rule the fast lane runs here (5-12 s)
@pytest.mark.planted("image-span-truncated", "vision-tokens-in-loss")
def test_idefics3_tiles_count_by_resolution_and_the_cut_row_is_found(tmp_path):
    from helpers import load_tiny_idefics3

    model, processor = load_tiny_idefics3()  # skipped where transformers needs torchvision for it (5.6, 5.16)
    # Square pictures split into 2x2 tiles + the global image (20 placeholders), wide ones into 2x1 (12); row 3
    # carries three square pictures (60) and is the one max_length cuts.
    data = vlm.vlm_messages(8, images_in={3: 3}, wide=frozenset({1, 5}))
    trainer = vlm.vlm_sft_trainer(tmp_path, data, model=model, processor=processor, max_length=120)
    report = preflight(
        trainer=trainer
    )  # the processor refuses row 3's batch (a TypeError): preflight goes on
    assert report.stats["modality"] == "vision-language"
    cut = next(f for f in report.findings if f.rule == "image-span-truncated")
    assert cut.evidence["rows"] == [3]
    assert cut.evidence["cut"][0]["expected"] == 60
    assert cut.evidence["batches_refused"] == 1
    from hf_sanity.measure.vision import image_spans, measure_modality

    spans = image_spans(trainer, measure_modality(processor, model), [])
    assert sorted(set(spans.per_image.values())) == [12, 20]  # the tokens a picture takes, per resolution
    vision = next(f for f in report.findings if f.rule == "vision-tokens-in-loss")
    assert vision.evidence["cause"] == "conversational-default"
    assert "duplicate-examples" not in rules(report)


# -- blank stand-ins: the span count reads no picture twice ----------------------------------------------------
def spans_both_ways(trainer, monkeypatch):
    """The image spans of ``trainer`` as preflight measures them (blank stand-ins after the first batch) and with
    every row's real pictures collated; and the stand-ins chosen (None: none matched)."""
    from hf_sanity.measure import vision

    modality = vision.measure_modality(trainer.processing_class, trainer.model)
    chosen = []
    calibrated = vision.StandIns.calibrated.__func__

    def spy(cls, *args, **kwargs):
        chosen.append(calibrated(cls, *args, **kwargs))
        return chosen[-1]

    with monkeypatch.context() as patch:
        patch.setattr(vision.StandIns, "calibrated", classmethod(spy))
        fast = vision.image_spans(trainer, modality, [])
    with monkeypatch.context() as patch:
        patch.setattr(vision.StandIns, "calibrated", classmethod(lambda cls, *a, **k: None))
        real = vision.image_spans(trainer, modality, [])
    return fast, real, chosen[0]


def test_blank_stand_ins_count_what_the_real_pictures_count(tmp_path, monkeypatch):
    # 72 rows: the first 32 collated with their pictures, the rest with blanks; rows 40 and 65 (three pictures,
    # 48 placeholders) are cut by max_length=40, rows 50-53 are wide.
    data = vlm.vlm_prompt_completion(72, images_in={40: 3, 65: 3}, wide=frozenset(range(50, 54)))
    trainer = vlm.vlm_sft_trainer(tmp_path, data, max_length=40)
    fast, real, stand_ins = spans_both_ways(trainer, monkeypatch)
    assert stand_ins is not None and stand_ins.fixed  # LLaVA: 16 placeholders whatever the size
    assert [c["row"] for c in fast.cut] == [40, 65]
    assert fast == real


def test_a_batch_whose_stand_ins_cannot_be_made_is_collated_with_its_real_pictures(tmp_path, monkeypatch):
    """A picture whose size cannot be read (here: every size read after the first batch's) sends its batch back to
    the real pictures: the spans are still the real ones, cut rows included."""
    from hf_sanity.measure import vision

    data = vlm.vlm_prompt_completion(72, images_in={40: 3, 65: 3})
    trainer = vlm.vlm_sft_trainer(tmp_path, data, max_length=40)
    modality = vision.measure_modality(trainer.processing_class, trainer.model)
    real = vision.image_spans(trainer, modality, [])
    read = vision._size

    def unreadable_after_calibration(picture):
        if len(calls) >= 32:  # the first batch's calibration read 32 sizes
            raise OSError("cannot identify image file")
        calls.append(1)
        return read(picture)

    calls: list[int] = []
    monkeypatch.setattr(vision, "_size", unreadable_after_calibration)
    fallen_back = vision.image_spans(trainer, modality, [])
    assert len(calls) == 32  # the stand-ins were chosen, then could not be made
    assert [c["row"] for c in fallen_back.cut] == [40, 65]
    assert fallen_back == real


def test_picture_files_stand_in_by_their_header_size(tmp_path, monkeypatch):
    """A dataset of picture files (the `images` column of paths cast to Image features, as `load_dataset`
    gives them): the spans are those of the real pictures."""
    import datasets

    folder = tmp_path / "pictures"
    folder.mkdir()
    paths = []
    for row in range(40):
        picture = vlm.image(row, wide=row % 7 == 0).resize((320 + row, 240))
        picture.save(folder / f"{row}.jpg")
        paths.append([str(folder / f"{row}.jpg")] * (3 if row == 35 else 1))
    source = vlm.vlm_prompt_completion(40, images_in={35: 3})
    data = datasets.Dataset.from_dict(
        {"prompt": source["prompt"], "completion": source["completion"], "images": paths}
    ).cast_column("images", datasets.Sequence(datasets.Image()))
    trainer = vlm.vlm_sft_trainer(tmp_path / "run", data, max_length=40)
    fast, real, stand_ins = spans_both_ways(trainer, monkeypatch)
    assert stand_ins is not None
    assert [c["row"] for c in fast.cut] == [35]
    assert fast == real


@pytest.mark.slow  # another VLM case of a rule the fast lane runs here (5-12 s)
def test_a_processor_that_counts_by_size_gets_blanks_of_each_pictures_size(tmp_path, monkeypatch):
    from helpers import load_tiny_idefics3

    model, processor = load_tiny_idefics3()  # skipped where transformers needs torchvision for it (5.6, 5.16)
    data = vlm.vlm_messages(40, images_in={36: 3}, wide=frozenset({1, 5, 33, 38}))
    trainer = vlm.vlm_sft_trainer(tmp_path, data, model=model, processor=processor, max_length=120)
    fast, real, stand_ins = spans_both_ways(trainer, monkeypatch)
    assert stand_ins is not None and not stand_ins.fixed  # square and wide pictures take 20 and 12
    assert sorted(set(fast.per_image.values())) == [12, 20]
    assert fast == real


# -- processor-not-saved --------------------------------------------------------------------------------------
def checkpointed_run(tmp_path, processing_class_of, save_steps: int = 2):
    """The tutorials' setup: transformers' Trainer with the masking collator, two steps, a checkpoint saved
    every ``save_steps``, the trainer's processing_class ``processing_class_of(processor)``; the callback's report
    and the checkpoint of step 2. (TRL's SFTTrainer refuses a tokenizer alone on image rows; Trainer takes it.)"""
    from transformers import Trainer, TrainingArguments

    model, processor = vlm.load_tiny_llava()
    config = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3, report_to=[],
        save_strategy="steps", save_steps=save_steps, save_only_model=True, use_cpu=True, bf16=False, seed=0,
        disable_tqdm=True, remove_unused_columns=False,
    )  # fmt: skip
    callback = SanityCallback()
    trainer = Trainer(
        model=model, args=config, train_dataset=vlm.vlm_messages(8), processing_class=processing_class_of(processor),
        data_collator=vlm.MaskingCollator(processor), callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    return callback.report, tmp_path / "checkpoint-2"


@pytest.mark.planted("processor-not-saved")
def test_a_trainer_given_the_tokenizer_alone_saves_checkpoints_without_the_image_processor(tmp_path):
    report, checkpoint = checkpointed_run(tmp_path, lambda processor: processor.tokenizer)
    assert (checkpoint / "model.safetensors").is_file() and not (
        checkpoint / "preprocessor_config.json"
    ).exists()
    found = [f for f in report.findings if f.rule == "processor-not-saved"]
    assert len(found) == 1, rules(report)
    finding = found[0]
    assert finding.severity == "error" and finding.step == 2
    assert finding.evidence["cause"] == "tokenizer-only"
    assert finding.evidence["folder"] == str(checkpoint)
    assert finding.evidence["missing"] == ["the image processor's config (preprocessor_config.json)"]
    assert "processing_class=processor" in finding.fix
    assert "internal-error" not in rules(report)


@pytest.mark.clean("processor-not-saved")
def test_a_trainer_given_the_processor_saves_it_into_each_checkpoint(tmp_path):
    report, checkpoint = checkpointed_run(tmp_path, lambda processor: processor)
    from transformers import AutoProcessor

    assert AutoProcessor.from_pretrained(checkpoint).image_processor is not None  # a server can load it
    assert above_info(report) == []
