"""What the run trains for: the training objective, measured once and given to every entry point.

A rule applies to the objectives it names (`catalog.define(..., objectives=...)`): an SFT rule reads one
sequence with labels and a cross-entropy loss, and never reads a DPO pair or a GRPO rollout as one. The
objective is read from the trainer's class (TRL's trainers by name, so TRL need not be installed) and config,
or from the dataset's columns when there is no trainer.

Kinds:

* ``sft``: next-token cross-entropy on labelled sequences (``Trainer``, TRL's ``SFTTrainer``);
* ``preference``: pairwise preference (``DPOTrainer`` and its ``loss_type``s: IPO, cDPO/robust, ...; ORPO,
  CPO/SimPO under ``trl.experimental``);
* ``preference-unpaired``: KTO (``prompt``/``completion``/``label``);
* ``reward``: a reward model trained on pairs (``RewardTrainer``);
* ``rl``: online RL from reward functions (``GRPOTrainer``, ``RLOOTrainer``);
* ``unknown``: a trainer hf-sanity does not know (another TRL trainer): only the rules that hold for any
  objective run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hf_sanity.measure.formats import label_is_boolean

KINDS = ("sft", "preference", "preference-unpaired", "reward", "rl", "unknown")
ANY = frozenset(KINDS)
SFT = frozenset({"sft"})
PREFERENCE = frozenset({"preference", "preference-unpaired"})
PAIRED = frozenset({"preference", "reward"})  # trained on (chosen, rejected) pairs
RL = frozenset({"rl"})
# Rules for the kinds that train on sequences with a loss over completion tokens: SFT, and each side of a
# preference or reward pair (EOS, truncation, BOS and special tokens of the sequences the model is fed).
SEQUENCES = SFT | PREFERENCE | {"reward"}
NOT_RL = ANY - RL - {"unknown"}  # a loss of its own that means what it says (RL losses are ~0 by design)
# Objectives whose every loss is >= 0 (cross-entropy, -log sigmoid, KTO's 1 - sigmoid); DPO's `robust`
# loss and RL objectives go below 0 by design.
NONNEGATIVE_LOSS = frozenset({"sft", "reward", "preference-unpaired"})

# TRL trainer class -> (kind, variant). Matched along the class's MRO, so a user's subclass is its parent's.
TRAINERS: dict[str, tuple[str, str]] = {
    "GRPOTrainer": ("rl", "grpo"),
    "RLOOTrainer": ("rl", "rloo"),
    "KTOTrainer": ("preference-unpaired", "kto"),
    "RewardTrainer": ("reward", "reward"),
    "ORPOTrainer": ("preference", "orpo"),
    "CPOTrainer": ("preference", "cpo"),
    "DPOTrainer": ("preference", "dpo"),
    "SFTTrainer": ("sft", "sft"),
}
# TRL trainers whose objective no rule here is written for: only objective-independent rules run on them.
UNKNOWN_TRL = ("OnlineDPOTrainer", "PPOTrainer", "XPOTrainer", "NashMDTrainer", "GKDTrainer", "BCOTrainer",
               "PRMTrainer", "DistillationTrainer")  # fmt: skip


@dataclass(frozen=True)
class Objective:
    kind: str = "sft"
    variant: str = "sft"  # dpo, ipo, orpo, cpo, simpo, kto, reward, grpo, rloo, sft, ...
    trainer: str | None = None  # the trainer's class name
    source: str = "default"  # "trainer", "columns" or "default"
    loss_types: tuple[str, ...] = ()
    beta: float | None = None
    details: dict[str, Any] = field(default_factory=dict, compare=False)  # config values rules read

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"objective kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def is_sft(self) -> bool:
        return self.kind == "sft"

    def describe(self) -> dict[str, Any]:
        """The report's ``stats.objective_detail``."""
        out: dict[str, Any] = {"variant": self.variant, "source": self.source}
        if self.trainer:
            out["trainer"] = self.trainer
        if self.loss_types:
            out["loss_type"] = list(self.loss_types)
        if self.beta is not None:
            out["beta"] = self.beta
        return out


