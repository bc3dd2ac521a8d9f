"""`diagnose()`: the ordered debugging protocol, cheapest and most decisive check first, stopping at the
first layer that is broken (an error finding):

1. overfit one batch (the gradient path), at the setup's fixed LR;
2. the loss at initialization against chance;
3. shapes (every module's, via forward hooks) and masks (the preflight mask rules on the collated batch);
4. the learning rate (an LR range test; and, when step 1 did not reach near zero with the gradient path
   intact, the overfit's LR search on it, then the capacity check);
5. numerical precision (float32 against bf16/fp16).

Step 1 that does not reach near zero with the path intact is not yet a verdict: "only after the first three
checks pass does the learning rate become the likely suspect", so steps 2 and 3 run before any LR search.
`overfit()` (here too) runs the same steps in the same order, only as far as its verdict needs
(:func:`run_protocol`); the steps' measurements are in `hf_sanity.protocol.overfit` and `.steps`.

The report names the broken layer and its fix, saves a single-batch reproduction, and ends with the
verification checklist: every item ticked from what was measured, the rest shown as skipped with why.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_sanity import catalog, progress
from hf_sanity.errors import UserInputError
from hf_sanity.protocol.build import build
from hf_sanity.protocol.options import ProtocolOptions
from hf_sanity.protocol.overfit import path_checklist, run_overfit, search_items, search_overfit
from hf_sanity.protocol.pipeline import Pipeline
from hf_sanity.rules.protocol import OVERFIT_FAILED, check_overfit, inconclusive
from hf_sanity.selection import Selection

PROTOCOL = Selection()  # overfit and diagnose run every protocol rule


def _item(layer: int, text: str, status: str, detail: str) -> dict[str, Any]:
    return {"layer": layer, "item": text, "status": status, "detail": detail}


def _status(findings) -> str:
    severities = {f.severity for f in findings}
    return "failed" if "error" in severities else "warning" if "warning" in severities else "passed"


def layer_overfit(pipeline: Pipeline, report, state: dict) -> tuple[list, list]:
    run, stats = run_overfit(pipeline, state["steps"])
    state["overfit"] = run
    report.stats["overfit"] = stats
    plot_overfit(report, run, state)
    # Not reaching near zero with the path intact is no verdict yet: steps 2 and 3 come first, then the LR.
    findings = [] if inconclusive(run) else catalog.run_all("protocol", run, PROTOCOL)
    return findings, path_checklist(stats, layer=1)


def plot_overfit(report, run, state: dict) -> None:
    from hf_sanity.protocol.render import overfit_png

    if state["png"]:
        report.plots["1. overfit: loss on the examples"] = overfit_png(run, state["plot"])


def pending_overfit(state: dict) -> bool:
    return state.get("overfit") is not None and inconclusive(state["overfit"])


def overfit_after_lr(pipeline: Pipeline, report, state: dict, sweep=None) -> tuple[list, list]:
    """Step 4 for an overfit step 1 left inconclusive: the LR search (unless the LR was given), then the
    overfit's verdict."""
    run = state["overfit"]
    items = []
    if run.lr_source == "default":
        run, stats = search_overfit(pipeline, run, sweep)
        state["overfit"] = run
        report.stats["overfit"] = stats
        plot_overfit(report, run, state)
        items = search_items(stats, layer=4)
    else:
        items.append(_item(4, "the overfit reaches near zero at a searched LR", "skipped",
                           f"the LR was given (lr={run.lr:.3g}): not searched"))  # fmt: skip
    return catalog.run_all("protocol", run, PROTOCOL), items


def layer_init_loss(pipeline: Pipeline, report, state: dict) -> tuple[list, list]:
    from hf_sanity.protocol.steps import run_init_loss

    model = pipeline.working_copy()
    findings, stats = run_init_loss(pipeline, model)
    del model
    report.stats["init_loss"] = stats
    text = "the step-0 loss is near chance (labels aligned, no leakage)"
    if stats.get("loss") is None:
        return findings, [_item(2, text, "skipped", stats.get("note", "not measured"))]
    detail = f"{stats['loss']:.4g} nat/token vs ln(V)={stats['ln_vocab']:.4g}, model entropy {stats['model_entropy']:.4g}"
    return findings, [_item(2, text, _status(findings), detail)]


