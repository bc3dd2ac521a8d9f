"""Train against eval: is the eval set a random sample of the data the model trains on?

An eval set cut as the head or the tail of a sorted source (``dataset.select(range(n))`` of a file sorted by
length, date or label; ``train_test_split(shuffle=False)``) or taken from somewhere else (another template,
another vocabulary, another label prior) measures something else than the task trained: its loss and metrics
mislead without any error. Everything here is measured on up to ``MAX_ROWS`` rows of each split (evenly
spaced, in order) and judged against what random splits of the same rows give, never against a fixed number
alone:

* per *key* of a row (its length in tokens, its text in lexical order, its label, its format: system turn and
  number of turns, its template: the marker families in its text, its system prompt): how many eval rows lie
  beyond the train rows' whole range (a random eval set puts about 1/(n+1) of its rows beyond each end),
  whether the train rows are themselves in the key's order (a sorted source), and how far the two
  distributions are apart (Kolmogorov-Smirnov D for numbers, total variation for categories) against the
  same distance between random re-splits of the pooled rows (a permutation test);
* what the eval set holds that train never does: its words (or token ids) and its categories (labels, formats,
  templates, system prompts) absent from train, against the same share between random halves of train.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hf_sanity.measure.encode import normalize, text_of
from hf_sanity.measure.families import FAMILY_OF
from hf_sanity.measure.formats import COLUMNS, Layout, conversation_of, detect_format

MAX_ROWS = 5000  # rows of each split read
PERMUTATIONS = 500  # random re-splits of the pooled rows: the sampling noise of a distance
UNSEEN_SPLITS = 20  # random halves of train: the sampling noise of "unseen in train"
LABEL_MAX_VALUES = 20  # answers (or a label column) with at most this many values are labels
LABEL_COLUMNS = ("label", "labels")
SEED = 0


@dataclass
class SplitRows:
    """What is compared of one split's rows (the ``rows`` read, in order)."""

    fmt: str
    rows: int  # in the whole split
    lengths: list[int]  # tokens per row that encoded
    texts: list[str]  # the row's text, normalized (its words; token ids for pre-tokenized rows)
    answers: list[str | None]  # the label column, else the last answer (normalized)
    shapes: list[str]  # system turn or not, number of user turns, tools or not; the format for plain rows
    templates: list[str]  # the marker families in the row's text ("none")
    systems: list[str | None]  # the system prompt (normalized), None without one


def _indices(n: int) -> list[int]:
    if n <= MAX_ROWS:
        return list(range(n))
    return sorted({int(i) for i in np.linspace(0, n - 1, MAX_ROWS).round()})


def split_rows(dataset, encoded, *, fmt: str | None, alpaca_template: str, has_template: bool) -> SplitRows:
    """``dataset``'s rows as :class:`SplitRows`; ``encoded``: its encoding (lengths), ``fmt`` its format as
    detected (None: detected here, from its columns)."""
    if fmt is None:
        try:
            fmt = detect_format(dataset.column_names, features=dataset.features)
        except Exception:
            fmt = "unknown"
    picked = _indices(len(dataset))
    layout = Layout.of(
        fmt if fmt in COLUMNS else "text", has_template=has_template, alpaca_template=alpaca_template
    )
    rows = dataset.select(picked).to_list() if picked else []
    valid = np.asarray(encoded["error"]) == "" if encoded is not None else np.zeros(0, dtype=bool)
    lengths = np.asarray(encoded["n_tokens"]) if encoded is not None else np.zeros(0, dtype=int)
    out = SplitRows(
        fmt,
        len(dataset),
        [int(lengths[i]) for i in picked if i < len(valid) and valid[i]],
        [],
        [],
        [],
        [],
        [],
    )
    for raw in rows:
        row = layout.to_trl(raw) if fmt in COLUMNS else raw
        row = row if isinstance(row, dict) else {}
        text, answer, shape, system = _read(row, fmt)
        label = next((raw[c] for c in LABEL_COLUMNS if isinstance(raw.get(c), (str, int, bool))), None)
        out.texts.append(text)
        out.answers.append(normalize(str(label)) if label is not None else answer)
        out.shapes.append(shape)
        out.systems.append(system)
        found = (
            {FAMILY_OF[m] for m in FAMILY_OF if m in text}
            if "<" in text or "#" in text or "[" in text
            else set()
        )
        out.templates.append("+".join(sorted(found)) or "none")
    return out


