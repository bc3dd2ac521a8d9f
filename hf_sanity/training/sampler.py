"""When SanityCallback rescores an RL run's rollouts (``sampler_probe``, for `sampler-mismatch`:
`hf_sanity.rules.training.sampler`; the measurement: `hf_sanity.measure.sampler`).

At the callback's pre-optimizer hook, before the update, the trainer's rollout buffer (TRL's ``_buffered_inputs``)
holds the completions this step trains on. When TRL generated them during this optimizer step (it assigns a new
buffer at each generation; a buffer reused across steps, ``steps_per_generation`` > the accumulation or
``num_iterations`` > 1, comes from an older policy by design and TRL corrects for it) and they came with sampler
log-probs, the probe rescores the first few with the policy that is about to be updated: the policy TRL meant to
sample. Due at the first :data:`FIRST_PROBES` optimizer steps and every ``every`` steps after, within
:data:`SHARE` of the run's wall time (`hf_sanity.training.budget`); single process only (a sharded model's forward
needs every rank).

The earlier policy the sampler may match (stale weights): the adapter disabled for a PEFT model, else TRL's
reference model (beta > 0), else a copy of the starting weights, kept at train begin for models of at most
:data:`COPY_PARAMETERS` parameters; a larger full fine-tune with beta = 0 is not tested for stale weights.
"""

from __future__ import annotations

import copy
from typing import Any

from hf_sanity.measure.processing import trainer_tokenizer
from hf_sanity.training.budget import Budget

RULE = "sampler-mismatch"
SHARE = 0.005  # of the run's wall time
FIRST_PROBES = 2  # optimizer steps probed from the start, whatever the cadence
FREE_PROBES = 4  # probes that run whatever they cost (the budget judges the ones after)
COPY_PARAMETERS = 100_000_000


class SamplerProbe:
    def __init__(self, trainer, every: int) -> None:
        from hf_sanity.measure import sampler

        self.trainer, self.every = trainer, every
        args = trainer.args
        self.temperature = float(getattr(args, "temperature", 1.0) or 1.0)
        use_vllm = bool(getattr(trainer, "use_vllm", False))
        self.setup = {
            "importance_correction": use_vllm
            and bool(getattr(trainer, "vllm_importance_sampling_correction", False)),
            "use_vllm": use_vllm,
            "rollout_func": getattr(trainer, "rollout_func", None) is not None,
        }
        self.budget = Budget(share=SHARE, free=FREE_PROBES)
        self.seen = None  # the rollout buffer looked at last (kept: an id could be reused)
        self.pending: dict[str, Any] | None = None
        self.probes = 0
        self.initial, self.initial_source = sampler.peft_initial(trainer.model), "adapter-disabled"
        if self.initial is None and getattr(trainer, "ref_model", None) is not None:
            self.initial, self.initial_source = sampler.model_initial(trainer.ref_model), "reference-model"
        elif self.initial is None and _copyable(trainer.model):
            kept = _copy(trainer.model)
            self.initial, self.initial_source = sampler.model_initial(kept), "initial-copy"
        if self.initial is None:
            self.initial_source = None

    def before_update(self) -> None:
        """The pre-optimizer hook: rescore the fresh rollouts when due (the values wait for :meth:`take`)."""
        buffered = getattr(self.trainer, "_buffered_inputs", None)
        if not isinstance(buffered, list) or not buffered or buffered is self.seen:
            return
        self.seen = buffered
        step = int(self.trainer.state.global_step) + 1
        if not isinstance(buffered[0], dict) or "sampling_per_token_logps" not in buffered[0]:
            return
        if not (step <= FIRST_PROBES or step % self.every == 0) or not self.budget.due():
            return
        from hf_sanity.measure.sampler import sampler_facts

        tokenizer = trainer_tokenizer(self.trainer)
        with self.budget.spend():
            facts = sampler_facts(
                self.trainer.model, buffered[0], self.temperature, initial=self.initial,
                initial_source=self.initial_source, tokenizer=tokenizer,
            )  # fmt: skip
        if facts is not None:
            self.probes += 1
            self.pending = {**facts, **self.setup, "step": step}

    def take(self) -> dict[str, Any]:
        """The last probe's facts for the monitors (once)."""
        facts, self.pending = self.pending, None
        return {"sampler_probe": facts} if facts is not None else {}

    def stats(self) -> dict[str, Any]:
        return {"probes": self.probes, "skipped": self.budget.skipped, "seconds": round(self.budget.spent, 4),
                "initial_policy": self.initial_source,
                **self.setup}  # fmt: skip


def _copyable(model) -> bool:
    """A model small enough to keep a copy of its starting weights, and not partitioned (DeepSpeed ZeRO-3)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params) <= COPY_PARAMETERS and not any(hasattr(p, "ds_id") for p in params)


def _copy(model):
    """A frozen copy of ``model``'s weights that runs its own forward: accelerate's ``prepare`` replaces a model's
    ``forward`` by a wrapper of the bound method (mixed precision), which a deep copy would keep calling."""
    kept = copy.deepcopy(model).eval().requires_grad_(False)
    for module in kept.modules():
        module.__dict__.pop("forward", None)
    return kept
