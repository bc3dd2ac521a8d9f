"""The step detectors of one run: one instance of every registered Monitor with an enabled rule, fed alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_sanity import catalog
from hf_sanity.rules.training.base import Monitor, TrainingSetup


class MonitorSet:
    def __init__(self, sink, setup: TrainingSetup | None = None) -> None:
        self.setup = setup = setup or TrainingSetup()
        self.sink = sink
        self.first_step = 1  # the first step this process trains (after a resume: the checkpoint's + 1)
        self.monitors: list[Monitor] = [
            cls.from_setup(setup) for cls in catalog.monitors(sink.selection.enabled)
        ]
        self.ran: set[str] = (
            set()
        )  # detectors that ran on their inputs at least once (monitors, curve detectors)
        self._plan = self._planned()

    def _planned(self) -> list[tuple[Monitor, frozenset[str], tuple[str, ...], str, str]]:
        """Per monitor that still watches something, set up once: the keys it reads, the enabled rules it
        watches, its guard's name (those rules, which it would leave unwatched if it broke) and its detector's
        name."""
        plan = []
        for monitor in self.monitors:
            if monitor.done:
                continue
            watched = tuple(r.slug for r in monitor.rules if self.sink.selection.enabled(r.slug))
            plan.append(
                (monitor, frozenset(monitor.reads), watched, ", ".join(watched), _name(type(monitor)))
            )
        return plan

    def feed(self, step: int, values: Mapping[str, Any]) -> None:
        """Every monitor that still watches something and reads one of ``values``' keys gets the keys it
        declares (its ``reads``: the contract); each runs in its own guard, named by the rules it would leave
        unwatched if it broke."""
        keys = values.keys()
        finished = False
        for monitor, reads, watched, name, detector in self._plan:
            if reads.isdisjoint(keys):
                continue
            self.ran.add(detector)
            found = None
            with self.sink.guard(name, step):
                found = monitor.update(step, {k: values[k] for k in reads & keys})
                catalog.note_ran(watched)
            if found:
                self.sink.emit(found)
                finished = finished or monitor.done
        if finished:  # a monitor whose every rule has fired watches nothing more: it leaves the plan
            self._plan = [entry for entry in self._plan if not entry[0].done]

    # -- across a checkpoint -----------------------------------------------------------------------------
    def state(self) -> dict[str, dict[str, Any]]:
        """Every monitor's :meth:`Monitor.state`, by class (plain JSON data, for a checkpoint)."""
        return {_name(type(m)): m.state() for m in self.monitors}

    def restore(self, saved: Mapping[str, Any] | None, *, first_step: int) -> None:
        """This process trains from ``first_step`` on (a resumed run): each monitor continues from its saved
        state; one without any (not in ``saved``: a checkpoint written without hf-sanity, a rule not selected
        then, a state that does not restore) starts afresh, not knowing the run's start."""
        self.first_step = first_step
        for i, monitor in enumerate(self.monitors):
            data = (saved or {}).get(_name(type(monitor)))
            restored = False
            if data is not None:
                with self.sink.guard("resume", first_step):
                    monitor.restore(data)
                    restored = True
            if not restored:  # from scratch, also after a restore that broke half-way
                monitor = self.monitors[i] = type(monitor).from_setup(self.setup)
                monitor.start_known = first_step == 1
            monitor.first_step = first_step
        self._plan = self._planned()

    def curves(self, history, state, *, model, final: bool) -> None:
        """The online curve detectors on the run's curves so far (main process): at an evaluation and, with
        ``final``, at train end; a finding without a step gets the current one. A resumed run's curves are the
        logged ones: Trainer's log history holds the steps before the checkpoint, this process's record not."""
        if not self.sink.is_main:
            return
        with self.sink.guard("curves"):
            from hf_sanity.drivers.curves import analyze
            from hf_sanity.training.measures import vocab_size

            per_step = self.sink.world_size == 1 and self.first_step == 1
            curves = history.curves(state.log_history, vocab_size=vocab_size(model), per_step=per_step)
            curves.planned_steps = getattr(state, "max_steps", None) or None
            if self.setup.max_grad_norm is not None:  # the trainer's arguments were read
                curves.max_grad_norm, curves.warmup_steps = self.setup.max_grad_norm, self.setup.warmup_steps
            found = analyze(curves, final=final, online=True, ran=self.ran, selection=self.sink.selection)
            for finding in found:
                finding.step = state.global_step if finding.step is None else finding.step
            self.sink.emit(found)

    def __contains__(self, slug: str) -> bool:
        return any(slug in (r.slug for r in m.rules) for m in self.monitors)


def _name(cls: type) -> str:
    """A monitor's name: its step detector's (``module.Class``), also its key in a saved state."""
    return catalog.Detector("", "step", cls).name
