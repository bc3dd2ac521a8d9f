"""The side-by-side view: a prompt, what the model generated for it, and the reference answer (and the base
model's generation), the way a person reads a model's outputs. Attached to every `outputs` finding: the
terminal shows the first example as columns, JSON carries every example as plain text and as fields, HTML as
tables; the substrings a finding is about (stray markers, the copied prompt) are highlighted."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

MARK_STYLE = "bold white on red"
TERMINAL_CHARS = 320  # characters of each column the terminal shows
FULL_CHARS = 2000  # characters of each column kept for JSON and HTML


@dataclass(frozen=True)
class OutputExample:
    """One prompt: ``columns`` are (label, text) pairs, e.g. ("prompt", ...), ("generation", ...),
    ("reference", ...); ``note`` says how the generation ended; ``marks`` are substrings to highlight."""

    row: int
    columns: tuple[tuple[str, str], ...]
    note: str = ""
    marks: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, row: int, columns: Iterable[tuple[str, str | None]], *, note: str = "", marks=()
    ) -> OutputExample:
        kept = tuple((label, _cut(text, FULL_CHARS)) for label, text in columns if text is not None)
        return cls(int(row), kept, note, tuple(m for m in marks if m))

    def segments(self, text: str) -> list[tuple[str, bool]]:
        """``text`` split into (piece, is a highlighted substring)."""
        if not self.marks:
            return [(text, False)]
        pattern = re.compile("|".join(re.escape(m) for m in sorted(set(self.marks), key=len, reverse=True)))
        out, at = [], 0
        for match in pattern.finditer(text):
            if match.start() > at:
                out.append((text[at : match.start()], False))
            out.append((match.group(), True))
            at = match.end()
        if at < len(text):
            out.append((text[at:], False))
        return out

    @property
    def caption(self) -> str:
        return f"row {self.row}" + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class OutputView:
    """The examples of one finding, side by side; the terminal shows the first ``shown`` of them."""

    title: str
    examples: tuple[OutputExample, ...]
    shown: int = 1

    def data(self) -> list[dict[str, object]]:
        """Every example as a mapping (row, each column, note), for the JSON report."""
        return [
            {"row": e.row, **dict(e.columns), **({"note": e.note} if e.note else {})} for e in self.examples
        ]

    def plain(self) -> str:
        lines = [f"{self.title}: {len(self.examples)} example{'s' if len(self.examples) != 1 else ''}"]
        for example in self.examples:
            lines.append(f"  {example.caption}")
            for label, text in example.columns:
                lines.append(f"    {label}:")
                lines += [f"      {line}" for line in text.splitlines() or [""]]
        return "\n".join(lines)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for example in self.examples[: self.shown]:
            yield Text(f"{self.title}: {example.caption}", style="dim")
            table = Table(padding=(0, 1), header_style="bold", expand=False)
            width = max(16, (options.max_width - 4) // max(len(example.columns), 1) - 3)
            for label, _ in example.columns:
                table.add_column(label, overflow="fold", max_width=width, vertical="top")
            cells = []
            for _, text in example.columns:
                cell = Text()
                for piece, marked in example.segments(_cut(text, TERMINAL_CHARS)):
                    cell.append(piece, MARK_STYLE if marked else None)
                cells.append(cell)
            table.add_row(*cells)
            yield table
        hidden = len(self.examples) - self.shown
        if hidden > 0:
            yield Text(
                f"{hidden} more example{'s' if hidden != 1 else ''} in the JSON and HTML reports", style="dim"
            )


EXAMPLES = 3  # examples a finding keeps


def side_by_side(gens, title: str, samples, *, marks=None, base: bool = False) -> OutputView:
    """The first offending ``samples`` of ``gens`` (a `measure.generate.Generations`) side by side: prompt,
    generation (special tokens shown), reference, and the base model's generation with ``base``; ``marks``:
    a function of a sample giving the substrings to highlight."""
    examples = []
    for sample in list(samples)[:EXAMPLES]:
        columns = [("prompt", sample.prompt), ("generation", sample.raw), ("reference", sample.reference)]
        if base:
            columns.append(("base model", sample.base_text))
        examples.append(
            OutputExample.of(
                sample.row, columns, note=ending(gens, sample), marks=marks(sample) if marks else ()
            )
        )
    return OutputView(title, tuple(examples))


def ending(gens, sample) -> str:
    """How a generation ended, in words."""
    if sample.stopped:
        token = gens.token_names.get(sample.ids[-1], str(sample.ids[-1]))
        return f"stopped on {token} after {len(sample.ids)} tokens"
    return f"no {gens.expected_stop} in {gens.max_new_tokens} tokens: max_new_tokens reached"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
