"""Curve rules: shapes of the loss and eval curves, shared by `SanityCallback` (online) and `doctor`
(on logged histories). Detectors are pure functions over series of numbers.

Every detector takes a :class:`Curves` and returns a list of findings; :func:`analyze` runs them all
(``final=False`` while training is still running: only the detectors that can judge a partial curve).
Thresholds are named constants below and quoted in each rule's ``detects`` text. They are relative
(fractions of the loss level) or measured against the curve's own noise, never absolute loss values, so
they hold for a loss of 0.3 as for a loss of 9:

* the *level* of a stretch of curve is its median, so one bad batch does not move it;
* the *noise* of a curve is the robust standard deviation of its step-to-step differences
  (1.4826 x MAD / sqrt(2)), which ignores the trend and a few outliers.

The curve-level forms of four rules declared in `hf_sanity.rules.training` are detected here too:
`nonfinite-loss` (a NaN/Inf loss, or a loss of exactly 0.0 right after losses >= 0.01: with
`logging_nan_inf_filter` on, the default, Trainer logs 0.0 for a logging window whose steps were all
NaN), `negative-loss` (any logged loss < 0), `lr-zero` (the logged learning rate is exactly 0 at a
logged step other than the first and the last: the schedule reached 0 before the end) and `loss-flat`
(the medians of the first points and of each third lie within 2% of each other and the step-to-step
swing is under 10% of the level; "flat at chance" within 5% of ln(V) when the vocabulary size is known).

Online (``final=False``) the detectors that need the whole run are skipped: loss-oscillation and
underfitting judge the end of training, and loss-flat is measured with its cause by the callback's own
monitor. Every detector is O(n) (vectorised), so analysing 100k per-step losses takes well under a second.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hf_sanity.catalog import Rule, define
from hf_sanity.findings import Finding
from hf_sanity.rules.training import LOSS_FLAT, LR_ZERO, NEGATIVE_LOSS, NONFINITE_LOSS

# -- thresholds ------------------------------------------------------------------------------------
SPIKE_HISTORY = 10  # trailing points that define the running level before a step
SPIKE_NOISE_HISTORY = 50  # trailing points that define the noise there
SPIKE_MIN_HISTORY = 20  # no spike is judged before this many points
SPIKE_RATIO = 1.5  # a spike is >= 50% above the running median ...
SPIKE_NOISE = 6.0  # ... and >= 6 noise sigmas above it (Gaussian noise: ~1e-9 per point)
SPIKE_MAX_FINDINGS = 3

OSC_MIN_POINTS = 20
OSC_AMPLITUDE = 0.10  # the typical step-to-step swing is >= 10% of the loss level ...
OSC_SIGN_CHANGES = 0.5  # ... the direction flips at least every other step ...
# ... and the whole decrease (first points -> last third) is smaller than one typical swing.

EVAL_MIN = 3  # evaluations needed by every eval-based detector
OVERFIT_RISE = 0.03  # the last eval loss is >= 3% above the best one ...
OVERFIT_AFTER = 2  # ... with >= 2 evaluations after the best ...
TRAIN_FELL = 0.02  # ... while the train level fell >= 2% over the same steps

UNDERFIT_MIN_POINTS = 10
UNDERFIT_DROP = 0.10  # the best running level never got 10% below the start (train, and eval if logged)
UNDERFIT_CHANCE = 0.8  # or, with the vocabulary known, it never got below 80% of ln(V)

VBT_GAP = 0.10  # eval loss >= 10% below the train level ...
VBT_CONSECUTIVE = 3  # ... at each of the last 3 evaluations

CONSTANT_REL = 1e-6  # eval values equal to 1e-6 relative count as identical
CONSTANT_TRAIN_MOVED = 0.01  # ... while the train level moved >= 1% between the first and last evaluation

MEMO_TRAIN_DROP = 0.5  # train level halves between the first and the last evaluation ...
MEMO_EVAL_FLAT = 0.03  # ... while the eval loss stays within 3% (max - min, relative to its min)

FLAT_MIN_POINTS = 10
FLAT_REL = 0.02  # the medians of the first points and of each third lie within 2% of each other
FLAT_CHANCE = 0.05  # "flat at chance": the level is within 5% of ln(V)

ZERO_AFTER_POSITIVE = 0.01  # a loss of exactly 0.0 right after a loss >= 0.01 is a hidden NaN
LR_ZERO_ABS = 1e-12  # a learning rate at or below this is 0

TRAIN_LEVEL_POINTS = 5  # the train level at an eval step: median of the 5 train points nearest to it


LOSS_SPIKE = define(
    "loss-spike",
    severity="warning",
    stage="curves",
    symptom="The loss suddenly jumps after it had been decreasing.",
    detects=f"A logged train loss >= {SPIKE_RATIO:g}x the median of the {SPIKE_HISTORY} points before it and "
    f">= {SPIKE_NOISE:g} noise sigmas above that median (noise: robust spread of the step-to-step differences "
    f"over the {SPIKE_NOISE_HISTORY} points before it), "
    "once that running median is below the median of the first points (the loss had decreased). Reports "
    "the step, the learning rate there and how long the loss stayed up; up to "
    f"{SPIKE_MAX_FINDINGS} spikes per run.",
    fix="Lower the LR or lengthen warmup, keep gradient clipping on, inspect the batch that preceded the spike.",
)

LOSS_OSCILLATION = define(
    "loss-oscillation",
    severity="warning",
    stage="curves",
    symptom="The loss zig-zags without trending down.",
    detects=f"At the end of training ({OSC_MIN_POINTS}+ logged points): the typical step-to-step swing (median "
    f"|difference|) is >= {OSC_AMPLITUDE:.0%} of the loss level, the direction flips at >= "
    f"{OSC_SIGN_CHANGES:.0%} of the steps, and the whole decrease (median of the first points minus the "
    "median of the last third) is smaller than one typical swing. A curve flat from the start with smaller "
    "swings is `loss-flat` instead.",
    fix="Lower the learning rate, raise the batch size (or gradient accumulation), check data shuffling.",
)

OVERFITTING = define(
    "overfitting",
    severity="warning",
    stage="curves",
    symptom="Eval loss rises while the training loss keeps falling.",
    detects=f"With {EVAL_MIN}+ evaluations: the last eval loss is >= {OVERFIT_RISE:.0%} above the best one, "
    f"with {OVERFIT_AFTER}+ evaluations after the best, while the train level (median of the "
    f"{TRAIN_LEVEL_POINTS} train points nearest each evaluation) fell >= {TRAIN_FELL:.0%} between the best "
    "and the last evaluation. Reports the best step.",
    fix="Keep the checkpoint of the best step (load_best_model_at_end), train fewer epochs, add data or "
    "regularisation (dropout, weight decay, smaller LoRA rank).",
)

UNDERFITTING = define(
    "underfitting",
    severity="warning",
    stage="curves",
    symptom="Both train and eval loss stay high.",
    detects=f"At the end of training ({UNDERFIT_MIN_POINTS}+ logged points, neither flat nor oscillating): "
    "the lowest running "
    f"median of the train loss never got {UNDERFIT_DROP:.0%} below its start, nor did the eval loss below "
    "its first evaluation (when logged); or, with the vocabulary size V known, both stayed above "
    f"{UNDERFIT_CHANCE:.0%} of ln(V) (near chance). A run that went down and then diverged is not "
    "underfitting (see loss-spike).",
    fix="First run the overfit test (`hf-sanity overfit`): if a single batch cannot be overfit it is a pipeline "
    "bug; otherwise raise the LR, train longer, or use a larger adapter.",
)

VAL_BELOW_TRAIN = define(
    "val-below-train",
    severity="warning",
    stage="curves",
    symptom="Eval loss is consistently below the train loss.",
    detects=f"At each of the last {VBT_CONSECUTIVE} evaluations the eval loss is >= {VBT_GAP:.0%} below the "
    f"train level there (median of the {TRAIN_LEVEL_POINTS} train points nearest the evaluation, so the "
    "lag of the logged train average does not count).",
    fix="Check for leakage between splits (split-leakage), an easier eval set, or dropout making train loss "
    "higher; make sure both losses are computed over the same tokens.",
)

EVAL_CONSTANT = define(
    "eval-constant",
    severity="warning",
    stage="curves",
    symptom="Eval metrics are identical at every evaluation.",
    detects=f"The eval loss or an eval metric has the same value (to {CONSTANT_REL:g} relative) at every one of "
    f"{EVAL_MIN}+ evaluations while the train level moved >= {CONSTANT_TRAIN_MOVED:.0%} between the first "
    "and the last of them. Timing and sample-count entries (*_runtime, *_per_second, *_time, *_samples) "
    "are not metrics.",
    fix="Check that evaluation uses the current weights (not a stale copy), that the adapter is active, and "
    "that the metric reads the predictions.",
)

MEMORIZING = define(
    "memorizing",
    severity="warning",
    stage="curves",
    symptom="Training loss falls fast towards 0 while eval does not improve.",
    detects=f"Over {EVAL_MIN}+ evaluations the train level falls to <= {MEMO_TRAIN_DROP:.0%} of its value at "
    f"the first evaluation while the eval loss stays within {MEMO_EVAL_FLAT:.0%} (max - min over its min) "
    "without being exactly constant (that is eval-constant).",
    fix="Deduplicate the training data, lower the LR or epochs, add data; check label-leakage.",
)


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
            step = _number(entry.get("step"))
            if "loss" in entry:
                loss = _number(entry["loss"])
                if loss is not None:
                    curves.train_steps.append(int(step) if step is not None else len(curves.train_steps) + 1)
                    curves.train_loss.append(loss)
                    lrs.append(_number(entry.get("learning_rate")))
            metrics = {
                key: value
                for key, value in ((k, _number(v)) for k, v in entry.items() if k.startswith("eval_"))
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


def _number(value: Any) -> float | None:
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
def _finite(steps: Sequence[int], values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(steps[: len(values)], dtype=np.int64)
    v = np.asarray(values[: len(s)], dtype=np.float64)
    keep = np.isfinite(v)
    return s[keep], v[keep]


def _train(curves: Curves) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, losses, lr) of the finite train points; a 0.0 that hides a NaN is dropped too."""
    n = min(len(curves.train_steps), len(curves.train_loss))
    steps = np.asarray(curves.train_steps[:n], dtype=np.int64)
    loss = np.asarray(curves.train_loss[:n], dtype=np.float64)
    lr = np.asarray(curves.lr[:n], dtype=np.float64) if len(curves.lr) >= n else np.full(n, np.nan)
    keep = np.isfinite(loss)
    keep[_hidden_nan_zeros(loss)] = False
    return steps[keep], loss[keep], lr[keep]


