"""Reward models (a sequence-classification head with one output, trained on pairs): a head that never trains,
a score read from the wrong token."""

from __future__ import annotations

import numpy as np

from hf_sanity.catalog import define

REWARD_HEAD_FROZEN = define(
    "reward-head-frozen",
    severity="error",
    stage="model",
    objectives={"reward", "sft"},
    symptom="The reward model's loss stays near ln 2 and its accuracy near chance: the randomly initialised "
    "score head never trains.",
    detects="A sequence-classification model (under PEFT or not) whose head (`score`, `classifier`) has no "
    'parameter that requires grad while others do: LoRA without `task_type="SEQ_CLS"` or '
    "`modules_to_save=[\"score\"]` leaves the new head frozen (TRL suppresses the 'newly initialized' warning).",
    fix='Use `LoraConfig(task_type="SEQ_CLS", ...)` (PEFT then trains the head) or add '
    '`modules_to_save=["score"]`; in a full fine-tune, do not freeze the head.',
)

REWARD_SCORE_POSITION = define(
    "reward-score-position",
    severity="error",
    stage="tokens",
    objectives={"reward"},
    symptom="Reward-model accuracy stays near chance, or rewards do not follow the completion.",
    detects="The token the score is pooled from, as transformers pools it (the rightmost token that is not "
    "`config.pad_token_id`), on the pairs as tokenized and right-padded with the tokenizer's pad: "
    "`evidence.cause` `config-pad-differs` (the config's pad id is not the tokenizer's, so a padded row is "
    "scored on padding) or `completion-is-pad` (the completion holds only pad-id tokens, so the score is read "
    "inside the prompt).",
    fix="Set `model.config.pad_token_id = tokenizer.pad_token_id` (TRL's RewardTrainer does it), and use a pad "
    "token that never occurs in the conversations (not EOS when the template writes EOS inside turns).",
)

HEAD_NAMES = ("score", "classifier")


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _head_parameters(model) -> dict[str, bool]:
    """{name: requires_grad} of the classification head's parameters (PEFT's copies included)."""
    return {
        name: p.requires_grad
        for name, p in model.named_parameters()
        if any(part in HEAD_NAMES for part in name.split("."))
    }


def _is_classifier(model) -> bool:
    return type(_base(model)).__name__.endswith("ForSequenceClassification")


@REWARD_HEAD_FROZEN.check(applies=lambda ctx: ctx.model_given and _is_classifier(ctx.model))
def check_reward_head_frozen(ctx):
    model = ctx.model
    head = _head_parameters(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not head or any(head.values()) or not trainable:
        return  # no head found, the head trains, or nothing trains (no-trainable-params says so)
    peft = getattr(model, "peft_config", None)
    task = None
    if isinstance(peft, dict) and peft:
        task = getattr(next(iter(peft.values())), "task_type", None)
    yield REWARD_HEAD_FROZEN.finding(
        f"the {type(_base(model)).__name__} head ({', '.join(sorted(head))}) does not train while "
        f"{len(trainable)} other tensors do" + (f" (PEFT task_type={task})" if peft else ""),
        evidence={
            "head_parameters": sorted(head),
            "trainable_tensors": len(trainable),
            "peft": bool(peft),
            "task_type": str(task) if task is not None else None,
        },
    )


@REWARD_SCORE_POSITION.check(applies=lambda ctx: ctx.pairs is not None and ctx.model_config is not None)
def check_reward_score_position(ctx):
    config = ctx.model_config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    config_pad, tok_pad = getattr(text, "pad_token_id", None), ctx.tokenizer.pad_token_id
    if config_pad is None:
        return  # transformers raises on batches of more than one row: loud, not silent
    if tok_pad is not None and config_pad != tok_pad:
        yield REWARD_SCORE_POSITION.finding(
            f"config.pad_token_id={config_pad} is not the tokenizer's pad id {tok_pad}: every right-padded row is "
            "scored on a padding token (the rightmost token that is not the config's pad)",
            evidence={
                "cause": "config-pad-differs",
                "config_pad_token_id": config_pad,
                "tokenizer_pad_token_id": tok_pad,
            },
        )
        return
    pairs = ctx.pairs
    inside = []
    for i in ctx.sample_indices[:256]:
        ids = np.asarray(ctx.row(i)["input_ids"])
        keep = np.flatnonzero(ids != config_pad)
        pooled = int(keep[-1]) if len(keep) else -1
        if pooled < int(pairs.prompt_len[i]):
            inside.append(i)
    if inside:
        yield REWARD_SCORE_POSITION.finding(
            f"in {len(inside)} sampled pairs the score is pooled inside the prompt: every completion token is the "
            f"pad id {config_pad}",
            evidence={"cause": "completion-is-pad", "rows": inside[:10], "pad_token_id": config_pad},
            example=ctx.view(inside[0]),
        )
