"""Vision-language rules: the image tokens in the loss (`vision-tokens-in-loss`), the image spans that
``max_length`` cuts (`image-span-truncated`), the vision tokens' share of it (`vision-token-budget`), the processor a
checkpoint lacks (`processor-not-saved`), adapters on the vision towers (`vision-tower-adapters`).

They judge a run measured vision-language (`hf_sanity.measure.vision`); a text run is never judged here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hf_sanity.catalog import define
from hf_sanity.measure.objective import ANY

VISION_TOKENS_IN_LOSS = define(
    "vision-tokens-in-loss",
    severity="error",
    stage="tokens",
    symptom="A vision-language fine-tune trains the model to emit image placeholders: every image's expanded "
    "`<image>` run (and the vision start/end tokens) carries loss, the loss is diluted by tokens no answer "
    "holds, and the model may write placeholders at inference.",
    detects="On a vision-language run (a processor with an image processor, vision tensors in the batch, or an "
    "image token id in the model's config), in the trainer's real collated batches (preflight) and the "
    "callback's first batch: the image/video placeholders and vision start/end tokens (and negative ids) whose "
    "label is not -100. Any is an error; evidence: how many of how many, the rows, a token view. Causes by "
    "format: `conversational-default` (TRL's collator on `messages` rows sets labels = input_ids without "
    "`assistant_only_loss`), `completion-only-loss-off` (prompt-completion rows with `completion_only_loss=False`), "
    "`collator` (the user's own collator).",
    fix="By format: prompt-completion rows (`prompt` holding the image turn, `completion` the answer) with "
    "completion-only loss (TRL's default for them); or `SFTConfig(assistant_only_loss=True)` with a chat template "
    "that marks the assistant turns with `{% generation %}`; or, in your own collator, set the label of every "
    "vision token to -100 (`labels[torch.isin(labels, vision_ids)] = -100`).",
)

COLLATOR_DIFF = """\
 labels = batch["input_ids"].clone()
 labels[batch["attention_mask"] == 0] = -100
+vision_ids = torch.tensor({ids})  # image placeholders, vision start/end
+labels[torch.isin(labels, vision_ids)] = -100"""


def is_vision_run(ctx) -> bool:
    return ctx.modality.is_vision


def _cause(ctx) -> str:
    """Which format put the vision tokens in the loss: TRL's collator on conversations or prompt-completion
    rows without completion-only loss, or a collator of the user's."""
    trainer = ctx.trainer
    collator = type(getattr(trainer, "data_collator", None)).__name__
    if trainer is None or collator != "DataCollatorForVisionLanguageModeling":
        return "collator"
    columns = getattr(getattr(trainer, "train_dataset", None), "column_names", None) or ()
    if "prompt" in columns and "completion" in columns:
        return "completion-only-loss-off"
    return "conversational-default"


FIXES = {
    "conversational-default": "TRL's collator trains every token of `messages` rows, the image placeholders "
    "included. Set `SFTConfig(assistant_only_loss=True)` with a chat template that marks the assistant turns "
    "with `{% generation %}` (the processor's `chat_template`), or convert the rows to prompt-completion "
    "(`prompt` = the turns up to the answer, `completion` = the answer), which TRL trains on the completion only.",
    "completion-only-loss-off": "Set `SFTConfig(completion_only_loss=True)` (or leave it unset: TRL's default "
    "for prompt-completion rows), so that the prompt and its image placeholders carry no loss.",
    "collator": "Your collator labels the vision tokens: set their labels to -100, as in this diff:\n"
    + COLLATOR_DIFF,
}


@VISION_TOKENS_IN_LOSS.check(applies=is_vision_run)
def check_vision_tokens_in_loss(ctx):
    counts = ctx.vision_tokens
    valid = ctx.valid
    supervised = counts.supervised[valid]
    if int(supervised.sum()) == 0:
        return
    rows_hit = valid & (counts.supervised > 0)
    rows = ctx.first(rows_hit)
    total_vision = int(counts.total[valid].sum())
    hit = int(supervised.sum())
    cause = _cause(ctx)
    first = rows[0]
    ids = sorted(ctx.modality.vision_ids)
    yield VISION_TOKENS_IN_LOSS.finding(
        f"{hit:,} of {total_vision:,} vision tokens (image placeholders, vision start/end) carry loss in "
        f"{int(rows_hit.sum())} of {int(valid.sum())} collated rows: the model is trained to emit them",
        evidence={
            "cause": cause,
            "vision_tokens_supervised": hit,
            "vision_tokens": total_vision,
            "supervised_tokens": int(ctx.col("n_supervised")[valid].sum()),
            "rows": rows,
            "rows_affected": int(rows_hit.sum()),
            "vision_token_ids": ids,
            "said_by": list(ctx.modality.said_by),
        },
        fix=FIXES[cause].replace("{ids}", str(ids)),
        example=ctx.view(first, focus=int(counts.first_supervised[first])),
        rows=np.asarray(rows_hit),
    )


