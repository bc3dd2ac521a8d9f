"""The pipeline the protocol trains: 2-10 examples of the real pipeline, and a way to train a copy of the model
on them with the setup's own loss and optimizer class.

Three ways in, one :class:`Pipeline` out:

* :func:`from_trainer`: the examples are the first rows of ``trainer.get_train_dataloader()`` (the trainer's
  collator, exactly as the model receives them); the loss is ``trainer.compute_loss``; the optimizer is the
  trainer's own (rebuilt over the copy's parameters, same class and param groups) or, when the trainer has
  none yet, ``trainer.create_optimizer`` run for the copy. All of it on a shallow copy of the trainer bound
  to a deep copy of the model: the user's trainer and model are never touched.
* :func:`from_objects`: a model, a tokenizer and dataset rows; rows are tokenized by the preflight
  :class:`~hf_sanity.preflight.encode.Encoder` (as TRL does: completion-only labels unless ``loss_on="all"``),
  right-padded (labels -100), optionally with a LoRA adapter; the optimizer is AdamW, the loss the model's.
* :func:`from_paths`: the CLI's way: the same, loaded from paths with `hf_sanity.preflight.sources`.

Regularisation is switched off on every working copy (dropout modules and dropout probabilities 0, weight
decay 0) and the learning-rate schedule is not used: the protocol asks whether the examples *can* be learned.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_sanity.errors import UserInputError
from hf_sanity.tokenview import IGNORE_INDEX

MIN_EXAMPLES, MAX_EXAMPLES = 2, 10
# Overfit learning rates when none is given: a few times the usual training LR (the test only has to memorise
# a handful of examples, fast), for an adapter and for full fine-tuning. A trainer's own LR is used when larger.
DEFAULT_LR_ADAPTER = 1e-3
DEFAULT_LR_FULL = 1e-4
DEFAULT_MAX_GRAD_NORM = 1.0  # TrainingArguments' default
MODEL_INPUTS = ("input_ids", "attention_mask", "labels", "position_ids", "token_type_ids")


@dataclass
class Bound:
    """A working copy of the model with its optimizer and the setup's loss on one collated batch."""

    model: Any
    optimizer: Any
    loss: Callable[[dict], Any]


@dataclass
class Pipeline:
    """What the protocol trains: the user's model (read, never modified), the examples, and how to bind a copy."""

    model: Any
    tokenizer: Any
    batches: list[dict]  # the examples as collated batches (CPU tensors), usually one
    examples: int
    lr: float  # the overfit learning rate
    configured_lr: float | None  # the LR the user trains with, where known
    binder: Callable[[Any, float], Bound] = field(repr=False)
    source: str = "objects"  # trainer | objects | paths
    optimizer_name: str = "AdamW"
    max_grad_norm: float | None = DEFAULT_MAX_GRAD_NORM
    max_len: int | None = None
    precision: str | None = None  # the half format the trainer is configured with (bf16/fp16)
    model_ref: str | None = None  # where the model was loaded from (for the reproduction script)
    adapter: dict | None = None  # the LoRA config, as a dict (for the reproduction script)
    command: list[str] | None = None  # the command line that built it
    protected: list[Path] = field(default_factory=list)  # folders nothing may be written into
    dropouts_off: int | None = None  # dropouts that were on in the model and are off in its working copies

    def working_copy(self, dtype=None):
        """A deep copy of the model in train mode with regularisation off (optionally cast to ``dtype``)."""
        memo: dict[int, Any] = {}
        try:
            model = copy.deepcopy(self.model, memo)
        except Exception as exc:
            raise RuntimeError(
                f"hf-sanity works on a copy of the model and cannot copy this one ({type(exc).__name__}: {exc})"
            ) from exc
        rebind_forwards(model, memo)
        if dtype is not None:
            model = model.to(dtype)
        self.dropouts_off = regularisation_off(model)
        model.train()
        return model

    def bind(self, model, lr: float) -> Bound:
        bound = self.binder(model, lr)
        if not isinstance(bound.optimizer, NullOptimizer):
            self.optimizer_name = type(bound.optimizer).__name__  # what the setup really builds
        for group in getattr(bound.optimizer, "param_groups", []):
            group["lr"] = lr
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        return bound

    @property
    def vocab_size(self) -> int | None:
        return vocab_size(self.model, self.tokenizer)

    def describe(self) -> dict[str, Any]:
        params = list(self.model.parameters())
        return {
            "source": self.source,
            "examples": self.examples,
            "batches": len(self.batches),
            "optimizer": self.optimizer_name,
            "lr": self.lr,
            "configured_lr": self.configured_lr,
            "max_grad_norm": self.max_grad_norm,
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "params": sum(p.numel() for p in params),
            "adapter": (self.adapter or {}).get("peft_type") if self.adapter else None,
            "model": self.model_ref or type(self.model).__name__,
            "max_len": self.max_len,
            "dropouts_off": self.dropouts_off,
        }


