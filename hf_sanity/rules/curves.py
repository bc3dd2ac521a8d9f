"""Curve rules: shapes of the loss and eval curves, shared by `SanityCallback` (online) and `doctor`
(on logged histories). Detectors are pure functions over series of numbers.

Every detector takes a :class:`~hf_sanity.measure.curves.Curves` and returns a list of findings; it is
registered on its rule as a "curve" detector, and `hf_sanity.drivers.curves.analyze` runs them
(``final=False`` while training is still running: only the detectors that can judge a partial curve).
Thresholds are named constants below and quoted in each rule's ``detects`` text. They are relative
(fractions of the loss level) or measured against the curve's own noise, never absolute loss values, so
they hold for a loss of 0.3 as for a loss of 9:

* the *level* of a stretch of curve is its median, so one bad batch does not move it;
* the *noise* of a curve is the robust standard deviation of its step-to-step differences
  (1.4826 x MAD / sqrt(2)), which ignores the trend and a few outliers.

(The series and these statistics live in `hf_sanity.measure.curves`.)

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
from typing import Any

import numpy as np

from hf_sanity.catalog import define
from hf_sanity.findings import Finding
from hf_sanity.measure.curves import (
    TRAIN_LEVEL_POINTS,
    Curves,
    eval_points,
    finite_points,
    head_points,
    hidden_nan_zeros,
    ln_vocab,
    lr_at,
    max_rows,
    median_rows,
    noise_rows,
    rolling_median_min,
    slope_fit,
    trailing,
    train_level_at,
    train_levels,
    train_points,
)
from hf_sanity.measure.objective import NOT_RL
from hf_sanity.numbers import median, noise, rounded
from hf_sanity.rules.training.divergence import guarded_fix, safeguards
from hf_sanity.rules.training.loss import NEGATIVE_LOSS, NONFINITE_LOSS
from hf_sanity.rules.training.updates import LOSS_FLAT, LR_ZERO, falling, flat, slope_error

# -- thresholds ------------------------------------------------------------------------------------
SPIKE_HISTORY = 10  # trailing points that define the running level before a step
SPIKE_NOISE_HISTORY = 50  # trailing points that define the noise there
SPIKE_MIN_HISTORY = 20  # no spike is judged before this many points
SPIKE_RATIO = 1.5  # a spike is >= 50% above the running median ...
SPIKE_NOISE = 6.0  # ... and >= 6 noise sigmas above it (Gaussian noise: ~1e-9 per point) ...
SPIKE_OVER_PAST = (
    1.5  # ... and rises 1.5x higher above it than any of the SPIKE_NOISE_HISTORY points before ...
)
SPIKE_BIG = 2.0  # ... and is either 2x the running median or held (the next point is 50% above it too)
SPIKE_MAX_FINDINGS = 3
SPIKE_REPEATS = 3  # repeated: 3+ such jumps (whether or not each stands out) ...
SPIKE_UNLEARNED = 0.9  # ... whose median height in the later half is >= 90% of that in the earlier half
SPIKE_LISTED = 10  # steps and ratios listed in a repeated-spikes finding

OSC_MIN_POINTS = 20
OSC_AMPLITUDE = 0.10  # the typical step-to-step swing is >= 10% of the loss level ...
OSC_SIGN_CHANGES = 0.5  # ... the direction flips at least every other step ...
OSC_TREND_SE = 2.0  # ... and the drop between the thirds stays under one swing with 2 standard errors added

EVAL_MIN = 3  # evaluations needed by every eval-based detector


def evaluated(curves: Curves) -> bool:
    """The run was evaluated at least :data:`EVAL_MIN` times: the eval-based detectors have a curve to read."""
    return len(curves.eval_steps) >= EVAL_MIN


OVERFIT_RISE = 0.03  # the last eval loss is >= 3% above the best one ...
OVERFIT_AFTER = 2  # ... with >= 2 evaluations after the best ...
TRAIN_FELL = 0.02  # ... while the train level fell >= 2% over the same steps

UNDERFIT_MIN_POINTS = 10
UNDERFIT_MIN_STEPS = 50  # a run planned for fewer optimizer steps is a smoke run: not judged ...
UNDERFIT_REACHED = 0.9  # ... nor a run stopped before 90% of its planned steps
UNDERFIT_DROP = 0.10  # the best running level never got 10% below the start (train, and eval if logged)
UNDERFIT_CHANCE = 0.8  # or, with the vocabulary known, it never got below 80% of ln(V)

VBT_GAP = 0.10  # eval loss >= 10% below the train level ...
VBT_CONSECUTIVE = 3  # ... at each of the last 3 evaluations

CONSTANT_REL = 1e-6  # eval values equal to 1e-6 relative count as identical
CONSTANT_TRAIN_MOVED = 0.01  # ... while the train level moved >= 1% between the first and last evaluation

MEMO_TRAIN_DROP = 0.5  # train level halves between the first and the last evaluation ...
MEMO_EVAL_FLAT = 0.03  # ... while the eval loss stays within 3% (max - min, relative to its min)

FLAT_CHANCE = 0.05  # "flat at chance": the level is within 5% of ln(V)

LR_ZERO_ABS = 1e-12  # a learning rate at or below this is 0


LOSS_SPIKE = define(
    "loss-spike",
    severity="warning",
    stage="curves",
    symptom="The loss suddenly jumps after it had been decreasing.",
    detects=f"A logged train loss judged against the loss's own step-to-step spread: >= {SPIKE_RATIO:g}x the "
    f"median of the {SPIKE_HISTORY} points before it, >= {SPIKE_NOISE:g} noise sigmas above that median (noise: "
    f"robust spread of the step-to-step differences over the {SPIKE_NOISE_HISTORY} points before it), and "
    f"{SPIKE_OVER_PAST:g}x higher above it than any of those {SPIKE_NOISE_HISTORY} points rose (a batch as hard "
    f"as others the run has seen is noise, whatever its ratio); and either >= {SPIKE_BIG:g}x that median or held "
    "(the next point is still up), since a one-step bump that falls straight back is one harder batch. Only once "
    "that running median is below the median of the first points (the loss had decreased). Reports the step, "
    "the learning rate there, how long the loss stayed up, and whether gradient clipping is off or warmup "
    f"absent; up to {SPIKE_MAX_FINDINGS} spikes per run. `evidence.cause`: transient (it fell back at the next "
    "step, or it is the last logged point: `info`), held (it stayed up some steps) or not-recovered (it never came "
    f"back down): warnings; and repeated: {SPIKE_REPEATS}+ jumps of that size (>= {SPIKE_RATIO:g}x, the noise "
    f"test, {SPIKE_BIG:g}x or held, whether or not each stands out from the ones before) whose median height in "
    f"the later half of them is >= {SPIKE_UNLEARNED:.0%} of that in the earlier half: batches the run does not "
    "learn down keep coming back (a warning, with the steps, the ratios and the period where it is regular); "
    "harder rows the model learns come back lower each time and are not.",
    fix="Lower the LR or lengthen warmup, keep gradient clipping on, inspect the batch that preceded the spike.",
)

LOSS_OSCILLATION = define(
    "loss-oscillation",
    severity="warning",
    stage="curves",
    symptom="The loss zig-zags without trending down.",
    detects=f"At the end of training ({OSC_MIN_POINTS}+ logged points): the typical step-to-step swing (median "
    f"|difference|) is >= {OSC_AMPLITUDE:.0%} of the loss level, the direction flips at >= "
    f"{OSC_SIGN_CHANGES:.0%} of the steps, and with confidence there is no downward trend under the swings: "
    f"the drop from the median of the first third to that of the last third, plus {OSC_TREND_SE:g} standard "
    "errors (from the curve's own step-to-step noise), stays under one typical swing. Batch-to-batch noise on a "
    "falling loss is not an oscillation, and it is judged on the loss the user sees (under DDP, the logged mean "
    "over ranks). A curve flat from the start with smaller "
    "swings is `loss-flat` instead.",
    fix="Lower the learning rate, raise the batch size (or gradient accumulation), check data shuffling.",
    explained_by=("loss-diverged",),
)

OVERFITTING = define(
    "overfitting",
    severity="warning",
    stage="curves",
    objectives=NOT_RL,
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
    detects=f"At the end of a run planned for {UNDERFIT_MIN_STEPS}+ optimizer steps (the trainer state's max_steps; "
    f"shorter runs are smoke runs and runs stopped before {UNDERFIT_REACHED:.0%} of their plan are not judged), "
    f"with {UNDERFIT_MIN_POINTS}+ logged points, neither flat nor oscillating: the lowest running "
    f"median of the train loss never got {UNDERFIT_DROP:.0%} below its start, nor did the eval loss below "
    "its first evaluation (when logged); or, with the vocabulary size V known, both stayed above "
    f"{UNDERFIT_CHANCE:.0%} of ln(V) (near chance). A run that went down and then diverged is not "
    "underfitting (see loss-spike).",
    fix="First run the overfit test (`hf-sanity overfit`): if a single batch cannot be overfit it is a pipeline "
    "bug; otherwise raise the LR, train longer, or use a larger adapter.",
    explained_by=("loss-diverged", "loss-flat"),
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
    explained_by=("grad-accum-loss-scaling",),
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


# -- shapes -------------------------------------------------------------------------------------
def _is_flat(steps: np.ndarray, loss: np.ndarray) -> bool:
    """Flat: the levels of the curve's thirds agree (see loss-flat) and its fitted trend is known to fall by
    less than FLAT_RATE of the level per step (a slow, steady start is not flat)."""
    if not flat(loss):
        return False
    slope, spread = slope_fit(steps, loss)
    return not falling(slope, slope_error(loss, spread), median(loss))


# -- detectors -------------------------------------------------------------------------------------
def _spike_finding(
    steps, loss, lr, i: int, end: int, base: float, noise: float, guards: dict[str, Any]
) -> Finding:
    n = len(loss)
    recovered = end + 1 < n
    pending = (
        end == i == n - 1
    )  # a one-point jump at the last logged step: whether it falls back is not known
    at_once = recovered and end == i
    lr_here = lr_at(lr, i)
    sigmas = (loss[i] - base) / noise if noise > 0 else math.inf
    if at_once or pending:
        how = "transient"
        tail = (
            "; it fell straight back at the next step: one harder batch, nothing the run did not recover from"
            if at_once
            else "; it is the last logged step, so whether it falls back is not known yet"
        )
    else:
        how = "held" if recovered else "not-recovered"
        tail = f"; it stayed up until step {int(steps[end])}" if recovered else "; it never came back down"
    return LOSS_SPIKE.finding(
        f"train loss jumped to {loss[i]:.4g} at step {int(steps[i])}, {loss[i] / base:.2f}x its running "
        f"median {base:.4g}" + (f" (lr {lr_here:.3g})" if lr_here is not None else "") + tail,
        severity="info" if how == "transient" else None,
        evidence={
            "cause": how,
            "step": int(steps[i]),
            "loss": rounded(float(loss[i])),
            "running_median": rounded(base),
            "ratio": rounded(float(loss[i] / base), 3),
            "noise_sigmas": rounded(float(sigmas), 3),
            "learning_rate": lr_here,
            "previous_step": int(steps[i - 1]),
            "elevated_until_step": int(steps[end]),
            "recovered": None if pending else recovered,
            **guards,
        },
        step=int(steps[i]),
        fix=guarded_fix(TRANSIENT_FIX if how == "transient" else LOSS_SPIKE.fix, guards),
    )


def _repeated_finding(steps, loss, jumps: list[tuple[int, int, float]], guards: dict[str, Any]) -> Finding:
    """One warning for spikes that keep coming back at a height the run does not learn down."""
    idx = [i for i, _, _ in jumps]
    ratios = [float(loss[i] / base) for i, _, base in jumps]
    half = len(jumps) // 2
    early, late = median(loss[idx[:half]]), median(loss[idx[-half:]])
    gaps = np.diff(steps[idx])
    every = int(gaps[0]) if len(gaps) and (gaps == gaps[0]).all() else None
    first = int(steps[idx[0]])
    return LOSS_SPIKE.finding(
        f"train loss jumped {len(jumps)} times, {min(ratios):.2f}x to {max(ratios):.2f}x its running median "
        f"(steps {', '.join(str(int(steps[i])) for i in idx[:SPIKE_LISTED])}"
        + (", ..." if len(idx) > SPIKE_LISTED else "")
        + ")"
        + (f", every {every} steps" if every else "")
        + f": the loss falls back after each, but the jumps do not come down as the run learns (median "
        f"{early:.4g} in the first {half}, {late:.4g} in the last {half}): batches the model cannot learn keep "
        "coming back",
        evidence={
            "cause": "repeated",
            "spikes": len(jumps),
            "steps": [int(steps[i]) for i in idx[:SPIKE_LISTED]],
            "ratios": [rounded(r, 3) for r in ratios[:SPIKE_LISTED]],
            "min_ratio": rounded(min(ratios), 3),
            "max_ratio": rounded(max(ratios), 3),
            "losses": [rounded(float(loss[i])) for i in idx[:SPIKE_LISTED]],
            "early_spike_loss": rounded(early),
            "late_spike_loss": rounded(late),
            "every_steps": every,
            # a one-point jump at the last step is not known not to recover
            "recovered": all(end + 1 < len(loss) or end == i for i, end, _ in jumps),
            **guards,
        },
        step=first,
        fix=guarded_fix(REPEATED_FIX, guards),
    )


TRANSIENT_FIX = (
    "Nothing to change for one batch the run recovered from at once; if it recurs, inspect the batch at that step "
    "(rerun with SanityCallback, which saves it)."
)
REPEATED_FIX = (
    "Inspect the batches at the listed steps (a regular period points at the data order: a shard or a collator "
    "path that corrupts every k-th batch, shuffled or misaligned labels): filter the rows the model cannot learn; "
    "if the batches are sound, lower the learning rate and keep gradient clipping on."
)


@LOSS_SPIKE.detector("curve", online=True)
def loss_spike(curves: Curves) -> list[Finding]:
    """Sudden jumps of the train loss above its running median, once the loss had decreased: repeated ones the
    run does not learn down and ones it does not recover from are warnings, one it recovers from at the next
    step is info."""
    steps, loss, lr = train_points(curves)
    n = len(loss)
    if n <= SPIKE_MIN_HISTORY:
        return []
    start = median(loss[:SPIKE_MIN_HISTORY])  # fixed, so the online verdict does not change as n grows
    base = trailing(loss, SPIKE_HISTORY, median_rows, SPIKE_MIN_HISTORY)
    noise = trailing(loss, SPIKE_NOISE_HISTORY, noise_rows, SPIKE_MIN_HISTORY)
    with np.errstate(invalid="ignore"):
        rise = np.where(np.isfinite(base), loss - base, -np.inf)
        highest = np.maximum(trailing(rise, SPIKE_NOISE_HISTORY, max_rows, SPIKE_MIN_HISTORY), 0.0)
        held = np.append(loss[1:] >= SPIKE_RATIO * base[:-1], False)
        jump = (
            (base > 0)
            & (base < start)
            & (loss >= SPIKE_RATIO * base)
            & ((noise == 0) | (rise >= SPIKE_NOISE * noise))
            & ((loss >= SPIKE_BIG * base) | held)
        )
        stands_out = jump & (rise >= SPIKE_OVER_PAST * highest)
    guards = safeguards(curves.max_grad_norm, curves.warmup_steps)
    jumps: list[tuple[int, int, float]] = []  # (first index, last index, running median) of each jump
    events: list[Finding] = []
    total = 0
    after = -1  # the last index of the previous jump
    for i in np.flatnonzero(jump):
        i = int(i)
        if i <= after:
            continue
        # The jump lasts while the loss stays above the spike threshold.
        end = i
        while end + 1 < n and loss[end + 1] >= SPIKE_RATIO * base[i]:
            end += 1
        after = end
        jumps.append((i, end, float(base[i])))
        if not stands_out[i]:
            continue
        total += 1
        if len(events) < SPIKE_MAX_FINDINGS:
            events.append(_spike_finding(steps, loss, lr, i, end, float(base[i]), float(noise[i]), guards))
    if total > len(events):
        for finding in events:
            finding.evidence["spikes_in_run"] = total
    if len(jumps) >= SPIKE_REPEATS:
        half = len(jumps) // 2
        idx = [i for i, _, _ in jumps]
        if median(loss[idx[-half:]]) >= SPIKE_UNLEARNED * median(loss[idx[:half]]):
            # The one warning that says what the run shows; the single jumps' own findings would repeat it.
            return [_repeated_finding(steps, loss, jumps, guards)] + [
                f for f in events if f.evidence["cause"] == "not-recovered"
            ]
    return events


def _oscillation(steps: np.ndarray, loss: np.ndarray) -> dict[str, float] | None:
    """The oscillation statistics of a train curve when it zig-zags without trending down, else None."""
    n = len(loss)
    if n < OSC_MIN_POINTS or _is_flat(steps, loss):
        return None
    diffs = np.diff(loss)
    amplitude = float(np.median(np.abs(diffs)))
    level = median(loss)
    if level <= 0:
        return None
    signs = np.sign(diffs[diffs != 0])
    flips = float(np.mean(signs[1:] != signs[:-1])) if len(signs) > 1 else 0.0
    third = n // 3
    start, end = median(loss[:third]), median(loss[-third:])
    # No trend under the swings, with confidence: the drop between the first and last thirds stays under one
    # typical swing even with 2 standard errors of per-step noise added (a difference of medians). Short or
    # noisy curves cannot show that, and batch-to-batch noise on a falling loss is not an oscillation.
    error = OSC_TREND_SE * 1.2533 * noise(loss) * math.sqrt(2 / third)
    if amplitude >= OSC_AMPLITUDE * level and flips >= OSC_SIGN_CHANGES and start - end + error < amplitude:
        return {"amplitude": amplitude, "level": level, "flips": flips, "start": start, "end": end}
    return None


@LOSS_OSCILLATION.detector("curve", online=True, final=True)
def loss_oscillation(curves: Curves) -> list[Finding]:
    """Large step-to-step swings with no downward trend under them."""
    steps, loss, lr = train_points(curves)
    stats = _oscillation(steps, loss)
    if stats is None:
        return []
    amplitude, level = stats["amplitude"], stats["level"]
    return [
        LOSS_OSCILLATION.finding(
            f"train loss swings by {amplitude / level:.0%} of its level from step to step "
            f"(median swing {amplitude:.3g}) and does not trend down: it went from {stats['start']:.4g} to "
            f"{stats['end']:.4g}",
            evidence={
                "median_swing": rounded(amplitude),
                "swing_fraction_of_level": rounded(amplitude / level, 3),
                "direction_flips": rounded(stats["flips"], 3),
                "start_level": rounded(stats["start"]),
                "end_level": rounded(stats["end"]),
                "level": rounded(level),
                "learning_rate_max": rounded(float(np.nanmax(lr))) if np.isfinite(lr).any() else None,
                "points": len(loss),
            },
        )
    ]


@OVERFITTING.detector("curve", online=True, applies=evaluated)
def overfitting(curves: Curves) -> list[Finding]:
    """Eval loss went down (or started at its best) then rose while the train loss kept falling."""
    esteps, evals = eval_points(curves)
    tsteps, tloss, _ = train_points(curves)
    if len(evals) < EVAL_MIN or not len(tloss):
        return []
    best = int(np.argmin(evals))
    after = len(evals) - 1 - best
    if after < OVERFIT_AFTER or evals[best] <= 0:
        return []
    rise = (evals[-1] - evals[best]) / evals[best]
    train_best = train_level_at(tsteps, tloss, int(esteps[best]))
    train_last = train_level_at(tsteps, tloss, int(esteps[-1]))
    if rise < OVERFIT_RISE or not train_last <= (1 - TRAIN_FELL) * train_best:
        return []
    return [
        OVERFITTING.finding(
            f"eval loss rose {rise:.1%} from its best {evals[best]:.4g} at step {int(esteps[best])} to "
            f"{evals[-1]:.4g} at step {int(esteps[-1])} while the train loss fell from {train_best:.4g} to "
            f"{train_last:.4g}",
            evidence={
                "best_step": int(esteps[best]),
                "best_eval_loss": rounded(float(evals[best])),
                "last_step": int(esteps[-1]),
                "last_eval_loss": rounded(float(evals[-1])),
                "rise": rounded(float(rise), 3),
                "train_at_best": rounded(train_best),
                "train_at_last": rounded(train_last),
                "first_eval_loss": rounded(float(evals[0])),
            },
            step=int(esteps[best]),
        )
    ]


def _smoke_or_cut_short(curves: Curves, steps: np.ndarray) -> bool:
    """The run is a smoke run (planned for under UNDERFIT_MIN_STEPS steps; without a plan, its last logged
    step is its length), or it stopped well before its plan: its learning is not judged."""
    last = int(steps[-1]) if len(steps) else 0
    planned = curves.planned_steps or last
    return planned < UNDERFIT_MIN_STEPS or last < UNDERFIT_REACHED * planned


@UNDERFITTING.detector("curve", online=True, final=True)
def underfitting(curves: Curves) -> list[Finding]:
    """Both losses stay close to where they started (or near chance) until the end."""
    tsteps, tloss, _ = train_points(curves)
    n = len(tloss)
    if n < UNDERFIT_MIN_POINTS or _smoke_or_cut_short(curves, tsteps):
        return []
    if _is_flat(tsteps, tloss) or _oscillation(tsteps, tloss) is not None:
        return []
    window = head_points(n)
    start = median(tloss[:window])
    best = rolling_median_min(tloss, window)
    end = median(tloss[-window:])
    if start <= 0:
        return []
    _, evals = eval_points(curves)
    has_eval = len(evals) >= 2
    train_drop = (start - best) / start
    eval_drop = (evals[0] - evals.min()) / evals[0] if has_eval and evals[0] > 0 else None
    chance = ln_vocab(curves)
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
                "train_start": rounded(start),
                "train_best": rounded(best),
                "train_end": rounded(end),
                "train_drop": rounded(train_drop, 3),
                "eval_first": rounded(float(evals[0])) if has_eval else None,
                "eval_best": rounded(float(evals.min())) if has_eval else None,
                "eval_drop": rounded(eval_drop, 3),
                "chance_ln_vocab": rounded(chance),
                "reasons": reasons,
            },
            step=int(tsteps[-1]),
        )
    ]


@VAL_BELOW_TRAIN.detector("curve", online=True, applies=evaluated)
def val_below_train(curves: Curves) -> list[Finding]:
    """The eval loss sits clearly below the train loss at the last evaluations."""
    esteps, evals = eval_points(curves)
    tsteps, tloss, _ = train_points(curves)
    if len(evals) < max(EVAL_MIN, VBT_CONSECUTIVE) or not len(tloss):
        return []
    levels = train_levels(tsteps, tloss, esteps)
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
                "median_gap": rounded(float(np.median(gaps)), 3),
                "last_eval_loss": rounded(float(evals[-1])),
                "last_train_level": rounded(float(levels[-1])),
            },
            step=int(esteps[first]),
        )
    ]


def _train_moved(curves: Curves, first_step: int, last_step: int) -> tuple[bool, float | None]:
    tsteps, tloss, _ = train_points(curves)
    if not len(tloss):
        return True, None  # nothing says training stood still
    a = train_level_at(tsteps, tloss, first_step)
    b = train_level_at(tsteps, tloss, last_step)
    moved = abs(a - b) / max(abs(a), 1e-12)
    return moved >= CONSTANT_TRAIN_MOVED, moved


def _constant(values: np.ndarray) -> bool:
    return len(values) >= EVAL_MIN and all(
        math.isclose(v, values[0], rel_tol=CONSTANT_REL, abs_tol=1e-12) for v in values
    )


@EVAL_CONSTANT.detector("curve", online=True, applies=evaluated)
def eval_constant(curves: Curves) -> list[Finding]:
    """An eval metric with the same value at every evaluation while training moved."""
    series = {"eval_loss": curves.eval_loss, **curves.eval_metrics}
    constant: dict[str, float] = {}
    first_step = last_step = None
    evaluations = 0
    for name, values in series.items():
        steps, vals = finite_points(curves.eval_steps, values)
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
                "train_moved": rounded(amount, 3),
            },
            step=last_step,
        )
    ]


@MEMORIZING.detector("curve", online=True, applies=evaluated)
def memorizing(curves: Curves) -> list[Finding]:
    """Train loss collapses while the eval loss stays flat."""
    esteps, evals = eval_points(curves)
    tsteps, tloss, _ = train_points(curves)
    if len(evals) < EVAL_MIN or not len(tloss) or _constant(evals) or evals.min() <= 0:
        return []
    spread = float((evals.max() - evals.min()) / evals.min())
    first = train_level_at(tsteps, tloss, int(esteps[0]))
    last = train_level_at(tsteps, tloss, int(esteps[-1]))
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
                "train_at_first_eval": rounded(first),
                "train_at_last_eval": rounded(last),
                "eval_min": rounded(float(evals.min())),
                "eval_max": rounded(float(evals.max())),
                "eval_spread": rounded(spread, 3),
            },
            step=int(esteps[-1]),
        )
    ]


@NEGATIVE_LOSS.detector("curve")  # online, the negative-loss monitor sees every step
def negative_loss(curves: Curves) -> list[Finding]:
    """Any logged train or eval loss below 0."""
    out = []
    for kind, steps, values in (
        ("train", curves.train_steps, curves.train_loss),
        ("eval", curves.eval_steps, curves.eval_loss),
    ):
        s, v = finite_points(steps, values)
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
                        "loss": rounded(float(v[i])),
                        "negative": len(bad),
                        "logged": len(v),
                        "min": rounded(float(v.min())),
                    },
                    step=int(s[i]),
                )
            )
    return out


@NONFINITE_LOSS.detector("curve")  # online, the nonfinite-loss monitor names the exact step
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
            zeros = hidden_nan_zeros(v)
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
                            "previous_loss": rounded(float(before[-1])),
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


@LR_ZERO.detector("curve")  # online, the lr-zero monitor reads the optimizer
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
                "peak_lr": rounded(peak),
                "zero_until_end": trailing,
            },
            step=int(steps[i]),
        )
    ]


@LOSS_FLAT.detector("curve", final=True)  # online, the loss-flat monitor measures the cause
def loss_flat(curves: Curves) -> list[Finding]:
    """The train loss does not move from the start (compared with chance, ln(V), where V is known)."""
    steps, loss, _ = train_points(curves)
    if not _is_flat(steps, loss):
        return []
    level = median(loss)
    chance = ln_vocab(curves)
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
                "level": rounded(level),
                "first": rounded(float(loss[0])),
                "last": rounded(float(loss[-1])),
                "relative_spread": rounded(spread, 3),
                "points": n,
                "chance_ln_vocab": rounded(chance),
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
