"""The step detectors of one run: one instance of every registered Monitor with an enabled rule, fed alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_sanity import catalog
from hf_sanity.rules.training.base import Monitor, TrainingSetup


class MonitorSet:
    def __init__(self, sink, setup: TrainingSetup | None = None) -> None:
        setup = setup or TrainingSetup()
        self.sink = sink
        self.setup = setup
        self.monitors: list[Monitor] = [
            cls.from_setup(setup) for cls in catalog.monitors(sink.selection.enabled)
        ]
        self.ran: set[str] = (
            set()
        )  # detectors that ran on their inputs at least once (monitors, curve detectors)
        # Per monitor, set up once: the keys it reads, its guard's name (the rules it would leave unwatched if
        # it broke) and its detector's name.
        self._plan = [
            (
                monitor,
                frozenset(monitor.reads),
                ", ".join(r.slug for r in monitor.rules if sink.selection.enabled(r.slug)),
                catalog.Detector("", "step", type(monitor)).name,
            )
            for monitor in self.monitors
        ]

    def feed(self, step: int, values: Mapping[str, Any]) -> None:
        """Every monitor that still watches something and reads one of ``values``' keys gets them; each runs in
        its own guard, named by the rules it would leave unwatched if it broke."""
        keys = values.keys()
        finished = False
        for monitor, reads, name, detector in self._plan:
            if reads.isdisjoint(keys):
                continue
            self.ran.add(detector)
            found = None
            with self.sink.guard(name, step):
                found = monitor.update(step, values)
            if found:
                self.sink.emit(found)
                finished = finished or monitor.done
        if finished:  # a monitor whose every rule has fired watches nothing more: it leaves the plan
            self._plan = [entry for entry in self._plan if not entry[0].done]

    def curves(self, history, state, *, vocab_size: int | None, final: bool) -> None:
        """The online curve detectors on the run's curves so far (main process): at an evaluation and, with
        ``final``, at train end; a finding without a step gets the current one."""
        if not self.sink.is_main:
            return
        with self.sink.guard("curves"):
            from hf_sanity.drivers.curves import analyze

            per_step = self.sink.world_size == 1
            curves = history.curves(state.log_history, vocab_size=vocab_size, per_step=per_step)
            curves.planned_steps = getattr(state, "max_steps", None) or None
            if self.setup.max_grad_norm is not None:  # the trainer's arguments were read
                curves.max_grad_norm, curves.warmup_steps = self.setup.max_grad_norm, self.setup.warmup_steps
            found = analyze(curves, final=final, online=True, ran=self.ran)
            for finding in found:
                finding.step = state.global_step if finding.step is None else finding.step
            self.sink.emit(found)

    def __contains__(self, slug: str) -> bool:
        return any(slug in (r.slug for r in m.rules) for m in self.monitors)
