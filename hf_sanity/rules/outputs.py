"""Output rules: what the fine-tuned model actually says for held-out prompts (`hf-sanity outputs`, and
`SanityCallback(generate_every=...)` at evaluations).

Each detector reads one :class:`~hf_sanity.measure.generate.Generations` (greedy generations, measured once)
and yields findings with the evidence (the fraction, the rows, a side-by-side of prompt / generation /
reference) and a fix that names the upstream rule explaining the symptom: a model that never stops did not
learn its end of turn (``eos-not-learned``), one that echoes its prompt was trained to write it
(``prompt-in-loss``), stray markers come from another chat template (``template-mismatch``), outputs equal to
the base model's from an adapter that is not applied (``adapter-not-loaded``), cut answers from cut training
answers (``truncated-completion``). ``stop-token-mismatch`` (rules/template.py) also runs here.

Thresholds were calibrated on `hf_sanity.testing.trained` fixtures: a correctly fine-tuned tiny model (three
training seeds, 64 held-out prompts each, 256 new tokens) measured 0 on every share below; each planted bug
measured 0.9 or more on its own (docs/benchmarks.md, "Output checks: calibration").
"""

from __future__ import annotations

import re
from collections import Counter

from hf_sanity.catalog import define
from hf_sanity.measure.objective import ANY
from hf_sanity.numbers import fmt
from hf_sanity.outputview import side_by_side

# A rule fires when at least this share of the judged generations shows its symptom.
NEVER_STOPS_SHARE = 0.2
STRAY_SHARE = 0.1
ECHO_SHARE = 0.2
LOOP_SHARE = 0.2
TRUNCATED_SHARE = 0.2
IDENTICAL_SHARE = 0.9
# One answer repeated across prompts: the most common non-empty answer on IDENTICAL_OUTPUTS_SHARE of the distinct
# prompts (an error from IDENTICAL_OUTPUTS_ERROR), judged on IDENTICAL_MIN_PROMPTS distinct prompts or more.
IDENTICAL_OUTPUTS_SHARE = 0.5
IDENTICAL_OUTPUTS_ERROR = 0.8
IDENTICAL_MIN_PROMPTS = 5
# One generation echoes a prompt text when it starts (within its first ECHO_OFFSET words) with that text's
# first words, at least ECHO_MIN_WORDS of them and ECHO_COVER of the text.
ECHO_OFFSET = 3
ECHO_MIN_WORDS = 4
ECHO_COVER = 0.6
# One generation loops when one n-gram repeated back to back (4+ times) covers LOOP_COVER of it.
LOOP_COVER = 0.3
# A marker is the cause of a rule's symptom when it is in MARKER_CAUSE of the generations (or more).
MARKER_CAUSE = 0.5
# One answer is truncated when it stops at TRUNCATED_RATIO of the reference's tokens or less, mid-sentence;
# references shorter than TRUNCATED_MIN_REFERENCE tokens are not judged.
TRUNCATED_RATIO = 0.5
TRUNCATED_MIN_REFERENCE = 4
SENTENCE_END = tuple(".!?…。！？\"'”’)]}>`*|")
# A line that is only a role header, as a template writes one when its special tokens are stripped.
ROLE_HEADER = re.compile(
    r"(?m)^[ \t]*(?:#{1,3}[ \t]*)?(?:user|assistant|system|human|gpt)[ \t]*:?[ \t]*$", re.IGNORECASE
)


def _share(count: int, total: int) -> float:
    return count / total if total else 0.0


