"""`SanityCallback`: watch a real Trainer run and report its failures as findings, at the step they appear.

    sanity = SanityCallback()                       # abort_on="error" to stop at the first error
    Trainer(..., callbacks=[sanity]).train()        # or TRL's SFTTrainer
    sanity.report.print()                           # also in output_dir/hf-sanity/report.json

It translates Trainer events into calls on plain objects of `hf_sanity.training`: instruments observe the
Trainer (removed at train end), a sampler measures each step into a recorder read in one transfer every
``check_every`` steps, the step history turns that into values for every registered step detector
(`hf_sanity.rules.training`), curve detectors run at evaluations and at train end, and the sink keeps, prints
and writes the findings. Every check runs in a guard (an exception becomes an ``internal-error`` finding);
extra forwards leave grads, RNG and modes as they were: with ``abort_on="never"`` the run is bit-for-bit the
run without the callback.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers.trainer_callback import ExportableState, TrainerCallback

from hf_sanity.measure.objective import of_trainer
from hf_sanity.selection import resolve
from hf_sanity.training import first_batch, memory, outcome, replay, resume, shards
from hf_sanity.training.budget import Budget
from hf_sanity.training.generation import GenerationCheck
from hf_sanity.training.instrument import Instruments, OwnClock, clocked, find_trainer, move_before_reporters
from hf_sanity.training.measures import StepSampler, train_only_modules, vocab_size
from hf_sanity.training.monitors import MonitorSet
from hf_sanity.training.ranks import RankExchange, world
from hf_sanity.training.recorder import EarlyFlags, Recorder
from hf_sanity.training.sink import FindingSink
from hf_sanity.training.trl_metrics import ObjectiveFeed
from hf_sanity.training.values import StepHistory

ABORT_CHOICES = ("error", "never")


@clocked  # its events on self.clock (the instruments clock their own calls): stats.callback_share
class SanityCallback(TrainerCallback, ExportableState):
    """Watches a Trainer run; findings in :attr:`report` and in ``output_dir/hf-sanity/report.json``; a stop
    at an error in ``trainer.state.hf_sanity_aborted_at_step`` too (see :mod:`hf_sanity.training.outcome`).

    ``abort_on="error"`` stops training cleanly (``control.should_training_stop``) at the first error finding,
    after writing the report; ``"never"`` (the default) only reports. ``select``/``ignore`` pick rules as in
    preflight. ``check_every``: steps between reads of the on-device values (also read at every logging step);
    ``probe_every``: steps between predictions probes (fewer where they would take over 0.1% of the run);
    ``sync_every``: steps between the cross-rank exchanges under DDP (defaults to ``check_every``).
    ``generate_every``: from that step on, at evaluations (at most once every ``generate_every`` steps),
    generate for ``generate_prompts`` held-out prompts of the eval dataset (or the rows given) and run the
    `outputs` rules (never-stops, repeats-prompt, ...); off by default, cost in `hf_sanity.training.generation`.
    ``reward_dry_run=False``: no reward function is called at train begin. ``show_first_batch``: print the first
    real batch decoded (True: every row; N: the first N rows; in the report's views too). A run resumed from a
    checkpoint continues its checks (`hf_sanity.training.resume`).
    """

    def __init__(
        self, abort_on: str = "never", select: str | Iterable[str] | None = None,
        ignore: str | Iterable[str] | None = None, *, check_every: int = 10, probe_every: int = 50,
        sync_every: int | None = None, use_config: bool = True, print_findings: bool = True,
        generate_every: int | None = None, generate_prompts: int | Any = 8, reward_dry_run: bool = True,
        show_first_batch: bool | int = False,
    ) -> None:  # fmt: skip
        self.settings = resume.settings(locals())  # what Trainer rebuilds it with from a checkpoint
        if abort_on not in ABORT_CHOICES:
            raise ValueError(f"abort_on must be one of {ABORT_CHOICES}, got {abort_on!r}")
        checked = {"check_every": check_every, "probe_every": probe_every, "sync_every": sync_every}
        for name, value in checked.items():
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        GenerationCheck.validate(generate_every, generate_prompts)
        self.generation = GenerationCheck(generate_every, generate_prompts) if generate_every else None
        self.abort_on, self.print_findings, self.reward_dry_run = abort_on, print_findings, reward_dry_run
        self.show_first_batch = show_first_batch
        self.selection = resolve(select, ignore, use_config=use_config)
        self.check_every, self.probe_every = check_every, probe_every
        self.sync_every = sync_every or check_every
        self.instruments, self.clock = Instruments(), OwnClock()
        self._reset()

    def _reset(self) -> None:
        self.sink = FindingSink(self.selection, abort_on=self.abort_on, print_findings=self.print_findings)
        self.trainer = self.model = self.sampler = self.exchange = None
        self.trl, self.monitors = ObjectiveFeed(), MonitorSet(self.sink)
        self.recorder, self.early, self.history = Recorder(), EarlyFlags(), StepHistory()
        self.held, self.first = replay.HeldBatches(), first_batch.FirstBatch(show=self.show_first_batch)
        self._step = self._micro = self._reads = 0
        self._autocast, self.memory_budget, self.resumed = None, Budget(), {}
        if self.generation is not None:  # a second train() checks its outputs from the start again
            self.generation.reset()

    report = property(lambda self: self.sink.report, doc="The findings so far; written at train end.")

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (transformers' ExportableState): see :mod:`hf_sanity.training.resume`."""
        with self.sink.guard("checkpoint-state"):  # inside Trainer's save: nothing may raise
            if self.sampler is not None and self.sink.world_size == 1:
                self._read(now=self._step)
        return resume.export(self)

    # -- Trainer events ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if (given := resume.handed_back(self)) is not None:  # Trainer swapped in a copy: the user's goes on
            return given.on_train_begin(args, state, control, model=model, optimizer=optimizer, **kwargs)
        self.instruments.uninstall()
        self._reset()
        self.clock.restart()
        sink = self.sink
        with sink.guard("callback-setup"):  # first and alone: every rank must agree on the world size
            sink.is_main = bool(state.is_world_process_zero)
            outcome.begin(state)
            self.trainer = find_trainer()
            sink.narrow(of_trainer(self.trainer))
            sink.rank, sink.world_size = world()
        with sink.guard("callback-setup"):
            self.model = getattr(self.trainer, "model", None) or model
            sink.output_dir = Path(args.output_dir or ".") / "hf-sanity"
            sink.annotate = lambda finding: self.held.attach(finding, sink.save_batch)
            self.sampler = StepSampler(
                self.trainer, self.model, optimizer or getattr(self.trainer, "optimizer", None), args, state,
                sink.wants, check_every=self.check_every, world_size=sink.world_size,
            )  # fmt: skip
            self.exchange = RankExchange(
                sink.rank, sink.world_size, compared=self.sampler.sharding.replicated
            )
            self.monitors = MonitorSet(sink, self.sampler.training_setup(sink.world_size, sink.objective))
            self.trl = ObjectiveFeed(self.trainer, sink, self.probe_every, self.reward_dry_run)
            self.resumed = resume.begin(self, state)  # a resumed run continues from the checkpoint's state
            self.monitors.feed(0, {**self.sampler.setup_values(), **self.trl.begin()})
            self.instruments.install(self.trainer, self.model, self)
            move_before_reporters(self.trainer, self)
        self._memory_check(0)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self._step, self._micro = state.global_step + 1, 0
        if self.sampler is not None and self.sampler.watches_step_begin:
            with self.sink.guard("stale-gradients"):
                self.sampler.step_begins(self.recorder, self._step)
        return control

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        step = state.global_step + 1
        with self.sink.guard("callback-gradient-path"):
            if self.sampler is not None:
                optimizer = optimizer or getattr(self.trainer, "optimizer", None)
                self.sampler.before_optimizer(self.recorder, step, optimizer)
        self.trl.before_update(self.sink)  # an RL run's KL probe: its baseline, before the first update
        with self.sink.guard("callback-early-read"):
            if self.early.nonfinite() is not None:
                self._read(now=step, weights_step=step, control=control)
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):
        with self.sink.guard("callback-update-ratio"):
            if self.sampler is not None:
                self.sampler.after_optimizer(self.recorder, state.global_step + 1, trainer=self.trainer)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        self.trl.step_end(step, self.monitors, self.sink)
        sharded = self.sampler is not None and self.sampler.sharded
        if self.first.probe_due(step, self.probe_every, self.sink, sharded=sharded) and self._probes_run():
            with self.sink.guard("predictions-frozen"), self.instruments.quiet():
                self.first.probe(self.model, self.recorder, step)
        if step % self.check_every == 0 or control.should_log or control.should_save:  # before a checkpoint
            self._read(now=step, control=control)
        if self.sink.world_size > 1 and step % self.sync_every == 0:
            self._sync(step, control)
        if self.sink.stop_pending and self.sink.world_size == 1:
            outcome.stop(self.sink, control, self.trainer, step)
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.history.evaluations.append(state.global_step)  # later training forwards must be in train mode
        self._read(now=state.global_step, control=control)
        self.monitors.curves(self.history, state, vocab_size=vocab_size(self.model), final=False)
        if self.generation is not None:
            self.generation.at_evaluate(self, state)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.trl.log(state.global_step, logs, self.monitors, self.sink)
        outcome.log_counts(self.sink, state, logs)  # and into state.log_history, which Trainer keeps
        return control

    def on_train_end(self, args, state, control, **kwargs):
        try:
            self._read(now=state.global_step)  # the run is over: nothing left to stop
            self.monitors.curves(self.history, state, vocab_size=vocab_size(self.model), final=True)
            if self.sink.world_size > 1:
                self._sync(state.global_step, control, final=True)
            with self.sink.guard("report"):
                self.report.stats.update(outcome.stats(self, steps=state.global_step))
                self.sink.write()
        finally:
            self.instruments.uninstall()
        return control

    # -- what the instruments observe ----------------------------------------------------------------
    def before_micro(self, inputs):
        with self.sink.guard("callback-batch"):
            batch = dict(inputs) if hasattr(inputs, "items") else {}
            self.held.hold(self._step or 1, batch)
            if self.sampler is not None:
                self.sampler.batch(batch)
            return self.first.labels_seen(batch, self.trainer, self.sink, self.monitors.feed, self.clock)

    def after_micro(self, loss) -> None:
        with self.sink.guard("callback-loss"):
            if hasattr(loss, "detach"):
                host = self.recorder.push(self._step or 1, "loss", loss)
                self.early.mark(self._step or 1, self._micro, loss, host=host)
            self._micro += 1

    def grad_norm(self, norm) -> None:
        with self.sink.guard("callback-grad-norm"):
            self.recorder.push(self._step or 1, "grad_norm", shards.plain(norm))

    def pre_forward(self, module, args, kwargs) -> None:
        if self.sampler is not None and self.sampler.watch_mode:
            with self.sink.guard("train-mode-off"):
                self.sampler.forward(self.recorder, self._step or 1, module)
        if self._autocast is None:
            with self.sink.guard("callback-precision"):
                self._autocast = replay.autocast_state(module) or False
        if not self.first.done:
            with self.sink.guard("first-batch"), self.instruments.quiet():
                values = self.first.check(
                    module, args, kwargs, self.trainer, self.sink, probe=self._probes_run()
                )
                self.monitors.feed(1, values)

    def post_forward(self, module, output) -> None:
        if (shapes := self.first.logits_pending(output)) is not None:
            self.monitors.feed(1, shapes)

    def failed(self, exc: BaseException) -> None:
        """Training dies: report an out-of-memory error with its memory picture, write the report, clean up."""
        try:
            outcome.failed(self, exc)
        finally:
            try:
                with self.sink.guard("report"):
                    self.sink.write()
            finally:
                self.instruments.uninstall()

    # -- reading -------------------------------------------------------------------------------------
    def _read(self, *, now: int, weights_step: int | None = None, control=None) -> None:
        """Move every recorded value to the host in one transfer and feed the monitors, step by step."""
        records: dict[int, dict[str, list[Any]]] = {}
        with self.sink.guard("callback-read"):
            if self.sampler is not None and len(self.recorder):
                self.sampler.push_label_entropy(self.recorder, now)
            records = self.recorder.read()
            self._reads += 1
        for step, raw in records.items():
            with self.sink.guard("callback-read"):
                values = self.history.values(step, raw, scaler=bool(self.sampler and self.sampler.scaler))
                if values.get("loss_finite") is False:
                    values["nonfinite"] = self._diagnose(step, raw["loss"], weights_step)
                if values.get("training") is False and self.model is not None:
                    values["train_only_modules"] = train_only_modules(self.model)
                self.monitors.feed(step, values)
        if records:
            self._memory_check(now)
        self.held.release(now)
        if self.sink.stop_pending and control is not None and self.sink.world_size == 1:
            outcome.stop(self.sink, control, self.trainer, now)

    def _diagnose(self, step: int, micro: list[float], weights_step: int | None) -> dict[str, Any]:
        with self.sink.guard("nonfinite-loss"), self.instruments.quiet():
            return replay.first_nonfinite(
                self.sink, self.sampler, self.held, self.model, step=step, micro=micro, now=self._step,
                weights_step=weights_step, autocast=self._autocast,
            )  # fmt: skip
        return {}  # the check broke: an internal-error finding

    def _probes_run(self) -> bool:
        """The probes' extra forward may run (on every rank at the same point: under FSDP2 it gathers shards)."""
        return self.sampler is None or self.sampler.sharding.probe_skip is None

    def _memory_check(self, step: int) -> None:
        if self.sink.wants("memory-growth", "oom") and self.memory_budget.due():  # the walk: 0.1% of the run
            with self.sink.guard("memory-growth"), self.memory_budget.spend():
                self.monitors.feed(step, memory.held_now(self.trainer, self.model, skip=self))

    # -- findings, stopping, DDP ---------------------------------------------------------------------
    def _sync(self, step: int, control, final: bool = False) -> None:
        with self.sink.guard("callback-sync"):
            stop = self.exchange.sync(step, self.model, self.sink, self.monitors.feed)
            if stop and self.abort_on == "error" and not final:
                outcome.stop(self.sink, control, self.trainer, step)
