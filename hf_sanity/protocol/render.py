"""How `overfit` and `diagnose` reports look: in the terminal (the loss curve as a sparkline, the shape table,
the LR sweep, the precision table and the checklist, all drawn from ``report.stats``) and as PNG figures
(matplotlib's Agg canvas, no pyplot) that ``--plot`` writes and ``--html`` embeds through ``report.plots``."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from hf_sanity.numbers import fmt
from hf_sanity.report import Report, render_finding, write_atomic

BLOCKS = "▁▂▃▄▅▆▇█"
STATUS = {
    "passed": ("✓", "bold green"),
    "failed": ("✗", "bold red"),
    "warning": ("!", "bold yellow"),
    "skipped": ("–", "dim"),
}
SECTIONS = ("setup", "overfit", "init_loss", "shapes", "masks", "lr_range", "precision", "checklist", "repro")


def sparkline(values: Sequence[Any], width: int = 60) -> str:
    """The values as one line of block characters (non-finite values as ×), at most ``width`` wide."""
    points = [v if isinstance(v, (int, float)) else math.nan for v in values]
    if not points:
        return ""
    if len(points) > width:
        points = [points[round(i * (len(points) - 1) / (width - 1))] for i in range(width)]
    finite = [v for v in points if math.isfinite(v)]
    if not finite:
        return "×" * len(points)
    low, high = min(finite), max(finite)
    span = high - low or 1.0
    return "".join(
        BLOCKS[min(len(BLOCKS) - 1, int((v - low) / span * (len(BLOCKS) - 1) + 0.5))]
        if math.isfinite(v)
        else "×"
        for v in points
    )


@dataclass
class ProtocolReport(Report):
    """A report whose terminal form shows the protocol's measurements, not only its findings."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        counts = self.counts()
        style = "bold red" if counts["error"] else "bold yellow" if counts["warning"] else "bold green"
        yield Text(self.summary(), style=style)
        yield from self.rendered_notes()
        stats = self.stats
        if stats.get("verdict"):
            yield Text(stats["verdict"], style="bold red" if stats.get("broken_layer") else "bold green")
        for finding in self.ordered():
            yield Text()
            yield render_finding(finding)
        if "overfit" in stats:
            yield Text()
            yield overfit_text(stats["overfit"])
        if "init_loss" in stats:
            yield Text()
            yield init_loss_text(stats["init_loss"])
        if stats.get("shapes"):
            yield Text()
            yield shapes_table(stats["shapes"])
        if stats.get("masks"):
            yield masks_text(stats["masks"])
        if "lr_range" in stats:
            yield Text()
            yield lr_text(stats["lr_range"])
        if "precision" in stats:
            yield Text()
            yield precision_table(stats["precision"])
        if stats.get("checklist"):
            yield Text()
            yield checklist_table(stats["checklist"])
        if stats.get("repro"):
            yield Text()
            yield repro_text(stats["repro"])
        rest = {k: v for k, v in stats.items() if k not in SECTIONS and k not in ("verdict", "broken_layer")}
        if "setup" in stats:
            rest = {**{k: v for k, v in stats["setup"].items() if v is not None}, **rest}
        if rest:
            yield Text()
            yield Text("stats: " + ", ".join(f"{k}={fmt(v, 4)}" for k, v in rest.items()), style="dim")


def overfit_text(stats: dict[str, Any]) -> Text:
    text = Text("overfit  ", style="bold")
    searched = stats.get("lr_search")
    count = len(searched["tried"]) if searched else 0
    how = f" (searched: {count} LR{'s' if count != 1 else ''} tried)" if searched else ""
    text.append(f"loss on {stats['examples']} examples, lr={stats['lr']:.3g}{how}: ")
    text.append(fmt(stats["loss_start"], 4))
    text.append(f" {sparkline(stats['losses'])} ", style="cyan")
    text.append(fmt(stats["loss_final"], 4))
    reached = stats.get("reached_at_step")
    if reached is not None and stats.get("passed"):
        text.append(f"  near zero (≤ {stats['near_zero']}) at step {reached}", style="green")
    else:
        text.append(f"  not near zero (≤ {stats['near_zero']}) after {stats['steps_run']} steps", style="red")
    return text


def init_loss_text(stats: dict[str, Any]) -> Text:
    text = Text("step-0 loss  ", style="bold")
    if stats.get("loss") is None:
        text.append(stats.get("note", "not measured"), style="dim")
        return text
    text.append(
        f"{stats['loss']:.4g} nat/token on {stats['tokens']} tokens; chance ln(V)={stats['ln_vocab']:.4g}; "
        f"model entropy {stats['model_entropy']:.4g}"
    )
    return text


