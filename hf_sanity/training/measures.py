"""What SanityCallback measures on the model and optimizer at a step, for the step detectors: the gradient
path (who requires grad, got one, is stepped), the learning rate, the update-to-weight ratio of a few sampled
tensors, stale gradients, the label counts behind the label entropy, and train-only modules.

Each measurement returns device tensors or plain numbers; the callback records them without synchronising
(see `hf_sanity.training.recorder`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hf_sanity.constants import IGNORE_INDEX


def optimizer_ids(optimizer) -> set[int] | None:
    """ids of the parameters in the optimizer's param groups (None when there is no optimizer to look at)."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer
        groups = getattr(inner, "param_groups", None)
    if groups is None:
        return None
    return {id(p) for group in groups for p in group.get("params", [])}


def max_lr(optimizer) -> float | None:
    groups = getattr(optimizer, "param_groups", None) or []
    rates = [g.get("lr") for g in groups if isinstance(g.get("lr"), (int, float))]
    return float(max(rates)) if rates else None


def gradient_path(trainable: Sequence[Any], in_optimizer: set[int] | None) -> dict[str, int]:
    """Right before the optimizer step: how many parameters require grad, got one, and will be stepped."""
    required = [p for p in trainable if p.requires_grad]
    with_grad = [p for p in required if p.grad is not None]
    out = {"n_trainable": len(required), "n_with_grad": len(with_grad)}
    if in_optimizer is not None:
        out["n_in_optimizer"] = sum(1 for p in with_grad if id(p) in in_optimizer)
    return out


def spread(items: Sequence[Any], n: int) -> list[Any]:
    """``n`` items evenly spread over ``items`` (first and last included)."""
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def snapshot(params: Sequence[Any]) -> list[Any]:
    return [p.detach().clone() for p in params]


def measure_update(params: Sequence[Any], before: Sequence[Any]):
    """(median |Δw|/|w| over the tensors with a non-zero norm, whether any weight changed), as device tensors."""
    import torch

    diff = torch.stack([(p.detach().float() - old.float()).norm() for p, old in zip(params, before)])
    norm = torch.stack([old.float().norm() for old in before])
    ratio = torch.where(norm > 0, diff / norm.clamp_min(1e-30), torch.full_like(diff, math.nan)).nanmedian()
    return ratio, ((diff > 0) | diff.isnan()).any()  # NaN weights did change


def present_norm(params) -> Any:
    """Norm of the gradients ``params`` already hold when a step begins (0.0 when they were cleared)."""
    import torch

    grads = [p.grad.detach().float() for p in params if p.grad is not None]
    return torch.stack([g.norm() for g in grads]).norm() if grads else 0.0


def train_only_modules(model) -> int:
    """Modules that behave differently in train and eval mode: dropout with p > 0, batch norm."""
    import torch

    count = 0
    for module in model.modules():
        if (isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0) or isinstance(
            module, torch.nn.modules.batchnorm._BatchNorm
        ):
            count += 1
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "attn_pdrop", "resid_pdrop"):
        if isinstance(getattr(config, key, None), (int, float)) and getattr(config, key) > 0:
            count += 1
    return count


def vocab_size(model) -> int | None:
    """The model's input-embedding rows (the V of ln V), where it has embeddings."""
    if model is None or not hasattr(model, "get_input_embeddings"):
        return None
    return getattr(model.get_input_embeddings(), "num_embeddings", None)


def count_labels(counts, labels) -> None:
    """Add a batch's supervised label ids (after the shift) into ``counts``, a device vector over the vocabulary."""
    if not hasattr(labels, "dim") or labels.dim() < 2 or labels.is_floating_point():
        return
    shifted = labels[..., 1:].reshape(-1).to(counts.device, non_blocking=True)
    ids = shifted.clamp(0, counts.numel() - 1)
    counts.index_add_(0, ids, (shifted != IGNORE_INDEX).float())


def label_entropy(counts):
    """The entropy of the label distribution counted so far (a device scalar)."""
    p = counts / counts.sum().clamp_min(1)
    return -(p * p.clamp_min(1e-30).log()).sum()


SAMPLED_PARAMS = 4  # tensors sampled for the update ratio and the stale-gradient check
SAMPLE_MAX_ELEMENTS = 1 << 24  # ... each at most 16M elements (cloned at measured steps)
EARLY_MEASURE_STEPS = 10  # the update ratio is measured at every one of the first steps, then every check


