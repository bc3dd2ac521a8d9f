"""Replicas that drifted apart under DDP: `ranks-diverged`.

:class:`RankMonitor` is fed ``checksum_max``/``checksum_min`` (element-wise max and min over ranks of one
checksum per parameter) and ``names``; `hf_sanity.training.ranks` computes and exchanges them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import ANY
from hf_sanity.rules.training.base import Monitor, TrainingSetup

RANKS_DIVERGED = define(
    "ranks-diverged",
    severity="error",
    stage="training",
    objectives=ANY,
    symptom="Under DDP, replicas drift apart; checkpoints from different ranks differ.",
    detects="Cheap per-parameter checksums are compared across ranks every few steps.",
    fix="Make every rank go through the DDP-wrapped model for forward/backward, clip on every rank, and do not "
    "skip steps on one rank only.",
)

RELATIVE_TOLERANCE = 1e-6  # replicas are bit-identical; this only absorbs a reduction done differently


@monitor
class RankMonitor(Monitor):
    rules = (RANKS_DIVERGED,)
    reads = ("checksum_max", "checksum_min", "names")

    def __init__(self, world_size: int = 1) -> None:
        super().__init__()
        self.world_size = world_size

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> RankMonitor:
        return cls(setup.world_size)

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        high, low = values.get("checksum_max"), values.get("checksum_min")
        if high is None or low is None:
            return []
        names: Sequence[str] = values.get("names") or [str(i) for i in range(len(high))]
        differing = []
        worst = 0.0
        for name, hi, lo in zip(names, high, low):
            gap = abs(hi - lo)
            scale = max(abs(hi), abs(lo), 1e-30)
            if gap > RELATIVE_TOLERANCE * scale:
                differing.append(name)
                worst = max(worst, gap / scale)
        if not differing:
            return []
        return self.fire(
            RANKS_DIVERGED,
            f"{len(differing)} of {len(high)} parameters differ between the {self.world_size} ranks at step {step} "
            f"(first: {differing[0]}, relative gap up to {worst:.2g})",
            step=step,
            evidence={
                "differing": len(differing),
                "parameters": len(high),
                "names": differing[:10],
                "max_relative_gap": worst,
                "world_size": self.world_size,
            },
        )
