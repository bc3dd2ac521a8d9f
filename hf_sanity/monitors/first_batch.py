"""The first real batch entering the model, checked once at the first training step.

The tensor rules of preflight (`empty-loss-mask`, `labels-misaligned`, `prompt-in-loss`, `eos-not-learned`,
...) run on it through the usual context; `shape-mismatch` compares its shapes; `init-loss-off-chance` runs
preflight's own check on the step-0 numbers the callback's probe measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_sanity.findings import Finding
from hf_sanity.rules.training import SHAPE_MISMATCH

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


def token_findings(
    tokenizer, batch: Mapping[str, Any], *, model, trainer, selection, max_len, step0
) -> list[Finding]:
    """preflight's `tokens` rules on this one batch, and `init-loss-off-chance` on the step-0 numbers."""
    from hf_sanity.preflight.run import run_checks
    from hf_sanity.preflight.trainer_batches import batches_context
    from hf_sanity.report import Report
    from hf_sanity.rng import preserved_rng
    from hf_sanity.rules.internal import internal_error
    from hf_sanity.rules.model import INIT_LOSS_OFF_CHANCE

    if tokenizer is None or "input_ids" not in batch:
        return []
    tensors = {
        k: v.detach().cpu()
        for k, v in batch.items()
        if k in ("input_ids", "labels", "attention_mask", "position_ids") and hasattr(v, "shape")
    }
    with preserved_rng():
        ctx = batches_context(tokenizer, [tensors], model=model, max_len=max_len, trainer=trainer)
        report = run_checks(ctx, selection, stages=("tokens",), report=Report())
        findings = list(report.findings)
        if (
            step0
            and selection.enabled(INIT_LOSS_OFF_CHANCE.slug)
            and INIT_LOSS_OFF_CHANCE.checker is not None
        ):
            ctx.__dict__["init_loss"] = dict(step0)
            try:
                findings += [f for f in INIT_LOSS_OFF_CHANCE.checker(ctx) or () if selection.apply(f)]
            except Exception as exc:
                findings.append(internal_error(INIT_LOSS_OFF_CHANCE.slug, exc))
    for finding in findings:
        finding.step = 1 if finding.step is None else finding.step
    return findings
