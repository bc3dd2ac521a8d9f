"""Model rules: the model's vocabulary, embeddings, trainable parameters and step-0 loss."""

from __future__ import annotations

import math

import numpy as np

from hf_sanity.catalog import NotMeasured, define
from hf_sanity.measure.objective import ANY, SEQUENCES
from hf_sanity.remedies import RemedyDoc, embeddings_from_text

INIT_LOSS_OFF_CHANCE = define(
    "init-loss-off-chance",
    severity="error",
    stage="model",
    symptom="Loss starts far above or far below expected.",
    detects="The step-0 loss on a sample of supervised tokens (with --adapter, of the model with the adapter "
    "attached), against chance ln(V) and the model's own predictive entropy. Far above, the labels are "
    "scored in other alignments (one position earlier or later, the input's own next token): one that scores "
    "far better is an error with cause `labels-shifted` or `labels-not-input`; a model whose top guess is "
    "right on under 2% of the tokens is an error with cause `nothing-predicted` (a broken init or head, "
    "weights that did not load, another tokenizer's ids); otherwise the data is new to a trained model "
    "(`new-data`, info: a new answer style costs more than the model's own entropy). Far below, the prompts "
    "are blanked: answers copied from the input are an error (`answer-in-input`); answers the model knows "
    "from their prompts (`seen-data`: continued fine-tuning on data it was trained on or data like it) or "
    "without them (`predictable-without-prompt`) are warnings.",
    fix="Far above: check the labels (not shifted by hand, the same tokens as the input) and the weights (loaded, "
    "not re-initialised). Far below: check label-leakage and what the labels contain.",
    needs=("vocab-size-mismatch", "adapter-empty", "adapter-base-mismatch"),
)

NO_TRAINABLE_PARAMS = define(
    "no-trainable-params",
    severity="error",
    stage="model",
    objectives=ANY,
    symptom="Fine-tune produces base-model-quality output: nothing was trained.",
    detects="No parameter of the model requires grad (a frozen model, or an adapter that was not attached).",
    fix="Attach the adapter with peft.get_peft_model (or unfreeze the layers to train) before building the trainer.",
)


VOCAB_SIZE_MISMATCH = define(
    "vocab-size-mismatch",
    severity="error",
    stage="model",
    objectives=ANY,
    symptom="CUDA 'device-side assert' / index errors, or tokens silently mapped to the wrong embeddings.",
    detects="Token ids in the data (or the tokenizer's size) reach past the model's embedding rows.",
    fix="After adding tokens, call `model.resize_token_embeddings(len(tokenizer))` (and train or initialise the new "
    "rows); make sure the tokenizer belongs to the model.",
)


# Why the embedding checks cannot measure a model: said once for all of them (see catalog.NotMeasured).
NO_INPUT_EMBEDDINGS = (
    "the model exposes no input embeddings (no get_input_embeddings(), as a custom nn.Module): its embedding "
    "rows cannot be read"
)


@VOCAB_SIZE_MISMATCH.check
def check_vocab_size(ctx):
    rows = ctx.embedding_rows
    if not rows:
        if ctx.model_given and ctx.input_embeddings is None:
            raise NotMeasured(NO_INPUT_EMBEDDINGS)
        return
    max_ids = ctx.col("max_id")
    beyond = ctx.valid & (max_ids >= rows)
    tokenizer_size = len(ctx.tokenizer)
    if beyond.any():
        bad_rows = ctx.first(beyond)
        yield VOCAB_SIZE_MISMATCH.finding(
            f"{int(beyond.sum())} examples use token ids up to {int(max_ids.max())} but the model has {rows} "
            "embedding rows",
            evidence={
                "embedding_rows": rows,
                "max_token_id": int(max_ids.max()),
                "tokenizer_size": tokenizer_size,
                "rows": bad_rows,
            },
            example=ctx.view(bad_rows[0], focus=int(np.argmax(ctx.row(bad_rows[0])["input_ids"]))),
            rows=beyond,
        )
    elif tokenizer_size > rows:
        yield VOCAB_SIZE_MISMATCH.finding(
            f"the tokenizer has {tokenizer_size} tokens but the model only {rows} embedding rows",
            evidence={"embedding_rows": rows, "tokenizer_size": tokenizer_size},
        )


