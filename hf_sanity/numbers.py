"""The few statistics and number formats every part of hf-sanity shares (one copy of each)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import Any

import numpy as np


def finite(values: Iterable[float | None]) -> list[float]:
    """The finite numbers among ``values``, as floats."""
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def is_finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def median(values: Sequence[float] | np.ndarray) -> float:
    """The median (NaN for no values): the level of a short series that one outlier does not move.

    A short list of Python numbers is sorted in Python (the step detectors take medians of a few dozen values
    at every step, and ``np.median`` costs ~20 µs a call); the result is ``np.median``'s to the bit: the
    middle value, or the mean of the two middle ones in float64, NaN if any value is NaN."""
    n = len(values)
    if not n:
        return math.nan
    if n <= SMALL_MEDIAN and isinstance(values, (list, tuple)) and set(map(type, values)) <= _PLAIN:
        ordered = sorted(map(float, values))
        if any(map(math.isnan, ordered)):
            return math.nan
        mid = n // 2
        return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return float(np.median(values))


SMALL_MEDIAN = 512
_PLAIN = frozenset((float, int))


def noise(values: Sequence[float] | np.ndarray) -> float:
    """Robust standard deviation of a series' step-to-step noise: 1.4826 x the MAD of its differences /
    sqrt(2). It ignores the trend and a few outliers. (A short list of Python numbers is computed in Python, as
    :func:`median` does, to the same bits: the step detectors call it at every step.)"""
    if len(values) < 3:
        return 0.0
    if isinstance(values, list) and len(values) <= SMALL_MEDIAN and set(map(type, values)) <= _PLAIN:
        diffs = [float(b) - float(a) for a, b in pairwise(values)]
        middle = median(diffs)
        return 1.4826 * median([abs(d - middle) for d in diffs]) / math.sqrt(2)
    diffs = np.diff(values)
    return float(1.4826 * np.median(np.abs(diffs - np.median(diffs))) / math.sqrt(2))


def fmt(value: Any, digits: int = 3) -> str:
    """A number for a message: ``digits`` significant digits, an exponent only for very small or very large
    magnitudes. Anything else as ``str``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        return str(value)
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits}g}"


def rounded(value: float | None, digits: int = 4) -> float | None:
    """A number for the JSON evidence: ``digits`` significant digits (non-finite values and None unchanged)."""
    if value is None or not math.isfinite(value):
        return value
    return float(f"{value:.{digits}g}")
