"""The curves of runs as one PNG, with every finding marked at its step: people read a curve faster than
a table. matplotlib's Agg canvas is used directly (no pyplot, no global state, no display needed)."""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

from hf_sanity.errors import UserInputError
from hf_sanity.findings import Finding
from hf_sanity.measure.curves import Curves
from hf_sanity.report import write_atomic

SEVERITY_COLOR = {"error": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserInputError(
            "--plot needs matplotlib: pip install matplotlib (or pip install 'hf-sanity[dev]')"
        ) from None


def _finite_pairs(steps: Sequence[int], values: Sequence[float]) -> tuple[list[int], list[float]]:
    pairs = [(s, v) for s, v in zip(steps, values) if isinstance(v, (int, float)) and math.isfinite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def plot_runs(
    runs: Sequence[tuple[str, Curves, Sequence[Finding]]],
    path: str | Path | None,
    *,
    notes: Sequence[Finding] = (),
) -> bytes:
    """One panel per run: train loss, eval loss, the learning rate on a twin axis, and each finding as a
    vertical line at its step (findings without a step are listed in the panel's corner). ``notes`` are
    findings about all runs together, written under the panels. Returns the PNG, also written atomically to
    ``path`` when given."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = max(1, len(runs))
    lines = [
        line
        for f in notes
        for line in textwrap.wrap(f"{f.severity} {f.rule}: {f.message}", 140, subsequent_indent="    ")
    ]
    footer = 0.2 + 0.16 * len(lines) if lines else 0.0  # inches
    figure = Figure(figsize=(10, 3.6 * rows + footer), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, 1, squeeze=False)[:, 0]
    for ax, (label, curves, findings) in zip(axes, runs):
        _panel(ax, label, curves, findings)
    if lines:
        figure.text(0.01, 0.05 / figure.get_figheight(), "\n".join(lines), fontsize=8, va="bottom",
                    ha="left", family="monospace")  # fmt: skip
    figure.tight_layout(rect=(0, footer / figure.get_figheight(), 1, 1))
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    if path is not None:
        write_atomic(path, buffer.getvalue())
    return buffer.getvalue()


def _panel(ax, label: str, curves: Curves, findings: Sequence[Finding]) -> None:
    ax.set_title(label, fontsize=10, loc="left")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    handles = []
    steps, loss = _finite_pairs(curves.train_steps, curves.train_loss)
    if loss:
        handles += ax.plot(steps, loss, color="#1f77b4", linewidth=1, label="train loss")
    esteps, eloss = _finite_pairs(curves.eval_steps, curves.eval_loss)
    if eloss:
        handles += ax.plot(esteps, eloss, color="#2ca02c", marker="o", markersize=3, linewidth=1.2,
                           label="eval loss")  # fmt: skip
    lsteps, lr = _finite_pairs(curves.train_steps, curves.lr)
    if lr:
        twin = ax.twinx()
        handles += twin.plot(lsteps, lr, color="#7f7f7f", linestyle="--", linewidth=1, label="learning rate")
        twin.set_ylabel("learning rate", color="#7f7f7f")
        twin.tick_params(axis="y", colors="#7f7f7f")
        twin.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    left, right = ax.get_xlim()
    placed = 0
    unplaced = []
    for finding in findings:
        color = SEVERITY_COLOR.get(finding.severity, "black")
        if finding.step is None:
            unplaced.append(finding)
            continue
        ax.axvline(finding.step, color=color, linestyle=":", linewidth=1.2)
        on_right = right > left and (finding.step - left) / (right - left) > 0.7  # label inwards
        ax.annotate(
            finding.rule,
            xy=(finding.step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-3 if on_right else 3, -10 - 11 * (placed % 4)),
            textcoords="offset points",
            ha="right" if on_right else "left",
            fontsize=8,
            color=color,
        )
        placed += 1
    if unplaced:
        ax.text(
            0.99, 0.97, "\n".join(f"{f.severity}: {f.rule}" for f in unplaced),
            transform=ax.transAxes, ha="right", va="top", fontsize=8,
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8, "edgecolor": "#cccccc"},
        )  # fmt: skip
    if not findings:
        ax.text(0.99, 0.97, "no findings", transform=ax.transAxes, ha="right", va="top", fontsize=8,
                color="#2ca02c")  # fmt: skip
    if handles:
        ax.legend(handles=handles, loc="best", fontsize=8, framealpha=0.8)
