"""What the protocol trains: 2-10 examples of the user's real pipeline, and a :class:`Learner` per run (a working
copy of the model with the setup's own optimizer class and loss on one collated batch).

Regularisation is switched off on every working copy (dropout modules and dropout probabilities 0, weight
decay 0) and the learning-rate schedule is not used: the protocol asks whether the examples *can* be learned.
How a pipeline is built from a trainer, objects or paths is `hf_sanity.protocol.build`.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_sanity import progress
from hf_sanity.constants import IGNORE_INDEX

DEFAULT_MAX_GRAD_NORM = 1.0  # TrainingArguments' default


@dataclass
class Learner:
    """A working copy of the model with its optimizer and the setup's loss on one collated batch (what the
    overfit, the LR sweep and the precision check train or evaluate)."""

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
    lr: float  # the overfit LR: the given one or the setup's fixed step-1 LR, then the one step 4's search reports
    configured_lr: float | None  # the LR the user trains with, where known
    binder: Callable[[Any, float], Learner] = field(repr=False)
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
    lr_search: bool = False  # no overfit LR was given: step 4 may search one (hf_sanity.protocol.lr_search)

    def working_copy(self, dtype=None):
        """A deep copy of the model in train mode with regularisation off (optionally cast to ``dtype``)."""
        memo: dict[int, Any] = {}
        try:
            with progress.phase("copying the model"):
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

    def bind(self, model, lr: float) -> Learner:
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
            "lr_search": self.lr_search,
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


# -- working copies --------------------------------------------------------------------------------
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


# -- batches ---------------------------------------------------------------------------------------
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


def _cpu(batch: Mapping[str, Any]) -> dict:
    return {k: (v.detach().cpu() if hasattr(v, "detach") else v) for k, v in batch.items()}


def data_floor(batches: list[dict]):
    """What the examples themselves forbid (:class:`~hf_sanity.rules.protocol.DataFloor`): a causal model's
    prediction at a position depends on the tokens up to it only, so supervised positions with one identical
    prefix and different targets cannot all be predicted; the best any model can do there is the targets'
    empirical distribution. Prefixes restart where ``position_ids`` do (packed examples) and skip positions the
    attention mask leaves out (padding). None when the batches carry no labels."""
    from hf_sanity.rules.protocol import DataFloor

    prefixes: dict[tuple[int, int], int] = {}  # (parent prefix, token) -> prefix id: a trie of the inputs
    targets: dict[int, Counter] = {}
    for batch in batches:
        if not hasattr(batch.get("labels"), "tolist") or not hasattr(batch.get("input_ids"), "tolist"):
            return None
        ids, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
        mask = (
            batch["attention_mask"].tolist() if getattr(batch.get("attention_mask"), "ndim", 0) == 2 else None
        )
        positions = batch["position_ids"].tolist() if hasattr(batch.get("position_ids"), "tolist") else None
        for row in range(len(ids)):
            node = 0
            for t in range(len(ids[row]) - 1):
                if positions is not None and positions[row][t] == 0:
                    node = 0
                if mask is not None and not mask[row][t]:
                    continue
                node = prefixes.setdefault((node, ids[row][t]), len(prefixes) + 1)
                target = labels[row][t + 1]
                if target != IGNORE_INDEX:
                    targets.setdefault(node, Counter())[target] += 1
    total = sum(sum(c.values()) for c in targets.values())
    if not total:
        return None
    shared = [c for c in targets.values() if len(c) > 1]
    nats = sum(n * math.log(sum(c.values()) / n) for c in shared for n in c.values())
    return DataFloor(
        nats=nats / total, positions=sum(sum(c.values()) for c in shared), prefixes=len(shared), tokens=total
    )