def _hidden_nan_zeros(loss: np.ndarray) -> list[int]:
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


def _median(values: np.ndarray) -> float:
    return float(np.median(values)) if len(values) else math.nan


def _noise(values: np.ndarray) -> float:
    """Robust standard deviation of the per-step noise: MAD of the step-to-step differences / sqrt(2)."""
    if len(values) < 3:
        return 0.0
    diffs = np.diff(values)
    return float(1.4826 * np.median(np.abs(diffs - np.median(diffs))) / math.sqrt(2))


def _head(n: int) -> int:
    """How many first points define the starting level."""
    return max(3, n // 20)


def _rolling_median_min(values: np.ndarray, window: int) -> float:
    """The lowest median of `window` consecutive points (windows a quarter window apart: O(n))."""
    if len(values) <= window:
        return _median(values)
    stride = max(1, window // 4)
    starts = list(range(0, len(values) - window + 1, stride))
    if starts[-1] != len(values) - window:
        starts.append(len(values) - window)
    return min(_median(values[i : i + window]) for i in starts)


def _trailing(values: np.ndarray, window: int, reduce, start: int, chunk: int = 20_000) -> np.ndarray:
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


def _median_rows(rows: np.ndarray) -> np.ndarray:
    return np.median(rows, axis=1)


def _noise_rows(rows: np.ndarray) -> np.ndarray:
    """`_noise` of each row."""
    if rows.shape[1] < 3:
        return np.zeros(rows.shape[0])
    diffs = np.diff(rows, axis=1)
    centred = np.abs(diffs - np.median(diffs, axis=1, keepdims=True))
    return 1.4826 * np.median(centred, axis=1) / math.sqrt(2)


def _train_levels(steps: np.ndarray, loss: np.ndarray, at: Sequence[int]) -> np.ndarray:
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
        out[j] = _median(loss[nearest])
    return out


def _train_level_at(steps: np.ndarray, loss: np.ndarray, step: int) -> float:
    return float(_train_levels(steps, loss, [step])[0])


def _lr_at(lr: np.ndarray, index: int) -> float | None:
    if index < len(lr) and math.isfinite(lr[index]):
        return float(lr[index])
    return None


def _chance(curves: Curves) -> float | None:
    return math.log(curves.vocab_size) if curves.vocab_size and curves.vocab_size > 1 else None


def _is_flat(loss: np.ndarray) -> bool:
    """The loss does not move from the first points: the medians of the first points and of each third
    lie within FLAT_REL of each other, and the step-to-step swings are small (below OSC_AMPLITUDE of the
    level; large swings around one level are loss-oscillation)."""
    n = len(loss)
    if n < FLAT_MIN_POINTS:
        return False
    third = n // 3
    levels = [
        _median(loss[: _head(n)]),
        _median(loss[:third]),
        _median(loss[third : 2 * third]),
        _median(loss[2 * third :]),
    ]
    top = max(abs(v) for v in levels)
    swing = float(np.median(np.abs(np.diff(loss))))
    return top > 0 and (max(levels) - min(levels)) <= FLAT_REL * top and swing < OSC_AMPLITUDE * top


def _round(value: float | None, digits: int = 4) -> float | None:
    if value is None or not math.isfinite(value):
        return value
    return float(f"{value:.{digits}g}")


# -- detectors -------------------------------------------------------------------------------------
def _spike_finding(steps, loss, lr, i: int, end: int, base: float, noise: float) -> Finding:
    recovered = end + 1 < len(loss)
    lr_here = _lr_at(lr, i)
    sigmas = (loss[i] - base) / noise if noise > 0 else math.inf
    return LOSS_SPIKE.finding(
        f"train loss jumped to {loss[i]:.4g} at step {int(steps[i])}, {loss[i] / base:.2f}x its running "
        f"median {base:.4g}"
        + (f" (lr {lr_here:.3g})" if lr_here is not None else "")
        + ("" if recovered else "; it never came back down"),
        evidence={
            "step": int(steps[i]),
            "loss": _round(float(loss[i])),
            "running_median": _round(base),
            "ratio": _round(float(loss[i] / base), 3),
            "noise_sigmas": _round(float(sigmas), 3),
            "learning_rate": lr_here,
            "previous_step": int(steps[i - 1]),
            "elevated_until_step": int(steps[end]),
            "recovered": recovered,
        },
        step=int(steps[i]),
    )


def loss_spike(curves: Curves) -> list[Finding]:
    """Sudden jumps of the train loss above its running median, once the loss had decreased."""
    steps, loss, lr = _train(curves)
    n = len(loss)
    if n <= SPIKE_MIN_HISTORY:
        return []
    start = _median(loss[:SPIKE_MIN_HISTORY])  # fixed, so the online verdict does not change as n grows
    base = _trailing(loss, SPIKE_HISTORY, _median_rows, SPIKE_MIN_HISTORY)
    noise = _trailing(loss, SPIKE_NOISE_HISTORY, _noise_rows, SPIKE_MIN_HISTORY)
    with np.errstate(invalid="ignore"):
        candidate = (
            (base > 0)
            & (base < start)
            & (loss >= SPIKE_RATIO * base)
            & ((noise == 0) | (loss - base >= SPIKE_NOISE * noise))
        )
    events: list[Finding] = []
    total = 0
    after = -1  # the last index of the previous event
    for i in np.flatnonzero(candidate):
        i = int(i)
        if i <= after:
            continue
        # The event lasts while the loss stays above the spike threshold.
        end = i
        while end + 1 < n and loss[end + 1] >= SPIKE_RATIO * base[i]:
            end += 1
        after = end
        total += 1
        if len(events) < SPIKE_MAX_FINDINGS:
            events.append(_spike_finding(steps, loss, lr, i, end, float(base[i]), float(noise[i])))
    if total > len(events):
        for finding in events:
            finding.evidence["spikes_in_run"] = total
    return events


def _oscillation(loss: np.ndarray) -> dict[str, float] | None:
    """The oscillation statistics of a train curve when it zig-zags without trending down, else None."""
    n = len(loss)
    if n < OSC_MIN_POINTS or _is_flat(loss):
        return None
    diffs = np.diff(loss)
    amplitude = float(np.median(np.abs(diffs)))
    level = _median(loss)
    if level <= 0:
        return None
    signs = np.sign(diffs[diffs != 0])
    flips = float(np.mean(signs[1:] != signs[:-1])) if len(signs) > 1 else 0.0
    start = _median(loss[: _head(n)])
    end = _median(loss[-(n // 3) :])
    if amplitude >= OSC_AMPLITUDE * level and flips >= OSC_SIGN_CHANGES and start - end < amplitude:
        return {"amplitude": amplitude, "level": level, "flips": flips, "start": start, "end": end}
    return None


def loss_oscillation(curves: Curves) -> list[Finding]:
    """Large step-to-step swings with no downward trend under them."""
    _, loss, lr = _train(curves)
    stats = _oscillation(loss)
    if stats is None:
        return []
    amplitude, level = stats["amplitude"], stats["level"]
    return [
        LOSS_OSCILLATION.finding(
            f"train loss swings by {amplitude / level:.0%} of its level from step to step "
            f"(median swing {amplitude:.3g}) and does not trend down: it went from {stats['start']:.4g} to "
            f"{stats['end']:.4g}",
            evidence={
                "median_swing": _round(amplitude),
                "swing_fraction_of_level": _round(amplitude / level, 3),
                "direction_flips": _round(stats["flips"], 3),
                "start_level": _round(stats["start"]),
                "end_level": _round(stats["end"]),
                "level": _round(level),
                "learning_rate_max": _round(float(np.nanmax(lr))) if np.isfinite(lr).any() else None,
                "points": len(loss),
            },
        )
    ]


def _evals(curves: Curves) -> tuple[np.ndarray, np.ndarray]:
    return _finite(curves.eval_steps, curves.eval_loss)


def overfitting(curves: Curves) -> list[Finding]:
    """Eval loss went down (or started at its best) then rose while the train loss kept falling."""
    esteps, evals = _evals(curves)
    tsteps, tloss, _ = _train(curves)
    if len(evals) < EVAL_MIN or not len(tloss):
        return []
    best = int(np.argmin(evals))
    after = len(evals) - 1 - best
    if after < OVERFIT_AFTER or evals[best] <= 0:
        return []
    rise = (evals[-1] - evals[best]) / evals[best]
    train_best = _train_level_at(tsteps, tloss, int(esteps[best]))
    train_last = _train_level_at(tsteps, tloss, int(esteps[-1]))
    if rise < OVERFIT_RISE or not train_last <= (1 - TRAIN_FELL) * train_best:
        return []
    return [
        OVERFITTING.finding(
            f"eval loss rose {rise:.1%} from its best {evals[best]:.4g} at step {int(esteps[best])} to "
            f"{evals[-1]:.4g} at step {int(esteps[-1])} while the train loss fell from {train_best:.4g} to "
            f"{train_last:.4g}",
            evidence={
                "best_step": int(esteps[best]),
                "best_eval_loss": _round(float(evals[best])),
                "last_step": int(esteps[-1]),
                "last_eval_loss": _round(float(evals[-1])),
                "rise": _round(float(rise), 3),
                "train_at_best": _round(train_best),
                "train_at_last": _round(train_last),
                "first_eval_loss": _round(float(evals[0])),
            },
            step=int(esteps[best]),
        )
    ]


def underfitting(curves: Curves) -> list[Finding]:
    """Both losses stay close to where they started (or near chance) until the end."""
    tsteps, tloss, _ = _train(curves)
    n = len(tloss)
    if n < UNDERFIT_MIN_POINTS or _is_flat(tloss) or _oscillation(tloss) is not None:
        return []
    window = _head(n)
    start = _median(tloss[:window])
    best = _rolling_median_min(tloss, window)
    end = _median(tloss[-window:])
    if start <= 0:
        return []
    _, evals = _evals(curves)
    has_eval = len(evals) >= 2
    train_drop = (start - best) / start
    eval_drop = (evals[0] - evals.min()) / evals[0] if has_eval and evals[0] > 0 else None
    chance = _chance(curves)
    reasons = []
    if train_drop < UNDERFIT_DROP and (not has_eval or (eval_drop is not None and eval_drop < UNDERFIT_DROP)):
        reasons.append("barely-moved")
    if (
        chance is not None
        and best >= UNDERFIT_CHANCE * chance
        and (not has_eval or evals.min() >= UNDERFIT_CHANCE * chance)
    ):
        reasons.append("near-chance")
    if not reasons:
        return []
    if reasons[0] == "barely-moved":
        message = f"train loss never got more than {train_drop:.1%} below its start ({start:.4g} -> best {best:.4g})"
        if has_eval:
            message += f", eval loss {eval_drop:.1%} below its first evaluation"
    else:
        message = f"train loss ends at {end:.4g}, still {best / chance:.0%} of chance ln(V)={chance:.4g} at its best"
    return [
        UNDERFITTING.finding(
            message,
            evidence={
                "train_start": _round(start),
                "train_best": _round(best),
                "train_end": _round(end),
                "train_drop": _round(train_drop, 3),
                "eval_first": _round(float(evals[0])) if has_eval else None,
                "eval_best": _round(float(evals.min())) if has_eval else None,
                "eval_drop": _round(eval_drop, 3),
                "chance_ln_vocab": _round(chance),
                "reasons": reasons,
            },
            step=int(tsteps[-1]),
        )
    ]


def val_below_train(curves: Curves) -> list[Finding]:
    """The eval loss sits clearly below the train loss at the last evaluations."""
    esteps, evals = _evals(curves)
    tsteps, tloss, _ = _train(curves)
    if len(evals) < max(EVAL_MIN, VBT_CONSECUTIVE) or not len(tloss):
        return []
    levels = _train_levels(tsteps, tloss, esteps)
    below = evals <= (1 - VBT_GAP) * levels
    if not below[-VBT_CONSECUTIVE:].all():
        return []
    first = len(below) - VBT_CONSECUTIVE
    while first > 0 and below[first - 1]:
        first -= 1
    gaps = 1 - evals[first:] / levels[first:]
    return [
        VAL_BELOW_TRAIN.finding(
            f"eval loss is {float(np.median(gaps)):.0%} below the train loss at the last {len(gaps)} "
            f"evaluations (from step {int(esteps[first])}; last: eval {evals[-1]:.4g} vs train {levels[-1]:.4g})",
            evidence={
                "from_step": int(esteps[first]),
                "evaluations_below": len(gaps),
                "evaluations": len(evals),
                "median_gap": _round(float(np.median(gaps)), 3),
                "last_eval_loss": _round(float(evals[-1])),
                "last_train_level": _round(float(levels[-1])),
            },
            step=int(esteps[first]),
        )
    ]


def _train_moved(curves: Curves, first_step: int, last_step: int) -> tuple[bool, float | None]:
    tsteps, tloss, _ = _train(curves)
    if not len(tloss):
        return True, None  # nothing says training stood still
    a = _train_level_at(tsteps, tloss, first_step)
    b = _train_level_at(tsteps, tloss, last_step)
    moved = abs(a - b) / max(abs(a), 1e-12)
    return moved >= CONSTANT_TRAIN_MOVED, moved


def _constant(values: np.ndarray) -> bool:
    return len(values) >= EVAL_MIN and all(
        math.isclose(v, values[0], rel_tol=CONSTANT_REL, abs_tol=1e-12) for v in values
    )


def eval_constant(curves: Curves) -> list[Finding]:
    """An eval metric with the same value at every evaluation while training moved."""
    series = {"eval_loss": curves.eval_loss, **curves.eval_metrics}
    constant: dict[str, float] = {}
    first_step = last_step = None
    evaluations = 0
    for name, values in series.items():
        steps, vals = _finite(curves.eval_steps, values)
        if _constant(vals):
            constant[name] = float(vals[0])
            first_step = int(steps[0]) if first_step is None else min(first_step, int(steps[0]))
            last_step = int(steps[-1]) if last_step is None else max(last_step, int(steps[-1]))
            evaluations = max(evaluations, len(vals))
    if not constant or first_step is None or last_step is None:
        return []
    moved, amount = _train_moved(curves, first_step, last_step)
    if not moved:
        return []
    shown = ", ".join(f"{k}={v:.6g}" for k, v in list(constant.items())[:4])
    return [
        EVAL_CONSTANT.finding(
            f"{shown} identical at all {evaluations} evaluations (steps {first_step}-{last_step})"
            + (f" while the train loss moved {amount:.0%}" if amount is not None else ""),
            evidence={
                "constant": constant,
                "evaluations": evaluations,
                "first_step": first_step,
                "last_step": last_step,
                "train_moved": _round(amount, 3),
            },
            step=last_step,
        )
    ]


def memorizing(curves: Curves) -> list[Finding]:
    """Train loss collapses while the eval loss stays flat."""
    esteps, evals = _evals(curves)
    tsteps, tloss, _ = _train(curves)
    if len(evals) < EVAL_MIN or not len(tloss) or _constant(evals) or evals.min() <= 0:
        return []
    spread = float((evals.max() - evals.min()) / evals.min())
    first = _train_level_at(tsteps, tloss, int(esteps[0]))
    last = _train_level_at(tsteps, tloss, int(esteps[-1]))
    if spread >= MEMO_EVAL_FLAT or not (first > 0 and last <= MEMO_TRAIN_DROP * first):
        return []
    return [
        MEMORIZING.finding(
            f"train loss fell from {first:.4g} to {last:.4g} ({1 - last / first:.0%} lower) between steps "
            f"{int(esteps[0])} and {int(esteps[-1])} while the eval loss stayed within {spread:.1%} "
            f"({evals.min():.4g}-{evals.max():.4g})",
            evidence={
                "first_eval_step": int(esteps[0]),
                "last_eval_step": int(esteps[-1]),
                "train_at_first_eval": _round(first),
                "train_at_last_eval": _round(last),
                "eval_min": _round(float(evals.min())),
                "eval_max": _round(float(evals.max())),
                "eval_spread": _round(spread, 3),
            },
            step=int(esteps[-1]),
        )
    ]


def negative_loss(curves: Curves) -> list[Finding]:
    """Any logged train or eval loss below 0."""
    out = []
    for kind, steps, values in (
        ("train", curves.train_steps, curves.train_loss),
        ("eval", curves.eval_steps, curves.eval_loss),
    ):
        s, v = _finite(steps, values)
        bad = np.flatnonzero(v < 0)
        if len(bad):
            i = int(bad[0])
            out.append(
                NEGATIVE_LOSS.finding(
                    f"{kind} loss is {v[i]:.4g} at step {int(s[i])} ({len(bad)} of {len(v)} logged {kind} "
                    "losses are negative)",
                    evidence={
                        "kind": kind,
                        "first_step": int(s[i]),
                        "loss": _round(float(v[i])),
                        "negative": len(bad),
                        "logged": len(v),
                        "min": _round(float(v.min())),
                    },
                    step=int(s[i]),
                )
            )
    return out


def nonfinite_loss(curves: Curves) -> list[Finding]:
    """NaN/Inf losses, and losses of exactly 0.0 that hide NaN steps."""
    out = []
    for kind, steps, values in (
        ("train", curves.train_steps, curves.train_loss),
        ("eval", curves.eval_steps, curves.eval_loss),
    ):
        n = min(len(steps), len(values))
        s = np.asarray(steps[:n], dtype=np.int64)
        v = np.asarray(values[:n], dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(v))
        if len(bad):
            i = int(bad[0])
            out.append(
                NONFINITE_LOSS.finding(
                    f"{kind} loss is {v[i]} at step {int(s[i])} ({len(bad)} of {n} logged {kind} losses are "
                    "NaN/Inf)",
                    evidence={
                        "kind": kind,
                        "first_step": int(s[i]),
                        "value": str(v[i]),
                        "nonfinite": len(bad),
                        "logged": n,
                        "last_finite_step": int(s[:i][np.isfinite(v[:i])][-1])
                        if np.isfinite(v[:i]).any()
                        else None,
                    },
                    step=int(s[i]),
                )
            )
        if kind == "train":
            zeros = _hidden_nan_zeros(v)
            if zeros:
                i = zeros[0]
                before = v[:i][np.isfinite(v[:i])]
                out.append(
                    NONFINITE_LOSS.finding(
                        f"train loss logged as exactly 0.0 at step {int(s[i])} right after {before[-1]:.4g}: "
                        "with logging_nan_inf_filter (on by default) Trainer logs 0.0 when every step since "
                        f"the last log was NaN/Inf ({len(zeros)} such logged 0.0 losses)",
                        evidence={
                            "kind": "train",
                            "first_step": int(s[i]),
                            "value": 0.0,
                            "previous_loss": _round(float(before[-1])),
                            "zero_losses": len(zeros),
                            "logged": n,
                            "hidden_by": "logging_nan_inf_filter",
                        },
                        fix="Rerun with TrainingArguments(logging_nan_inf_filter=False) (or check grad_norm, "
                        "NaN there confirms it) and let SanityCallback name the first non-finite step; "
                        + NONFINITE_LOSS.fix,
                        step=int(s[i]),
                    )
                )
    return out


def lr_zero(curves: Curves) -> list[Finding]:
    """The learning rate is 0 at logged steps before the end: the schedule decayed (or was set to) 0."""
    n = min(len(curves.lr), len(curves.train_steps))
    if n < 2:
        return []
    lr = np.asarray(curves.lr[:n], dtype=np.float64)
    steps = np.asarray(curves.train_steps[:n], dtype=np.int64)
    known = np.isfinite(lr)
    zero = known & (np.abs(lr) <= LR_ZERO_ABS)
    if known.any() and zero[known].all():
        return [
            LR_ZERO.finding(
                f"learning rate is 0 at every one of the {int(known.sum())} logged steps",
                evidence={"zero_steps": int(zero.sum()), "logged": n, "first_step": int(steps[0])},
                step=int(steps[0]),
            )
        ]
    interior = np.flatnonzero(zero[1 : n - 1]) + 1
    if not len(interior):
        return []
    i = int(interior[0])
    peak = float(np.nanmax(np.where(known, lr, np.nan)))
    trailing = bool(zero[i:].all())
    return [
        LR_ZERO.finding(
            f"learning rate is 0 from step {int(steps[i])}"
            + (" to the end" if trailing else "")
            + f" ({int(zero.sum())} of {n} logged steps; peak {peak:.3g}): "
            + ("the schedule decayed to 0 early" if trailing else "the schedule hits 0 before the end"),
            evidence={
                "first_zero_step": int(steps[i]),
                "zero_steps": int(zero.sum()),
                "logged": n,
                "last_step": int(steps[-1]),
                "peak_lr": _round(peak),
                "zero_until_end": trailing,
            },
            step=int(steps[i]),
        )
    ]


def loss_flat(curves: Curves) -> list[Finding]:
    """The train loss does not move from the start (compared with chance, ln(V), where V is known)."""
    steps, loss, _ = _train(curves)
    if not _is_flat(loss):
        return []
    level = _median(loss)
    chance = _chance(curves)
    at_chance = chance is not None and abs(level - chance) <= FLAT_CHANCE * chance
    n = len(loss)
    spread = float((np.max(loss) - np.min(loss)) / abs(level)) if level else math.inf
    if at_chance:
        message = (
            f"train loss is flat at chance: {level:.4g} over {n} logged steps, ln(V)={chance:.4g} for "
            f"V={curves.vocab_size} (the model predicts a uniform distribution)"
        )
    else:
        message = f"train loss is flat at {level:.4g} over {n} logged steps (steps {int(steps[0])}-{int(steps[-1])})"
        if chance is not None:
            message += f"; chance would be ln(V)={chance:.4g}"
    lr = [v for v in curves.lr if math.isfinite(v)]
    cause = "lr-zero" if lr and all(abs(v) <= LR_ZERO_ABS for v in lr) else "unknown"
    return [
        LOSS_FLAT.finding(
            message,
            evidence={
                "level": _round(level),
                "first": _round(float(loss[0])),
                "last": _round(float(loss[-1])),
                "relative_spread": _round(spread, 3),
                "points": n,
                "chance_ln_vocab": _round(chance),
                "at_chance": at_chance,
                "cause": cause,
            },
            fix=None
            if cause != "unknown"
            else "The logs alone cannot name the cause: rerun a few steps with SanityCallback (or run "
            "`hf-sanity overfit`) to measure it. " + LOSS_FLAT.fix,
            step=int(steps[0]),
        )
    ]


# -- running them ----------------------------------------------------------------------------------
Detector = Callable[[Curves], list[Finding]]

# (rule, detector, meaningful on a partial curve)
DETECTORS: tuple[tuple[Rule, Detector, bool], ...] = (
    (NONFINITE_LOSS, nonfinite_loss, True),
    (NEGATIVE_LOSS, negative_loss, True),
    (LR_ZERO, lr_zero, True),
    (LOSS_SPIKE, loss_spike, True),
    (OVERFITTING, overfitting, True),
    (VAL_BELOW_TRAIN, val_below_train, True),
    (EVAL_CONSTANT, eval_constant, True),
    (MEMORIZING, memorizing, True),
    (LOSS_FLAT, loss_flat, False),  # online, the loss-flat monitor measures the cause instead
    (LOSS_OSCILLATION, loss_oscillation, False),
    (UNDERFITTING, underfitting, False),
)


def analyze(curves: Curves, *, final: bool) -> list[Finding]:
    """Every curve detector on ``curves``. ``final=False`` while training still runs: only the detectors
    that can judge a partial curve. A detector that raises becomes an ``internal-error`` finding."""
    from hf_sanity.rules.internal import internal_error

    findings: list[Finding] = []
    for rule, detector, online in DETECTORS:
        if not final and not online:
            continue
        try:
            findings.extend(detector(curves))
        except Exception as exc:
            findings.append(internal_error(rule.slug, exc))
    return findings
