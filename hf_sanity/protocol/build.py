"""Three ways to the protocol's :class:`~hf_sanity.protocol.pipeline.Pipeline`, one per kind of setup:

* :func:`from_trainer`: the examples are the first rows of ``trainer.get_train_dataloader()`` (the trainer's
  collator, exactly as the model receives them); the loss is ``trainer.compute_loss``; the optimizer is the
  trainer's own (rebuilt over the copy's parameters, same class and param groups) or, when the trainer has
  none yet, ``trainer.create_optimizer`` run for the copy. All of it on a shallow copy of the trainer bound
  to a deep copy of the model: the user's trainer and model are never touched.
* :func:`from_objects`: a model, a tokenizer and dataset rows; rows are tokenized by the measurement core's
  :class:`~hf_sanity.measure.encode.Encoder` (as TRL does: completion-only labels unless ``loss_on="all"``),
  right-padded (labels -100), optionally with a LoRA adapter; the optimizer is AdamW, the loss the model's.
* :func:`from_paths`: the CLI's way: the same, loaded from paths with `hf_sanity.drivers.load`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hf_sanity.errors import UserInputError
from hf_sanity.measure.tensors import pad_batches, pad_id
from hf_sanity.protocol.lora import adapter_dict, attach_lora, is_peft, lora_config
from hf_sanity.protocol.optimizers import adamw, remap_optimizer, unwrapped
from hf_sanity.protocol.options import MIN_EXAMPLES, ProtocolOptions
from hf_sanity.protocol.pipeline import DEFAULT_MAX_GRAD_NORM, Learner, NullOptimizer, Pipeline, _cpu

# Step 1's LR when none is given, fixed per setup: a few times the usual training LR, for an adapter and for
# full fine-tuning (a pretrained model memorises a handful of examples at these within a few hundred steps).
# Not the trainer's own LR: step 1 asks whether the pipeline can learn, with one documented rate; the LR itself
# is step 4's question, searched only after steps 2 and 3 pass.
DEFAULT_LR_ADAPTER = 1e-3
DEFAULT_LR_FULL = 1e-4
MODEL_INPUTS = ("input_ids", "attention_mask", "labels", "position_ids", "token_type_ids")


def model_ref_of(model) -> str | None:
    base = model.get_base_model() if is_peft(model) and hasattr(model, "get_base_model") else model
    ref = getattr(getattr(base, "config", None), "_name_or_path", None)
    return str(ref) if ref else None


def _local_dir(ref: str | None) -> Path | None:
    if not ref:
        return None
    path = Path(os.path.expanduser(ref))
    return path.resolve() if path.is_dir() else None


def default_lr(model) -> float:
    return DEFAULT_LR_ADAPTER if is_peft(model) else DEFAULT_LR_FULL


def take_examples(batches: Iterable[Mapping[str, Any]], n: int) -> tuple[list[dict], int]:
    """The first ``n`` examples of a stream of collated batches: whole batches, the last one cut to size
    where its rows are examples (packed or padding-free batches are kept whole)."""
    from hf_sanity.measure.batches import batch_rows

    out: list[dict] = []
    count = 0
    for batch in batches:
        batch = dict(batch)
        ids = batch.get("input_ids")
        if ids is None or not hasattr(ids, "shape"):
            raise UserInputError(
                "the trainer's batches have no input_ids tensor; hf-sanity needs token batches"
            )
        rows = int(ids.shape[0])
        packed = rows == 1 or any(k.startswith(("cu_seq_lens", "max_length")) for k in batch)
        need = n - count
        if not packed and rows > need:
            batch = {
                k: (v[:need] if hasattr(v, "shape") and v.ndim > 0 and v.shape[0] == rows else v)
                for k, v in batch.items()
            }
        tensors = {k: v for k, v in batch.items() if hasattr(v, "shape")}
        out.append(_cpu(batch))
        count += max(len(batch_rows(tensors)), 1)
        if count >= n:
            break
    return out, count


def encode_examples(
    tokenizer, dataset, n: int, *, fmt=None, loss_on="completion", max_len=None, alpaca_template=None
) -> list[dict]:
    """The first ``n`` rows that tokenize, as TRL would tokenize them (labels included)."""
    from hf_sanity.measure.encode import EncodeOptions, Encoder
    from hf_sanity.measure.formats import detect_format
    from hf_sanity.measure.sources import as_dataset

    dataset = as_dataset(dataset)
    if len(dataset) == 0:
        raise UserInputError("the dataset is empty")
    fmt = detect_format(dataset.column_names, fmt, features=dataset.features)
    options = EncodeOptions(fmt=fmt, loss_on=loss_on, max_len=max_len, alpaca_template=alpaca_template)
    encoder = Encoder(tokenizer, options)
    rows, errors = [], []
    for i in range(min(len(dataset), 20 * n)):
        encoded = encoder.encode(dataset[i])
        if encoded["error"]:
            errors.append(f"row {i}: {encoded['error']}")
            continue
        rows.append({"input_ids": encoded["input_ids"][:max_len], "labels": encoded["labels"][:max_len]})
        if len(rows) == n:
            break
    if not rows:
        raise UserInputError(f"no row of the dataset can be tokenized ({errors[0]})")
    if len(rows) < MIN_EXAMPLES:
        raise UserInputError(
            f"the overfit test needs at least {MIN_EXAMPLES} examples; the dataset gives {len(rows)}"
        )
    return rows


def _model_loss(model):
    from hf_sanity.measure.tensors import forward_kwargs

    def loss(batch: dict):
        # Only what the forward names: a custom `forward(input_ids, labels=None)` gets no attention_mask.
        out = model(**forward_kwargs(model, batch, labels=True))
        value = out.loss if hasattr(out, "loss") else out[0]
        if value is None:
            raise ValueError("the model returned no loss (are labels in the batch?)")
        return value

    return loss


def from_objects(
    model,
    tokenizer,
    dataset,
    *,
    options: ProtocolOptions | None = None,
    lora=None,
    optimizer=None,
    model_ref: str | None = None,
    **option_values,
) -> Pipeline:
    """A pipeline from a model, a tokenizer and dataset rows (a `datasets.Dataset` or a list of dicts)."""
    opts = ProtocolOptions.of(options, **option_values)
    if model is None or tokenizer is None or dataset is None:
        raise UserInputError("overfit/diagnose need trainer=... or model=, tokenizer= and dataset=")
    if lora is not None:
        if isinstance(lora, dict):
            from peft import LoraConfig

            lora = LoraConfig(**{"task_type": "CAUSAL_LM", **lora})
        if optimizer is not None:
            raise UserInputError(
                "pass lora= or optimizer=, not both (the optimizer must see the adapter's weights)"
            )
        model = attach_lora(copy.deepcopy(model), lora)  # the user's model is never modified
    rows = encode_examples(
        tokenizer, dataset, opts.n, fmt=opts.format, loss_on=opts.loss_on, max_len=opts.max_len,
        alpaca_template=opts.alpaca_template,
    )  # fmt: skip
    batch = pad_batches([(r["input_ids"], r["labels"]) for r in rows], pad_id(tokenizer))[0]
    configured = opts.lr
    if opts.lr is None and optimizer is not None:
        configured = optimizer.param_groups[0]["lr"]
    overfit_lr = opts.lr if opts.lr is not None else default_lr(model)
    user_optimizer = optimizer

    def binder(copy_model, rate: float) -> Learner:
        if user_optimizer is not None:
            opt = remap_optimizer(user_optimizer, model, copy_model, rate)
        else:
            opt = adamw(copy_model, rate)
        return Learner(copy_model, opt, _model_loss(copy_model))

    ref = model_ref or model_ref_of(model)
    return Pipeline(
        model=model,
        tokenizer=tokenizer,
        batches=[batch],
        examples=len(rows),
        lr=overfit_lr,
        configured_lr=configured,
        binder=binder,
        source="objects",
        optimizer_name=type(optimizer).__name__ if optimizer is not None else "AdamW",
        max_len=opts.max_len,
        model_ref=ref,
        adapter=adapter_dict(model),
        protected=[p for p in (_local_dir(ref),) if p is not None],
        lr_search=opts.lr is None,
    )


def from_paths(
    model: str,
    dataset: str,
    *,
    options: ProtocolOptions | None = None,
    tokenizer: str | None = None,
    split: str = "train",
    adapter_config: str | os.PathLike | None = None,
    lora_r: int | None = None,
    lora_alpha: int | None = None,
    lora_target: list[str] | None = None,
    trust_remote_code: bool = False,
    command: list[str] | None = None,
) -> Pipeline:
    """The CLI's pipeline: everything loaded from paths, bad input raised as one-line errors before any work."""
    from hf_sanity.drivers.load import from_paths as load_paths

    lora = lora_config(adapter_config, lora_r, lora_alpha, lora_target)
    setup = load_paths(model, dataset, tokenizer=tokenizer, split=split, trust_remote_code=trust_remote_code)
    rows_model = setup.load_model()
    if lora is not None:
        rows_model = attach_lora(rows_model, lora)  # loaded here: nobody else holds it
    pipeline = from_objects(rows_model, setup.tokenizer, setup.dataset, options=options)
    pipeline.source = "paths"
    pipeline.model_ref = model
    pipeline.command = command
    pipeline.protected = [p for p in (_local_dir(model), _local_dir(tokenizer), _local_dir(dataset)) if p]
    return pipeline


