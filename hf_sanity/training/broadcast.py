"""What the loss is computed from, at the first real step: the model's output against the labels, watched for
broadcasting.

A custom ``compute_loss`` that subtracts ``(B,)`` targets from a ``(B, 1)`` output computes a ``(B, B)``
matrix: every prediction against every target. Nothing raises, the loss is a plausible number and the run
trains on it (it oscillates where it should converge). The protocol's remedy is a shape assertion before the
loss; this is that assertion, made for the user on the first micro-batch:

* :class:`LossWatch` is a ``TorchFunctionMode`` active for the first ``training_step`` only. It follows which
  tensors derive from the labels (the batch's label tensors) and which from the model (its parameters: the
  model's output and everything computed from it), through every torch operation; an elementwise operation
  (or a loss function of ``torch.nn.functional``) between one derived from the model alone and one derived
  from the labels alone, whose result is larger than both (each operand was expanded along a dimension of the
  other), is a broadcast in the loss, in a custom ``compute_loss`` or in a custom model's forward.
* torch's own warning for it (``F.mse_loss``'s "target size ... different to the input size ... broadcasting")
  is recorded on the way and shown again as it would have been.

The mode only observes: every operation is the one the run calls, with the same arguments; a run watched is
the run unwatched. It is not installed where a mode could change how the step is traced or sharded (compiled
models, FSDP, DeepSpeed).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

OUTPUT, LABELS = "output", "labels"
DEFAULT_LABELS = ("labels", "label", "label_ids")
# Elementwise arithmetic between two tensors (the methods, the operators and the functions), and the loss
# functions whose input and target torch broadcasts against each other.
ELEMENTWISE = frozenset(
    {
        "add", "sub", "mul", "div", "true_divide", "subtract", "multiply", "divide", "rsub", "pow", "maximum",
        "minimum", "sub_", "add_", "mul_", "div_", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__",
        "__rmul__", "__truediv__", "__rtruediv__", "__pow__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
    }
)  # fmt: skip
LOSSES = frozenset(
    {
        "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
        "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss", "soft_margin_loss",
    }
)  # fmt: skip
BROADCAST_WARNING = "broadcast"  # in the text of torch's warning (mse_loss, l1_loss, ...)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # hf_sanity/


def caller_site() -> str | None:
    """``file:line`` of the innermost frame outside torch and hf-sanity: where the user's code called the op."""
    import torch

    skip = (_PACKAGE, os.path.dirname(torch.__file__) + os.sep)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    return None if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _tensors(value: Any) -> Iterable[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _shape(t) -> list[int]:
    return [int(d) for d in t.shape]


class LossWatch:
    """Tags tensors by origin (the labels, the model's output) through the step; records each broadcast
    between the two (:attr:`broadcasts`) and torch's broadcasting warnings (:attr:`warnings`)."""

    MAX_RECORDED = 5

    def __init__(self, labels: Iterable[Any], parameters: Iterable[Any]) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self.origin = WeakIdKeyDictionary()
        for tensor in parameters:
            self.origin[tensor] = frozenset({OUTPUT})
        for tensor in labels:
            self.origin[tensor] = frozenset({LABELS})
        self.broadcasts: list[dict[str, Any]] = []
        self.warnings: list[str] = []
        self.compared = 0  # operations between what the model computed and the labels: the loss, looked at
        self.error: Exception | None = None  # the watch broke on an operation (the step went on)
        self.loss_site: str | None = None  # where the last loss function of torch was called from

    def observe(self, func, args, kwargs, result) -> None:
        name = getattr(func, "__name__", "")
        operands = list(_tensors((args, kwargs)))
        # `y.view_as(out)`, `y.to(out)`: the other tensor lends its shape or dtype, not its values
        sources = operands[:1] if name.endswith("_as") or name == "to" else operands
        tags = frozenset().union(*(self.origin.get(t, frozenset()) for t in sources)) if sources else None
        if tags:
            for tensor in _tensors(result):
                self.origin[tensor] = self.origin.get(tensor, frozenset()) | tags
        if name in LOSSES:  # torch's own warning names this call as its site: the user's line, kept for it
            self.loss_site = caller_site()
        if (
            len(operands) >= 2
            and OUTPUT in (tags or ())
            and LABELS in tags
            and (name in ELEMENTWISE or name in LOSSES)
        ):
            self._check(name, operands[0], operands[1])

    def _check(self, name: str, a, b) -> None:
        import torch

        tags = (self.origin.get(a, frozenset()), self.origin.get(b, frozenset()))
        if tags[0] == {LABELS} and tags[1] == {OUTPUT}:
            a, b, tags = b, a, tags[::-1]
        if tags != ({OUTPUT}, {LABELS}):
            return
        self.compared += 1
        if a.shape == b.shape:
            return
        try:
            shape = torch.broadcast_shapes(a.shape, b.shape)
        except RuntimeError:
            return  # it raises on its own
        numel = 1
        for d in shape:
            numel *= int(d)
        if numel > max(a.numel(), b.numel()) and len(self.broadcasts) < self.MAX_RECORDED:
            self.broadcasts.append(
                {
                    "op": name, "output": _shape(a), "labels": _shape(b), "result": [int(d) for d in shape],
                    "at": caller_site(),
                }
            )  # fmt: skip


def _mode(watch: LossWatch, clock):
    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            with clock:  # the mode's own work is the callback's, though it runs inside Trainer's step
                kwargs = kwargs or {}
                with clock.pause():
                    result = func(*args, **kwargs)
                try:
                    watch.observe(func, args, kwargs, result)
                except Exception as exc:  # never into the user's step: reported after it (internal-error)
                    watch.error = watch.error or exc
                return result

    return Mode()


def watchable(trainer) -> str | None:
    """None when the first step can be watched; else why not (a mode could change how it is traced or
    sharded)."""
    args = getattr(trainer, "args", None)
    if getattr(args, "torch_compile", False):
        return "the model is compiled"
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        return "the parameters are sharded"
    return None


def label_tensors(trainer, batch: Mapping[str, Any]) -> list[Any]:
    names = list(getattr(trainer, "label_names", None) or ()) or list(DEFAULT_LABELS)
    return [batch[k] for k in names if hasattr(batch.get(k), "shape")]


@contextlib.contextmanager
def watched(watch: LossWatch, report: Callable[[LossWatch], None], clock=None):
    """The first step under the watch: torch's warnings recorded on the way (and shown again, through the
    user's filters, as they would have been), then ``report(watch)`` once the step returned. ``clock`` (the
    callback's :class:`~hf_sanity.training.instrument.OwnClock`) counts the mode's own work on every
    operation, not the operation."""
    from hf_sanity.training.instrument import OwnClock

    clock = clock if clock is not None else OwnClock()
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with _mode(watch, clock):
                yield watch
    finally:
        for item in caught:
            if BROADCAST_WARNING in str(item.message) and len(watch.warnings) < LossWatch.MAX_RECORDED:
                watch.warnings.append(str(item.message))
            filename, lineno = item.filename, item.lineno
            if filename == __file__ and watch.loss_site:  # raised through the mode: the user's line instead
                filename, _, line = watch.loss_site.rpartition(":")
                lineno = int(line)
            warnings.warn_explicit(item.message, item.category, filename, lineno)
    report(watch)
