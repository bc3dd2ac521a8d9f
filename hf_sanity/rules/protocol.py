"""Protocol rules: the ordered debugging protocol of `overfit` and `diagnose`.

The detectors are pure functions over measurements (:class:`GradientPath`, :class:`OverfitRun`,
:class:`LRSweep`, :class:`PrecisionRun`); `hf_sanity.protocol` takes the measurements on a copy of the
user's model and hands them here. Thresholds are the named constants below, quoted in each ``detects``:

* *near zero* (overfit): the loss on the handful of examples falls to 0.05 nat/token, as the protocol writes
  it ("nearly zero": its own example ends at 0.012); every supervised token is then predicted with ~95%
  probability (geometric mean). Where the examples themselves forbid it (identical inputs followed by
  different targets: no model can predict both), near zero is that floor plus 0.05: the floor is the mean
  entropy of the targets that follow one identical prefix, the lowest mean loss any causal model can reach.
* *divergence* (LR range, and the overfit's LR search): the loss is non-finite, or above both 4x its best value
  so far (fastai's ``lr_find`` stop rule) and its best value plus a quarter of its starting value (so
  oscillations around a memorised, near-zero loss do not count).
* *the overfit LR*: step 1 trains at a fixed LR per setup, 1e-3 for an adapter and 1e-4 for full
  fine-tuning (or the one given). When it does not reach near zero with the gradient path intact, steps 2
  (step-0 loss against chance) and 3 (shapes and masks) run first; only when they pass does step 4 search
  the LR: after the LR range test on the same examples, runs from the same weights at LRs half a decade apart,
  the first a decade below where the sweep diverges. A run's trend is read over windows of a sixth of the step
  budget: it stops once a window's mean loss is not below the one before by 5% of the way left to near zero
  (too slow to get there), and its loss still falls when that difference is at least 2 standard errors. The
  next LR is higher while every run's loss still fell at its end (too low an LR), lower once one diverges or
  stops falling (plateaus or oscillates). The search stops at the first run that reaches near zero, or once 3
  step budgets are spent, the sweep included; when none reaches it, the best LR's run goes on to the whole
  step budget before the verdict.
* *capacity*: when no LR brings a setup that trains only part of the model (an adapter, frozen layers) near
  zero, the same search runs with every weight trainable; reaching near zero then, the trainable share was too
  small for the examples.
* *precision tolerance*: 8 unit roundoffs of the half format relative to the float32 loss (bf16: 3.1%,
  fp16: 0.39%), plus 0.02 nat: a half-precision forward pass rounds at every op, and a few roundoffs of
  relative error on the mean loss is its normal noise; more means a module lost range or precision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hf_sanity.catalog import define
from hf_sanity.findings import Finding

NEAR_ZERO_NATS = 0.05
DIVERGE_RATIO = 4.0
DIVERGE_FLOOR = 0.25  # of the starting loss
SUGGEST_BELOW = 10.0  # the suggested LR is an order of magnitude below divergence
LR_SEARCH_BUDGETS = 3  # the overfit's LR search trains at most this many step budgets, its sweep included
# ... then, when no run reached near zero, the best LR's run goes on to the whole step budget (one more at most)
LR_SEARCH_RUNG = 10**0.5  # the LRs it tries are half a decade apart
LR_SEARCH_WINDOW = 1 / 6  # of the step budget: a search run's loss trend is read over windows this long
LR_SEARCH_PACE = 0.05  # a window must cut this share of the way left to near zero, or the run stops
LR_SEARCH_SIGNIFICANCE = 2.0  # standard errors: the loss still falls when a window's mean is this far below
PRECISION_ROUNDOFFS = 8
PRECISION_ATOL = 0.02
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
# The capacity check: with every weight trainable, the loss must close this share of the gap between the setup's
# best and near zero (or reach near zero) for the trainable share to be what holds the overfit back.
CAPACITY_GAP = 0.9

OVERFIT_FAILED = define(
    "overfit-failed",
    severity="error",
    stage="protocol",
    symptom="The model cannot overfit a handful of examples: the pipeline is broken, not the hyperparameters.",
    detects="2-10 examples from the real pipeline (same tokenization, collator, adapter, optimizer class) are "
    "trained on alone with regularisation off (dropout 0, weight decay 0) on a copy of the model. The loss must "
    f"reach near zero: {NEAR_ZERO_NATS} nat/token, or, where identical inputs in the examples are followed by "
    "different targets, the floor that imposes (the mean entropy of the targets after one identical prefix: "
    f"computed and shown) plus {NEAR_ZERO_NATS}. Step 1 trains at a fixed LR per setup (1e-3 with an adapter, "
    "1e-4 for full fine-tuning; --lr to give another). The gradient path is measured, not guessed: label "
    "positions that carry loss, parameters that require grad, which of them the optimizer holds, the loss's "
    "grad_fn, every parameter's .grad after one backward and whether one optimizer step changes them. The first "
    "broken link is named from the first step: labels all masked, no trainable params, params not in the "
    "optimizer, loss not connected to the parameters being updated, no gradient reaching them, an optimizer "
    "step that updates nothing; a model whose loss does not move when every input token is replaced cannot "
    "tell the examples apart at any LR (input-ignored). With the path intact and the loss not near zero, the "
    "protocol's order holds: step 2 (the step-0 loss against chance) and step 3 (shapes and masks) run before "
    "the learning rate is touched; an error there stops it (the LR is not searched: fix that first). When they "
    "pass (and no --lr was given), step 4 searches the LR: an LR range test on the same examples, then runs "
    "from the same weights at LRs half a decade apart, the first a decade below where the sweep diverges; a "
    "run stops once its mean loss over a sixth of the step budget is not below the sixth before by 5% of the "
    "way left to near zero; the next LR is higher while every run's loss still fell (by 2 standard errors), "
    "lower once one diverges or plateaus or oscillates; the search stops at the first run that reaches near "
    "zero, within 3 step budgets in all (the sweep included); when none does, the LR with the best loss runs "
    "the whole step budget before the verdict. No LR reaching near zero is not-converged (each LR tried with "
    "its best loss), or capacity when only part of the model trains (an adapter, frozen layers) and the same "
    f"search with every weight trainable reaches near zero or closes {CAPACITY_GAP:.0%} of the gap between the "
    "setup's best loss and near zero: the trainable share is too small for the examples (the numbers: weights "
    "that train, the adapter's rank and modules or the frozen tensors, where the unrestricted run got).",
    fix="Fix the broken part of the gradient path named in the evidence before tuning anything.",
)

LR_RANGE = define(
    "lr-range",
    severity="info",
    stage="protocol",
    symptom="Which learning rate to use.",
    detects="A short exponential LR sweep (1e-7 to 1, 8 steps per decade) with the setup's optimizer class on "
    "a copy of the model, on the overfit examples. The loss diverges at the first LR where it is non-finite or "
    "above both 4x its best value so far and its best value plus a quarter of its starting value; the "
    "suggested base LR is an order of magnitude below. A configured LR at or past divergence is a warning.",
    fix="Use the suggested learning rate as a starting point.",
)

PRECISION_MISMATCH = define(
    "precision-mismatch",
    severity="error",
    stage="protocol",
    symptom="Training in half precision diverges or behaves differently than in float32.",
    detects="The same batch's loss in float32 against bf16 and fp16 autocast where the device supports them: "
    "a non-finite half-precision loss, or one that differs from float32 by more than 8 unit roundoffs of the "
    "format relative to it (bf16 3.1%, fp16 0.39%) plus 0.02 nat. The first weight or float32 module output "
    "beyond the format's range is named.",
    fix="Train in bf16 (wider range than fp16), keep the loss and norms in fp32, or use fp32 for the unstable modules.",
)


# -- overfit ---------------------------------------------------------------------------------------
@dataclass
class GradientPath:
    """What one forward/backward/step on the overfit batch measured (``None``: not measurable)."""

    supervised_tokens: int | None = None  # label positions that carry loss (after the shift); None: no labels
    label_positions: int = 0
    trainable: int = 0  # parameter tensors that require grad
    trainable_elements: int = 0
    total_elements: int = 0
    in_optimizer: int = 0  # trainable tensors the optimizer holds
    not_in_optimizer: list[str] = field(default_factory=list)  # their names (trainable, not held)
    not_in_optimizer_elements: int = 0
    optimizer_frozen: int = 0  # tensors the optimizer holds that do not require grad
    optimizer_foreign: int = 0  # tensors the optimizer holds that are not the model's
    # The loss on the first batch does not move when every input token is replaced (None: not measured).
    input_ignored: bool | None = None
    optimizer: str = ""
    loss: float | None = None
    loss_error: str | None = None
    loss_requires_grad: bool = False
    loss_grad_fn: str | None = None
    grad_none: int = 0  # optimizer tensors whose .grad is None after backward
    grad_zero: int = 0  # ... all zero
    grad_nonfinite: int = 0
    grad_nonzero: int = 0
    no_grad_names: list[str] = field(default_factory=list)  # trainable tensors without a non-zero gradient
    updated: int | None = None  # optimizer tensors changed by one step
    never_updated: list[str] | None = None  # optimizer tensors still at their initial value after training


@dataclass
class Cause:
    key: str
    part: str  # the part of the gradient path, in words
    message: str
    fix: str


def gradient_path_cause(path: GradientPath) -> Cause | None:
    """The first broken link of the gradient path that no amount of training can get past, or None."""
    if path.supervised_tokens == 0:
        return Cause(
            "labels-masked",
            "labels all masked",
            f"labels all masked: none of the {path.label_positions} label positions carries loss (all -100)",
            "Check the response template / assistant mask (it must match the rendered text: a template that is "
            "never found masks everything), `completion_only_loss`/`assistant_only_loss`, and max_len (completions "
            "cut away entirely).",
        )
    if path.loss_error is not None:
        return Cause(
            "loss-error",
            "loss not computable",
            f"the loss cannot be computed on the batch: {path.loss_error}",
            "Make the model return a finite loss on the collated batch (labels present, shapes matching input_ids, "
            "token ids inside the vocabulary).",
        )
    if path.trainable == 0:
        return Cause(
            "no-trainable-params",
            "no trainable params",
            f"no trainable params: none of the model's {path.total_elements:,} parameters requires grad",
            "Attach the adapter with peft.get_peft_model (its target_modules must name modules of this model) or "
            "unfreeze the layers to train, before building the optimizer.",
        )
    if path.in_optimizer == 0:
        held = (
            f"; it holds {path.optimizer_frozen} frozen and {path.optimizer_foreign} foreign tensors"
            if path.optimizer_frozen or path.optimizer_foreign
            else ""
        )
        return Cause(
            "params-not-in-optimizer",
            "params not in the optimizer",
            f"params not in the optimizer: none of the {path.trainable} trainable tensors "
            f"({path.trainable_elements:,} weights) is in the optimizer{held}",
            "Build the optimizer after the adapter is attached and from the model that is trained "
            "(`AdamW(p for p in model.parameters() if p.requires_grad)`), or let the Trainer create it.",
        )
    if not path.loss_requires_grad or path.loss_grad_fn is None:
        how = "does not require grad" if not path.loss_requires_grad else "is a leaf (grad_fn=None)"
        return Cause(
            "loss-not-connected",
            "loss not connected",
            f"loss not connected to the parameters being updated: the loss {how}, so backward reaches none of "
            f"the {path.in_optimizer} trainable tensors",
            "Return the loss tensor the forward pass built: no .detach(), .item(), torch.tensor(loss) or "
            "torch.no_grad() between the model output and the returned loss; with gradient checkpointing and "
            "frozen embeddings call model.enable_input_require_grads().",
        )
    if path.grad_nonzero == 0 and path.grad_none == path.in_optimizer:
        return Cause(
            "loss-not-connected",
            "loss not connected",
            f"loss not connected to the parameters being updated: the loss has a graph ({path.loss_grad_fn}) but "
            f"after backward none of the {path.in_optimizer} tensors in the optimizer has a .grad",
            "The loss is computed from tensors that do not depend on the trained parameters: check custom "
            "compute_loss / forward code for detached or recomputed tensors, and that the optimizer holds the "
            "parameters of the model that computes the loss.",
        )
    if path.grad_nonzero == 0:
        what = "non-finite" if path.grad_nonfinite else "zero"
        return Cause(
            "no-gradient",
            "no gradient reaching the params",
            f"no gradient reaching the params: every one of the {path.in_optimizer} tensors in the optimizer got "
            f"a {what} or missing gradient ({path.grad_zero} zero, {path.grad_nonfinite} non-finite, "
            f"{path.grad_none} None)",
            "A path between the trained parameters and the loss multiplies by zero or is cut (a scale of 0, a "
            "masked or detached branch, a hook): find where the gradient stops with the tensors named in the "
            "evidence.",
        )
    if path.updated == 0:
        return Cause(
            "no-update",
            "optimizer step updates nothing",
            f"the optimizer step changes none of the {path.in_optimizer} tensors it holds although their gradient "
            "is non-zero",
            "Check the optimizer's step (a wrapper that never calls the real one, a learning rate of 0) and any "
            "code that restores or overwrites the weights after the step; with half-precision weights, updates "
            "below their rounding step are lost (keep fp32 master weights).",
        )
    return None


@dataclass
class DataFloor:
    """The lowest mean loss (nat/token) any causal model can reach on the examples: supervised positions whose
    whole input up to them is identical to another's but whose target differs (no model can predict both)."""

    nats: (
        float  # the floor: the entropy of the targets after each identical prefix, averaged over every target
    )
    positions: int  # supervised positions that share their prefix with one that has another target
    prefixes: int  # distinct prefixes followed by more than one target
    tokens: int  # supervised positions in all


