"""What a collated batch's ``attention_mask`` says, against its tokens, labels and position ids.

Label masks say what is trained; the attention mask says what each token may look at. The collator builds
both, and a bug in the second is as silent as one in the first: padding attended, real tokens hidden, packed
sequences that see each other. Measured on the batches the trainer really builds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hf_sanity.constants import IGNORE_INDEX


@dataclass(frozen=True)
class AttentionFacts:
    rows: int
    width: int
    mask_given: bool
    position_ids_given: bool
    # Padding (a leading or trailing run of the pad token) with attention_mask 1 that real tokens see: leading
    # padding (a causal model attends to everything before), or trailing padding that carries loss.
    pad_seen: int = 0
    pad_seen_rows: list[int] = field(default_factory=list)
    pad_trained: int = 0  # ... of which carry loss
    # Positions with attention_mask 0 that are content: between attended tokens, or carrying loss.
    hidden: int = 0
    hidden_supervised: int = 0
    hidden_rows: list[int] = field(default_factory=list)
    # ... of them, padding the collator added (before the first or after the last attended token) that
    # carries loss: the mask is right there, the labels are not (padded with the pad id instead of -100).
    padding_in_loss: int = 0
    padding_in_loss_rows: list[int] = field(default_factory=list)
    padding_labels: dict[int, int] = field(default_factory=dict)  # their label values, with counts
    left_padded_rows: list[int] = field(default_factory=list)
    right_padded_rows: list[int] = field(default_factory=list)
    # Rows whose position ids restart: several sequences packed in one row.
    packed_rows: list[int] = field(default_factory=list)

    @property
    def packed_with_mask(self) -> bool:
        """Packed rows with a 2-D attention mask: transformers builds the per-sequence (block-diagonal) mask
        from position ids only when no attention mask is passed; with one, each sequence attends to the ones
        packed before it."""
        return bool(self.packed_rows) and self.mask_given


def attention_facts(batch: Mapping[str, Any], *, pad_id: int | None, end_ids, bos_id: int | None):
    """The facts of one collated batch, or None when it has no 2-D ``input_ids``. ``end_ids``: the tokens a
    real example may end with (so that pad == EOS does not count the example's own EOS as padding)."""
    ids = batch.get("input_ids")
    if ids is None or getattr(ids, "dim", lambda: 0)() != 2:
        return None
    mask = batch.get("attention_mask")
    mask = mask if mask is not None and mask.dim() == 2 and mask.shape == ids.shape else None
    labels = batch.get("labels")
    labels = labels.tolist() if labels is not None and labels.shape == ids.shape else None
    positions = batch.get("position_ids")
    positions = positions.expand(ids.shape[0], -1).tolist() if positions is not None else None
    rows, width = ids.shape
    facts: dict[str, Any] = {
        "pad_seen": 0, "pad_seen_rows": [], "pad_trained": 0, "hidden": 0, "hidden_supervised": 0,
        "hidden_rows": [], "padding_in_loss": 0, "padding_in_loss_rows": [], "padding_labels": {},
        "left_padded_rows": [], "right_padded_rows": [], "packed_rows": [],
    }  # fmt: skip
    id_rows = ids.tolist()
    mask_rows = mask.tolist() if mask is not None else None
    for r in range(rows):
        row = id_rows[r]
        if positions is not None and any(p == 0 for p in positions[r][1:]):
            facts["packed_rows"].append(r)
        if mask_rows is None:
            continue
        keep = [int(m) != 0 for m in mask_rows[r]]
        labs = labels[r] if labels is not None else None
        _padding_seen(facts, r, row, keep, labs, pad_id, end_ids, bos_id)
        _content_hidden(facts, r, keep, labs)
    return AttentionFacts(
        rows=rows, width=width, mask_given=mask is not None, position_ids_given=positions is not None, **facts
    )


def _padding_seen(facts, r, row, keep, labs, pad_id, end_ids, bos_id) -> None:
    if not any(keep):
        return
    first = keep.index(True)
    last = len(keep) - 1 - keep[::-1].index(True)
    if first > 0:
        facts["left_padded_rows"].append(r)
    if last < len(keep) - 1:
        facts["right_padded_rows"].append(r)
    if pad_id is None:
        return
    lead = _run(row, pad_id, 0, 1)
    lead -= 1 if lead and pad_id == bos_id else 0  # the example's own BOS
    trail = _run(row, pad_id, len(row) - 1, -1)
    trail -= 1 if trail and pad_id in end_ids else 0  # the example's own EOS
    seen = [i for i in range(min(lead, len(row) - 1)) if keep[i]]  # attended by every token after them
    tail = range(len(row) - trail, len(row)) if 0 < trail < len(row) else range(0)
    trained = [i for i in tail if keep[i] and labs is not None and labs[i] != IGNORE_INDEX]
    if seen or trained:
        facts["pad_seen"] += len(seen) + len(trained)
        facts["pad_trained"] += len(trained)
        facts["pad_seen_rows"].append(r)


def _content_hidden(facts, r, keep, labs) -> None:
    if not any(keep):
        return
    first = keep.index(True)
    last = len(keep) - 1 - keep[::-1].index(True)
    inside = {i for i in range(first, last + 1) if not keep[i]}
    supervised = {i for i, k in enumerate(keep) if not k and labs is not None and labs[i] != IGNORE_INDEX}
    hidden = inside | supervised
    if hidden:
        facts["hidden"] += len(hidden)
        facts["hidden_supervised"] += len(supervised)
        facts["hidden_rows"].append(r)
    padding = [i for i in supervised if i < first or i > last]
    if padding:
        facts["padding_in_loss"] += len(padding)
        facts["padding_in_loss_rows"].append(r)
        for i in padding:
            facts["padding_labels"][labs[i]] = facts["padding_labels"].get(labs[i], 0) + 1


def _run(row: list[int], token: int, start: int, step: int) -> int:
    """How many ``token`` in a row from ``start`` walking by ``step``."""
    n, i = 0, start
    while 0 <= i < len(row) and row[i] == token:
        n, i = n + 1, i + step
    return n