UNTRAINED_SPECIAL_TOKENS = define(
    "untrained-special-tokens",
    severity="error",
    stage="model",
    objectives=SEQUENCES,
    symptom="Loss much higher than base model at step 0, NaNs in half precision, or the model never stops: "
    "template tokens the base model never trained (e.g. Llama-3 base with the instruct template).",
    detects="Special/added tokens that the data uses whose input-embedding rows look untrained: norm below 5% of "
    "the median row norm (zero init), within 5% of the median distance from the mean row (mean init by "
    "resize_token_embeddings), or two or more of them collapsed onto one vector.",
    fix="Initialise those rows (e.g. to the mean embedding) and train them (modules_to_save=['embed_tokens', "
    "'lm_head'] or trainable_token_indices with LoRA), or use the instruct checkpoint the template belongs to.",
    remedy=RemedyDoc(
        "unsafe",
        "Initialises their input and output embedding rows to the mean embedding of the pieces "
        "their text is made of: each its own vector (the repaired folder holds the weights).",
    ),
)

TINY_FRACTION = 0.05


EMBEDDING_CHUNK = 8192  # rows read at a time: no float32 copy of a 152k-row embedding


def untrained_rows(embeddings, ids: list[int]) -> dict[str, list[int]] | None:
    """Which of ``ids`` have embedding rows that look untrained; None when the rows are not all here to read
    (a ZeRO-3 partition or an FSDP shard: the check is not measured, so it says nothing).

    ``near_zero``: norm below 5% of the median row norm (zero-initialised); ``near_mean``: within 5% of the
    median distance from the mean row (``resize_token_embeddings`` initialises new rows at the mean);
    ``collapsed``: two or more of them on the same vector.
    """
    import torch

    weight = embeddings.weight
    if hasattr(weight, "full_tensor") or weight.dim() != 2 or weight.numel() == 0:
        return None
    with torch.no_grad():
        n = weight.shape[0]
        ids = [i for i in ids if i < n]
        if not ids:
            return {"near_zero": [], "near_mean": [], "collapsed": []}
        chunks = range(0, n, EMBEDDING_CHUNK)
        total = sum(weight[lo : lo + EMBEDDING_CHUNK].float().sum(dim=0) for lo in chunks)
        mean = total / n
        norms = torch.cat([weight[lo : lo + EMBEDDING_CHUNK].float().norm(dim=1) for lo in chunks])
        to_mean = torch.cat([(weight[lo : lo + EMBEDDING_CHUNK].float() - mean).norm(dim=1) for lo in chunks])
        median_norm, median_to_mean = float(norms.median()), float(to_mean.median())
        near_zero = [i for i in ids if float(norms[i]) < TINY_FRACTION * median_norm]
        near_mean = [
            i for i in ids if i not in near_zero and float(to_mean[i]) < TINY_FRACTION * median_to_mean
        ]
        rows = weight[ids].float()
        collapsed = []
        if len(ids) >= 2:
            close = torch.cdist(rows, rows) < 1e-3 * max(median_norm, 1e-12)
            close &= ~torch.eye(len(ids), dtype=torch.bool, device=close.device)
            collapsed = [
                i for k, i in enumerate(ids) if bool(close[k].any()) and i not in near_zero + near_mean
            ]
    return {"near_zero": near_zero, "near_mean": near_mean, "collapsed": collapsed}


def used_special_ids(ctx) -> list[int]:
    return ctx.distinct("special_ids")


@UNTRAINED_SPECIAL_TOKENS.check
def check_untrained_special_tokens(ctx):
    if not ctx.has_model:
        return
    used = used_special_ids(ctx)
    if not used:
        return
    if ctx.input_embeddings is None:
        raise NotMeasured(NO_INPUT_EMBEDDINGS)
    health = untrained_rows(ctx.input_embeddings, used)
    if health is None:
        return
    suspect = sorted({i for group in health.values() for i in group})
    if not suspect:
        return
    names = ctx.tokenizer.convert_ids_to_tokens(suspect)
    yield UNTRAINED_SPECIAL_TOKENS.finding(
        f"{len(suspect)} special tokens the data uses look untrained: {', '.join(map(repr, names[:5]))}",
        evidence={"tokens": names, "ids": suspect, **health},
        remedy=embeddings_from_text(ctx.tokenizer, suspect),
    )


