"""Remedies: a finding's fix as data, applied to a copy of the setup and verified by running the checks again.

A rule attaches a :class:`Remedy` to its finding (``RULE.finding(..., remedy=...)``), as ruff attaches a fix to
a diagnostic: what it changes, its safety, and an ``apply`` that edits a :class:`Repair` (the working copy:
never the user's objects or folders). ``hf-sanity fix`` (``hf_sanity.drivers.fix``) applies the safe ones
(with ``--unsafe-fixes`` the unsafe ones too), runs the checks again on the copy and reports each finding
``fixed``, ``not fixed`` (with what remains) or ``display only``. A rule declares what its remedy does once, in
``define(..., remedy=RemedyDoc(...))``: ``explain`` and docs/rules.md show it.

Safety, as ruff's applicability:

* ``safe``: cannot change what a correct setup trains on (the end-of-turn id added to the generation config's
  ``eos_token_id``: a setup that stops correctly stops the same);
* ``unsafe``: changes the data or the vocabulary (rows dropped, labels restored, a pad token added and the
  embeddings resized, a training argument);
* ``display``: a change hf-sanity cannot make (your collator's code): shown, never applied.

Nothing here imports torch, transformers or datasets at import time: rules build remedies while they run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hf_sanity.jsonvalues import jsonable

SAFETIES = ("safe", "unsafe", "display")
# What a remedy may change (fixes.json names them).
TARGETS = ("tokenizer", "special-tokens", "generation-config", "chat-template", "dataset", "eval-dataset",
           "training-args", "model")  # fmt: skip


@dataclass(frozen=True)
class RemedyDoc:
    """What a rule's remedy does, for ``explain`` and the docs page: ``safety`` is one of :data:`SAFETIES` or
    several (``"safe or unsafe"``: the finding says which, e.g. safe only when the text is identical)."""

    safety: str
    does: str

    def __post_init__(self) -> None:
        if not set(self.safety.split(" or ")) <= set(SAFETIES):
            raise ValueError(f"remedy safety must be among {SAFETIES}, got {self.safety!r}")


@dataclass
class Remedy:
    """One finding's repair. ``title``: what it does, in one line (the diff and fixes.md say it); ``changes``:
    the :data:`TARGETS` it edits; ``apply(repair)``: the edit, on the copy (None for ``display``);
    ``detail``: JSON values for fixes.json (the rows dropped, the template used, ...)."""

    title: str
    safety: str
    changes: tuple[str, ...]
    apply: Callable[[Repair], None] | None = field(default=None, repr=False, compare=False)
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.safety not in SAFETIES:
            raise ValueError(f"remedy safety must be one of {SAFETIES}, got {self.safety!r}")
        unknown = set(self.changes) - set(TARGETS)
        if unknown:
            raise ValueError(f"unknown remedy targets {sorted(unknown)}; use {TARGETS}")
        if (self.apply is None) != (self.safety == "display"):
            raise ValueError("a display-only remedy has no apply; every other one has one")

    @property
    def applicable(self) -> bool:
        return self.safety != "display"

    def __getstate__(self) -> dict[str, Any]:
        """A copy for another process (torchrun's ranks get rank 0's report) describes the remedy; ``apply``
        edits this process's objects, so only the process that found it can apply it."""
        return {k: v for k, v in vars(self).items() if k != "apply"}

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "safety": self.safety, "changes": list(self.changes),
                "detail": jsonable(self.detail)}  # fmt: skip