# -- never-stops -------------------------------------------------------------------------------------------
NEVER_STOPS = define(
    "never-stops",
    severity="error",
    stage="outputs",
    objectives=ANY,
    symptom="The model never stops: it answers, then runs on (a new turn, repetitions) until max_new_tokens.",
    detects="Greedy generations for held-out prompts that reach max_new_tokens without the end-of-turn or EOS "
    f"token; an error when {NEVER_STOPS_SHARE:.0%} or more of them do (prompts whose reference answer is longer "
    "than max_new_tokens are not judged). Generation stops on the served stop tokens and on the template's "
    "end of turn, so a generation config that forgets the latter is stop-token-mismatch, not this. The cause "
    f"is template-mismatch only when {MARKER_CAUSE:.0%} or more of them carry another template's markers; the "
    "served template's own turn markers (a new turn written after the answer) mean eos-not-learned.",
    fix="Train the end of turn: keep the end-of-turn/EOS token in the labels (see eos-not-learned: pad == EOS "
    "masked by the collator, text data without EOS), then fine-tune again. A model that writes its own "
    "template's next turn (`<|im_start|>user`) did not learn to stop: adding that marker to the stop tokens "
    "hides the bug. If the outputs carry another template's markers, train and serve with the same chat "
    "template (template-mismatch).",
)


@NEVER_STOPS.detector("outputs")
def never_stops(gens):
    judged = [
        s for s in gens.samples if s.reference_tokens is None or s.reference_tokens < gens.max_new_tokens
    ]
    running = [s for s in judged if not s.stopped]
    share = _share(len(running), len(judged))
    if not running or share < NEVER_STOPS_SHARE:
        return
    expected = gens.expected_stop
    written = Counter(m for s in running for m in gens.markers if m in s.raw)
    # The served template's own turn markers (ChatML's `<|im_start|>`) in a generation that did not stop are
    # the model running on into the next turn: its end of turn is not learned. Only another template's
    # markers say it was trained with another template.
    own = set(gens.own_markers)
    foreign = {m: n for m, n in written.items() if m != expected and m not in own}
    next_turn = {m: n for m, n in written.items() if m != expected and m in own}
    if expected and expected in written:
        cause = "markers-not-atomic"
        why = (
            f"the model writes {expected!r} as text (in {written[expected]} of them) but never as the one token "
            "generation stops on: the end-of-turn marker is split into pieces by this tokenizer"
        )
        fix = (
            f"Make {expected!r} one token of the tokenizer (see markers-not-atomic), train with it in the labels "
            "(eos-not-learned), and serve with the same tokenizer."
        )
    elif foreign and max(foreign.values()) >= MARKER_CAUSE * len(running):
        marker = max(foreign, key=foreign.get)
        cause = "template-mismatch"
        why = (
            f"the model ends its turns with {marker!r} (in {foreign[marker]} of them), which the served template "
            "does not stop on: it was trained with another chat template than the one it is served with"
        )
        fix = (
            "Serve with the tokenizer and chat template the model was trained with (save the tokenizer with the "
            f"model; see template-mismatch), or add {marker!r} to the generation config's eos_token_id only if "
            "that template is the one you mean to serve."
        )
    else:
        cause = "eos-not-learned"
        why = f"the model never emits {expected!r}: it did not learn to end its turn"
        if next_turn:
            marker = max(next_turn, key=next_turn.get)
            why += (
                f" and runs on into the next turn (it writes its own template's {marker!r} in "
                f"{next_turn[marker]} of them)"
            )
        fix = None
    looping = sum(1 for s in running if loops(s))
    yield NEVER_STOPS.finding(
        f"{len(running)} of {len(judged)} generations ({share:.0%}) reach max_new_tokens={gens.max_new_tokens} "
        f"without {expected!r}; {why}",
        evidence={
            "cause": cause,
            "fraction": share,
            "never_stopped": len(running),
            "judged": len(judged),
            "expected_stop": expected,
            "stop_tokens": sorted(gens.token_names.get(i, str(i)) for i in gens.stop_ids),
            "markers_written": dict(written.most_common(5)),
            "looping": looping,
            "rows": [s.row for s in running[:10]],
        },
        example=side_by_side(
            gens, "never stops", running, marks=lambda s: [m for m in written if m in s.raw]
        ),
        fix=fix,
        rows=[s.row for s in running],
    )


