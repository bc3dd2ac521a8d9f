"""What every step detector shares: a Monitor is fed numbers step by step and fires each of its rules once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hf_sanity.catalog import Rule
from hf_sanity.findings import Finding


@dataclass(frozen=True)
class TrainingSetup:
    """What SanityCallback knows of the run when it builds the monitors."""

    warmup_steps: int = 0
    world_size: int = 1
    vocab_size: int | None = None  # the model's embedding rows: chance is ln(V)
    accumulation: int = 1  # gradient_accumulation_steps
    max_grad_norm: float | None = None  # gradient clipping (0: off; None: not known)


class Monitor:
    """A plain object fed numbers step by step: ``update(step, values) -> list[Finding]``.

    ``values`` holds whatever was measured at ``step`` (a monitor ignores keys it does not know and keys that
    are missing, so one step can arrive in several parts: the per-step values, the first batch's shapes, a
    memory check). Each of a monitor's rules fires at most once. Register a monitor with
    :func:`hf_sanity.catalog.monitor`; SanityCallback builds one per run with :meth:`from_setup`.
    """

    rules: tuple[Rule, ...] = ()
    reads: tuple[str, ...] = ()  # the value keys it needs: it is fed only the values that carry one of them

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
