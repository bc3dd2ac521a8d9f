"""Data rules: what is wrong with the rows themselves, before any token is looked at."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from hf_sanity.catalog import define
from hf_sanity.measure.families import NO_TEMPLATE
from hf_sanity.remedies import Remedy, RemedyDoc, drop_rows, merge_system_turns

BAD_INPUT_VALUES = define(
    "bad-input-values",
    severity="error",
    stage="data",
    symptom="Training crashes mid-epoch on one row, or silently trains on empty or malformed examples.",
    detects="Each row is validated while it is tokenized: None/empty/non-string fields, empty conversations, "
    "unknown roles, conversations without an assistant turn, and rows the chat template or tokenizer rejects. "
    "A row the template rejects is rendered again with its system turn merged into the first user turn: when "
    "that renders, the cause is `system-role-refused` (the template has no system role, as Mistral's).",
    fix="Drop or repair the listed rows before training (e.g. `dataset.filter(...)`); the reasons say what is wrong.",
    remedy=RemedyDoc(
        "unsafe",
        "Drops the rows (dataset.jsonl); rows a template without a system role refuses get their system prompt "
        "merged into the first user turn instead.",
    ),
)

SYSTEM_REFUSED_FIX = (
    "This chat template has no system role: merge the system prompt into the first user turn "
    "(`[{{'role': 'user', 'content': system + '\\n\\n' + first_user}}, ...]`, which the template renders), or "
    "train with a chat template that has a system role (and serve with the same one). Dropping these rows would "
    "drop {share:.0%} of the data.{rest}"
)


@BAD_INPUT_VALUES.check
def check_bad_input_values(ctx):
    errors = ctx.col("error")
    bad = (errors != "") & (errors != NO_TEMPLATE)
    if not bad.any():
        return
    rows = ctx.first(bad)
    reasons = Counter(re.sub(r"\d+", "N", str(e)) for e in errors[bad])
    evidence = {"rows": rows, "count": int(bad.sum()), "reasons": dict(reasons.most_common(5))}
    refused = bad & ctx.col("system_refused").astype(bool)
    drop = drop_rows(np.flatnonzero(bad & ~refused), BAD_INPUT_VALUES.slug, "that cannot be trained on")
    if not refused.any():
        yield BAD_INPUT_VALUES.finding(
            f"{int(bad.sum())} of {len(errors)} rows cannot be trained on as they are "
            f"(row {rows[0]}: {errors[rows[0]]})",
            evidence=evidence,
            rows=bad,
            remedy=drop if ctx.rows_are_dataset else None,
        )
        return
    n_refused, first = int(refused.sum()), ctx.first(refused, 1)[0]
    others = int(bad.sum()) - n_refused
    rest = (
        f" The other {others} row{'s fail' if others != 1 else ' fails'} for other reasons (see reasons): drop or "
        "repair them."
        if others
        else ""
    )
    yield BAD_INPUT_VALUES.finding(
        f"{int(bad.sum())} of {len(errors)} rows cannot be trained on as they are: the chat template refuses the "
        f"system turn of {n_refused} of them (row {first}: {errors[first]}); merged into the first user turn, "
        "they render",
        evidence={**evidence, "cause": "system-role-refused", "system_refused": n_refused},
        fix=SYSTEM_REFUSED_FIX.format(share=n_refused / len(errors), rest=rest),
        rows=bad,
        remedy=_merged_then_dropped(ctx, refused, drop if others else None),
    )


def _merged_then_dropped(ctx, refused, drop: Remedy | None) -> Remedy | None:
    """The refused rows' system prompts merged into their first user turns, and the other bad rows dropped."""
    merge = merge_system_turns(np.flatnonzero(refused), BAD_INPUT_VALUES.slug, ctx.source_format,
                               "the template refuses the system turn of")  # fmt: skip
    if merge is None or not ctx.rows_are_dataset:
        return None
    if drop is None:
        return merge

    def apply(repair) -> None:
        merge.apply(repair)
        drop.apply(repair)

    return Remedy(f"{merge.title}, and {drop.title}", "unsafe", ("dataset",), apply,
                  detail={**merge.detail, **drop.detail})  # fmt: skip


