"""Length rules: max_len against the data and against the model."""

from __future__ import annotations

import numpy as np

from hf_sanity.catalog import define
from hf_sanity.measure import frameworks
from hf_sanity.measure.objective import SEQUENCES
from hf_sanity.remedies import RemedyDoc, keep_answers_whole

TRUNCATED_COMPLETION = define(
    "truncated-completion",
    severity="error",
    stage="tokens",
    objectives=SEQUENCES,
    symptom="Answers truncated mid-sentence; the model learns to stop in the middle of a thought.",
    detects="Completion tokens at positions >= max_len (truncation keeps the start). Warning when under 10% "
    "of examples are cut, error above. On a trainer's batches (cut before hf-sanity sees them, cause "
    "`trainer-max-length`): rows as long as the framework's cut (TRL's `max_length`, Axolotl's `sequence_len`; "
    "LLaMA-Factory's `cutoff_len`, which its trainer does not know: from the config where hf-sanity's LLaMA-Factory "
    "entry point runs it, else read off a first batch whose rows are all one length with an answer running to the "
    "last token) whose last answer has no end of turn, that end in a later turn whose answer the cut removed, or "
    "whose prompt lost its end and the assistant header (LLaMA-Factory cuts the longer of prompt and answer); the "
    "rows the trainer dropped (TRL: the cut left them no completion token); and the rows Axolotl's data preparation "
    "dropped before training for being longer than `sequence_len` (`excess_length_strategy: drop`, its default; "
    "counted where hf-sanity's Axolotl plugin or `hf-sanity run -- axolotl ...` ran the preparation, and recalled "
    "when a later run loads the rows it prepared: evidence `dropped_too_long` of `rows_prepared`). Said in the "
    "framework's terms.",
    fix="Drop or split the examples longer than max_len, or raise max_len until they fit; the finding says what "
    "each costs (the examples and supervised tokens dropped, or how much longer the longest sequences get).",
    remedy=RemedyDoc(
        "unsafe",
        "Under 10% of the examples cut: drops them (dataset.jsonl); more: the max_length that "
        "keeps 99% of them whole, as the training argument to use (fixes.json), and the rows it "
        "still cuts dropped.",
    ),
)

ERROR_FRACTION = 0.10
# Where each framework's cut length is set (the fix names it in the user's own terms).
CUT_FIX = {
    "TRL": "the trainer's max_length (`SFTConfig(max_length=...)`, `--max_length` on `trl sft`)",
    "Axolotl": "`sequence_len` in the Axolotl config (rows longer than it are dropped, or cut with "
    "`excess_length_strategy: truncate`)",
    "LLaMA-Factory": "`cutoff_len` in the LLaMA-Factory config (it splits the length between prompt and answer, "
    "cutting both)",
    "transformers": "the max_length your tokenization truncates to",
}


