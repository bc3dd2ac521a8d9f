"""RL fine-tuning from reward functions (TRL's GRPOTrainer, RLOOTrainer), before training and as it runs: reward
functions that cannot score what the trainer will pass them, completions cut at `max_completion_length`, groups
too small for the reward's pass rate.

Before training the rules read ``ctx.rl`` (`hf_sanity.measure.rl.Rollouts`): a group of completions the model
generates for a few prompts with the trainer's own generation settings, and every reward function called on them
and on completions built from the dataset's answers, in the exact shape TRL passes. In training they read TRL's
logged metrics (``logs``) and the callback's dry run at train begin (``reward_dry_run``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import RL
from hf_sanity.measure.rl import CONTINUE_FACTOR, group_size_for_signal, rate_upper_bound, uninformative_share
from hf_sanity.numbers import fmt
from hf_sanity.rules.training.base import Monitor, TrainingSetup

REWARD_FUNCTION_BROKEN = define(
    "reward-function-broken",
    severity="error",
    stage="trainer",
    objectives=RL,
    symptom="The reward stays flat and `loss` and `grad_norm` sit at 0: the reward function gives every "
    "completion the same score (or crashes at the first step).",
    detects="Before training (preflight, and the callback at train begin): every reward function is called the way "
    "TRL calls it, each call in a child process that is killed at its time limit (nothing it draws, writes or "
    "starts reaches the run; on the main process only under torch.distributed, its verdict shared with every "
    "rank; where no fork exists nothing is called and the report says so), on 16 completions built from the "
    "dataset's own answers (the "
    "answer, the same in a reasoning format over several lines, a wrong answer of the same shape, an empty one) "
    "and, in preflight, on a group the model generates for each of 4 prompts: strings for text prompts, "
    '`[{"role": "assistant", "content": ...}]` for conversational ones, special tokens stripped as '
    "`skip_special_tokens` strips them, the dataset's columns as keyword arguments, `prompts`, `completion_ids`, "
    "`trainer_state`. Error when it raises, returns the wrong number of rewards, returns None for more than 10% "
    "of them, or one value for completions that differ without reading them (constant by construction: called "
    "again with completions that fail on any use, it returns the same without touching them; a warning when "
    "another function varies, or when that could not be told). One that reads its completions and gave them one "
    "value is sparse (zero on these samples), not broken: group-too-small and reward-zero-advantage say its pass "
    "rate. "
    "`evidence.cause`: `completion-type` (constant on messages, varies on the same completions as strings), "
    "`special-tokens-stripped` (its source looks for a token the decode strips), `missing-column` (it reads a "
    "column TRL does not pass: absent, or removed by `remove_unused_columns=True`), `constant`, `raises`, "
    "`wrong-length`, `none-values`; `timeout` (a warning: it did not return within 20 s, killed, not judged). In "
    "training: one function's `rewards/<f>/std` at 0 for 5 logged steps while another's varies (not one the dry "
    "run saw read its completions; a warning when no dry run judged it). "
    "`reward_dry_run=False` skips the calls (a function that calls a paid service); the report "
    "says so. After a `preflight(trainer=...)` of the same trainer the callback calls nothing: it reads "
    "preflight's verdict on the same 16 completions (`reward_dry_run.from`: `preflight`), unless a reward "
    "function, the dataset, the tokenizer or `remove_unused_columns` changed since, or a function reads "
    "`trainer_state` (preflight's is not the run's).",
    fix='Follow evidence.cause: read a conversational completion\'s text as `completion[0]["content"]` '
    "(completion-type); look for what the decode leaves (the text, not the special token) or end on EOS "
    "(special-tokens-stripped); keep the column (`remove_unused_columns=False`, TRL's default) or read the one "
    "the dataset has (missing-column); fix the function so that it scores what differs between completions.",
)

COMPLETIONS_TRUNCATED = define(
    "completions-truncated",
    severity="warning",
    stage="trainer",
    objectives=RL,
    symptom="The reward stays at 0 and nothing is learned: the completions are cut at `max_completion_length` "
    "before they reach the answer (97-99% truncated at TRL's old default of 256 tokens).",
    detects="Before training: a group of `num_generations` completions for each of 4 prompts, generated with the "
    "trainer's own settings (temperature, top_p/top_k, `max_completion_length`, stopping on the ids the trainer "
    "stops on), and the share clipped (the last id is no stop id): warning at 50%, error at 90% with none ended. "
    "In training: `completions/clipped_ratio` >= 0.5 over the last 10 logged steps (warning), or >= 0.9 with "
    "`completions/mean_terminated_length` 0 for 3 logged steps (error). `evidence.cause`: `stop-token-mismatch` "
    "(the trainer does not stop on the template's end of turn, or the completions write one it does not stop "
    "on), `repetition` (they loop until the cap), `no-end-of-turn` (the policy does not end them: before "
    "training, up to 8 clipped completions generated on to 4x the cap and fewer than half end; in training, an "
    "entropy of 75% of ln(V) or more, random tokens), `budget` (they are longer than the cap: continued, most "
    "end, at the length the evidence gives). The fix follows the cause.",
    fix="Raise `max_completion_length` (budget); set `mask_truncated_completions=True` (truncated completions then "
    "carry no loss); make generation stop on the end-of-turn token (stop-token-mismatch); start from a model that "
    "ends its turns (no-end-of-turn).",
)

GROUP_TOO_SMALL = define(
    "group-too-small",
    severity="warning",
    stage="trainer",
    objectives=RL,
    symptom="Most groups get one reward value for all their completions, so most of each batch carries no "
    "gradient: `frac_reward_zero_std` high, training slow.",
    detects="Before training, for a binary reward (two values on the completions the dry run scored) or a sparse one "
    "(one value, though it reads its completions): its pass rate p on the model's own completions (when they all "
    "got one value, on a larger sample of 8 prompts x 8), and the share of groups expected to hold one value, "
    "p^G + (1-p)^G for G = `num_generations`; warning above 0.5 (RLOO's default G=2 with a binary reward always: "
    "at least half its groups are uninformative). The evidence gives the measured rate and the group size that "
    "would give signal (the smallest G with more than half of the groups varying; where none passed, at the rate's 95% "
    "upper bound). Not judged when most of the completions are truncated (completions-truncated).",
    fix="Raise `num_generations` (G=8 or 16); use prompts the model passes sometimes (filter the ones it always "
    "or never passes); or a graded reward instead of a binary one.",
)

UNINFORMATIVE_LIMIT = 0.5
TRUNCATED_WARN, TRUNCATED_ERROR = 0.5, 0.9
NEAR_UNIFORM = 0.75  # an entropy at this share of ln(V) or more: the policy writes near-random tokens
FIX_BY_CAUSE = {
    "completion-type": "The completions of conversational prompts are lists of messages: score "
    '`completion[0]["content"]`, e.g. `text = c[0]["content"] if isinstance(c, list) else c`.',
    "special-tokens-stripped": "TRL decodes completions with skip_special_tokens=True: look for the text around "
    "the special token, or check that the completion ended (its `completion_ids` end with EOS).",
    "missing-column": "Pass the column the function reads: keep it in the dataset, with remove_unused_columns=False "
    "(TRL's default for GRPO/RLOO).",
    "raises": "Fix the exception: TRL would raise it at the first step.",
    "timeout": "A function that calls a service or a model: check it separately, and pass reward_dry_run=False.",
    "wrong-length": "Return exactly one reward per completion.",
    "none-values": "Return a number for every completion (None only where the function does not apply).",
    "constant": "Make the reward depend on the completion: it scores completions that differ in content alike.",
}


def _is_rl_trainer(ctx) -> bool:
    return ctx.trainer is not None and ctx.objective.kind == "rl" and getattr(ctx, "rl", None) is not None


@REWARD_FUNCTION_BROKEN.check(applies=_is_rl_trainer)
def check_reward_functions(ctx):
    run = ctx.rl.dry_run
    if run is None:
        return
    checks = [c for c in run.checks if c.cause is not None]
    varying = [c.name for c in run.checks if not c.constant and c.cause is None]
    for check in checks:
        severity = {
            "timeout": "warning",  # not judged: slow, not broken
            "special-tokens-stripped": "error" if check.constant else "warning",  # dead, or a dead branch
            # No function gives the groups a spread; not told from a sparse one (it may read them): a warning.
            "constant": "warning" if varying or check.reads_completions is not False else "error",
        }.get(check.cause, "error")
        others = f"; {', '.join(varying)} still varies" if varying and check.constant else ""
        yield REWARD_FUNCTION_BROKEN.finding(
            f"reward function {check.name!r}: {check.why} (cause: {check.cause}){others}",
            evidence={
                "cause": check.cause,
                "function": check.name,
                "why": check.why,
                **{
                    k: v
                    for k, v in check.describe().items()
                    if v not in ([], {}, None, "") and k not in ("cause", "why")
                },
                "completions": dict(run.batches),
            },
            severity=severity,
            fix=FIX_BY_CAUSE.get(check.cause),
        )


def truncation_cause(*, stop_mismatch: bool, end_of_turn_inside: int, looping: int, clipped: int,
                     continued=None) -> str:  # fmt: skip
    """Why completions run to the cap: the trainer does not stop on the template's end of turn (or they write one
    it does not stop on), they loop, the policy never ends them (continued to 4x the cap, most still run on), or
    the cap is shorter than what they say."""
    if stop_mismatch or (clipped and end_of_turn_inside >= clipped / 2):
        return "stop-token-mismatch"
    if clipped and looping >= clipped / 2:
        return "repetition"
    if continued is not None and continued.completions and 2 * continued.ended < continued.completions:
        return "no-end-of-turn"
    return "budget"


TRUNCATION_FIX = {
    "budget": "Raise `max_completion_length` (the answers need more tokens than the cap); or set "
    "`mask_truncated_completions=True` (truncated completions then carry no loss).",
    "stop-token-mismatch": "Make generation stop on the template's end of turn: add its id to "
    "`model.generation_config.eos_token_id` (TRL stops on that and the tokenizer's EOS), or pass "
    "`generation_kwargs={'eos_token_id': [...]}`; then set `mask_truncated_completions=True` for what is still cut.",
    "repetition": "The completions loop until the cap: a longer cap only makes the loops longer. Sample hotter or "
    "with `repetition_penalty`, and check the model the run starts from (an SFT that taught it to loop).",
    "no-end-of-turn": "The policy does not end its completions: a longer cap would not help. Start from a model "
    "that ends its turns (an SFT with the end-of-turn token in the labels: see eos-not-learned), and check that the "
    "trainer stops on the token the model ends an answer with.",
}


@COMPLETIONS_TRUNCATED.check(applies=_is_rl_trainer)
def check_completions_truncated(ctx):
    from hf_sanity.measure.rl import stop_mismatch

    sampled = ctx.rl.sampled
    if sampled is None or not sampled.clipped:
        return
    share = sampled.clipped_share
    if share < TRUNCATED_WARN:
        return
    clipped = sum(sampled.clipped)
    mismatch = stop_mismatch(ctx.trainer)
    looping = sampled.looping >= clipped / 2
    continued = ctx.rl.continued if not mismatch and not looping else None  # measured only where it decides
    cause = truncation_cause(stop_mismatch=bool(mismatch), end_of_turn_inside=sampled.end_of_turn_inside,
                             looping=sampled.looping, clipped=clipped, continued=continued)  # fmt: skip
    ended = sampled.terminated_lengths
    evidence: dict = {}
    if cause == "stop-token-mismatch":
        wrote = sampled.end_of_turn_inside
        turn_end = mismatch.get("end_of_turn") or f"id {sampled.end_of_turn_id}"
        said = (
            f"the trainer does not stop on the template's end of turn {turn_end!r} (it stops on "
            + (f"{', '.join(map(repr, mismatch['stop_tokens']))})" if mismatch else f"{sampled.stop_ids})")
            + (f": {wrote} of them wrote it and ran on" if wrote else "")
        )
        evidence.update(end_of_turn=turn_end, end_of_turn_written=wrote)
    elif cause == "repetition":
        said = f"{sampled.looping} of them loop until the cap"
    elif cause == "no-end-of-turn":
        said = (
            f"the policy does not end them: continued to {continued.max_tokens} tokens ({CONTINUE_FACTOR}x the cap), "
            f"{continued.ended} of {continued.completions} ended"
        )
        evidence.update(continued=continued.completions, continued_ended=continued.ended,
                        continued_to=continued.max_tokens)  # fmt: skip
    else:
        said = "the answers are longer than the cap" + (
            f" (those that ended took {fmt(sum(ended) / len(ended))} tokens on average)" if ended else ""
        )
        if continued is not None and continued.ended:
            said += (
                f"; continued, {continued.ended} of {continued.completions} ended, at up to "
                f"{max(continued.lengths)} tokens"
            )
            evidence.update(continued=continued.completions, continued_ended=continued.ended,
                            continued_lengths=sorted(continued.lengths))  # fmt: skip
    first = next(i for i, c in enumerate(sampled.clipped) if c)
    fix = TRUNCATION_FIX[cause]
    if cause == "budget" and continued is not None and continued.lengths:
        fix = fix.replace(
            "`max_completion_length`", f"`max_completion_length` to at least {max(continued.lengths)}"
        )
    yield COMPLETIONS_TRUNCATED.finding(
        f"{clipped} of {len(sampled.clipped)} completions ({share:.0%}) the model generates with the trainer's "
        f"settings run to max_completion_length={sampled.max_new_tokens} without ending: {said} (cause: {cause})",
        evidence={
            "cause": cause,
            "clipped_share": share,
            "clipped": clipped,
            "completions": len(sampled.clipped),
            "max_completion_length": sampled.max_new_tokens,
            "stop_ids": sampled.stop_ids,
            "terminated_mean_length": sum(ended) / len(ended) if ended else 0.0,
            **evidence,
            "first_clipped": sampled.completions.texts[first][-200:],
            "seconds": round(sampled.seconds + (continued.seconds if continued is not None else 0.0), 2),
        },
        severity="error" if share >= TRUNCATED_ERROR and not ended else "warning",
        fix=fix,
    )


@GROUP_TOO_SMALL.check(applies=_is_rl_trainer)
def check_group_too_small(ctx):
    rollouts = ctx.rl
    if rollouts.sampled_rewards is None or rollouts.sampled.clipped_share >= TRUNCATED_WARN:
        return  # truncated completions say nothing of the pass rate (completions-truncated says why)
    measured = rollouts.measured_pass_rate
    if measured is None:
        return
    group, rate, n = rollouts.group_size, measured.rate, measured.completions
    share = uninformative_share(rate, group)
    if share <= UNINFORMATIVE_LIMIT and not (group == 2 and share >= UNINFORMATIVE_LIMIT):
        return
    evidence = {
        "cause": "sparse-reward" if measured.sparse or measured.passed in (0, n) else "binary-reward",
        "pass_rate": rate,
        "passed": measured.passed,
        "completions": n,
        "group_size": group,
        "expected_uninformative": share,
        "values": list(measured.values),
        "expected_at": {g: round(uninformative_share(rate, g), 3) for g in (2, 4, 8, 16)},
    }
    needed = group_size_for_signal(rate)
    if needed is not None:
        evidence["group_size_for_signal"] = needed
        said = f"; G={needed} would give more than half of them a spread"
    else:  # it never (or always) passed: the rate is bounded, not measured
        bound = rate_upper_bound(n)
        at_bound = group_size_for_signal(bound)
        evidence.update(pass_rate_bound=bound, group_size_for_signal_at_bound=at_bound)
        side = "passed" if measured.passed == 0 else "failed"
        said = (
            f"; none {side} (the rate is under {bound:.0%} at 95% confidence): even at {bound:.0%}, more than half "
            f"of the groups would vary only from G={at_bound}"
            if at_bound
            else ""
        )
    what = (
        f"a sparse reward (it reads the completions, but gave all {n} of the model's completions the same reward, "
        f"{fmt(measured.values[0])})"
        if measured.sparse
        else f"a binary reward passing {rate:.0%} of the model's own completions ({measured.passed} of {n})"
    )
    yield GROUP_TOO_SMALL.finding(
        f"{what} leaves {share:.0%} of groups of G={group} with one value (p^G + (1-p)^G): they carry no "
        f"gradient{said}",
        evidence=evidence,
        fix=f"Raise num_generations (to {needed or evidence.get('group_size_for_signal_at_bound') or 16} or more); "
        "use prompts the model passes sometimes (filter the ones it always or never passes); or a graded reward "
        "instead of a binary one.",
    )


# -- in training -------------------------------------------------------------------------------------------------
CONSTANT_LOGS = 5  # logged steps in a row with one function's std at 0 ...


@monitor
class RewardFunctionMonitor(Monitor):
    """`reward-function-broken` from the callback's dry run at train begin (only what is certain: it raises, the
    wrong length, None, messages vs strings, a column not passed), then from TRL's logs: one function's
    `rewards/<f>/std` at 0 for 5 logged steps while another's varies."""

    rules = (REWARD_FUNCTION_BROKEN,)
    reads = ("reward_dry_run", "logs")

    def __init__(self) -> None:
        super().__init__()
        self.dry: dict[str, Any] = {}
        self.flat: dict[str, list[int]] = {}

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        dry = values.get("reward_dry_run")
        if dry:
            self.dry = {name: dict(check) for name, check in (dry.get("functions") or {}).items()}
            return self._from_dry_run(step)
        logs = values.get("logs")
        if not logs:
            return []
        stds = {
            key[len("rewards/") : -len("/std")]: value
            for key, value in logs.items()
            if key.startswith("rewards/") and key.endswith("/std")
        }
        if len(stds) < 2:  # one function alone, constant: reward-zero-advantage names it
            return []
        varying = [name for name, std in stds.items() if std > 0]
        for name, std in stds.items():
            self.flat[name] = [*self.flat.get(name, []), step] if std == 0 and varying else []
        stuck = [name for name, steps in self.flat.items() if len(steps) >= CONSTANT_LOGS]
        if not stuck:
            return []
        # A function the dry run saw read its completions is flat on the policy's completions, not broken: it is
        # sparse there (reward-zero-advantage and the pass rate say so); one never judged is a warning at most.
        stuck = [name for name in stuck if self.dry.get(name, {}).get("reads_completions") is not True]
        if not stuck:
            return []
        name = stuck[0]
        others = ", ".join(n for n in varying if n != name)
        known = self.dry.get(name, {})
        cause = known.get("cause") or "constant"
        judged = (bool(known) and known.get("reads_completions") is False) or cause != "constant"
        why = known.get("why") or (
            "its rewards/<f>/std is 0 at every logged step (no dry run told whether it reads its completions)"
        )
        return self.fire(
            REWARD_FUNCTION_BROKEN,
            f"reward function {name!r} gives every completion of a batch the same reward "
            f"({fmt(logs.get(f'rewards/{name}/mean', 0.0))}) for {len(self.flat[name])} logged steps while "
            f"{others} varies (cause: {cause})",
            step=step,
            evidence={"cause": cause, "function": name, "why": why, "logged_steps": self.flat[name]},
            fix=FIX_BY_CAUSE.get(cause),
            severity="error" if judged else "warning",
        )

    def _from_dry_run(self, step: int) -> list[Finding]:
        certain = ("raises", "wrong-length", "none-values", "completion-type", "missing-column")
        for name, check in self.dry.items():
            cause = check.get("cause")
            if cause in certain or (cause == "special-tokens-stripped" and check.get("constant")):
                return self.fire(
                    REWARD_FUNCTION_BROKEN,
                    f"reward function {name!r}, called before the first step as TRL will call it: {check.get('why')} "
                    f"(cause: {cause})",
                    step=step,
                    evidence={
                        "function": name,
                        **{k: v for k, v in check.items() if v not in ([], {}, None, "")},
                    },
                    fix=FIX_BY_CAUSE.get(cause),
                )
        return []