DUPLICATE_EXAMPLES = define(
    "duplicate-examples",
    severity="warning",
    stage="data",
    symptom="The model parrots a few answers; eval looks better than it should.",
    detects="A hash of each example's normalized text (lower case, collapsed whitespace); rows whose hash was seen before.",
    fix="Deduplicate the dataset (keep the first of each group), e.g. by the normalized text.",
    remedy=RemedyDoc("unsafe", "Drops every row that repeats an earlier one (dataset.jsonl)."),
)


@DUPLICATE_EXAMPLES.check
def check_duplicates(ctx):
    whole = ctx.valid & ~ctx.col("piece").astype(bool)  # pieces cut by a packing are not examples
    hashes = ctx.col("hash")[whole]
    rows = np.flatnonzero(whole)
    if (
        ctx.image_digests is not None
    ):  # a VLM row is its text and its pictures: same text, other image, not alike
        hashes = np.array(
            [hash((int(h), ctx.image_digests[r])) for h, r in zip(hashes, rows)], dtype=np.int64
        )
    _, first_index, counts = np.unique(hashes, return_index=True, return_counts=True)
    repeats = np.delete(rows, first_index)  # every row that repeats an earlier one: the rows to drop
    duplicates = len(hashes) - len(first_index)
    if duplicates == 0:
        return
    seen: dict[int, int] = {}
    pairs = []
    for row, h in zip(rows, hashes):
        if h in seen and len(pairs) < 5:
            pairs.append([seen[h], int(row)])
        seen.setdefault(h, int(row))
    yield DUPLICATE_EXAMPLES.finding(
        f"{duplicates} of {len(hashes)} examples ({duplicates / len(hashes):.1%}) repeat an earlier one",
        evidence={
            "duplicates": duplicates,
            "fraction": duplicates / len(hashes),
            "pairs": pairs,
            "largest_group": int(counts.max()),
        },
        rows=repeats,
        remedy=drop_rows(repeats, DUPLICATE_EXAMPLES.slug, "repeating an earlier one")
        if ctx.rows_are_dataset
        else None,
    )


SPLIT_LEAKAGE = define(
    "split-leakage",
    severity="error",
    stage="data",
    symptom="Eval loss and metrics look excellent; the model does worse on genuinely new inputs.",
    detects="Hashes of normalized example text in the eval split that also occur in the train split.",
    fix="Remove the overlapping examples from the eval split (or split by a key that cannot repeat, such as a source id).",
    remedy=RemedyDoc("unsafe", "Drops the overlapping rows from the eval split (eval_dataset.jsonl)."),
)


@SPLIT_LEAKAGE.check(applies=lambda ctx: ctx.eval_encoded is not None)  # no eval split: nothing to compare
def check_split_leakage(ctx):
    train = set(ctx.col("hash")[ctx.valid].tolist())
    eval_hashes = np.asarray(ctx.eval_encoded["hash"])
    eval_valid = np.asarray(ctx.eval_encoded["error"]) == ""
    overlap = eval_valid & np.isin(eval_hashes, list(train))
    if not overlap.any():
        return
    n = int(eval_valid.sum())
    rows = [int(i) for i in np.flatnonzero(overlap)[:10]]
    yield SPLIT_LEAKAGE.finding(
        f"{int(overlap.sum())} of {n} eval examples ({overlap.sum() / n:.1%}) also appear in the train split",
        evidence={"overlap": int(overlap.sum()), "fraction": float(overlap.sum() / n), "eval_rows": rows},
        rows=overlap,  # rows of the eval split
        remedy=drop_rows(np.flatnonzero(overlap), SPLIT_LEAKAGE.slug, "also in the train split", split="eval")
        if ctx.rows_are_dataset
        else None,
    )


LABEL_LEAKAGE = define(
    "label-leakage",
    severity="warning",
    stage="data",
    symptom="Loss starts far below what the vocabulary predicts and falls to ~0; the model copies instead of answering.",
    detects="An answer (the completion or an assistant turn; 20+ characters, normalized) found verbatim in the text "
    "before it and pasted there rather than quoted: it is at least half of that text, or that text ends with it. "
    "A span quoted from inside a longer context (extractive QA, RAG with citations) is what the model will have at "
    "inference, not leakage; `--task extractive` turns the check off.",
    fix="Remove the answer from the input (check the template/formatting function that builds the prompt). If "
    "the task is to quote the input (extractive QA, RAG with citations), pass `--task extractive` "
    '(`task="extractive"`).',
    remedy=RemedyDoc("unsafe", "Drops the rows whose answer is pasted into the prompt (dataset.jsonl)."),
)

