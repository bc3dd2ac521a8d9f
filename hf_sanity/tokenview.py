"""The token view: one tokenized example the way a person debugs it.

Each token decoded back to text, with its id and whether it carries loss (label != -100). It is the
"print the exact tensor entering the model and decode it" check, automated, and it is attached to every
mask-related finding. A *detailed* view (``from_ids(..., detailed=True)``: `hf-sanity show`, the decoded
batch) shows every position of a batch row with its attention mask, its position id, its label and what
its logits are trained to predict (the label of the next position: transformers shifts the labels inside
the model), and marks padding and where packed sequences start.
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
PAD_STYLE = "dim strike"
BOUNDARY = "‖"  # where a packed sequence starts (its position id is 0)
BOUNDARY_STYLE = "bold magenta"


# The placeholder tokens a VLM processor repeats once per image feature (LLaVA, Qwen2-VL, Gemma 3, Idefics3):
# shown folded, ``<image>×16``.
PLACEHOLDER_TEXTS = frozenset(
    {"<image>", "<video>", "<|image_pad|>", "<|video_pad|>", "<image_soft_token>", "<image_token>"}
)


@dataclass(frozen=True)
class TokenCell:
    pos: int
    id: int
    text: str
    loss: bool | None  # None: no labels were given
    # A detailed view's: the attention mask (None: no mask), the position id (None: none given), the label,
    # and the text of the label the logits at this position are trained to predict (the next position's).
    attention: int | None = None
    position: int | None = None
    label: int | None = None
    predicts: str | None = None

    @property
    def padding(self) -> bool:
        return self.attention == 0

    @property
    def starts_sequence(self) -> bool:
        """A packed sequence starts here: its position id is 0 past the row's first position (not padding)."""
        return self.position == 0 and self.pos > 0 and not self.padding