class NullOptimizer:
    """Stands in when there is nothing to optimise (no trainable parameter): steps do nothing."""

    def __init__(self):
        self.param_groups: list[dict] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        pass


# -- helpers ---------------------------------------------------------------------------------------
def _rebound(value, memo: dict[int, Any], depth: int = 0):
    """``value`` with every reference to an original object replaced by its copy (through bound methods and
    the closures of functions, a few levels deep)."""
    import types

    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, types.MethodType) and id(value.__self__) in memo:
        return types.MethodType(_rebound(value.__func__, memo, depth + 1), memo[id(value.__self__)])
    if isinstance(value, types.FunctionType) and value.__closure__ and depth < 4:
        cells = []
        changed = False
        for cell in value.__closure__:
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(cell)
                continue
            new = _rebound(content, memo, depth + 1)
            changed |= new is not content
            cells.append(types.CellType(new) if new is not content else cell)
        if changed:
            func = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__,
                                      tuple(cells))  # fmt: skip
            func.__kwdefaults__ = value.__kwdefaults__
            func.__dict__.update(value.__dict__)
            func.__qualname__ = value.__qualname__
            return func
    return value


def rebind_forwards(model, memo: dict[int, Any]) -> int:
    """Point patched ``forward`` methods of a deep copy at the copy. A wrapper installed on the instance (TRL's
    fused LM head, for one) keeps the original model's ``forward`` in its closure, which ``deepcopy`` does not
    follow: the copy would run the original's modules. Returns how many were rebound."""
    import types

    count = 0
    for module in model.modules():
        forward = vars(module).get("forward")
        if isinstance(forward, types.MethodType):
            func = _rebound(forward.__func__, memo)
            if func is not forward.__func__:
                module.forward = types.MethodType(func, module)
                count += 1
    return count


def regularisation_off(model) -> int:
    """Dropout to 0 everywhere (modules, attention-dropout attributes, the config): returns how many were on."""
    import torch

    switched = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            switched += module.p > 0
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float) and not isinstance(value, bool):
                switched += value > 0
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for name in list(vars(config)):
            value = getattr(config, name, None)
            if "dropout" in name and isinstance(value, float):
                setattr(config, name, 0.0)
    return int(switched)


def vocab_size(model, tokenizer=None) -> int | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None and weight.ndim == 2:
        return int(weight.shape[0])
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if size:
        return int(size)
    return len(tokenizer) if tokenizer is not None else None


def supervised_count(batch: Mapping[str, Any]) -> int | None:
    """Label positions that carry loss, after the shift (the first position is never predicted)."""
    labels = batch.get("labels")
    if labels is None or not hasattr(labels, "shape"):
        return None
    if labels.ndim >= 2:
        return int((labels[..., 1:] != IGNORE_INDEX).sum())
    return int((labels != IGNORE_INDEX).sum())


def label_positions(batch: Mapping[str, Any]) -> int:
    labels = batch.get("labels")
    if labels is None or not hasattr(labels, "shape"):
        return 0
    return int(labels[..., 1:].numel()) if labels.ndim >= 2 else int(labels.numel())


