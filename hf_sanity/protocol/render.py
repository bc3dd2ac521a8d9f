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
        if stats.get("overfit", {}).get("lr_search"):
            yield Text()
            yield search_text(stats["overfit"])
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
    """Step 1: the loss at the step-1 LR (the search's runs are step 4's, shown with it), its trajectory, near
    zero and the floor the data imposes."""
    first = stats.get("step1")
    losses = first["losses"] if first else stats["losses"]
    lr = first["lr"] if first else stats["lr"]
    how = " (given)" if stats["lr_chosen_by"] == "given" else " (the setup's step-1 LR)"
    text = Text("overfit  ", style="bold")
    text.append(f"loss on {stats['examples']} examples, lr={lr:.3g}{how}: ")
    text.append(fmt(losses[0], 4) if losses else "-")
    text.append(f" {sparkline(losses)} ", style="cyan")
    text.append(fmt(losses[-1], 4) if losses else "-")
    steps = len(losses) - 1
    reached = stats.get("reached_at_step")
    if first is None and reached is not None and stats.get("passed"):
        text.append(f"  near zero (≤ {stats['near_zero']}) at step {reached}", style="green")
    else:
        text.append(f"  not near zero (≤ {stats['near_zero']}) after {steps} steps", style="red")
    floor = stats.get("data_floor")
    if floor:
        text.append(
            f"\n  near zero is the data's floor {floor['nats']} + 0.05: {floor['positions']} of "
            f"{floor['supervised_tokens']} supervised positions follow an input identical to another's with a "
            f"different target ({floor['prefixes']} such inputs); no model can predict both",
            style="yellow",
        )
    if first is None:
        text.append(trajectory_text(stats.get("trajectory") or []))
    return text


def trajectory_text(points: list[list[Any]]) -> Text:
    text = Text("\n  ")
    text.append(" · ".join(f"step {step}: {fmt(loss, 4)}" for step, loss in points), style="dim")
    return text


def search_text(stats: dict[str, Any]) -> Text:
    """Step 4's overfit LR search (after steps 2 and 3 passed), and the capacity check."""
    search = stats["lr_search"]
    tried = search["tried"]
    text = Text("overfit LR search (step 4)  ", style="bold")
    lrs = [t["lr"] for t in tried]
    span = f"{min(lrs):.1e} … {max(lrs):.1e}" if len(lrs) > 1 else f"{lrs[0]:.1e}" if lrs else "-"
    text.append(
        f"{len(tried)} LR{'s' if len(tried) != 1 else ''} tried ({span}), reported lr={stats['lr']:.3g}: "
    )
    text.append(fmt(stats["loss_start"], 4))
    text.append(f" {sparkline(stats['losses'])} ", style="cyan")
    text.append(fmt(stats["loss_final"], 4))
    reached = stats.get("reached_at_step")
    if reached is not None and stats.get("passed"):
        text.append(f"  near zero (≤ {stats['near_zero']}) at step {reached}", style="green")
    else:
        text.append(f"  not near zero (≤ {stats['near_zero']}) at any LR tried", style="red")
    text.append(trajectory_text(stats.get("trajectory") or []))
    capacity = stats.get("capacity")
    if capacity:
        text.append(
            f"\n  capacity: {capacity['trainable_elements']:,} of {capacity['total_elements']:,} weights train "
            f"({capacity['held_back']}); ",
        )
        if "not_measured" in capacity:
            text.append(
                f"with every weight trainable: not measured ({capacity['not_measured']})", style="dim"
            )
        elif capacity["all_trainable_reached"]:
            text.append(
                f"with every weight trainable: near zero at lr={capacity['all_trainable_lr']:.3g} in "
                f"{capacity['all_trainable_steps']} steps",
                style="red",
            )
        elif stats.get("cause") == "capacity":
            text.append(
                f"with every weight trainable: {capacity['all_trainable_best_loss']} at "
                f"lr={capacity['all_trainable_lr']:.3g}: the share holds it back",
                style="red",
            )
        else:
            text.append(
                f"with every weight trainable: not near zero either (best {capacity['all_trainable_best_loss']})",
                style="yellow",
            )
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
