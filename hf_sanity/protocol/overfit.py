"""Layer 1: overfit a handful of examples, measuring the gradient path on the way; and step 4's LR search for
the overfit, with its capacity check.

A working copy of the model is trained on the pipeline's examples alone, at the setup's fixed step-1 LR (or
the one given). The first step is also the probe: its forward pass gives the loss and its grad_fn, its
backward pass every parameter's ``.grad``, its optimizer step whether the parameters move.
:func:`hf_sanity.rules.protocol.check_overfit` then judges the measurements. When the probe already shows a
break no training can get past (no trainable params, nothing in the optimizer, a detached loss, ...) only a
short confirmation run follows, to show the flat curve. When the run does not reach near zero with the path
intact, the protocol's steps 2 and 3 come next (`hf_sanity.protocol.diagnose`); only then does
:func:`search_overfit` search the LR (step 4), and check the capacity of a setup that trains part of the model.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

from hf_sanity import progress
from hf_sanity.numbers import fmt
from hf_sanity.protocol.loop import (
    clip_grads,
    first_line,
    forward_loss,
    micro_weights,
    optimizer_params,
    signature,
    train,
)
from hf_sanity.protocol.lr_search import Search, search_lr
from hf_sanity.protocol.optimizers import adamw
from hf_sanity.protocol.pipeline import Learner, Pipeline, data_floor, label_positions, supervised_count
from hf_sanity.rules.protocol import (
    LR_SEARCH_BUDGETS,
    GradientPath,
    LRSweep,
    LRTrial,
    OverfitRun,
    Share,
    gradient_path_cause,
    near_zero_threshold,
    overfit_cause,
)

CONFIRM_STEPS = 20  # steps run to show the curve when the gradient path is already known to be broken
MAX_NAMES = 10


def probe(pipeline: Pipeline, learner: Learner, weights: list[float]) -> tuple[GradientPath, float]:
    """The gradient path, measured on the first training step (which it performs). Returns the path and the
    step-0 loss."""
    import torch

    model, optimizer = learner.model, learner.optimizer
    path = GradientPath(optimizer=type(optimizer).__name__)
    named = list(model.named_parameters())
    path.total_elements = sum(p.numel() for _, p in named)
    trainable = [(n, p) for n, p in named if p.requires_grad]
    path.trainable = len(trainable)
    path.trainable_elements = sum(p.numel() for _, p in trainable)
    held = optimizer_params(optimizer)
    held_ids = {id(p) for p in held}
    own = {id(p): p for _, p in named}
    path.in_optimizer = sum(1 for _, p in trainable if id(p) in held_ids)
    missing = [(n, p) for n, p in trainable if id(p) not in held_ids]
    path.not_in_optimizer = [n for n, _ in missing]
    path.not_in_optimizer_elements = sum(p.numel() for _, p in missing)
    path.optimizer_frozen = sum(1 for i in held_ids if i in own and not own[i].requires_grad)
    path.optimizer_foreign = sum(1 for i in held_ids if i not in own) + getattr(
        optimizer, "_hf_sanity_foreign", 0
    )
    counts = [supervised_count(b) for b in pipeline.batches]
    path.supervised_tokens = None if any(c is None for c in counts) else sum(counts)
    path.label_positions = sum(label_positions(b) for b in pipeline.batches)

    for _, p in named:
        p.grad = None
    loss_value = float("nan")
    try:
        loss, first = forward_loss(learner, pipeline.batches, weights)
        loss_value = float(loss.detach().float())
    except Exception as exc:
        path.loss_error = first_line(exc)
        return path, loss_value
    path.loss = loss_value
    path.input_ignored = input_ignored(learner, pipeline.batches[0])
    path.loss_requires_grad = bool(first.requires_grad)
    path.loss_grad_fn = type(first.grad_fn).__name__ if first.grad_fn is not None else None
    if not math.isfinite(loss_value) and path.supervised_tokens != 0:
        path.loss_error = f"the step-0 loss is {loss_value}"
        return path, loss_value
    if loss.requires_grad:
        try:
            loss.backward()
        except Exception as exc:
            path.loss_error = f"backward failed: {first_line(exc)}"
            return path, loss_value
    trained = [(n, p) for n, p in trainable if id(p) in held_ids]
    silent = []
    for name, p in trained:
        if p.grad is None:
            path.grad_none += 1
            silent.append(name)
        elif not bool(torch.isfinite(p.grad).all()):
            path.grad_nonfinite += 1
        elif bool((p.grad == 0).all()):
            path.grad_zero += 1
            silent.append(name)
        else:
            path.grad_nonzero += 1
    path.no_grad_names = silent[:MAX_NAMES]
    if path.grad_nonzero:
        before = {id(p): signature(p) for _, p in trained}
        clip_grads(held, pipeline.max_grad_norm)
        optimizer.step()
        path.updated = sum(1 for _, p in trained if signature(p) != before[id(p)])
    return path, loss_value


def input_ignored(learner: Learner, batch: dict) -> bool | None:
    """Whether the loss on ``batch`` is exactly the same with every input token replaced by token 0 (eval
    mode, no gradient, RNG kept): a model that computes the same whatever it reads. None: not measurable."""
    import torch

    from hf_sanity.untouched import untouched

    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.numel() == 0:
        return None
    filler = 0 if int(ids.flatten()[0]) != 0 else 1
    blanked = {**batch, "input_ids": torch.full_like(ids, filler)}
    try:
        with untouched(learner.model), torch.no_grad():
            as_is, _ = forward_loss(learner, [batch], [1.0])
            without, _ = forward_loss(learner, [blanked], [1.0])
    except Exception:  # the gradient path reports a loss that cannot be computed; this is a side measurement
        return None
    a, b = float(as_is.detach().float()), float(without.detach().float())
    return math.isfinite(a) and abs(a - b) <= 1e-6 * max(1.0, abs(a))


def run_overfit(pipeline: Pipeline, steps: int = 300) -> tuple[OverfitRun, dict[str, Any]]:
    """Step 1: train a working copy on the examples at ``pipeline.lr`` (the setup's fixed LR, or the one given);
    the measurements and their stats. The user's model is untouched. A broken gradient path is named from the
    probe and only confirmed by a short run."""
    import torch

    from hf_sanity.untouched import preserved_rng

    started = time.perf_counter()
    with preserved_rng():
        torch.manual_seed(0)
        model = pipeline.working_copy()
        learner = pipeline.bind(model, pipeline.lr)
        weights = micro_weights(pipeline.batches)
        held = {id(p) for p in optimizer_params(learner.optimizer)}
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) in held]
        initial = {n: signature(p) for n, p in trained}
        with progress.phase("overfit: the first step (gradient path)"):
            path, loss0 = probe(pipeline, learner, weights)
        floor = data_floor(pipeline.batches)
        floor = floor if floor is not None and floor.nats > 0 else None
        threshold = near_zero_threshold(floor)
        losses = [loss0]
        broken = gradient_path_cause(path)
        budget = min(steps, CONFIRM_STEPS) if broken is not None else steps
        if path.loss_error is None and math.isfinite(loss0) and loss0 > threshold:
            try:
                name = f"overfit at lr {pipeline.lr:.2g}"
                train(pipeline, learner, weights, losses, budget, threshold, name=name)
            except Exception as exc:  # a later step broke (the probe's passed): reported as measured
                path.loss_error = f"step {len(losses)}: {first_line(exc)}"
        if path.updated:
            path.never_updated = [n for n, p in trained if signature(p) == initial[n]]
        del model, learner
    run = OverfitRun(
        path=path,
        losses=losses,
        threshold=threshold,
        steps=steps,
        lr=pipeline.lr,
        examples=pipeline.examples,
        vocab_size=pipeline.vocab_size,
        lr_source="default" if pipeline.lr_search else "given",
        floor=floor,
        share=share_of(pipeline, path),
    )
    return run, overfit_stats(run, pipeline, time.perf_counter() - started)


def share_of(pipeline: Pipeline, path: GradientPath) -> Share:
    adapter = pipeline.adapter
    described = None
    if adapter:
        targets = adapter.get("target_modules")
        targets = ", ".join(targets) if isinstance(targets, list) else str(targets)
        kind = {"LORA": "LoRA"}.get(str(adapter.get("peft_type")), str(adapter.get("peft_type", "adapter")))
        described = f"{kind} r={adapter.get('r')} on {targets}"
    frozen = sum(1 for p in pipeline.model.parameters() if not p.requires_grad)
    return Share(path.trainable_elements, path.total_elements, described, frozen)


def every_weight_trainable(pipeline: Pipeline) -> Pipeline:
    """The pipeline with every weight of its working copies trainable (an adapter's base and frozen layers
    too), trained by AdamW with the setup's own loss: the capacity check."""
    binder = pipeline.binder

    def bind(model, lr: float) -> Learner:
        model.requires_grad_(True)
        learner = binder(model, lr)
        return Learner(model, adamw(model, lr), learner.loss)

    return replace(pipeline, binder=bind)


def search_overfit(
    pipeline: Pipeline, run: OverfitRun, sweep: LRSweep | None = None
) -> tuple[OverfitRun, dict[str, Any]]:
    """Step 4 for an overfit that step 1 left inconclusive: the LR search (:mod:`hf_sanity.protocol.lr_search`,
    on ``sweep`` when the range test already ran); when no LR reaches near zero and only part of the model
    trains, the same search with every weight trainable (the capacity check). ``pipeline.lr`` becomes the LR
    the report shows."""
    from hf_sanity.untouched import preserved_rng

    started = time.perf_counter()
    weights = micro_weights(pipeline.batches)
    path = replace(run.path)
    first = LRTrial(lr=run.lr, losses=list(run.losses), threshold=run.threshold)
    relaxed = None
    with preserved_rng():
        search = search_lr(pipeline, run.steps, run.threshold, weights, sweep=sweep)
        path.loss_error = search.error
        searched = replace(
            run, path=path, lr_source="search", tried=search.tried, sweep_diverges_at=search.sweep_diverges_at,
            first=first,
        )  # fmt: skip
        reported = search.reported()
        if reported is not None and reported.losses:
            searched.losses, searched.lr = reported.losses, reported.lr
            pipeline.lr = reported.lr
            if path.updated:
                path.never_updated = reported.never_updated
        cause = overfit_cause(searched)
        if (
            cause is not None
            and cause.key == "not-converged"
            and run.share is not None
            and run.share.restricted
        ):
            try:
                with progress.phase("capacity check: every weight trainable"):
                    relaxed = search_lr(every_weight_trainable(pipeline), run.steps, run.threshold, weights)
                searched.relaxed = relaxed.reported()
                searched.relaxed_error = relaxed.error
            except Exception as exc:  # out of memory, typically: the check is said not measured, not guessed
                searched.relaxed_error = first_line(exc)
    return searched, overfit_stats(searched, pipeline, time.perf_counter() - started, search, relaxed)


def search_stats(search: Search, steps: int) -> dict[str, Any]:
    """The LR search as measured: the range test's divergence and every run, in the order they ran."""

    def ended(trial) -> str:
        if trial.reached:
            return "near zero"
        return (
            "too high (diverged, plateaued or oscillating)" if trial.too_high else "too low (still falling)"
        )

    return {
        "sweep_diverges_at": search.sweep_diverges_at,
        "sweep_steps": search.sweep_steps,
        "tried": [
            {
                "lr": float(f"{t.lr:.4g}"),
                "steps": t.steps,
                "best_loss": round(t.best, 5) if math.isfinite(t.best) else str(t.best),
                "ended": ended(t),
            }
            for t in search.tried
        ],
        "steps": search.steps,
        "step_limit": (LR_SEARCH_BUDGETS + 1) * steps,  # the search's budgets, and the best LR's whole run
    }


TRAJECTORY_POINTS = 8  # steps of the overfit's loss shown in the report, as the protocol shows its own


def trajectory(losses: list[float]) -> list[list[float]]:
    """[step, loss] at a few steps from the first to the last (the protocol's "step 0: 1.2156 ... step 299:
    0.0123")."""
    if not losses:
        return []
    last = len(losses) - 1
    steps = sorted({round(i * last / (TRAJECTORY_POINTS - 1)) for i in range(TRAJECTORY_POINTS)})
    return [
        [step, round(losses[step], 4) if math.isfinite(losses[step]) else str(losses[step])] for step in steps
    ]


def overfit_stats(
    run: OverfitRun,
    pipeline: Pipeline,
    seconds: float,
    search: Search | None = None,
    relaxed: Search | None = None,
) -> dict[str, Any]:
    cause = overfit_cause(run)
    path = run.path
    floor = run.floor
    return {
        "passed": cause is None,
        "cause": cause.key if cause else None,
        "loss_start": run.initial,
        "loss_final": run.losses[-1] if run.losses else None,
        "near_zero": round(run.threshold, 4),
        "data_floor": {
            "nats": round(floor.nats, 4),
            "positions": floor.positions,
            "prefixes": floor.prefixes,
            "supervised_tokens": floor.tokens,
        }
        if floor is not None
        else None,
        "reached_at_step": run.reached_at,
        "steps_run": max(len(run.losses) - 1, 0),
        "step_budget": run.steps,
        "lr": run.lr,
        "lr_chosen_by": run.lr_source,
        "step1": {
            "lr": run.first.lr,
            "steps_run": run.first.steps,
            "loss_final": run.first.losses[-1],
            "losses": [round(x, 5) if math.isfinite(x) else str(x) for x in run.first.losses],
        }
        if run.first is not None
        else None,
        "lr_search": search_stats(search, run.steps) if search else None,
        "found_before_lr": run.blocked_by or None,
        "capacity": capacity_stats(run, relaxed) if run.relaxed is not None or run.relaxed_error else None,
        "examples": run.examples,
        "trajectory": trajectory(run.losses),
        "losses": [round(x, 5) if math.isfinite(x) else str(x) for x in run.losses],
        "gradient_path": {
            "supervised_tokens": path.supervised_tokens,
            "label_positions": path.label_positions,
            "trainable": path.trainable,
            "trainable_elements": path.trainable_elements,
            "total_elements": path.total_elements,
            "optimizer": path.optimizer,
            "in_optimizer": path.in_optimizer,
            "not_in_optimizer": path.not_in_optimizer[:MAX_NAMES],
            "optimizer_frozen": path.optimizer_frozen,
            "optimizer_foreign": path.optimizer_foreign,
            "loss_grad_fn": path.loss_grad_fn,
            "loss_requires_grad": path.loss_requires_grad,
            "loss_error": path.loss_error,
            "grads": {
                "nonzero": path.grad_nonzero,
                "zero": path.grad_zero,
                "none": path.grad_none,
                "nonfinite": path.grad_nonfinite,
            },
            "no_grad": path.no_grad_names,
            "updated": path.updated,
            "never_updated": path.never_updated[:MAX_NAMES] if path.never_updated is not None else None,
        },
        "seconds": round(seconds, 2),
    }


def capacity_stats(run: OverfitRun, relaxed: Search | None) -> dict[str, Any]:
    """The capacity check as measured: the setup's share, and where the search with every weight trainable got."""
    share, best = run.share, run.relaxed
    out: dict[str, Any] = {
        "trainable_elements": share.trainable if share else None,
        "total_elements": share.total if share else None,
        "held_back": (share.adapter or f"{share.frozen_tensors} frozen tensors") if share else None,
    }
    if best is None:
        out["not_measured"] = run.relaxed_error
        return out
    out.update(
        all_trainable_reached=best.reached,
        all_trainable_lr=float(f"{best.lr:.4g}"),
        all_trainable_steps=best.steps,
        all_trainable_best_loss=round(best.best, 5) if math.isfinite(best.best) else str(best.best),
        all_trainable_search=search_stats(relaxed, run.steps) if relaxed else None,
    )
    return out


def path_checklist(stats: dict[str, Any], layer: int = 1) -> list[dict[str, Any]]:
    """The gradient-path items of the checklist, each ticked from a measurement."""
    path = stats["gradient_path"]
    grads = path["grads"]
    items = []

    def item(text: str, status: str, detail: str) -> None:
        items.append({"layer": layer, "item": text, "status": status, "detail": detail})

    sup = path["supervised_tokens"]
    if path["loss_error"] and sup != 0:
        item("the loss is computable", "failed", path["loss_error"])
    if sup is None:
        item("labels carry loss", "skipped", "the batch has no labels (the loss builds its own)")
    else:
        item(
            "labels carry loss",
            "passed" if sup else "failed",
            f"{sup} of {path['label_positions']} label positions",
        )
    item(
        "trainable parameters exist",
        "passed" if path["trainable"] else "failed",
        f"{path['trainable']} tensors, {path['trainable_elements']:,} of {path['total_elements']:,} weights",
    )
    if not path["trainable"]:
        status = "skipped"
        detail = "nothing is trainable"
    elif path["in_optimizer"] == 0:
        status, detail = "failed", f"none of {path['trainable']} trainable tensors"
    elif path["not_in_optimizer"]:
        status, detail = "warning", f"{len(path['not_in_optimizer'])} trainable tensors missing"
    else:
        status, detail = "passed", f"all {path['in_optimizer']} trainable tensors ({path['optimizer']})"
    item("the optimizer holds the trainable parameters", status, detail)
    if path["loss_error"] or path["in_optimizer"] == 0 or not path["trainable"] or sup == 0:
        for text in (
            "the loss is connected to the graph",
            "gradient reaches the parameters",
            "an optimizer step updates them",
        ):
            item(text, "skipped", "not measurable past the failure above")
    else:
        connected = path["loss_grad_fn"] is not None and path["loss_requires_grad"]
        item(
            "the loss is connected to the graph",
            "passed" if connected else "failed",
            f"grad_fn={path['loss_grad_fn']}",
        )
        reach = (
            f"{grads['nonzero']} non-zero, {grads['zero']} zero, {grads['none']} None, "
            f"{grads['nonfinite']} non-finite"
        )
        item("gradient reaches the parameters", "passed" if grads["nonzero"] else "failed", reach)
        if path["updated"] is None:
            item("an optimizer step updates them", "skipped", "no gradient to step on")
        else:
            item(
                "an optimizer step updates them",
                "passed" if path["updated"] else "failed",
                f"{path['updated']} of {path['in_optimizer']} tensors changed",
            )
    item(*step1_item(stats))
    return items


def step1_item(stats: dict[str, Any]) -> tuple[str, str, str]:
    """The checklist's step-1 verdict: near zero at the step-1 LR; inconclusive (a warning) when the path is
    intact and steps 2-4 are still to come; failed once the overfit's own verdict is."""
    first = stats["step1"] or {
        "lr": stats["lr"],
        "steps_run": stats["steps_run"],
        "loss_final": stats["loss_final"],
    }
    floor = stats["data_floor"]
    near = f"near zero: {stats['near_zero']}" + (
        f", the data's floor {floor['nats']} + 0.05" if floor else ""
    )
    detail = (
        f"{fmt(stats['loss_start'], 4)} -> {fmt(first['loss_final'], 4)} in {first['steps_run']} steps at "
        f"lr={first['lr']:.3g} ({near})"
    )
    text = "the loss reaches near zero at the step-1 LR"
    if stats["step1"] is None and stats["passed"] and stats["reached_at_step"] is not None:
        return text, "passed", detail
    if stats["cause"] in (None, "not-converged", "capacity") and not stats["gradient_path"]["loss_error"]:
        # the path is intact: not conclusive at one LR; steps 2 and 3, then the LR search, decide
        then = (
            "the LR was given: not searched" if stats["lr_chosen_by"] == "given" else "then the LR (step 4)"
        )
        return text, "warning", detail + f"; not conclusive at one LR: steps 2 and 3 first, {then}"
    return text, "failed", detail


def search_items(stats: dict[str, Any], layer: int = 4) -> list[dict[str, Any]]:
    """The checklist items of step 4's overfit search and of the capacity check."""
    items = []
    search = stats["lr_search"]
    if search is None:
        return items
    reached = stats["passed"] and stats["reached_at_step"] is not None
    count = len(search["tried"])
    bests = [t["best_loss"] for t in search["tried"] if isinstance(t["best_loss"], float)]
    detail = f"{count} LR{'s' if count != 1 else ''} tried; " + (
        f"near zero at lr={stats['lr']:.3g}, step {stats['reached_at_step']}"
        if reached
        else f"best {fmt(min(bests, default=math.nan), 4)} (near zero: {stats['near_zero']})"
    )
    items.append(
        {
            "layer": layer,
            "item": "the overfit reaches near zero at a searched LR",
            "status": "passed" if reached else "failed",
            "detail": detail,
        }
    )
    capacity = stats["capacity"]
    if capacity is not None:
        if "not_measured" in capacity:
            status, detail = "skipped", f"not measured: {capacity['not_measured']}"
        else:
            status = "failed" if stats["cause"] == "capacity" else "passed"
            detail = (
                f"{capacity['trainable_elements']:,} of {capacity['total_elements']:,} weights train "
                f"({capacity['held_back']}); every weight trainable: best {capacity['all_trainable_best_loss']} "
                f"at lr={capacity['all_trainable_lr']:.3g}"
            )
        items.append({"layer": layer, "item": "the trainable share is enough for the examples", "status": status,
                      "detail": detail})  # fmt: skip
    return items
