"""An online RL run whose sampler is not the policy it trains (`sampler-mismatch`).

:class:`SamplerMonitor` reads two things: the callback's rescoring probe (``sampler_probe``: the facts of
``hf_sanity.measure.sampler.sampler_facts`` on a few completions of a fresh rollout batch, with whether TRL corrects
for the sampler: ``importance_correction``), and TRL's own ``sampling/*`` metrics in the logs, which TRL computes
only where it corrects (``use_vllm=True`` with ``vllm_importance_sampling_correction``). The measurement is
`hf_sanity.measure.sampler`; when the probe runs, `hf_sanity.training.sampler`.

Severity: an error when nothing corrects the run (a ``rollout_func``'s log-probs are stored and never used: TRL
1.16 applies its importance-sampling correction only with vLLM), a warning where TRL's correction runs (the run is
reweighted, within its cap, but the sampler still is not the policy: the research notes' healthy bf16 gap is about
0.03 nat/token, fp32's 0.002).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import RL
from hf_sanity.numbers import fmt
from hf_sanity.rules.training.base import Monitor

SAMPLER_MISMATCH = define(
    "sampler-mismatch",
    severity="error",
    stage="training",
    objectives=RL,
    symptom="An online RL run (a `rollout_func`, an external vLLM) trains on completions its policy did not sample: "
    "the reward stays flat while the KL and the gradient norm rise, and nothing says the run is off-policy.",
    detects="The sampler's log-probs against the policy's on the same tokens. Where TRL logs them (`use_vllm=True` "
    "with its importance-sampling correction): `sampling/sampling_logp_difference/mean` and "
    "`sampling/importance_sampling_ratio/mean` at 3 logged steps in a row (warning: TRL reweights). Otherwise (a "
    "`rollout_func` whose `logprobs` TRL stores and never uses) a rescoring probe: the first 4 completions of a "
    "fresh rollout batch, at the first 2 optimizer steps and every `probe_every` steps after (within 0.2% of the "
    "run's wall time; single process), scored by the policy (log-softmax of its logits over the trainer's "
    "temperature, as TRL scores them). Flagged at 2 probes in a row with a mean absolute gap above 0.05 "
    "nat/token or a mean per-token sequence ratio exp(mean(policy - sampled)) outside [0.9, 1.1]; an error when "
    "no importance correction is applied. Causes: `retokenized` (a completion's ids and its log-probs differ in "
    "count, or, where nothing else explains the gap, at least half the completions match the policy token for "
    "token (within 0.05 nat) up to a token from which they are far off (4 times the matched tokens' gap, 0.1 at "
    "least): the ids were decoded and re-encoded after sampling and the log-probs cropped to them), `stale-weights` (an earlier policy fits the "
    "sampled log-probs: the reference model, the adapter disabled, or a copy of the starting weights kept for "
    "models up to 100M parameters), `temperature` (the log-softmax at another temperature fits them: the first "
    "token's ratio shows it most), `top-p` (log-probs renormalised over a nucleus: above the policy's on nearly "
    "every token), `no-correction` (no signature explains the gap and nothing corrects it), `unknown`.",
    fix="Make the sampler the policy: sync the weights into the sampler after each update (with LoRA: the merged "
    "adapter), sample and report log-probs at the trainer's `temperature`, return the full-distribution log-probs "
    "(vLLM: `--logprobs-mode processed_logprobs` only with the same top-p/top-k the trainer knows of), and return "
    "the sampled ids themselves, never a re-encoding of their text. Where the sampler cannot match the policy, "
    "correct for it: `use_vllm=True` keeps TRL's importance-sampling correction on.",
)

GAP = 0.05  # nat/token: healthy bf16 is ~0.03 (mean abs), fp32 ~0.002
RATIO_LOW, RATIO_HIGH = 0.9, 1.1  # the mean per-token sequence ratio exp(mean(policy - sampled))
CONFIRMING = 2  # probes in a row over the limits (a probe is 4 completions)
LOGGED = 3  # TRL's logged sampling metrics over the limits: logged steps in a row
FITS = 0.25  # an explanation leaves at most a quarter of the gap (and less than GAP)
TEMPERATURE_OFF = 0.05  # an apparent temperature 5% off the trainer's
ABOVE = 0.9  # top-p: the share of tokens whose sampled log-prob is above the policy's

CAUSE_FIX = {
    "retokenized": "Return the ids the sampler produced (`completion_ids` from the engine, never "
    "`tokenizer.encode(text)`), with one log-prob per id; re-rendering a multi-turn conversation from its text "
    "changes ids too (see template-not-prefix-preserving).",
    "stale-weights": "Sync the policy's weights into the sampler after every optimizer step (with LoRA: merge or "
    "load the current adapter; vLLM: `sync_weights`); the sampler now samples the policy the run started from.",
    "temperature": "Sample and compute the log-probs at the trainer's `temperature` (divide the logits by it before "
    "the log-softmax), or set the trainer's `temperature` to the sampler's.",
    "top-p": "Return log-probs of the full distribution (vLLM: `--logprobs-mode processed_logprobs` with the "
    "trainer's top-p/top-k), or give the trainer the same `top_p`/`top_k`; renormalised log-probs make every "
    "sampled token look likelier than the policy finds it.",
    "no-correction": "Find where the sampler differs from the policy (weights, temperature, top-p, ids), or correct "
    "for it: `use_vllm=True` applies TRL's importance-sampling correction; a `rollout_func`'s log-probs are never "
    "used for one.",
    "unknown": "Find where the sampler differs from the policy (weights, temperature, top-p/top-k, precision); "
    "TRL reweights within its cap (`vllm_importance_sampling_clip_max`), but a large gap still biases the run.",
}


INITIAL = {
    "adapter-disabled": "the base model with the adapter disabled",
    "reference-model": "the reference model",
    "initial-copy": "the weights the run started from",
}


def over_limits(facts: Mapping[str, Any]) -> bool:
    ratio = facts.get("sequence_ratio_mean")
    gap = facts.get("gap_mean")
    return bool(
        (gap is not None and math.isfinite(gap) and gap > GAP)
        or (ratio is not None and not RATIO_LOW <= ratio <= RATIO_HIGH)
    )


def cause_of(facts: Mapping[str, Any]) -> str:
    """What explains a probe's gap, from its facts (``measure.sampler.sampler_facts``)."""
    gap = facts["gap_mean"]

    def fits(key: str) -> bool:
        value = facts.get(key)
        return value is not None and math.isfinite(value) and value <= min(FITS * gap, GAP)

    if facts.get("rows_logprob_count_differs"):
        return "retokenized"
    if fits("initial_gap"):
        return "stale-weights"
    apparent, configured = facts.get("apparent_temperature"), facts.get("temperature") or 1.0
    if fits("apparent_temperature_gap") and abs(apparent / configured - 1) > TEMPERATURE_OFF:
        return "temperature"
    if (fits("apparent_top_p_gap") and facts.get("apparent_top_p", 1) < 1) or (
        facts.get("delta_mean", 0) > GAP and facts.get("above_share", 0) >= ABOVE
    ):
        return "top-p"
    if facts.get("rows_matched_then_broken", 0) * 2 >= max(facts.get("sequences", 0), 1):
        return "retokenized"
    return "unknown" if facts.get("importance_correction") else "no-correction"


