"""RL training as it runs (TRL's GRPOTrainer, RLOOTrainer): groups that carry no gradient and why, the policy
drifting from where it started, one reward gamed at the expense of another, entropy collapsing or running away
with the completions' length, advantages made of noise.

The monitors read what the trainer logs (``logs``: `frac_reward_zero_std`, `reward_std`, `rewards/<f>/mean|std`,
`completions/*`, `entropy`, `kl`, `grad_norm`), its latest rollouts in group order (``rollouts``:
`hf_sanity.measure.rl.rollout_summary`), the callback's reward dry run at train begin (``reward_dry_run``) and,
with beta = 0, its own estimate of the KL to the initial policy (``policy_kl``): see
`hf_sanity.training.trl_metrics`. They never read the loss: on-policy GRPO's loss is ~0 by construction (its
importance ratio is 1), negative losses are normal, and `clip_ratio` is 0 with one iteration per generation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import RL
from hf_sanity.measure.rl import group_size_for_signal, rate_upper_bound, uninformative_share
from hf_sanity.numbers import fmt, median
from hf_sanity.rules.training.base import Monitor, TrainingSetup

REWARD_ZERO_ADVANTAGE = define(
    "reward-zero-advantage",
    severity="error",
    stage="training",
    objectives=RL,
    symptom="The reward is flat for hours with `loss 0.0` and `grad_norm 0.0`: every group of completions got "
    "the same reward, so every advantage is 0 and nothing trains.",
    detects="`frac_reward_zero_std` >= 0.95 with the gradient norm under 1e-8 for 3 logged steps in a row "
    "(error; where every reward function varied on the dry run's completions, for at least 8 groups: a graded "
    "reward leaves a group without a spread by chance, 3 groups of one a step say nothing yet), or a mean of 0.8 "
    "over 10 logged steps (warning), with the cause measured on the run: "
    "`completions-truncated` (`completions/clipped_ratio` >= 0.9), `completion-type` (the dry run at train begin "
    "found a reward function constant on messages and varying on strings), `sampling-cold` (the completions of "
    "most uninformative groups are identical: temperature under 0.5, or `entropy` under 0.1 nat/token), "
    "`reward-constant` (every function's `rewards/<f>/std` is 0 over the batch although the completions differ), "
    "`reward-prompt-only` (the batch's rewards vary, the rewards within each group do not, though its "
    "completions differ: read from the per-completion rewards in group order), `group-too-small` (a binary "
    "reward whose measured pass rate p makes p^G + (1-p)^G about the share observed, or a sparse one that the dry "
    "run saw read its completions and that gave the whole batch one value: the message gives the rate and the "
    "group size that would give signal; or a reward that varied on the dry run's completions and scores the "
    "completions of each group alike), `unknown`.",
    fix="Follow evidence.cause: raise `max_completion_length` or set `mask_truncated_completions=True` "
    "(completions-truncated); fix the reward function (completion-type, reward-constant, reward-prompt-only: see "
    "reward-function-broken); temperature >= 0.7 (sampling-cold); raise `num_generations`, use prompts the model "
    "sometimes passes, or a graded reward (group-too-small).",
)

KL_SPIKE = define(
    "kl-spike",
    severity="warning",
    stage="training",
    objectives=RL,
    symptom="A reward jumps while the outputs degrade: the policy runs away from where it started.",
    detects="The KL to the reference per token above 10x its early median (the logged values up to 10% of the "
    "planned steps, at least 3) and above 0.1, or above 1 nat/token (error). With beta > 0 it is TRL's logged "
    "`kl`; with beta = 0 (TRL's default: no reference, no `kl` logged) it is hf-sanity's own estimate of "
    "KL(initial || current) per token: the first 8 rollouts TRL trains on (samples of the initial policy) scored "
    "before the first update and re-scored every `probe_every` steps, at the trainer's temperature (they were "
    "trained on: the estimate leans high); cost: one forward of 8 sequences per probe, no generation (single "
    "process; a resumed run measures from the policy it resumed).",
    fix="Inspect the completions (`log_completions=True`), tighten the reward that jumped, add or raise beta "
    "(0.01-0.04), lower the learning rate.",
)

REWARD_HACKING = define(
    "reward-hacking",
    severity="warning",
    stage="training",
    objectives=RL,
    symptom="One reward (often a format reward) saturates while the others fall: the policy games the easy "
    "reward at the expense of the one that matters.",
    detects="With two reward functions or more: one function's logged mean (over 3 logged steps) at >= 95% of "
    "its range (the lowest to the highest reward it gave a completion so far) while another's has fallen from "
    "its peak by more than 20% of that peak and of its range. The KL to the start is in the evidence.",
    fix="Inspect the completions (`log_completions=True`): tighten the saturated reward (a stricter format regex), "
    "weight the falling one up (`reward_weights`), add beta, lower the learning rate.",
)

ENTROPY_COLLAPSE = define(
    "entropy-collapse",
    severity="warning",
    stage="training",
    objectives=RL,
    symptom="The policy collapses onto one answer per prompt: completions within a group become identical and "
    "the groups stop carrying a gradient.",
    detects="`entropy` below 0.2x its starting value (the median of its first 3 logged values) for 3 logged steps "
    "while `frac_reward_zero_std` rises (its last 3 logged values above its first 3 by 0.1).",
    fix="Keep exploring: `epsilon_high=0.28` (DAPO's clip-higher), an entropy bonus, a lower learning rate, a "
    "higher temperature.",
)

LENGTH_RUNAWAY = define(
    "length-runaway",
    severity="warning",
    stage="trainer",  # its config check runs in preflight; its monitor in training
    objectives=RL,
    symptom="Completions grow longer and turn into gibberish while the reward does not improve.",
    detects="In training: `entropy` above 2x its starting value for 3 logged steps while "
    "`completions/mean_length` rises at each of the last 5 logged steps and the reward does not rise (the last "
    '2 logged rewards within a quarter of `reward_std` of the first 2). Before training: `loss_type="grpo"`, '
    "whose per-sequence length normalisation biases the policy toward long wrong answers (TRL: 'not "
    "recommended due to length bias').",
    fix='Use `loss_type="dapo"` (TRL\'s default) or `"dr_grpo"`; lower the learning rate; cap '
    "`max_completion_length`; `mask_truncated_completions=True`.",
)

ADVANTAGE_NOISE = define(
    "advantage-noise",
    severity="warning",
    stage="training",
    objectives=RL,
    symptom="Training follows noise: groups whose rewards differ by a rounding error get advantages of +-1.",
    detects='Under `scale_rewards="group"` each advantage is divided by its group\'s reward std (+ 1e-4): more than '
    "20% of the groups seen (at least 8) with 0 < std < 1e-3, read from the per-completion rewards in group order.",
    fix='Set `scale_rewards="batch"` or `"none"`; round or quantise the reward so equal answers get equal '
    "rewards; scale the reward up if its range is that small by design.",
)

ZERO_STD_ERROR, ZERO_STD_WARN = 0.95, 0.8
ZERO_GRAD = 1e-8
ERROR_LOGS, WARN_LOGS = 3, 10
# Groups without a spread, in a row, before an error where the reward is known to vary (the dry run): a healthy
# run has a third to a half of such groups (a confident model, a length-graded reward); 8 in a row by chance is
# under 0.4% at a half.
ERROR_GROUPS = 8
# What the cause reads of each function's dry-run verdict.
DRY_RUN_KEYS = ("cause", "why", "values", "reads_completions", "constant", "distinct", "sparse")
COLD_TEMPERATURE, COLD_ENTROPY = 0.5, 0.1
TRUNCATED = 0.9
GROUP_TOLERANCE = 0.15
ALL_IDENTICAL = 0.999  # every group's completions identical (a share of groups)  # observed zero-std share within this of p^G + (1-p)^G: statistics, not a bug

ZERO_ADVANTAGE_FIX = {
    "completions-truncated": "Raise max_completion_length (the completions are cut before they are scored), or set "
    "mask_truncated_completions=True; see completions-truncated.",
    "completion-type": 'The reward function scores messages as strings: use `completion[0]["content"]` for '
    "conversational prompts; see reward-function-broken.",
    "sampling-cold": "The completions of a group are identical: sample hotter (temperature >= 0.7, top_k/top_p "
    "off) so that they differ and the reward can tell them apart.",
    "reward-constant": "The reward gives every completion the same score: make it depend on the completion; see "
    "reward-function-broken.",
    "reward-prompt-only": "The reward depends on the prompt only (it differs between groups, never within one): "
    "score the completion.",
    "group-too-small": "Raise num_generations, keep prompts the model sometimes passes, or use a graded reward.",
}
# group-too-small where the reward is graded already (it varied on the dry run) and a group's completions score alike.
GRADED_FIX = (
    "Raise num_generations, or sample hotter (temperature ~1.0, top_k/top_p off), so that the completions of a "
    "group differ in what the reward scores."
)


def zero_advantage_cause(
    logs: list[Mapping[str, float]],
    rollouts: list[Mapping[str, Any]],
    dry: Mapping[str, Mapping[str, Any]],
    temperature: float | None,
    group_size: int | None,
) -> tuple[str, str, dict[str, Any]]:
    """(cause, why, measured numbers) of groups without a reward spread, from the logged steps of the window, the
    rollouts read at them and the dry run's verdicts."""

    def mean(key: str, source=logs) -> float | None:
        values = [v[key] for v in source if v.get(key) is not None and math.isfinite(v[key])]
        return sum(values) / len(values) if values else None

    clipped, entropy = mean("completions/clipped_ratio"), mean("entropy")
    identical, differing = mean("identical_groups", rollouts), mean("zero_std_differing", rollouts)
    batch_std = mean("batch_std", rollouts)
    stds = {k: v for log in logs for k, v in log.items() if k.startswith("rewards/") and k.endswith("/std")}
    numbers = {"clipped_ratio": clipped, "entropy": entropy, "temperature": temperature,
               "identical_groups": identical, "zero_std_differing": differing, "batch_std": batch_std}  # fmt: skip
    if clipped is not None and clipped >= TRUNCATED:
        return (
            "completions-truncated",
            f"{clipped:.0%} of the completions are clipped at max_completion_length",
            numbers,
        )
    typed = [name for name, check in dry.items() if check.get("cause") == "completion-type"]
    if typed:
        return "completion-type", f"{', '.join(typed)}: {dry[typed[0]].get('why')}", numbers
    zero = mean("zero_std_groups", rollouts) or 0.0
    if temperature is not None and temperature < COLD_TEMPERATURE:
        return (
            "sampling-cold",
            f"temperature={fmt(temperature)}: the completions of a group barely differ",
            numbers,
        )
    if (
        identical is not None and identical >= ALL_IDENTICAL
    ):  # nothing the reward does can give a group a spread
        return (
            "sampling-cold",
            f"the {group_size} completions are identical in {identical:.0%} of the groups: no reward can tell them apart",
            numbers,
        )
    if stds and all(
        v == 0 for v in stds.values()
    ):  # one value for the whole batch, whose groups differ: the reward's
        return _batch_constant(dry, rollouts, mean("reward"), group_size, numbers)
    if identical is not None and zero and identical >= 0.5 * zero:
        return (
            "sampling-cold",
            (
                f"the {group_size} completions are identical in {identical:.0%} of the groups (entropy "
                f"{fmt(entropy) if entropy is not None else 'n/a'} nat/token): no reward can tell them apart"
            ),
            numbers,
        )
    if entropy is not None and entropy < COLD_ENTROPY:
        return (
            "sampling-cold",
            f"entropy {fmt(entropy)} nat/token: the completions of a group barely differ",
            numbers,
        )
    if batch_std and differing is not None and differing >= 0.5:
        return (
            "reward-prompt-only",
            (
                f"the batch's rewards vary (std {fmt(batch_std)}) but {differing:.0%} of the groups give their differing "
                "completions one reward: the reward depends on the prompt only"
            ),
            numbers,
        )
    rates = [r["pass_rate"] for r in rollouts if r.get("binary") and r.get("pass_rate") is not None]
    if rates and group_size:
        p = sum(rates) / len(rates)
        expected = uninformative_share(p, group_size)
        numbers.update(pass_rate=p, expected_zero_std=expected)
        observed = mean("frac_reward_zero_std") or 0.0
        numbers["frac_reward_zero_std"] = observed
        if abs(expected - observed) <= GROUP_TOLERANCE or expected >= observed:
            needed = group_size_for_signal(p)
            numbers["group_size_for_signal"] = needed
            return (
                "group-too-small",
                (
                    f"a binary reward passing {p:.0%} leaves p^G + (1-p)^G = {expected:.0%} of groups of G={group_size} "
                    "with one value: statistics, not a bug"
                    + (f"; G={needed} would give more than half of them a spread" if needed else "")
                ),
                numbers,
            )
    return "unknown", "no measured cause: see the completions (log_completions=True)", numbers