def shapes_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(
        title="shapes through the forward pass",
        title_justify="left",
        show_edge=False,
        header_style="bold",
        title_style="bold",
    )
    for column in ("module", "type", "input", "output", "dtype", "calls"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(
            row["module"], row["type"], row["input"], row["output"], row["dtype"], str(row["calls"])
        )
    return table


def masks_text(stats: dict[str, Any]) -> Text:
    text = Text("masks  ", style="bold")
    if "note" in stats:
        return text.append(stats["note"], style="dim")
    text.append(
        f"{stats['examples']} examples, {stats['tokens']} tokens, {stats['supervised_tokens']} carry loss; "
    )
    text.append(", ".join(stats["rules"]) if stats["rules"] else "no mask rule fired")
    return text


def lr_text(stats: dict[str, Any]) -> Text:
    text = Text("LR range  ", style="bold")
    text.append(f"{stats['lr_min']:.0e} … {stats['lr_max']:.0e}: ")
    text.append(sparkline(stats["losses"]), style="cyan")
    if stats.get("diverges_at") is not None:
        text.append(f"  diverges at {stats['diverges_at']:.1e}")
    else:
        text.append("  no divergence")
    if stats.get("suggested_lr") is not None:
        text.append(f"; suggested base LR {stats['suggested_lr']:.1e}", style="green")
    return text


def precision_table(stats: dict[str, Any]) -> Table:
    table = Table(
        title="precision: the same batch's loss",
        title_justify="left",
        show_edge=False,
        header_style="bold",
        title_style="bold",
    )
    for column in ("dtype", "loss", "difference", "tolerance", "verdict"):
        table.add_column(column)
    table.add_row("float32", fmt(stats["fp32"], 4), "", "", "reference")
    for dtype, row in stats["half"].items():
        symbol, style = STATUS[row["status"]]
        table.add_row(
            dtype,
            fmt(row["loss"], 4),
            fmt(row["difference"], 4),
            fmt(row["tolerance"], 4),
            Text(f"{symbol} {row['status']}", style=style),
        )
    for dtype, why in stats.get("skipped", {}).items():
        table.add_row(dtype, "", "", "", Text(f"– skipped: {why}", style="dim"))
    return table


def checklist_table(items: list[dict[str, Any]]) -> Table:
    table = Table(
        title="verification checklist",
        title_justify="left",
        show_edge=False,
        show_header=False,
        title_style="bold",
    )
    table.add_column("", no_wrap=True)
    table.add_column("layer", style="dim", no_wrap=True)
    table.add_column("check")
    table.add_column("measured", style="dim", overflow="fold")
    for item in items:
        symbol, style = STATUS.get(item["status"], ("?", ""))
        table.add_row(Text(symbol, style=style), str(item["layer"]), item["item"], item["detail"])
    return table


def repro_text(repro: dict[str, Any]) -> Text:
    text = Text("reproduction  ", style="bold")
    text.append(f"the batch is saved in {repro['folder']}\n")
    text.append("  run: ", style="dim")
    text.append(repro["command"])
    if repro.get("diagnose"):
        text.append("\n  again: ", style="dim")
        text.append(repro["diagnose"])
    return text


# -- figures ---------------------------------------------------------------------------------------
def want_png(path: str | Path | None, with_plot: bool = True) -> bool:
    """A PNG is drawn when a path asks for one (matplotlib then required) or, for ``report.plots``, when
    matplotlib is installed."""
    if path is not None:
        from hf_sanity.plots import require_matplotlib

        require_matplotlib()
        return True
    if not with_plot:
        return False
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width: float = 8, height: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _png(figure, path: str | Path | None) -> bytes:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png")
    if path is not None:
        write_atomic(path, buffer.getvalue())
    return buffer.getvalue()


def overfit_png(run, path: str | Path | None = None) -> bytes:
    """The loss on the overfit examples per step, with the near-zero line."""
    figure = _figure()
    ax = figure.subplots()
    steps = [i for i, x in enumerate(run.losses) if math.isfinite(x)]
    values = [run.losses[i] for i in steps]
    if values:
        ax.plot(steps, values, color="#1f77b4", linewidth=1.4, label="loss on the examples")
        if min(values) > 0:
            ax.set_yscale("log")
    ax.axhline(
        run.threshold, color="#2ca02c", linestyle="--", linewidth=1, label=f"near zero ({run.threshold:.3g})"
    )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nat/token)")
    how = " (searched)" if run.searched else ""
    ax.set_title(f"overfit {run.examples} examples, lr={run.lr:.3g}{how}", fontsize=10, loc="left")
    ax.legend(fontsize=8, loc="best")
    return _png(figure, path)


def lr_png(sweep, path: str | Path | None = None) -> bytes:
    """The LR range test: loss against learning rate (log), divergence and suggestion marked."""
    figure = _figure()
    ax = figure.subplots()
    pairs = [(lr, x) for lr, x in zip(sweep.lrs, sweep.losses) if math.isfinite(x)]
    if pairs:
        ax.plot([p[0] for p in pairs], [p[1] for p in pairs], color="#1f77b4", linewidth=1.4, label="loss")
    ax.set_xscale("log")
    i = sweep.divergence
    if i is not None:
        ax.axvline(sweep.lrs[i], color="#d62728", linestyle=":", label=f"diverges ({sweep.lrs[i]:.1e})")
    if sweep.suggestion is not None:
        ax.axvline(
            sweep.suggestion, color="#2ca02c", linestyle="--", label=f"suggested ({sweep.suggestion:.1e})"
        )
    if sweep.configured_lr:
        ax.axvline(
            sweep.configured_lr,
            color="#7f7f7f",
            linestyle="-.",
            label=f"configured ({sweep.configured_lr:.1e})",
        )
    ax.set_xlabel("learning rate")
    ax.set_ylabel("loss (nat/token)")
    ax.set_title("LR range test", fontsize=10, loc="left")
    ax.legend(fontsize=8, loc="best")
    return _png(figure, path)