@monitor
class TruncationMonitor(Monitor):
    """`completions/clipped_ratio` over the last 10 logged steps at 0.5 (warning); at 0.9 with no completion
    ended for 3 logged steps (error)."""

    rules = (COMPLETIONS_TRUNCATED,)
    reads = ("logs", "rl_setup")

    def __init__(self, max_completion_length: int | None = None, vocab_size: int | None = None) -> None:
        super().__init__()
        self.max_completion_length, self.vocab_size = max_completion_length, vocab_size
        self.ratios: list[tuple[int, float]] = []
        self.none_ended: list[int] = []
        self.any_ended = False  # some completion of the run ended (a terminated length above 0)
        self.entropy: float | None = None  # the latest logged entropy (nat/token)
        self.stop_mismatch: dict[str, Any] = {}

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> Monitor:
        return cls(setup.objective.details.get("max_completion_length"), setup.vocab_size)

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        setup = values.get("rl_setup")
        if setup:
            self.stop_mismatch = dict(setup.get("stop_mismatch") or {})
        logs = values.get("logs") or {}
        ratio = logs.get("completions/clipped_ratio")
        if ratio is None:
            return []
        self.ratios = [*self.ratios, (step, ratio)][-10:]
        ended = logs.get("completions/mean_terminated_length")
        self.any_ended |= bool(ended)
        if logs.get("entropy") is not None and math.isfinite(logs["entropy"]):
            self.entropy = logs["entropy"]
        self.none_ended = [*self.none_ended, step] if ratio >= TRUNCATED_ERROR and ended == 0 else []
        window = [r for _, r in self.ratios]
        mean = sum(window) / len(window)
        error = len(self.none_ended) >= 3
        if not error and (len(window) < 3 or mean < TRUNCATED_WARN):
            return []
        cause, why = self._cause()
        said = "none ended" if error else f"{mean:.0%} on average over the last {len(window)} logged steps"
        return self.fire(
            COMPLETIONS_TRUNCATED,
            f"completions run to max_completion_length={self.max_completion_length}: clipped_ratio "
            f"{fmt(ratio)} at step {step}, {said}; {why} (cause: {cause})",
            step=step,
            evidence={
                "cause": cause,
                "why": why,
                "clipped_ratio": ratio,
                "clipped_ratio_mean": mean,
                "mean_terminated_length": ended,
                "max_completion_length": self.max_completion_length,
                "entropy": self.entropy,
                "logged_steps": [s for s, _ in self.ratios],
            },
            severity="error" if error else "warning",
            fix=TRUNCATION_FIX.get(cause),
        )

    def _cause(self) -> tuple[str, str]:
        """(cause, why) from what the run logged: the trainer's stop ids against the template (at train begin); the
        policy's entropy near ln(V) (random tokens: it ends a completion only by chance); else the cap."""
        if self.stop_mismatch:
            return "stop-token-mismatch", (
                f"the chat template ends a turn with {self.stop_mismatch.get('end_of_turn')!r}, which the trainer "
                f"does not stop on (it stops on {self.stop_mismatch.get('stop_tokens')})"
            )
        uniform = math.log(self.vocab_size) if self.vocab_size and self.vocab_size > 1 else None
        if self.entropy is not None and uniform and self.entropy >= NEAR_UNIFORM * uniform:
            return "no-end-of-turn", (
                f"the policy writes near-random tokens (entropy {fmt(self.entropy)} nat/token, ln V = {fmt(uniform)}): "
                "it never writes an end of turn but by chance, whatever the cap"
            )
        if not self.any_ended:
            return "budget", (
                "no completion has ended: the answers are longer than max_completion_length, or the policy never "
                "ends them (preflight(trainer=...) continues them past the cap to tell)"
            )
        return "budget", "the completions are longer than max_completion_length"