def near_zero_threshold(floor: DataFloor | None = None) -> float:
    """Loss (nat/token) under which the overfit examples count as memorised: NEAR_ZERO_NATS above the floor
    the examples impose (0 when no identical input has two targets)."""
    return NEAR_ZERO_NATS + (floor.nats if floor is not None else 0.0)


def window_means(losses: Sequence[float], window: int) -> tuple[float, float, float] | None:
    """The mean loss over the last ``window`` steps, over the window before, and the standard error of their
    difference; None while the run is shorter than two windows."""
    if window < 2 or len(losses) < 2 * window:
        return None
    recent, before = list(losses[-window:]), list(losses[-2 * window : -window])
    means = [sum(w) / window for w in (recent, before)]
    variances = [sum((x - m) ** 2 for x in w) / (window - 1) for w, m in zip((recent, before), means)]
    return means[0], means[1], math.sqrt(sum(variances) / window)


def on_pace(losses: Sequence[float], window: int, threshold: float) -> bool:
    """Whether the loss falls fast enough to be worth more steps: the last window's mean is below the one
    before by ``LR_SEARCH_PACE`` of the way that was left to near zero (True while too short to tell)."""
    means = window_means(losses, window)
    if means is None:
        return True
    recent, before, _ = means
    return recent < before - LR_SEARCH_PACE * max(before - threshold, 0.0)


