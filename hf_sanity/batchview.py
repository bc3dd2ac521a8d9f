"""The decoded batch: the exact tensors a trainer feeds its model, every position of every row shown.

"Print the exact tensor entering the model, immediately before the forward pass. Decode it back to text."
Each row is a detailed :class:`~hf_sanity.tokenview.TokenView`: every token with its id, its attention mask,
its position id, its label, whether it carries loss and what the logits at its position are trained to
predict (transformers shifts the labels inside the model: the label of the next position). Padding
(attention 0) and the starts of packed sequences (position id 0) are marked, and the batch says how its
labels are shifted. `hf-sanity show`, `preflight --show N` and `SanityCallback(show_first_batch=True)` render
it in the terminal, the JSON (``views``) and the HTML page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.tokenview import TokenView

SHIFTS = {
    "in-model": "labels are the input ids (-100 where no loss): the model shifts them, so the logits at position t "
    "are trained to predict the label at t+1 (the `predicts` column)",
    "pre-shifted": "labels are already shifted (the label at t is the input at t+1): a transformers causal LM shifts "
    "them again, so position t is trained to predict the token at t+2 (see labels-misaligned)",
    "other": "labels differ from the input ids (another target sequence): position t is trained to predict the "
    "label at t+1",
    "none": "no labels: nothing in this batch carries loss as given (the trainer's compute_loss may build them, "
    "a reward model scores the whole sequence)",
}


def label_shift(rows: Sequence[tuple[Sequence[int], Sequence[int] | None]]) -> str:
    """How a batch's labels line up with its inputs (see :data:`SHIFTS`), from their supervised positions."""
    same = following = supervised = 0
    for ids, labels in rows:
        if labels is None:
            continue
        for t, label in enumerate(labels):
            if label == IGNORE_INDEX:
                continue
            supervised += 1
            same += label == ids[t]
            following += t + 1 < len(ids) and label == ids[t + 1]
    if not supervised:
        return "none"
    if same >= following and same >= supervised / 2:
        return "in-model"
    return "pre-shifted" if following >= supervised / 2 else "other"


def _row_summary(view: TokenView, row: int) -> dict[str, Any]:
    cells = view.cells
    padded = [c.pos for c in cells if c.padding]
    real = [c.pos for c in cells if not c.padding]
    side = None
    if padded and real:
        side = "left" if padded[0] < real[0] else "right" if padded[-1] > real[-1] else "inside"
    return {
        "row": row,
        "positions": view.total,
        "padding": len(padded),
        "padding_side": side,
        "with_loss": sum(bool(c.loss) for c in cells if not c.padding),
        "sequences": [0, *(c.pos for c in cells if c.starts_sequence)] if cells else [],
    }