def explain(cause: str, facts: Mapping[str, Any]) -> str:
    if cause == "retokenized" and not facts.get("rows_logprob_count_differs"):
        return (
            f"{facts['rows_matched_then_broken']} of {facts['sequences']} completions match the policy token for "
            "token up to a token from which they are far off: the ids were changed after sampling "
            "(decoded and re-encoded) and the log-probs cropped to them, so from there they belong to tokens "
            "never trained on"
        )
    if cause == "retokenized":
        first = (facts.get("logprob_counts") or [[None, None]])[0]
        return (
            f"{facts['rows_logprob_count_differs']} of {facts['sequences']} completions carry a different number "
            f"of ids and log-probs (first: {first[0]} ids, {first[1]} log-probs): the ids were changed after "
            "sampling (decoded and re-encoded), so the log-probs belong to tokens never trained on"
        )
    if cause == "stale-weights":
        source = INITIAL.get(facts.get("initial_source"), "an earlier policy")
        return (
            f"they match {source} within {fmt(facts['initial_gap'])} nat/token: the sampler runs on weights the "
            "run no longer trains"
        )
    if cause == "temperature":
        return (
            f"they fit log-softmax(logits / {fmt(facts['apparent_temperature'])}) within "
            f"{fmt(facts['apparent_temperature_gap'])} nat/token, and the trainer scores at temperature "
            f"{fmt(facts['temperature'])} (first-token ratio {fmt(facts.get('first_token_ratio'))})"
        )
    if cause == "top-p":
        return (
            f"they sit above the policy's on {facts['above_share']:.0%} of the tokens (by "
            f"{fmt(facts['delta_mean'])} nat/token, a kept mass of {math.exp(-facts['delta_mean']):.2f}; nucleus "
            f"fit: top_p={fmt(facts.get('apparent_top_p'))}): log-probs renormalised over a nucleus"
        )
    return "no signature (weights, temperature, top-p, ids) explains the gap"