def _batch_constant(dry, rollouts, reward, group_size, numbers) -> tuple[str, str, dict[str, Any]]:
    """(cause, why, numbers) of a batch whose every reward function gave every completion one value: a binary reward
    that (almost) never or always passes, a sparse one the dry run saw read its completions (both: the group is too
    small for its pass rate), or a constant one."""
    seen = [check.get("values") or [] for check in dry.values()]
    completions = int(sum(r.get("groups", 0) * r.get("group_size", 0) for r in rollouts))
    if len(seen) == 1 and len(seen[0]) == 2 and reward is not None:  # a binary reward that works
        lo, hi = seen[0]
        p = (reward - lo) / (hi - lo)
        numbers.update(
            pass_rate=p, expected_zero_std=uninformative_share(min(max(p, 0.0), 1.0), group_size or 2)
        )
        if p <= 0.05 or p >= 0.95:
            return (
                "group-too-small",
                (
                    f"the reward takes two values ({fmt(lo)}, {fmt(hi)}: it varied on the dry run's completions) and "
                    f"gave {'every' if p >= 0.95 else 'no'} completion the higher one: at a pass rate of {p:.0%} no "
                    f"group of G={group_size} has a spread"
                    + _bounded(completions, "passed" if p <= 0.05 else "failed")
                ),
                {**numbers, **_bound_numbers(completions)},
            )
    varied = [check.get("distinct") or 0 for check in dry.values() if check.get("constant") is False]
    if (
        dry
        and len(varied) == len(dry)
        and not any(check.get("cause") or check.get("sparse") for check in dry.values())
    ):
        # Graded, and seen to vary: the policy's completions of a group score alike (short, confident answers).
        numbers["reward_varies"] = True
        return (
            "group-too-small",
            (
                f"every reward function varied on the dry run's completions (at least {min(varied)} values) but "
                f"scores the G={group_size} completions of each group alike: they are too few, or too much alike, "
                "to differ in reward"
            ),
            numbers,
        )
    if dry and all(check.get("reads_completions") and not check.get("cause") for check in dry.values()):
        # Sparse, not constant: the dry run saw every function read its completions.
        value = fmt(seen[0][0]) if len(seen) == 1 and seen[0] else "one value"
        numbers.update(pass_rate=0.0, expected_zero_std=1.0, **_bound_numbers(completions))
        return (
            "group-too-small",
            (
                f"the reward reads its completions (the dry run at train begin) but gave every completion the "
                f"same reward ({value}): a sparse reward that none of the policy's completions passed, so no group "
                f"of G={group_size} has a spread" + _bounded(completions, "passed")
            ),
            numbers,
        )
    told = bool(dry) and all(check.get("reads_completions") is False for check in dry.values())
    return (
        "reward-constant",
        "every reward function gives the whole batch one value (rewards/<f>/std = 0) although its completions "
        "differ"
        + (
            ""
            if told
            else " (not told from a reward that none of them passes: no dry run said whether "
            "it reads its completions)"
        ),
        numbers,
    )


