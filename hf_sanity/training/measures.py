"""What SanityCallback measures on the model and optimizer at a step, for the step detectors: the gradient
path (who requires grad, got one, is stepped), the learning rate, the update-to-weight ratio of a few sampled
tensors, stale gradients, the label counts behind the label entropy, and train-only modules.

Each measurement returns device tensors or plain numbers; the callback records them without synchronising
(see `hf_sanity.training.recorder`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import Any

from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.measure.objective import SFT_OBJECTIVE
from hf_sanity.measure.tensors import strided
from hf_sanity.training import shards
from hf_sanity.training.shards import full_numel, local_tensor, squares


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
    """Right before the optimizer step: how many parameters require grad, got one, and will be stepped. (It
    runs at every step and reads two attributes of every trainable tensor: the loops run in C.)"""
    required = list(compress(trainable, map(_requires_grad, trainable)))
    with_grad = list(compress(required, map(is_not, map(_grad, required), repeat(None))))
    out = {"n_trainable": len(required), "n_with_grad": len(with_grad)}
    if in_optimizer is not None:
        out["n_in_optimizer"] = sum(map(in_optimizer.__contains__, map(id, with_grad)))
    return out


_requires_grad, _grad = attrgetter("requires_grad"), attrgetter("grad")


def spread(items: Sequence[Any], n: int) -> list[Any]:
    """``n`` items evenly spread over ``items`` (first and last included)."""
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def snapshot(parts: Sequence[Any], into: Sequence[Any] | None = None) -> list[Any]:
    """Copies of ``parts``: written into ``into`` (the last snapshot's buffers) when they match, so a measured
    step allocates nothing: fresh memory costs page faults, on a busy VM milliseconds of them (issue 22)."""
    import torch

    if into is not None and len(into) == len(parts) and all(map(_same_layout, into, parts)):
        torch._foreach_copy_(list(into), list(parts))
        return list(into)
    return [t.clone() for t in parts]


def _same_layout(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def update_squares(parts: Sequence[Any], before: Sequence[Any], *, consume: bool = False):
    """Per sampled tensor, (sum of squared changes, sum of squared old weights) over the part this rank holds:
    a (k, 2) float32 device tensor, to be summed over ranks when the parts are shards. ``consume``: ``before``
    is a snapshot of ours, overwritten with the change (no new tensor the size of the sample)."""
    import torch

    old = [t.float() for t in before]
    old_norms = torch._foreach_norm(old)  # one kernel launch per list, not per tensor
    if consume:
        torch._foreach_sub_(old, [t.float() for t in parts])  # old - new: the change's norm
        change = old
    else:
        change = torch._foreach_sub([t.float() for t in parts], old)
    return torch.stack([torch.stack(torch._foreach_norm(change)), torch.stack(old_norms)], 1).square()


def update_ratio(sums):
    """(median |Δw|/|w| over the tensors with a non-zero norm, whether any weight changed), as device tensors,
    from :func:`update_squares` summed over every part of each tensor (as Python numbers when they are on the
    CPU: already on the host, a few numbers cost less in Python than in tensor operations)."""
    import torch

    if sums.device.type == "cpu":
        pairs = [(math.sqrt(d), math.sqrt(n)) for d, n in sums.tolist()]
        ratios = sorted(d / n for d, n in pairs if n > 0 and not math.isnan(d / n))
        ratio = ratios[(len(ratios) - 1) // 2] if ratios else math.nan  # torch's nanmedian: the lower middle
        return ratio, any(d > 0 or math.isnan(d) for d, _ in pairs)
    diff, norm = sums[:, 0].sqrt(), sums[:, 1].sqrt()
    ratio = torch.where(norm > 0, diff / norm.clamp_min(1e-30), torch.full_like(diff, math.nan)).nanmedian()
    return ratio, ((diff > 0) | diff.isnan()).any()  # NaN weights did change


def gradient_squares(params: Sequence[Any], weights: Sequence[float]):
    """Sum over ``params`` of weight x the squared norm of the part of its gradient this rank holds (None
    when none holds a gradient: they were cleared)."""
    held = [(local_tensor(p.grad), w) for p, w in zip(params, weights) if p.grad is not None]
    if not held:
        return None
    return sum(w * squares(g) for g, w in held)


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


def warmup_steps(trainer, args, max_steps: int) -> tuple[int | None, str | None]:
    """(the scheduler's warmup steps, None) as Trainer builds its schedule from ``args``
    (``get_warmup_steps``: on transformers v5 ``warmup_steps`` below 1 is a ratio of ``max_steps``; v4's
    ``warmup_ratio`` too), or (None, why) when they cannot be known: a scheduler the user passed in (or
    DeepSpeed's) follows its own warmup, and arguments without these fields say nothing."""
    scheduler = getattr(trainer, "lr_scheduler", None)
    if scheduler is not None and getattr(trainer, "_created_lr_scheduler", True) is False:
        return (
            None,
            f"the learning-rate scheduler ({type(scheduler).__name__}) was not built from the arguments",
        )
    if hasattr(args, "get_warmup_steps"):
        try:
            return int(args.get_warmup_steps(max_steps)), None
        except Exception as exc:  # unknown, and said so: never taken for "no warmup"
            return None, f"{type(args).__name__}.get_warmup_steps raised {type(exc).__name__}: {exc}"
    steps, ratio = getattr(args, "warmup_steps", None), getattr(args, "warmup_ratio", None)
    if isinstance(steps, (int, float)) and (steps >= 1 or (steps == 0 and not ratio)):
        return int(steps), None
    fraction = steps if isinstance(steps, float) and 0 < steps < 1 else ratio
    if isinstance(fraction, (int, float)) and max_steps:
        return math.ceil(max_steps * fraction), None
    return None, f"{type(args).__name__} has no warmup_steps or warmup_ratio to read"


def vocab_size(model) -> int | None:
    """The model's input-embedding rows (the V of ln V): from its embeddings where transformers can resolve them,
    else from its config's ``vocab_size`` (a model whose ``get_input_embeddings`` raises NotImplementedError:
    transformers' answer for embeddings it cannot find); None where neither says."""
    get = getattr(model, "get_input_embeddings", None) if model is not None else None
    if get is not None:
        try:
            rows = getattr(get(), "num_embeddings", None)
        except NotImplementedError:
            rows = None
        if isinstance(rows, int) and rows > 0:
            return rows
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def count_labels(counts, labels) -> None:
    """Add batches' supervised label ids (after the shift) into ``counts``, a device vector over the
    vocabulary; ``labels``: one batch's labels or a list of them (counted in one pass)."""
    import torch

    batches = [x for x in (labels if isinstance(labels, list) else [labels]) if _countable(x)]
    if not batches:
        return
    parts = [x[..., 1:].reshape(-1).to(counts.device, non_blocking=True) for x in batches]
    shifted = parts[0] if len(parts) == 1 else torch.cat(parts)
    ids = shifted.clamp(0, counts.numel() - 1)
    counts.index_add_(0, ids, (shifted != IGNORE_INDEX).float())


def _countable(labels) -> bool:
    return hasattr(labels, "dim") and labels.dim() >= 2 and not labels.is_floating_point()


def label_entropy(counts):
    """The entropy of the label distribution counted so far (a device scalar)."""
    p = counts / counts.sum().clamp_min(1)
    return -(p * p.clamp_min(1e-30).log()).sum()


SAMPLED_PARAMS = 4  # tensors sampled for the update ratio and the stale-gradient check
SAMPLE_MAX_ELEMENTS = 1 << 24  # ... each at most 16M elements (cloned at measured steps)
LABEL_BATCHES = 64  # micro-batches' labels held at most before they are counted
LABEL_ALL = 64  # the labels of the first 64 micro-batches are all counted ...
LABEL_EVERY = 8  # ... then those of one micro-batch in 8 (a sample of the same distribution)
# A larger tensor's update ratio is read on an evenly strided 8k of its elements: below torch's grain size
# (32,768), so each operation on it runs on the calling thread. Above it, an operation of a few microseconds
# wakes the intra-op threads and, on a loaded CPU, waited milliseconds for one (issue 22). 8k rather than 32k:
# the ratio is judged in decades and a uniform sample of 8k reads it to about a percent, at a quarter of the
# copying (a measured step's snapshot 78 -> 30 us on a CPU, for four tensors of 64k).
UPDATE_SAMPLE_ELEMENTS = 1 << 13
EARLY_MEASURE_STEPS = 10  # the update ratio is measured at every one of the first steps, then every check


class StepSampler:
    """The model-side measurements of one run, set up once at train begin: which parameters train, a few of
    them sampled for the update ratio and stale gradients, the optimizer's membership, the label counts and
    the precision in use. Every method records into the recorder; nothing is read on the host.

    On sharded parameters (see :mod:`hf_sanity.training.shards`) the update ratio and the stale-gradient norm
    are summed over ranks by one all_reduce at a fixed point of the step (the optimizer step of a measured
    step, the start of every step) that every rank reaches alike: the sample, the measured steps and whether
    to reduce depend only on the model's structure and the step number, never on this rank's values."""

    def __init__(
        self, trainer, model, optimizer, args, state, measures, *, check_every: int = 10, world_size: int = 1
    ) -> None:
        """``measures(*keys)``: whether some enabled step detector reads one of the value ``keys`` (the run's
        measurement plan, :meth:`hf_sanity.training.sink.FindingSink.measures`): each value here is sampled
        exactly when a check reads it."""
        import torch

        self.model = model
        self.check_every, self.world_size = check_every, world_size
        self.first_step = (getattr(state, "global_step", 0) or 0) + 1  # > 1: resumed from a checkpoint
        params = list(model.named_parameters())
        self.sharding = shards.detect(trainer, model, world_size)
        self.total_params = sum(full_numel(p) for _, p in params)
        self.trainable = [(n, p) for n, p in params if p.requires_grad]
        self._trainable_params = [p for _, p in self.trainable]
        accelerator = getattr(trainer, "accelerator", None)
        precision = getattr(accelerator, "mixed_precision", "no") if accelerator is not None else "no"
        native = bool(getattr(accelerator, "native_amp", False))
        self.half = (native and precision in ("fp16", "bf16")) or any(
            p.dtype in (torch.float16, torch.bfloat16) for _, p in params[:8]
        )
        self.scaler = getattr(accelerator, "scaler", None) is not None
        # None when unknown (why in the report's stats): the rules that need it then judge by the LR itself.
        self.warmup_steps, self.warmup_unknown = warmup_steps(
            trainer, args, getattr(state, "max_steps", 0) or 0
        )
        self.accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        self.max_steps = int(getattr(state, "max_steps", 0) or 0)
        # Trainer clips at args.max_grad_norm; 0 or None turns clipping off.
        self.max_grad_norm = float(args.max_grad_norm or 0.0) if hasattr(args, "max_grad_norm") else None
        self.vocab_size = vocab_size(model)
        skipped = self.sharding.skipped
        self.stale_sample = (
            spread([p for _, p in self.trainable], SAMPLED_PARAMS)
            if measures("stale_norm") and "stale-gradients" not in skipped
            else []
        )
        # Sharded optimizers (FSDP, DeepSpeed) may hold flattened copies: membership cannot be checked by identity.
        # A plain loop over DTensor parameters steps the parameters themselves: there it can.
        copies = self.sharding.engine is not None or self.sharding.kind in ("fsdp1", "zero3")
        self.optimizer_ids = None if copies else optimizer_ids(optimizer)
        stepped = [p for _, p in self.trainable if self.optimizer_ids is None or id(p) in self.optimizer_ids]
        # Sizes every rank agrees on (a shard's own size differs by rank): every rank samples the same tensors.
        small = [p for p in stepped if full_numel(p) <= SAMPLE_MAX_ELEMENTS] or sorted(
            stepped, key=full_numel
        )[:1]
        self.update_sample = (
            spread(small, SAMPLED_PARAMS)
            if measures("update_ratio", "updated") and "update ratio" not in skipped
            else []
        )
        self.watch_path = measures("n_trainable", "n_with_grad", "n_in_optimizer")
        self.watch_mode = measures("training")
        self.label_counts = None
        rows = self.vocab_size
        # Where batches and the module live (a ZeRO-3 partition may be offloaded to the CPU: not there).
        self.device = params[0][1].device if params else torch.device("cpu")
        if rows and measures("label_entropy"):
            self.label_counts = torch.zeros(rows, dtype=torch.float32, device=self.device)
        self._labels: list[Any] = []  # the batches' labels since the last count (counted at each read)
        self._batches = 0  # micro-batches seen
        self._fresh = False  # labels were counted since the entropy was last recorded
        self._snapshot = None
        self._buffers = None  # the snapshot's tensors, reused from one measured step to the next
        self._measuring = False

    sharded = property(
        lambda self: self.sharding.sharded, doc="Some rank holds only a part of some parameter."
    )

    def training_setup(self, world_size: int, objective=None):
        """What the step detectors are built with."""
        from hf_sanity.rules.training.base import TrainingSetup

        return TrainingSetup(
            self.warmup_steps, world_size, self.vocab_size, self.accumulation, max_steps=self.max_steps,
            half_precision=self.half, objective=objective or SFT_OBJECTIVE, max_grad_norm=self.max_grad_norm,
        )  # fmt: skip

    def setup_values(self) -> dict[str, Any]:
        """What the gradient path looks like at train begin (for no-trainable-params, optimizer-missing-params)."""
        names = [n for n, _ in self.trainable]
        inside = (
            None
            if self.optimizer_ids is None
            else [n for n, p in self.trainable if id(p) in self.optimizer_ids]
        )
        return {"total_params": self.total_params, "trainable": names, "in_optimizer": inside}

    @property
    def watches_step_begin(self) -> bool:
        return bool(self.stale_sample) or (bool(self.update_sample) and self.sharding.steps_in_backward)

    def measured(self, step: int) -> bool:
        """Whether the update ratio is measured at ``step`` (every one of the first steps this process trains,
        then every check): the same answer on every rank."""
        return step - self.first_step < EARLY_MEASURE_STEPS or step % self.check_every == 0

    def step_begins(self, recorder, step: int) -> None:
        if self.update_sample and self.sharding.steps_in_backward:
            self._start_update(step)  # DeepSpeed steps inside backward: the update is measured from here
        if not self.stale_sample or not self.measured(step):
            return  # gradients that are not cleared stay so: the measured steps see them
        if not self._reduces(self.stale_sample):
            present = gradient_squares(self.stale_sample, [1.0] * len(self.stale_sample))
            recorder.push(step, "stale_norm", 0.0 if present is None else present.sqrt())
            return
        weights = self.sharding.weights(self.stale_sample, self.world_size)

        def local():
            present = gradient_squares(self.stale_sample, weights)
            return self._zeros(1) if present is None else present.reshape(1)

        recorder.push(step, "stale_norm", self._summed(local, 1)[0].sqrt())

    def forward(self, recorder, step: int, module) -> None:
        """A forward's mode, where it is a training forward (one that builds a graph; generation's forwards, one a
        token, and a reference's run without one): recorded whenever it is eval mode (the finding) and at the
        measured steps in train mode (what shows the check ran)."""
        import torch

        if torch.is_grad_enabled() and (not module.training or self.measured(step)):
            recorder.push(step, "training", bool(module.training))

    def batch(self, batch) -> None:
        """A micro-batch's labels, counted at the next read (one pass then, not a few operations every step:
        the counts, adds of one, come out the same in any order); after the first ``LABEL_ALL`` micro-batches,
        one in ``LABEL_EVERY``: the prior is a distribution, which a sample of the batches estimates."""
        self._batches += 1
        if self._batches > LABEL_ALL and self._batches % LABEL_EVERY:
            return
        if self.label_counts is not None and "labels" in batch:
            self._labels.append(batch["labels"])
            if len(self._labels) >= LABEL_BATCHES:
                self._count_labels()

    def before_optimizer(self, recorder, step: int, optimizer) -> None:
        if self.update_sample and not self.sharding.steps_in_backward:
            self._start_update(step)
        lr = max_lr(optimizer)
        if lr is not None:
            recorder.push(step, "lr", lr)
        if self.watch_path and self.measured(step):  # a broken path stays broken: measured steps see it
            path = gradient_path(self._trainable_params, self.optimizer_ids)
            if not self.sharding.gradients_in_params:
                path.pop("n_with_grad")  # p.grad is not where this layout keeps gradients: 0 would be a lie
            for key, value in path.items():
                recorder.push(step, key, value)

    def after_optimizer(self, recorder, step: int, *, trainer=None) -> None:
        """After the optimizer step of a measured step: the update ratio (not recorded when the step was
        skipped: a GradScaler found inf gradients)."""
        if not self._measuring:
            return
        self._measuring = False
        accelerator = getattr(trainer, "accelerator", None)
        skipped = bool(getattr(accelerator, "optimizer_step_was_skipped", False))
        before, self._snapshot = self._snapshot, None

        reduce = self._reduces(self.update_sample)
        weights = self.sharding.weights(self.update_sample, self.world_size) if reduce else None

        def local():
            if before is None:
                raise RuntimeError("no snapshot of the sampled weights was taken before the optimizer step")
            sums = update_squares(self._update_parts(), before, consume=True)
            return sums * sums.new_tensor(weights).unsqueeze(1) if weights is not None else sums

        k = len(self.update_sample)
        sums = self._summed(local, 2 * k).reshape(k, 2) if reduce else local()
        if not skipped:
            ratio, updated = update_ratio(sums)
            recorder.push(step, "update_ratio", ratio)
            recorder.push(step, "updated", updated)

    def push_label_entropy(self, recorder, step: int) -> None:
        """The entropy of the labels seen so far (for loss-plateau-prior), recorded at ``step`` when new labels
        were counted since the last one."""
        if self.label_counts is not None and (self._labels or self._fresh):
            self._count_labels()
            recorder.push(step, "label_entropy", label_entropy(self.label_counts))
            self._fresh = False

    def _count_labels(self) -> None:
        pending, self._labels = self._labels, []
        count_labels(self.label_counts, pending)
        self._fresh = self._fresh or bool(pending)

    # -- sums over ranks -----------------------------------------------------------------------------
    def _start_update(self, step: int) -> None:
        # Decided before anything that may fail: after_optimizer's all_reduce must follow on every rank.
        self._measuring = self.measured(step)
        self._snapshot = None
        if self._measuring:
            self._snapshot = self._buffers = snapshot(self._update_parts(), into=self._buffers)

    def _update_parts(self) -> list[Any]:
        """What the update ratio reads of each sampled tensor: the part this rank holds; of a whole tensor over
        UPDATE_SAMPLE_ELEMENTS, an evenly strided view of at most that many elements (|Δw|/|w| of a uniform sample is
        the tensor's, and the clone at each measured step stays small: issue 22)."""
        parts = [local_tensor(p) for p in self.update_sample]
        if self._reduces(self.update_sample):  # shards: every rank must read the same elements of the whole
            return parts
        return [strided(t, UPDATE_SAMPLE_ELEMENTS) for t in parts]

    def _reduces(self, params: Sequence[Any]) -> bool:
        """Some of ``params`` is sharded across more than one rank: its norm needs every rank's part."""
        return self.world_size > 1 and any(self.sharding.is_sharded(p) for p in params)

    def _zeros(self, n: int):
        import torch

        return torch.zeros(n, dtype=torch.float32, device=self.device)

    def _summed(self, local, n: int):
        """``local()`` (``n`` sums of squares, weighted by :meth:`Sharding.weights`) summed over ranks. The
        all_reduce runs even when ``local()`` fails on this rank (NaN sent in its place, the error raised after
        it): a collective one rank skips would hang the others."""
        error = None
        try:
            mine = local().reshape(-1).float()
        except Exception as exc:  # raised again once the collective is done
            mine, error = self._zeros(n).fill_(math.nan), exc
        total = shards.all_sum(mine, world_size=self.world_size)
        if error is not None:
            raise error
        return total