IMAGE_SPAN_TRUNCATED = define(
    "image-span-truncated",
    severity="error",
    stage="trainer",
    symptom="A vision-language run crashes hours in, when the batch of one long row comes up: its image "
    "placeholders were cut by `max_length` while the image's features stay whole (\"Mismatch in `image` token "
    'count", "Image features and image tokens do not match").',
    detects="With a VLM trainer whose collator cuts at `max_length` (TRL's): every row of its dataset (up to "
    "2,000) through a copy of that collator without the cut, the placeholders the processor expands the row's "
    "pictures into (patches and merge size, image splitting) against those in the first `max_length` tokens. "
    "Every cut row is an error, its index in the evidence; the batches the collator refused while preflight "
    "drew them are counted (cause `collator-refuses`: the processor raises on that batch; "
    "`features-mismatch`: the cut ids reach the model, whose forward raises).",
    fix="Raise `max_length` above the longest row (`SFTConfig(max_length=...)`, or None for no cut), or drop "
    "the rows with too many or too large pictures (`dataset.filter`), or lower the image resolution "
    "(`max_pixels`, no image splitting) so each picture takes fewer tokens.",
)


def has_vision_trainer(ctx) -> bool:
    return ctx.trainer is not None and ctx.modality.is_vision


@IMAGE_SPAN_TRUNCATED.check(applies=has_vision_trainer)
def check_image_span_truncated(ctx):
    spans = ctx.image_spans
    if spans is None or not spans.cut:
        return
    rows = [c["row"] for c in spans.cut]
    longest = max(c["length"] for c in spans.cut)
    cause = "collator-refuses" if ctx.refused_batches else "features-mismatch"
    worst = min(spans.cut, key=lambda c: c["surviving"] - c["expected"])
    yield IMAGE_SPAN_TRUNCATED.finding(
        f"max_length={spans.max_length} cuts the image placeholders of {len(rows)} of {spans.rows_checked} rows "
        f"(row {worst['row']}: {worst['surviving']} of {worst['expected']} survive); the run crashes when their "
        "batch comes up",
        evidence={
            "cause": cause,
            "rows": rows,
            "max_length": spans.max_length,
            "cut": spans.cut[:20],
            "longest_row": longest,
            "rows_checked": spans.rows_checked,
            "rows_total": spans.rows_total,
            "batches_refused": len(ctx.refused_batches),
            "refused_error": ctx.refused_batches[0] if ctx.refused_batches else None,
        },
        fix=f"Raise max_length to {longest} or more (`SFTConfig(max_length={longest})`, or None), or drop rows "
        f"{rows[:10]} (`dataset.filter`), or lower the image resolution so each picture takes fewer tokens.",
    )


VISION_TOKEN_BUDGET = define(
    "vision-token-budget",
    severity="warning",
    stage="trainer",
    symptom="The pictures fill the context: with most of `max_length` taken by image tokens, little or no room is "
    "left for the question and the answer, which are cut or crowded out.",
    detects="With a VLM trainer whose collator cuts at `max_length`: per row of its dataset (up to 2,000), the "
    "image placeholders the processor writes for its pictures as a share of `max_length`. The 95th percentile "
    "above 80% is a warning; the evidence holds the tokens one picture takes at each resolution in the data, so "
    "what the resolution (`max_pixels`, image splitting) costs is seen.",
    fix="Lower the image resolution (the image processor's `size` / `max_pixels`, no image splitting) so each "
    "picture takes fewer tokens, or raise `max_length`.",
)

BUDGET_SHARE = 0.8  # the p95 share of max_length the vision tokens may take