def from_trainer(trainer, *, options: ProtocolOptions | None = None) -> Pipeline:
    """A pipeline from a (Hugging Face / TRL) Trainer: its batches, its loss, its optimizer class."""
    from hf_sanity.untouched import preserved_rng

    opts = options or ProtocolOptions()
    tokenizer = getattr(trainer, "processing_class", None) or getattr(
        getattr(trainer, "data_collator", None), "tokenizer", None
    )
    with preserved_rng():
        try:
            loader = trainer.get_train_dataloader()
        except ValueError as exc:
            raise UserInputError(f"cannot draw batches from the trainer: {exc}") from None
        batches, count = take_examples(loader, opts.n)
    if not batches:
        raise UserInputError("the trainer's train dataloader is empty")
    args = trainer.args
    user_optimizer = getattr(trainer, "optimizer", None)
    if user_optimizer is not None:
        user_optimizer = unwrapped(user_optimizer)  # after train(): accelerate's wrapper around it
    # a scheduler keeps the LR it started from in "initial_lr": after train(), "lr" is where it decayed to
    first_group = user_optimizer.param_groups[0] if user_optimizer is not None else {}
    configured = first_group.get("initial_lr", first_group.get("lr", args.learning_rate))
    overfit_lr = opts.lr if opts.lr is not None else default_lr(trainer.model)
    original = trainer.model

    def binder(model, rate: float) -> Learner:
        worker = copy.copy(trainer)  # shares the collator and the accelerator, owns the rest it writes
        worker.model = worker.model_wrapped = model
        worker.optimizer = worker.lr_scheduler = None
        worker.args = copy.copy(args)
        worker.args.weight_decay = 0.0
        worker.args.learning_rate = rate
        worker.state = copy.deepcopy(trainer.state)
        for name in ("_metrics", "_total_train_tokens"):
            if name in vars(trainer):
                setattr(worker, name, copy.deepcopy(vars(trainer)[name]))
        if user_optimizer is not None:
            opt = remap_optimizer(user_optimizer, original, model, rate)
        elif any(p.requires_grad for p in model.parameters()):
            opt = worker.create_optimizer()
        else:  # nothing to optimise: torch refuses an optimizer without parameters
            opt = NullOptimizer()
        worker.optimizer = opt

        def loss(batch: dict):
            return worker.compute_loss(model, dict(batch))

        return Learner(model, opt, loss)

    return Pipeline(
        model=original,
        tokenizer=tokenizer,
        batches=batches,
        examples=count,
        lr=overfit_lr,
        configured_lr=configured,
        binder=binder,
        source="trainer",
        optimizer_name=type(user_optimizer).__name__ if user_optimizer is not None else str(args.optim),
        max_grad_norm=getattr(args, "max_grad_norm", DEFAULT_MAX_GRAD_NORM) or None,
        max_len=getattr(args, "max_length", None) or getattr(args, "max_seq_length", None),
        precision=trainer_precision(args),
        model_ref=model_ref_of(original),
        adapter=adapter_dict(original),
        protected=[p for p in (_local_dir(model_ref_of(original)),) if p is not None],
        lr_search=opts.lr is None,
    )


def trainer_precision(args) -> str | None:
    if getattr(args, "bf16", False):
        return "bf16"
    return "fp16" if getattr(args, "fp16", False) else None


def build(
    pipeline: Pipeline | None = None,
    *,
    trainer=None,
    model=None,
    tokenizer=None,
    dataset=None,
    options: ProtocolOptions | None = None,
    lora=None,
    optimizer=None,
) -> Pipeline:
    """The pipeline of ``overfit()``/``diagnose()``: given, from a trainer, or from objects."""
    if pipeline is not None:
        return pipeline
    if trainer is not None:
        if lora is not None:
            raise UserInputError("with trainer=..., the adapter is the trainer's model's: do not pass lora=")
        return from_trainer(trainer, options=options)
    return from_objects(model, tokenizer, dataset, options=options, lora=lora, optimizer=optimizer)