def layer_shapes_masks(pipeline: Pipeline, report, state: dict) -> tuple[list, list]:
    from hf_sanity.protocol.steps import run_masks, shape_rows

    model = pipeline.working_copy()
    rows, summary = shape_rows(model, pipeline.batches[0])
    findings, masks = run_masks(pipeline, model)
    del model
    report.stats["shapes"] = rows
    report.stats["masks"] = {**masks, "shapes": summary}
    shape_detail = f"input_ids {summary['input_ids']}, labels {summary['labels']}, logits {summary['logits']}"
    items = [
        _item(
            3,
            "tensor shapes agree through the forward pass",
            "passed" if summary["consistent"] else "warning",
            f"{len(rows)} module rows; {shape_detail}",
        ),
    ]
    if "note" in masks:
        items.append(_item(3, "masks: the right tokens carry loss", "skipped", masks["note"]))
    else:
        fired = ", ".join(masks["rules"]) or "no mask rule fired"
        items.append(
            _item(
                3,
                "masks: the right tokens carry loss",
                _status(findings),
                f"{masks['supervised_tokens']} of {masks['tokens']} tokens carry loss; {fired}",
            )
        )
        leaks = [f for f in findings if f.rule == "future-token-leak"]
        checked = masks["causal_rows_checked"]
        if not checked:
            status, detail = "skipped", "no row of the batch to change the future of"
        else:
            status = _status(leaks)
            detail = (
                leaks[0].message
                if leaks
                else f"{checked} rows: the tokens after t do not move the logits at <= t"
            )
        items.append(_item(3, "no position sees the tokens after it (causal mask)", status, detail))
    return findings, items


def layer_lr(pipeline: Pipeline, report, state: dict) -> tuple[list, list]:
    from hf_sanity.protocol.render import lr_png, want_png
    from hf_sanity.protocol.steps import run_lr_range

    pending = pending_overfit(state)
    if state["through"] == "overfit":  # overfit's step 4: the LR search only, no verdict on the configured LR
        return overfit_after_lr(pipeline, report, state) if pending else ([], [])
    sweep, stats = run_lr_range(pipeline)
    report.stats["lr_range"] = stats
    findings = catalog.run_all("protocol", sweep, PROTOCOL)
    if want_png(None, state["with_plot"]) and sweep.lrs:
        report.plots["4. LR range test"] = lr_png(sweep)
    if stats["suggested_lr"] is None:
        detail = stats.get("error") or "the loss diverges from the first step"
        items = [_item(4, "an LR range with a stable base LR", "failed", detail)]
    else:
        where = (
            f"diverges at {stats['diverges_at']:.1e}" if stats["diverges_at"] is not None else "no divergence"
        )
        detail = f"{where}; suggested {stats['suggested_lr']:.1e}"
        if stats["configured_lr"]:
            detail += f"; configured {stats['configured_lr']:.1e}"
        items = [_item(4, "an LR range with a stable base LR", _status(findings), detail)]
    if pending:
        more, more_items = overfit_after_lr(pipeline, report, state, sweep if sweep.lrs else None)
        findings, items = findings + more, items + more_items
    return findings, items


def layer_precision(pipeline: Pipeline, report, state: dict) -> tuple[list, list]:
    from hf_sanity.protocol.steps import run_precision

    run, stats = run_precision(pipeline)
    report.stats["precision"] = stats
    findings = catalog.run_all("protocol", run, PROTOCOL)
    items = []
    for name, row in stats["half"].items():
        detail = f"{row['loss']:.5g} vs float32 {stats['fp32']:.5g} (tolerance {row['tolerance']:.3g})"
        items.append(_item(5, f"the {name} loss matches float32", row["status"], detail))
    for name, why in stats["skipped"].items():
        items.append(_item(5, f"the {name} loss matches float32", "skipped", why))
    return findings, items


@dataclass(frozen=True)
class Layer:
    """One step of the protocol: its number and title, what runs it, and the report stats it measures (kept
    with the reproduction when the layer is broken)."""

    number: int
    title: str
    run: Callable[[Pipeline, Any, dict], tuple[list, list]]  # (pipeline, report, state shared by the layers)
    measured: Callable[[dict], Any]


LAYERS: tuple[Layer, ...] = (
    Layer(1, "overfit one batch", layer_overfit, lambda s: s.get("overfit", {}).get("gradient_path")),
    Layer(2, "loss at initialization vs chance", layer_init_loss, lambda s: s.get("init_loss")),
    Layer(3, "shapes and masks", layer_shapes_masks, lambda s: s.get("masks")),
    Layer(4, "learning rate (LR range test)", layer_lr, lambda s: s.get("lr_range")),
    Layer(5, "numerical precision", layer_precision, lambda s: s.get("precision")),
)