@VISION_TOKEN_BUDGET.check(applies=has_vision_trainer)
def check_vision_token_budget(ctx):
    spans = ctx.image_spans
    if spans is None or not spans.vision:
        return
    shares = np.asarray(spans.vision, dtype=float) / spans.max_length
    p95 = float(np.percentile(shares, 95))
    if p95 <= BUDGET_SHARE:
        return
    over = [int(r) for r in np.flatnonzero(shares > BUDGET_SHARE)]
    yield VISION_TOKEN_BUDGET.finding(
        f"the image tokens take {p95:.0%} of max_length={spans.max_length} at the 95th percentile of "
        f"{spans.rows_checked} rows ({len(over)} rows above {BUDGET_SHARE:.0%}): little room is left for text",
        evidence={
            "p95_share": round(p95, 4),
            "max_length": spans.max_length,
            "median_vision_tokens": float(np.median(spans.vision)),
            "tokens_per_image": spans.per_image,
            "rows": over[:50],
            "rows_checked": spans.rows_checked,
        },
    )


PROCESSOR_NOT_SAVED = define(
    "processor-not-saved",
    severity="error",
    stage="training",
    symptom="A vision-language checkpoint a server cannot serve as it was trained: the folder holds the weights and "
    "the tokenizer but not the image processor's settings (resolution, normalisation, image splitting) or the chat "
    "template that places the pictures, so the server fails to load a processor or builds a default one whose "
    "pictures become other tokens.",
    detects="On a vision-language run (`stats.modality`), at each checkpoint the Trainer saves (SanityCallback, "
    "on_save); and the folder `served` and `outputs` load the model (or the adapter) from: "
    "each read for the image processor's config (`preprocessor_config.json`, or `image_processor` in "
    "`processor_config.json`) and a chat template (`chat_template.jinja` / `.json`, or `chat_template` in the "
    "tokenizer's or processor's config). Either missing is an error; cause `tokenizer-only` when the trainer's "
    "`processing_class` is the tokenizer alone (Trainer saves what it is given), `no-processing-class` when it "
    "has none, else (and for a served folder) `not-saved`.",
    fix="Give the trainer the whole processor (`processing_class=processor`, not `processor.tokenizer`): Trainer "
    "saves it into every checkpoint; or save it beside the weights yourself (`processor.save_pretrained(folder)`).",
)


def is_vision_folder(folder) -> bool:
    return folder.modality.is_vision


@PROCESSOR_NOT_SAVED.detector("saved", applies=is_vision_folder)
def check_processor_not_saved(folder):
    missing = []
    if not folder.has_image_processor:
        missing.append("the image processor's config (preprocessor_config.json)")
    if not folder.has_chat_template:
        missing.append("the chat template")
    if not missing:
        return
    if folder.trainer_has_processor or not folder.from_trainer:
        cause = "not-saved"
    else:
        cause = folder.processing_class or "no-processing-class"
    fix = None
    if cause != "not-saved":
        fix = (
            f"The trainer's processing_class is {'the tokenizer alone' if cause == 'tokenizer-only' else 'not set'}, "
            "so its checkpoints get no image processor: pass `processing_class=processor` (the whole processor), or "
            "`processor.save_pretrained(folder)` beside the weights you serve."
        )
    yield PROCESSOR_NOT_SAVED.finding(
        f"{Path(folder.path).name} lacks {' and '.join(missing)}: a server cannot process pictures the way "
        "training did",
        evidence={
            "cause": cause,
            "folder": folder.path,
            "missing": missing,
            "files": list(folder.files),
            "step": folder.step,
        },
        fix=fix,
        step=folder.step,
    )


VISION_TOWER_ADAPTERS = define(
    "vision-tower-adapters",
    severity="warning",
    stage="model",
    objectives=ANY,
    symptom="A vision-language LoRA run trains the vision encoder or the projector by accident: "
    '`target_modules="all-linear"` (or a suffix like `q_proj` that the vision tower\'s layers share) puts '
    "adapters on them, the server that loads language-model-only adapters (vLLM's LoRA for most VLMs) "
    "refuses or drops them, and what is served is not what was trained.",
    detects="With a PEFT model (the trainer's, e.g. `SFTTrainer(peft_config=...)`, or the model given): each "
    "adapter layer's tower by its module path (vision encoder, projector, language model) and each tower's "
    "share of the trainable parameters. Adapter layers on the vision encoder or projector while no "
    "`target_modules` / `modules_to_save` entry names them (`all-linear`, bare layer names) are a warning; the "
    "evidence holds the layers, the towers' shares and a regex that reaches the language model alone.",
    fix='Target the language model alone by its path: `LoraConfig(target_modules=r"model\\.language_model\\..*'
    "\\.(q_proj|k_proj|v_proj|o_proj)\")` (peft fullmatches a string against each module's path). To train the "
    "vision side on purpose, name it in target_modules, and serve with an engine that loads adapters on the "
    "vision tower.",
)