class StepSampler:
    """The model-side measurements of one run, set up once at train begin: which parameters train, a few of
    them sampled for the update ratio and stale gradients, the optimizer's membership, the label counts and
    the precision in use. Every method records into the recorder; nothing synchronises."""

    def __init__(self, trainer, model, optimizer, args, state, wants) -> None:
        import contextlib

        import torch

        self.model = model
        params = list(model.named_parameters())
        self.total_params = sum(p.numel() for _, p in params)
        self.trainable = [(n, p) for n, p in params if p.requires_grad]
        accelerator = getattr(trainer, "accelerator", None)
        precision = getattr(accelerator, "mixed_precision", "no") if accelerator is not None else "no"
        native = bool(getattr(accelerator, "native_amp", False))
        self.half = (native and precision in ("fp16", "bf16")) or any(
            p.dtype in (torch.float16, torch.bfloat16) for _, p in params[:8]
        )
        self.scaler = getattr(accelerator, "scaler", None) is not None
        self.sharded = bool(
            getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False)
        )
        self.warmup_steps = 0
        with contextlib.suppress(Exception):
            self.warmup_steps = int(args.get_warmup_steps(state.max_steps or 0))
        self.accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        self.vocab_size = vocab_size(model)
        self.stale_sample = (
            spread([p for _, p in self.trainable], SAMPLED_PARAMS) if wants("stale-gradients") else []
        )
        # Sharded optimizers (FSDP, DeepSpeed) hold flattened copies: membership cannot be checked by identity.
        self.optimizer_ids = None if self.sharded else optimizer_ids(optimizer)
        stepped = [p for _, p in self.trainable if self.optimizer_ids is None or id(p) in self.optimizer_ids]
        small = [p for p in stepped if p.numel() <= SAMPLE_MAX_ELEMENTS] or sorted(
            stepped, key=lambda p: p.numel()
        )[:1]
        self.update_sample = spread(small, SAMPLED_PARAMS) if wants("loss-flat", "lr-too-low") else []
        self.watch_path = wants("lr-zero", "lr-too-low", "loss-flat")
        self.label_counts = None
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        rows = getattr(embeddings, "num_embeddings", None)
        if rows and wants("loss-plateau-prior"):
            device = params[0][1].device if params else torch.device("cpu")
            self.label_counts = torch.zeros(rows, dtype=torch.float32, device=device)
        self._snapshot = None

    def training_setup(self, world_size: int):
        """What the step detectors are built with."""
        from hf_sanity.rules.training.base import TrainingSetup

        return TrainingSetup(self.warmup_steps, world_size, self.vocab_size, self.accumulation)

    def setup_values(self) -> dict[str, Any]:
        """What the gradient path looks like at train begin (for no-trainable-params, optimizer-missing-params)."""
        names = [n for n, _ in self.trainable]
        inside = (
            None
            if self.optimizer_ids is None
            else [n for n, p in self.trainable if id(p) in self.optimizer_ids]
        )
        return {"total_params": self.total_params, "trainable": names, "in_optimizer": inside}

    def step_begins(self, recorder, step: int) -> None:
        if self.stale_sample:
            recorder.push(step, "stale_norm", present_norm(self.stale_sample))

    def batch(self, batch) -> None:
        if self.label_counts is not None and "labels" in batch:
            count_labels(self.label_counts, batch["labels"])

    def before_optimizer(self, recorder, step: int, optimizer, *, check_every: int) -> None:
        lr = max_lr(optimizer)
        if lr is not None:
            recorder.push(step, "lr", lr)
        if self.watch_path:
            for key, value in gradient_path([p for _, p in self.trainable], self.optimizer_ids).items():
                recorder.push(step, key, value)
        measure = step <= EARLY_MEASURE_STEPS or step % check_every == 0
        self._snapshot = snapshot(self.update_sample) if self.update_sample and measure else None

    def after_optimizer(self, recorder, step: int, *, skipped: bool) -> None:
        if self._snapshot is not None and not skipped:
            ratio, updated = measure_update(self.update_sample, self._snapshot)
            recorder.push(step, "update_ratio", ratio)
            recorder.push(step, "updated", updated)
        self._snapshot = None

    def push_label_entropy(self, recorder, step: int) -> None:
        """The entropy of the labels seen so far (for loss-plateau-prior), recorded at ``step``."""
        if self.label_counts is not None:
            recorder.push(step, "label_entropy", label_entropy(self.label_counts))