NEW_TOKENS_FROZEN = define(
    "new-tokens-frozen",
    severity="error",
    stage="model",
    objectives=ANY,
    symptom="The model never learns the new chat/tool tokens: it keeps emitting garbage where they belong.",
    detects="Tokens added to the tokenizer (ids past its base vocabulary) that the data uses and whose embedding "
    "rows look untrained (see untrained-special-tokens), while the adapter config trains no embeddings (no "
    "embed_tokens/lm_head in modules_to_save or target_modules, no trainable_token_indices), or the embedding "
    "rows do not require grad.",
    fix="With LoRA add `modules_to_save=['embed_tokens', 'lm_head']` or `trainable_token_indices={'embed_tokens': "
    "[ids]}`; without an adapter keep the embeddings trainable.",
)


def adapter_config_of(ctx) -> dict | None:
    """The LoRA/PEFT config in play: the saved adapter's, or the trainer's PeftModel's."""
    import json
    from pathlib import Path

    if ctx.adapter_path:
        path = Path(ctx.adapter_path) / "adapter_config.json"
        if path.is_file():
            return json.loads(path.read_text())
    model = ctx.model if ctx.has_model else None
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        config = next(iter(peft_config.values()))
        return config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return None


def trains_embeddings(config: dict) -> bool:
    def names(value) -> list[str]:
        if value is None:
            return []
        return [value] if isinstance(value, str) else list(value)

    modules = names(config.get("modules_to_save")) + names(config.get("target_modules"))
    if any(
        m in ("embed_tokens", "lm_head", "wte", "word_embeddings") or m.endswith("embed_tokens")
        for m in modules
    ):
        return True
    return bool(config.get("trainable_token_indices"))


@NEW_TOKENS_FROZEN.check
def check_new_tokens_frozen(ctx):
    base = getattr(ctx.tokenizer, "vocab_size", None)
    if not base:
        return
    added = [i for i in used_special_ids(ctx) if i >= base]
    if not added or not ctx.has_model:
        return
    if ctx.input_embeddings is None:
        raise NotMeasured(NO_INPUT_EMBEDDINGS)
    health = untrained_rows(ctx.input_embeddings, added)
    if health is None:
        return
    used = sorted({i for group in health.values() for i in group})  # trained added tokens need no training
    if not used:
        return
    config = adapter_config_of(ctx)
    if config is not None:
        if trains_embeddings(config):
            return
        why = "the adapter config trains no embeddings"
    elif ctx.model_given:
        if ctx.input_embeddings.weight.requires_grad:
            return
        why = "the input embeddings do not require grad"
    else:
        return
    names = ctx.tokenizer.convert_ids_to_tokens(used)
    yield NEW_TOKENS_FROZEN.finding(
        f"{len(used)} added tokens the data uses will not train: {why} ({', '.join(map(repr, names[:4]))})",
        evidence={
            "tokens": names,
            "ids": used,
            "base_vocab_size": base,
            "modules_to_save": (config or {}).get("modules_to_save"),
        },
    )


@INIT_LOSS_OFF_CHANCE.check(applies=lambda ctx: ctx.has_model)
def check_init_loss(ctx):
    measured = ctx.init_loss
    if measured is None or measured["tokens"] == 0:
        return
    vocab = ctx.embedding_rows or len(ctx.tokenizer)
    chance = math.log(vocab)
    loss, entropy = measured["loss"], measured["entropy"]
    evidence = {
        "loss": round(loss, 4),
        "ln_vocab": round(chance, 4),
        "model_entropy": round(entropy, 4),
        "label_entropy": round(measured["label_entropy"], 4),
        "tokens": measured["tokens"],
        "examples": measured.get("examples", len(ctx.sample_indices)),
    }
    if measured.get("top1") is not None:
        evidence["top1"] = round(measured["top1"], 4)
    # A calibrated model's loss is close to its own predictive entropy; a fresh head's is ln(V).
    if far_above_chance(loss, chance):
        yield above_chance(loss, f"far above chance ln(V)={chance:.2f}", measured, evidence)
    elif loss > entropy + max(2.0, 0.5 * chance):
        compared = f"far above the model's own predictive entropy {entropy:.2f} (chance ln(V)={chance:.2f})"
        yield above_chance(loss, compared, measured, evidence)
    elif loss < FAR_BELOW_FRACTION * chance:
        yield below_chance(ctx, loss, chance, evidence)