def _bound_numbers(completions: int) -> dict[str, Any]:
    """A pass rate of 0 on ``completions`` samples, bounded: the highest rate it leaves likely (95%), and the
    group size that would give half of the groups a spread at that rate."""
    if not completions:
        return {}
    bound = rate_upper_bound(completions)
    return {"completions_seen": completions, "pass_rate_bound": bound,
            "group_size_for_signal_at_bound": group_size_for_signal(bound)}  # fmt: skip


def _bounded(completions: int, side: str) -> str:
    """What a rate of 0 (or 1) on ``completions`` samples means for the group size (``side``: "passed" or
    "failed", the outcome none of them had)."""
    numbers = _bound_numbers(completions)
    if not numbers or numbers["group_size_for_signal_at_bound"] is None:
        return ""
    return (
        f" (none of the {completions} completions seen {side}: that rate is under {numbers['pass_rate_bound']:.0%} "
        f"at 95% confidence, where more than half of the groups would vary only from "
        f"G={numbers['group_size_for_signal_at_bound']})"
    )


@monitor
class ZeroAdvantageMonitor(Monitor):
    rules = (REWARD_ZERO_ADVANTAGE,)
    reads = ("logs", "rollouts", "reward_dry_run")

    def __init__(self, temperature: float | None = None, group_size: int | None = None) -> None:
        super().__init__()
        self.temperature, self.group_size = temperature, group_size
        self.window: list[dict[str, float]] = []  # the last logged steps (their RL numbers)
        self.seen: list[dict[str, Any]] = []  # the rollouts read at them
        self.zero_run: list[int] = []
        self.zero_groups = 0  # the groups behind the logged steps of zero_run
        self.dry: dict[str, dict[str, Any]] = {}

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> Monitor:
        details = setup.objective.details
        return cls(details.get("temperature"), details.get("num_generations"))

    def _cause(self, window: list[dict[str, float]]) -> tuple[str, str, dict[str, Any]]:
        """(cause, why, numbers) of the logged steps of ``window``, with the rollouts read at them."""
        return zero_advantage_cause(
            window, self.seen[-len(window) :], self.dry, self.temperature, self.group_size
        )

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        dry = values.get("reward_dry_run")
        if dry:
            self.dry = {
                name: {key: check.get(key) for key in DRY_RUN_KEYS}
                for name, check in dry.get("functions", {}).items()
            }
        if values.get("rollouts"):
            self.seen = [*self.seen, dict(values["rollouts"])][-WARN_LOGS:]
        logs = values.get("logs") or {}
        frac = logs.get("frac_reward_zero_std")
        if frac is None:
            return []
        kept = (
            "frac_reward_zero_std",
            "grad_norm",
            "completions/clipped_ratio",
            "entropy",
            "reward",
            "reward_std",
        )
        entry = {
            k: v for k, v in logs.items() if k in kept or (k.startswith("rewards/") and k.endswith("/std"))
        }
        self.window = [*self.window, entry][-WARN_LOGS:]
        grad = logs.get("grad_norm")
        dead = frac >= ZERO_STD_ERROR and grad is not None and grad < ZERO_GRAD
        self.zero_run = [*self.zero_run, step] if dead else []
        # The groups behind this log: those of the rollouts read at it (a generation's), one where none were.
        groups = int((values.get("rollouts") or {}).get("groups") or 1)
        self.zero_groups = self.zero_groups + groups if dead else 0
        fracs = [w["frac_reward_zero_std"] for w in self.window]
        found = None
        if len(self.zero_run) >= ERROR_LOGS:
            severity, window = "error", self.window[-min(len(self.zero_run), WARN_LOGS) :]
            said = (
                f"frac_reward_zero_std >= {ZERO_STD_ERROR} and grad_norm < {ZERO_GRAD:g} for "
                f"{len(self.zero_run)} logged steps since step {self.zero_run[0]}"
            )
            found = self._cause(window)
            if found[2].get("reward_varies") and self.zero_groups < ERROR_GROUPS:
                found = None  # too few groups yet to tell a reward that never separates them from chance
        if found is None and len(fracs) >= WARN_LOGS and sum(fracs) / len(fracs) >= ZERO_STD_WARN:
            severity, window = "warning", self.window
            said = f"{sum(fracs) / len(fracs):.0%} of the groups had one reward over the last {len(fracs)} logged steps"
            found = self._cause(window)
        if found is None:
            return []
        cause, why, numbers = found
        fix = ZERO_ADVANTAGE_FIX.get(cause)
        needed = numbers.get("group_size_for_signal") or numbers.get("group_size_for_signal_at_bound")
        if numbers.get("reward_varies"):  # graded already: what makes a group's completions differ
            fix = GRADED_FIX
        if cause == "group-too-small":  # the measured rate and the group size that would give signal, said
            said += f"; {why}"
            if needed:
                fix = fix.replace("Raise num_generations", f"Raise num_generations (to {needed} or more)")
        return self.fire(
            REWARD_ZERO_ADVANTAGE,
            f"every completion of a group gets the same reward, so the advantages are 0 and nothing trains: {said} "
            f"(cause: {cause})",
            step=step,
            evidence={
                "cause": cause,
                "why": why,
                "frac_reward_zero_std": fracs[-len(window) :],
                "grad_norm": [w.get("grad_norm") for w in window],
                **numbers,
            },
            severity=severity,
            fix=fix,
        )


