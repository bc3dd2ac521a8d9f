"""The shapes of the first real batch entering the model: `shape-mismatch`.

:class:`ShapeMonitor` is fed ``shapes`` (the batch's per-token tensors, before the forward: a mismatch may
well crash it) and, after the forward, ``logits_shape``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.rules.training.base import Monitor

SHAPE_MISMATCH = define(
    "shape-mismatch",
    severity="error",
    stage="training",
    symptom="Crashes on a shape error, or broadcasting silently computes the wrong loss.",
    detects="input_ids, labels and attention_mask of the first real batch must have the same shape; logits "
    "must match labels on the sequence dimension.",
    fix="Pad labels with the same collator as input_ids (-100 for padding) and return them at the same length.",
)

ALIGNED = ("input_ids", "labels", "attention_mask", "inputs_embeds")


def shape_findings(
    shapes: Mapping[str, tuple[int, ...]], logits_shape: tuple[int, ...] | None = None
) -> list[Finding]:
    """`shape-mismatch`: the per-token tensors of a batch share (batch, sequence); the logits match the labels."""
    present = {k: tuple(shapes[k][:2]) for k in ALIGNED if shapes.get(k) is not None and len(shapes[k]) >= 2}
    problems = []
    if len(set(present.values())) > 1:
        problems.append(", ".join(f"{k} {tuple(shapes[k])}" for k in present))
    labels = present.get("labels")
    if logits_shape is not None and labels is not None and tuple(logits_shape[:2]) != labels:
        problems.append(f"logits {tuple(logits_shape)} vs labels {tuple(shapes['labels'])}")
    if not problems:
        return []
    return [
        SHAPE_MISMATCH.finding(
            f"the first batch's tensors disagree on (batch, sequence): {'; '.join(problems)}",
            evidence={"shapes": {k: list(v) for k, v in shapes.items()}, "logits": list(logits_shape or [])},
            step=1,
        )
    ]


@monitor
class ShapeMonitor(Monitor):
    rules = (SHAPE_MISMATCH,)
    reads = ("shapes", "logits_shape")

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        if values.get("shapes") is None:
            return []
        found = shape_findings(values["shapes"], values.get("logits_shape"))
        return (
            self.fire(SHAPE_MISMATCH, found[0].message, step=found[0].step, evidence=found[0].evidence)
            if found
            else []
        )