# -- stray-markers-in-output ---------------------------------------------------------------------------------
STRAY_MARKERS_IN_OUTPUT = define(
    "stray-markers-in-output",
    severity="error",
    stage="outputs",
    objectives=ANY,
    symptom="Generated answers contain template or role markers (`<|im_start|>`, `[INST]`, `### Response:`, an "
    "`assistant` header): the model was trained with another chat format, or runs on into a new turn.",
    detects="The generated text (special tokens kept, the stop token excluded) is searched for the tokenizer's "
    "special tokens, every known chat format's turn markers and lines that are only a role header; an error "
    f"when {STRAY_SHARE:.0%} or more of the generations carry one.",
    fix="Train and serve with the same chat template (template-mismatch: save the tokenizer with the model); "
    "markers of the served template's own next turn mean the model did not stop (eos-not-learned, "
    "stop-token-mismatch).",
)


def _strays(gens, sample) -> list[str]:
    found = [m for m in gens.markers if m in sample.raw]
    found += [h.strip() for h in ROLE_HEADER.findall(sample.raw)]
    return found


@STRAY_MARKERS_IN_OUTPUT.detector("outputs")
def stray_markers_in_output(gens):
    hits = {s.row: _strays(gens, s) for s in gens.samples}
    bad = [s for s in gens.samples if hits[s.row]]
    share = _share(len(bad), len(gens.samples))
    if not bad or share < STRAY_SHARE:
        return
    counts = Counter(m for s in bad for m in set(hits[s.row]))
    own = set(gens.own_markers)
    top, top_n = counts.most_common(1)[0]
    if top_n >= MARKER_CAUSE * len(gens.samples) and top not in own:
        cause = "template-mismatch"
        why = f"{top!r} is not a marker of the served chat template: the model was trained with another one"
        fix = (
            "The model writes another chat format's markers: train and serve with the same chat template (see "
            "template-mismatch; save the tokenizer with the model and serve with it), and strip such markers "
            "from the training data (stray-template-markers)."
        )
    elif top_n >= MARKER_CAUSE * len(gens.samples):
        cause = "runs-into-next-turn"
        why = f"{top!r} is the served template's own turn marker: the model runs past its end of turn"
        fix = (
            "The model writes the next turn itself: it did not stop. Keep the end-of-turn token in the labels "
            "(eos-not-learned) and make generation stop on it (stop-token-mismatch)."
        )
    else:
        cause = "scattered"
        why = "no one marker dominates: the model scatters special tokens through its answers"
        fix = (
            "Markers scattered through the answers come from a barely trained model (check the loss curve) or "
            "from training and serving with different chat templates (template-mismatch): compare the "
            "tokenizer you serve with against the one you trained with."
        )
    yield STRAY_MARKERS_IN_OUTPUT.finding(
        f"{len(bad)} of {len(gens.samples)} generations ({share:.0%}) contain template markers (most common: "
        f"{counts.most_common(1)[0][0]!r}); {why}",
        evidence={
            "cause": cause,
            "fraction": share,
            "with_markers": len(bad),
            "generations": len(gens.samples),
            "markers": dict(counts.most_common(8)),
            "rows": [s.row for s in bad[:10]],
        },
        example=side_by_side(gens, "stray markers", bad, marks=lambda s: hits[s.row]),
        fix=fix,
        rows=[s.row for s in bad],
    )


# -- repeats-prompt ------------------------------------------------------------------------------------------
REPEATS_PROMPT = define(
    "repeats-prompt",
    severity="warning",
    stage="outputs",
    objectives=ANY,
    symptom="The model answers by first copying the user's message (or the system prompt) back.",
    detects=f"A generation that opens (within its first {ECHO_OFFSET} words) with the first words of the last "
    f"user turn or the system prompt, in order: at least {ECHO_MIN_WORDS} words and {ECHO_COVER:.0%} of that "
    "text (restating part of the question, as in 'The capital of France is Paris.', is not an echo); a "
    f"warning when {ECHO_SHARE:.0%} or more of the generations echo.",
    fix="The model learned to write the prompt: check that the completions do not open with it (a completion "
    "built as prompt + answer: `hf-sanity preflight` reports it as answer-repeats-prompt) and that the loss is "
    "on the answers only (prompt-in-loss).",
)


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def copied_words(generation: str, source: str) -> int:
    """How many of ``source``'s words, from its first, ``generation`` reproduces in order, starting within
    its first ECHO_OFFSET words."""
    wanted = _words(source)
    said = _words(generation)[: len(wanted) + ECHO_OFFSET]
    best = 0
    for start in range(min(ECHO_OFFSET + 1, len(said))):
        k = 0
        while start + k < len(said) and k < len(wanted) and said[start + k] == wanted[k]:
            k += 1
        best = max(best, k)
    return best