def still_falling(losses: Sequence[float], window: int) -> bool:
    """Whether the loss still falls at all, however slowly: the last window's mean is
    ``LR_SEARCH_SIGNIFICANCE`` standard errors below the one before (not a plateau, not an oscillation).
    True while too short to tell."""
    means = window_means(losses, window)
    if means is None:
        return True
    recent, before, error = means
    return recent < before - LR_SEARCH_SIGNIFICANCE * error


@dataclass
class LRTrial:
    """One run of the overfit's LR search: the loss on the examples after each update at ``lr``."""

    lr: float
    losses: list[float]
    threshold: float  # near zero
    window: int = 0  # steps over which the run's trend is read (``on_pace``, ``still_falling``); 0: not read
    never_updated: list[str] | None = None  # optimizer tensors still at their initial value after the run

    @property
    def best(self) -> float:
        finite = [x for x in self.losses if math.isfinite(x)]
        return min(finite) if finite else float("nan")

    @property
    def steps(self) -> int:
        return max(len(self.losses) - 1, 0)

    @property
    def reached(self) -> bool:
        return any(x <= self.threshold for x in self.losses)

    @property
    def reached_at(self) -> int | None:
        return next((step for step, x in enumerate(self.losses) if x <= self.threshold), None)

    @property
    def ended_finite(self) -> bool:
        return bool(self.losses) and math.isfinite(self.losses[-1])

    @property
    def too_high(self) -> bool:
        """Whether the LR looks too high: the run ended on a diverging loss, or its loss no longer falls at all
        (it plateaus or oscillates). A run whose loss still falls at its end, too slowly, had too low an LR."""
        if len(self.losses) < 2:
            return False
        start, last = self.losses[0], self.losses[-1]
        before = [x for x in self.losses[:-1] if math.isfinite(x)]
        if diverging(last, min(before, default=math.inf), start):
            return True
        return not still_falling(self.losses, self.window)


