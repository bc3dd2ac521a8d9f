"""The logged series of a run (`Curves`, read from a Trainer ``log_history``) and the robust statistics the
curve rules compute on them. Pure NumPy; nothing here judges a curve (that is `hf_sanity.rules.curves`).

* the *level* of a stretch of curve is its median, so one bad batch does not move it;
* the *noise* of a curve is the robust standard deviation of its step-to-step differences
  (:func:`hf_sanity.numbers.noise`), which ignores the trend and a few outliers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

from hf_sanity.numbers import median

ZERO_AFTER_POSITIVE = 0.01  # a loss of exactly 0.0 right after a loss >= 0.01 is a hidden NaN
TRAIN_LEVEL_POINTS = 5  # the train level at an eval step: median of the 5 train points nearest to it

# -- the series ------------------------------------------------------------------------------------
NOT_METRICS = ("_runtime", "_per_second", "_time", "_samples")


@dataclass
class Curves:
    """The logged series of one run.

    ``lr`` is aligned with ``train_steps`` (empty when no learning rate was logged); ``eval_loss`` and
    every list of ``eval_metrics`` are aligned with ``eval_steps``. A metric not logged at one evaluation
    while it was at others is NaN there; NaN in ``train_loss``/``eval_loss`` is a logged NaN.
    """

    train_steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    eval_metrics: dict[str, list[float]] = field(default_factory=dict)
    vocab_size: int | None = None
    # What the run was set up with, where known (None: not known, nothing is said about it): the optimizer
    # steps it was planned for (the trainer state's max_steps), gradient clipping (max_grad_norm; 0: off) and
    # the warmup steps.
    planned_steps: int | None = None
    max_grad_norm: float | None = None
    warmup_steps: int | None = None

    @classmethod
    def from_log_history(cls, log_history: list[dict], vocab_size: int | None = None) -> Curves:
        """Read a Trainer ``state.log_history``: train entries carry ``loss`` (and ``learning_rate``), eval
        entries ``eval_loss`` and ``eval_*`` metrics. The end-of-training summary (``train_loss``) is
        skipped; so are timing entries (``eval_runtime``, ``*_per_second``)."""
        curves = cls(vocab_size=vocab_size)
        lrs: list[float | None] = []
        evals: list[dict[str, float]] = []
        for entry in log_history or ():
            if not isinstance(entry, dict):
                continue
            step = number(entry.get("step"))
            if "loss" in entry:
                loss = number(entry["loss"])
                if loss is not None:
                    curves.train_steps.append(int(step) if step is not None else len(curves.train_steps) + 1)
                    curves.train_loss.append(loss)
                    lrs.append(number(entry.get("learning_rate")))
            metrics = {
                key: value
                for key, value in ((k, number(v)) for k, v in entry.items() if k.startswith("eval_"))
                if value is not None and not key.endswith(NOT_METRICS)
            }
            if metrics:
                curves.eval_steps.append(int(step) if step is not None else len(curves.eval_steps) + 1)
                evals.append(metrics)
        if any(lr is not None for lr in lrs):
            curves.lr = [math.nan if lr is None else lr for lr in lrs]
        if any("eval_loss" in metrics for metrics in evals) and not all("eval_loss" in m for m in evals):
            # Evaluations of another kind (no loss logged): keep eval_loss NaN-free, so NaN there is real.
            keep = [i for i, metrics in enumerate(evals) if "eval_loss" in metrics]
            curves.eval_steps = [curves.eval_steps[i] for i in keep]
            evals = [evals[i] for i in keep]
        keys = sorted({key for metrics in evals for key in metrics})
        for key in keys:
            values = [metrics.get(key, math.nan) for metrics in evals]
            if key == "eval_loss":
                curves.eval_loss = values
            else:
                curves.eval_metrics[key] = values
        return curves


def number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # "NaN", "Infinity" as some writers spell them
        except ValueError:
            return None
    return None


# -- robust statistics -----------------------------------------------------------------------------
def finite_points(steps: Sequence[int], values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(steps[: len(values)], dtype=np.int64)
    v = np.asarray(values[: len(s)], dtype=np.float64)
    keep = np.isfinite(v)
    return s[keep], v[keep]


def train_points(curves: Curves) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, losses, lr) of the finite train points; a 0.0 that hides a NaN is dropped too."""
    n = min(len(curves.train_steps), len(curves.train_loss))
    steps = np.asarray(curves.train_steps[:n], dtype=np.int64)
    loss = np.asarray(curves.train_loss[:n], dtype=np.float64)
    lr = np.asarray(curves.lr[:n], dtype=np.float64) if len(curves.lr) >= n else np.full(n, np.nan)
    keep = np.isfinite(loss)
    keep[hidden_nan_zeros(loss)] = False
    return steps[keep], loss[keep], lr[keep]


