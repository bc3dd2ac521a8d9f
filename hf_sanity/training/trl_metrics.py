"""What a preference or RL trainer tells about its own objective, as values for the step detectors.

TRL's trainers log their own vocabulary (`rewards/chosen`, `rewards/margins`, `logps/chosen`, KTO's `kl`,
`frac_reward_zero_std`, `completions/clipped_ratio`, ...) through ``log()``, averaged over each logging window;
per micro-batch they wait in ``trainer._metrics["train"]`` until the logging step averages and clears them, so
at the end of the first optimizer step the first micro-batch's values are the exact step-0 numbers, computed
before any update. This module reads both, and at train begin measures what the rules compare them with (the
pairs as the trainer prepared them, the reference model's facts; an RL run's reward functions called on a few
completions, in a child process whose verdicts are read at the first step's end, and, with beta = 0, the start
of its own KL probe). During an RL run it also reads the trainer's
latest rollouts in group order (``trainer._logs``: each completion's reward per function and its text). Nothing
here runs on an SFT run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hf_sanity import versions
from hf_sanity.measure.processing import trainer_tokenizer

# The rows of a trainer's prepared dataset summarised at train begin: enough for the shares the rules read,
# a bounded cost whatever the dataset's size.
SUMMARY_ROWS = 1024


class ObjectiveFeed:
    """Values for the step detectors of a preference or RL run (``active`` is False on any other run). ``sink``: the
    callback's (the run's objective, the rules it wants, the guard each measurement runs in); ``every``: steps
    between the RL KL probes (beta = 0); ``reward_dry_run``: call an RL run's reward functions at train begin."""

    def __init__(self, trainer=None, sink=None, every: int = 50, reward_dry_run: bool = True) -> None:
        self.trainer, self.sink = trainer, sink
        self.objective = objective = getattr(sink, "objective", None)
        self.every, self.reward_dry_run = every, reward_dry_run
        kinds = ("preference", "preference-unpaired", "reward", "rl")
        self.active = trainer is not None and objective is not None and objective.kind in kinds
        # TRL's internal tallies are read under a supported TRL only (another one: the logged metrics alone).
        self.internals = self.active and versions.supported("trl")
        self.drift: PolicyDrift | None = None
        self.sampler = None  # the rescoring probe of an RL run's sampler (`hf_sanity.training.sampler`)
        # What an RL run's reward dry run found at train begin (or why it did not run).
        self.dry_run: dict[str, Any] | str | None = None
        self.pending = None  # the dry run at work in its child (`measure.rl.PendingDryRun`), until settled
        self.unreaped = 0  # child processes of the dry run not reaped yet

    def begin(self) -> dict[str, Any]:
        """At train begin: the pairs as prepared (preference, reward), the reference's facts, an RL run's setup."""
        if not self.active:
            return {}
        from hf_sanity.measure.reference import reference_facts

        values: dict[str, Any] = {}
        if self.objective.kind in ("preference", "preference-unpaired", "rl"):
            values["reference"] = reference_facts(self.trainer)
        if self.objective.kind in ("preference", "reward"):
            # Read only where a rule names its cause with it: a clean run never pays for the summary. One that
            # breaks is an internal-error finding (its guard), and reads as empty.
            values["preference_data"] = LazySummary(
                lambda: pair_summary(self.trainer, reward=self.objective.kind == "reward"),
                guard=lambda: self.sink.guard("callback-trl-metrics"),
            )
        if self.objective.kind == "rl":
            values.update(self.rl_begin())
        return values

    def rl_begin(self) -> dict[str, Any]:
        """An RL run at train begin: the stop ids against the template's end of turn; the reward functions called on
        the dry run's completions (unless ``reward_dry_run=False``), each call in a child process, on the main
        process only (the same verdict on every rank), or the verdict a ``preflight(trainer=...)`` of the same
        functions made on the same calls (`hf_sanity.measure.rl.carried_dry_run`); with beta = 0, the KL probe."""
        from hf_sanity.measure import rl

        values: dict[str, Any] = {"rl_setup": {"stop_mismatch": rl.stop_mismatch(self.trainer)}}
        measures = self.sink.measures
        if not self.reward_dry_run:
            self.dry_run = "skipped: reward_dry_run=False (no reward function was called)"
        elif measures("reward_dry_run") and self.sink.world_size == 1:
            carried = None
            with self.sink.guard("reward-dry-run"):  # preflight(trainer=...) judged the same calls: no fork
                carried = rl.carried_dry_run(self.trainer)
            if carried is not None:
                values.update(self._verdict(carried, child=False))
            else:
                # Started here, its verdict read at the first step's end (settle): its child works beside that
                # step, and a verdict that stops the run (abort_on="error") stops it at that step, as one read
                # here would.
                with self.sink.guard("reward-dry-run"):
                    self.pending = rl.start_dry_run(self.trainer, lambda: [rl.synthetic(self.trainer)])
        elif measures("reward_dry_run"):
            with self.sink.guard("reward-dry-run"):  # on the main process only: every rank gets its verdict
                run = rl.on_main_process(lambda: rl.dry_run(self.trainer, [rl.synthetic(self.trainer)]))
                values.update(self._verdict(run))
        if not self.internals:  # the probes read TRL's rollout buffer
            return values
        # Its baseline (a forward at the first update) only where a measurement will follow it.
        ahead = probe_ahead(self.trainer, self.every)
        if not self.objective.beta and measures("policy_kl") and self.sink.world_size == 1 and ahead:
            self.drift = PolicyDrift(self.trainer)  # its baseline: at the first update (before_update)
        if measures("sampler_probe") and self.sink.world_size == 1 and _samples_elsewhere(self.trainer):
            with self.sink.guard("sampler-mismatch"):
                from hf_sanity.training.sampler import SamplerProbe

                self.sampler = SamplerProbe(self.trainer, self.every)
        return values

    def _verdict(self, run, *, child: bool = True) -> dict[str, Any]:
        """The dry run's verdicts: in the report, its notes, and as the value the monitors read (``child``: made by
        a process of this run, whose exit is to be reaped)."""
        if child:
            self.unreaped = 1  # its processes' exits: reaped at the steps' ends (user_code.reap_finished)
        self.dry_run = run.describe()
        self.sink.report.notes.extend(run.notes())
        return {"reward_dry_run": self.dry_run} if isinstance(self.dry_run, dict) else {}

    def settle(self, monitors) -> None:
        """The dry run started at train begin: its verdicts to the monitors, as of step 0 (waiting for its child
        as long as the calls' limits allow). At the first step's end, or at the run's end if none came."""
        pending, self.pending = self.pending, None
        if pending is not None:
            with self.sink.guard("reward-dry-run"):
                monitors.feed(0, self._verdict(pending.result()))

    def abandon(self) -> None:
        """The run was interrupted: a dry run still at work is killed, its verdict not waited for."""
        pending, self.pending = self.pending, None
        if pending is not None:
            with self.sink.guard("reward-dry-run"):
                pending.abandon()
                self.dry_run = "skipped: the run was interrupted before the dry run's verdict"

    def stats(self) -> dict[str, Any]:
        """For the report: an RL run's reward dry run at train begin, and whether the KL probe ran (beta = 0)."""
        if not self.active or self.objective.kind != "rl":
            return {}
        out: dict[str, Any] = {"kl_probe": self.drift is not None}
        if self.sampler is not None:
            out["sampler_probe"] = self.sampler.stats()
        if self.dry_run is not None:
            out["reward_dry_run"] = self.dry_run
        return out

    def first_step(self) -> dict[str, Any]:
        """At the end of the first optimizer step: the first micro-batch's metrics, before any update."""
        metrics = getattr(self.trainer, "_metrics", None)
        current = metrics.get("train") if isinstance(metrics, dict) else None
        if not self.internals or not isinstance(current, dict) or not current:  # absent, or shaped otherwise
            return {}
        first = {key: values[0] for key, values in current.items() if isinstance(values, list) and values}
        numbers = {k: float(v) for k, v in first.items() if isinstance(v, (int, float))}
        return {"step0_metrics": numbers} if numbers else {}

    def before_update(self, sink) -> None:
        """The callback's pre-optimizer hook: the KL probe's baseline, at the first update this process makes."""
        if self.drift is not None and self.drift.batch is None:
            with sink.guard("kl-spike"):
                self.drift.start()
        if self.sampler is not None:
            with sink.guard("sampler-mismatch"):
                self.sampler.before_update()

    def step_end(self, step: int, monitors, sink) -> None:
        """The callback's end of step: the first step's metrics to the monitors; every ``every`` steps, an RL run's
        KL to its initial policy (beta = 0)."""
        if self.pending is not None:  # the dry run's verdict first: an error stops the run at this step
            self.settle(monitors)
        if self.active and step == 1:
            with sink.guard("callback-trl-metrics"):
                monitors.feed(1, self.first_step())
        if self.drift is not None and step % self.every == 0:
            with sink.guard("kl-spike"):
                monitors.feed(step, {"policy_kl": self.drift.measure()})
        if self.sampler is not None:
            with sink.guard("sampler-mismatch"):
                monitors.feed(step, self.sampler.take())
        if self.unreaped:  # the dry run's child processes, exited by now: reaped without waiting
            with sink.guard("reward-dry-run"):
                from hf_sanity.measure.user_code import reap_finished

                self.unreaped = reap_finished()

    def log(self, step: int, logs: dict[str, Any] | None, monitors, sink) -> None:
        """The callback's log: the logged numbers to the monitors (and an RL run's latest rollouts)."""
        if self.active:
            with sink.guard("callback-trl-metrics"):
                values = self.logged(logs)
                if values and self.objective.kind == "rl" and self.internals:
                    from hf_sanity.measure.rl import rollout_summary

                    values["rollouts"] = rollout_summary(self.trainer)
                monitors.feed(step, values)

    def logged(self, logs: dict[str, Any] | None) -> dict[str, Any]:
        """A training log's numbers (not an evaluation's)."""
        if not self.active or not logs or any(key.startswith("eval_") for key in logs):
            return {}
        numbers = {
            k: float(v) for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        return {"logs": numbers} if "loss" in numbers or len(numbers) > 2 else {}


def probe_ahead(trainer, every: int | None) -> bool:
    """A step of the run still to come is a multiple of ``every`` (a probe's step): False only where the trainer's
    state says how far it runs and no such step is left (a 40-step run probed every 50: its baseline would be
    measured for nothing)."""
    state = getattr(trainer, "state", None)
    planned, done = getattr(state, "max_steps", None), getattr(state, "global_step", 0) or 0
    if not every or not isinstance(planned, int) or planned <= 0 or not isinstance(done, int):
        return True  # not known: measured as before
    return planned // every > done // every


def _samples_elsewhere(trainer) -> bool:
    """The trainer samples through a ``rollout_func`` or vLLM: its rollouts come with the sampler's log-probs."""
    return getattr(trainer, "rollout_func", None) is not None or bool(getattr(trainer, "use_vllm", False))


class PolicyDrift:
    """The KL from an RL run's initial policy to its current one, where TRL measures none (beta = 0: no reference
    model). The completions of the first micro-batch TRL trains on are samples of the initial policy: at the first
    optimizer step, before the update (the callback's pre-optimizer hook), their mean log-probability per token is
    kept (at the trainer's temperature, as TRL scores them); :meth:`measure` re-scores them with the current
    policy, and the difference estimates KL(initial || current) per token. Cost: one forward of at most
    :data:`DRIFT_ROWS` rollouts per measurement; no generation. A resumed run measures from the policy it
    resumed."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.temperature = float(getattr(trainer.args, "temperature", 1.0) or 1.0)
        self.batch: dict[str, Any] | None = None
        self.initial: float | None = None

    def start(self) -> None:
        """Before the first update: the first rollouts, scored by the policy that sampled them."""
        buffered = getattr(self.trainer, "_buffered_inputs", None)
        first = buffered[0] if isinstance(buffered, (list, tuple)) and buffered else None
        if not isinstance(first, dict) or not {"prompt_ids", "completion_ids", "completion_mask"} <= set(
            first
        ):
            return
        self.batch = rollout_batch(first, DRIFT_ROWS)
        self.initial = self._logp()

    def _logp(self) -> float | None:
        if self.batch is None:
            return None
        return completion_logp(self.trainer.model, self.batch, self.temperature)

    def measure(self) -> float | None:
        now = self._logp()
        return None if now is None or self.initial is None else self.initial - now


DRIFT_ROWS = 8


def rollout_batch(inputs: dict[str, Any], rows: int) -> dict[str, Any]:
    """The first ``rows`` prompt + completion sequences of a TRL rollout batch (prompts left-padded, completions
    right-padded, as TRL feeds them), with their completion tokens as labels."""
    import torch

    prompt_ids, completion_ids = inputs["prompt_ids"][:rows], inputs["completion_ids"][:rows]
    prompt_mask = inputs.get("prompt_mask", torch.ones_like(prompt_ids))[:rows]
    completion_mask = inputs["completion_mask"][:rows]
    labels = torch.where(completion_mask.bool(), completion_ids, torch.full_like(completion_ids, -100))
    return {
        "input_ids": torch.cat([prompt_ids, completion_ids], dim=1).detach().clone(),
        "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1).detach().clone(),
        "labels": torch.cat([torch.full_like(prompt_ids, -100), labels], dim=1).detach().clone(),
    }


def completion_logp(model, batch: dict[str, Any], temperature: float = 1.0) -> float | None:
    """The mean log-probability per labelled token of ``batch`` (logits divided by ``temperature``, as TRL scores
    its completions), without grad in eval mode, everything restored."""
    import torch

    from hf_sanity.measure.tensors import forward_kwargs, logits_of
    from hf_sanity.training.shards import kept_sharded
    from hf_sanity.untouched import untouched

    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with untouched(model), kept_sharded(model):
        logits = logits_of(model(**forward_kwargs(model, inputs, use_cache=False)))
        if logits is None or logits.dim() != 3 or logits.shape[:2] != labels.shape:
            return None
        targets = labels[:, 1:].to(logits.device)
        mask = targets != -100
        if not bool(mask.any()):
            return None
        logp = torch.log_softmax(logits[:, :-1][mask].float() / temperature, dim=-1)
        return float(logp.gather(-1, targets[mask].unsqueeze(-1)).mean())


def pair_summary(trainer, *, reward: bool) -> dict[str, Any]:
    """The shares the preference rules read in training, from the first :data:`SUMMARY_ROWS` pairs as the trainer
    prepared them: identical pairs and why, content-blind separability, the chosen completion's mean length."""
    from hf_sanity.measure.markers import derive_markers
    from hf_sanity.measure.preference import pairs_from_trainer, separability

    data = getattr(trainer, "train_dataset", None)
    tokenizer = trainer_tokenizer(trainer)
    if data is None or tokenizer is None or not hasattr(data, "select"):
        return {}
    head = _Head(trainer, data.select(range(min(SUMMARY_ROWS, len(data)))))
    pairs, _ = pairs_from_trainer(head, tokenizer=tokenizer, markers=derive_markers(tokenizer), reward=reward,
                                  sample=0)  # fmt: skip
    if not len(pairs):
        return {}
    causes = [str(c) for c in pairs.cause[pairs.identical]]
    kept = pairs.chosen_kept[pairs.chosen_kept > 0]
    return {
        "pairs": len(pairs),
        "identical_fraction": float(pairs.identical.mean()),
        "identical_cause": max(set(causes), key=causes.count) if causes else None,
        "separability": separability(pairs),  # each content-blind rule's accuracy (judged by the rule)
        "chosen_tokens_mean": float(kept.mean()) if len(kept) else None,
    }


class LazySummary(Mapping):
    """:func:`pair_summary`'s numbers, computed at the first read: the rules that read them (the causes of
    `preference-no-signal` and `preference-trivially-separable`) do so only when they fire, so a clean run never
    summarises its pairs. The trainer's prepared dataset does not change during the run, so a late read sees the
    pairs an early one would have; RNG states are kept as they were. ``guard``: the context the computation runs
    in (the callback's: an exception becomes an internal-error finding, and the summary reads as empty)."""

    def __init__(self, compute: Callable[[], dict[str, Any]], guard: Callable[[], Any] | None = None) -> None:
        self._compute: Callable[[], dict[str, Any]] | None = compute
        self._guard = guard
        self._data: dict[str, Any] = {}

    @property
    def data(self) -> dict[str, Any]:
        if self._compute is not None:
            import contextlib

            from hf_sanity.untouched import preserved_rng

            compute, self._compute = self._compute, None
            with self._guard() if self._guard else contextlib.nullcontext(), preserved_rng():
                self._data = dict(compute() or {})
        return self._data

    def __bool__(self) -> bool:  # there is something to read (an empty summary reads as no data)
        return True

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __iter__(self):
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    @property
    def computed(self) -> bool:
        return self._compute is None


class _Head:
    """The trainer, seen with the first rows of its dataset only."""

    def __init__(self, trainer, data) -> None:
        self.args, self.train_dataset = trainer.args, data