KL_FACTOR, KL_FLOOR, KL_ERROR = 10.0, 0.1, 1.0
EARLY_SHARE, EARLY_POINTS = 0.10, 3


@monitor
class KLMonitor(Monitor):
    rules = (KL_SPIKE,)
    reads = ("logs", "policy_kl")

    def __init__(self, max_steps: int = 0, beta: float | None = None) -> None:
        super().__init__()
        self.max_steps, self.beta = max_steps, beta
        self.early: list[float] = []
        self.points: list[tuple[int, float]] = []

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> Monitor:
        return cls(setup.max_steps, setup.objective.beta)

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        logged = (values.get("logs") or {}).get("kl")
        kl, source = (logged, "kl") if logged is not None else (values.get("policy_kl"), "policy_kl")
        if kl is None or not math.isfinite(kl):
            return []
        self.points = [*self.points, (step, kl)][-20:]
        base = median(self.early) if self.early else 0.0
        if kl <= KL_ERROR and (len(self.early) < EARLY_POINTS or step <= EARLY_SHARE * self.max_steps):
            self.early.append(kl)
            return []
        limit = KL_ERROR if kl > KL_ERROR else max(KL_FACTOR * base, KL_FLOOR)
        if kl <= limit:
            return []
        what = "TRL's kl" if source == "kl" else "hf-sanity's estimate of KL(initial || current) (beta = 0)"
        return self.fire(
            KL_SPIKE,
            f"the KL to the reference is {fmt(kl)} nat/token at step {step} ({what}), "
            + (f"{kl / base:.0f}x its early median {fmt(base)}" if base > 0 else f"above {fmt(limit)}"),
            step=step,
            evidence={
                "kl": kl,
                "source": source,
                "early_median": base,
                "limit": limit,
                "beta": self.beta,
                "recent": [[s, v] for s, v in self.points[-8:]],
            },
            severity="error" if kl > KL_ERROR else "warning",
        )


