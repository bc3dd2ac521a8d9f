"""The token view: one tokenized example the way a person debugs it.

Each token decoded back to text, with its id and whether it carries loss (label != -100). It is the
"print the exact tensor entering the model and decode it" check, automated, and it is attached to every
mask-related finding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from hf_sanity.constants import IGNORE_INDEX

LOSS_STYLE = "bold black on green"
NO_LOSS_STYLE = "grey50"
FOCUS_STYLE = "bold white on red"


@dataclass(frozen=True)
class TokenCell:
    pos: int
    id: int
    text: str
    loss: bool | None  # None: no labels were given


def escape(text: str) -> str:
    """Make whitespace visible, as a debugger would show it."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


@dataclass(frozen=True)
class TokenView:
    """A window of one example's tokens (at most ``window`` of them, around ``focus``)."""

    cells: tuple[TokenCell, ...]
    total: int
    title: str = ""
    focus: int | None = None
    cut: int | None = None  # max_len: tokens from here on are truncated away

    @classmethod
    def from_ids(
        cls,
        tokenizer,
        input_ids: Sequence[int],
        labels: Sequence[int] | None = None,
        *,
        focus: int | None = None,
        window: int = 48,
        title: str = "",
        attention_mask: Sequence[int] | None = None,
        cut: int | None = None,
    ) -> TokenView:
        ids = [int(i) for i in input_ids]
        total = len(ids)
        if focus is None or not 0 <= focus < total:
            focus = None
            start = max(0, total - window) if total > window else 0
        else:
            start = min(max(0, focus - window // 2), max(0, total - window))
        stop = min(total, start + window)
        if attention_mask is not None:  # padding is noise in a view
            while (
                stop > start + 1
                and int(attention_mask[stop - 1]) == 0
                and (focus is None or stop - 1 > focus)
            ):
                stop -= 1
        cells = tuple(
            TokenCell(
                pos=pos,
                id=ids[pos],
                text=escape(tokenizer.decode([ids[pos]], skip_special_tokens=False)),
                loss=None if labels is None else int(labels[pos]) != IGNORE_INDEX,
            )
            for pos in range(start, stop)
        )
        return cls(
            cells=cells, total=total, title=title, focus=focus, cut=cut if cut and cut < total else None
        )

    @property
    def span(self) -> str:
        if not self.cells:
            return "no tokens"
        return f"tokens {self.cells[0].pos}-{self.cells[-1].pos} of {self.total}"

    def segments(self) -> list[tuple[str, bool | None]]:
        """Consecutive cells merged by loss flag: the text as the model reads it."""
        out: list[tuple[str, bool | None]] = []
        for cell in self.cells:
            if out and out[-1][1] == cell.loss:
                out[-1] = (out[-1][0] + cell.text, cell.loss)
            else:
                out.append((cell.text, cell.loss))
        return out

    def plain(self) -> str:
        """Plain text for JSON and logs: supervised spans in ⟦ ⟧, then one row per token."""
        head = f"{self.title}: " if self.title else ""
        lines = [f"{head}{self.span} (⟦…⟧ carries loss)"]
        inline = "".join(f"⟦{text}⟧" if loss else text for text, loss in self.segments())
        prefix = "…" if self.cells and self.cells[0].pos > 0 else ""
        suffix = "…" if self.cells and self.cells[-1].pos < self.total - 1 else ""
        lines.append(f"  {prefix}{inline}{suffix}")
        lines.append(f"  {'pos':>5} {'id':>7}  loss  token")
        for cell in self.cells:
            if cell.pos == self.cut:
                lines.append(f"  {'':>5} {'':>7}  ----  max_len={self.cut}: the rest is cut")
            mark = {True: " yes", False: "  - ", None: "  ? "}[cell.loss]
            arrow = "  <-" if cell.pos == self.focus else ""
            lines.append(f"  {cell.pos:>5} {cell.id:>7}  {mark}  {cell.text}{arrow}")
        return "\n".join(lines)

    def _table_cells(self, rows: int = 8) -> tuple[TokenCell, ...]:
        """The terminal shows every token inline, and ids for the few around the focus (or the end)."""
        if self.focus is None:
            return self.cells[-rows:]
        at = next(i for i, cell in enumerate(self.cells) if cell.pos == self.focus)
        lo = max(0, min(at - rows // 2, len(self.cells) - rows))
        return self.cells[lo : lo + rows]

    def inline_text(self) -> Text:
        text = Text()
        if self.cells and self.cells[0].pos > 0:
            text.append("…", NO_LOSS_STYLE)
        for cell in self.cells:
            if cell.pos == self.cut:
                text.append(f"✂max_len={self.cut}✂", "bold red")
            style = FOCUS_STYLE if cell.pos == self.focus else LOSS_STYLE if cell.loss else NO_LOSS_STYLE
            text.append(cell.text, style)
        if self.cells and self.cells[-1].pos < self.total - 1:
            text.append("…", NO_LOSS_STYLE)
        return text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        head = f"{self.title}: " if self.title else ""
        legend = Text(f"{head}{self.span}  ")
        legend.append(" loss ", LOSS_STYLE)
        legend.append(" ")
        legend.append(" no loss ", NO_LOSS_STYLE)
        yield legend
        yield self.inline_text()
        table = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
        for name, justify in (("pos", "right"), ("id", "right"), ("loss", "center"), ("token", "left")):
            table.add_column(name, justify=justify)
        for cell in self._table_cells():
            if cell.pos == self.cut:
                table.add_row("", "", "", Text(f"max_len={self.cut}: the rest is cut", style="bold red"))
            style = FOCUS_STYLE if cell.pos == self.focus else LOSS_STYLE if cell.loss else NO_LOSS_STYLE
            mark = {True: "yes", False: "-", None: "?"}[cell.loss]
            table.add_row(str(cell.pos), str(cell.id), mark, Text(cell.text, style=style))
        yield table
