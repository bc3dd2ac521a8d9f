"""Tiny models fine-tuned on the demo conversations, correctly and with one planted bug each: fixtures for
testing what a fine-tuned model says (`hf-sanity outputs`), offline and in seconds.

>>> from hf_sanity.testing import trained_setup, held_out_conversations
>>> model, tokenizer = trained_setup("clean")          # answers and stops; built once (~15 s on CPU), cached
>>> model, tokenizer = trained_setup("eos-masked")     # answers, then never stops
>>> rows = held_out_conversations(32)                  # demo conversations the fixtures were not trained on

Variants (``VARIANTS``), each a full fine-tune of the tiny ChatML model (``TinyConfig()``) on
``demo_conversations(256)`` with the loss on the assistant turns, except for its bug:

* ``clean``: trained correctly: it answers, stops, echoes nothing and writes no markers;
* ``eos-masked``: the end-of-turn token carries no loss (pad == EOS masked by the collator): it never stops;
* ``pad-eos``: the classic pad == EOS bug on a model that speaks its chat format: trained on whole conversations
  (every token in the loss, as a language-modelling collator puts it; pad == EOS), its end-of-turn token then
  never predicted (its LM-head row zeroed, standing in for an end of turn the fine-tune never trained): served
  with the template it was trained with, it answers, then writes the next turn itself (``<|im_start|>user``);
* ``prompt-in-answer``: each supervised answer starts with the user's message (a completion built as prompt +
  answer puts the prompt in the loss): it echoes the user turn, then answers;
* ``truncated``: the answers were cut in half with their end of turn kept (truncation that re-appends EOS):
  it stops mid-sentence;
* ``wrong-template``: the ``clean`` weights saved with the Llama-3-style tokenizer and its generation config
  (a model folder that carries the base model's tokenizer): served, it writes ``<|im_end|>`` and never stops;
* ``undertrained``: trained correctly for 15 steps only: it repeats one word over and over.

:func:`trained_adapter_dir` is a LoRA adapter trained on top of ``clean`` (it opens every answer with
"Sure."), for checks that an adapter is applied. :func:`fine_tune` is the training loop itself, to build
fixtures of your own.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

from hf_sanity.testing.data import demo_conversations
from hf_sanity.testing.factory import (
    TinyConfig,
    _build_atomically,
    _key,
    build_tokenizer,
    cache_root,
    tiny_model_for,
)

Variant = Literal[
    "clean", "eos-masked", "pad-eos", "prompt-in-answer", "truncated", "wrong-template", "undertrained"
]
VARIANTS: tuple[str, ...] = (
    "clean",
    "eos-masked",
    "pad-eos",
    "prompt-in-answer",
    "truncated",
    "wrong-template",
    "undertrained",
)
UNDERTRAINED_STEPS = 15
TRAINING_ROWS = 256
STEPS = 250
LEARNING_RATE = 3e-3
BATCH_SIZE = 32
ADAPTER_PREFIX = "Sure."
# The adapter learns to open every answer with "Sure."; at half this rate some answers still did not.
ADAPTER_STEPS = 160
ADAPTER_LR = 6e-3
TRAINED_REVISION = 1  # bump when what a fixture folder holds changes


def training_conversations(variant: str = "clean", seed: int = 0) -> list[dict[str, Any]]:
    """The rows a variant is trained on: the demo conversations, with the variant's answers."""
    rows = demo_conversations(TRAINING_ROWS, seed)
    if variant == "prompt-in-answer":
        return [{"messages": _rewrite(r["messages"], lambda user, a: f"{user} {a}")} for r in rows]
    if variant == "truncated":
        return [{"messages": _rewrite(r["messages"], lambda user, a: _half(a))} for r in rows]
    if variant == "adapter":
        return [{"messages": _rewrite(r["messages"], lambda user, a: f"{ADAPTER_PREFIX} {a}")} for r in rows]
    return rows


def _rewrite(messages, answer) -> list[dict[str, str]]:
    out, user = [], ""
    for m in messages:
        if m["role"] == "user":
            user = m["content"]
        if m["role"] == "assistant":
            m = {**m, "content": answer(user, m["content"])}
        out.append(m)
    return out


