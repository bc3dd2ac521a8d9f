"""The loss of every training step: `nonfinite-loss`, `negative-loss`, `loss-plateau-prior`.

Fed one record per optimizer step: ``loss`` (the step's loss as Trainer logs it), ``losses`` (its
micro-batches), ``grad_norm`` (the step's pre-clip gradient norm), ``label_entropy`` (the entropy of the
labels seen so far) and, for a non-finite step, ``nonfinite`` (the facts the callback measured on the
offending batch, see `hf_sanity.training.replay`; :func:`classify` names the cause).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import ANY, NONNEGATIVE_LOSS
from hf_sanity.numbers import finite, fmt, is_finite, median
from hf_sanity.rules.training.base import Monitor

NONFINITE_LOSS = define(
    "nonfinite-loss",
    severity="error",
    stage="training",
    objectives=ANY,
    symptom="Loss becomes NaN/Inf (often logged as 0.0 because `logging_nan_inf_filter` hides it).",
    detects="The per-step loss is kept on the device and read once per logging step, so the exact first "
    "non-finite step is found; the batch is replayed with forward hooks to name the first module whose "
    "output went non-finite, and `evidence.cause` is one of input, lr-too-high, unsafe-math, "
    "precision-overflow, empty-loss-mask or unknown. The batch is saved under output_dir/hf-sanity/.",
    fix="Follow evidence.cause: clean the inputs (input), lower the LR or clip gradients (lr-too-high), guard "
    "log/exp/division in the custom loss (unsafe-math), train in bf16 or fp32 (precision-overflow), fix the "
    "labels mask (empty-loss-mask); reproduce on the saved batch.",
)

NEGATIVE_LOSS = define(
    "negative-loss",
    severity="error",
    stage="training",
    objectives=NONNEGATIVE_LOSS,
    symptom="The loss goes below zero.",
    detects="A cross-entropy loss is never negative: a negative value means a wrong reduction or a sign error.",
    fix="Check the custom loss: sign, reduction, and that it is a proper negative log-likelihood.",
)

LOSS_PLATEAU_PRIOR = define(
    "loss-plateau-prior",
    severity="warning",
    stage="training",
    symptom="The loss plateaus early at a value that never improves; outputs are generic.",
    detects="The loss sits at the entropy of the label distribution: the model learned the token prior only.",
    fix="Check that inputs reach the model (attention mask, position ids, the inputs actually vary) and that "
    "the LR is not too low; run the overfit test.",
)

# -- why a loss went NaN/Inf: the facts measured on the offending batch, and the verdict ---------------
CAUSES = ("input", "empty-loss-mask", "lr-too-high", "unsafe-math", "precision-overflow", "unknown")
# The fix for each cause; the catalog's fix lists them all.
FIX_BY_CAUSE = {
    "input": "Find where the non-finite values enter the batch (the saved batch shows them) and clean or drop them.",
    "empty-loss-mask": "Drop batches without supervised tokens or fix the labels mask (empty-loss-mask shows which "
    "examples carry no loss); a mean over zero tokens is 0/0.",
    "lr-too-high": "Lower the learning rate or lengthen the warmup, and keep gradient clipping on (max_grad_norm).",
    "unsafe-math": "The model's outputs are finite; the loss computation is not. Use log_softmax / "
    "F.cross_entropy instead of log(softmax(...)), and guard log(0), exp overflow and division by zero.",
    "precision-overflow": "The same batch is finite in float32: train in bf16 instead of fp16, or keep the "
    "overflowing module (evidence.module) in float32.",
}
BLOW_UP = 10.0  # a grad norm (or loss) 10x its earlier median: the run was diverging


def blew_up(grad_norms: Sequence[float], losses: Sequence[float], recent: int = 3) -> str | None:
    """Why the steps before a non-finite loss look like divergence (None when they do not)."""
    if any(not math.isfinite(g) for g in grad_norms[-recent:]):
        return "the gradient norm was already non-finite on the steps before"
    gn = finite(grad_norms)
    if len(gn) >= 2:
        earlier = gn[:-recent] if len(gn) > recent else gn[:1]
        base = median(earlier)
        peak = max(gn[-recent:])
        if base > 0 and peak > BLOW_UP * base:
            return f"the gradient norm rose to {peak:.3g}, {peak / base:.0f}x its earlier median {base:.3g}"
    ls = finite(losses)
    if len(ls) >= 2:
        start = min(ls[: max(1, len(ls) - recent)])
        peak = max(ls[-recent:])
        if start > 0 and peak > BLOW_UP * start:
            return f"the loss rose to {peak:.3g}, {peak / start:.0f}x its earlier minimum {start:.3g}"
    return None


def classify(
    facts: Mapping[str, Any], *, grad_norms: Sequence[float] = (), losses: Sequence[float] = ()
) -> tuple[str, str]:
    """The cause of a non-finite loss and the reason, from what was measured on the offending batch.

    ``facts``: ``input_nonfinite`` (names of batch tensors holding NaN/Inf), ``supervised_tokens``,
    ``logits_finite`` (the replayed forward's outputs were all finite), ``half_precision`` and
    ``fp32_finite`` (the same batch recomputed in float32 gave a finite loss). ``grad_norms``/``losses`` are
    the steps before.
    """
    if facts.get("input_nonfinite"):
        names = ", ".join(facts["input_nonfinite"])
        return "input", f"the batch itself holds non-finite values ({names})"
    if facts.get("supervised_tokens") == 0:
        return (
            "empty-loss-mask",
            "the batch has no supervised token (every label is -100): the mean loss is 0/0",
        )
    diverging = blew_up(grad_norms, losses)
    if diverging:
        return "lr-too-high", diverging
    if facts.get("nonfinite_weights"):
        return (
            "lr-too-high",
            f"the weights were already non-finite ({facts['nonfinite_weights'][0]}, ...) after an update",
        )
    if facts.get("logits_finite") is True:
        return (
            "unsafe-math",
            "every module output and the logits are finite: the loss computation made the NaN/Inf",
        )
    if facts.get("half_precision") and facts.get("fp32_finite") is True:
        return "precision-overflow", "the forward is non-finite in half precision but finite in float32"
    return "unknown", "no measured cause; reproduce on the saved batch"


PLATEAU_WINDOW = 30  # steps the loss must sit at the label prior ...
PLATEAU_TOLERANCE = 0.05  # ... within 5% of the label entropy ...
PLATEAU_FLAT = 0.01  # ... without the second half of the window improving by 1% of it
PLATEAU_START_ABOVE = 0.10  # and the loss started >= 10% above the prior (it came down to it)


@monitor
class LossMonitor(Monitor):
    rules = (NONFINITE_LOSS, NEGATIVE_LOSS, LOSS_PLATEAU_PRIOR)
    reads = ("loss", "losses", "nonfinite", "label_entropy", "grad_norm")

    def __init__(self, *, plateau_window: int = PLATEAU_WINDOW) -> None:
        super().__init__()
        self.plateau_window = plateau_window
        self.losses: list[tuple[int, float]] = []  # finite step losses
        self.grad_norms: list[float] = []  # every step's grad norm, finite or not, before the current step
        self.label_entropy: float | None = None
        self._near_since: int | None = None

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        out: list[Finding] = []
        if values.get("label_entropy") is not None:
            self.label_entropy = float(values["label_entropy"])
        loss = values.get("loss")
        if loss is not None:
            micro = [float(x) for x in values.get("losses") or [loss]]
            if not all(math.isfinite(x) for x in [*micro, float(loss)]):
                out += self._nonfinite(step, float(loss), micro, values.get("nonfinite") or {})
            else:
                if min(micro) < 0 or loss < 0:
                    lowest = min(min(micro), float(loss))
                    out += self.fire(
                        NEGATIVE_LOSS,
                        f"the training loss is negative ({fmt(lowest)}) at step {step}",
                        step=step,
                        evidence={"loss": lowest, "micro_batch_losses": micro},
                    )
                self.losses.append((step, float(loss)))
                out += self._plateau(step)
        if "grad_norm" in values and values["grad_norm"] is not None:
            self.grad_norms.append(float(values["grad_norm"]))
        return out

    def _nonfinite(
        self, step: int, loss: float, micro: list[float], facts: Mapping[str, Any]
    ) -> list[Finding]:
        if NONFINITE_LOSS.slug in self.fired:
            return []
        cause, why = classify(facts, grad_norms=self.grad_norms, losses=[v for _, v in self.losses])
        bad = next((i for i, x in enumerate(micro) if not math.isfinite(x)), 0)
        evidence = {
            "cause": cause,
            "why": why,
            "loss": loss,
            "micro_batch": bad,
            "module": facts.get("module"),
            "last_finite_loss": self.losses[-1][1] if self.losses else None,
            "grad_norms_before": self.grad_norms[-5:],
        }
        evidence.update({k: v for k, v in facts.items() if k not in evidence and v is not None})
        where = f" in {facts['module']}" if facts.get("module") else ""
        return self.fire(
            NONFINITE_LOSS,
            f"the loss is {loss} at step {step} (first non-finite step; cause: {cause}){where}",
            step=step,
            evidence=evidence,
            fix=FIX_BY_CAUSE.get(cause),
        )

    def _plateau(self, step: int) -> list[Finding]:
        prior = self.label_entropy
        if prior is None or prior <= 0 or LOSS_PLATEAU_PRIOR.slug in self.fired:
            return []
        loss = self.losses[-1][1]
        if abs(loss - prior) <= PLATEAU_TOLERANCE * prior:
            if self._near_since is None:
                self._near_since = step
        else:
            self._near_since = None
        w = self.plateau_window
        if len(self.losses) < 2 * w:
            return []
        window = [v for _, v in self.losses[-w:]]
        level = median(window)
        start = median([v for _, v in self.losses[:5]])
        improving = median(window[: w // 2]) - median(window[w // 2 :]) > PLATEAU_FLAT * prior
        if (
            abs(level - prior) > PLATEAU_TOLERANCE * prior
            or improving
            or start < (1 + PLATEAU_START_ABOVE) * prior
        ):
            return []
        since = self._near_since if self._near_since is not None else self.losses[-w][0]
        return self.fire(
            LOSS_PLATEAU_PRIOR,
            f"the loss sits at {fmt(level)}, the entropy of the label distribution ({fmt(prior)}), "
            f"over the last {w} steps: the model predicts the token prior only",
            step=since,
            evidence={
                "loss_level": level,
                "label_entropy": prior,
                "start_loss": start,
                "window_steps": w,
                "since_step": since,
            },
        )


def loss_level(losses: list[tuple[int, float]], last: int = 5) -> float | None:
    values = [v for _, v in losses[-last:] if is_finite(v)]
    return median(values) if values else None
