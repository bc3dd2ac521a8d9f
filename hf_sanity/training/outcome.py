"""How a watched run goes on record, besides its findings: the ``hf_sanity/<rule>`` counters in the Trainer's
logs, the stop at the first error (``abort_on="error"``), and the report's stats.

* The counters go into the ``logs`` every later logging callback receives (wandb, TensorBoard, ...) and into
  the entry Trainer keeps in ``state.log_history`` (Trainer appends its copy of ``logs`` before it calls
  ``on_log``), so ``trainer_state.json``, checkpoints and ``hf-sanity doctor`` see them too.
* A stop prints one line naming the rule and the step (main process), records ``aborted_at_step``,
  ``aborted_by`` and ``abort_reason`` in the report's stats, sets ``trainer.state.hf_sanity_aborted_at_step``
  (None on a run that was not stopped; a TrainerState attribute, not saved by ``save_to_json``) and adds
  ``hf_sanity/aborted_at_step`` to the logs from then on (so to the final summary log Trainer keeps in
  ``log_history``, which ``trainer_state.json`` saves).
"""

from __future__ import annotations

from typing import Any

from hf_sanity.findings import Finding

STATE_ATTRIBUTE = "hf_sanity_aborted_at_step"
ABORTED_KEY = "hf_sanity/aborted_at_step"


def begin(state) -> None:
    """A new run: nothing stopped it (yet)."""
    if state is not None:
        setattr(state, STATE_ATTRIBUTE, None)


def log_counts(sink, state, logs: dict[str, Any] | None) -> None:
    """The counters into ``logs`` and into this log's entry of ``state.log_history``."""
    extra: dict[str, Any] = {f"hf_sanity/{slug}": count for slug, count in sink.counts.items()}
    if sink.aborted_at is not None:
        extra[ABORTED_KEY] = sink.aborted_at
    if logs is None or not extra:
        return
    with sink.guard("callback-log"):
        history = getattr(state, "log_history", None)
        last = history[-1] if history else None
        if isinstance(last, dict) and _same_log(last, logs, getattr(state, "global_step", None)):
            last.update(extra)
        logs.update(extra)


def _same_log(entry: dict[str, Any], logs: dict[str, Any], step: int | None) -> bool:
    """``entry`` is Trainer's copy of ``logs`` (``{**logs, "step": global_step}``): the same step, and the very
    value objects of ``logs`` (compared by identity: a NaN is not equal to itself, an array not to a bool)."""
    if entry.get("step") != step:
        return False
    return all(k in logs and logs[k] is v for k, v in entry.items() if k != "step")


def reason(sink) -> Finding | None:
    """The error that stopped the run: this process's first, else the earliest the main process merged."""
    if sink.stop_reason is not None:
        return sink.stop_reason
    errors = [f for f in sink.report.findings if f.severity == "error"]
    return min(errors, key=lambda f: f.step if f.step is not None else 1 << 62, default=None)


def stop(sink, control, trainer, step: int) -> None:
    """Stop training cleanly after this step: the report written, the stop on record and said once."""
    sink.stop_pending = False
    state = getattr(trainer, "state", None)
    max_steps = getattr(state, "max_steps", 0) or 0
    if sink.aborted_at is None and not (max_steps and step >= max_steps):  # the last step stops anyway
        sink.aborted_at = step
        cause = reason(sink)
        where = f" @ step {cause.step}" if cause is not None and cause.step is not None else ""
        why = f"{cause.rule}{where}: {cause.message}" if cause is not None else "an error finding"
        sink.report.stats.update(
            aborted_at_step=step, aborted_by=cause.rule if cause else None, abort_reason=why
        )
        if state is not None:
            setattr(state, STATE_ATTRIBUTE, step)
        sink.say(_line(step, why, sink.output_dir), soft_wrap=True)
    with sink.guard("report"):
        sink.write()
    for ctl in (control, getattr(trainer, "control", None)):
        if ctl is not None:
            ctl.should_training_stop = True


def _line(step: int, why: str, folder) -> Any:
    from rich.text import Text

    line = Text("hf-sanity: ", style="bold red")
    line.append(f'stopping training after step {step} (abort_on="error"): {why}')
    if folder is not None:
        line.append(f"; report: {folder / 'report.json'}", style="dim")
    return line


def stats(callback, *, steps: int) -> dict[str, Any]:
    """The run's figures for the report: the callback's own clock, reads and transfers, the memory walks and
    probes their time budgets ran and skipped, and the sharding layout."""
    sink, sampler, budget = callback.sink, callback.sampler, callback.memory_budget
    clock = callback.clock
    # A dry run no step's end read (a run of no step, or one that failed): its verdicts now.
    callback.trl.settle(callback.monitors)
    out = sink.stats(
        clock.so_far(),
        clock.share(),
        steps=steps,
        reads=callback._reads,
        transfers=callback.recorder.transfers,
    )
    out.update(memory_walks=budget.runs, memory_walks_skipped=budget.skipped)
    out.update(probes=callback.first.budget.runs, probes_skipped=callback.first.budget.skipped)
    out.update(
        callback.resumed, loss_watch=callback.first.loss_watch_stats
    )  # resumed_from_step, resumed_state
    out.update(callback.trl.stats())  # an RL run: its reward dry run (or why it did not run), its KL probe
    if sampler is not None:
        out["warmup_steps"] = sampler.warmup_steps
        if sampler.warmup_unknown:
            out["warmup_unknown"] = sampler.warmup_unknown
    sharding = sampler.sharding if sampler is not None else None
    if sharding is not None and (sharding.engine or sharding.sharded):
        out["sharding"] = sharding.stats()  # what ran on which layout, and what did not, with why
    return out


def failed(callback, exc: BaseException) -> None:
    """Training died with ``exc``: an out-of-memory error is reported with its memory picture (each part on
    its own: memory is short), the report's stats say what stopped the run, and it is written. Every part runs in its own
    guard: whatever breaks here is an internal-error finding, and ``exc`` is what the user's loop gets."""
    from hf_sanity.training import memory

    sink = callback.sink
    if isinstance(exc, KeyboardInterrupt):  # the user stopped the run: no verdict is waited for
        callback.trl.abandon()
    if memory.is_oom(exc) and sink.measures("oom"):
        with sink.guard("oom"):
            callback._read(now=callback._step)
        with sink.guard("oom"):
            optimizer = getattr(callback.trainer, "optimizer", None)
            oom = memory.oom_facts(exc, callback.model, optimizer, sink.guard)
            callback.monitors.feed(callback._step or 1, {"oom": oom})
    sink.report.stats.update(aborted_by=type(exc).__name__)  # said first: a figure below may not be known
    with sink.guard("report"):
        steps = getattr(getattr(callback.trainer, "state", None), "global_step", callback._step)
        sink.report.stats.update(stats(callback, steps=steps), aborted_by=type(exc).__name__)
    with sink.guard("report"):
        sink.write()
