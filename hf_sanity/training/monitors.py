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
        self.monitors: list[Monitor] = [
            cls.from_setup(setup) for cls in catalog.monitors(sink.selection.enabled)
        ]
        self.ran: set[str] = (
            set()
        )  # detectors that ran on their inputs at least once (monitors, curve detectors)

    def feed(self, step: int, values: Mapping[str, Any]) -> None:
        """Every monitor that still watches something and reads one of ``values``' keys gets them; each runs in
        its own guard, named by the rules it would leave unwatched if it broke."""
        for monitor in self.monitors:
            if monitor.done or not any(key in values for key in monitor.reads):
                continue
            name = ", ".join(r.slug for r in monitor.rules if self.sink.selection.enabled(r.slug))
            self.ran.add(catalog.Detector("", "step", type(monitor)).name)
            with self.sink.guard(name, step):
                self.sink.emit(monitor.update(step, values))

    def __contains__(self, slug: str) -> bool:
        return any(slug in (r.slug for r in m.rules) for m in self.monitors)