@dataclass
class Share:
    """How much of the model trains: the weights that do, of all, and how the rest is held back."""

    trainable: int
    total: int
    adapter: str | None = None  # "LoRA r=1 on q_proj", for an adapter
    frozen_tensors: int = 0  # the model's own tensors that do not train (an adapter's base included)

    @property
    def restricted(self) -> bool:
        return 0 < self.trainable < self.total

    def describe(self) -> str:
        how = self.adapter or f"{self.frozen_tensors} tensors frozen"
        return (
            f"{self.trainable:,} of {self.total:,} weights train ({self.trainable / self.total:.2%}: {how})"
        )


@dataclass
class OverfitRun:
    """The overfit measurements: the gradient path, then the loss on the examples at each step: step 1's run at
    its fixed (or given) LR, or, once step 4 searched the LR, the search's reported run (step 1's then in
    ``first``)."""

    path: GradientPath
    losses: list[float]
    threshold: float
    steps: int  # the step budget
    lr: float  # the LR of ``losses``
    examples: int
    vocab_size: int | None = None
    # given | search (``tried`` holds its runs) | default (the setup's fixed step-1 LR)
    lr_source: str = "given"
    tried: list[LRTrial] = field(default_factory=list)
    sweep_diverges_at: float | None = None  # where the search's range test diverged; None: not up to its end
    floor: DataFloor | None = None  # what the examples themselves impose (None: nothing, or not measurable)
    first: LRTrial | None = None  # step 1's run, when step 4 searched the LR after it
    blocked_by: list[str] = field(default_factory=list)  # error rules of steps 2-3 that stopped the LR search
    share: Share | None = None
    relaxed: LRTrial | None = None  # the capacity check: the best run with every weight trainable
    relaxed_error: str | None = None  # why the capacity check could not run to its end

    @property
    def searched(self) -> bool:
        return self.lr_source == "search"

    @property
    def initial(self) -> float:
        return self.losses[0] if self.losses else float("nan")

    @property
    def best(self) -> float:
        finite = [x for x in self.losses if math.isfinite(x)]
        return min(finite) if finite else float("nan")

    @property
    def reached_at(self) -> int | None:
        """The first step whose loss is at or under the threshold."""
        for step, loss in enumerate(self.losses):
            if math.isfinite(loss) and loss <= self.threshold:
                return step
        return None

    @property
    def passed(self) -> bool:
        return gradient_path_cause(self.path) is None and self.reached_at is not None


