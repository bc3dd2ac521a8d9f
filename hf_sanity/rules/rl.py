"""RL fine-tuning from reward functions (TRL's GRPOTrainer, RLOOTrainer), before training and as it runs: reward
functions that cannot score what the trainer will pass them, completions cut at `max_completion_length`, groups
too small for the reward's pass rate.

Before training the rules read ``ctx.rl`` (`hf_sanity.measure.rl.Rollouts`): a group of completions the model
generates for a few prompts with the trainer's own generation settings, and every reward function called on them
and on completions built from the dataset's answers, in the exact shape TRL passes. In training they read TRL's
logged metrics (``logs``) and the callback's dry run at train begin (``reward_dry_run``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import RL
from hf_sanity.measure.rl import uninformative_share
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
    "TRL calls it, on copies, with a time limit, on 16 completions built from the dataset's own answers (the "
    "answer, the same in a reasoning format over several lines, a wrong answer of the same shape, an empty one) "
    "and, in preflight, on a group the model generates for each of 4 prompts: strings for text prompts, "
    '`[{"role": "assistant", "content": ...}]` for conversational ones, special tokens stripped as '
    "`skip_special_tokens` strips them, the dataset's columns as keyword arguments, `prompts`, `completion_ids`, "
    "`trainer_state`. Error when it raises, returns the wrong number of rewards, returns None for more than 10% "
    "of them, or one value for completions that differ (a warning when another function varies). "
    "`evidence.cause`: `completion-type` (constant on messages, varies on the same completions as strings), "
    "`special-tokens-stripped` (its source looks for a token the decode strips), `missing-column` (it reads a "
    "column TRL does not pass: absent, or removed by `remove_unused_columns=True`), `constant`, `raises`, "
    "`wrong-length`, `none-values`; `timeout` (a warning: it did not return within 20 s, not judged). In "
    "training: one function's `rewards/<f>/std` at 0 for 5 logged steps while another's varies. "
    "`reward_dry_run=False` skips the calls (a function that calls a paid service); the report "
    "says so.",
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
    "(the completions write the template's end of turn, which the trainer does not stop on), `repetition` (they "
    "loop until the cap), `budget` (they are longer than the cap).",
    fix="Raise `max_completion_length`; set `mask_truncated_completions=True` (truncated completions then carry "
    "no loss); make generation stop on the end-of-turn token (stop-token-mismatch).",
)

GROUP_TOO_SMALL = define(
    "group-too-small",
    severity="warning",
    stage="trainer",
    objectives=RL,
    symptom="Most groups get one reward value for all their completions, so most of each batch carries no "
    "gradient: `frac_reward_zero_std` high, training slow.",
    detects="Before training, for a binary reward (two values on the completions the dry run scored): its pass "
    "rate p on the model's own completions, and the share of groups expected to hold one value, p^G + (1-p)^G "
    "for G = `num_generations`; warning above 0.5 (RLOO's default G=2 with a binary reward always: at least "
    "half its groups are uninformative). Not judged when most of the completions are truncated "
    "(completions-truncated).",
    fix="Raise `num_generations` (G=8 or 16); use prompts the model passes sometimes (filter the ones it always "
    "or never passes); or a graded reward instead of a binary one.",
)

UNINFORMATIVE_LIMIT = 0.5
TRUNCATED_WARN, TRUNCATED_ERROR = 0.5, 0.9
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
            "constant": "warning" if varying else "error",  # no function gives the groups a spread
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


def truncation_cause(*, end_of_turn_inside: int, looping: int, clipped: int) -> str:
    """Why completions run to the cap: they write an end of turn the trainer does not stop on, they loop, or the
    cap is shorter than what they say."""
    if clipped and end_of_turn_inside >= clipped / 2:
        return "stop-token-mismatch"
    if clipped and looping >= clipped / 2:
        return "repetition"
    return "budget"


@COMPLETIONS_TRUNCATED.check(applies=_is_rl_trainer)
def check_completions_truncated(ctx):
    sampled = ctx.rl.sampled
    if sampled is None or not sampled.clipped:
        return
    share = sampled.clipped_share
    if share < TRUNCATED_WARN:
        return
    clipped = sum(sampled.clipped)
    cause = truncation_cause(
        end_of_turn_inside=sampled.end_of_turn_inside, looping=sampled.looping, clipped=clipped
    )
    ended = sampled.terminated_lengths
    said = {
        "stop-token-mismatch": f"{sampled.end_of_turn_inside} of them wrote the end of turn (id "
        f"{sampled.end_of_turn_id}), which the trainer does not stop on",
        "repetition": f"{sampled.looping} of them loop until the cap",
        "budget": "the answers are longer than the cap"
        + (f" (those that ended took {fmt(sum(ended) / len(ended))} tokens on average)" if ended else ""),
    }[cause]
    first = next(i for i, c in enumerate(sampled.clipped) if c)
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
            "first_clipped": sampled.completions.texts[first][-200:],
            "seconds": round(sampled.seconds, 2),
        },
        severity="error" if share >= TRUNCATED_ERROR and not ended else "warning",
    )


@GROUP_TOO_SMALL.check(applies=_is_rl_trainer)
def check_group_too_small(ctx):
    from hf_sanity.measure.rl import pass_rate

    rollouts = ctx.rl
    rewards = rollouts.sampled_rewards
    if rewards is None or rollouts.sampled.clipped_share >= TRUNCATED_WARN:
        return  # truncated completions say nothing of the pass rate (completions-truncated says why)
    binary, rate = pass_rate(rewards)
    # All the model's completions got one value of a reward that takes two on the dry run's completions.
    values = sorted({r for r in [*rewards, *(rollouts.rewards("synthetic") or ())] if r == r})  # NaN != NaN
    if not binary and len(values) == 2 and len(set(rewards)) == 1:
        binary, rate = True, float(rewards[0] == values[1])
    if not binary or rate is None:
        return
    group = rollouts.group_size
    share = uninformative_share(rate, group)
    if share <= UNINFORMATIVE_LIMIT and not (group == 2 and share >= UNINFORMATIVE_LIMIT):
        return
    n = len(rewards)
    yield GROUP_TOO_SMALL.finding(
        f"a binary reward passing {rate:.0%} of the model's own completions ({round(rate * n)} of {n}) leaves "
        f"{share:.0%} of groups of G={group} with one value (p^G + (1-p)^G): they carry no gradient",
        evidence={
            "pass_rate": rate,
            "group_size": group,
            "expected_uninformative": share,
            "completions": n,
            "values": values,
            "expected_at": {g: round(uninformative_share(rate, g), 3) for g in (2, 4, 8, 16)},
        },
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
        name = stuck[0]
        others = ", ".join(n for n in varying if n != name)
        known = self.dry.get(name, {})
        cause = known.get("cause") or "constant"
        why = known.get("why") or "its rewards/<f>/std is 0 at every logged step"
        return self.fire(
            REWARD_FUNCTION_BROKEN,
            f"reward function {name!r} gives every completion of a batch the same reward "
            f"({fmt(logs.get(f'rewards/{name}/mean', 0.0))}) for {len(self.flat[name])} logged steps while "
            f"{others} varies (cause: {cause})",
            step=step,
            evidence={"cause": cause, "function": name, "why": why, "logged_steps": self.flat[name]},
            fix=FIX_BY_CAUSE.get(cause),
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

    def __init__(self, max_completion_length: int | None = None) -> None:
        super().__init__()
        self.max_completion_length = max_completion_length
        self.ratios: list[tuple[int, float]] = []
        self.none_ended: list[int] = []
        self.stop_mismatch: dict[str, Any] = {}

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> Monitor:
        return cls(setup.objective.details.get("max_completion_length"))

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
        self.none_ended = [*self.none_ended, step] if ratio >= TRUNCATED_ERROR and ended == 0 else []
        window = [r for _, r in self.ratios]
        mean = sum(window) / len(window)
        error = len(self.none_ended) >= 3
        if not error and (len(window) < 3 or mean < TRUNCATED_WARN):
            return []
        cause = "stop-token-mismatch" if self.stop_mismatch else "budget"
        why = (
            f"the chat template ends a turn with {self.stop_mismatch.get('end_of_turn')!r}, which the trainer does "
            f"not stop on (it stops on {self.stop_mismatch.get('stop_tokens')})"
            if self.stop_mismatch
            else "the completions are longer than max_completion_length"
        )
        said = "none ended" if error else f"{mean:.0%} on average over the last {len(window)} logged steps"
        return self.fire(
            COMPLETIONS_TRUNCATED,
            f"completions run to max_completion_length={self.max_completion_length}: clipped_ratio "
            f"{fmt(ratio)} at step {step}, {said} (cause: {cause})",
            step=step,
            evidence={
                "cause": cause,
                "why": why,
                "clipped_ratio": ratio,
                "clipped_ratio_mean": mean,
                "mean_terminated_length": ended,
                "max_completion_length": self.max_completion_length,
                "logged_steps": [s for s, _ in self.ratios],
            },
            severity="error" if error else "warning",
        )
