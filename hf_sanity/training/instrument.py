"""How SanityCallback observes a Trainer without changing it, and takes it all back at the end.

* ``trainer.training_step`` is wrapped: the batch before each micro-batch, the loss Trainer got (before
  ``logging_nan_inf_filter`` hides a NaN), and the exception that kills a step (out of memory);
* ``trainer._get_grad_norm`` is wrapped: the pre-clip gradient norm Trainer computes anyway;
* forward hooks on the model: the first real batch and whether each training forward runs in train mode.

The observer (the callback) gets ``before_micro(inputs)`` (which may return a context the step runs in),
``after_micro(loss)``, ``failed(exc)``,
``grad_norm(norm)``, ``pre_forward(module, args, kwargs)`` and ``post_forward(module, output)``; hooks fire
only inside a training step, never during hf-sanity's own extra forwards (:attr:`Instruments.busy`) and, after
the first forward, only for forwards that build a graph (:attr:`Instruments.graph_only`).

:class:`OwnClock` is the callback's own clock: every piece of code it adds to a run (each Trainer event, each
call of the instruments above, their wrappers' own work around Trainer's) is timed once, at its outermost
entry, so ``stats.callback_seconds`` is everything the callback costs that can be told apart from the model's
own work, and ``stats.callback_share`` that time over the run's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from typing import Any


class OwnClock:
    """Seconds spent in the callback's code. Reentrant: an entry inside another (a guard inside an event, an
    event Trainer fires from inside a wrapped step) is inside the outer one's time, and counted once."""

    __slots__ = ("_depth", "_entered", "seconds", "started")

    def __init__(self) -> None:
        self.seconds, self._depth, self._entered = 0.0, 0, 0.0
        self.started: float | None = None  # the run's wall clock starts at on_train_begin

    def restart(self) -> None:
        """A new run: the seconds so far forgotten (an entry in progress still counts whole)."""
        self.seconds, self.started = 0.0, time.perf_counter()
        if self._depth:
            self._entered = self.started

    def __enter__(self) -> None:
        if self._depth == 0:
            self._entered = time.perf_counter()
        self._depth += 1

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._entered

    @property
    def running(self) -> bool:
        return self._depth > 0

    def so_far(self) -> float:
        """The seconds counted, with the entry in progress (the report is written inside on_train_end)."""
        return self.seconds + (time.perf_counter() - self._entered if self._depth else 0.0)

    def pause(self):
        """Trainer's own work inside one of ours (the wrapped step's original): not counted."""
        return _Paused(self)

    def share(self) -> float | None:
        """The callback's seconds over the run's (from train begin to now)."""
        if self.started is None:
            return None
        wall = time.perf_counter() - self.started
        return self.so_far() / wall if wall > 0 else None


class _Paused:
    __slots__ = ("clock", "depth")

    def __init__(self, clock: OwnClock) -> None:
        self.clock = clock

    def __enter__(self) -> None:
        clock = self.clock
        self.depth, clock._depth = clock._depth, 0
        if self.depth:
            clock.seconds += time.perf_counter() - clock._entered

    def __exit__(self, *exc) -> None:
        clock = self.clock
        clock._depth = self.depth
        if self.depth:
            clock._entered = time.perf_counter()


# What Trainer calls on the callback besides its events. The observer's methods are not here: the instruments
# that call them (the wrapped step, the hooks, the norm wrapper) put each call on the clock themselves.
CLOCKED = ("state",)


def clocked(cls):
    """Class decorator: every ``on_*`` event of ``cls`` and the methods in :data:`CLOCKED` run on
    ``self.clock`` (an :class:`OwnClock`)."""
    for name in [n for n in vars(cls) if n.startswith("on_")] + list(CLOCKED):
        method = getattr(cls, name, None)
        if callable(method):
            setattr(cls, name, _on_clock(method))
    return cls


def _on_clock(method):
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        with self.clock:
            return method(self, *args, **kwargs)

    return timed


class Instruments:
    def __init__(self) -> None:
        self._installed: list[tuple[Any, str, Any, bool]] = []  # (object, attribute, previous, had it)
        self._hooks: list[Any] = []
        self._output_hook = None  # the forward hook's handle, while outputs are read
        self.in_train = False  # inside trainer.training_step
        self.busy = False  # hf-sanity runs its own forward: hooks stay quiet
        # Only forwards that build a graph are observed from now on (the observer set it: the first forward,
        # whatever it was, is behind it): generation's forwards, one a token, and a reference's cost one check.
        self.graph_only = False

    def install(self, trainer, model, observer) -> None:
        from hf_sanity.launch import tracebacks

        self.graph_only = False
        tracebacks.install()  # a crash that passes through these wrappers is printed without their frames
        if trainer is not None:
            self._wrap(trainer, "training_step", lambda original: self._training_step(original, observer))
            if hasattr(
                trainer, "_get_grad_norm"
            ):  # private to Trainer: without it the gradient rules go blind
                self._wrap(trainer, "_get_grad_norm", lambda original: _observed_norm(original, observer))
        if model is not None:
            self._hooks.append(model.register_forward_pre_hook(self._pre(observer), with_kwargs=True))
            self._output_hook = model.register_forward_hook(self._post(observer), with_kwargs=True)
            self._hooks.append(self._output_hook)

    def release_output_hook(self) -> None:
        """The forwards' outputs are read no more (the first one's was): every later forward, each token of a
        generation included, runs without the hook. Safe inside the hook itself: torch calls a forward's hooks
        from a copy of their list."""
        if self._output_hook is not None:
            self._output_hook.remove()
            self._output_hook = None

    def uninstall(self) -> None:
        for obj, name, previous, had in reversed(self._installed):
            if had:
                setattr(obj, name, previous)
            else:
                vars(obj).pop(name, None)
        for handle in self._hooks:
            handle.remove()
        self._installed, self._hooks, self._output_hook = [], [], None

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
        clock = observer.clock

        def training_step(model, inputs, *args, **kwargs):
            with clock:  # the wrapper's own work counts; Trainer's step inside it does not
                watch = observer.before_micro(inputs) or contextlib.nullcontext()
                self.in_train = True
                try:
                    with watch, clock.pause():
                        loss = original(model, inputs, *args, **kwargs)
                except BaseException as exc:
                    self.in_train = False
                    with contextlib.suppress(Exception):  # the user's exception goes on unchanged
                        observer.failed(exc)
                    raise
                self.in_train = False
                observer.after_micro(loss)
                return loss

        return training_step

    def _pre(self, observer):
        import torch

        clock, grad_enabled = observer.clock, torch.is_grad_enabled

        def hook(module, args, kwargs):
            with clock:
                if self.in_train and not self.busy and (not self.graph_only or grad_enabled()):
                    observer.pre_forward(module, args, kwargs)

        return hook

    def _post(self, observer):
        clock = observer.clock

        def hook(module, args, kwargs, output):
            with clock:
                if self.in_train and not self.busy:
                    observer.post_forward(module, output)

        return hook


def _observed_norm(original, observer):
    clock = observer.clock

    def _get_grad_norm(*args, **kwargs):
        with clock:
            with clock.pause():
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