SATURATED, FALLEN = 0.95, 0.20
SMOOTH = 3  # logged steps a function's mean is averaged over


@monitor
class RewardHackingMonitor(Monitor):
    rules = (REWARD_HACKING,)
    reads = ("logs", "rollouts", "policy_kl")

    def __init__(self) -> None:
        super().__init__()
        self.ranges: dict[str, list[float]] = {}  # function -> [lowest, highest] reward given to a completion
        self.means: dict[str, list[float]] = {}  # function -> its recent logged means
        self.peaks: dict[str, float] = {}  # function -> the peak of its smoothed mean
        self.kl: float | None = None

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        if values.get("policy_kl") is not None:
            self.kl = values["policy_kl"]
        for name, seen in ((values.get("rollouts") or {}).get("functions") or {}).items():
            lo, hi = self.ranges.get(name, [seen["min"], seen["max"]])
            self.ranges[name] = [min(lo, seen["min"]), max(hi, seen["max"])]
        logs = values.get("logs") or {}
        if logs.get("kl") is not None:
            self.kl = logs["kl"]
        smoothed = {}
        for key, value in logs.items():
            if key.startswith("rewards/") and key.endswith("/mean") and math.isfinite(value):
                name = key[len("rewards/") : -len("/mean")]
                self.means[name] = [*self.means.get(name, []), value][-SMOOTH:]
                smoothed[name] = sum(self.means[name]) / len(self.means[name])
                if len(self.means[name]) == SMOOTH:
                    self.peaks[name] = max(self.peaks.get(name, -math.inf), smoothed[name])
        if len(smoothed) < 2:
            return []
        for high, mean in smoothed.items():
            lo, hi = self.ranges.get(high, [0.0, 0.0])
            if len(self.means[high]) < SMOOTH or hi <= lo or (mean - lo) / (hi - lo) < SATURATED:
                continue
            for low, now in smoothed.items():
                peak = self.peaks.get(low)
                low_range = self.ranges.get(low, [0.0, 0.0])
                span = low_range[1] - low_range[0]
                if low == high or peak is None or span <= 0:
                    continue
                fall = peak - now
                if fall > FALLEN * abs(peak) and fall > FALLEN * span:
                    return self._fire(step, high, mean, (lo, hi), low, peak, now)
        return []

    def _fire(self, step, high, mean, bounds, low, peak, now) -> list[Finding]:
        return self.fire(
            REWARD_HACKING,
            f"reward {high!r} is saturated ({fmt(mean)}, {(mean - bounds[0]) / (bounds[1] - bounds[0]):.0%} of its "
            f"range {fmt(bounds[0])}..{fmt(bounds[1])}) while {low!r} fell from {fmt(peak)} to {fmt(now)}"
            + (f"; KL to the start {fmt(self.kl)}" if self.kl is not None else ""),
            step=step,
            evidence={
                "saturated": high,
                "saturated_mean": mean,
                "saturated_range": list(bounds),
                "falling": low,
                "falling_peak": peak,
                "falling_now": now,
                "kl": self.kl,
            },
        )


