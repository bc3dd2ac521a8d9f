"""The per-class table of eval predictions (`doctor --predictions`): where an accuracy comes from.

One row per label: its support, the accuracy on its rows, how often the model predicted it, and what its
rows were most often mistaken for. A model that learned the prior shows one label predicted everywhere; a
leak shows perfect rows where people would hesitate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class ClassTable:
    rows: list[dict[str, Any]]  # measure.runs.class_table
    title: str = "per class"

    def data(self) -> dict[str, Any]:
        return {"kind": "per-class", "title": self.title, "rows": self.rows}

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table = Table(title=self.title, title_justify="left", header_style="bold", show_edge=False)
        for name, justify in (("label", "left"), ("support", "right"), ("accuracy", "right"),
                              ("predicted", "right"), ("most confused with", "left")):  # fmt: skip
            table.add_column(name, justify=justify, overflow="fold")
        for row in self.rows:
            confused = (
                f"{row['most_confused_with']} ({row['confused']})" if row["most_confused_with"] else "-"
            )
            style = "red" if row["accuracy"] == 0 else ""
            table.add_row(
                row["label"], str(row["support"]), Text(f"{row['accuracy']:.1%}", style=style),
                str(row["predicted"]), confused,
            )  # fmt: skip
        yield table