class Repair:
    """The working copy of a setup that remedies edit: its own tokenizer and generation config, the dataset's
    rows (read when a remedy first asks; edits and drops by the row's index in the dataset as given, so
    remedies computed on the same report compose), the training arguments, and the model (loaded, or
    copied from the object given, only when a remedy asks for it)."""

    def __init__(self, *, tokenizer, dataset=None, eval_dataset=None, generation_config=None, model=None,
                 training_args: dict[str, Any] | None = None, options=None) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.training_args: dict[str, Any] = dict(training_args or {})
        self.options = options  # the EncodeOptions the checks read the rows with
        self._data = {"train": dataset, "eval": eval_dataset}
        self._rows: dict[str, list[dict[str, Any]]] = {}
        self.dropped: dict[str, dict[int, str]] = {
            "train": {},
            "eval": {},
        }  # index -> the rule that dropped it
        self.edited: dict[str, dict[int, str]] = {"train": {}, "eval": {}}
        self._originals: dict[str, dict[int, dict[str, Any]]] = {"train": {}, "eval": {}}
        self._model_source = model
        self._model = None

    # -- rows ------------------------------------------------------------------------------------------
    def rows(self, split: str = "train") -> list[dict[str, Any]]:
        """Every row of ``split`` as given (a list the remedies edit in place)."""
        if split not in self._rows:
            data = self._data[split]
            self._rows[split] = [] if data is None else data.to_list()
        return self._rows[split]

    def drop(self, indices: Iterable[int], rule: str, split: str = "train") -> None:
        for i in indices:
            self.dropped[split].setdefault(int(i), rule)

    def replace(self, index: int, row: dict[str, Any], rule: str, split: str = "train") -> None:
        self._originals[split].setdefault(int(index), self.rows(split)[index])
        self.rows(split)[index] = row
        self.edited[split].setdefault(int(index), rule)

    def original(self, index: int, split: str = "train") -> dict[str, Any]:
        """Row ``index`` of ``split`` as given, before any edit."""
        return self._originals[split].get(int(index), self.rows(split)[index])

    def data_changed(self, split: str = "train") -> bool:
        return bool(self.dropped[split] or self.edited[split])

    def kept(self, split: str = "train") -> list[dict[str, Any]]:
        """The rows of ``split`` after the edits, without the dropped ones."""
        return [row for i, row in enumerate(self.rows(split)) if i not in self.dropped[split]]

    def encoder(self):
        """An encoder of the rows as the checks read them, with the copy's tokenizer."""
        from hf_sanity.measure.encode import EncodeOptions, Encoder

        return Encoder(self.tokenizer, self.options or EncodeOptions(fmt="messages"))

    # -- model -----------------------------------------------------------------------------------------
    @property
    def model_changed(self) -> bool:
        return self._model is not None

    @property
    def model(self):
        """The model to edit: loaded from its folder, or a copy of the object given (the user's is left
        alone). Asking for it means a remedy changes it: the repaired folder then holds its weights."""
        if self._model is None:
            source = self._model_source
            if source is None:
                raise ValueError("this remedy changes the model, and no model was given")
            loaded = callable(source) and not hasattr(source, "forward")
            self._model = source() if loaded else copy.deepcopy(source)
        return self._model


# -- building blocks rules share ------------------------------------------------------------------------
def drop_rows(rows: Iterable[int], rule: str, what: str, *, split: str = "train") -> Remedy:
    """Drop ``rows`` (indices of the dataset as given) from ``split``: unsafe, the data changes."""
    indices = sorted({int(i) for i in rows})

    def apply(repair: Repair) -> None:
        repair.drop(indices, rule, split)

    n = len(indices)
    where = "" if split == "train" else " of the eval split"
    return Remedy(
        f"drop the {n} row{'s' if n != 1 else ''}{where} {what}",
        "unsafe",
        ("dataset" if split == "train" else "eval-dataset",),
        apply,
        detail={"rows_dropped": n, "split": split},
    )


def display(title: str) -> Remedy:
    """A change hf-sanity cannot make (code of yours): shown with the finding, never applied."""
    return Remedy(title, "display", ())


def merge_system_turns(rows: Iterable[int], rule: str, fmt: str, why: str) -> Remedy | None:
    """Rows whose system prompt a template without a system role drops (or refuses) get it merged into their
    first user turn, as such templates expect it: unsafe, the data changes. ``fmt``: the rows' format as
    given (``messages``, or ``prompt-completion`` with the system turn in the prompt); None for others."""
    if fmt not in ("messages", "prompt-completion"):
        return None
    indices = sorted({int(i) for i in rows})
    key = "messages" if fmt == "messages" else "prompt"

    def apply(repair: Repair) -> None:
        import json

        from hf_sanity.measure.encode import system_merged

        for i in indices:
            row = repair.rows()[i]
            value = row.get(key)
            messages = json.loads(value) if isinstance(value, str) else value
            merged = system_merged(messages) if isinstance(messages, list) else None
            if merged is not None:
                text = json.dumps(merged, ensure_ascii=False) if isinstance(value, str) else merged
                repair.replace(i, {**row, key: text}, rule)

    n = len(indices)
    return Remedy(
        f"merge the system prompt into the first user turn of the {n} row{'s' if n != 1 else ''} {why}",
        "unsafe",
        ("dataset",),
        apply,
        detail={"rows_edited": n},
    )