def has_peft_model(ctx) -> bool:
    return ctx.peft_model is not None


@VISION_TOWER_ADAPTERS.check(applies=has_peft_model)
def check_vision_tower_adapters(ctx):
    from hf_sanity.measure.towers import LANGUAGE, PROJECTOR, TOWERS, VISION

    towers = ctx.adapter_towers
    if towers is None or not towers.on_vision() or towers.named:
        return
    landed = ", ".join(
        f"{len(towers.adapted[t])} on the {t}" for t in (VISION, PROJECTOR) if towers.adapted[t]
    )
    share = towers.share()
    vision_share = share[VISION] + share[PROJECTOR]
    regex = towers.language_only_regex()
    yield VISION_TOWER_ADAPTERS.finding(
        f"the adapter's layers landed on the vision side ({landed}) that target_modules does not name: "
        f"{vision_share:.1%} of the trainable parameters train the vision side, which a language-model-only "
        "server will not load",
        evidence={
            "cause": "untargeted",
            "target_modules": towers.targets,
            "adapted_layers": {t: len(towers.adapted[t]) for t in TOWERS},
            "vision_layers": towers.on_vision()[:20],
            "trainable_params": towers.trainable,
            "trainable_share": share,
            "language_model_path": towers.language_path,
            "language_only_target": regex,
            "language_layers": len(towers.adapted[LANGUAGE]),
        },
        fix=f'To train the language model alone, target it by path: `LoraConfig(target_modules=r"{regex}")` '
        "(peft fullmatches a string against each module's path). To train the vision side on purpose, name it "
        "in target_modules (e.g. `multi_modal_projector`) and serve with an engine that loads adapters on the "
        "vision tower: a language-model-only server will not load them.",
    )


IMAGE_SETTINGS_DRIFT = define(
    "image-settings-drift",
    severity="warning",
    stage="outputs",
    symptom="A vision-language model served with other image settings than it was trained with: each picture "
    "becomes several times more (or fewer) tokens than in training (576 a picture in training, 16,384 at "
    "inference), so the model sees images at a resolution or tiling it never learned, answers get worse, and "
    "long contexts run out.",
    detects="`served` and `outputs` given the serving processor (the folder of `--inference-tokenizer` / "
    "`--tokenizer`, or `processor=`) with a model folder that holds the training processor: one reference "
    "picture (512x512) through each; tokens per picture that differ by more than 2x are a warning, with the "
    "settings that differ (resolution `size` / `longest_edge`, pixel bounds `min_pixels` / `max_pixels`, "
    "`do_image_splitting`, tokens per tile); the cause names the first setting that decides the count.",
    fix="Serve with the processor saved beside the model (`AutoProcessor.from_pretrained(model_folder)`), or "
    "set the serving processor's image settings to the training ones (e.g. vLLM's `--mm-processor-kwargs`).",
)

DRIFT_RATIO = 2.0  # tokens per picture, serving against training, beyond which the model sees another input


def has_serving_processor(folder) -> bool:
    return folder.serving_processor is not None and folder.has_image_processor


@IMAGE_SETTINGS_DRIFT.detector("saved", applies=has_serving_processor)
def check_image_settings_drift(folder):
    settings = folder.image_settings
    if settings is None or settings.ratio <= DRIFT_RATIO:
        return
    cause = settings.cause
    change = settings.differing.get(cause, {})
    yield IMAGE_SETTINGS_DRIFT.finding(
        f"a {settings.reference} picture is {settings.serving_tokens} tokens at serving against "
        f"{settings.training_tokens} in training ({settings.ratio:.1f}x): {cause} is "
        f"{change.get('serving')!r} at serving, {change.get('training')!r} in training",
        evidence={
            "cause": cause,
            "reference": settings.reference,
            "tokens_per_image": {"training": settings.training_tokens, "serving": settings.serving_tokens},
            "ratio": round(settings.ratio, 2),
            "differing": settings.differing,
            "folder": folder.path,
        },
        fix=f"Serve with the processor saved in {folder.path} (`AutoProcessor.from_pretrained`), or set the "
        f"serving processor's `{cause}` to {change.get('training')!r} as in training.",
    )
