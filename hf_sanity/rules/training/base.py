"""What every step detector shares: a Monitor is fed numbers step by step, fires each of its rules once, and
keeps its state across a checkpoint (:meth:`Monitor.state` / :meth:`Monitor.restore`)."""

from __future__ import annotations

import functools
import inspect
import numbers
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hf_sanity.catalog import Rule
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import SFT_OBJECTIVE, Objective


@dataclass(frozen=True)
class TrainingSetup:
    """What SanityCallback knows of the run when it builds the monitors."""

    warmup_steps: int | None = 0  # None: unknown (a scheduler passed in): the rules judge by the LR itself
    world_size: int = 1
    vocab_size: int | None = None  # the model's embedding rows: chance is ln(V)
    accumulation: int = 1  # gradient_accumulation_steps
    max_steps: int = 0  # the run's planned optimizer steps (0: unknown)
    half_precision: bool = False  # bf16/fp16 weights or autocast
    objective: Objective = SFT_OBJECTIVE  # what the run trains for (`measure.objective`)
    max_grad_norm: float | None = None  # gradient clipping (0: off; None: not known)


SAVED_HEAD, SAVED_TAIL = 16, 128  # a saved series keeps its first points (baselines) and its last (windows)


class Monitor:
    """A plain object fed numbers step by step: ``update(step, values) -> list[Finding]``.

    ``values`` holds whatever was measured at ``step`` (a monitor ignores keys that are missing, so one step
    can arrive in several parts: the per-step values, the first batch's shapes, a memory check). Each of a
    monitor's rules fires at most once. Register a monitor with :func:`hf_sanity.catalog.monitor`;
    SanityCallback builds one per run with :meth:`from_setup`.

    A run resumed from a checkpoint continues where the checkpoint left it: :meth:`state` is every attribute
    but the configuration (the ``__init__`` parameters, which the resumed run's setup gives afresh) as plain
    JSON data, :meth:`restore` takes it back. Without a saved state (a checkpoint written without hf-sanity)
    ``start_known`` is False: what a monitor judges against the run's start it does not judge.
    """

    rules: tuple[Rule, ...] = ()
    # Every value key it reads: the contract. MonitorSet feeds it only these keys, and only records that carry
    # one of them; tests/test_architecture.py checks that its code reads no other key and that some
    # measurement produces each.
    reads: tuple[str, ...] = ()
    not_carried: tuple[str, ...] = ()  # attributes measured on this process: a resumed one measures afresh
    first_step = 1  # the first step this process trains: 1, or the checkpoint's step + 1 after a resume
    start_known = True  # it has seen the run since step 1 (or restored the state of one that had)

    def __init__(self) -> None:
        self.fired: set[str] = set()

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> Monitor:
        return cls()

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:  # pragma: no cover - abstract
        raise NotImplementedError

    def fire(
        self, rule: Rule, message: str, *, step: int | None, evidence: dict[str, Any], **kw
    ) -> list[Finding]:
        if rule.slug in self.fired:
            return []
        self.fired.add(rule.slug)
        return [rule.finding(message, evidence=evidence, step=step, **kw)]

    @property
    def done(self) -> bool:
        """Every rule of this monitor has fired: there is nothing left to watch."""
        return all(rule.slug in self.fired for rule in self.rules)

    # -- across a checkpoint -----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this monitor: plain JSON data (windows, baselines, what fired; a long
        series keeps its first ``SAVED_HEAD`` and last ``SAVED_TAIL`` items). Raises TypeError on an attribute
        that is not plain data."""
        skip = _not_saved(type(self))
        return {name: _plain(value, name) for name, value in vars(self).items() if name not in skip}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state` of this class: each attribute gets its saved value, in the type a fresh
        monitor holds there (sets, tuples and deques come back as such, (step, value) points as tuples)."""
        skip = _not_saved(type(self))
        for name, value in state.items():
            if name not in skip and hasattr(self, name):
                setattr(self, name, _typed(value, getattr(self, name)))


@functools.cache
def _not_saved(cls: type) -> frozenset[str]:
    configuration = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    return frozenset({*configuration, *cls.not_carried, "first_step"})


def _ends(items: list[Any]) -> list[Any]:
    return items if len(items) <= SAVED_HEAD + SAVED_TAIL else items[:SAVED_HEAD] + items[-SAVED_TAIL:]


def _plain(value: Any, name: str) -> Any:
    """``value`` as JSON data: dicts with other keys than strings become [key, value] pairs, sets sorted lists."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        items = _ends(list(value.items()))
        if all(isinstance(k, str) for k, _ in items):
            return {k: _plain(v, name) for k, v in items}
        return [[_plain(k, name), _plain(v, name)] for k, v in items]
    if isinstance(value, (set, frozenset)):
        return [_plain(v, name) for v in _ends(sorted(value, key=repr))]
    if isinstance(value, (list, tuple, deque)):
        return [_plain(v, name) for v in _ends(list(value))]
    if hasattr(value, "to_state"):  # running sums and the like: their own plain state
        return _plain(value.to_state(), name)
    raise TypeError(f"monitor attribute {name!r} holds a {type(value).__name__}, not plain data")


def _tuples(value: Any) -> Any:
    """JSON back to a monitor's shapes: lists inside a list were tuples (points, pairs)."""
    if isinstance(value, list):
        return [tuple(_tuples(v)) if isinstance(v, list) else _tuples(v) for v in value]
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def _typed(value: Any, like: Any) -> Any:
    if hasattr(like, "load_state"):
        like.load_state(value)
        return like
    if isinstance(like, Mapping) and isinstance(value, list):  # [key, value] pairs
        return type(like)((tuple(k) if isinstance(k, list) else k, _tuples(v)) for k, v in value)
    if isinstance(like, deque):
        return deque(_tuples(value), maxlen=like.maxlen)
    if isinstance(like, (set, frozenset, tuple)):
        return type(like)(_tuples(value))
    return _tuples(value)
