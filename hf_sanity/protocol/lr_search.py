"""The overfit's learning rate when none is given: the test has to show that the pipeline *can* memorise the
examples, and one fixed default is too low for some setups and too high for others.

An LR range test on the examples gives where the loss diverges; runs from the same starting weights then try
LRs half a decade apart, the first a decade below that point (the range test's suggestion). A run stops
once its loss falls too slowly to get near zero. While every run's loss still fell at its end the next LR is
higher; once one diverges or stops falling (it plateaus or oscillates) the next is lower. The search stops at
the first run that reaches near zero, or once ``LR_SEARCH_BUDGETS`` step budgets are spent, the range test
included; when no run got there, the best LR then runs the whole step budget before the verdict. The
thresholds are those of
`hf_sanity.rules.protocol`, which judges the runs; this module only takes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hf_sanity.protocol.loop import first_line, optimizer_params, signature, train
from hf_sanity.protocol.pipeline import Pipeline
from hf_sanity.protocol.steps import LR_MAX, LR_MIN, LR_PER_DECADE, lr_grid, run_lr_range
from hf_sanity.rules.protocol import (
    LR_SEARCH_BUDGETS,
    LR_SEARCH_RUNG,
    LR_SEARCH_WINDOW,
    SUGGEST_BELOW,
    LRSweep,
    LRTrial,
)

# Rung k is the LR top / LR_SEARCH_RUNG**k, top being where the range test diverges: rung 0 is that LR, the
# first rung tried its suggestion.
FIRST_RUNG = round(math.log(SUGGEST_BELOW, LR_SEARCH_RUNG))
SHORTEST_RUN = 0.1  # of the step budget: a run shorter than that says little about its LR


@dataclass
class Search:
    """What the search measured: every run in the order they ran, where the range test diverged, the steps."""

    tried: list[LRTrial] = field(default_factory=list)
    sweep_diverges_at: float | None = None  # None: not up to the end of the sweep
    sweep_steps: int = 0
    steps: int = 0  # every optimizer step of the search, the range test's included
    error: str | None = None  # a step that raised: "lr ..., step ...: Type: message"

    def reported(self) -> LRTrial | None:
        """The run the report shows: the first that reached near zero, else the lowest that ended finite."""
        for trial in self.tried:
            if trial.reached:
                return trial
        return min(
            self.tried,
            key=lambda t: (not t.ended_finite, t.best if math.isfinite(t.best) else math.inf),
            default=None,
        )


def sweep_density(steps: int) -> int:
    """Points per decade of the range test, so that it takes at most about one step budget."""
    decades = math.log10(LR_MAX / LR_MIN)
    return max(2, min(LR_PER_DECADE, int((steps - 1) / decades)))


def next_rung(tried: dict[int, LRTrial]) -> int:
    """The rung after the last run: one above the highest while every run so far had too low an LR, else one
    below the lowest."""
    highest = min(tried)
    if highest > 0 and not any(t.too_high for t in tried.values()):
        return highest - 1
    return max(tried) + 1


def trial_run(
    pipeline: Pipeline,
    lr: float,
    steps: int,
    threshold: float,
    weights: list[float],
    window: int,
    *,
    stop_early: bool = True,
) -> tuple[LRTrial, str | None]:
    """A run from the starting weights at ``lr`` (on its own working copy), stopped early as
    :func:`~hf_sanity.protocol.loop.train` does with ``window`` (unless not ``stop_early``: the whole ``steps``,
    its trend still read over ``window``); and the error of a step that raised."""
    import torch

    torch.manual_seed(0)
    model = pipeline.working_copy()
    learner = pipeline.bind(model, lr)
    held = {id(p) for p in optimizer_params(learner.optimizer)}
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) in held]
    initial = {n: signature(p) for n, p in trained}
    trial = LRTrial(lr=lr, losses=[], threshold=threshold, window=window)
    error = None
    try:
        train(
            pipeline,
            learner,
            weights,
            trial.losses,
            steps,
            threshold,
            window=window if stop_early else None,
            name=f"LR search: lr {lr:.2g}" if stop_early else f"overfit at lr {lr:.2g}",
        )
    except Exception as exc:  # a step that raises is not an LR problem: the search reports it as measured
        error = f"lr {lr:.3g}, step {len(trial.losses)}: {first_line(exc)}"
    trial.never_updated = [n for n, p in trained if signature(p) == initial[n]]
    del model, learner
    return trial, error


def search_lr(
    pipeline: Pipeline, steps: int, threshold: float, weights: list[float], sweep: LRSweep | None = None
) -> Search:
    """Runs at LRs chosen as the module docstring says, until one reaches near zero or the budget is spent.
    ``sweep``: an LR range test already run on these examples (diagnose's step 4), else one is run."""
    search = Search()
    if sweep is None:
        sweep, _ = run_lr_range(pipeline, lr_grid(LR_MIN, LR_MAX, sweep_density(steps)))
    search.sweep_steps = len(sweep.losses)
    i = sweep.divergence
    search.sweep_diverges_at = sweep.lrs[i] if i is not None else None
    # rung 0: where the sweep diverges, else the end of the sweep, else (no sweep step ran) 10x the start LR
    top = sweep.lrs[i] if i is not None else (sweep.lr_max if sweep.lrs else pipeline.lr * SUGGEST_BELOW)
    budget = LR_SEARCH_BUDGETS * steps
    window = max(1, round(LR_SEARCH_WINDOW * steps))
    spent = search.sweep_steps
    tried: dict[int, LRTrial] = {}
    rung = FIRST_RUNG
    while True:
        # the first run always gets a full budget, the next ones what is left of the search's
        allowed = steps if not tried else min(steps, budget - spent)
        if allowed < max(1, SHORTEST_RUN * steps):
            break
        trial, search.error = trial_run(
            pipeline, top / LR_SEARCH_RUNG**rung, allowed, threshold, weights, window
        )
        tried[rung] = trial
        search.tried.append(trial)
        spent += trial.steps
        if search.error is not None or trial.reached:
            break
        rung = next_rung(tried)
    best = search.reported()
    if (
        best is not None
        and search.error is None
        and not best.reached
        and best.ended_finite
        and best.steps < steps
    ):
        # No LR got there, and the runs were cut once their loss fell too slowly: before the verdict, the best
        # LR runs the whole budget the user gave (a slow run may still get there; if not, "more --steps" is
        # advice about that budget, not about a run the search cut short).
        full, search.error = trial_run(pipeline, best.lr, steps, threshold, weights, window, stop_early=False)
        search.tried[search.tried.index(best)] = full
        spent += full.steps
    search.steps = spent
    return search
