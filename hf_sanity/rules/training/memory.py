"""Memory held across steps: `memory-growth` and `oom`.

:class:`MemoryMonitor` is fed, at each memory check, ``graph_tensors`` (live tensors that still carry
autograd history between steps: there should be none), ``holders`` (where they are held: attribute path ->
count), ``allocated`` (accelerator memory allocated, in bytes, where there is an accelerator) and, when
training died of it, ``oom`` (the error text and a memory breakdown).

:func:`graph_tensors` finds the held tensors by walking the attributes of the objects that live across
steps (trainer, model, callbacks, the loss function and the user's module globals); :func:`gc_graph_tensors`
scans every object the garbage collector tracks (slower; the callback spends a bounded share of time on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import ANY
from hf_sanity.numbers import fmt
from hf_sanity.rules.training.base import Monitor

MEMORY_GROWTH = define(
    "memory-growth",
    severity="warning",
    stage="training",
    objectives=ANY,
    symptom="Out-of-memory after hours of training; memory rises step after step.",
    detects="Memory held across steps keeps growing: on GPU, allocated memory; on CPU, live tensors that "
    "carry autograd history. Names the growth per step and, where possible, the attribute or list holding them.",
    fix="Store `loss.item()` or `loss.detach()`, never the loss tensor itself, in lists and metrics.",
)

OOM = define(
    "oom",
    severity="error",
    stage="training",
    objectives=ANY,
    symptom="CUDA out of memory.",
    detects="An out-of-memory error during training; reports the memory breakdown and whether memory grew "
    "before it, so a leak is not 'fixed' by shrinking the batch.",
    fix="If memory grew before the OOM, fix the leak (memory-growth); otherwise lower the batch size, enable "
    "gradient checkpointing, or use a smaller max_len.",
)

GROWTH_CHECKS = 3  # the measure rose at 3 consecutive checks ...
MIN_BYTES_PER_STEP = 1 << 20  # ... by >= 1 MiB per step (accelerator memory) ...
SKIP_STEPS = 2  # ... ignoring the first steps (optimizer state is allocated at the first step)


@monitor
class MemoryMonitor(Monitor):
    rules = (MEMORY_GROWTH, OOM)
    reads = ("graph_tensors", "holders", "allocated", "oom")
    not_carried = ("series", "holders")  # this process's memory: a resumed process starts its own series

    def __init__(self) -> None:
        super().__init__()
        self.series: dict[str, list[tuple[int, float]]] = {"graph_tensors": [], "allocated": []}
        self.holders: dict[str, int] = {}

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        out: list[Finding] = []
        if values.get("holders"):
            self.holders = dict(values["holders"])
        for key in ("graph_tensors", "allocated"):
            value = values.get(key)
            if value is None or (key == "allocated" and step <= SKIP_STEPS):
                continue
            points = self.series[key]
            if points and points[-1][0] == step:
                points[-1] = (step, float(value))
            else:
                points.append((step, float(value)))
            out += self._growth(key, step)
        if values.get("oom"):
            out += self._oom(step, values["oom"])
        return out

    def growing(self, key: str) -> list[tuple[int, float]]:
        """The trailing run of points of ``key`` where each rose above the one before (with its base point)."""
        points = self.series[key]
        run = points[-1:]
        for prev, cur in zip(reversed(points[:-1]), reversed(points[1:])):
            rise = cur[1] - prev[1]
            need = MIN_BYTES_PER_STEP * (cur[0] - prev[0]) if key == "allocated" else 0
            if rise <= need:
                break
            run.insert(0, prev)
        return run if len(run) > 1 else []

    def _growth(self, key: str, step: int) -> list[Finding]:
        run = self.growing(key)
        if len(run) < GROWTH_CHECKS + 1:
            return []
        (s0, v0), (s1, v1) = run[0], run[-1]
        per_step = (v1 - v0) / max(s1 - s0, 1)
        first = run[1][0]
        holder = max(self.holders, key=self.holders.get) if self.holders else None
        if key == "graph_tensors":
            what = f"{fmt(per_step)} tensors with autograd history per step are kept alive ({int(v0)} -> {int(v1)})"
        else:
            what = f"allocated memory grows {per_step / 2**20:.1f} MiB per step ({v0 / 2**20:.0f} -> {v1 / 2**20:.0f} MiB)"
        where = f", held by {holder}" if holder else ""
        return self.fire(
            MEMORY_GROWTH,
            f"memory grows from step {first}: {what}{where}",
            step=first,
            evidence={
                "measure": key,
                "per_step": per_step,
                "start": v0,
                "end": v1,
                "steps": [s for s, _ in run],
                "holder": holder,
                "holders": dict(sorted(self.holders.items(), key=lambda kv: -kv[1])[:5]),
            },
        )

    def grew_before(self) -> bool:
        return MEMORY_GROWTH.slug in self.fired or any(len(self.growing(key)) >= 3 for key in self.series)

    def _oom(self, step: int, oom: Mapping[str, Any]) -> list[Finding]:
        grew = self.grew_before()
        verdict = "memory grew before it: fix the leak first" if grew else "memory was flat before it"
        return self.fire(
            OOM,
            f"out of memory at step {step}; {verdict}",
            step=step,
            evidence={"growth_before": grew, **{k: v for k, v in oom.items()}},
        )