def hidden_nan_zeros(loss: np.ndarray) -> list[int]:
    """Indices of losses of exactly 0.0 that follow a finite loss >= ZERO_AFTER_POSITIVE (directly or through
    other such zeros): what Trainer logs when every step of a logging window was NaN. A float32
    cross-entropy only reaches exactly 0 after passing through values far below 0.01."""
    out: list[int] = []
    armed = False  # the last finite loss was >= ZERO_AFTER_POSITIVE, or a suspicious zero
    for i, value in enumerate(loss):
        if not math.isfinite(value):
            continue
        if value == 0.0 and armed:
            out.append(i)
            continue
        armed = value >= ZERO_AFTER_POSITIVE
    return out


def head_points(n: int) -> int:
    """How many first points define the starting level."""
    return max(3, n // 20)


def rolling_median_min(values: np.ndarray, window: int) -> float:
    """The lowest median of `window` consecutive points (windows a quarter window apart: O(n))."""
    if len(values) <= window:
        return median(values)
    stride = max(1, window // 4)
    starts = list(range(0, len(values) - window + 1, stride))
    if starts[-1] != len(values) - window:
        starts.append(len(values) - window)
    return min(median(values[i : i + window]) for i in starts)


def trailing(values: np.ndarray, window: int, reduce, start: int, chunk: int = 20_000) -> np.ndarray:
    """``reduce`` (a row-wise function of a 2-D array) over the up-to-`window` points before each index
    from `start` on; vectorised in chunks so memory stays bounded on long per-step curves."""
    out = np.full(len(values), np.nan)
    for lo in range(start, len(values), chunk):
        hi = min(len(values), lo + chunk)
        full = np.arange(lo, hi) >= window
        if full.any():
            first = lo + int(np.argmax(full))
            rows = np.lib.stride_tricks.sliding_window_view(values[first - window : hi - 1], window)
            out[first:hi] = reduce(rows)
        for i in range(lo, min(hi, window)):  # the first points: shorter histories
            out[i] = reduce(values[None, :i])[0]
    return out


def median_rows(rows: np.ndarray) -> np.ndarray:
    return np.median(rows, axis=1)


def max_rows(rows: np.ndarray) -> np.ndarray:
    """The largest value of each row (-inf for an empty row)."""
    return rows.max(axis=1) if rows.shape[1] else np.full(rows.shape[0], -np.inf)


def noise_rows(rows: np.ndarray) -> np.ndarray:
    """`_noise` of each row."""
    if rows.shape[1] < 3:
        return np.zeros(rows.shape[0])
    diffs = np.diff(rows, axis=1)
    centred = np.abs(diffs - np.median(diffs, axis=1, keepdims=True))
    return 1.4826 * np.median(centred, axis=1) / math.sqrt(2)


def train_levels(steps: np.ndarray, loss: np.ndarray, at: Sequence[int]) -> np.ndarray:
    """The train level at each eval step of `at`: median of the train points nearest to it (both sides);
    NaN when no train point was logged within TRAIN_LEVEL_POINTS logging intervals of it."""
    out = np.full(len(at), np.nan)
    if not len(loss):
        return out
    interval = max(float(np.median(np.diff(steps))) if len(steps) > 1 else 1.0, 1.0)
    for j, step in enumerate(at):
        distance = np.abs(steps - step)
        if distance.min() > TRAIN_LEVEL_POINTS * interval:
            continue
        if len(loss) > TRAIN_LEVEL_POINTS:
            nearest = np.argpartition(distance, TRAIN_LEVEL_POINTS - 1)[:TRAIN_LEVEL_POINTS]
        else:
            nearest = np.arange(len(loss))
        out[j] = median(loss[nearest])
    return out


def train_level_at(steps: np.ndarray, loss: np.ndarray, step: int) -> float:
    return float(train_levels(steps, loss, [step])[0])


def lr_at(lr: np.ndarray, index: int) -> float | None:
    if index < len(lr) and math.isfinite(lr[index]):
        return float(lr[index])
    return None


def ln_vocab(curves: Curves) -> float | None:
    return math.log(curves.vocab_size) if curves.vocab_size and curves.vocab_size > 1 else None


def eval_points(curves: Curves) -> tuple[np.ndarray, np.ndarray]:
    return finite_points(curves.eval_steps, curves.eval_loss)


class Trend:
    """The least-squares line through (step, value) points, kept as running sums: O(1) per point, so a monitor
    can fit every point since warmup at every step. Steps are counted from the first point (no cancellation
    in the sums on long runs)."""

    __slots__ = ("n", "origin", "sx", "sxx", "sxy", "sy")

    def __init__(self) -> None:
        self.origin: int | None = None
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = 0.0

    def to_state(self) -> dict[str, float | int | None]:
        """The sums as plain data (a monitor's saved state, see `rules.training.base.Monitor.state`)."""
        return {name: getattr(self, name) for name in self.__slots__}

    def load_state(self, state: dict[str, float | int | None]) -> None:
        for name in self.__slots__:
            setattr(self, name, state[name])

    def add(self, step: int, value: float) -> None:
        if self.origin is None:
            self.origin = step
        x = float(step - self.origin)
        self.n += 1
        self.sx += x
        self.sy += value
        self.sxx += x * x
        self.sxy += x * value

    @property
    def spread(self) -> float:
        """The sum of squared deviations of the steps from their mean (what a slope's standard error divides)."""
        return self.sxx - self.sx * self.sx / self.n if self.n else 0.0

    @property
    def slope(self) -> float:
        """Change of the value per step (NaN with fewer than two distinct steps)."""
        spread = self.spread
        return (self.sxy - self.sx * self.sy / self.n) / spread if spread > 0 else math.nan


def slope_fit(steps: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """(slope per step, spread of the steps) of the least-squares line through a curve (NaN slope when its
    steps do not vary)."""
    x = np.asarray(steps, dtype=np.float64)
    x = x - x.mean() if len(x) else x
    spread = float(np.dot(x, x))
    if spread <= 0:
        return math.nan, 0.0
    return float(np.dot(x, np.asarray(values, dtype=np.float64)) / spread), spread


def is_flat(loss: np.ndarray | list[float], *, rel: float, swing: float, min_points: int) -> bool:
    """The loss does not move: the medians of the first points and of each third lie within ``rel`` of each
    other, and the typical step-to-step swing stays below ``swing`` of the level (large swings around one
    level are an oscillation, not a flat loss)."""
    n = len(loss)
    if n < min_points:
        return False
    third = n // 3
    first, last = median(loss[:third]), median(loss[2 * third :])
    if isinstance(loss, list) and abs(first - last) > rel * max(map(abs, loss)):
        # Every level lies within the values, so the largest |level| is at most the largest |value|: levels
        # this far apart cannot be flat (the step detectors run this test at every step).
        return False
    levels = [median(loss[: head_points(n)]), first, median(loss[third : 2 * third]), last]
    top = max(abs(v) for v in levels)
    if isinstance(loss, list):  # a short list of floats: the same numbers without numpy's per-call cost
        typical_swing = median([abs(b - a) for a, b in pairwise(loss)])
    else:
        typical_swing = float(np.median(np.abs(np.diff(loss))))
    return top > 0 and (max(levels) - min(levels)) <= rel * top and typical_swing < swing * top