def echo_of(sample) -> tuple[str, int, int] | None:
    """(the echoed prompt text, words copied, its words) when the sample echoes one, else None."""
    for source in sample.sources:
        total = len(_words(source))
        copied = copied_words(sample.text, source)
        if copied >= min(ECHO_MIN_WORDS, total) and total and copied / total >= ECHO_COVER and copied >= 2:
            return source, copied, total
    return None


@REPEATS_PROMPT.detector("outputs")
def repeats_prompt(gens):
    echoes = {s.row: echo_of(s) for s in gens.samples}
    bad = [s for s in gens.samples if echoes[s.row]]
    share = _share(len(bad), len(gens.samples))
    if not bad or share < ECHO_SHARE:
        return
    first = bad[0]
    _, copied, total = echoes[first.row]
    yield REPEATS_PROMPT.finding(
        f"{len(bad)} of {len(gens.samples)} generations ({share:.0%}) start by copying the prompt (e.g. row "
        f"{first.row}: {copied} of its {total} words, in order)",
        evidence={
            "fraction": share,
            "echoes": len(bad),
            "generations": len(gens.samples),
            "copied_share": [round(echoes[s.row][1] / echoes[s.row][2], 3) for s in bad[:10]],
            "rows": [s.row for s in bad[:10]],
        },
        example=side_by_side(gens, "echoes the prompt", bad, marks=lambda s: [echoes[s.row][0]]),
        rows=[s.row for s in bad],
    )


# -- repetition-loop -----------------------------------------------------------------------------------------
REPETITION_LOOP = define(
    "repetition-loop",
    severity="warning",
    stage="outputs",
    objectives=ANY,
    symptom="Degenerate output: the model repeats the same word or phrase over and over (often to the end).",
    detects="The longest back-to-back repetition of one n-gram (up to 64 tokens, at least 4 times in a row) in "
    f"each generation; a generation loops when it covers {LOOP_COVER:.0%} or more of it; a warning when "
    f"{LOOP_SHARE:.0%} or more of the generations loop.",
    fix="A model that loops is barely trained (check the loss curve: underfitting, a learning rate too low, too "
    "few steps) or has not learned to end its answer (eos-not-learned); duplicated training rows "
    "(duplicate-examples) make it worse. A repetition penalty at serving time hides the symptom, not the cause.",
)


def loops(sample) -> bool:
    return sample.loop_tokens > 0 and sample.loop_tokens >= LOOP_COVER * max(len(sample.body), 1)


@REPETITION_LOOP.detector("outputs")
def repetition_loop(gens):
    bad = [s for s in gens.samples if loops(s)]
    share = _share(len(bad), len(gens.samples))
    if not bad or share < LOOP_SHARE:
        return
    first = bad[0]
    to_end = sum(1 for s in bad if s.loop_end >= len(s.body) - 1)
    yield REPETITION_LOOP.finding(
        f"{len(bad)} of {len(gens.samples)} generations ({share:.0%}) repeat one phrase over and over (e.g. row "
        f"{first.row}: {first.loop_unit!r} over {first.loop_tokens} of its {len(first.body)} tokens); {to_end} of "
        "them to the end",
        evidence={
            "fraction": share,
            "looping": len(bad),
            "generations": len(gens.samples),
            "to_the_end": to_end,
            "periods": [s.loop_period for s in bad[:10]],
            "loop_share": [round(s.loop_tokens / max(len(s.body), 1), 3) for s in bad[:10]],
            "rows": [s.row for s in bad[:10]],
        },
        example=side_by_side(gens, "repetition loop", bad, marks=lambda s: [s.loop_unit]),
        rows=[s.row for s in bad],
    )