def _read(row: dict[str, Any], fmt: str) -> tuple[str, str | None, str, str | None]:
    """(text, last answer, shape, system prompt) of a row as TRL reads it."""
    messages = conversation_of(row)
    if messages:
        messages = [m for m in messages if isinstance(m, dict)]
        texts = [text_of(m) for m in messages]
        roles = [m.get("role") for m in messages]
        answers = [t for r, t in zip(roles, texts) if r == "assistant"]
        systems = [t for r, t in zip(roles, texts) if r == "system"]
        turns = sum(r == "user" for r in roles)
        shape = f"{'system+' if systems else ''}{min(turns, 4)}{'+' if turns > 4 else ''} turns"
        shape += "+tools" if row.get("tools") else ""
        return (
            normalize(" ".join(texts)),
            normalize(answers[-1]) if answers else None,
            shape,
            normalize(systems[0])[:200] if systems else None,
        )
    if fmt == "tokens":
        return " ".join(map(str, row.get("input_ids") or [])), None, fmt, None
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        return normalize(row["prompt"] + " " + row["completion"]), normalize(row["completion"]), fmt, None
    text = row.get("text")
    return (normalize(text) if isinstance(text, str) else ""), None, fmt, None


# -- statistics ----------------------------------------------------------------------------------------------
def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    values = np.concatenate([a, b])
    cdf_a = np.searchsorted(np.sort(a), values, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), values, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def tv_distance(a: np.ndarray, b: np.ndarray, categories: int) -> float:
    """Total variation between two samples of category codes."""
    pa = np.bincount(a, minlength=categories) / len(a)
    pb = np.bincount(b, minlength=categories) / len(b)
    return float(0.5 * np.abs(pa - pb).sum())


def permutation_noise(a: np.ndarray, b: np.ndarray, distance, rng) -> float:
    """The largest ``distance`` between random re-splits of the pooled values into parts of the same sizes:
    a distance beyond it has a permutation p-value below 1/(PERMUTATIONS + 1)."""
    pooled = np.concatenate([a, b])
    worst = 0.0
    for _ in range(PERMUTATIONS):
        shuffled = rng.permutation(pooled)
        worst = max(worst, distance(shuffled[: len(a)], shuffled[len(a) :]))
    return worst


def spearman_with_order(values: np.ndarray) -> float:
    """How sorted the values are in their order of arrival: the rank correlation of value and position."""
    if len(values) < 3:
        return 0.0
    ranks = np.argsort(np.argsort(values, kind="stable"), kind="stable").astype(float)
    order = np.arange(len(values), dtype=float)
    if ranks.std() == 0:
        return 0.0
    return float(np.corrcoef(ranks, order)[0, 1])


def grouped(codes: np.ndarray) -> float:
    """How grouped the categories are in their order of arrival: 1 - (runs - categories) / (expected runs of a
    random order - categories); 1 when each category comes in one run, ~0 for a random order."""
    if len(codes) < 3:
        return 0.0
    runs = 1 + int((codes[1:] != codes[:-1]).sum())
    shares = np.bincount(codes) / len(codes)
    expected = 1 + (len(codes) - 1) * (1 - float((shares**2).sum()))
    categories = int((shares > 0).sum())
    if expected - categories <= 0:
        return 0.0
    return float(1 - (runs - categories) / (expected - categories))


@dataclass
class KeyComparison:
    key: str
    kind: str  # "number", "order" (lexical) or "category"
    above: float = 0.0  # share of eval rows beyond the train rows' largest value
    below: float = 0.0  # ... beyond their smallest
    train_sorted: float = 0.0  # rank correlation with position (numbers, order) or grouping (categories)
    distance: float | None = None  # KS D or TV between the splits
    noise: float | None = None  # the largest distance between random re-splits
    summary: dict[str, Any] = field(default_factory=dict)  # what a person reads: medians, top categories


@dataclass
class SplitComparison:
    train: SplitRows
    eval: SplitRows
    keys: dict[str, KeyComparison]
    unseen: dict[
        str, dict[str, Any]
    ]  # per key: eval share unseen in train, its random-split baseline, examples