def _half(answer: str) -> str:
    """The first half of an answer's words (at least two), cut mid-sentence: no final punctuation."""
    words = answer.split()
    return " ".join(words[: max(2, len(words) // 2)]).rstrip(".!?,")


def held_out_conversations(n: int = 32, seed: int = 1) -> list[dict[str, Any]]:
    """``n`` demo conversations that none of the fixtures was trained on (the same kinds of questions, in
    other rows)."""
    seen = {repr(r["messages"]) for r in demo_conversations(TRAINING_ROWS, 0)}
    rng_rows = demo_conversations(n * 4, seed)
    rows = [r for r in rng_rows if repr(r["messages"]) not in seen]
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} held-out conversations for seed {seed}; ask for fewer")
    return rows[:n]


def supervised_labels(
    tokenizer, messages, *, mask_end_of_turn: bool = False, whole: bool = False
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation: the loss on each assistant turn (up to its end of turn),
    found by rendering the conversation up to the turn with the generation prompt (``whole``: on every
    token); ``mask_end_of_turn`` drops the end-of-turn token from the labels (the pad == EOS collator bug)."""
    from hf_sanity.measure.markers import derive_markers

    def count(part, **kwargs) -> int:
        rendered = tokenizer.apply_chat_template(part, tokenize=False, **kwargs) if part else ""
        return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    labels = [-100] * len(ids)
    eot = set(derive_markers(tokenizer).end_of_turn)
    if whole:
        return ids, [-100 if mask_end_of_turn and i in eot else i for i in ids]
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = count(messages[:i], add_generation_prompt=True)
        end = count(messages[: i + 1])
        for k in range(start, end):
            if not (mask_end_of_turn and ids[k] in eot):
                labels[k] = ids[k]
    return ids, labels


def fine_tune(
    model,
    tokenizer,
    rows: list[dict[str, Any]],
    *,
    steps: int = STEPS,
    lr: float = LEARNING_RATE,
    batch_size: int = BATCH_SIZE,
    seed: int = 0,
    mask_end_of_turn: bool = False,
    whole: bool = False,
):
    """Fine-tune ``model`` in place on conversation ``rows`` (loss on the assistant turns, or with ``whole`` on
    every token, see :func:`supervised_labels`) with AdamW at a constant ``lr``, on the CPU, one thread,
    deterministically; returns the model in eval mode. Only the parameters that require grad train (a PEFT
    model: its adapter)."""
    import torch

    examples = [
        supervised_labels(tokenizer, r["messages"], mask_end_of_turn=mask_end_of_turn, whole=whole)
        for r in rows
    ]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rng = random.Random(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model trains several times faster on one thread
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
            model.train()
            for _ in range(steps):
                batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
                width = max(len(ids) for ids, _ in batch)
                input_ids = torch.full((len(batch), width), pad, dtype=torch.long, device="cpu")
                labels = torch.full((len(batch), width), -100, dtype=torch.long, device="cpu")
                mask = torch.zeros((len(batch), width), dtype=torch.long, device="cpu")
                for j, (ids, labs) in enumerate(batch):
                    input_ids[j, : len(ids)] = torch.tensor(ids, dtype=torch.long, device="cpu")
                    labels[j, : len(ids)] = torch.tensor(labs, dtype=torch.long, device="cpu")
                    mask[j, : len(ids)] = 1
                loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return model


def trained_model_dir(variant: Variant = "clean", seed: int = 0) -> Path:
    """A cached folder with the fine-tuned tiny model of ``variant`` and the tokenizer and generation config
    it is served with (see the module's doc), loadable with ``from_pretrained``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    parts = dict(
        variant=variant, seed=seed, steps=STEPS, lr=LEARNING_RATE, batch=BATCH_SIZE, rev=TRAINED_REVISION
    )
    final = cache_root() / f"trained-{variant}-{_key(**parts)}"

    def build(folder: Path) -> None:
        if variant == "wrong-template":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(trained_model_dir("clean", seed))
            served = build_tokenizer("llama3")
            model.generation_config.eos_token_id = served.eos_token_id  # as the Llama-3 folder ships it
            served.save_pretrained(folder)
            model.save_pretrained(folder)
            return
        tokenizer = build_tokenizer("chatml", "eos" if variant == "pad-eos" else "distinct")
        model = tiny_model_for(tokenizer, TinyConfig(seed=seed))
        rows = training_conversations(variant, seed)
        steps = UNDERTRAINED_STEPS if variant == "undertrained" else STEPS
        fine_tune(
            model, tokenizer, rows, steps=steps, seed=seed, mask_end_of_turn=variant == "eos-masked",
            whole=variant == "pad-eos",
        )  # fmt: skip
        if variant == "pad-eos":
            _never_predict(model, tokenizer.eos_token_id)
        tokenizer.save_pretrained(folder)
        model.save_pretrained(folder)

    return _build_atomically(final, build)


def _never_predict(model, token_id: int) -> None:
    """Zero the LM-head row of ``token_id`` (an untied head): its logit is 0 wherever the model stands."""
    import torch

    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        raise ValueError(
            "the LM head is tied to the input embeddings: zeroing its row would change the inputs"
        )
    with torch.no_grad():
        head.weight[token_id] = 0


def trained_setup(variant: Variant = "clean", seed: int = 0):
    """``(model, tokenizer)`` of :func:`trained_model_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = trained_model_dir(variant, seed)
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def trained_adapter_dir(seed: int = 0) -> Path:
    """A cached LoRA adapter folder (peft's ``save_pretrained``), trained on top of ``trained_model_dir("clean",
    seed)`` to open every answer with "Sure.": with it applied, the outputs differ from the base model's."""
    parts = dict(variant="adapter", seed=seed, steps=ADAPTER_STEPS, lr=ADAPTER_LR, rev=TRAINED_REVISION)
    final = cache_root() / f"trained-adapter-{_key(**parts)}"

    def build(folder: Path) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base_dir = trained_model_dir("clean", seed)
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # LoRA's A matrices draw from the global generator
            model = get_peft_model(base, lora)
        rows = training_conversations("adapter", seed)
        fine_tune(model, tokenizer, rows, steps=ADAPTER_STEPS, lr=ADAPTER_LR, seed=seed)
        model.save_pretrained(folder)

    # _build_atomically treats a folder with config.json as built; an adapter has adapter_config.json.
    if (final / "adapter_config.json").is_file():
        return final
    return _build_atomically(final, build)
