"""Preference data, before training (DPO and its variants, ORPO, CPO/SimPO, KTO, reward models): pairs that
carry no signal as the trainer will see them, pairs a content-blind rule separates, prompts rendered twice,
KTO batches of one label, a reward head that never trains or reads the wrong token, β set against the paper.

Every rule here reads ``ctx.pairs`` or ``ctx.unpaired`` (`hf_sanity.measure.preference`): the token ids the
trainer's own preparation wrote (or TRL's tokenization of the rows, without a trainer) and its collator's cut.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import PAIRED, PREFERENCE
from hf_sanity.measure.preference import separability
from hf_sanity.numbers import fmt
from hf_sanity.rules.training.base import Monitor, TrainingSetup

PAIRS_IDENTICAL = define(
    "preference-pairs-identical",
    severity="error",
    stage="tokens",
    objectives=PAIRED,
    symptom="The preference loss sits at its starting value (ln 2 = 0.6931 for DPO) with margins 0 and "
    "accuracy 0: the pairs carry no signal.",
    detects="Pairs whose chosen and rejected token ids are equal as the trainer feeds them (after its "
    "collator's `max_length` cut), with `evidence.cause`: `truncation` (chosen and rejected share a prefix "
    "longer than the room the prompt leaves), `identical-text`, `empty-completion`. Warning above 1% of the "
    "pairs, error above 20%. Also counts the rows TRL drops without a word: a prompt that fills `max_length` "
    "alone (DPO, KTO), a reward pair with a side longer than `max_length`.",
    fix="Raise `max_length` (or shorten the prompts) so that the completions diverge inside it; deduplicate "
    "pairs whose chosen and rejected are the same text; drop pairs with empty completions.",
)

TRIVIALLY_SEPARABLE = define(
    "preference-trivially-separable",
    severity="warning",
    stage="data",
    objectives=PAIRED,
    symptom="`rewards/accuracies` reaches 1.0 in a few steps and the loss falls to 0, but the model does not "
    "get better: it learned to tell the pairs apart by length, by an EOS, by language.",
    detects="Before training: content-blind rules on the pairs as tokenized: the longer (or the shorter) side "
    "wins, only the chosen (or rejected) side ends with EOS/end of turn, the sides are in different scripts. "
    "Warning when one separates 80% of the pairs, error at 95% (`evidence.cause`: `length`, `eos`, "
    "`language`). During training: `rewards/accuracies` >= 0.95 before 10% of the steps, explained by the "
    "preflight rule where it holds.",
    fix="Balance the pairs on the confound (length-matched pairs, or resample rejected answers on-policy), "
    "or use a length-robust objective (IPO, `ld_alpha`, SimPO's length normalisation); lower the LR.",
)

TEMPLATE_LEAK = define(
    "preference-template-leak",
    severity="warning",
    stage="template",
    objectives=PREFERENCE | {"reward"},
    symptom="Training works, but the model is trained on a context it never sees at inference: the prompt "
    "twice, the assistant header twice, two BOS.",
    detects="Per pair (`evidence.cause`): `prompt-repeated` (conversational chosen/rejected that repeat the "
    "user or system turn although `prompt` is given, or a text completion that starts with the prompt's "
    "text), `generation-prompt-doubled` (both completions open with the assistant header the prompt already "
    "ends with), `double-bos` (the prompt starts with BOS twice: a rendered string tokenized again), "
    "`prompt-not-prefix` (TRL's 'tokenized prompt is not a prefix' condition, counted per row). Warning on "
    "any; error when over half the pairs repeat the prompt.",
    fix="Give conversational rows and let TRL render them: `prompt` holds the conversation up to the last user "
    "turn, `chosen`/`rejected` only the final assistant message; pass text rows un-rendered (no template, no "
    "BOS) or tokenize them without special tokens.",
)

UNMIXED_BATCHES = define(
    "preference-unmixed-batches",
    severity="warning",
    stage="trainer",
    objectives={"preference-unpaired"},
    symptom="KTO trains, but for long stretches every batch is all desirable, then all undesirable; "
    "`rewards/margins` is missing from most logs and the loss swings.",
    detects="The share of KTO batches (rows in the order its sequential sampler draws them, in "
    "`per_device_train_batch_size` chunks) that hold one label, against q^B + (1-q)^B expected under random "
    "mixing; warning above 5x that and 10%. `evidence.cause`: `auto-unpaired` (TRL unpaired a paired dataset: "
    "all chosen rows, then all rejected) or `sorted-by-label`.",
    fix="Unpair the dataset yourself and shuffle it before passing it in: "
    "`trl.unpair_preference_dataset(dataset).shuffle(seed=0)` (KTO samples sequentially, nothing reshuffles).",
)

BETA_MISSET = define(
    "preference-beta-misset",
    severity="warning",
    stage="trainer",
    objectives={"preference"},
    symptom="SimPO or IPO trains toward a margin far from the one the method was designed for: rewards fall "
    "together, or nothing moves.",
    detects="The trainer's config: SimPO (`CPOTrainer`, `loss_type='simpo'`) with beta < 1 (the paper uses "
    "beta 2.5 and gamma/beta 0.55; TRL's defaults are 0.1 and 0.5, a target margin of 5 nats per token); IPO "
    "with a target gap 1/(2 beta) above 5.",
    fix="SimPO: beta=2.5, simpo_gamma=1.375 (gamma/beta 0.55) as in the paper; IPO: beta >= 0.1.",
)

MIN_PAIRS = 20  # fewer pairs say nothing about a share
IDENTICAL_WARN, IDENTICAL_ERROR = 0.01, 0.20
DROPPED_WARN = 0.01
SEPARABLE_WARN, SEPARABLE_ERROR = 0.80, 0.95
UNMIXED_FACTOR, UNMIXED_FLOOR = 5.0, 0.10


def _has_pairs(ctx) -> bool:
    return ctx.pairs is not None and len(ctx.pairs) > 0


def _source(pairs, mask: np.ndarray) -> list[int]:
    """The dataset rows of the pairs in ``mask`` (the user's row numbers)."""
    index = np.flatnonzero(mask)
    return [int(i) for i in (pairs.source[index] if pairs.source is not None else index)]


@PAIRS_IDENTICAL.check(applies=lambda ctx: ctx.pairs is not None)
def check_pairs_identical(ctx):
    pairs = ctx.pairs
    n = len(pairs)
    given = pairs.rows_given if pairs.rows_given is not None else n
    dropped = pairs.dropped_prompt_fills + pairs.dropped_too_long
    share = float(pairs.identical.mean()) if n else 0.0
    evidence = {
        "pairs": n,
        "rows_given": given,
        "max_length": pairs.max_length,
        "dropped_prompt_fills_max_length": pairs.dropped_prompt_fills,
        "dropped_too_long": pairs.dropped_too_long,
    }
    if n and share > IDENTICAL_WARN:
        causes = {
            c: int((pairs.cause == c).sum()) for c in ("truncation", "identical-text", "empty-completion")
        }
        cause = max(causes, key=causes.get)
        rows = _source(pairs, pairs.identical)
        first = int(np.flatnonzero(pairs.identical)[0])
        why = {
            "truncation": f"chosen and rejected share their first {int(pairs.shared_prefix[first])} tokens and "
            f"max_length={pairs.max_length} leaves {max(0, (pairs.max_length or 0) - int(pairs.prompt_len[first]))} "
            f"after the {int(pairs.prompt_len[first])}-token prompt",
            "identical-text": "chosen and rejected are the same text",
            "empty-completion": "both completions are empty",
        }[cause]
        need = int((pairs.prompt_len + pairs.shared_prefix)[pairs.identical].max()) + 1
        fixes = {
            "truncation": f"Raise max_length to at least {need} (the longest prompt plus the opening its chosen and "
            "rejected share, plus the first token where they differ), or shorten the prompts.",
            "identical-text": "Deduplicate: drop the pairs whose chosen and rejected are the same text.",
            "empty-completion": "Drop the pairs with empty completions.",
        }
        also = f"; the trainer also drops {dropped} of {given} rows without a word" if dropped else ""
        yield PAIRS_IDENTICAL.finding(
            f"{int(pairs.identical.sum())} of {n} pairs ({share:.1%}) are identical as the trainer feeds them "
            f"(cause: {cause}): they carry no preference signal{also}",
            evidence={
                **evidence,
                "identical": int(pairs.identical.sum()),
                "fraction": share,
                "cause": cause,
                "causes": causes,
                "why": why,
                "rows": rows[:10],
            },
            example=ctx.view(
                first,
                title=f"pair {rows[0]}: chosen as fed (rejected is the same)",
                focus=pairs.max_length - 1 if cause == "truncation" and pairs.max_length else None,
            ),
            severity="error" if share > IDENTICAL_ERROR else "warning",
            fix=fixes[cause],
            rows=rows,
        )
    elif given and dropped / given > DROPPED_WARN:
        cause = "prompt-fills-max-length" if pairs.dropped_prompt_fills else "pair-too-long"
        what = (
            f"their prompt alone fills max_length={pairs.max_length}"
            if pairs.dropped_prompt_fills
            else "a side is longer than max_length"
        )
        yield PAIRS_IDENTICAL.finding(
            f"the trainer drops {dropped} of {given} rows ({dropped / given:.1%}) without a word: {what}",
            evidence={**evidence, "dropped": dropped, "fraction_dropped": dropped / given, "cause": cause},
            severity="warning",
            fix="Raise max_length or shorten the prompts; TRL filters these rows out silently.",
        )


CAUSE_OF_RULE = {"longer-wins": "length", "shorter-wins": "length", "only-chosen-ends": "eos",
                 "only-rejected-ends": "eos"}  # fmt: skip


def separable(pairs) -> tuple[str, str, float] | None:
    """(rule, cause, accuracy) of the best content-blind rule at or above the warning threshold."""
    return None if pairs is None else strongest(separability(pairs), len(pairs))


def strongest(scores: dict[str, float], pairs: int) -> tuple[str, str, float] | None:
    """Of the content-blind rules' accuracies on ``pairs`` pairs (``measure.preference.separability``), the best
    at or above the warning threshold, as (rule, cause, accuracy)."""
    if pairs < MIN_PAIRS or not scores:
        return None
    rule = max(scores, key=scores.get)
    if scores[rule] < SEPARABLE_WARN:
        return None
    return rule, CAUSE_OF_RULE.get(rule, "language"), scores[rule]


@TRIVIALLY_SEPARABLE.check(applies=_has_pairs)
def check_trivially_separable(ctx):
    found = separable(ctx.pairs)
    if found is None:
        return
    rule, cause, accuracy = found
    pairs = ctx.pairs
    said = {
        "longer-wins": "the chosen answer is the longer one",
        "shorter-wins": "the chosen answer is the shorter one",
        "only-chosen-ends": "only the chosen answer ends with EOS / end of turn",
        "only-rejected-ends": "only the rejected answer ends with EOS / end of turn",
    }.get(
        rule,
        f"the chosen answer is in {rule.removeprefix('chosen-is-').upper()} script and the rejected is not",
    )
    yield TRIVIALLY_SEPARABLE.finding(
        f"{said} in {accuracy:.0%} of {len(pairs)} pairs: a content-blind rule separates them (cause: {cause})",
        evidence={
            "cause": cause,
            "rule": rule,
            "accuracy": accuracy,
            "pairs": len(pairs),
            "rules": {k: round(v, 3) for k, v in separability(pairs).items()},
            "chosen_len_mean": float(pairs.chosen_len.mean()),
            "rejected_len_mean": float(pairs.rejected_len.mean()),
        },
        severity="error" if accuracy >= SEPARABLE_ERROR else "warning",
    )


@TEMPLATE_LEAK.check(applies=_has_pairs)
def check_template_leak(ctx):
    pairs = ctx.pairs
    counts: dict[str, np.ndarray] = {}
    for cause, flags in (
        ("prompt-repeated", pairs.leaked),
        ("generation-prompt-doubled", pairs.gen_prompt_doubled),
        ("double-bos", pairs.double_bos),
        ("prompt-not-prefix", pairs.prefix_mismatch),
    ):
        if flags is not None and len(flags) and flags.any():
            counts[cause] = flags
    if not counts:
        return
    cause = max(counts, key=lambda c: counts[c].mean())
    flags = counts[cause]
    share = float(flags.mean())
    n_checked = len(flags)
    said = {
        "prompt-repeated": "chosen/rejected repeat the prompt's user or system turn: TRL renders the prompt twice",
        "generation-prompt-doubled": "both completions open with the assistant header the prompt already ends with",
        "double-bos": "the prompt starts with two BOS tokens (a rendered string tokenized with special tokens again)",
        "prompt-not-prefix": "the tokenized prompt is not a prefix of prompt+completion: TRL trains on a "
        "context that differs from the one the model sees at inference",
    }[cause]
    first = int(np.flatnonzero(flags)[0])
    yield TEMPLATE_LEAK.finding(
        f"{int(flags.sum())} of {n_checked} pairs ({share:.0%}): {said} (cause: {cause})",
        evidence={
            "cause": cause,
            "fraction": share,
            "checked": n_checked,
            "counts": {c: int(f.sum()) for c, f in counts.items()},
            "rows": _source(pairs, flags)[:10],
        },
        example=ctx.view(first, title=f"pair {_source(pairs, flags)[0]}: prompt + chosen as fed")
        if first < len(ctx)
        else None,
        severity="error" if cause == "prompt-repeated" and share > 0.5 else "warning",
    )


@UNMIXED_BATCHES.check(applies=lambda ctx: ctx.unpaired is not None)
def check_unmixed_batches(ctx):
    data = ctx.unpaired
    size = max(1, data.batch_size)
    batches = len(data) // size
    if not data.sequential or batches < 2:
        return
    labels = data.label[: batches * size].reshape(batches, size)
    means = labels.mean(axis=1)
    single = float(((means == 0) | (means == 1)).mean())
    q = float(data.label.mean())
    expected = q**size + (1 - q) ** size
    if single <= max(UNMIXED_FACTOR * expected, UNMIXED_FLOOR):
        return
    cause = "auto-unpaired" if data.auto_unpaired else "sorted-by-label"
    yield UNMIXED_BATCHES.finding(
        f"{single:.0%} of {batches} batches of {size} hold one label (expected {expected:.1%} under random "
        f"mixing at {q:.0%} desirable; cause: {cause})",
        evidence={
            "cause": cause,
            "single_label_fraction": single,
            "expected_fraction": expected,
            "desirable_fraction": q,
            "batch_size": size,
            "batches": batches,
            "batch_label_means": [round(float(m), 3) for m in means[:16]],
        },
    )


@BETA_MISSET.check(applies=lambda ctx: ctx.trainer is not None and ctx.objective.kind == "preference")
def check_beta_misset(ctx):
    objective = ctx.objective
    beta = objective.beta
    if beta is None or beta <= 0:
        return
    if objective.variant == "simpo" and beta < 1:
        gamma = objective.details.get("simpo_gamma")
        gamma_note = (
            f", simpo_gamma={fmt(gamma)} (gamma/beta {fmt(gamma / beta)})" if gamma is not None else ""
        )
        yield BETA_MISSET.finding(
            f"SimPO with beta={fmt(beta)}{gamma_note}: the paper uses beta=2.5 and gamma/beta=0.55",
            evidence={
                "variant": "simpo",
                "beta": beta,
                "simpo_gamma": gamma,
                "paper_beta": 2.5,
                "paper_gamma_over_beta": 0.55,
            },
        )
    elif objective.variant == "ipo" and 1 / (2 * beta) > 5:
        yield BETA_MISSET.finding(
            f"IPO with beta={fmt(beta)}: its target log-ratio gap 1/(2 beta) = {1 / (2 * beta):.3g} nats "
            "(above 5: the loss pushes the margins far past what the data supports)",
            evidence={"variant": "ipo", "beta": beta, "target_gap": 1 / (2 * beta), "limit": 5},
        )


# In training: the accuracy the trainer logs, against its planned length.
EARLY_SHARE = 0.10  # "before 10% of the steps"
ACCURATE = 0.95
ACCURATE_LOGS = 3  # logged steps in a row
MIN_PLANNED_STEPS = 50  # a shorter run has no "early" to speak of


@monitor
class SeparatedEarlyMonitor(Monitor):
    """`rewards/accuracies` (the reward trainer's `accuracy`) at 0.95 or more for 3 logged steps in a row before
    10% of the planned steps, explained by the data's content-blind separability where it was measured."""

    rules = (TRIVIALLY_SEPARABLE,)
    reads = ("logs", "preference_data")

    def __init__(self, max_steps: int = 0) -> None:
        super().__init__()
        self.max_steps = max_steps
        self.data: Mapping[str, Any] = {}
        self.run: list[int] = []

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> Monitor:
        return cls(setup.max_steps)

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        if values.get("preference_data"):
            self.data = values["preference_data"]  # a lazy summary: read when the rule fires
        logs = values.get("logs")
        if not logs or self.max_steps < MIN_PLANNED_STEPS or step > EARLY_SHARE * self.max_steps:
            return []
        accuracy = logs.get("rewards/accuracies", logs.get("accuracy"))
        if accuracy is None:
            return []
        self.run = [*self.run, step] if accuracy >= ACCURATE else []
        if len(self.run) < ACCURATE_LOGS:
            return []
        strong = strongest(self.data.get("separability") or {}, self.data.get("pairs") or 0)
        found = dict(zip(("rule", "cause", "accuracy"), strong, strict=True)) if strong else {}
        cause = found.get("cause", "unknown")
        explained = (
            f"; {found['rule']} separates {found['accuracy']:.0%} of the pairs (see preference-trivially-separable)"
            if found
            else "; no content-blind rule measured explains it: check the pairs for a confound, lower the LR"
        )
        return self.fire(
            TRIVIALLY_SEPARABLE,
            f"the pairs are told apart at accuracy {fmt(accuracy)} by step {step}, before {EARLY_SHARE:.0%} of the "
            f"{self.max_steps} planned steps{explained}",
            step=step,
            evidence={
                "cause": cause,
                "accuracy": accuracy,
                "steps": list(self.run),
                "max_steps": self.max_steps,
                "separable": found or None,
            },
            severity="warning",
        )
