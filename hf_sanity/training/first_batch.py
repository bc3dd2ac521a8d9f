"""The first real batch entering the model, checked once at the first training step.

The token rules of preflight (`empty-loss-mask`, `labels-misaligned`, `prompt-in-loss`, `eos-not-learned`, ...)
and `template-mismatch`'s foreign-marker check run on it through the usual context, and `init-loss-off-chance` on the step-0 numbers the callback's probe
measured on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from hf_sanity import catalog
from hf_sanity.findings import Finding
from hf_sanity.measure.processing import trainer_tokenizer
from hf_sanity.rules.training.predictions import FROZEN_PROBES
from hf_sanity.selection import Selection
from hf_sanity.training.budget import Budget
from hf_sanity.training.routing import RouterWatch

ALIGNED = ("input_ids", "labels", "attention_mask", "inputs_embeds")
TOKEN_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
SHAPE_RULE = "shape-mismatch"
STEP0_RULE = "init-loss-off-chance"
# Another chat format's markers in the tokens (a framework's template that is not the tokenizer's, e.g.
# LLaMA-Factory's `template: llama3` on a ChatML tokenizer): what the model trains on, against what it is served.
TEMPLATE_RULE = "template-mismatch"
LEAK_RULE = "future-token-leak"  # the model on the batch with its future changed: two extra forwards, a probe
# What the probe of the first batch measures: the step-0 numbers, the first predictions the later probes compare
# with (`changed`), where a mixture of experts routes it. It runs when an enabled step detector reads one.
PROBED = ("step0", "changed", "router_load")
# The context rules that read the first batch's own forwards (the step-0 probe, the future-token probe).
PROBE_RULES = frozenset({STEP0_RULE, LEAK_RULE})


def token_findings(
    tokenizer,
    batch: Mapping[str, Any],
    *,
    model,
    trainer,
    selection: Selection,
    max_len,
    step0,
    causal=False,
    unprobed=False,
    framework_cut: int | None = None,
) -> list[Finding]:
    """preflight's `tokens` rules on this one batch, `init-loss-off-chance` on the step-0 numbers and, with
    ``causal``, `future-token-leak` on the batch as the model got it. ``unprobed``: the batch holds ids the
    embedding has no row for, so no probe ran: the rules that read one are run for the catalog to skip them
    (their precondition, vocab-size-mismatch, fails on this batch: one `checks-skipped` says so)."""
    from hf_sanity.measure.batches import batches_context
    from hf_sanity.untouched import preserved_rng

    if tokenizer is None or "input_ids" not in batch:
        return []
    from hf_sanity.measure.vision import measure_modality

    tensors = {k: v.detach().cpu() for k, v in batch.items() if k in TOKEN_KEYS and hasattr(v, "shape")}
    # The modality from the whole batch (its pixel_values), the processor and the model's config.
    modality = measure_modality(getattr(trainer, "processing_class", None), model, batch)
    with preserved_rng():
        ctx = batches_context(
            tokenizer, [tensors], model=model, max_len=max_len, trainer=trainer, init_loss=step0,
            first_batch=tensors, modality=modality, framework_cut=framework_cut,
        )  # fmt: skip
        findings = catalog.run_all("context", ctx, selection, stages=("tokens",))
        findings += catalog.run_all("context", ctx, selection.restricted({TEMPLATE_RULE}))
        if unprobed:
            findings += catalog.run_all("context", ctx, selection.restricted(PROBE_RULES))
        if step0:
            findings += catalog.run_all("context", ctx, selection.restricted({STEP0_RULE}))
        if causal:
            findings += catalog.run_all("context", ctx, selection.restricted({LEAK_RULE}))
    for finding in findings:
        finding.step = 1 if finding.step is None else finding.step
    return findings


class FirstBatch:
    """The first real batch, caught by the forward pre-hook of the first training forward: its shapes (before
    the forward, which a mismatch may crash, and after it with the logits), the step-0 probe on it, and the
    token rules. Its first rows stay as the probe batch that `predictions-frozen` re-runs every few steps."""

    def __init__(self, show: bool | int = False, framework_cut: int | None = None) -> None:
        if isinstance(show, bool) or show is None:
            show = bool(show)
        elif not isinstance(show, int) or show < 1:
            raise ValueError(
                f"show_first_batch must be True, False or a number of rows (1 or more), got {show!r}"
            )
        self.show = show  # print the batch decoded: True, every row; N, the first N rows
        # The length a framework's entry point read from its config (LLaMA-Factory's cutoff_len): its trainer
        # does not know it, and the rows arrive cut at it.
        self.framework_cut = framework_cut
        self.done = False
        self.judge_step0 = True  # False on a resumed run: its model is trained, chance says nothing of it
        self._labels = None  # the first batch's labels, which compute_loss may pop before the forward
        self.loss_watch = None  # the first step's (broadcast.LossWatch), or why it was not watched
        self._shapes: dict[str, tuple[int, ...]] | None = None  # waiting for the logits
        self._probe_batch = None
        self._probe_prev = None
        self._chosen_from_output = False  # the step-0 likelihood is read from the first forward's logits
        self._probe_kind = (
            "predictions"  # what the probe measures: argmax predictions, or (preference) likelihood
        )
        # Probes where the model runs alone are on a time budget; the first ones always run (what
        # predictions-frozen needs to fire). Under sharded parameters the probe's forward gathers every rank's
        # shards: there every rank must probe at the same steps, so only the fixed interval decides.
        self.budget = Budget(free=FROZEN_PROBES)
        # A mixture of experts: where its routers send the probe batch, counted in the probes' own forwards.
        self.experts = RouterWatch()

    def labels_seen(self, batch: Mapping[str, Any], trainer=None, sink=None, feed=None, clock=None):
        """A micro-batch begins: the first one's labels are kept (compute_loss may pop them before the forward),
        and the context it runs in is returned: the watch of what its loss is computed from (`broadcast`), a
        no-op context for every other one."""
        if not self.done and "labels" in batch:
            self._labels = batch["labels"]
        elif not self.done and {"input_ids", "completion_mask"} <= set(batch):
            # TRL 1.9's preference trainers (and older) pass no labels to the forward, 1.16's pass the
            # completion tokens: the same labels, from the prepared batch.
            self._labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        if self.loss_watch is not None or sink is None or not sink.measures("loss_broadcast"):
            return contextlib.nullcontext()
        from hf_sanity.training import broadcast

        why = broadcast.watchable(trainer)
        model = getattr(trainer, "model", None)
        if why is not None or model is None:
            self.loss_watch = why or "no model"
            return contextlib.nullcontext()
        watch = broadcast.LossWatch(broadcast.label_tensors(trainer, batch), model.parameters())
        self.loss_watch = watch

        def report(watched) -> None:
            with sink.guard(SHAPE_RULE, 1):
                if watched.error is not None:
                    raise watched.error
                found = {"broadcasts": watched.broadcasts, "warnings": watched.warnings}
                feed(1, {"loss_broadcast": found if watched.broadcasts or watched.warnings else None})

        return broadcast.watched(watch, report, clock)

    @property
    def loss_watch_stats(self) -> dict[str, Any] | str | None:
        """For the report: what the first step's loss was computed from, or why it was not watched."""
        watch = self.loss_watch
        if watch is None or isinstance(watch, str):
            return watch
        return {
            "compared": watch.compared,
            "broadcasts": len(watch.broadcasts),
            "warnings": len(watch.warnings),
        }

    def check(self, module, args, kwargs, trainer, sink, *, probe: bool = True) -> dict[str, Any]:
        """Everything the first batch tells; returns the values for the step detectors: its shapes and the
        model's own step-0 numbers on it (None when not measured). Without ``probe`` no extra forward runs (a
        layout where it is not known to be safe, see :mod:`hf_sanity.training.shards`): the token rules only."""
        import torch

        from hf_sanity.training import probe as probing  # (``probe`` is the flag)

        self.done = True
        batch = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        if "input_ids" not in batch and args and isinstance(args[0], torch.Tensor):
            batch["input_ids"] = args[0]
        kept = self._labels
        if "labels" not in batch and kept is not None:
            # Popped by compute_loss for a custom loss / label smoothing. Only labels that fit the forward's ids:
            # TRL 1.9's KTOTrainer runs its KL rows (KL_input_ids, another length) first.
            ids = batch.get("input_ids")
            if ids is None or tuple(kept.shape) == tuple(ids.shape):
                batch["labels"] = kept
        self._labels = None
        self._shapes = {k: tuple(v.shape) for k, v in batch.items() if k in ALIGNED}
        step0 = chosen = None
        # Ids past the embedding: a forward of hf-sanity's on them would fail where the user's own fails next
        # (an IndexError, a CUDA device-side assert). No probe runs; the model checks that read one are skipped.
        unprobed = probe and probing.ids_beyond_embedding(module, batch) is not None
        probe = probe and not unprobed
        if (
            probe
            and sink.objective.kind == "preference"
            and sink.measures("chosen_logp")
            and "labels" in batch
        ):
            with sink.guard("callback-probe"):  # the chosen rows (the batch's first half): their likelihood
                chosen = max(1, batch["input_ids"].shape[0] // 2)
                self._probe_batch = probing.probe_batch(batch, min(chosen, probing.PROBE_ROWS))
                self._probe_kind = "likelihood"
                # One later probe shows a fall from the step-0 number (predictions-frozen needs 3 in a row): the
                # first runs, the next ones within the probes' 0.1% of the run.
                self.budget.free = 1
                chosen = None
                # Without dropout the training forward's own logits are the probe's: read from its output
                # (logits_pending); else, or where the forward keeps only some logits, one forward of ours.
                if probing.logits_reusable(module, kwargs):
                    self._chosen_from_output = True
                else:
                    chosen = probing.chosen_logp(module, self._probe_batch)
        elif probe and sink.measures(*PROBED) and ("labels" in batch or self.experts.look(module, sink)):
            # (a batch without labels, an RL run's generation: the probe would measure nothing but routing)
            with sink.guard("callback-probe"):
                self._probe_batch = probing.probe_batch(batch)
                with self.experts.counted(module, self._probe_batch, sink):
                    measured = probing.probe(module, self._probe_batch, stats=True)
                self._probe_prev = measured.get("argmax")
                step0 = measured.get("stats")
        tokenizer = trainer_tokenizer(trainer)
        if self.show and tokenizer is not None and "input_ids" in batch:
            with sink.guard("show-first-batch"):
                self.shown(tokenizer, batch, sink)
        token_rules = [r.slug for r in catalog.all_rules() if r.stage == "tokens"]
        # An RL trainer's first forward is its generation's (prompts only, no labels): not a training sequence.
        causal = probe and sink.wants(LEAK_RULE)
        wanted = sink.wants(*token_rules, TEMPLATE_RULE) or step0 is not None or causal or unprobed
        if sink.objective.kind != "rl" and wanted:
            from hf_sanity.measure.batches import trainer_max_len

            sink.emit(
                token_findings(
                    tokenizer, batch, model=module, trainer=trainer, selection=sink.selection,
                    max_len=trainer_max_len(trainer) if trainer is not None else None,
                    step0=step0 if self.judge_step0 else None, causal=causal, unprobed=unprobed,
                    framework_cut=self.framework_cut,
                )
            )  # fmt: skip
        values = {"shapes": dict(self._shapes), "step0": step0}
        values.update(self.experts.first_values(module, trainer, sink, rl=sink.objective.kind == "rl"))
        if chosen is not None:  # read once, at the first step
            values["chosen_logp"] = float(chosen)
        return values

    def shown(self, tokenizer, batch: Mapping[str, Any], sink) -> None:
        """``show_first_batch``: the batch as the model got it, decoded, printed (main process) and kept in the
        report's views."""
        from hf_sanity.batchview import BatchView

        tensors = {k: v.detach().cpu() for k, v in batch.items() if hasattr(v, "shape")}
        count = int(tensors["input_ids"].shape[0])
        rows = list(range(count if self.show is True else min(self.show, count)))
        view = BatchView.from_batch(
            tokenizer, tensors, rows=rows, title="the first real batch",
            source="the first batch of the run, as its model's forward received it (after the collator)",
        )  # fmt: skip
        sink.report.views.append(view)
        sink.say(view, always=True)

    def logits_pending(self, output, model=None) -> dict[str, Any] | None:
        """After the first forward: its shapes with the logits' (once), and the step-0 likelihood read from its
        logits (a forward of ours on ``model``, still at its initial weights, where they were not returned)."""
        if self._shapes is None:
            return None
        shapes, self._shapes = self._shapes, None
        logits = getattr(output, "logits", None)
        values = {
            "shapes": shapes,
            "logits_shape": tuple(logits.shape) if logits is not None else None,
            **self.experts.after_first_forward(output),  # what a mixture of experts' forward returned
        }
        if self._chosen_from_output:  # the chosen rows' likelihood at step 0, from the training forward
            from hf_sanity.training.probe import chosen_logp_of

            self._chosen_from_output = False
            measured = chosen_logp_of(logits, self._probe_batch)
            if measured is None and model is not None:
                from hf_sanity.training.probe import chosen_logp

                measured = chosen_logp(model, self._probe_batch)
            if measured is not None:
                values["chosen_logp"] = float(measured)
        return values

    def probe_due(self, step: int, every: int | None, sink, *, sharded: bool = False) -> bool:
        """A probe (`predictions-frozen`; on a preference run, the chosen answers' likelihood) runs at the end of
        this step: every ``every`` steps, within its time budget unless the parameters are ``sharded``."""
        wanted = sink.measures("changed", "chosen_logp", "router_load")
        due = bool(every) and step % every == 0 and wanted
        return due and self._probe_batch is not None and (sharded or self.budget.due())

    def probe(self, model, recorder, step: int) -> None:
        """Re-run the probe batch: the share of its argmax predictions that changed since the last probe."""
        from hf_sanity.training import probe

        if self._probe_batch is None or model is None:
            return
        if self._probe_kind == "likelihood":
            with self.budget.spend():
                measured = probe.chosen_logp(model, self._probe_batch)
            if measured is not None:
                recorder.push(step, "chosen_logp", measured)
            return
        with self.budget.spend(), self.experts.counted(model, self._probe_batch):
            current = probe.probe(model, self._probe_batch).get("argmax")
        self.experts.push(recorder, step)
        if current is None:
            return
        if self._probe_prev is not None and self._probe_prev.shape == current.shape:
            recorder.push(step, "probe_changed", (current != self._probe_prev).float().mean())
        self._probe_prev = current