@monitor
class SamplerMonitor(Monitor):
    rules = (SAMPLER_MISMATCH,)
    reads = ("sampler_probe", "logs")

    def __init__(self) -> None:
        super().__init__()
        self.streak: list[int] = []  # the steps of the probes in a row over the limits
        self.logged: list[int] = []  # the logged steps in a row with TRL's sampling metrics over the limits
        self.last: dict[str, Any] | None = None  # the last probe's facts

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        found: list[Finding] = []
        probe = values.get("sampler_probe")
        if probe is not None:
            self.last = dict(probe)
            self.streak = [*self.streak, step][-CONFIRMING:] if over_limits(probe) else []
            if len(self.streak) >= CONFIRMING:
                found += self._probed(step, probe)
        logs = values.get("logs") or {}
        diff = logs.get("sampling/sampling_logp_difference/mean")
        ratio = logs.get("sampling/importance_sampling_ratio/mean")
        if diff is not None or ratio is not None:
            facts = {"gap_mean": diff, "sequence_ratio_mean": ratio}
            self.logged = [*self.logged, step][-LOGGED:] if over_limits(facts) else []
            if len(self.logged) >= LOGGED:
                found += self._logged(step, logs)
        return found

    def _probed(self, step: int, facts: Mapping[str, Any]) -> list[Finding]:
        cause = cause_of(facts)
        corrected = bool(facts.get("importance_correction"))
        tail = (
            "TRL's importance-sampling correction reweights the run"
            if corrected
            else "no importance correction is applied (TRL corrects only with use_vllm=True): the run trains "
            "off-policy"
        )
        return self.fire(
            SAMPLER_MISMATCH,
            f"the sampler's log-probs are {fmt(facts['gap_mean'])} nat/token from the policy's on the same tokens "
            f"(mean over {facts['tokens']} tokens of {facts['sequences']} completions, steps "
            f"{self.streak[0]}-{step}; sequence ratio {facts['sequence_ratio_mean']:.2f}, "
            f"{facts['sequence_ratio_min']:.2f}-{facts['sequence_ratio_max']:.2f}): {explain(cause, facts)}; {tail}",
            step=self.streak[0],
            evidence={
                **facts,
                "source": "rescoring-probe",
                "probe_steps": list(self.streak),
                "cause": cause,
                "limits": {"gap": GAP, "ratio": [RATIO_LOW, RATIO_HIGH]},
            },
            severity="warning" if corrected else "error",
            fix=CAUSE_FIX[cause],
        )

    def _logged(self, step: int, logs: Mapping[str, Any]) -> list[Finding]:
        probed = self.last if self.last is not None and over_limits(self.last) else None
        cause = cause_of(probed) if probed is not None else "unknown"
        metrics = {k: v for k, v in logs.items() if k.startswith("sampling/")}
        diff = metrics.get("sampling/sampling_logp_difference/mean")
        ratio = metrics.get("sampling/importance_sampling_ratio/mean")
        return self.fire(
            SAMPLER_MISMATCH,
            f"TRL measures the sampler {fmt(diff)} nat/token from the policy (sampling_logp_difference/mean) and "
            f"an importance-sampling ratio of {fmt(ratio)} (mean) at steps {self.logged[0]}-{step}: the sampler "
            "is not the policy; TRL reweights within its cap"
            + (f" ({explain(cause, probed)})" if probed is not None and cause != "unknown" else ""),
            step=self.logged[0],
            evidence={
                "source": "trl-metrics",
                "metrics": metrics,
                "logged_steps": list(self.logged),
                "probe": probed,
                "cause": cause,
                "importance_correction": True,
                "limits": {"gap": GAP, "ratio": [RATIO_LOW, RATIO_HIGH]},
            },
            severity="warning",
            fix=CAUSE_FIX[cause],
        )