# Far above: another alignment of the labels that scores far better (half the loss, and a nat less) on a
# quarter of the positions or more is what the labels were meant to be.
ALIGNED_SHARE = 0.25
NOTHING_PREDICTED = 0.02  # the model's top guess right on under 2% of the tokens: it predicts none of them
ALIGNMENT_WHY = {
    "label_before": (
        "labels-shifted",
        "scored one position earlier (each label as the target of its own position) the loss is {other:.2f} "
        "instead of {given:.2f}: the labels were shifted by hand (labels[i] = input_ids[i+1]) and the model "
        "shifts them again",
    ),
    "label_after": (
        "labels-shifted",
        "scored one position later the loss is {other:.2f} instead of {given:.2f}: the labels lag the input by "
        "one position",
    ),
    "input_next": (
        "labels-not-input",
        "scored against the input's own next tokens the loss is {other:.2f} instead of {given:.2f}: the labels "
        "are not the tokens the model reads (built from another sequence or tokenizer, or random ids)",
    ),
}
ABOVE_CHANCE_FIX = {
    "labels-shifted": "Set labels to a copy of input_ids (-100 where no loss is wanted) and let the model shift "
    "them: do not shift them yourself.",
    "labels-not-input": "Build the labels from the same input_ids the model reads (a copy, -100 on the prompt "
    "and the padding): check the collator or the preprocessing that writes them.",
    "nothing-predicted": "Check the weights: that they loaded (no 'newly initialized' warning for layers you "
    "expect trained), that nothing re-initialised or rescaled them after loading (init_weights, a scaled "
    "lm_head), and that the tokenizer is the model's own.",
    "new-data": "Nothing to fix if the data is new to this model on purpose (a new answer style, new content): "
    "expect the loss to start high and fall fast. If it should not be new, check that the tokenizer and chat "
    "template are the ones the model was trained with.",
    "unknown": "Check the labels (not shifted by hand, the same tokens as the input) and the weights (loaded, "
    "not re-initialised).",
}


def above_chance(loss: float, compared: str, measured: dict, evidence: dict):
    """The finding for a step-0 loss far above what the model predicts, with its cause: another alignment of
    the labels that scores far better, a model that predicts nothing, or data new to a trained model."""
    head = f"step-0 loss {loss:.2f} is {compared}"
    top1 = measured.get("top1")
    if top1 is None:  # measured without the detail (an older caller): no cause to name
        cause, why, severity = "unknown", ": labels or init are wrong", None
    elif aligned := better_alignment(measured):
        name, other = aligned
        cause, template = ALIGNMENT_WHY[name]
        why, severity = "; " + template.format(other=other["loss"], given=other["given"]), None
        evidence = {**evidence, "alignment": name, "loss_aligned": round(other["loss"], 4),
                    "aligned_tokens": other["tokens"]}  # fmt: skip
    elif top1 < NOTHING_PREDICTED:
        cause, severity = "nothing-predicted", None
        why = (
            f"; the model's top guess is the label on {top1:.1%} of the tokens and no other alignment of the labels "
            "scores better: it predicts none of them (a broken or rescaled init, weights that did not load, "
            "token ids from another tokenizer)"
        )
    else:
        cause, severity = "new-data", "info"
        why = (
            f", but the model's top guess is the label on {top1:.0%} of the tokens and no other alignment of the "
            "labels scores better: the data is new to this model (a style or content it has not learned)"
        )
    return INIT_LOSS_OFF_CHANCE.finding(
        f"{head}{why}",
        evidence={**evidence, "direction": "above", "cause": cause},
        fix=ABOVE_CHANCE_FIX[cause],
        severity=severity,
    )


def better_alignment(measured: dict) -> tuple[str, dict] | None:
    """The alignment of the labels that scores far better than the labels given (half their loss and a nat
    less, on a quarter of the positions or more); None when none does. A shift by one position is the more
    precise diagnosis: it is preferred to the input's own tokens, which fit shifted labels as well."""
    for name in ALIGNMENT_WHY:  # in order of preference
        other = (measured.get("alignments") or {}).get(name)
        if other is None:
            continue
        covers = other["tokens"] >= max(8, ALIGNED_SHARE * measured["tokens"])
        if covers and other["loss"] < min(other["given"] - 1.0, 0.5 * other["given"]):
            return name, other
    return None