ANSWER_REPEATS_PROMPT = define(
    "answer-repeats-prompt",
    severity="error",
    stage="data",
    symptom="The fine-tuned model repeats the question before answering, or only echoes it.",
    detects="Trained answers (completions, assistant turns) that open with the whole prompt before them (the "
    "user turn; 20+ characters, normalized): a completion built as prompt + answer. An error when half the "
    "examples or more do it (the formatting function), a warning below.",
    fix="Build the completion from the answer alone: the prompt goes in the prompt (or the user turn), once; "
    "the model learns to write whatever its completions hold.",
)
ECHO_ERROR_SHARE = 0.5


@ANSWER_REPEATS_PROMPT.check
def check_answer_repeats_prompt(ctx):
    echo = ctx.valid & (ctx.col("n_echo") > 0)
    if not echo.any():
        return
    n, count = int(ctx.valid.sum()), int(echo.sum())
    rows = ctx.first(echo)
    yield ANSWER_REPEATS_PROMPT.finding(
        f"in {count} of {n} examples ({count / n:.1%}) the answer opens with the prompt before it, verbatim",
        evidence={
            "count": count,
            "fraction": count / n,
            "answers": int(ctx.col("n_echo")[ctx.valid].sum()),
            "rows": rows,
        },
        example=ctx.view(rows[0]),
        severity="error" if count / n >= ECHO_ERROR_SHARE else "warning",
        rows=echo,
    )


# Pasted, not quoted: the answer is at least this share of the text before it, ...
PASTED_SHARE = 0.5
# ... or at most this many characters of that text follow it (a label such as "Answer:" or a newline).
PASTED_TAIL = 20


@LABEL_LEAKAGE.check(applies=lambda ctx: ctx.task != "extractive")
def check_label_leakage(ctx):
    share, after = ctx.col("leak"), ctx.col("leak_after")
    found = ctx.valid & (after >= 0)
    pasted = found & ((share >= PASTED_SHARE) | (after <= PASTED_TAIL))
    if not pasted.any():
        return
    n = int(ctx.valid.sum())
    rows = ctx.first(pasted)
    ratio = float(np.median(share[pasted]))
    at_end = int((pasted & (after <= PASTED_TAIL)).sum())
    yield LABEL_LEAKAGE.finding(
        f"in {int(pasted.sum())} of {n} examples ({pasted.sum() / n:.1%}) the answer is pasted into the prompt "
        f"(typically {ratio:.0%} of the text before it; {at_end} at its very end)",
        evidence={
            "count": int(pasted.sum()),
            "fraction": float(pasted.sum() / n),
            "answer_prompt_ratio": round(ratio, 4),
            "at_prompt_end": at_end,
            "quoted_spans": int((found & ~pasted).sum()),  # answers quoted from a longer context: not counted
            "rows": rows,
        },
        example=ctx.view(rows[0]),
        rows=pasted,
        remedy=drop_rows(np.flatnonzero(pasted), LABEL_LEAKAGE.slug, "whose answer is pasted into the prompt")
        if ctx.rows_are_dataset
        else None,
    )


# -- is the eval set a random sample of the training data? (measure/splits.py) ------------------------------
SLICE_SHARE = (
    0.5  # of the eval rows beyond every train row on one side of a key (a random eval set: ~1/(n+1))
)
SORTED_SOURCE = 0.9  # rank correlation (or grouping) of the train rows' key with their order: a sorted source
DISTANCE_FLOOR = 0.1  # KS D or total variation: smaller differences are not worth a warning
# ... and beyond the largest of 500 random re-splits of the pooled rows by this factor: that largest is a
# 1-in-500 event of chance alone, which a check run on every eval set should not report (the margin makes it
# a 1-in-many-thousands one; planted differences measure 1.5x and more)
NOISE_MARGIN = 1.5
UNSEEN_EXCESS = 0.05  # eval items unseen in train: this much above random halves of train, and twice theirs
EVAL_MIN_ROWS = 20  # eval rows needed to compare distributions (a slice shows with fewer)
SLICE_MIN_ROWS = 5
KEY_WORDS = {"length": "length in tokens", "text-order": "text (in lexical order)", "label": "label",
             "format": "format (system turn, turns)", "template": "template markers"}  # fmt: skip