def inconclusive(run: OverfitRun) -> bool:
    """Step 1 did not reach near zero although nothing it measured explains why (the gradient path is intact,
    the loss finite, the input reaches the model, every trainable tensor is in the optimizer): by the
    protocol's order, steps 2 and 3 come next, then (step 4) the learning rate."""
    path = run.path
    return (
        not run.searched
        and not run.blocked_by
        and gradient_path_cause(path) is None
        and run.reached_at is None
        and bool(run.losses)
        and math.isfinite(run.losses[-1])
        and not path.input_ignored
        and not path.not_in_optimizer
    )


def capacity_gap(run: OverfitRun) -> float | None:
    """The share of the gap between the setup's best loss and near zero that training every weight closes (1:
    it reaches near zero); None without the capacity check."""
    relaxed = run.relaxed
    if relaxed is None or not run.tried:
        return None
    if relaxed.reached:
        return 1.0
    best = min(t.best for t in run.tried)
    if not (math.isfinite(best) and math.isfinite(relaxed.best)) or best <= run.threshold:
        return None
    return max(0.0, (best - relaxed.best) / (best - run.threshold))


def overfit_cause(run: OverfitRun) -> Cause | None:
    """Why the examples were not overfit (None when they were)."""
    blocking = gradient_path_cause(run.path)
    if blocking is not None:
        return blocking
    if run.reached_at is not None:
        return None
    path = run.path
    if path.not_in_optimizer:
        share = path.not_in_optimizer_elements / max(path.trainable_elements, 1)
        return Cause(
            "params-not-in-optimizer",
            "params not in the optimizer",
            f"params not in the optimizer: {len(path.not_in_optimizer)} of the {path.trainable} trainable tensors "
            f"({share:.0%} of trainable weights) are not in the optimizer and never update",
            "Build the optimizer over every trainable parameter (after attaching the adapter), or let the Trainer "
            "create it.",
        )
    tried = run.tried if run.searched else []
    if run.losses and not math.isfinite(run.losses[-1]):
        where = (
            f"at every LR the search tried ({lr_span(tried)})"
            if len(tried) > 1
            else f"after {len(run.losses) - 1} steps at lr={run.lr:g}"
        )
        return Cause(
            "loss-nonfinite",
            "loss became non-finite",
            f"the loss became non-finite {where}",
            "Lower the learning rate (see the LR range test) and check the precision (diagnose's layer 5).",
        )
    if path.input_ignored:
        return Cause(
            "input-ignored",
            "the input does not reach the model",
            "the model's loss on the batch is the same with every input token replaced: its output does not "
            "depend on its input, so no LR can make it tell the examples apart",
            "Check the model's forward: that it reads input_ids (or inputs_embeds built from them) and that the "
            "input embedding is not constant (zeroed, or weights that failed to load).",
        )
    stalled = path.never_updated or []
    extra = f"; {len(stalled)} tensors in the optimizer never changed (e.g. {stalled[0]})" if stalled else ""
    near = f"near zero ({run.threshold:.3g}{' with the data floor' if run.floor else ''})"
    if run.blocked_by:
        return Cause(
            "not-converged",
            "loss does not reach near zero",
            f"the loss only went from {run.initial:.3g} to {run.best:.3g} in {len(run.losses) - 1} steps at "
            f"lr={run.lr:g}, not {near}, and the protocol's next steps found {', '.join(run.blocked_by)}: the "
            "learning rate was not searched",
            f"Fix {', '.join(run.blocked_by)} first (see those findings), then rerun: the learning rate is only "
            "the suspect once the step-0 loss, shapes and masks are right.",
        )
    gap = capacity_gap(run)
    if gap is not None and gap >= CAPACITY_GAP and run.share is not None:
        relaxed = run.relaxed
        got = (
            f"reach it at lr={relaxed.lr:.3g} in {relaxed.reached_at} steps"
            if relaxed.reached
            else f"get to {relaxed.best:.3g} at lr={relaxed.lr:.3g} in {relaxed.steps} steps ({int(gap * 100)}% of the way)"
        )
        return Cause(
            "capacity",
            "the trainable share is too small",
            f"the trainable share is too small for these examples: {run.share.describe()}; no LR brings the "
            f"loss {near} ({len(tried)} tried, {lr_span(tried)}, best {min(t.best for t in tried):.3g} from "
            f"{run.initial:.3g}), while the same examples with every weight trainable {got}",
            "Give the setup more capacity where it learns: raise the LoRA rank, target more modules (every "
            "linear layer; the output head and embeddings when the answers use new tokens or a new format), or "
            "unfreeze layers; then rerun overfit.",
        )
    if tried:
        unrestricted = ""
        if gap is not None:
            unrestricted = (
                f"; with every weight trainable it gets no nearer (best {run.relaxed.best:.3g}): not a matter "
                "of capacity"
                if gap < 1 - CAPACITY_GAP
                else f"; with every weight trainable it gets to {run.relaxed.best:.3g}, not near zero either"
            )
        return Cause(
            "not-converged",
            "loss does not reach near zero",
            f"the gradient path is intact but no learning rate brings the loss {near}: "
            f"{len(tried)} LR{'s' if len(tried) > 1 else ''} tried ({lr_span(tried)}), the best loss "
            f"{min(t.best for t in tried):.3g} "
            f"(from {run.initial:.3g}) at lr={run.lr:.3g}{extra}{unrestricted}",
            "The examples cannot be memorised by this setup: labels that do not follow from the inputs "
            "(shuffled, misaligned, or changing from step to step), or a loss that does not measure the targets. "
            "Rerun with more --steps to rule out the budget.",
        )
    return Cause(
        "not-converged",
        "loss does not reach near zero",
        f"the gradient path is intact but the loss only went from {run.initial:.3g} to {run.best:.3g} in "
        f"{len(run.losses) - 1} steps at lr={run.lr:g}, not {near}{extra}",
        "Rerun without --lr (overfit then searches the learning rate) or with more --steps. If it still "
        "stalls, the examples cannot be memorised: labels that do not follow from the inputs (shuffled or "
        "misaligned), or an adapter with too little capacity or on the wrong modules.",
    )


