"""Preference training as it runs (DPO and its variants, KTO, ORPO, CPO/SimPO): a loss that carries no signal,
a reference that is not the initial policy, the chosen answer's likelihood falling while the margins rise.

The monitors read what the trainer logs (``logs``: TRL's `rewards/*`, `logps/*`, `loss`, `grad_norm`), the first
micro-batch's metrics before any update (``step0_metrics``), the pairs as prepared (``preference_data``), the
reference's facts (``reference``) and the callback's probe of the chosen answers' log-likelihood on a fixed
batch (``chosen_logp``): see `hf_sanity.training.trl_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hf_sanity.catalog import define, monitor
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import PREFERENCE, RL
from hf_sanity.measure.reference import config_dropout, dropout_modules, mismatch_cause, reference_facts
from hf_sanity.numbers import fmt
from hf_sanity.rules.training.base import Monitor, TrainingSetup

NO_SIGNAL = define(
    "preference-no-signal",
    severity="error",
    stage="training",
    objectives=PREFERENCE,
    symptom="The loss sits at its starting value (0.6931 = ln 2 for DPO, 0.5 x weight for KTO) for hours, "
    "margins 0, accuracy 0, gradient norm ~0.",
    detects="From step 2 on, 5 logged steps in a row whose loss stays within 0.002 of its no-signal value "
    "(ln 2 for DPO's sigmoid loss, KTO's 0.5 x its weights, else the first logged loss), whose "
    "`rewards/margins` stay under 1e-3 and whose gradient norm stays under 1e-5. `evidence.cause`: "
    "`identical-pairs` (the pairs as prepared are identical: see preference-pairs-identical), "
    "`empty-completion-mask` (`logps/chosen` and `logps/rejected` exactly 0: no completion token is scored), "
    "`frozen-parameters` (gradient norm exactly 0), `lr-beta-too-small` (a gradient, but beta so small that it "
    "vanishes), `unknown`.",
    fix="Follow evidence.cause: raise max_length or fix the pairs (identical-pairs), fix the completion masks "
    "(empty-completion-mask), unfreeze the parameters or the adapter (frozen-parameters), raise beta or the LR "
    "(lr-beta-too-small).",
)

REFERENCE_MISMATCH = define(
    "reference-mismatch",
    severity="error",
    stage="trainer",
    objectives=PREFERENCE | RL,
    symptom="Unstable or odd training from the first step: the policy is measured against a reference that is "
    "not the model it started from.",
    detects="During training: the implicit rewards of the first micro-batch (`rewards/chosen`, "
    "`rewards/rejected`), computed before any update, are not 0 (above 1e-3 in fp32, 0.05 in bf16/fp16); for "
    "GRPO/RLOO with beta > 0, the first micro-batch's `kl` (above 1e-4 in fp32, 0.01 in bf16/fp16). "
    "Before training (`preflight(trainer=...)`, a warning): a reference model whose weights differ from the "
    "policy's, or dropout active in the policy. `evidence.cause`: `reloaded-from-path` (TRL reloads the "
    "reference of a full fine-tune from `model.config._name_or_path`, and the policy was changed in memory "
    "after loading), `explicit-ref` (the `ref_model` given differs, with the distance), `adapter-reference` (a "
    "trained PEFT adapter whose reference is the base model), `dropout` (dropout on in the policy: TRL's "
    "`disable_dropout` zeroes `nn.Dropout` modules only, not a config's functional `attention_dropout`), "
    "`stale-precompute` (precomputed reference log-probs).",
    fix="Follow evidence.cause: save the changed policy and load the trainer from that folder, or pass "
    "`ref_model=copy.deepcopy(model)` (reloaded-from-path, explicit-ref); set the config's dropout rates to 0 "
    "(`model.config.attention_dropout = 0.0`) or `disable_dropout=True` (dropout); upgrade PEFT to >= 0.20 so TRL "
    "copies the adapter as the reference (adapter-reference); recompute the reference log-probs "
    "(stale-precompute).",
)

LIKELIHOOD_DISPLACEMENT = define(
    "likelihood-displacement",
    severity="warning",
    stage="training",
    objectives=PREFERENCE,
    symptom="Margins and accuracy rise, yet the model gets worse: longer, repetitive or 'opposite' answers. The "
    "chosen answers' probability falls with the rejected ones'; the mass goes to third answers.",
    detects="The chosen completions' mean log-probability per token on a fixed batch (the first training batch, "
    "re-scored at probe steps without grad) falls more than 0.5 nats below its step-0 value while "
    "`rewards/margins` rise (warning), more than 1.5 nats (error).",
    fix='Anchor the chosen answers with an NLL term (`loss_type=["sigmoid", "sft"]`, RPO-style), lower the LR, '
    "filter near-identical pairs (their gradients push both sides down).",
)

# The fix for each cause (the catalog's fix lists them all).
NO_SIGNAL_FIX = {
    "identical-pairs": "Raise max_length or shorten the prompts so that chosen and rejected differ inside it, and "
    "drop pairs whose sides are the same text (see preference-pairs-identical).",
    "empty-completion-mask": "No completion token is scored: check that the completions are not empty and that "
    "the prompt leaves room for them under max_length.",
    "frozen-parameters": "Nothing the loss reaches trains: unfreeze the parameters (requires_grad) or the adapter.",
    "lr-beta-too-small": "Raise beta (TRL's default is 0.1) or the learning rate.",
}
REFERENCE_FIX = {
    "reloaded-from-path": "TRL reloads the reference of a full fine-tune from model.config._name_or_path: save the "
    "changed policy (`model.save_pretrained(dir)`) and build the trainer from that folder, or pass "
    "`ref_model=copy.deepcopy(model)`.",
    "explicit-ref": "Pass the initial policy as ref_model (`copy.deepcopy(model)` before training), or leave ref_model "
    "unset.",
    "adapter-reference": "Upgrade PEFT to >= 0.20 so TRL keeps a frozen copy of the trained adapter as the reference, "
    "or merge the adapter into the base before preference training.",
    "dropout": "Turn dropout off in the policy: `model.config.attention_dropout = 0.0` (and the config's other "
    "dropout rates), which TRL's disable_dropout does not reach, or `disable_dropout=True` for nn.Dropout modules.",
    "stale-precompute": "Recompute the reference log-probs (precompute_ref_log_probs) with the current reference.",
}

STUCK_STEPS = 5
STUCK_LOSS = 0.002
STUCK_MARGIN = 1e-3
STUCK_GRAD = 1e-5
TOLERANCE_FP32, TOLERANCE_HALF = 1e-3, 0.05
KL_TOLERANCE_FP32, KL_TOLERANCE_HALF = 1e-4, 0.01  # k3 of bf16 log-prob noise of ~0.1 nat: ~5e-3
DISPLACEMENT_WARN, DISPLACEMENT_ERROR = 0.5, 1.5


def no_signal_loss(objective) -> float | None:
    """The loss at zero margin, where the objective says it (None: the first logged loss stands for it)."""
    loss_types = objective.loss_types or ("sigmoid",)
    if objective.variant == "dpo" and tuple(loss_types) == ("sigmoid",):
        return math.log(2)  # -log sigmoid(0), with or without label smoothing
    if objective.variant == "kto" and tuple(loss_types) in (("kto",), ()):
        weights = [
            objective.details.get("desirable_weight", 1.0),
            objective.details.get("undesirable_weight", 1.0),
        ]
        if weights[0] == weights[1]:
            return 0.5 * float(weights[0])
    return None


@monitor
class PreferenceSignalMonitor(Monitor):
    rules = (NO_SIGNAL,)
    reads = ("logs", "preference_data")

    def __init__(self, target: float | None = None, beta: float | None = None) -> None:
        super().__init__()
        self.target, self.beta = target, beta
        self.data: Mapping[str, Any] = {}
        self.stuck: list[tuple[int, dict[str, float]]] = []

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> Monitor:
        return cls(no_signal_loss(setup.objective), setup.objective.beta)

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        if values.get("preference_data"):
            self.data = values["preference_data"]  # a lazy summary: read when the rule fires
        logs = values.get("logs")
        if not logs or "loss" not in logs or step < 2:
            if logs and "loss" in logs and self.target is None:
                self.target = logs["loss"]  # the first logged loss: the model at (near) zero margin
            return []
        if self.target is None:
            self.target = logs["loss"]
        margin, grad = logs.get("rewards/margins"), logs.get("grad_norm")
        stuck = (
            abs(logs["loss"] - self.target) < STUCK_LOSS
            and (margin is None or abs(margin) < STUCK_MARGIN)
            and (grad is None or grad < STUCK_GRAD)
        )
        self.stuck = [*self.stuck, (step, logs)] if stuck else []
        if len(self.stuck) < STUCK_STEPS:
            return []
        cause, why = self._cause(logs)
        first = self.stuck[0][0]
        return self.fire(
            NO_SIGNAL,
            f"the loss has stayed at {fmt(logs['loss'])} (no-signal value {fmt(self.target)}) with margins "
            f"{fmt(margin or 0.0)} and gradient norm {fmt(grad or 0.0)} for {len(self.stuck)} logged steps since "
            f"step {first} (cause: {cause})",
            step=step,
            fix=NO_SIGNAL_FIX.get(cause),
            evidence={
                "cause": cause,
                "why": why,
                "loss": logs["loss"],
                "no_signal_loss": self.target,
                "margins": margin,
                "grad_norm": grad,
                "logged_steps": [s for s, _ in self.stuck],
                "identical_fraction": self.data.get("identical_fraction"),
            },
        )

    def _cause(self, logs: Mapping[str, float]) -> tuple[str, str]:
        if logs.get("logps/chosen") == 0 and logs.get("logps/rejected", 0) == 0:
            return (
                "empty-completion-mask",
                "logps/chosen and logps/rejected are exactly 0: no completion token is scored",
            )
        share = self.data.get("identical_fraction") or 0.0
        if share >= 0.5:
            return "identical-pairs", (
                f"{share:.0%} of the pairs are identical as the trainer feeds them (cause: "
                f"{self.data.get('identical_cause')}): see preference-pairs-identical"
            )
        grad = logs.get("grad_norm")
        if grad == 0:
            return "frozen-parameters", "the gradient norm is exactly 0: nothing the loss reaches trains"
        if grad is not None and grad > 0 and self.beta is not None and self.beta < 0.01:
            return "lr-beta-too-small", f"a gradient flows, but beta={fmt(self.beta)} scales it to ~0"
        return "unknown", "no measured cause"


@monitor
class ReferenceMonitor(Monitor):
    rules = (REFERENCE_MISMATCH,)
    reads = ("step0_metrics", "reference")

    def __init__(self, half_precision: bool = False) -> None:
        super().__init__()
        self.tolerance = TOLERANCE_HALF if half_precision else TOLERANCE_FP32
        self.kl_tolerance = KL_TOLERANCE_HALF if half_precision else KL_TOLERANCE_FP32
        self.facts: dict[str, Any] = {}

    @classmethod
    def from_setup(cls, setup: TrainingSetup) -> Monitor:
        return cls(setup.half_precision)

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        if values.get("reference") is not None:
            self.facts = dict(values["reference"])
        metrics = values.get("step0_metrics")
        if not metrics:
            return []
        # Preference: the implicit rewards; RL with beta > 0: the KL to the reference (RLOO's first-order one
        # can be negative).
        keys = ("kl",) if "kl" in metrics else ("rewards/chosen", "rewards/rejected")
        rewards = {k: metrics[k] for k in keys if k in metrics}
        tolerance = self.kl_tolerance if "kl" in rewards else self.tolerance
        worst = max((abs(v) for v in rewards.values() if math.isfinite(v)), default=0.0)
        if worst <= tolerance:
            return []
        cause, why = mismatch_cause(self.facts)
        what = "the KL to the reference" if "kl" in rewards else "the implicit rewards"
        return self.fire(
            REFERENCE_MISMATCH,
            f"{what} of the first micro-batch, before any update, {'is' if 'kl' in rewards else 'are'} not 0 "
            f"({', '.join(f'{k}={fmt(v)}' for k, v in rewards.items())}; tolerance {fmt(tolerance)}): the "
            f"reference is not the initial policy (cause: {cause})",
            step=step,
            fix=REFERENCE_FIX.get(cause),
            evidence={
                "cause": cause,
                "why": why,
                **rewards,
                "tolerance": tolerance,
                **{k: v for k, v in self.facts.items() if v not in (None, [], {}, False)},
            },
        )


def _has_reference(ctx) -> bool:
    """A preference trainer, or an RL trainer with beta > 0 (with beta = 0 TRL loads no reference)."""
    if ctx.trainer is None:
        return False
    return ctx.objective.kind in PREFERENCE or (ctx.objective.kind == "rl" and bool(ctx.objective.beta))


@REFERENCE_MISMATCH.check(applies=_has_reference)
def check_reference(ctx):
    """Before training: a reference whose weights differ, or dropout on (a warning: the step-0 rewards decide)."""
    facts = reference_facts(ctx.trainer)
    dropout = dropout_modules(ctx.trainer.model) or config_dropout(ctx.trainer.model)
    if not facts.get("ref_distance") and not dropout:
        return
    cause, why = mismatch_cause(facts)
    yield REFERENCE_MISMATCH.finding(
        f"the reference will not be the initial policy at step 0: {why} (cause: {cause})",
        fix=REFERENCE_FIX.get(cause),
        evidence={
            "cause": cause,
            "why": why,
            **{k: v for k, v in facts.items() if v not in (None, [], {}, False)},
        },
        severity="warning",
    )


@monitor
class LikelihoodMonitor(Monitor):
    rules = (LIKELIHOOD_DISPLACEMENT,)
    reads = ("chosen_logp", "logs")

    def __init__(self) -> None:
        super().__init__()
        self.start: tuple[int, float] | None = None
        self.margins: list[float] = []

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        logs = values.get("logs") or {}
        if "rewards/margins" in logs and math.isfinite(logs["rewards/margins"]):
            self.margins.append(logs["rewards/margins"])
        logp = values.get("chosen_logp")
        if logp is None or not math.isfinite(logp):
            return []
        if self.start is None:
            self.start = (step, logp)
            return []
        drop = self.start[1] - logp
        rising = len(self.margins) >= 2 and self.margins[-1] > self.margins[0]
        if drop <= DISPLACEMENT_WARN or not (rising or drop > DISPLACEMENT_ERROR):
            return []
        margins = (
            f"while the margins rose from {fmt(self.margins[0])} to {fmt(self.margins[-1])}"
            if rising
            else f"(margins now {fmt(self.margins[-1])})"
            if self.margins
            else ""
        )
        return self.fire(
            LIKELIHOOD_DISPLACEMENT,
            f"the chosen answers' log-probability fell {fmt(drop)} nats per token since step {self.start[0]} "
            f"({fmt(self.start[1])} -> {fmt(logp)} on a fixed batch) {margins}".rstrip(),
            step=step,
            evidence={
                "drop_nats_per_token": drop,
                "chosen_logp_start": self.start[1],
                "chosen_logp": logp,
                "margins_first": self.margins[0] if self.margins else None,
                "margins_last": self.margins[-1] if self.margins else None,
            },
            severity="error" if drop > DISPLACEMENT_ERROR else "warning",
        )