EVAL_NOT_RANDOM = define(
    "eval-not-random",
    severity="warning",
    stage="data",
    symptom="Eval loss and metrics that do not reflect the task: an eval set of the longest (or shortest, or "
    "last-labelled) examples, better or worse than the model really is.",
    detects=f"With an eval dataset, on up to 5,000 rows of each split: a head or tail slice of a sorted source "
    f"(cause `sorted-slice`: {SLICE_SHARE:.0%} or more of the eval rows lie beyond every train row on one side "
    "of a key, where a random eval set puts about 1/(n+1) of its rows; or the train rows are in the order of a "
    f"key, rank correlation or grouping >= {SORTED_SOURCE:g}, and the eval rows differ on it), or a length, "
    f"label or format distribution that differs from train's beyond sampling noise (cause `distribution`, "
    f"{EVAL_MIN_ROWS}+ eval rows: a Kolmogorov-Smirnov D or total variation >= {DISTANCE_FLOOR:g} and "
    f"{NOISE_MARGIN:g}x above the largest of 500 random re-splits of the pooled rows), over the same vocabulary, template and labels "
    "(else it is split-shift). Keys: length in tokens, the text in lexical order, the label (a label column, "
    "or answers with at most 20 values), the format (system turn, number of turns).",
    fix="Draw the eval set at random from the same data: `dataset.train_test_split(test_size=0.1, shuffle=True, "
    "seed=0)` (`stratify_by_column=` for labels), or shuffle before slicing (`dataset.shuffle(seed=0)`); never "
    "the first or last rows of a file sorted by length, date or label.",
)

SPLIT_SHIFT = define(
    "split-shift",
    severity="warning",
    stage="data",
    symptom="Good training loss, eval loss or metrics that say something else: the eval set is another "
    "distribution than the one trained on.",
    detects="With an eval dataset, what the eval rows hold that the train rows never do, against the same "
    "share between random halves of train (up to 5,000 rows each): words (token ids for pre-tokenized rows), "
    "template markers or system prompts, formats (another dataset format, or a system turn and turn count "
    f"train never has), labels; flagged {UNSEEN_EXCESS:g} above the random halves' largest share and at least "
    "twice it. The lengths, label prior and formats that differ beyond sampling noise go with it as evidence. "
    "A slice of a sorted source is eval-not-random's.",
    fix="Build the eval set from the same source and preprocessing as train (the same template, format, "
    "vocabulary and labels) when it is meant to measure the task trained. An eval set from another distribution "
    "on purpose (out-of-domain) measures transfer: read it as such, and keep an in-distribution eval set too.",
)


def _differs(key) -> bool:
    return (
        key.distance is not None
        and key.distance >= DISTANCE_FLOOR
        and key.distance > NOISE_MARGIN * (key.noise or 0.0)
    )


def _slice(comparison):
    """The key the train rows are sorted by and the eval rows were cut from the end of: (key, "head" or "tail"
    or "part", the share of eval rows beyond every train row or None); None. A sorted source and an eval set
    off its end, both: eval rows beyond the train rows alone are as much the mark of another source."""
    rows = len(comparison.eval.texts)
    for key in comparison.keys.values():
        if abs(key.train_sorted) < SORTED_SOURCE:
            continue
        share = max(key.above, key.below)
        if key.kind != "category" and share >= SLICE_SHARE and rows >= SLICE_MIN_ROWS:
            return key, "tail" if key.above >= key.below else "head", share
        if _differs(key) and rows >= EVAL_MIN_ROWS:
            return key, _end(key), None
    return None


def _end(key) -> str:
    """Which end of a sorted source the eval rows were cut from: its head or its tail (where the train rows'
    order puts the values the eval rows have more of); "part" for categories."""
    if key.kind != "number" or not key.summary:
        return "part"
    higher = key.summary["eval_median"] > key.summary["train_median"]
    return "tail" if higher == (key.train_sorted > 0) else "head"


def _new(comparison) -> dict[str, dict]:
    """What eval holds that train does not, per kind, beyond what random halves of train show."""
    out = {}
    for kind, unseen in comparison.unseen.items():
        if (
            unseen["share"] >= UNSEEN_EXCESS + unseen["baseline"]
            and unseen["share"] >= 2 * unseen["baseline"]
        ):
            out[kind] = unseen
    train, eval_ = comparison.train.fmt, comparison.eval.fmt
    from hf_sanity.measure.formats import read_as

    if read_as(train) != read_as(eval_):
        out["dataset-format"] = {"train": train, "eval": eval_}
    return out