def lr_span(tried: Sequence[LRTrial]) -> str:
    rates = [t.lr for t in tried]
    return f"{min(rates):.1e} to {max(rates):.1e}" if len(rates) > 1 else f"{rates[0]:.1e}"


# The measurements each cause is shown with (beyond the loss curve's).
CAUSE_EVIDENCE = {
    "labels-masked": ("supervised_tokens", "label_positions"),
    "loss-error": ("loss_error", "supervised_tokens"),
    "no-trainable-params": ("trainable", "total_elements"),
    "params-not-in-optimizer": (
        "trainable",
        "in_optimizer",
        "optimizer",
        "not_in_optimizer",
        "optimizer_frozen",
        "optimizer_foreign",
    ),
    "loss-not-connected": ("loss_grad_fn", "loss_requires_grad", "in_optimizer", "grads"),
    "no-gradient": ("in_optimizer", "grads", "no_grad"),
    "no-update": ("optimizer", "in_optimizer", "grads", "updated"),
    "input-ignored": ("input_ignored", "supervised_tokens"),
}
CONVERGENCE_EVIDENCE = ("supervised_tokens", "trainable", "in_optimizer", "grads", "updated", "never_updated")


@OVERFIT_FAILED.detector("protocol", reads=OverfitRun)
def check_overfit(run: OverfitRun) -> list[Finding]:
    cause = overfit_cause(run)
    if cause is None:
        return []
    path = run.path
    measured = {
        "supervised_tokens": path.supervised_tokens,
        "label_positions": path.label_positions,
        "trainable": path.trainable,
        "total_elements": path.total_elements,
        "in_optimizer": path.in_optimizer,
        "optimizer": path.optimizer,
        "not_in_optimizer": path.not_in_optimizer[:5],
        "optimizer_frozen": path.optimizer_frozen,
        "optimizer_foreign": path.optimizer_foreign,
        "loss_error": path.loss_error,
        "loss_grad_fn": path.loss_grad_fn,
        "loss_requires_grad": path.loss_requires_grad,
        "grads": {
            "nonzero": path.grad_nonzero,
            "zero": path.grad_zero,
            "none": path.grad_none,
            "nonfinite": path.grad_nonfinite,
        },
        "no_grad": path.no_grad_names[:5],
        "updated": path.updated,
        "never_updated": (path.never_updated or [])[:5],
        "input_ignored": path.input_ignored,
    }
    evidence = {
        "cause": cause.key,
        "broken": cause.part,
        "loss_start": run.initial,
        "loss_best": run.best,
        "near_zero": round(run.threshold, 4),
        "steps_run": max(len(run.losses) - 1, 0),
        "lr": run.lr,
        "lr_chosen_by": run.lr_source,
        "examples": run.examples,
    }
    if run.searched and run.tried:
        evidence["lrs_tried"] = [
            [float(f"{t.lr:.3g}"), round(t.best, 4) if math.isfinite(t.best) else str(t.best)]
            for t in run.tried
        ]
        evidence["sweep_diverges_at"] = run.sweep_diverges_at
    if run.first is not None:
        evidence["step1"] = {
            "lr": run.first.lr,
            "steps": run.first.steps,
            "best_loss": round(run.first.best, 4),
        }
    if run.floor is not None:
        evidence["data_floor"] = round(run.floor.nats, 4)
    if run.blocked_by:
        evidence["found_before_lr"] = run.blocked_by
    if run.share is not None and (run.relaxed is not None or cause.key == "capacity"):
        evidence["trainable_elements"] = run.share.trainable
        evidence["total_elements"] = run.share.total
        evidence["trainable_share"] = round(run.share.trainable / run.share.total, 6)
        if run.share.adapter:
            evidence["adapter"] = run.share.adapter
        else:
            evidence["frozen_tensors"] = run.share.frozen_tensors
    if run.relaxed is not None:
        evidence["all_weights_trainable"] = {
            "reached_near_zero": run.relaxed.reached,
            "lr": float(f"{run.relaxed.lr:.3g}"),
            "steps": run.relaxed.steps,
            "best_loss": round(run.relaxed.best, 4)
            if math.isfinite(run.relaxed.best)
            else str(run.relaxed.best),
        }
    elif run.relaxed_error:
        evidence["all_weights_trainable"] = {"not_measured": run.relaxed_error}
    for key in CAUSE_EVIDENCE.get(cause.key, CONVERGENCE_EVIDENCE):
        if measured[key] is not None and measured[key] != []:
            evidence[key] = measured[key]
    return [OVERFIT_FAILED.finding(cause.message, evidence=evidence, fix=cause.fix)]