# -- answer-truncated ----------------------------------------------------------------------------------------
ANSWER_TRUNCATED = define(
    "answer-truncated",
    severity="warning",
    stage="outputs",
    objectives=ANY,
    symptom="Answers stop early, in the middle of a sentence (or at once, empty), far shorter than the answers the "
    "model was trained on.",
    detects="With reference answers: a generation that stops (end of turn or EOS) at "
    f"{TRUNCATED_RATIO:.0%} or less of its reference's length in tokens and mid-sentence, where the reference "
    f"ends a sentence; a warning when {TRUNCATED_SHARE:.0%} or more of the judged generations are cut.",
    fix="The model learned to stop mid-answer: training answers were cut with their end-of-turn token kept "
    "(truncation that re-appends EOS, answers clipped while exporting). Raise max_len or drop the long "
    "examples (truncated-completion), and check the training answers end where the references do.",
)


def _ends_sentence(text: str) -> bool:
    text = text.rstrip()
    return bool(text) and text.endswith(SENTENCE_END)


def truncated(sample) -> bool:
    return (
        sample.stopped
        and len(sample.body) <= TRUNCATED_RATIO * sample.reference_tokens
        and not _ends_sentence(sample.text)
    )


@ANSWER_TRUNCATED.detector("outputs")
def answer_truncated(gens):
    judged = [
        s
        for s in gens.samples
        if s.reference is not None
        and (s.reference_tokens or 0) >= TRUNCATED_MIN_REFERENCE
        and _ends_sentence(s.reference)
    ]
    bad = [s for s in judged if truncated(s)]
    share = _share(len(bad), len(judged))
    if not bad or share < TRUNCATED_SHARE:
        return
    ratios = [round(len(s.body) / s.reference_tokens, 3) for s in bad]
    empty = sum(1 for s in bad if not s.text.strip())
    yield ANSWER_TRUNCATED.finding(
        f"{len(bad)} of {len(judged)} generations ({share:.0%}) stop mid-sentence at {min(ratios):.0%}-"
        f"{max(ratios):.0%} of their reference's length" + (f" ({empty} of them empty)" if empty else ""),
        evidence={
            "fraction": share,
            "truncated": len(bad),
            "empty": empty,
            "judged": len(judged),
            "length_ratio": ratios[:10],
            "rows": [s.row for s in bad[:10]],
        },
        example=side_by_side(gens, "answer cut short", bad),
        rows=[s.row for s in bad],
    )


# -- identical-outputs -------------------------------------------------------------------------------------
IDENTICAL_OUTPUTS = define(
    "identical-outputs",
    severity="warning",
    stage="outputs",
    objectives=ANY,
    symptom="The model gives one answer to every prompt (the same sentence whatever it is asked).",
    detects=f"Among {IDENTICAL_MIN_PROMPTS}+ distinct held-out prompts with a non-empty answer (whitespace "
    "collapsed), the most common answer is given to "
    f"{IDENTICAL_OUTPUTS_SHARE:.0%} or more of them: a warning; an error at {IDENTICAL_OUTPUTS_ERROR:.0%} or more "
    "(the model ignores its prompt). Not where the reference answers are themselves that repetitive (a "
    f"classification set whose references share one label on {IDENTICAL_OUTPUTS_SHARE:.0%} or more of the "
    "prompts). The evidence names the answer, its share and the prompts that got another one.",
    fix="The model answers without reading its prompt: it is barely trained (a few steps on random weights "
    "collapse to one likely sentence: train longer or at a higher LR, check the loss fell), or it was trained to "
    "say one thing (the completions in the data are all the same text: a column mapped wrong, a constant "
    "target; look at them with `hf-sanity show`), or the prompt does not reach it (check attention-mask and "
    "truncation findings). Compare with the base model (--base) to see whether the fine-tuning did it.",
)


def _answer(text: str) -> str:
    return " ".join(text.split())