def to_device(batch: Mapping[str, Any], device) -> dict:
    return {k: (v.to(device) if hasattr(v, "to") and hasattr(v, "shape") else v) for k, v in batch.items()}


def model_device(model):
    import torch

    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _cpu(batch: Mapping[str, Any]) -> dict:
    return {k: (v.detach().cpu() if hasattr(v, "detach") else v) for k, v in batch.items()}


def check_options(n: int, steps: int, lr: float | None, max_len: int | None = None) -> None:
    if not MIN_EXAMPLES <= n <= MAX_EXAMPLES:
        raise UserInputError(f"--n must be between {MIN_EXAMPLES} and {MAX_EXAMPLES} examples, got {n}")
    if steps < 1:
        raise UserInputError(f"--steps must be at least 1, got {steps}")
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise UserInputError(f"--lr must be a positive number, got {lr}")
    if max_len is not None and max_len <= 0:
        raise UserInputError(f"--max-len must be positive, got {max_len}")


def is_peft(model) -> bool:
    return isinstance(getattr(model, "peft_config", None), dict) and bool(model.peft_config)


def adapter_dict(model) -> dict | None:
    if not is_peft(model):
        return None
    config = next(iter(model.peft_config.values()))
    out = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return {k: (sorted(v) if isinstance(v, set) else getattr(v, "value", v)) for k, v in out.items()}


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


# -- examples --------------------------------------------------------------------------------------
def take_examples(batches: Iterable[Mapping[str, Any]], n: int) -> tuple[list[dict], int]:
    """The first ``n`` examples of a stream of collated batches: whole batches, the last one cut to size
    where its rows are examples (packed or padding-free batches are kept whole)."""
    from hf_sanity.preflight.trainer_batches import batch_rows

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


def collate(tokenizer, rows: list[dict[str, list[int]]]) -> dict:
    """Right-padded tensors: pad id in input_ids, -100 in labels, 0 in attention_mask."""
    import torch

    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.tensor(row["input_ids"])
        labels[i, :n] = torch.tensor(row["labels"])
        mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def encode_examples(
    tokenizer, dataset, n: int, *, fmt=None, loss_on="completion", max_len=None
) -> list[dict]:
    """The first ``n`` rows that tokenize, as TRL would tokenize them (labels included)."""
    import datasets

    from hf_sanity.preflight.encode import EncodeOptions, Encoder
    from hf_sanity.preflight.formats import detect_format

    if loss_on not in ("completion", "all"):
        raise UserInputError(f"--loss-on must be 'completion' or 'all', got {loss_on!r}")
    if isinstance(dataset, list):
        dataset = datasets.Dataset.from_list(dataset)
    if len(dataset) == 0:
        raise UserInputError("the dataset is empty")
    fmt = detect_format(dataset.column_names, fmt)
    encoder = Encoder(tokenizer, EncodeOptions(fmt=fmt, loss_on=loss_on, max_len=max_len))
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