# -- LR range --------------------------------------------------------------------------------------
@dataclass
class LRSweep:
    lrs: list[float]  # the LR of each step that ran
    losses: list[float]  # the loss before that step's update
    lr_min: float
    lr_max: float
    configured_lr: float | None = None

    @property
    def divergence(self) -> int | None:
        return divergence_index(self.losses)

    @property
    def suggestion(self) -> float | None:
        i = self.divergence
        top = self.lrs[i] if i is not None else (self.lrs[-1] if self.lrs else None)
        if top is None or i == 0:
            return None
        return top / SUGGEST_BELOW


def diverging(loss: float, best: float, start: float) -> bool:
    """Whether ``loss`` has diverged, given the best loss before it and the starting one (see the module
    docstring)."""
    if not math.isfinite(loss):
        return True
    return math.isfinite(start) and loss > max(DIVERGE_RATIO * best, best + DIVERGE_FLOOR * start)


def divergence_index(losses: Sequence[float]) -> int | None:
    """The first step at which the sweep's loss diverges (see the module docstring), or None."""
    if not losses:
        return None
    start = losses[0]
    best = math.inf
    for i, loss in enumerate(losses):
        if not math.isfinite(loss) or (i > 0 and diverging(loss, best, start)):
            return i
        best = min(best, loss)
    return None