@TRUNCATED_COMPLETION.check
def check_truncated_completion(ctx):
    if ctx.options.arrived_cut_at:  # a trainer's batches: the cut happened before hf-sanity saw the rows
        yield from _cut_by_trainer(ctx, ctx.options.arrived_cut_at)
        return
    max_len = ctx.options.max_len
    if not max_len:
        return
    cut = ctx.valid & (ctx.col("n_completion_cut") > 0)
    if not cut.any():
        return
    lengths = ctx.col("n_tokens")[ctx.valid]
    n, n_cut = int(ctx.valid.sum()), int(cut.sum())
    fraction = n_cut / n
    p50, p90, p99 = (int(np.percentile(lengths, q)) for q in (50, 90, 99))
    # The shortest max_len that keeps at least 99% of the examples whole (an order statistic: with 25 examples
    # that is all of them).
    for_99 = int(np.sort(lengths)[int(np.ceil(0.99 * n)) - 1])
    for_all = int(ctx.col("n_tokens")[cut].max())  # the max_len that keeps every completion whole
    supervised = ctx.col("n_supervised")
    dropped = float(supervised[cut].sum() / max(int(supervised[ctx.valid].sum()), 1))
    rows = ctx.first(cut)
    examples = f"{n_cut} example{'s' if n_cut != 1 else ''}"
    drop = (
        f"drop or split the {examples} longer than max_len ({fraction:.1%} of the examples, {dropped:.1%} of the "
        "supervised tokens)"
    )
    grow = f"raise max_len to {for_all:,} to keep every completion whole (the longest sequences get "
    grow += f"{for_all / max_len:.1f}x as long: memory and time per batch"
    if max_len < for_99 < for_all:
        grow += f"; max_len={for_99:,} keeps 99% of the examples whole"
    grow += ")"
    first, second = (drop, grow) if fraction < ERROR_FRACTION else (grow, drop)
    think = _think_lost(ctx, cut)
    yield TRUNCATED_COMPLETION.finding(
        f"max_len={max_len:,} cuts into the completion of {n_cut} of {n} examples ({fraction:.1%}); the longest "
        f"is {for_all:,} tokens" + _think_said(think),
        evidence={
            **think,
            "max_len": max_len,
            "cut": n_cut,
            "fraction": fraction,
            "completion_tokens_lost": int(ctx.col("n_completion_cut")[ctx.valid].sum()),
            "length_p50": p50,
            "length_p90": p90,
            "length_p99": p99,
            "length_max": int(lengths.max()),
            "max_len_for_99pct": for_99,
            "max_len_for_all": for_all,
            "cut_supervised_fraction": round(dropped, 4),
            "rows": rows,
        },
        example=ctx.view(rows[0], focus=max_len - 1),
        severity="error" if fraction >= ERROR_FRACTION else "warning",
        fix=f"{first[0].upper()}{first[1:]}, or {second}.",
        rows=cut,
        remedy=keep_answers_whole(
            ctx, cut, for_99 if fraction >= ERROR_FRACTION else None, TRUNCATED_COMPLETION.slug
        ),
    )


def _cut_by_trainer(ctx, max_len: int):
    """Rows the trainer cut at ``max_len`` inside a completion (their end-of-turn gone) or before a later
    answer (multi-turn rows that keep an earlier one), and rows it dropped because the cut left them no
    completion token (TRL's SFTTrainer)."""
    mid_way = ctx.valid & ctx.col("arrived_cut").astype(bool)
    lost = ctx.valid & ctx.col("arrived_turn_lost").astype(bool)
    prompt_cut = ctx.valid & ctx.col("arrived_prompt_cut").astype(bool) & ~mid_way  # the prompt's end cut
    answers_cut = mid_way | lost
    cut = answers_cut | prompt_cut
    n, n_cut = int(ctx.valid.sum()), int(cut.sum())
    given, kept = ctx.trainer_rows or (None, None)
    dropped = given - kept if given is not None else 0
    framework = frameworks.of_trainer(ctx.trainer)
    prepared = frameworks.prepared_drop(framework)  # dropped for length before the trainer existed (Axolotl)
    too_long = prepared.too_long if prepared is not None else 0
    if not n_cut and not dropped and not too_long:
        return
    parts = []
    if answers_cut.any():
        how = [f"{int(mid_way.sum())} cut mid-answer"] if mid_way.any() else []
        if lost.any():
            how.append(f"{int(lost.sum())} losing a later answer whole (no token of it left after the cut)")
        n_answers = int(answers_cut.sum())
        parts.append(
            f"cuts into the answers of {n_answers} of the {n} examples inspected ({n_answers / n:.1%}: "
            f"{', '.join(how)})"
        )
    if prompt_cut.any():
        k = int(prompt_cut.sum())
        parts.append(
            f"cuts the prompt of {k} of the {n} examples inspected ({k / n:.1%}): the end of their prompt and the "
            "assistant header are gone, so the answer is trained right after a cut question, with no turn between"
        )
    if dropped:
        parts.append(
            f"dropped {dropped} of the {given} rows passed to it ({dropped / given:.1%}): the cut left them no "
            "completion token"
        )
    if too_long:
        parts.append(_prepared_drop_said(prepared))
    share = max(
        n_cut / max(n, 1),
        dropped / given if given else 0.0,
        too_long / prepared.rows_prepared if too_long else 0.0,
    )
    rows = ctx.first(cut) if n_cut else []
    think = _think_lost(ctx, cut)
    read_off = ctx.options.arrived_cut_source == "batch"  # not from the arguments or a framework's config
    owner = "the trainer" if framework is frameworks.TRANSFORMERS else framework.name
    setting = f"{owner}'s {framework.cut_key}"
    yield TRUNCATED_COMPLETION.finding(
        f"{setting}={max_len:,} "
        + " and ".join(parts)
        + _think_said(think)
        + (
            f" (every row of the first batch is {max_len:,} tokens long: the cut {framework.name} made)"
            if read_off
            else ""
        ),
        evidence={
            **think,
            "max_len": max_len,
            "cut": n_cut,
            "fraction": n_cut / max(n, 1),
            "examples_inspected": n,
            "cut_mid_answer": int(mid_way.sum()),
            "answer_lost": int(lost.sum()),
            "prompt_cut": int(prompt_cut.sum()),
            "dropped_by_trainer": dropped,
            "rows_passed": given,
            "cause": "trainer-max-length",
            "framework": framework.name,
            "setting": framework.cut_key,
            "cut_read_from": ctx.options.arrived_cut_source or "arguments",
            **(_prepared_drop_evidence(prepared) if too_long else {}),
            "rows": rows,
        },
        example=ctx.view(rows[0], focus=max_len - 1) if rows else None,
        severity="error" if share >= ERROR_FRACTION else "warning",
        fix=(
            _prepared_drop_fix(prepared)
            if too_long
            else f"Raise {CUT_FIX.get(framework.name, framework.cut_key)}, or drop or split the longest examples "
            "before training; `hf-sanity preflight --dataset ... --max-len N` prices each choice (the examples and "
            "supervised tokens a value cuts)."
        )
        + (
            " The completions cut here end without their end-of-turn token: the model learns to stop mid-answer; "
            "the answers removed whole are never trained."
            if answers_cut.any() or dropped
            else ""
        )
        + (
            " The answers whose prompt is cut are trained without the turn they answer: the model learns to answer "
            "a question it was never asked in the served format."
            if prompt_cut.any()
            else ""
        ),
        rows=cut if n_cut else None,
    )