def set_chat_template(template: str, name: str, *, differs: int, rows: int, why: str = "") -> Remedy:
    """The tokenizer's chat template replaced by ``template`` (``name`` says which) after ``rows`` rows were
    rendered with both: safe when none renders differently (``differs``), unsafe otherwise (``why`` says so)."""

    def apply(repair: Repair) -> None:
        repair.tokenizer.chat_template = template

    said = why or (
        "every row renders the same text" if not differs else f"{differs} of {rows} rows render differently"
    )
    return Remedy(
        f"set the chat template to {name} ({said})",
        "unsafe" if differs else "safe",
        ("chat-template",),
        apply,
        detail={"template": name, "rows_rendered_differently": differs, "rows_rendered": rows},
    )


def keep_answers_whole(ctx, cut, raise_to: int | None, rule: str) -> Remedy | None:
    """Answers that max_len cuts (``cut``: a mask over the rows): with ``raise_to``, the training argument
    ``max_length`` raised to it and the rows it still cuts dropped; without, the cut rows dropped. Unsafe: what
    trains changes (more tokens per batch, fewer rows)."""
    import numpy as np

    if not ctx.rows_are_dataset:
        return None
    max_len = ctx.options.max_len
    raise_to = raise_to if raise_to and raise_to > max_len else None
    drop = [int(i) for i in np.flatnonzero(cut)]
    if raise_to:  # a row is still cut when a completion ends past the new length
        lengths = ctx.col("n_tokens")
        drop = [i for i in drop if lengths[i] > raise_to and _ends_past(ctx, i, raise_to)]

    def apply(repair: Repair) -> None:
        if raise_to:
            repair.training_args["max_length"] = raise_to
        repair.drop(drop, rule)

    n = len(drop)
    rows = f"the {n} row{'s' if n != 1 else ''}"
    valid = int(ctx.valid.sum())
    fits = f"{(valid - n) / valid:.0%} of the examples fit whole" if n else "every completion fits"
    title = (
        f"train with max_length={raise_to:,} (was {max_len:,}; {fits})"
        + (f" and drop {rows} it still cuts" if n else "")
        if raise_to
        else f"drop {rows} whose completion max_len={max_len:,} cuts"
    )
    changes = ("training-args",) * bool(raise_to) + ("dataset",) * bool(n)
    return Remedy(
        title, "unsafe", changes, apply, detail={"max_length": raise_to or max_len, "rows_dropped": n}
    )


def _ends_past(ctx, row: int, length: int) -> bool:
    spans = ctx.spans(row)
    if not spans:  # one completion, the whole sequence (language modelling)
        return bool(ctx.col("n_tokens")[row] > length)
    return any(span.stop > length and span.stop > span.start for span in spans)


def embeddings_from_text(tokenizer, ids: list[int]) -> Remedy:
    """The input (and untied output) embedding rows of the special tokens ``ids`` set to the mean of the rows
    of the pieces their text is made of (``<|eot_id|>``: ``<``, ``|``, ``eot``, ...), or of every other row
    where the text has none: unsafe, the weights change. A mean embedding, as the widely used fix gives them,
    but one of their own: all at the one mean of every row they would stay indistinguishable."""
    names = tokenizer.convert_ids_to_tokens(ids)

    def apply(repair: Repair) -> None:
        import torch

        from hf_sanity.measure.markers import boundary_ids

        model, tok = repair.model, repair.tokenizer
        specials = boundary_ids(tok) | set(ids)
        pieces = {}
        for i, name in zip(ids, names):
            found = tok(name[:1], add_special_tokens=False)["input_ids"]
            found += tok(name[1:], add_special_tokens=False)["input_ids"] if len(name) > 1 else []
            pieces[i] = [p for p in found if p not in specials]
        inputs = model.get_input_embeddings()
        outputs = model.get_output_embeddings()
        tables = [inputs.weight]
        if outputs is not None and outputs.weight.data_ptr() != inputs.weight.data_ptr():
            tables.append(outputs.weight)
        with torch.no_grad():
            for weight in tables:
                others = [r for r in range(weight.shape[0]) if r not in specials]
                for i in ids:
                    source = pieces[i] or others
                    weight[i] = weight[source].float().mean(dim=0).to(weight.dtype)

    return Remedy(
        f"initialise the embedding rows of {', '.join(map(repr, names[:4]))}"
        + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        + " to the mean embedding of the pieces their text is made of",
        "unsafe",
        ("model",),
        apply,
        detail={"tokens": names, "ids": list(ids)},
    )