def _decode(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


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
    detailed: bool = False  # every position, with its attention, position id, label and prediction target

    @classmethod
    def from_ids(
        cls,
        tokenizer,
        input_ids: Sequence[int],
        labels: Sequence[int] | None = None,
        *,
        focus: int | None = None,
        window: int | None = 48,
        title: str = "",
        attention_mask: Sequence[int] | None = None,
        cut: int | None = None,
        position_ids: Sequence[int] | None = None,
        detailed: bool = False,
    ) -> TokenView:
        """The view of ``input_ids`` (at most ``window`` tokens around ``focus``; None: all of them). Padding
        at the end (``attention_mask`` 0) is left out, unless ``detailed``: then every position is shown as
        the model gets it, with its attention, position id, label and prediction target."""
        ids = [int(i) for i in input_ids]
        total = len(ids)
        window = total if window is None else window
        if focus is None or not 0 <= focus < total:
            focus = None
            start = max(0, total - window) if total > window else 0
        else:
            start = min(max(0, focus - window // 2), max(0, total - window))
        stop = min(total, start + window)
        if attention_mask is not None and not detailed:  # padding is noise in a view
            while (
                stop > start + 1
                and int(attention_mask[stop - 1]) == 0
                and (focus is None or stop - 1 > focus)
            ):
                stop -= 1

        def extra(pos: int) -> dict:
            if not detailed:
                return {}
            label = int(labels[pos]) if labels is not None else None
            after = int(labels[pos + 1]) if labels is not None and pos + 1 < total else IGNORE_INDEX
            return {
                "attention": int(attention_mask[pos]) if attention_mask is not None else None,
                "position": int(position_ids[pos]) if position_ids is not None else None,
                "label": label,
                "predicts": None if after == IGNORE_INDEX else escape(_decode(tokenizer, after)),
            }

        cells = tuple(
            TokenCell(
                pos=pos,
                id=ids[pos],
                text=escape(_decode(tokenizer, ids[pos])),
                loss=None if labels is None else int(labels[pos]) != IGNORE_INDEX,
                **extra(pos),
            )
            for pos in range(start, stop)
        )
        return cls(
            cells=cells, total=total, title=title, focus=focus, cut=cut if cut and cut < total else None,
            detailed=detailed,
        )  # fmt: skip

    @property
    def span(self) -> str:
        if not self.cells:
            return "no tokens"
        return f"tokens {self.cells[0].pos}-{self.cells[-1].pos} of {self.total}"

    def collapsed(self) -> list[tuple[TokenCell, str]]:
        """The cells as they are read, each run of one image placeholder (a VLM's expanded picture) folded into
        its first cell as ``<image>×16``; every other cell as it is."""
        out: list[tuple[TokenCell, str]] = []
        run = 0
        for cell in self.cells:
            previous = out[-1][0] if out else None
            same = previous is not None and cell.text in PLACEHOLDER_TEXTS and cell.id == previous.id
            if same and cell.loss == previous.loss and cell.pos != self.cut and cell.pos != self.focus:
                run += 1
                out[-1] = (previous, f"{previous.text}×{run}")
                continue
            run = 1
            out.append((cell, cell.text))
        return out

    def segments(self) -> list[tuple[str, bool | None]]:
        """Consecutive cells merged by loss flag: the text as the model reads it (image placeholder runs
        folded, ``<image>×16``)."""
        out: list[tuple[str, bool | None]] = []
        for cell, text in self.collapsed():
            if out and out[-1][1] == cell.loss:
                out[-1] = (out[-1][0] + text, cell.loss)
            else:
                out.append((text, cell.loss))
        return out

    def columns(self) -> tuple[str, ...]:
        """The extra columns of a detailed view: those its cells carry."""
        if not self.detailed:
            return ()
        out = []
        if any(c.attention is not None for c in self.cells):
            out.append("attn")
        if any(c.position is not None for c in self.cells):
            out.append("pos_id")
        if any(c.label is not None for c in self.cells):
            out += ["label", "predicts"]
        return tuple(out)

    def _extra(self, cell: TokenCell) -> dict[str, str]:
        return {
            "attn": "" if cell.attention is None else str(cell.attention),
            "pos_id": "" if cell.position is None else str(cell.position),
            "label": "" if cell.label is None else str(cell.label),
            "predicts": "" if cell.predicts is None else f"-> {cell.predicts}",
        }

    def plain(self) -> str:
        """Plain text for JSON and logs: supervised spans in ⟦ ⟧, then one row per token."""
        if self.detailed:
            return self._plain_detailed()
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

    def _plain_detailed(self) -> str:
        """Every position: padding runs folded in the text (``[12 x pad]``), ``‖`` where a packed sequence
        starts; then one row per position with its extra columns."""
        head = f"{self.title}: " if self.title else ""
        lines = [
            f"{head}{self.span} (⟦…⟧ carries loss, [n x pad] attention 0, {BOUNDARY} a packed sequence starts)"
        ]
        inline, run = [], 0
        for cell, shown in self.collapsed():
            if cell.padding:
                run += 1
                continue
            if run:
                inline.append(f"[{run} x pad]")
                run = 0
            text = f"⟦{shown}⟧" if cell.loss else shown
            inline.append((BOUNDARY if cell.starts_sequence else "") + text)
        if run:
            inline.append(f"[{run} x pad]")
        lines.append("  " + "".join(inline).replace("⟧⟦", ""))
        extra = self.columns()
        widths = {"attn": 4, "pos_id": 6, "label": 7, "predicts": 0}
        header = f"  {'pos':>5} {'id':>7}" + "".join(f" {c:>{widths[c]}}" for c in extra if c != "predicts")
        lines.append(header + "  loss  token" + ("  predicts" if "predicts" in extra else ""))
        for cell in self.cells:
            if cell.starts_sequence:
                lines.append(f"  {'':>5} {'':>7}  {BOUNDARY} a packed sequence starts (position id 0)")
            values = self._extra(cell)
            row = f"  {cell.pos:>5} {cell.id:>7}" + "".join(
                f" {values[c]:>{widths[c]}}" for c in extra if c != "predicts"
            )
            mark = "pad " if cell.padding else {True: " yes", False: "  - ", None: "  ? "}[cell.loss]
            tail = f"  {values['predicts']}" if "predicts" in extra and values["predicts"] else ""
            lines.append(f"{row}  {mark}  {cell.text}{tail}")
        return "\n".join(lines)

    def _table_cells(self, rows: int = 8) -> tuple[TokenCell, ...]:
        """The terminal shows every token inline, and ids for the few around the focus (or the end); a
        detailed view, every position."""
        if self.detailed:
            return self.cells
        if self.focus is None:
            return self.cells[-rows:]
        at = next(i for i, cell in enumerate(self.cells) if cell.pos == self.focus)
        lo = max(0, min(at - rows // 2, len(self.cells) - rows))
        return self.cells[lo : lo + rows]

    def inline_text(self) -> Text:
        text = Text()
        if self.cells and self.cells[0].pos > 0:
            text.append("…", NO_LOSS_STYLE)
        for cell, shown in self.collapsed():
            if cell.pos == self.cut:
                text.append(f"✂max_len={self.cut}✂", "bold red")
            if cell.starts_sequence:
                text.append(BOUNDARY, BOUNDARY_STYLE)
            text.append(shown, self._style(cell))
        if self.cells and self.cells[-1].pos < self.total - 1:
            text.append("…", NO_LOSS_STYLE)
        return text

    def _style(self, cell: TokenCell) -> str:
        if cell.pos == self.focus:
            return FOCUS_STYLE
        if cell.padding:
            return PAD_STYLE
        return LOSS_STYLE if cell.loss else NO_LOSS_STYLE

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        head = f"{self.title}: " if self.title else ""
        legend = Text(f"{head}{self.span}  ")
        legend.append(" loss ", LOSS_STYLE)
        legend.append(" ")
        legend.append(" no loss ", NO_LOSS_STYLE)
        if self.detailed and any(c.padding for c in self.cells):
            legend.append(" ")
            legend.append(" padding ", PAD_STYLE)
        if any(c.starts_sequence for c in self.cells):
            legend.append(f" {BOUNDARY} ", BOUNDARY_STYLE)
            legend.append("a packed sequence starts")
        yield legend
        yield self.inline_text()
        extra = [c for c in self.columns() if c != "predicts"]
        table = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
        names = [
            ("pos", "right"),
            ("id", "right"),
            *((c, "right") for c in extra),
            ("loss", "center"),
            ("token", "left"),
        ]
        if "predicts" in self.columns():
            names.append(("predicts", "left"))
        for name, justify in names:
            table.add_column(name, justify=justify)
        blank = [""] * (len(names) - 1)
        for cell in self._table_cells():
            if cell.pos == self.cut:
                table.add_row(
                    *blank[: 3 + len(extra)], Text(f"max_len={self.cut}: the rest is cut", style="bold red")
                )
            if cell.starts_sequence:
                table.add_row(
                    *blank[: 3 + len(extra)],
                    Text(f"{BOUNDARY} a packed sequence starts", style=BOUNDARY_STYLE),
                )
            values = self._extra(cell)
            mark = "pad" if cell.padding else {True: "yes", False: "-", None: "?"}[cell.loss]
            row = [
                str(cell.pos),
                str(cell.id),
                *(values[c] for c in extra),
                mark,
                Text(cell.text, style=self._style(cell)),
            ]
            if "predicts" in self.columns():
                row.append(values["predicts"])
            table.add_row(*row)
        yield table