def below_chance(ctx, loss: float, chance: float, evidence: dict):
    """The finding for a step-0 loss far below chance, with its cause measured by blanking the prompts."""
    # What the prompt contributes: blanked, a copied answer can no longer be copied.
    ablation = ctx.prompt_ablation or {}
    blanked, as_is = ablation.get("prompt_blanked"), ablation.get("as_is")
    copied = ablation.get("answer_in_prompt", 0.0)
    if blanked is None:
        cause, why = "unknown", "leakage, or data the model has seen"
    elif blanked > max(2 * as_is, as_is + 1.0) and copied >= ANSWER_IN_PROMPT:
        cause = "answer-in-input"
        why = (
            f"with the prompts blanked it is {blanked:.2f}, and {copied:.0%} of the answers' token pairs are "
            "in their prompts: the model copies the answers from the input (leakage, unless the task is "
            "to quote it)"
        )
    elif blanked > max(2 * as_is, as_is + 1.0):
        cause = "seen-data"
        why = (
            f"with the prompts blanked it is {blanked:.2f}, and only {copied:.0%} of the answers' token pairs are "
            "in their prompts: the model predicts these answers from their prompts without copying them, as a "
            "model trained on these examples or ones like them does (continued fine-tuning on the same kind of "
            "data starts here)"
        )
    else:
        cause = "predictable-without-prompt"
        why = (
            f"and {blanked:.2f} with the prompts blanked: the answers are predictable on their own (data the "
            "model was trained on, or boilerplate labels)"
        )
    return INIT_LOSS_OFF_CHANCE.finding(
        f"step-0 loss {loss:.2f} is far below chance ln(V)={chance:.2f}; {why}",
        evidence={
            **evidence,
            "direction": "below",
            "cause": cause,
            "loss_prompt_blanked": blanked,
            "answer_in_prompt": copied,
        },
        fix=BELOW_CHANCE_FIX[cause],
        severity=None if cause == "answer-in-input" else "warning",
    )


TRAINER_SCALED = 1.5  # a trainer loss 1.5x the model's own cross-entropy is scaled, not noise


@INIT_LOSS_OFF_CHANCE.check(
    # In a run, the callback judges the first step's loss as training_step returned it (Step0Monitor).
    applies=lambda ctx: (
        ctx.trainer is not None and ctx.first_batch is not None and ctx.has_model and not ctx.step0_given
    )
)
def check_trainer_loss(ctx):
    """The loss that trains: the trainer's own compute_loss on the first rows of its first batch, against chance
    and against the model's own cross-entropy on the sampled examples (a scaled or replaced loss starts far above
    chance while the model does not)."""
    loss, measured = ctx.trainer_loss, ctx.init_loss
    vocab = ctx.embedding_rows or len(ctx.tokenizer)
    if loss is None or measured is None or not measured["tokens"] or not math.isfinite(loss):
        return
    chance = math.log(vocab)
    model_loss = measured["loss"]
    if not far_above_chance(loss, chance) or loss < TRAINER_SCALED * model_loss:
        return  # the model's own loss is what is off, if anything: check_init_loss says so with its cause
    yield INIT_LOSS_OFF_CHANCE.finding(
        f"the trainer's compute_loss returns {loss:.2f} on the first rows of its first batch, far above chance "
        f"ln(V)={chance:.2f} and {loss / model_loss:.1f}x the model's own cross-entropy {model_loss:.2f}",
        evidence={
            "trainer_loss": loss,
            "model_loss": model_loss,
            "ratio": loss / model_loss,
            "ln_vocab": chance,
            "compute_loss": f"{type(ctx.trainer).__name__}.compute_loss",
            "direction": "above",
            "cause": "trainer-loss",
        },
        fix="The loss your training step computes is not the model's cross-entropy: check the custom "
        "compute_loss (a scale factor, a sum where a mean belongs, the reduction over micro-batches).",
    )


ANSWER_IN_PROMPT = 0.5  # share of an answer's token pairs found in its prompt: copied, whole or in pieces
BELOW_CHANCE_FIX = {
    "answer-in-input": "Remove the answer from the prompt (check the function or template that builds it; see "
    "label-leakage for verbatim copies). If the task is to quote the input (extractive QA, RAG), this is "
    "expected: pass --task extractive.",
    "seen-data": "Expected when continuing to fine-tune on data like what the model was trained on. Otherwise "
    "check whether it was already trained on these examples (a checkpoint of this run, eval data in its "
    "pretraining): evaluate on examples it has not seen, and fine-tune from the base model.",
    "predictable-without-prompt": "Check whether this model was already trained on these examples (a checkpoint "
    "of this run, eval data in pretraining) and whether the labels are mostly boilerplate (a fixed answer "
    "format, repeated text): train on what the model must learn.",
    "unknown": "Check label-leakage (the answer in the input), train/eval contamination, and whether this "
    "model was already trained on this data.",
}