def _distributions(comparison) -> dict[str, dict]:
    if len(comparison.eval.texts) < EVAL_MIN_ROWS:
        return {}
    return {
        name: {"distance": round(key.distance, 4), "random_resplits_max": round(key.noise, 4), **key.summary}
        for name, key in comparison.keys.items()
        if name in ("length", "label", "format") and _differs(key)
    }


@EVAL_NOT_RANDOM.check(applies=lambda ctx: ctx.eval_dataset is not None)
def check_eval_not_random(ctx):
    comparison = ctx.splits
    if comparison is None:
        return
    sliced = _slice(comparison)
    n = len(comparison.eval.texts)
    base = {
        "eval_rows": comparison.eval.rows,
        "train_rows": comparison.train.rows,
        "rows_compared": [len(comparison.train.texts), n],
    }
    if sliced is not None:
        key, side, share = sliced
        words = KEY_WORDS[key.key]
        order = "grouped by" if key.kind == "category" else "in the order of"
        sorted_by = (
            f"the train rows are {order} their {words} ({key.train_sorted:.2f}: 1 is sorted, 0 random)"
        )
        if share is not None:
            where = "above" if side == "tail" else "below"
            chance = 1 / (len(comparison.train.texts) + 1)
            cut = f"{share:.0%} of its {n} rows lie {where} every train row (a random eval set puts about {chance:.1%} there)"
        else:
            cut = f"it differs from them on it by {key.distance:.2f}, where random re-splits of the same rows reach {key.noise:.2f}"
        what = (
            f"the {side} of a source sorted by {words}"
            if side != "part"
            else f"a part of a source sorted by {words}"
        )
        evidence = {"cause": "sorted-slice", "key": key.key, "side": side, "share_beyond": share,
                    "train_sorted": round(key.train_sorted, 4), **key.summary, **base}  # fmt: skip
        yield EVAL_NOT_RANDOM.finding(
            f"the eval set looks like {what}: {sorted_by}, and {cut}", evidence=evidence
        )
        return
    if _new(comparison):
        return  # another source: split-shift's
    differing = _distributions(comparison)
    if differing:
        name, first = next(iter(differing.items()))
        yield EVAL_NOT_RANDOM.finding(
            f"the eval set's {' and '.join(KEY_WORDS[k] for k in differing)} distribution differs from train's "
            f"beyond sampling noise ({name}: distance {first['distance']:.2f}, random re-splits of the same rows "
            f"reach {first['random_resplits_max']:.2f}), over the same vocabulary and template: it is not a random "
            "sample of the same data",
            evidence={"cause": "distribution", "differs": differing, **base},
        )


SHIFT_ORDER = ("dataset-format", "template", "system-prompt", "vocabulary", "format", "label")
SHIFT_WORDS = {
    "vocabulary": "of its words never occur in train",
    "template": "of its rows carry template markers train never has",
    "system-prompt": "of its system prompts are ones train never uses",
    "format": "of its rows have a format (system turn, turns) train never has",
    "label": "of its labels never occur in train",
}


@SPLIT_SHIFT.check(applies=lambda ctx: ctx.eval_dataset is not None)
def check_split_shift(ctx):
    comparison = ctx.splits
    if comparison is None or _slice(comparison) is not None:
        return
    new = _new(comparison)
    if not new:
        return
    parts = []
    for kind, found in new.items():
        if kind == "dataset-format":
            parts.append(f"it is {found['eval']} data, train is {found['train']}")
        else:
            parts.append(
                f"{found['share']:.0%} {SHIFT_WORDS[kind]} (random halves of train: at most {found['baseline']:.0%})"
            )
    yield SPLIT_SHIFT.finding(
        f"the eval set comes from another distribution than train: {'; '.join(parts)}",
        evidence={
            "cause": min(new, key=SHIFT_ORDER.index),
            "causes": sorted(new, key=SHIFT_ORDER.index),
            "unseen": new,
            "differs": _distributions(comparison),
            "eval_rows": comparison.eval.rows,
            "train_rows": comparison.train.rows,
        },
    )