@IDENTICAL_OUTPUTS.detector("outputs")
def identical_outputs(gens):
    by_prompt = {}  # one sample per distinct prompt: a held-out set that repeats a prompt repeats its answer
    for sample in gens.samples:
        if _answer(sample.text):
            by_prompt.setdefault(sample.prompt, sample)
    judged = list(by_prompt.values())
    if len(judged) < IDENTICAL_MIN_PROMPTS:
        return
    answers = Counter(_answer(s.text) for s in judged)
    answer, count = answers.most_common(1)[0]
    share = _share(count, len(judged))
    if count < 2 or share < IDENTICAL_OUTPUTS_SHARE:
        return
    references = [_answer(s.reference) for s in judged if s.reference]
    reference_share = (
        _share(Counter(references).most_common(1)[0][1], len(references)) if references else None
    )
    if reference_share is not None and reference_share >= IDENTICAL_OUTPUTS_SHARE:
        return  # the expected answers repeat too: the set asks one question many ways
    same = [s for s in judged if _answer(s.text) == answer]
    other = [s.row for s in judged if _answer(s.text) != answer]
    severity = "error" if share >= IDENTICAL_OUTPUTS_ERROR else "warning"
    shown = answer if len(answer) <= 80 else answer[:77] + "..."
    yield IDENTICAL_OUTPUTS.finding(
        f"{count} of {len(judged)} distinct prompts ({share:.0%}) get the same answer {shown!r}"
        + (", whatever they ask" if share >= IDENTICAL_OUTPUTS_ERROR else "")
        + f"; {len(answers)} distinct answer{'s' if len(answers) != 1 else ''} in all",
        severity=severity,
        evidence={
            "answer": answer,
            "share": round(share, 4),
            "same_answer": count,
            "prompts": len(judged),
            "distinct_answers": len(answers),
            "stopped": sum(1 for s in same if s.stopped),
            "reference_share": None if reference_share is None else round(reference_share, 4),
            "rows": [s.row for s in same[:10]],
            "other_rows": other[:10],
        },
        example=side_by_side(gens, "the same answer to every prompt", same),
        rows=[s.row for s in same],
    )


# -- adapter-no-effect ---------------------------------------------------------------------------------------
ADAPTER_NO_EFFECT = define(
    "adapter-no-effect",
    severity="error",
    stage="outputs",
    objectives={"sft", "unknown"},
    symptom="The fine-tuned model answers exactly like the base model: the adapter is not loaded, or did nothing.",
    detects="With a base model to compare (--base): the greedy generations of the fine-tuned model and of the "
    f"base model for the same prompts are compared token for token; an error when {IDENTICAL_SHARE:.0%} or "
    "more are identical. Not after preference or RL training, whose policy starts as its reference and may "
    "keep the same greedy answers (policy-drift compares those runs with their base).",
    fix="Serve the model with its adapter applied: PeftModel.from_pretrained(base, adapter), or "
    "merge_and_unload() and save the merged model (see adapter-not-loaded); check the adapter was trained "
    "(adapter-untrained) and that the folder you serve is the one training wrote.",
)


@ADAPTER_NO_EFFECT.detector("outputs", applies=lambda gens: gens.has_base)
def adapter_no_effect(gens):
    compared = [s for s in gens.samples if s.base_ids is not None]
    same = [s for s in compared if s.ids == s.base_ids]
    share = _share(len(same), len(compared))
    if not same or share < IDENTICAL_SHARE:
        return
    differ = [s.row for s in compared if s.ids != s.base_ids]
    yield ADAPTER_NO_EFFECT.finding(
        f"{len(same)} of {len(compared)} generations ({share:.0%}) are identical, token for token, to the base "
        "model's: the fine-tuning is not in the model that was run",
        evidence={
            "fraction": share,
            "identical": len(same),
            "compared": len(compared),
            "differing_rows": differ[:10],
        },
        example=side_by_side(gens, "identical to the base model", same, base=True),
    )


