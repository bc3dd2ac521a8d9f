"""Measurements that run the model on a changed input and compare: what the padding, the prompt, the input
and the trainer's own loss do to what the model computes. Each runs in `untouched` (eval mode, no gradient,
RNG, modes and grads as they were); the context calls them once and keeps the result."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.measure.losses import token_loss


def left_padding_shift(model, batch: dict[str, Any], row: int) -> dict[str, Any]:
    """Row ``row`` of ``batch`` (left-padded) run as the batch holds it and alone, without its padding: the
    largest difference of their logits on its tokens, against the logits' scale. They differ when the model's
    positions count the padding (no position_ids given, absolute position embeddings); rotary embeddings are
    relative and agree to rounding."""
    import torch

    from hf_sanity.measure.tensors import forward_kwargs, model_device, to_device
    from hf_sanity.untouched import untouched

    mask = batch["attention_mask"][row].bool()
    ids = batch["input_ids"][row]
    device = model_device(model)
    padded = to_device({"input_ids": ids[None], "attention_mask": mask[None].long()}, device)
    alone = to_device({"input_ids": ids[mask][None]}, device)
    with untouched(model), torch.no_grad():
        as_batched = model(**forward_kwargs(model, padded, use_cache=False)).logits[0, mask.to(device)]
        by_itself = model(**forward_kwargs(model, alone, use_cache=False)).logits[0]
    return {
        "max_logit_difference": float((as_batched.float() - by_itself.float()).abs().max()),
        "logit_scale": float(by_itself.float().abs().max()) or 1.0,
        "pads": int((~mask).sum()),
        "half": by_itself.dtype in (torch.float16, torch.bfloat16),
    }


ABLATION_TOKENS = 256  # answer positions scored per variant (a paired comparison: nats apart when it matters)


class InputAblation:
    """The loss on the supervised tokens of ``seqs`` ((input_ids, labels) pairs) as they are (``as_is``), with
    everything else (the prompt and the template's scaffolding) replaced by one filler token
    (``prompt_blanked``), and with every input token replaced (``input_blanked``): what the prompt contributes
    to predicting the answer, and whether the input reaches the model at all. Each variant is measured once,
    when first asked for, on at most ``max_tokens`` positions. ``model`` gives the model to score, as a
    context manager (the context's ``model_as_trained``); ``batches`` pads pairs into tensor batches."""

    def __init__(
        self,
        model: Callable[[], Any],
        tokenizer,
        seqs: Sequence[tuple[list[int], list[int]]],
        batches: Callable[[list], list[dict[str, Any]]],
        *,
        max_tokens: int = ABLATION_TOKENS,
    ) -> None:
        self.model, self.seqs, self.batches, self.max_tokens = model, list(seqs), batches, max_tokens
        self.filler = next(
            t
            for t in (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.eos_token_id, 0)
            if t is not None
        )
        self.filler_token = tokenizer.convert_ids_to_tokens(self.filler)
        self._keep = {tokenizer.bos_token_id}
        self._losses: dict[str, float | None] = {}

    def measured(self, *variants: str) -> dict[str, Any] | None:
        """The loss of each of ``variants`` and what they were measured on; None without supervised tokens."""
        out: dict[str, Any] = {}
        for variant in variants:
            out[variant] = self.loss(variant)
            if out[variant] is None:
                return None
        out.update(examples=len(self.seqs), filler=self.filler_token)
        if "prompt_blanked" in variants:
            out["answer_in_prompt"] = float(np.mean([answer_in_prompt(i, lab) for i, lab in self.seqs]))
        return out

    def loss(self, variant: str) -> float | None:
        if variant not in self._losses:
            # The variants share their labels, so a cap scores the same positions in each: a paired comparison.
            with self.model() as model:
                result = token_loss(model, self.batches(self._blanked(variant)), max_tokens=self.max_tokens)
            self._losses[variant] = result["loss"] if result["tokens"] else None
        return self._losses[variant]

    def _blanked(self, variant: str) -> list[tuple[list[int], list[int]]]:
        if variant == "as_is":
            return self.seqs
        everything = {"prompt_blanked": False, "input_blanked": True}[variant]
        return [
            (
                [
                    i if i in self._keep or (not everything and lab != IGNORE_INDEX) else self.filler
                    for i, lab in zip(ids, labels, strict=True)
                ],
                labels,
            )
            for ids, labels in self.seqs
        ]


def answer_in_prompt(ids: Sequence[int], labels: Sequence[int]) -> float:
    """The share of an example's supervised token pairs (bigrams) that also occur in its unsupervised part:
    1.0 when the answer is copied into the prompt, in pieces or whole; ~0 for an answer the prompt does not
    contain."""
    supervised = [i for i, lab in enumerate(labels) if lab != IGNORE_INDEX]
    pairs = [(ids[i - 1], ids[i]) for i in supervised if i > 0]
    if not pairs:
        return 0.0
    prompt = {
        (ids[i - 1], ids[i])
        for i in range(1, len(ids))
        if labels[i] == IGNORE_INDEX and labels[i - 1] == IGNORE_INDEX
    }
    return sum(pair in prompt for pair in pairs) / len(pairs)


@dataclass(frozen=True)
class TrainerStep:
    """What the trainer's own ``compute_loss`` made of one batch: the loss that trains, and the ``aux_loss`` of
    the output the model's forward returned inside it (the router's load-balancing loss of a mixture of experts;
    None when the forward returned none)."""

    loss: float
    aux_loss: float | None


# Set by transformers' training loop only (the micro-batches of the step being run): TRL 1.16's compute_loss reads
# it to spread a mixture of experts' load-balancing loss over them.
ACCUMULATION_STEPS = "current_gradient_accumulation_steps"
# What TRL's compute_loss appends to on each call (the metrics it logs next, the tokens it counts).
TRAINER_TALLIES = ("_metrics", "_total_train_tokens")


@contextlib.contextmanager
def as_in_a_step(trainer):
    """The trainer as its training loop has it when it calls ``compute_loss``, for a call made outside the loop:
    ``current_gradient_accumulation_steps`` is 1 (the batch measured stands for a whole step, its
    ``num_items_in_batch`` counts its own tokens), and what compute_loss tallies on the trainer is put back after,
    so the metrics the run logs hold none of hf-sanity's calls."""
    missing = object()
    saved = {name: vars(trainer).get(name, missing) for name in (ACCUMULATION_STEPS, *TRAINER_TALLIES)}
    kept = {name: copy.deepcopy(value) for name, value in saved.items() if value is not missing}
    setattr(trainer, ACCUMULATION_STEPS, 1)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                vars(trainer).pop(name, None)
            else:
                setattr(trainer, name, kept[name])


def trainer_step(trainer, batch: dict[str, Any]) -> TrainerStep:
    """What the trainer's own ``compute_loss`` returns on ``batch`` (with ``num_items_in_batch``, as Trainer
    passes it): the loss that trains, which a custom compute_loss may scale or replace; and what the model's
    forward returned inside it."""
    import inspect

    import torch

    from hf_sanity.measure.moe import as_number, returned_aux
    from hf_sanity.measure.tensors import model_device, to_device
    from hf_sanity.untouched import untouched

    model = trainer.model
    device = model_device(model)
    inputs = to_device({k: v for k, v in batch.items() if hasattr(v, "shape")}, device)
    extra = {}
    if "num_items_in_batch" in inspect.signature(trainer.compute_loss).parameters:
        items = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        # Trainer counts the items of every process and compute_loss multiplies the loss back by their number
        # (average_tokens_across_devices): this batch stands for each process's.
        if getattr(getattr(trainer, "args", None), "average_tokens_across_devices", False):
            items *= int(getattr(getattr(trainer, "accelerator", None), "num_processes", 1) or 1)
        extra["num_items_in_batch"] = torch.tensor(items, device=device)
    returned: list[Any] = []
    hook = model.register_forward_hook(lambda module, args, output: returned.append(returned_aux(output)))
    try:
        with untouched(model), torch.no_grad(), as_in_a_step(trainer):
            loss = trainer.compute_loss(model, dict(inputs), **extra)
    finally:
        hook.remove()
    loss = loss[0] if isinstance(loss, tuple) else loss
    return TrainerStep(float(loss.detach().float().mean()), as_number(returned[-1]) if returned else None)


TEMPLATE_TOKENS = (
    256  # answer tokens scored each way (the gap init-loss-above-base looks for: 0.5 nat and 50%)
)


def template_against_text(
    examples: Iterable[tuple[list[dict] | None, Sequence[Any], list[int]]],
    tokenizer,
    stop_ids,
    model: Callable[[], Any],
    batches: Callable[[list], list[dict[str, Any]]],
) -> dict[str, Any] | None:
    """The loss on each conversation's last answer in the chat template against the same answer after the same
    content as plain text. ``examples`` gives (messages, assistant spans, input_ids) per conversation;
    ``model`` the model to score as a context manager (the context's ``model_as_trained``); ``batches`` pads
    (input_ids, labels) pairs. None with fewer than two conversations that end in an answer with text."""
    from hf_sanity.measure.encode import text_of

    templated, plain = [], []
    for messages, spans, input_ids in examples:
        # A last turn that is only a tool call (`content: null`, valid OpenAI format) has no answer text to
        # score as plain text.
        if not messages or not spans or messages[-1].get("role") != "assistant":
            continue
        answer_text = messages[-1].get("content")
        if not isinstance(answer_text, str) or not answer_text:
            continue
        span = spans[-1]
        stop = span.stop - 1 if input_ids[span.stop - 1] in stop_ids else span.stop
        ids = input_ids[:stop]
        templated.append((ids, [IGNORE_INDEX] * span.start + ids[span.start : stop]))
        # The context as plain text: each turn's text and its tool calls (a call turn's content is often null).
        context = "\n\n".join(text_of(m) for m in messages[:-1]) + "\n\n"
        prefix = tokenizer(context)["input_ids"]
        answer = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
        plain.append((prefix + answer, [IGNORE_INDEX] * len(prefix) + answer))
    if len(templated) < 2:
        return None
    with model() as scored:
        in_template, as_text = (
            token_loss(scored, batches(seqs), max_tokens=TEMPLATE_TOKENS)["loss"]
            for seqs in (templated, plain)
        )
    return {"templated_loss": in_template, "plain_loss": as_text, "examples": len(templated)}