SFT_OBJECTIVE = Objective()
# Config values of preference and RL trainers the rules read (`Objective.details`).
CONFIG_KEYS = ("simpo_gamma", "cpo_alpha", "label_smoothing", "desirable_weight", "undesirable_weight",
               "num_generations", "max_completion_length", "temperature", "scale_rewards", "num_iterations",
               "max_length", "precompute_ref_log_probs", "disable_dropout", "mask_truncated_completions")  # fmt: skip


def _config_value(args, name: str, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def of_trainer(trainer) -> Objective:
    """The objective of a trainer object, from its class (and its parents') and its config (SFT without one)."""
    if trainer is None:
        return SFT_OBJECTIVE
    names = [cls.__name__ for cls in type(trainer).__mro__]
    trainer_name = type(trainer).__name__
    args = getattr(trainer, "args", None)
    for name in names:
        if name in UNKNOWN_TRL:
            return Objective("unknown", name.removesuffix("Trainer").lower(), trainer_name, "trainer")
        if name not in TRAINERS:
            continue
        kind, variant = TRAINERS[name]
        if kind == "sft":
            return Objective("sft", "sft", trainer_name, "trainer")
        raw = _config_value(args, "loss_type", ())
        loss_types = tuple(raw) if isinstance(raw, (list, tuple)) else (raw,) if raw else ()
        beta = _config_value(args, "beta")
        beta = float(beta) if isinstance(beta, (int, float)) and math.isfinite(beta) else None
        if name == "DPOTrainer" and "ipo" in loss_types:
            variant = "ipo"
        elif name == "CPOTrainer" and loss_types and loss_types[0] in ("simpo", "alphapo"):
            variant = "simpo"
        details = {key: getattr(args, key) for key in CONFIG_KEYS if args is not None and hasattr(args, key)}
        return Objective(kind, variant, trainer_name, "trainer", loss_types, beta, details)
    return Objective("sft", "sft", trainer_name, "trainer")


# Dataset columns -> objective, as TRL reads them (most specific first).
COLUMN_OBJECTIVES: tuple[tuple[frozenset[str], str, str], ...] = (
    (frozenset({"chosen", "rejected"}), "preference", "dpo"),
    (frozenset({"completion", "label"}), "preference-unpaired", "kto"),
)


def of_columns(columns: Iterable[str], *, features=None) -> Objective:
    """The objective a dataset's columns imply (SFT unless they are preference data); with ``features`` (the
    column types), a `label` that is not boolean is not KTO's (classification-style SFT data)."""
    present = set(columns)
    for needed, kind, variant in COLUMN_OBJECTIVES:
        if variant == "kto" and label_is_boolean(features) is False:
            continue
        if needed <= present:
            return Objective(kind, variant, None, "columns")
    return Objective("sft", "sft", None, "columns")


# What a finished run's logged metrics say it trained for (TRL logs its own vocabulary; most specific first).
LOGGED_KEYS: tuple[tuple[str, str, str], ...] = (
    ("frac_reward_zero_std", "rl", "grpo"),
    ("completions/clipped_ratio", "rl", "grpo"),
    ("mean_reward", "reward", "reward"),
    ("log_odds_chosen", "preference", "orpo"),
    ("rewards/accuracies", "preference", "dpo"),
    ("kl", "preference-unpaired", "kto"),
    ("rewards/chosen", "preference", "dpo"),
)


def of_log_history(entries) -> Objective:
    """The objective a run's ``log_history`` (trainer_state.json) shows, from the metric names TRL logs."""
    keys = {key for entry in entries or () if isinstance(entry, dict) for key in entry}
    for key, kind, variant in LOGGED_KEYS:
        if key in keys:
            return Objective(kind, variant, None, "logs")
    return Objective("sft", "sft", None, "logs")