def _numbers(key: str, a: list[float], b: list[float], rng) -> KeyComparison:
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    out = KeyComparison(key, "number")
    if len(x) == 0 or len(y) == 0:
        return out
    out.above, out.below = float((y > x.max()).mean()), float((y < x.min()).mean())
    out.train_sorted = spearman_with_order(x)
    out.distance, out.noise = ks_distance(x, y), permutation_noise(x, y, ks_distance, rng)
    out.summary = {
        "train_median": float(np.median(x)), "eval_median": float(np.median(y)),
        "train_range": [float(x.min()), float(x.max())], "eval_range": [float(y.min()), float(y.max())],
    }  # fmt: skip
    return out


def _order(key: str, a: list[str], b: list[str]) -> KeyComparison:
    out = KeyComparison(key, "order")
    if not a or not b:
        return out
    high, low = max(a), min(a)
    out.above = sum(v > high for v in b) / len(b)
    out.below = sum(v < low for v in b) / len(b)
    codes = {v: i for i, v in enumerate(sorted(set(a)))}
    out.train_sorted = spearman_with_order(np.asarray([codes[v] for v in a]))
    out.summary = {
        "train_first": low[:40],
        "train_last": high[:40],
        "eval_first": min(b)[:40],
        "eval_last": max(b)[:40],
    }
    return out


def _categories(key: str, a: list[str], b: list[str], rng) -> KeyComparison:
    out = KeyComparison(key, "category")
    if not a or not b:
        return out
    values = sorted(set(a) | set(b))
    codes = {v: i for i, v in enumerate(values)}
    x = np.asarray([codes[v] for v in a])
    y = np.asarray([codes[v] for v in b])
    out.train_sorted = grouped(x)

    def distance(p, q):
        return tv_distance(p, q, len(values))

    out.distance, out.noise = distance(x, y), permutation_noise(x, y, distance, rng)
    out.summary = {
        "train": {k: round(v / len(a), 4) for k, v in Counter(a).most_common(5)},
        "eval": {k: round(v / len(b), 4) for k, v in Counter(b).most_common(5)},
    }
    return out


def _unseen(a: list, b: list, rng, items=lambda row: [row]) -> dict[str, Any]:
    """The share of ``b``'s items (a row's, by ``items``) absent from every row of ``a``, and the same share
    between random halves of ``a`` (the largest of ``UNSEEN_SPLITS``): what sampling alone leaves unseen."""

    def share(reference: list, sample: list) -> tuple[float, Counter]:
        known = {item for row in reference for item in items(row)}
        seen = [item for row in sample for item in items(row)]
        missing = Counter(item for item in seen if item not in known)
        return (sum(missing.values()) / len(seen) if seen else 0.0), missing

    observed, missing = share(a, b)
    baseline = 0.0
    size = min(len(b), len(a) // 2)
    for _ in range(UNSEEN_SPLITS if size else 0):
        order = rng.permutation(len(a))
        held = [a[i] for i in order[:size]]
        rest = [a[i] for i in order[size:]]
        baseline = max(baseline, share(rest, held)[0])
    return {
        "share": observed,
        "baseline": baseline,
        "examples": [str(k)[:60] for k, _ in missing.most_common(5)],
    }


def compare_splits(train: SplitRows, eval_: SplitRows) -> SplitComparison:
    rng = np.random.default_rng(SEED)
    keys = {
        "length": _numbers("length", train.lengths, eval_.lengths, rng),
        "text-order": _order("text-order", train.texts, eval_.texts),
        "format": _categories("format", train.shapes, eval_.shapes, rng),
        "template": _categories("template", train.templates, eval_.templates, rng),
    }
    unseen = {
        "vocabulary": _unseen(train.texts, eval_.texts, rng, items=str.split),
        "format": _unseen(train.shapes, eval_.shapes, rng),
        "template": _unseen(train.templates, eval_.templates, rng),
        "system-prompt": _unseen([s for s in train.systems if s], [s for s in eval_.systems if s], rng),
    }
    labels = [a for a in train.answers if a is not None], [a for a in eval_.answers if a is not None]
    if labels[0] and labels[1] and 2 <= len(set(labels[0])) <= LABEL_MAX_VALUES:
        keys["label"] = _categories("label", *labels, rng)
        unseen["label"] = _unseen(*labels, rng)
    return SplitComparison(train, eval_, keys, unseen)
