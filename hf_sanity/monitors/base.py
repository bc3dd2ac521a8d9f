"""What every monitor shares: fire each rule once, and a few robust statistics over short series."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hf_sanity.catalog import Rule
from hf_sanity.findings import Finding


class Monitor:
    """A plain object fed numbers step by step: ``update(step, values) -> list[Finding]``.

    ``values`` holds whatever was measured at ``step`` (a monitor ignores keys it does not know and keys that
    are missing, so one step can arrive in several parts). Each of a monitor's rules fires at most once.
    """

    rules: tuple[Rule, ...] = ()

    def __init__(self) -> None:
        self.fired: set[str] = set()

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


def finite(values: Iterable[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return math.nan
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def is_finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def fmt(value: float) -> str:
    """A number for a message: 3 significant digits, no exponent for ordinary magnitudes."""
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.2e}"
    return f"{value:.3g}"