FAR_BELOW_FRACTION = 0.05


INPUT_IGNORED = define(
    "input-ignored",
    severity="error",
    stage="model",
    symptom="Train and eval loss both flat at or near chance whatever the LR: the model never sees its input.",
    detects="A few sampled examples are scored (with --adapter, by the model with the adapter attached) as they "
    "are and with every input token replaced by one filler token (the labels kept): a model whose loss does "
    "not move at all computes the same thing whatever it reads (a custom forward that ignores input_ids, an "
    "embedding that maps every token to the same vector).",
    fix="Check the model's forward: that it reads input_ids (or inputs_embeds built from them) and that the "
    "input embedding is not constant (a zeroed or frozen-at-zero embedding, weights that failed to load).",
    needs=("vocab-size-mismatch", "adapter-empty", "adapter-base-mismatch"),
)


@INPUT_IGNORED.check(applies=lambda ctx: ctx.has_model)
def check_input_ignored(ctx):
    ablation = ctx.input_ablation
    if ablation is None:
        return
    as_is, blanked = ablation["as_is"], ablation["input_blanked"]
    if abs(as_is - blanked) > 1e-6 * max(1.0, abs(as_is)):
        return
    yield INPUT_IGNORED.finding(
        f"the loss is {as_is:.4f} on {ablation['examples']} examples as they are and {blanked:.4f} with every "
        f"input token replaced by {ablation['filler']!r}: the model's output does not depend on its input",
        evidence={**ablation, "cause": "input-not-reaching-model"},
    )


def far_above_chance(loss: float, chance: float) -> bool:
    """A step-0 loss far above ln(V): worse than a uniform guess by a nat and a quarter of ln(V)."""
    return loss > chance + max(1.0, 0.25 * chance)


INIT_LOSS_ABOVE_BASE = define(
    "init-loss-above-base",
    severity="warning",
    stage="model",
    symptom="Loss much higher than the base model at step 0: the tokenizer or template differs from pretraining.",
    detects="On a sample of conversations (with --adapter, scored by the model with the adapter attached), the "
    "loss on the answer tokens in the training format (chat template) is compared with the loss on the same "
    "answer after the same content as plain text. Fires when the templated loss is more than 0.5 nat and 50% "
    "above the plain one.",
    fix="Use the chat template (and tokenizer) the model was trained with, or the instruct checkpoint the template "
    "belongs to; if the template is new on purpose, expect to train its tokens (see untrained-special-tokens).",
    needs=("vocab-size-mismatch", "adapter-empty", "adapter-base-mismatch"),
)


@INIT_LOSS_ABOVE_BASE.check(
    applies=lambda ctx: ctx.has_model and ctx.fmt in ("messages", "prompt-completion")
)
def check_init_loss_above_base(ctx):
    measured = ctx.template_against_text
    if measured is None:
        return
    in_template, as_text = measured["templated_loss"], measured["plain_loss"]
    if in_template > as_text + 0.5 and in_template > 1.5 * as_text:
        yield INIT_LOSS_ABOVE_BASE.finding(
            f"the answers cost {in_template:.2f} nats/token in the chat template but {as_text:.2f} as plain text",
            evidence={
                "templated_loss": round(in_template, 4),
                "plain_loss": round(as_text, 4),
                "examples": measured["examples"],
            },
        )


@NO_TRAINABLE_PARAMS.check
def check_no_trainable_params(ctx):
    if (
        not ctx.model_given
    ):  # a model loaded from a path is trainable; only a given model object can be frozen
        return
    model = ctx.model
    total = sum(p.numel() for p in model.parameters())
    if total and not any(p.requires_grad for p in model.parameters()):
        yield NO_TRAINABLE_PARAMS.finding(
            f"none of the model's {total:,} parameters requires grad",
            evidence={"parameters": total, "trainable": 0, "model": type(model).__name__},
        )
