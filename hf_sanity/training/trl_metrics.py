"""What a preference or RL trainer tells about its own objective, as values for the step detectors.

TRL's trainers log their own vocabulary (`rewards/chosen`, `rewards/margins`, `logps/chosen`, KTO's `kl`,
`frac_reward_zero_std`, `completions/clipped_ratio`, ...) through ``log()``, averaged over each logging window;
per micro-batch they wait in ``trainer._metrics["train"]`` until the logging step averages and clears them, so
at the end of the first optimizer step the first micro-batch's values are the exact step-0 numbers, computed
before any update. This module reads both, and at train begin measures what the rules compare them with (the
pairs as the trainer prepared them, the reference model's facts); nothing here runs on an SFT run.
"""

from __future__ import annotations

from typing import Any

# The rows of a trainer's prepared dataset summarised at train begin: enough for the shares the rules read,
# a bounded cost whatever the dataset's size.
SUMMARY_ROWS = 1024


class ObjectiveFeed:
    """Values for the step detectors of a preference or RL run (``active`` is False on any other run)."""

    def __init__(self, trainer=None, objective=None) -> None:
        self.trainer, self.objective = trainer, objective
        kinds = ("preference", "preference-unpaired", "reward", "rl")
        self.active = trainer is not None and objective is not None and objective.kind in kinds

    def begin(self) -> dict[str, Any]:
        """At train begin: the pairs as prepared (preference, reward) and the reference's facts."""
        if not self.active:
            return {}
        from hf_sanity.measure.reference import reference_facts

        values: dict[str, Any] = {}
        if self.objective.kind in ("preference", "preference-unpaired", "rl"):
            values["reference"] = reference_facts(self.trainer)
        if self.objective.kind in ("preference", "reward"):
            values["preference_data"] = pair_summary(self.trainer, reward=self.objective.kind == "reward")
        return values

    def first_step(self) -> dict[str, Any]:
        """At the end of the first optimizer step: the first micro-batch's metrics, before any update."""
        metrics = getattr(self.trainer, "_metrics", None)
        current = metrics.get("train") if isinstance(metrics, dict) else None
        if not self.active or not current:
            return {}
        first = {key: values[0] for key, values in current.items() if isinstance(values, list) and values}
        return {"step0_metrics": {k: float(v) for k, v in first.items() if isinstance(v, (int, float))}}

    def step_end(self, step: int, monitors, sink) -> None:
        """The callback's end of step: the first step's metrics to the monitors."""
        if self.active and step == 1:
            with sink.guard("callback-trl-metrics"):
                monitors.feed(1, self.first_step())

    def log(self, step: int, logs: dict[str, Any] | None, monitors, sink) -> None:
        """The callback's log: the logged numbers to the monitors."""
        if self.active:
            with sink.guard("callback-trl-metrics"):
                monitors.feed(step, self.logged(logs))

    def logged(self, logs: dict[str, Any] | None) -> dict[str, Any]:
        """A training log's numbers (not an evaluation's)."""
        if not self.active or not logs or any(key.startswith("eval_") for key in logs):
            return {}
        numbers = {
            k: float(v) for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        return {"logs": numbers} if "loss" in numbers or len(numbers) > 2 else {}


def pair_summary(trainer, *, reward: bool) -> dict[str, Any]:
    """The shares the preference rules read in training, from the first :data:`SUMMARY_ROWS` pairs as the trainer
    prepared them: identical pairs and why, content-blind separability, the chosen completion's mean length."""
    from hf_sanity.measure.markers import derive_markers
    from hf_sanity.measure.preference import pairs_from_trainer
    from hf_sanity.rules.preference import separable

    data = getattr(trainer, "train_dataset", None)
    tokenizer = getattr(trainer, "processing_class", None)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    if data is None or tokenizer is None or not hasattr(data, "select"):
        return {}
    head = _Head(trainer, data.select(range(min(SUMMARY_ROWS, len(data)))))
    pairs, _ = pairs_from_trainer(head, tokenizer=tokenizer, markers=derive_markers(tokenizer), reward=reward,
                                  sample=0)  # fmt: skip
    if not len(pairs):
        return {}
    causes = [str(c) for c in pairs.cause[pairs.identical]]
    found = separable(pairs)
    kept = pairs.chosen_kept[pairs.chosen_kept > 0]
    return {
        "pairs": len(pairs),
        "identical_fraction": float(pairs.identical.mean()),
        "identical_cause": max(set(causes), key=causes.count) if causes else None,
        "separable": {"rule": found[0], "cause": found[1], "accuracy": found[2]} if found else None,
        "chosen_tokens_mean": float(kept.mean()) if len(kept) else None,
    }


class _Head:
    """The trainer, seen with the first rows of its dataset only."""

    def __init__(self, trainer, data) -> None:
        self.args, self.train_dataset = trainer.args, data