COLLAPSE, RUNAWAY = 0.2, 2.0
ENTROPY_LOGS, LENGTH_LOGS = 3, 5
RISE = 0.1


@monitor
class EntropyMonitor(Monitor):
    rules = (ENTROPY_COLLAPSE, LENGTH_RUNAWAY)
    reads = ("logs",)

    def __init__(self) -> None:
        super().__init__()
        self.first: list[float] = []  # the first logged entropies (the start)
        self.first_zero: list[float] = []
        self.recent: list[dict[str, float]] = []

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        logs = values.get("logs") or {}
        entropy = logs.get("entropy")
        if entropy is None or not math.isfinite(entropy):
            return []
        keys = ("entropy", "frac_reward_zero_std", "completions/mean_length", "reward", "reward_std")
        self.recent = [*self.recent, {k: logs[k] for k in keys if k in logs}][-LENGTH_LOGS:]
        if len(self.first) < ENTROPY_LOGS:
            self.first.append(entropy)
            if "frac_reward_zero_std" in logs:
                self.first_zero.append(logs["frac_reward_zero_std"])
            return []
        start = median(self.first)
        return self._collapse(step, start) + self._runaway(step, start)

    def _collapse(self, step: int, start: float) -> list[Finding]:
        last = self.recent[-ENTROPY_LOGS:]
        if start <= 0 or any(r["entropy"] >= COLLAPSE * start for r in last):
            return []
        zero = [r["frac_reward_zero_std"] for r in last if "frac_reward_zero_std" in r]
        if not zero or not self.first_zero:
            return []
        before, now = sum(self.first_zero) / len(self.first_zero), sum(zero) / len(zero)
        if now < before + RISE:
            return []
        return self.fire(
            ENTROPY_COLLAPSE,
            f"the entropy fell to {fmt(last[-1]['entropy'])} nat/token ({last[-1]['entropy'] / start:.0%} of its start "
            f"{fmt(start)}) while the groups with one reward rose from {before:.0%} to {now:.0%}",
            step=step,
            evidence={
                "entropy": [r["entropy"] for r in last],
                "entropy_start": start,
                "frac_reward_zero_std_start": before,
                "frac_reward_zero_std": now,
            },
        )

    def _runaway(self, step: int, start: float) -> list[Finding]:
        recent = self.recent
        if len(recent) < LENGTH_LOGS or start <= 0 or any("completions/mean_length" not in r for r in recent):
            return []
        if any(r["entropy"] <= RUNAWAY * start for r in recent[-ENTROPY_LOGS:]):
            return []
        lengths = [r["completions/mean_length"] for r in recent]
        if any(b <= a for a, b in itertools.pairwise(lengths)):
            return []
        rewards = [r.get("reward") for r in recent]
        spread = [r.get("reward_std", 0.0) for r in recent]
        if None in rewards:
            return []
        rise = (rewards[-1] + rewards[-2]) / 2 - (rewards[0] + rewards[1]) / 2
        if rise > 0.25 * (sum(spread) / len(spread)):
            return []
        return self.fire(
            LENGTH_RUNAWAY,
            f"the completions grew from {fmt(lengths[0])} to {fmt(lengths[-1])} tokens over {len(lengths)} logged steps "
            f"with the entropy at {fmt(recent[-1]['entropy'])} nat/token ({recent[-1]['entropy'] / start:.1f}x its start) "
            f"and the reward not rising ({fmt(rewards[0])} -> {fmt(rewards[-1])})",
            step=step,
            evidence={
                "mean_length": lengths,
                "entropy": [r["entropy"] for r in recent],
                "entropy_start": start,
                "reward": rewards,
            },
        )


