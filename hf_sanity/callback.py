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

import contextlib
from collections.abc import Iterable
from typing import Any

from transformers.trainer_callback import ExportableState, TrainerCallback

from hf_sanity.selection import resolve
from hf_sanity.training import begin, first_batch, memory, outcome, replay, resume, saved, shards
from hf_sanity.training.budget import Budget
from hf_sanity.training.generation import GenerationCheck
from hf_sanity.training.instrument import Instruments, OwnClock, clocked
from hf_sanity.training.measures import train_only_modules
from hf_sanity.training.monitors import MonitorSet
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
        self.instruments, self.clock, self.framework_cut = Instruments(), OwnClock(), None  # see FirstBatch
        self._reset()

    def _reset(self) -> None:
        self.sink = FindingSink(self.selection, abort_on=self.abort_on, print_findings=self.print_findings)
        self.trainer = self.model = self.sampler = self.exchange = None
        self.trl, self.monitors, self.held = ObjectiveFeed(), MonitorSet(self.sink), replay.HeldBatches()
        self.recorder, self.early, self.history = Recorder(), EarlyFlags(), StepHistory()
        self.first = first_batch.FirstBatch(self.show_first_batch, self.framework_cut)
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
        exported = {"args": self.settings, "attributes": {}}  # what Trainer saves if even that broke
        with self.sink.guard("checkpoint-state"):
            exported = resume.export(self)
        return exported

    # -- Trainer events ------------------------------------------------------------------------------
    # Each event: a row of guarded blocks (tests/test_architecture.py checks no statement runs outside one): one
    # that raises is one internal-error finding and skips only itself; the next, and the user's run, go on.
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        given = None
        with self.sink.guard("callback-setup"):
            given = resume.handed_back(self)
        if given is not None:  # Trainer swapped in a copy: the user's goes on
            return given.on_train_begin(args, state, control, model=model, optimizer=optimizer, **kwargs)
        with self.sink.guard("callback-setup"):  # the previous sink's guard: a new run's sink is built here
            self.instruments.uninstall()
            self._reset()
            self.clock.restart()
        with self.sink.guard("callback-setup"):  # each part in its own guard: see training.begin
            begin.watch(self, args, state, model, optimizer)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        with self.sink.guard("callback-step"):
            self._step, self._micro = state.global_step + 1, 0
        with self.sink.guard("stale-gradients"):
            if self.sampler is not None and self.sampler.watches_step_begin:
                self.sampler.step_begins(self.recorder, self._step)
        return control

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        with self.sink.guard("callback-gradient-path"):
            if self.sampler is not None:
                optimizer = optimizer or getattr(self.trainer, "optimizer", None)
                self.sampler.before_optimizer(self.recorder, state.global_step + 1, optimizer)
        with self.sink.guard("kl-spike"):  # an RL run's KL probe: its baseline, before the first update
            self.trl.before_update(self.sink)
        with self.sink.guard("callback-early-read"):
            if self.early.nonfinite() is not None:
                self._read(now=state.global_step + 1, weights_step=state.global_step + 1, control=control)
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):
        with self.sink.guard("callback-update-ratio"):
            if self.sampler is not None:
                self.sampler.after_optimizer(self.recorder, state.global_step + 1, trainer=self.trainer)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        with self.sink.guard("callback-trl-metrics"):
            self.trl.step_end(state.global_step, self.monitors, self.sink)
        with self.sink.guard("predictions-frozen"):  # the probe, when due (its forward unseen by the hooks)
            sharded = self.sampler is not None and self.sampler.sharded
            due = self.first.probe_due(state.global_step, self.probe_every, self.sink, sharded=sharded)
            if due and self._probes_run():
                with self.instruments.quiet():
                    self.first.probe(self.model, self.recorder, state.global_step)
        with self.sink.guard("callback-read"):
            if state.global_step % self.check_every == 0 or control.should_log or control.should_save:
                self._read(now=state.global_step, control=control)  # before a checkpoint too
        with self.sink.guard("callback-sync"):
            if self.sink.world_size > 1 and state.global_step % self.sync_every == 0:
                self._sync(state.global_step, control)
        with self.sink.guard("callback-stop"):
            if self.sink.stop_pending and self.sink.world_size == 1:
                outcome.stop(self.sink, control, self.trainer, state.global_step)
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        with self.sink.guard("callback-read"):  # later training forwards must be in train mode:
            self.history.evaluations.append(state.global_step)
            self._read(now=state.global_step, control=control)
        with self.sink.guard("curves"):
            self.monitors.curves(self.history, state, model=self.model, final=False)
        with self.sink.guard("outputs"):
            if self.generation is not None:
                self.generation.at_evaluate(self, state)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        with self.sink.guard("callback-trl-metrics"):
            self.trl.log(state.global_step, logs, self.monitors, self.sink)
        with self.sink.guard("callback-log"):
            outcome.log_counts(self.sink, state, logs)  # and into state.log_history, which Trainer keeps
        return control

    on_save = saved.on_save  # each checkpoint as written: what a server needs beside the weights

    def on_train_end(self, args, state, control, **kwargs):
        try:
            with self.sink.guard("callback-read"):
                self._read(now=state.global_step)  # the run is over: nothing left to stop
            with self.sink.guard("curves"):
                self.monitors.curves(self.history, state, model=self.model, final=True)
            with self.sink.guard("callback-sync"):
                if self.sink.world_size > 1:
                    self._sync(state.global_step, control, final=True)
            with self.sink.guard("report"):
                self.report.stats.update(outcome.stats(self, steps=state.global_step))
            with self.sink.guard("report"):
                self.sink.write()
        finally:
            with self.sink.guard("callback-instruments"):
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
        if self.sampler is not None and self.sampler.watch_mode:  # every forward: a guard only where work is
            with self.sink.guard("train-mode-off"):
                self.sampler.forward(self.recorder, self._step or 1, module)
        if self._autocast is None:
            with self.sink.guard("callback-precision"):
                self._autocast = replay.autocast_state(module) or False
        if not self.first.done:
            with self.sink.guard("first-batch"), self.instruments.quiet():
                self.instruments.graph_only = True  # what is read of a later forward needs a graph
                values = self.first.check(
                    module, args, kwargs, self.trainer, self.sink, probe=self._probes_run()
                )
                self.monitors.feed(1, values)

    def post_forward(self, module, output) -> None:
        if self.first.done:  # the first forward's output, the only one read: the hook goes with it
            with self.sink.guard("first-batch"), self.instruments.quiet():  # (a probe forward, if needed)
                self.instruments.release_output_hook()
                self.monitors.feed(1, self.first.logits_pending(output, module) or {})

    def failed(self, exc: BaseException) -> None:
        """Training dies with the user's ``exc``: an out-of-memory error is reported with its memory picture, the
        report written, the instruments taken back. Nothing here may raise: the user's exception is what
        Trainer raises, unchanged (each part in its own guard, and a last net under them all)."""
        with contextlib.suppress(Exception):
            outcome.failed(self, exc)
        with contextlib.suppress(Exception):
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
        if self.sink.measures(*memory.WALKED) and self.memory_budget.due():  # the walk: 0.1% of the run
            with self.sink.guard("memory-growth"), self.memory_budget.spend():
                self.monitors.feed(step, memory.held_now(self.trainer, self.model, skip=self))

    # -- findings, stopping, DDP ---------------------------------------------------------------------
    def _sync(self, step: int, control, final: bool = False) -> None:
        with self.sink.guard("callback-sync"):
            stop = self.exchange.sync(step, self.model, self.sink, self.monitors.feed)
            if stop and self.abort_on == "error" and not final:
                outcome.stop(self.sink, control, self.trainer, step)
