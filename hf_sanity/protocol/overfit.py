"""Layer 1: overfit a handful of examples, measuring the gradient path on the way.

A working copy of the model is trained on the pipeline's examples alone. The first step is also the probe:
its forward pass gives the loss and its grad_fn, its backward pass every parameter's ``.grad``, its optimizer
step whether the parameters move. :func:`hf_sanity.rules.protocol.check_overfit` then judges the measurements.
When the probe already shows a break no training can get past (no trainable params, nothing in the optimizer,
a detached loss, ...) only a short confirmation run follows, to show the flat curve.
"""

from __future__ import annotations

import math
import time
from typing import Any

from hf_sanity import catalog, progress
from hf_sanity.numbers import fmt
from hf_sanity.protocol.build import build
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
from hf_sanity.protocol.options import ProtocolOptions
from hf_sanity.protocol.pipeline import Learner, Pipeline, label_positions, supervised_count
from hf_sanity.rules.protocol import (
    LR_SEARCH_BUDGETS,
    GradientPath,
    OverfitRun,
    gradient_path_cause,
    near_zero_threshold,
    overfit_cause,
)
from hf_sanity.selection import Selection

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
    """Train a working copy on the examples; the measurements and their stats. The user's model is untouched.

    The first step is the probe, at ``pipeline.lr``. A broken gradient path is named from it and only confirmed
    by a short run; an intact one trains on at the given LR or, with ``pipeline.lr_search``, at the LRs the
    search tries (:mod:`hf_sanity.protocol.lr_search`), and ``pipeline.lr`` becomes the one it reports."""
    import torch

    from hf_sanity.untouched import preserved_rng

    started = time.perf_counter()
    search = None
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
        threshold = near_zero_threshold(loss0, pipeline.vocab_size)
        losses = [loss0]
        broken = gradient_path_cause(path)
        to_train = path.loss_error is None and math.isfinite(loss0) and loss0 > threshold
        if to_train and broken is None and pipeline.lr_search:
            # every run of the search starts from the original weights on its own copy: free the probe's first
            del model, learner, trained
            search = search_lr(pipeline, steps, threshold, weights)
            path.loss_error = search.error
            reported = search.reported()
            if reported is not None and reported.losses:
                losses = reported.losses
                pipeline.lr = reported.lr
                if path.updated:
                    path.never_updated = reported.never_updated
        else:
            budget = min(steps, CONFIRM_STEPS) if broken is not None else steps
            if to_train:
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
        lr_source="search" if search else "default" if pipeline.lr_search else "given",
        tried=search.tried if search else [],
        sweep_diverges_at=search.sweep_diverges_at if search else None,
    )
    return run, overfit_stats(run, pipeline, time.perf_counter() - started, search)


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


def overfit_stats(
    run: OverfitRun, pipeline: Pipeline, seconds: float, search: Search | None = None
) -> dict[str, Any]:
    cause = overfit_cause(run)
    path = run.path
    return {
        "passed": cause is None,
        "cause": cause.key if cause else None,
        "loss_start": run.initial,
        "loss_final": run.losses[-1] if run.losses else None,
        "near_zero": round(run.threshold, 4),
        "reached_at_step": run.reached_at,
        "steps_run": max(len(run.losses) - 1, 0),
        "step_budget": run.steps,
        "lr": run.lr,
        "lr_chosen_by": run.lr_source,
        "lr_search": search_stats(search, run.steps) if search else None,
        "examples": run.examples,
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
    reached = stats["reached_at_step"]
    loss_detail = (
        f"{fmt(stats['loss_start'], 4)} -> {fmt(stats['loss_final'], 4)} in {stats['steps_run']} steps "
        f"at lr={stats['lr']:.3g} (near zero: {stats['near_zero']})"
    )
    if stats["lr_search"]:
        loss_detail += f"; LR searched: {len(stats['lr_search']['tried'])} tried"
    item(
        "the loss reaches near zero",
        "passed" if stats["passed"] and reached is not None else "failed",
        loss_detail,
    )
    return items


def overfit(
    trainer=None,
    model=None,
    tokenizer=None,
    dataset=None,
    *,
    options: ProtocolOptions | None = None,
    lora=None,
    optimizer=None,
    plot=None,
    with_plot: bool = True,
    pipeline: Pipeline | None = None,
    **option_values,
):
    """Overfit ``n`` (2-10) examples of the real pipeline on a copy of the model; a report that says whether the
    loss reaches near zero and, if not, which part of the gradient path is broken.

    Pass ``trainer=`` (its batches, loss and optimizer class are used) or ``model=``, ``tokenizer=`` and
    ``dataset=`` (rows tokenized as TRL does; ``lora=`` a peft LoraConfig or dict to attach an adapter,
    ``optimizer=`` to use yours). The options (``n``, ``steps``, ``lr``, ``max_len``, ``loss_on``, ``format``)
    are those of :class:`~hf_sanity.protocol.options.ProtocolOptions`, given as ``options=`` or by name.
    ``plot=`` writes the loss curve as a PNG; ``with_plot`` attaches it to ``report.plots`` (for the HTML page)
    when matplotlib is installed. Nothing of the user's is modified: the model is deep-copied and the RNG
    states are restored.
    """
    from hf_sanity.protocol.render import ProtocolReport, overfit_png, want_png
    from hf_sanity.untouched import preserved_rng

    started = time.perf_counter()
    opts = ProtocolOptions.of(options, **option_values)
    with preserved_rng():
        pipeline = build(
            pipeline, trainer=trainer, model=model, tokenizer=tokenizer, dataset=dataset, options=opts,
            lora=lora, optimizer=optimizer,
        )  # fmt: skip
        run, stats = run_overfit(pipeline, opts.steps)
    report = ProtocolReport(title="hf-sanity overfit")
    report.extend(catalog.run_all("protocol", run, Selection()))
    report.stats.update(setup=pipeline.describe(), overfit=stats, checklist=path_checklist(stats))
    report.stats["seconds"] = round(time.perf_counter() - started, 2)
    if want_png(plot, with_plot):
        report.plots["overfit: loss on the examples"] = overfit_png(run, plot)
    return report