@LENGTH_RUNAWAY.check(applies=lambda ctx: ctx.trainer is not None and ctx.objective.kind == "rl")
def check_length_biased_loss(ctx):
    if "grpo" not in ctx.objective.loss_types:
        return
    yield LENGTH_RUNAWAY.finding(
        'loss_type="grpo" normalises the loss per sequence: long wrong completions are penalised less per token, '
        "so the completions grow (TRL: 'not recommended due to length bias')",
        evidence={"loss_type": list(ctx.objective.loss_types), "cause": "loss-type"},
    )


NOISE_SHARE, NOISE_MIN_GROUPS = 0.2, 8


@monitor
class AdvantageNoiseMonitor(Monitor):
    rules = (ADVANTAGE_NOISE,)
    reads = ("rollouts",)

    def __init__(self, scale_rewards: str | None = None) -> None:
        super().__init__()
        self.scale_rewards = scale_rewards
        self.groups = 0.0
        self.tiny = 0.0

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> Monitor:
        return cls(setup.objective.details.get("scale_rewards"))

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        seen = values.get("rollouts")
        if not seen or self.scale_rewards != "group":
            return []
        self.groups += seen["groups"]
        self.tiny += seen["tiny_std_groups"] * seen["groups"]
        if self.groups < NOISE_MIN_GROUPS or self.tiny / self.groups <= NOISE_SHARE:
            return []
        return self.fire(
            ADVANTAGE_NOISE,
            f"{self.tiny / self.groups:.0%} of {self.groups:.0f} groups have a reward std between 0 and 1e-3: "
            'scale_rewards="group" divides their advantages by it, making rounding noise into +-1',
            step=step,
            evidence={
                "tiny_std_share": self.tiny / self.groups,
                "groups": self.groups,
                "limit": NOISE_SHARE,
                "scale_rewards": self.scale_rewards,
            },
        )