POLICY_DRIFT = define(
    "policy-drift",
    severity="warning",
    stage="outputs",
    objectives={"preference", "preference-unpaired", "rl"},
    symptom="After preference or RL training the model answers in another way than its base: much longer or "
    "shorter, no longer ending its turn, repeating itself. Rewards or margins rose; the answers got worse.",
    detects="With a base model to compare (--base), on a preference or RL run (the dataset's columns, or "
    "`--objective`): the tuned model's answers against the base's for the same prompts: mean length ratio above "
    "1.5 or below 0.5 (`evidence.cause` `length`), the share that ends its turn down by more than 20 points "
    "(`stops-less`), the share that loops up by more than 10 points (`repetition`). After RL with reward "
    "functions given (`outputs(..., reward_funcs=..., train_reward=...)`): their reward on the held-out "
    "generations below the reward of the run's last 10% of steps by more than 0.1 (`reward-drop`: the policy "
    "learned the training prompts, or a reward it could game).",
    fix="Anchor the policy to where it started: a lower LR, fewer steps, a larger beta (KL to the reference), an "
    'NLL term on the chosen answers (`loss_type=["sigmoid", "sft"]`), `loss_type="dapo"`/`"dr_grpo"` '
    "against GRPO's length bias; check the data for a length confound (preference-trivially-separable).",
)
DRIFT_LENGTH = (0.5, 1.5)
DRIFT_STOPS = 0.20
DRIFT_LOOPS = 0.10
DRIFT_REWARD = 0.10


def _base_loops(sample, stop_ids) -> bool:
    from hf_sanity.measure.generate import repeated_run

    body = list(sample.base_ids or ())
    if body and body[-1] in stop_ids:
        body = body[:-1]
    _, tokens, _ = repeated_run(body)
    return tokens > 0 and tokens >= LOOP_COVER * max(len(body), 1)


def _reward_drop(gens) -> float | None:
    rewards = gens.rewards or {}
    held_out, train = rewards.get("held_out"), rewards.get("train")
    return None if held_out is None or train is None else train - held_out


@POLICY_DRIFT.detector("outputs", applies=lambda gens: gens.has_base or bool(gens.rewards))
def policy_drift(gens):
    compared = [s for s in gens.samples if s.base_ids is not None]
    drop = _reward_drop(gens)
    if not compared and drop is None:
        return
    n = max(1, len(compared))
    tuned_len = sum(len(s.body) for s in compared) / n
    base_len = (
        sum(len(s.base_ids) - (s.base_ids[-1] in gens.stop_ids if s.base_ids else 0) for s in compared) / n
    )
    ratio = tuned_len / base_len if base_len else 1.0 if not compared else float("inf")
    stops = sum(s.stopped for s in compared) / n
    base_stops = sum(bool(s.base_ids) and s.base_ids[-1] in gens.stop_ids for s in compared) / n
    looping = sum(loops(s) for s in compared) / n
    base_looping = sum(_base_loops(s, gens.stop_ids) for s in compared) / n
    causes = []
    if not DRIFT_LENGTH[0] <= ratio <= DRIFT_LENGTH[1]:
        causes.append("length")
    if base_stops - stops > DRIFT_STOPS:
        causes.append("stops-less")
    if looping - base_looping > DRIFT_LOOPS:
        causes.append("repetition")
    if drop is not None and drop > DRIFT_REWARD:
        causes.append("reward-drop")
    if not causes:
        return
    said = {
        "length": f"answers {ratio:.2f}x as long as the base's ({tuned_len:.0f} vs {base_len:.0f} tokens)",
        "stops-less": f"{stops:.0%} end their turn (base: {base_stops:.0%})",
        "repetition": f"{looping:.0%} loop (base: {base_looping:.0%})",
        "reward-drop": f"the reward on held-out prompts is {fmt((gens.rewards or {}).get('held_out'))}, "
        f"{fmt(drop)} below the last training steps' {fmt((gens.rewards or {}).get('train'))}",
    }
    what = (
        f"drifted from its base on {n} prompts"
        if compared
        else f"drifted on {len(gens.samples)} held-out prompts"
    )
    yield POLICY_DRIFT.finding(
        f"the tuned model {what}: " + "; ".join(said[c] for c in causes),
        evidence={
            "cause": causes[0],
            "causes": causes,
            "length_ratio": ratio,
            "mean_tokens": tuned_len,
            "base_mean_tokens": base_len,
            "stopped": stops,
            "base_stopped": base_stops,
            "looping": looping,
            "base_looping": base_looping,
            "compared": len(compared),
            **({"rewards": dict(gens.rewards)} if gens.rewards else {}),
        },
        example=side_by_side(gens, "drifted from the base model", compared, base=True) if compared else None,
    )
