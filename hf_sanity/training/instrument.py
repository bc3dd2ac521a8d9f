"""How SanityCallback observes a Trainer without changing it, and takes it all back at the end.

* ``trainer.training_step`` is wrapped: the batch before each micro-batch, the loss Trainer got (before
  ``logging_nan_inf_filter`` hides a NaN), and the exception that kills a step (out of memory);
* ``trainer._get_grad_norm`` is wrapped: the pre-clip gradient norm Trainer computes anyway;
* forward hooks on the model: the first real batch and whether each training forward runs in train mode.

The observer (the callback) gets ``before_micro(inputs)`` (which may return a context the step runs in),
``after_micro(loss)``, ``failed(exc)``,
``grad_norm(norm)``, ``pre_forward(module, args, kwargs)`` and ``post_forward(module, output)``; hooks fire
only inside a training step and never during hf-sanity's own extra forwards (:attr:`Instruments.busy`).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any


class Instruments:
    def __init__(self) -> None:
        self._installed: list[tuple[Any, str, Any, bool]] = []  # (object, attribute, previous, had it)
        self._hooks: list[Any] = []
        self.in_train = False  # inside trainer.training_step
        self.busy = False  # hf-sanity runs its own forward: hooks stay quiet

    def install(self, trainer, model, observer) -> None:
        if trainer is not None:
            self._wrap(trainer, "training_step", lambda original: self._training_step(original, observer))
            if hasattr(
                trainer, "_get_grad_norm"
            ):  # private to Trainer: without it the gradient rules go blind
                self._wrap(trainer, "_get_grad_norm", lambda original: _observed_norm(original, observer))
        if model is not None:
            self._hooks.append(model.register_forward_pre_hook(self._pre(observer), with_kwargs=True))
            self._hooks.append(model.register_forward_hook(self._post(observer), with_kwargs=True))

    def uninstall(self) -> None:
        for obj, name, previous, had in reversed(self._installed):
            if had:
                setattr(obj, name, previous)
            else:
                vars(obj).pop(name, None)
        for handle in self._hooks:
            handle.remove()
        self._installed, self._hooks = [], []

    @contextlib.contextmanager
    def quiet(self):
        """hf-sanity's own forwards inside a training step: the hooks do not see them."""
        was, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = was

    def _wrap(self, obj, name: str, make) -> None:
        had = name in vars(obj)
        previous = vars(obj).get(name)
        setattr(obj, name, make(getattr(obj, name)))
        self._installed.append((obj, name, previous, had))

    def _training_step(self, original, observer):
        def training_step(model, inputs, *args, **kwargs):
            watch = observer.before_micro(inputs) or contextlib.nullcontext()
            self.in_train = True
            try:
                with watch:
                    loss = original(model, inputs, *args, **kwargs)
            except BaseException as exc:
                self.in_train = False
                observer.failed(exc)
                raise
            self.in_train = False
            observer.after_micro(loss)
            return loss

        return training_step

    def _pre(self, observer):
        def hook(module, args, kwargs):
            if self.in_train and not self.busy:
                observer.pre_forward(module, args, kwargs)

        return hook

    def _post(self, observer):
        def hook(module, args, kwargs, output):
            if self.in_train and not self.busy:
                observer.post_forward(module, output)

        return hook


def _observed_norm(original, observer):
    def _get_grad_norm(*args, **kwargs):
        norm = original(*args, **kwargs)
        if norm is not None:
            observer.grad_norm(norm)
        return norm

    return _get_grad_norm


def find_trainer(max_depth: int = 12):
    """The Trainer whose event is running: the first ``self`` up the stack that is a ``transformers.Trainer``."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        depth = 0
        while frame is not None and depth < max_depth:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
            frame = frame.f_back
            depth += 1
    finally:
        del frame
    return None


def move_before_reporters(trainer, callback) -> None:
    """Sit right after DefaultFlowCallback, so every reporting callback's on_log sees our counters."""
    handler = getattr(trainer, "callback_handler", None)
    callbacks = getattr(handler, "callbacks", None)
    if not callbacks or callback not in callbacks:
        return
    here = callbacks.index(callback)
    target = 1 if type(callbacks[0]).__name__ == "DefaultFlowCallback" else 0
    if here > target:  # moving earlier is safe while Trainer iterates this list
        callbacks.insert(target, callbacks.pop(here))