def _prepared_drop_said(prepared) -> str:
    """The rows a framework's preparation dropped for length (Axolotl's `excess_length_strategy: drop`), in its
    terms: how many of how many, how long, and whose choice the strategy was."""
    longest = f" (the longest {prepared.longest:,})" if prepared.longest else ""
    whose = "as set in the config" if prepared.strategy_set else f"{prepared.framework}'s default"
    when = (
        " (when it prepared the rows this run loaded from `dataset_prepared_path`)"
        if prepared.prepared_earlier
        else ""
    )
    return (
        f"dropped {prepared.too_long} of the {prepared.rows_prepared} rows its data preparation tokenized "
        f"({prepared.too_long / prepared.rows_prepared:.1%}) before training{when}: rows longer than "
        f"{prepared.cut:,} tokens{longest}, never trained (`excess_length_strategy: {prepared.strategy}`, {whose})"
    )


def _prepared_drop_evidence(prepared) -> dict:
    return {
        "dropped_too_long": prepared.too_long,
        "rows_prepared": prepared.rows_prepared,
        "fraction_dropped": prepared.too_long / prepared.rows_prepared,
        "longest_dropped": prepared.longest,
        "excess_length_strategy": prepared.strategy,
        "strategy_is_default": not prepared.strategy_set,
        **({"dropped_other": prepared.other_dropped} if prepared.other_dropped else {}),
        **({"prepared_earlier": True} if prepared.prepared_earlier else {}),
    }


def _prepared_drop_fix(prepared) -> str:
    """The three ways out in Axolotl's config, each with what it costs."""
    grow = f"Raise `sequence_len` in the {prepared.framework} config"
    if prepared.longest:
        grow += (
            f" to {prepared.longest:,} to keep every row (the longest sequences grow "
            f"{prepared.longest / prepared.cut - 1:.0%}: memory and time per batch)"
        )
    return (
        f"{grow}; or set `excess_length_strategy: truncate` to train the long rows cut at sequence_len (what is "
        "past the cut is never trained; an answer cut ends without its end-of-turn token, and the model learns to "
        "stop mid-answer, which truncated-completion then reports); or shorten or split the rows longer than "
        f"{prepared.cut:,} tokens before training. With the strategy or the rows changed, delete the rows Axolotl "
        "prepared under `dataset_prepared_path` (its hash of them leaves both out: it would load the rows it "
        "dropped again). `hf-sanity preflight --dataset ... --max-len N` prices each length (the examples and "
        "supervised tokens it cuts)."
    )