def check_repro_target(repro: str | Path | None, protected: list[Path]) -> None:
    """Refuse, before any work, a reproduction folder inside the model or data folders."""
    from hf_sanity.protocol.repro import _inside

    if repro is None:
        return
    for guarded in protected:
        if _inside(Path(repro).expanduser(), guarded):
            raise UserInputError(
                f"--repro {str(repro)!r} is inside {str(guarded)!r}; hf-sanity never writes into the model or "
                "data folders: pass another folder"
            )


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

    Step 1 trains at the setup's fixed LR (or ``lr=``). When it does not get there with the gradient path intact,
    the protocol's steps 2 and 3 (the step-0 loss, shapes and masks) run next, and only when they pass is the LR
    searched (step 4), then the capacity checked: the report holds every step that ran, in order.

    Pass ``trainer=`` (its batches, loss and optimizer class are used) or ``model=``, ``tokenizer=`` and
    ``dataset=`` (rows tokenized as TRL does; ``lora=`` a peft LoraConfig or dict to attach an adapter,
    ``optimizer=`` to use yours). The options (``n``, ``steps``, ``lr``, ``max_len``, ``loss_on``, ``format``)
    are those of :class:`~hf_sanity.protocol.options.ProtocolOptions`, given as ``options=`` or by name.
    ``plot=`` writes the loss curve as a PNG; ``with_plot`` attaches it to ``report.plots`` (for the HTML page)
    when matplotlib is installed. Nothing of the user's is modified: the model is deep-copied and the RNG
    states are restored.
    """
    from hf_sanity.protocol.render import ProtocolReport

    return run_protocol(
        ProtocolReport(title="hf-sanity overfit"), trainer=trainer, model=model, tokenizer=tokenizer,
        dataset=dataset, options=ProtocolOptions.of(options, **option_values), lora=lora, optimizer=optimizer,
        pipeline=pipeline, with_plot=with_plot, plot=plot, through="overfit",
    )  # fmt: skip


def diagnose(
    trainer=None,
    model=None,
    tokenizer=None,
    dataset=None,
    *,
    options: ProtocolOptions | None = None,
    lora=None,
    optimizer=None,
    repro: str | Path | None = None,
    write_repro: bool = True,
    with_plot: bool = True,
    pipeline: Pipeline | None = None,
    **option_values,
):
    """Run the five layers in order on the user's setup and stop at the first broken one.

    Takes the same setup and options as :func:`hf_sanity.protocol.overfit` (``trainer=`` or ``model=``/
    ``tokenizer=``/``dataset=``). When a layer is broken, its batch is saved as a reproduction into ``repro``
    (default: a fresh folder under ``./hf-sanity-repro/``) unless ``write_repro=False``. ``with_plot``: attach
    the loss curve and the LR sweep as PNGs to ``report.plots`` (when matplotlib is installed). Nothing of the
    user's is modified.
    """
    from hf_sanity.protocol.render import ProtocolReport

    return run_protocol(
        ProtocolReport(title="hf-sanity diagnose"), trainer=trainer, model=model, tokenizer=tokenizer,
        dataset=dataset, options=ProtocolOptions.of(options, **option_values), lora=lora, optimizer=optimizer,
        pipeline=pipeline, with_plot=with_plot, repro=repro, write_repro=write_repro, through="all",
    )  # fmt: skip


def run_protocol(
    report,
    *,
    trainer=None,
    model=None,
    tokenizer=None,
    dataset=None,
    options: ProtocolOptions,
    lora=None,
    optimizer=None,
    pipeline: Pipeline | None = None,
    with_plot: bool = True,
    plot=None,
    repro: str | Path | None = None,
    write_repro: bool = False,
    through: str = "all",
):
    """The protocol's layers in order, into ``report``, stopping at the first broken one. ``through``: ``all``
    (diagnose: every layer) or ``overfit`` (overfit: only as far as the overfit's own verdict needs: step 1,
    and when it is inconclusive steps 2 and 3, then step 4's LR search; no verdict on the configured LR, no
    precision, no reproduction)."""
    from hf_sanity.protocol.render import want_png
    from hf_sanity.untouched import preserved_rng

    started = time.perf_counter()
    state: dict[str, Any] = {
        "steps": options.steps, "with_plot": with_plot, "plot": plot, "through": through,
        "png": want_png(plot, with_plot),  # a --plot without matplotlib is bad input, before any work
    }  # fmt: skip
    checklist: list[dict[str, Any]] = []
    broken: tuple[Layer, Any] | None = None
    layers = LAYERS if through == "all" else LAYERS[:4]
    with preserved_rng():
        pipeline = build(
            pipeline, trainer=trainer, model=model, tokenizer=tokenizer, dataset=dataset, options=options,
            lora=lora, optimizer=optimizer,
        )  # fmt: skip
        if through == "all":
            check_repro_target(repro, pipeline.protected)
        report.stats["setup"] = {}  # first in the report, filled once the layers have run
        for layer in layers:
            if broken is not None:
                if through == "all":
                    checklist.append(_item(layer.number, layer.title, "skipped", f"not run: layer "
                                           f"{broken[0].number} ({broken[0].title}) is broken and this layer "
                                           "builds on it"))  # fmt: skip
                continue
            if through == "overfit" and layer.number > 1 and not pending_overfit(state):
                break  # the overfit's verdict is in: overfit runs no further
            broken_check: list = []
            findings, items = [], []
            shown = progress.phase(f"layer {layer.number} of {len(layers)}: {layer.title}")
            with shown, catalog.guard(f"diagnose layer {layer.number} ({layer.title})", broken_check):
                findings, items = layer.run(pipeline, report, state)
            if broken_check:  # a check that breaks is a finding, and the next layer still runs
                report.extend(broken_check)
                failure = broken_check[0].message.partition(" failed with ")[2]  # "Type: message"
                checklist.append(_item(layer.number, layer.title, "skipped", f"the check raised {failure}"))
                continue
            report.extend(findings)
            checklist.extend(items)
            errors = [f for f in findings if f.severity == "error"]
            if errors:
                # the overfit's verdict may come from step 4's search: it is layer 1's all the same
                broken = (LAYERS[0] if errors[0].rule == OVERFIT_FAILED.slug else layer, errors[0])
                run = state.get("overfit")
                if pending_overfit(state) and layer.number in (2, 3):
                    run.blocked_by = sorted({f.rule for f in errors})  # the LR is not searched past them
                    if through == "overfit":
                        report.extend(check_overfit(run))
                    report.stats["overfit"]["found_before_lr"] = run.blocked_by
    report.stats["setup"] = pipeline.describe()
    report.stats["checklist"] = checklist
    report.stats["seconds"] = round(time.perf_counter() - started, 2)
    if through == "all":
        verdict(report, broken, pipeline, repro, write_repro)
    return report


def verdict(report, broken, pipeline: Pipeline, repro, write_repro: bool) -> None:
    """diagnose's verdict: the broken layer and its cause (with the reproduction), or none broken."""
    checklist = report.stats["checklist"]
    if broken is None:
        report.stats["broken_layer"] = None
        counts = Counter(item["status"] for item in checklist)
        overfit = report.stats.get("overfit") or {}
        searched = (
            f"; the examples overfit at lr={overfit['lr']:.3g}, found by step 4 (not at the step-1 LR)"
            if overfit.get("passed") and overfit.get("lr_chosen_by") == "search"
            else ""
        )
        if counts["warning"] or counts["skipped"]:
            report.stats["verdict"] = (
                f"no layer is broken; {counts['warning']} checks warn and {counts['skipped']} were skipped "
                f"(see the checklist){searched}"
            )
        else:
            report.stats["verdict"] = (
                f"no layer is broken: all {len(checklist)} checks of the five layers pass"
            )
        return
    layer, finding = broken
    cause = finding.evidence.get("cause") or finding.rule
    report.stats["broken_layer"] = f"{layer.number}. {layer.title}"
    report.stats["cause"] = cause
    report.stats["verdict"] = f"broken at layer {layer.number} ({layer.title}): {finding.message}"
    if write_repro:
        from hf_sanity.protocol.repro import repro_folder, save_repro

        folder = repro_folder(repro, pipeline.protected)
        report.stats["repro"] = save_repro(
            pipeline,
            folder,
            layer=f"layer {layer.number} ({layer.title})",
            message=finding.message,
            cause=cause,
            measured={
                "rule": finding.rule,
                "evidence": finding.evidence,
                "layer_stats": layer.measured(report.stats),
            },
        )
