"""The shapes of the first real batch entering the model, and of what its loss is computed from:
`shape-mismatch`.

:class:`ShapeMonitor` is fed ``shapes`` (the batch's per-token tensors, before the forward: a mismatch may
well crash it), after the forward ``logits_shape``, and after the first step ``loss_broadcast``: the
operations of the step that broadcast the model's output against the labels, and torch's broadcasting
warnings (``hf_sanity.training.broadcast``).
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
    "must match labels on the sequence dimension. And what the loss is computed from, in the first real step "
    "(the trainer's own compute_loss, the model's forward): every torch operation is followed, and an "
    "elementwise operation or loss function between a tensor derived from the model alone and one derived from "
    "the labels alone whose result is larger than both (a (B, 1) output against (B,) targets: (B, B), every "
    "prediction against every target) is cause `broadcast`, with torch's own broadcasting warning when one was "
    "raised in the step. Not watched under torch.compile, FSDP or DeepSpeed (the report's "
    "`stats.loss_watch` says so).",
    fix="Pad labels with the same collator as input_ids (-100 for padding) and return them at the same length.",
)

BROADCAST_FIX = (
    "Make the model's output and the targets the same shape before the loss: `output.squeeze(-1)` for a "
    "(B, 1) regression head against (B,) targets (or `labels.view_as(output)`), and assert it "
    "(`assert output.shape == labels.shape`) where the loss is computed."
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
    reads = ("shapes", "logits_shape", "loss_broadcast")

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        if values.get("loss_broadcast"):
            return self._broadcast(step, values["loss_broadcast"])
        if values.get("shapes") is None:
            return []
        found = shape_findings(values["shapes"], values.get("logits_shape"))
        return (
            self.fire(SHAPE_MISMATCH, found[0].message, step=found[0].step, evidence=found[0].evidence)
            if found
            else []
        )

    def _broadcast(self, step: int, found: Mapping[str, Any]) -> list[Finding]:
        broadcasts, warned = found.get("broadcasts") or [], found.get("warnings") or []
        if broadcasts:
            first = broadcasts[0]
            message = (
                f"the loss at step {step} broadcasts the model's output {tuple(first['output'])} against the labels "
                f"{tuple(first['labels'])} into {tuple(first['result'])} (`{first['op']}`"
                f"{' at ' + first['at'] if first.get('at') else ''}): every prediction is compared with every "
                "target, and the loss is not the one meant"
            )
        else:
            message = f"torch warned of broadcasting in the loss at step {step}: {warned[0]}"
        evidence = {"cause": "broadcast", "operations": broadcasts, "torch_warnings": warned}
        return self.fire(SHAPE_MISMATCH, message, step=step, evidence=evidence, fix=BROADCAST_FIX)
