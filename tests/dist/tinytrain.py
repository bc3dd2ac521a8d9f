"""Tiny Trainer runs for the callback tests (in-process and under torchrun): one tiny Llama, short
conversations with the loss on the answers, CPU, fixed seed, no checkpoints and no reporting."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from typing import Any


def setup(dropout: float = 0.0):
    """(model, tokenizer) of the cached tiny ChatML setup; ``dropout`` > 0 turns attention dropout on."""
    from hf_sanity.testing import tiny_setup

    model, tok = tiny_setup("chatml", "distinct")
    if dropout:
        model.config.attention_dropout = dropout
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = dropout
    return model, tok


def rows(tok, n: int = 32, *, loss_on: str = "completion") -> list[dict[str, list[int]]]:
    """Tokenized conversations; labels on the last answer (``completion``) or everywhere (``all``)."""
    from hf_sanity.testing import demo_conversations

    out = []
    for row in demo_conversations(n):
        ids = tok.apply_chat_template(row["messages"])["input_ids"]
        prompt = len(tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True)["input_ids"])
        labels = list(ids) if loss_on == "all" else [-100] * prompt + ids[prompt:]
        out.append({"input_ids": list(ids), "labels": labels})
    return out


def args(output_dir, **overrides):
    from transformers import TrainingArguments

    base: dict[str, Any] = dict(
        output_dir=str(output_dir), max_steps=12, per_device_train_batch_size=4, learning_rate=3e-3,
        logging_steps=5, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        lr_scheduler_type="constant", data_seed=0,
    )  # fmt: skip
    base.update(overrides)
    return TrainingArguments(**base)


def trainer(
    output_dir, *, callbacks=(), model=None, tok=None, data=None, cls=None, collator=None, **overrides
):
    """A Trainer (or ``cls``) over the tiny setup; ``overrides`` go to TrainingArguments, except the Trainer
    keywords ``optimizers``, ``eval_dataset`` and ``compute_metrics``."""
    import datasets
    from transformers import DataCollatorForSeq2Seq, Trainer

    if model is None or tok is None:
        model, tok = setup()
    extra = {k: overrides.pop(k) for k in ("optimizers", "eval_dataset", "compute_metrics") if k in overrides}
    if isinstance(extra.get("eval_dataset"), list):
        extra["eval_dataset"] = datasets.Dataset.from_list(extra["eval_dataset"])
    data = data if data is not None else rows(tok)
    return (cls or Trainer)(
        model=model,
        args=args(output_dir, **overrides),
        train_dataset=datasets.Dataset.from_list(data) if isinstance(data, list) else data,
        data_collator=collator or DataCollatorForSeq2Seq(tok),
        processing_class=tok,
        callbacks=list(callbacks),
        **extra,
    )


def vocab_beyond_trainer(output_dir, *, callbacks=(), **overrides):
    """The tiny setup after ``tokenizer.add_special_tokens`` without ``model.resize_token_embeddings``: every row
    holds the new token near its start, an id the embedding has no row for."""
    model, tok = setup()
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    added = tok.convert_tokens_to_ids("<tool_call>")
    data = rows(tok, 16)
    for row in data:
        row["input_ids"][1] = added
    return trainer(output_dir, callbacks=callbacks, model=model, tok=tok, data=data, **overrides)


def step_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def embeds_collator(tok, model, nan_at_batch: int | None = None):
    """Feeds ``inputs_embeds`` (looked up in a frozen copy of the embedding table) instead of ``input_ids``;
    the ``nan_at_batch``-th batch this collator builds (1-based) holds one NaN."""
    from transformers import DataCollatorForSeq2Seq

    table = model.get_input_embeddings().weight.detach().clone()
    base = DataCollatorForSeq2Seq(tok)
    calls = [0]

    def collate(features):
        batch = base(features)
        calls[0] += 1
        embeds = table[batch.pop("input_ids")].clone()
        if calls[0] == nan_at_batch:
            embeds[0, 2, 5] = float("nan")
        batch["inputs_embeds"] = embeds
        return batch

    return collate