@dataclass
class BatchView:
    rows: list[TokenView]
    summaries: list[dict[str, Any]]
    shapes: dict[str, list[int]]
    shift: str
    source: str = ""
    title: str = "the decoded batch"
    notes: list[str] = field(default_factory=list)
    # Which tokens the rows' labels put in the loss and what decided it (`measure.loss_mask`), where the view
    # tokenized the rows itself (a trainer's batch carries its own labels).
    loss_mask: dict[str, str] | None = None

    @classmethod
    def from_batch(
        cls, tokenizer, batch: Mapping[str, Any], *, rows: Sequence[int] | None = None, source: str = "",
        title: str = "the decoded batch", names: Sequence[str] | None = None,
    ) -> BatchView:  # fmt: skip
        """The view of a collated batch (tensors: ``input_ids`` and what else it has), rows ``rows`` of it
        (default: every row); ``names``: what each shown row is (default ``row N`` of the batch)."""
        from hf_sanity.measure.batches import attended

        ids = batch["input_ids"]
        count = int(ids.shape[0])
        rows = list(range(count)) if rows is None else [r for r in rows if 0 <= r < count]
        labels, mask, positions = batch.get("labels"), batch.get("attention_mask"), batch.get("position_ids")
        notes = []
        completion = batch.get("completion_mask")
        if labels is None and hasattr(completion, "shape") and completion.shape == ids.shape:
            # TRL's preference collators: no labels, the loss (log-probabilities) is taken where this is 1
            labels = ids.masked_fill(completion == 0, IGNORE_INDEX)
            notes.append(
                "no labels: the loss positions are completion_mask's (the trainer's loss reads them)"
            )
        if positions is not None and positions.shape[0] != count:  # one row of position ids for every row
            positions = positions.expand(count, -1)
        views, summaries, pairs = [], [], []
        for k, r in enumerate(rows):
            row_ids = ids[r].tolist()
            row_labels = (
                labels[r].tolist() if hasattr(labels, "shape") and labels.shape == ids.shape else None
            )
            row_mask = [int(m) for m in attended(mask, r)] if mask is not None else None
            view = TokenView.from_ids(
                tokenizer, row_ids, row_labels, window=None, attention_mask=row_mask, detailed=True,
                position_ids=positions[r].tolist() if positions is not None else None, title=f"row {r}",
            )  # fmt: skip
            summary = _row_summary(view, r)
            summary["name"] = names[k] if names is not None and k < len(names) else f"row {r}"
            views.append(_titled(view, summary))
            summaries.append(summary)
            pairs.append((row_ids, row_labels))
        shapes = {k: [int(d) for d in v.shape] for k, v in batch.items() if hasattr(v, "shape")}
        if mask is not None and mask.dim() == 4:
            notes.append("attention_mask is 4-D (the collator's own): a position is shown as attended when it may "
                         "attend to itself")  # fmt: skip
        return cls(views, summaries, shapes, label_shift(pairs), source=source, title=title, notes=notes)

    def headline(self) -> str:
        shape = "x".join(map(str, self.shapes.get("input_ids", [])))
        return f"{self.title}: {', '.join(s['name'] for s in self.summaries)} (input_ids {shape})"

    def data(self) -> dict[str, Any]:
        rows = [
            {**summary, "tokens": [_token(c) for c in view.cells]}
            for view, summary in zip(self.rows, self.summaries)
        ]
        return {
            "kind": "batch",
            "title": self.title,
            "source": self.source,
            "shapes": self.shapes,
            "labels": {"shift": self.shift, "meaning": SHIFTS[self.shift]},
            "notes": self.notes,
            **({"loss_mask": self.loss_mask} if self.loss_mask else {}),
            "rows": rows,
        }

    def describe(self) -> list[str]:
        """What a person reads first: where the batch comes from, its shapes, how its labels line up."""
        shapes = ", ".join(f"{k} {tuple(v)}" for k, v in self.shapes.items())
        lines = [
            f"{self.source}" if self.source else "",
            f"tensors: {shapes}",
            f"labels: {SHIFTS[self.shift]}",
        ]
        return [line for line in lines if line] + self.notes

    def plain(self) -> str:
        return "\n\n".join(
            ["\n".join([self.headline(), *self.describe()]), *(view.plain() for view in self.rows)]
        )

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text(self.headline(), style="bold")
        for line in self.describe():
            yield Text(line, style="dim")
        for view in self.rows:
            yield Text()
            yield view


def _token(cell) -> dict[str, Any]:
    return {
        "pos": cell.pos, "id": cell.id, "text": cell.text, "attention": cell.attention, "position": cell.position,
        "label": cell.label, "loss": cell.loss, "predicts": cell.predicts,
    }  # fmt: skip


def _titled(view: TokenView, summary: dict[str, Any]) -> TokenView:
    """The row's view, titled with what it holds: padding, loss, packed sequences."""
    parts = [summary["name"], f"{summary['with_loss']} positions carry loss"]
    if summary["padding"]:
        parts.append(f"{summary['padding']} padding ({summary['padding_side']})")
    if len(summary["sequences"]) > 1:
        parts.append(f"{len(summary['sequences'])} packed sequences (starting at {summary['sequences']})")
    return TokenView(view.cells, view.total, title=", ".join(parts), detailed=True)
