"""`SanityCallback(generate_every=N, generate_prompts=K)`: the output checks of `hf-sanity outputs`, at
evaluation time, on a few held-out prompts, so that a run whose model will never stop (or echoes its prompt,
or writes another template's markers) is caught at its first evaluation, not after the run.

Off by default. Cost: at each evaluation from step N on (at most once every N steps), one batched greedy
``generate`` of K prompts (8 by default), each at most ``max_new_tokens`` long: twice the longest reference
answer plus 16 tokens, between 32 and 256 (the same rules, judged on a shorter budget). On the tiny CPU model
that is a few tenths of a second; on a 7B model on one GPU, roughly the time of K x 256 decode steps in one
batch (seconds). The seconds it took are in the report's ``callback_seconds_by_check["outputs"]``.

:class:`GenerationCheck` is a plain object (testable without a Trainer): :meth:`GenerationCheck.check` runs
on a model, a tokenizer and prompts; :meth:`GenerationCheck.at_evaluate` is the one call the callback makes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hf_sanity import catalog
from hf_sanity.findings import Finding
from hf_sanity.measure.generate import (
    DEFAULT_MAX_NEW_TOKENS,
    Prompt,
    generate,
    held_out_prompts,
    prompts_from_tokens,
)
from hf_sanity.measure.processing import trainer_tokenizer

DEFAULT_PROMPTS = 8
MIN_NEW_TOKENS = 32


class GenerationCheck:
    """The output checks at evaluations. ``every``: optimizer steps between two checks (none before step
    ``every``); ``prompts``: how many prompts to take from the trainer's eval dataset (tokenized rows, or
    conversations), or the held-out rows themselves (a list of conversation rows or a ``datasets.Dataset``)."""

    def __init__(
        self, every: int, prompts: int | Sequence[dict] | Any = DEFAULT_PROMPTS, *, max_new_tokens=None
    ):
        self.validate(every, prompts)
        self.every, self.source, self.max_new_tokens = every, prompts, max_new_tokens
        self.reset()

    def reset(self) -> None:
        """Forget the run so far (a new ``train()``): no check yet, prompts taken again from its eval data."""
        self.last: int | None = None
        self.prompts: list[Prompt] | None = None
        self.checks = 0
        self.skipped: str | None = None

    @staticmethod
    def validate(every, prompts) -> None:
        """The callback's arguments, checked when it is built (a ValueError, as the callback's others)."""
        if every is None:
            return
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"generate_every must be a positive integer (steps), got {every!r}")
        if isinstance(prompts, bool) or (isinstance(prompts, int) and prompts < 1):
            raise ValueError(f"generate_prompts must be a positive integer or held-out rows, got {prompts!r}")
        if not isinstance(prompts, int) and (not hasattr(prompts, "__len__") or len(prompts) == 0):
            raise ValueError(
                "generate_prompts must be a positive integer or a non-empty list/Dataset of rows"
            )

    def due(self, step: int) -> bool:
        return step >= self.every and (self.last is None or step - self.last >= self.every)

    def prompts_for(self, tokenizer, eval_dataset) -> list[Prompt]:
        """The held-out prompts: the rows given, else ``prompts`` rows of the trainer's eval dataset."""
        import datasets

        source = self.source
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if not isinstance(source, int):
            rows = (
                source if isinstance(source, datasets.Dataset) else datasets.Dataset.from_list(list(source))
            )
            return held_out_prompts(rows, n=len(rows), has_template=has_template)
        if isinstance(eval_dataset, dict):  # Trainer takes a dict of eval datasets: the first
            eval_dataset = next(iter(eval_dataset.values()), None)
        if eval_dataset is None or not len(eval_dataset):
            return []
        columns = getattr(eval_dataset, "column_names", None) or list(eval_dataset[0])
        if "input_ids" in columns:
            return prompts_from_tokens(eval_dataset, tokenizer, n=source)
        return held_out_prompts(eval_dataset, n=source, has_template=has_template)

    def budget(self, tokenizer, prompts: Sequence[Prompt]) -> int:
        """max_new_tokens: as given, else twice the longest reference plus 16, within [32, 256]."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        longest = max(
            (
                len(tokenizer(p.reference, add_special_tokens=False)["input_ids"])
                for p in prompts
                if p.reference
            ),
            default=DEFAULT_MAX_NEW_TOKENS,
        )
        return max(MIN_NEW_TOKENS, min(DEFAULT_MAX_NEW_TOKENS, 2 * longest + 16))

    def check(
        self, model, tokenizer, prompts: Sequence[Prompt], selection, step: int | None = None
    ) -> list[Finding]:
        """Generate for ``prompts`` and run every enabled `outputs` detector; findings at ``step``."""
        gens = generate(
            model, tokenizer, prompts, max_new_tokens=self.budget(tokenizer, prompts), batch_size=len(prompts)
        )
        found = catalog.run_all("outputs", gens, selection, step=step)
        for finding in found:
            finding.step = step if finding.step is None else finding.step
        self.checks += 1
        return found

    def at_evaluate(self, callback, state) -> None:
        """The one call of ``SanityCallback.on_evaluate``: when due, check the model being trained and hand the
        findings to the callback's sink. Only the main process generates, and not on sharded parameters
        (FSDP, ZeRO-3: a forward there needs every rank)."""
        step = state.global_step
        sink = callback.sink
        if not self.due(step) or not sink.is_main:
            return
        self.last = step
        with sink.guard("outputs", step):
            sharding = getattr(callback.sampler, "sharding", None)
            if sharding is not None and (sharding.sharded or sharding.engine == "deepspeed"):
                self.skipped = f"parameters are sharded ({sharding.kind}): generation needs every rank"
                sink.report.stats["generate"] = self.stats()
                return
            trainer = callback.trainer
            tokenizer = trainer_tokenizer(trainer)
            model = callback.model if callback.model is not None else getattr(trainer, "model", None)
            if tokenizer is None or model is None:
                self.skipped = "the trainer has no tokenizer (processing_class) to render prompts with"
                sink.report.stats["generate"] = self.stats()
                return
            if self.prompts is None:
                self.prompts = self.prompts_for(tokenizer, getattr(trainer, "eval_dataset", None))
            if not self.prompts:
                self.skipped = "no prompts in the eval dataset (a prompt side before each answer)"
            else:
                with callback.instruments.quiet():
                    sink.emit(self.check(model, tokenizer, self.prompts, sink.selection, step))
            sink.report.stats["generate"] = self.stats()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"every": self.every, "checks": self.checks, "prompts": len(self.prompts or [])}
        if self.last is not None:
            out["last_step"] = self.last
        if self.skipped:
            out["skipped"] = self.skipped
        return out
