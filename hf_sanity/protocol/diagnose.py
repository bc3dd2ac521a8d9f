"""`diagnose()`: the ordered debugging protocol, cheapest and most decisive check first, stopping at the
first layer that is broken (an error finding):

1. overfit one batch (the gradient path);
2. the loss at initialization against chance;
3. shapes (every module's, via forward hooks) and masks (the preflight mask rules on the collated batch);
4. the learning rate (an LR range test);
5. numerical precision (float32 against bf16/fp16).

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
from hf_sanity.protocol.overfit import path_checklist, run_overfit
from hf_sanity.protocol.pipeline import Pipeline
from hf_sanity.selection import Selection

PROTOCOL = Selection()  # overfit and diagnose run every protocol rule


def _item(layer: int, text: str, status: str, detail: str) -> dict[str, Any]:
    return {"layer": layer, "item": text, "status": status, "detail": detail}


def _status(findings) -> str:
    severities = {f.severity for f in findings}
    return "failed" if "error" in severities else "warning" if "warning" in severities else "passed"


def layer_overfit(pipeline: Pipeline, report, options: dict) -> tuple[list, list]:
    from hf_sanity.protocol.render import overfit_png, want_png

    run, stats = run_overfit(pipeline, options["steps"])
    report.stats["overfit"] = stats
    if want_png(None, options["with_plot"]):
        report.plots["1. overfit: loss on the examples"] = overfit_png(run)
    return catalog.run_all("protocol", run, PROTOCOL), path_checklist(stats, layer=1)


def layer_init_loss(pipeline: Pipeline, report, options: dict) -> tuple[list, list]:
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


def layer_shapes_masks(pipeline: Pipeline, report, options: dict) -> tuple[list, list]:
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


def layer_lr(pipeline: Pipeline, report, options: dict) -> tuple[list, list]:
    from hf_sanity.protocol.render import lr_png, want_png
    from hf_sanity.protocol.steps import run_lr_range

    sweep, stats = run_lr_range(pipeline)
    report.stats["lr_range"] = stats
    findings = catalog.run_all("protocol", sweep, PROTOCOL)
    if want_png(None, options["with_plot"]) and sweep.lrs:
        report.plots["4. LR range test"] = lr_png(sweep)
    if stats["suggested_lr"] is None:
        detail = stats.get("error") or "the loss diverges from the first step"
        return findings, [_item(4, "an LR range with a stable base LR", "failed", detail)]
    where = f"diverges at {stats['diverges_at']:.1e}" if stats["diverges_at"] is not None else "no divergence"
    detail = f"{where}; suggested {stats['suggested_lr']:.1e}"
    if stats["configured_lr"]:
        detail += f"; configured {stats['configured_lr']:.1e}"
    return findings, [_item(4, "an LR range with a stable base LR", _status(findings), detail)]


def layer_precision(pipeline: Pipeline, report, options: dict) -> tuple[list, list]:
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
    run: Callable[[Pipeline, Any, dict], tuple[list, list]]
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
    from hf_sanity.untouched import preserved_rng

    started = time.perf_counter()
    opts = ProtocolOptions.of(options, **option_values)
    report = ProtocolReport(title="hf-sanity diagnose")
    run_options = {"steps": opts.steps, "with_plot": with_plot}
    checklist: list[dict[str, Any]] = []
    broken: tuple[Layer, Any] | None = None
    with preserved_rng():
        pipeline = build(
            pipeline, trainer=trainer, model=model, tokenizer=tokenizer, dataset=dataset, options=opts,
            lora=lora, optimizer=optimizer,
        )  # fmt: skip
        check_repro_target(repro, pipeline.protected)
        report.stats["setup"] = {}  # first in the report, filled once the layers have run
        for layer in LAYERS:
            if broken is not None:
                checklist.append(
                    _item(
                        layer.number,
                        layer.title,
                        "skipped",
                        f"not run: layer {broken[0].number} ({broken[0].title}) is broken and this layer builds on it",
                    )
                )
                continue
            broken_check: list = []
            findings, items = [], []
            shown = progress.phase(f"layer {layer.number} of {len(LAYERS)}: {layer.title}")
            with shown, catalog.guard(f"diagnose layer {layer.number} ({layer.title})", broken_check):
                findings, items = layer.run(pipeline, report, run_options)
            if broken_check:  # a check that breaks is a finding, and the next layer still runs
                report.extend(broken_check)
                failure = broken_check[0].message.partition(" failed with ")[2]  # "Type: message"
                checklist.append(_item(layer.number, layer.title, "skipped", f"the check raised {failure}"))
                continue
            report.extend(findings)
            checklist.extend(items)
            errors = [f for f in findings if f.severity == "error"]
            if errors:
                broken = (layer, errors[0])
    report.stats["setup"] = pipeline.describe()
    report.stats["checklist"] = checklist
    if broken is None:
        report.stats["broken_layer"] = None
        counts = Counter(item["status"] for item in checklist)
        if counts["warning"] or counts["skipped"]:
            report.stats["verdict"] = (
                f"no layer is broken; {counts['warning']} checks warn and {counts['skipped']} were skipped "
                "(see the checklist)"
            )
        else:
            report.stats["verdict"] = (
                f"no layer is broken: all {len(checklist)} checks of the five layers pass"
            )
    else:
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
    report.stats["seconds"] = round(time.perf_counter() - started, 2)
    return report