@LR_RANGE.detector("protocol", reads=LRSweep)
def check_lr_range(sweep: LRSweep) -> list[Finding]:
    if not sweep.lrs:
        return []
    i = sweep.divergence
    suggestion = sweep.suggestion
    best_i = min(
        (k for k, x in enumerate(sweep.losses) if math.isfinite(x)),
        key=lambda k: sweep.losses[k],
        default=None,
    )
    evidence = {
        "diverges_at": sweep.lrs[i] if i is not None else None,
        "suggested_lr": suggestion,
        "lowest_loss_at": sweep.lrs[best_i] if best_i is not None else None,
        "configured_lr": sweep.configured_lr,
        "sweep": [
            [float(f"{lr:.3g}"), round(x, 4) if math.isfinite(x) else str(x)]
            for lr, x in zip(sweep.lrs, sweep.losses)
        ],
    }
    if suggestion is None:
        return [
            LR_RANGE.finding(
                f"the loss is non-finite or diverging from the first step (lr={sweep.lrs[0]:.0e}): no LR is stable",
                evidence=evidence,
                severity="warning",
                fix="Fix the overfit and precision layers first; a setup that diverges at lr=1e-7 is broken.",
            )
        ]
    if i is None:
        message = (
            f"the loss did not diverge up to lr={sweep.lrs[-1]:.0e}; suggested base LR {suggestion:.1e} "
            "(an order of magnitude below the end of the sweep)"
        )
    else:
        message = (
            f"the loss diverges at lr≈{sweep.lrs[i]:.1e}; suggested base LR {suggestion:.1e} "
            "(an order of magnitude below)"
        )
    configured = sweep.configured_lr
    if configured and i is not None and configured >= sweep.lrs[i]:
        return [
            LR_RANGE.finding(
                f"the configured LR {configured:.1e} is at or past where the loss diverges "
                f"(lr≈{sweep.lrs[i]:.1e}); suggested base LR {suggestion:.1e}",
                evidence=evidence,
                severity="warning",
                fix=f"Lower the learning rate to about {suggestion:.1e}.",
            )
        ]
    return [
        LR_RANGE.finding(message, evidence=evidence, fix=f"Start from a base LR of about {suggestion:.1e}.")
    ]


# -- precision -------------------------------------------------------------------------------------
@dataclass
class PrecisionRun:
    fp32: float
    half: dict[str, float]  # dtype name -> loss under autocast
    skipped: dict[str, str] = field(default_factory=dict)  # dtype name -> why it was not run
    overflow: dict[str, str] = field(default_factory=dict)  # dtype name -> first module beyond its range
    max_abs: dict[str, float] = field(default_factory=dict)  # dtype name -> largest fp32 activation seen
    used: str | None = None  # the half format the trainer is configured with, if any


def precision_tolerance(dtype: str, fp32_loss: float) -> float:
    return PRECISION_ATOL + PRECISION_ROUNDOFFS * UNIT_ROUNDOFF[dtype] * abs(fp32_loss)


@PRECISION_MISMATCH.detector("protocol", reads=PrecisionRun)
def check_precision(run: PrecisionRun) -> list[Finding]:
    out = []
    if not math.isfinite(run.fp32):
        return out
    for dtype, loss in run.half.items():
        tolerance = precision_tolerance(dtype, run.fp32)
        finite = math.isfinite(loss)
        if finite and abs(loss - run.fp32) <= tolerance:
            continue
        where = (
            f"; first module past the {dtype} range: {run.overflow[dtype]}" if dtype in run.overflow else ""
        )
        if finite:
            message = (
                f"the {dtype} loss {loss:.4g} differs from float32 {run.fp32:.4g} by {abs(loss - run.fp32):.3g} "
                f"(tolerance {tolerance:.3g}){where}"
            )
        else:
            message = f"the loss turns {loss} in {dtype} (float32: {run.fp32:.4g}){where}"
        other = run.used is not None and run.used != dtype
        out.append(
            PRECISION_MISMATCH.finding(
                message + (f" (you train in {run.used})" if other else ""),
                evidence={
                    "dtype": dtype,
                    "loss_fp32": run.fp32,
                    "loss_half": loss,
                    "difference": abs(loss - run.fp32) if finite else None,
                    "tolerance": round(tolerance, 5),
                    "first_overflow": run.overflow.get(dtype),
                    "max_abs_activation_fp32": run.max_abs.get(dtype),
                    "trainer_precision": run.used,
                },
                severity="info" if other else None,
            )
        )
    return out