# -- LoRA ------------------------------------------------------------------------------------------
def lora_config(
    adapter_config: str | os.PathLike | None = None,
    r: int | None = None,
    alpha: int | None = None,
    target: list[str] | None = None,
):
    """A peft LoraConfig from an adapter_config.json (file or folder) or from --lora-r/--lora-alpha/--lora-target."""
    if adapter_config is None and r is None:
        if alpha is not None or target:
            raise UserInputError("--lora-alpha/--lora-target need --lora-r (or pass --adapter-config)")
        return None
    if adapter_config is not None and r is not None:
        raise UserInputError("pass --adapter-config or --lora-r, not both")
    from peft import LoraConfig

    if adapter_config is not None:
        import json

        path = Path(adapter_config)
        if path.is_dir():
            path = path / "adapter_config.json"
        if not path.is_file():
            raise UserInputError(
                f"adapter config {str(adapter_config)!r} does not exist; pass adapter_config.json"
            )
        try:
            values = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserInputError(f"cannot read adapter config {str(path)!r}: {exc}") from None
        if not isinstance(values, dict):
            raise UserInputError(f"adapter config {str(path)!r} is not a JSON object")
        peft_type = str(values.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise UserInputError(
                f"adapter config {str(path)!r} is {peft_type}; only LoRA configs are supported"
            )
        known = set(LoraConfig.__dataclass_fields__)
        kwargs = {
            k: v
            for k, v in values.items()
            if k in known and k not in ("peft_type", "base_model_name_or_path")
        }
        kwargs.setdefault("task_type", "CAUSAL_LM")
    else:
        if r <= 0:
            raise UserInputError(f"--lora-r must be positive, got {r}")
        targets = [t for value in (target or []) for t in value.split(",") if t.strip()]
        kwargs = {
            "r": r,
            "lora_alpha": alpha if alpha is not None else 2 * r,
            "target_modules": targets if targets and targets != ["all-linear"] else "all-linear",
            "task_type": "CAUSAL_LM",
        }
    try:
        return LoraConfig(**kwargs)
    except Exception as exc:
        raise UserInputError(f"invalid LoRA config: {type(exc).__name__}: {exc}") from None


def attach_lora(model, config):
    import warnings

    from peft import get_peft_model

    try:
        with warnings.catch_warnings():  # peft reads a deprecated transformers attribute
            warnings.simplefilter("ignore", FutureWarning)
            return get_peft_model(model, config)
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserInputError(f"cannot attach the LoRA adapter: {text}") from None


# -- optimizers ------------------------------------------------------------------------------------
def adamw(model, lr: float):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if params else NullOptimizer()


def remap_optimizer(optimizer, original, model, lr: float):
    """The user's optimizer rebuilt over ``model`` (a copy of ``original``): same class, same param groups (by
    parameter name), fresh state. Parameters the original model does not own are dropped (counted)."""
    names = {id(p): n for n, p in original.named_parameters()}
    copied = dict(model.named_parameters())
    groups, foreign = [], 0
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None or name not in copied:
                foreign += 1
                continue
            params.append(copied[name])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params, "lr": lr})
    if not any(g["params"] for g in groups):
        rebuilt = NullOptimizer()
        rebuilt.param_groups = groups
    else:
        rebuilt = _same_class(optimizer, [g for g in groups if g["params"]], lr)
    rebuilt._hf_sanity_foreign = foreign
    return rebuilt


def _same_class(optimizer, groups: list[dict], lr: float):
    """A fresh optimizer of ``optimizer``'s class over ``groups``, with its defaults."""
    import inspect

    import torch

    cls = type(optimizer)
    defaults = {k: v for k, v in optimizer.defaults.items() if k != "lr"}
    try:
        accepted = inspect.signature(cls.__init__).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            defaults = {k: v for k, v in defaults.items() if k in accepted}
        return cls(groups, lr=lr, **defaults)
    except Exception:  # a constructor we cannot call: the same class, initialised as torch's base class does
        rebuilt = cls.__new__(cls)
        torch.optim.Optimizer.__init__(rebuilt, groups, {**optimizer.defaults, "lr": lr})
        return rebuilt


# -- builders --------------------------------------------------------------------------------------
def _model_loss(model):
    import inspect

    try:
        names = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        names = set(MODEL_INPUTS)

    def loss(batch: dict):
        out = model(**{k: v for k, v in batch.items() if k in names or k in MODEL_INPUTS[:3]})
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
    n: int = 8,
    lr: float | None = None,
    max_len: int | None = None,
    loss_on: str = "completion",
    format: str | None = None,
    lora=None,
    optimizer=None,
    model_ref: str | None = None,
    steps: int = 300,
) -> Pipeline:
    """A pipeline from a model, a tokenizer and dataset rows (a `datasets.Dataset` or a list of dicts)."""
    check_options(n, steps, lr, max_len)
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
    rows = encode_examples(tokenizer, dataset, n, fmt=format, loss_on=loss_on, max_len=max_len)
    batch = collate(tokenizer, rows)
    configured = lr
    if lr is None and optimizer is not None:
        configured = optimizer.param_groups[0]["lr"]
    overfit_lr = lr if lr is not None else max(configured or 0.0, default_lr(model))
    user_optimizer = optimizer

    def binder(copy_model, rate: float) -> Bound:
        if user_optimizer is not None:
            opt = remap_optimizer(user_optimizer, model, copy_model, rate)
        else:
            opt = adamw(copy_model, rate)
        return Bound(copy_model, opt, _model_loss(copy_model))

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
        max_len=max_len,
        model_ref=ref,
        adapter=adapter_dict(model),
        protected=[p for p in (_local_dir(ref),) if p is not None],
    )