def _think_lost(ctx, cut) -> dict:
    """Of the cut rows, those whose answer opened a think block the cut left without its close (evidence keys;
    none when no cut row did): the model is also trained on thinking that never ends (see think-unclosed)."""
    from hf_sanity.measure.agents import think_unclosed

    measured = think_unclosed(ctx)
    lost = [i for i in (measured or {}).get("rows", ()) if cut[i]]
    return {"think_unclosed": len(lost), "think_unclosed_rows": lost[:10]} if lost else {}


def _think_said(think: dict) -> str:
    n = think.get("think_unclosed")
    return f"; {n} of them lose the close of their think block (`</think>`)" if n else ""


def model_window(config) -> tuple[int | None, int | None]:
    """(max_position_embeddings, sliding_window) of a text config."""
    if config is None:
        return None, None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    return positions, window


MAX_LEN_EXCEEDS_MODEL = define(
    "max-len-exceeds-model",
    severity="error",
    stage="tokens",
    objectives=SEQUENCES,
    symptom="Position embeddings run out: index errors on long batches, or garbage beyond the trained length.",
    detects="max_len is larger than the model's `max_position_embeddings`: an error when rows are longer than "
    "the positions (they reach past them), a warning when no row is (TRL's default max_length=1024 on a "
    "512-position model with short rows: nothing breaks until a longer row comes).",
    fix="Set max_len <= max_position_embeddings, or extend the context properly (RoPE scaling) before training.",
)


@MAX_LEN_EXCEEDS_MODEL.check
def check_max_len_exceeds_model(ctx):
    positions, _ = model_window(ctx.model_config)
    max_len = ctx.options.max_len
    if not (positions and max_len and max_len > positions):
        return
    lengths = ctx.col("n_tokens")[ctx.valid]  # cut at max_len, a row longer than the positions still is
    beyond = int((lengths > positions).sum())
    longest = int(lengths.max()) if len(lengths) else 0
    evidence = {
        "max_len": max_len,
        "max_position_embeddings": positions,
        "longest": longest,
        "beyond": beyond,
    }
    if beyond:
        yield MAX_LEN_EXCEEDS_MODEL.finding(
            f"max_len={max_len} exceeds the model's max_position_embeddings={positions}, and {beyond} of "
            f"{len(lengths)} rows are longer than {positions} tokens (the longest {longest:,})",
            evidence=evidence,
        )
    else:
        yield MAX_LEN_EXCEEDS_MODEL.finding(
            f"max_len={max_len} exceeds the model's max_position_embeddings={positions}; no row reaches it now "
            f"(the longest is {longest:,} tokens), a longer one would",
            evidence=evidence,
            severity="warning",
        )


CONTEXT_BEYOND_WINDOW = define(
    "context-beyond-window",
    severity="warning",
    stage="tokens",
    objectives=SEQUENCES,
    symptom="RAG answers ignore retrieved context: the context lies past what the model attends to.",
    detects="Training inputs (after truncation) longer than the model's sliding-window attention or its position range.",
    fix="Shorten the inputs (fewer or smaller retrieved chunks, context first), or use a model whose window covers them.",
)


def _window_known(ctx) -> bool:
    """The model's config says its positions or its attention window: something to compare lengths with."""
    return any(model_window(ctx.model_config))


@CONTEXT_BEYOND_WINDOW.check(applies=_window_known)
def check_context_beyond_window(ctx):
    positions, window = model_window(ctx.model_config)
    limit = min(x for x in (positions, window) if x) if (positions or window) else None
    if not limit:
        return
    lengths = ctx.col("n_tokens")
    if ctx.options.max_len:
        lengths = np.minimum(lengths, ctx.options.max_len)
    beyond = ctx.valid & (lengths > limit)
    if not beyond.any():
        return
    n = int(ctx.valid.sum())
    kind = "sliding window" if window and limit == window else "position range"
    yield CONTEXT_BEYOND_WINDOW.finding(
        f"{int(beyond.sum())} of {n} inputs ({beyond.sum() / n:.1%}) are longer than the model's {kind} of {limit} tokens",
        evidence={
            "count": int(beyond.sum()),
            "fraction": float(beyond.sum() / n),
            "window": limit,
            "kind": kind,
            "longest": int(lengths.max()),
            "rows": ctx.first(beyond),
        },
        rows=beyond,
    )