def from_paths(
    model: str,
    dataset: str,
    *,
    tokenizer: str | None = None,
    split: str = "train",
    n: int = 8,
    steps: int = 300,
    lr: float | None = None,
    max_len: int | None = None,
    loss_on: str = "completion",
    format: str | None = None,
    adapter_config: str | os.PathLike | None = None,
    lora_r: int | None = None,
    lora_alpha: int | None = None,
    lora_target: list[str] | None = None,
    trust_remote_code: bool = False,
    command: list[str] | None = None,
) -> Pipeline:
    """The CLI's pipeline: everything loaded from paths, bad input raised as one-line errors before any work."""
    from hf_sanity.preflight.sources import load_config, load_dataset_ref, load_model, load_tokenizer

    check_options(n, steps, lr, max_len)
    lora = lora_config(adapter_config, lora_r, lora_alpha, lora_target)
    # a broken model folder fails before the data is read
    load_config(model, trust_remote_code=trust_remote_code)
    tok = load_tokenizer(tokenizer or model, trust_remote_code=trust_remote_code)
    data = load_dataset_ref(dataset, split)
    rows_model = load_model(model, trust_remote_code=trust_remote_code)
    if lora is not None:
        rows_model = attach_lora(rows_model, lora)  # loaded here: nobody else holds it
    pipeline = from_objects(
        rows_model, tok, data, n=n, lr=lr, max_len=max_len, loss_on=loss_on, format=format, steps=steps
    )
    pipeline.source = "paths"
    pipeline.model_ref = model
    pipeline.command = command
    pipeline.protected = [p for p in (_local_dir(model), _local_dir(tokenizer), _local_dir(dataset)) if p]
    return pipeline


def from_trainer(trainer, *, n: int = 8, lr: float | None = None, steps: int = 300) -> Pipeline:
    """A pipeline from a (Hugging Face / TRL) Trainer: its batches, its loss, its optimizer class."""
    from hf_sanity.rng import preserved_rng

    check_options(n, steps, lr)
    tokenizer = getattr(trainer, "processing_class", None) or getattr(
        getattr(trainer, "data_collator", None), "tokenizer", None
    )
    with preserved_rng():
        try:
            loader = trainer.get_train_dataloader()
        except ValueError as exc:
            raise UserInputError(f"cannot draw batches from the trainer: {exc}") from None
        batches, count = take_examples(loader, n)
    if not batches:
        raise UserInputError("the trainer's train dataloader is empty")
    args = trainer.args
    user_optimizer = getattr(trainer, "optimizer", None)
    configured = user_optimizer.param_groups[0]["lr"] if user_optimizer is not None else args.learning_rate
    overfit_lr = lr if lr is not None else max(configured or 0.0, default_lr(trainer.model))
    original = trainer.model

    def binder(model, rate: float) -> Bound:
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

        return Bound(model, opt, loss)

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
    n: int = 8,
    steps: int = 300,
    lr: float | None = None,
    **options,
) -> Pipeline:
    """The pipeline of ``overfit()``/``diagnose()``: given, from a trainer, or from objects."""
    if pipeline is not None:
        return pipeline
    if trainer is not None:
        if options.get("lora") is not None:
            raise UserInputError("with trainer=..., the adapter is the trainer's model's: do not pass lora=")
        return from_trainer(trainer, n=n, lr=lr, steps=steps)
    return from_objects(model, tokenizer, dataset, n=n, lr=lr, steps=steps, **options)
