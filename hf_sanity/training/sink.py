"""Where SanityCallback's findings go: the user's selection applied, one finding per rule (the earliest step
wins across ranks), printed once when it first fires (through ``tqdm.write``: above Trainer's progress bar, never
on its line), kept in the report and written to ``output_dir/hf-sanity/report.json`` by the main process. Every check runs in :meth:`FindingSink.guard`: its
exception becomes one ``internal-error`` finding per check, never the run's, and its seconds are counted.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from time import perf_counter
from typing import Any

from hf_sanity import catalog
from hf_sanity.catalog import explained
from hf_sanity.findings import SEVERITY_RANK, Finding
from hf_sanity.measure.objective import SFT_OBJECTIVE, Objective
from hf_sanity.report import Report
from hf_sanity.selection import Selection


class _TimedGuard(catalog.Guard):
    """``catalog.Guard`` for the callback: the check's seconds counted, and an internal-error reported once per
    check (the run goes on). Entered some thirty times a step: its attributes set here, not through
    ``Guard.__init__``, and a block that raised nothing leaves without ``Guard.__exit__``."""

    __slots__ = ("sink", "started")

    def __init__(self, sink: FindingSink, check: str, step: int | None) -> None:
        self.sink, self.check, self.step, self.found, self.user_errors = sink, check, step, None, True

    def __enter__(self) -> None:
        # Inside a guard of the same check (an event's guard around a part that guards itself): counted once.
        open_checks = self.sink.open_checks
        self.started = None if self.check in open_checks else perf_counter()
        if self.started is not None:
            open_checks.add(self.check)

    def __exit__(self, kind, exc, tb) -> bool:
        if self.started is not None:
            timings, check = self.sink.timings, self.check
            timings[check] = timings.get(check, 0.0) + (perf_counter() - self.started)
            self.sink.open_checks.discard(check)
        return kind is not None and super().__exit__(kind, exc, tb)

    def broken(self, exc: Exception) -> None:
        if self.check not in self.sink._failed:
            self.sink._failed.add(self.check)
            self.sink.emit([catalog.internal_error(self.check, exc, self.step)])


class FindingSink:
    def __init__(self, selection: Selection, *, abort_on: str = "never", print_findings: bool = True) -> None:
        self.selection = selection
        self.objective: Objective = SFT_OBJECTIVE
        self.abort_on = abort_on
        self.print_findings = print_findings
        self.report = Report(title="hf-sanity training")
        self.counts: dict[str, int] = {}  # findings per rule (what the logs carry as hf_sanity/<rule>)
        self.is_main = True
        self.rank, self.world_size = 0, 1
        self.output_dir: Path | None = None
        self.unsent: list[Finding] = []  # this rank's findings the other ranks have not seen (DDP)
        self.errors_unsent = False
        self.stop_pending = False  # an error finding with abort_on="error": stop at the next safe point
        self.stop_reason: Finding | None = None  # the first error finding that asked to stop
        self.aborted_at: int | None = None  # the step at which the callback stopped training
        self.annotate: Callable[[Finding], None] | None = None  # adds run facts to a kept finding
        self.timings: dict[str, float] = {}
        # The checks whose guard is open: a guard of one of them nested inside is not timed again.
        self.open_checks: set[str] = set()
        self._failed: set[str] = set()
        self._reads: frozenset[str] | None = None  # the value keys the enabled step detectors read

    def narrow(self, objective: Objective) -> None:
        """The run's training objective is known: from now on only the rules written for it are wanted."""
        self.objective = objective
        self.selection = self.selection.for_objective(objective.kind)
        self._reads = None

    def wants(self, *slugs: str) -> bool:
        """Some of these rules is enabled. Not for deciding what to measure for a step detector: that is
        :meth:`measures`, by the values it reads (tests/test_architecture.py holds the planners to it)."""
        return any(self.selection.enabled(slug) for slug in slugs)

    def measures(self, *keys: str) -> bool:
        """The run's measurement plan: whether some enabled step detector reads one of the value ``keys`` (its
        ``reads``, the contract MonitorSet feeds it by). A value is measured because a check reads it, never
        because some other rule of a list happens to be on (``select=["loss-diverged"]`` still samples the
        update ratio that names its cause ``lr-too-high``)."""
        if self._reads is None:
            enabled = self.selection.enabled
            self._reads = frozenset(key for cls in catalog.monitors(enabled) for key in cls.reads)
        return not self._reads.isdisjoint(keys)

    def guard(self, check: str, step: int | None = None) -> _TimedGuard:
        """Run one check: an exception becomes an internal-error finding (once per check), never the run's; its
        seconds are counted."""
        return _TimedGuard(self, check, step)

    def emit(self, findings: Iterable[Finding]) -> None:
        for finding in findings:
            kept = self.selection.apply(finding)
            if kept is None or self._duplicate(kept) or explained(kept, self.counts):
                continue
            if self.world_size > 1:
                kept.evidence["rank"] = self.rank
            if self.annotate is not None:
                with contextlib.suppress(Exception):
                    self.annotate(kept)
            self._add(kept)
            if self.world_size > 1:
                self.unsent.append(kept)
                self.errors_unsent |= kept.severity == "error"
            if kept.severity == "error" and self.abort_on == "error":
                self.stop_pending = True
                self.stop_reason = self.stop_reason or kept

    def restore(self, findings: list[Finding]) -> None:
        """A resumed run's findings from before its checkpoint: in the report and the counts, as they were
        (printed and acted on then: not printed, and no stop, now)."""
        for finding in findings:
            self.report.add(finding)
            self.counts[finding.rule] = self.counts.get(finding.rule, 0) + 1

    def merge(self, incoming: list[dict[str, Any]]) -> None:
        """Findings of other ranks, on the main process: one per rule, the earliest step wins."""
        for data in incoming:
            kept = self.selection.apply(Finding(**data))
            if kept is None:
                continue
            mine = self.report.by_rule(kept.rule)
            if mine and kept.rule != "internal-error":
                if kept.step is not None and mine[0].step is not None and kept.step < mine[0].step:
                    self.report.findings.remove(mine[0])
                    self.report.add(kept)  # not printed again: each rule prints once
                continue
            self._add(kept)

    def take_unsent(self) -> tuple[list[Finding], bool]:
        """This rank's new findings (and whether one is an error) since the last exchange."""
        unsent, errors = self.unsent, self.errors_unsent
        self.unsent, self.errors_unsent = [], False
        return unsent, errors

    def save_batch(self, batch, name: str) -> str | None:
        """A batch as ``output_dir/hf-sanity/<name>[-rank<r>].safetensors``, for reproduction (None: no folder)."""
        from hf_sanity.training.replay import save_batch

        if self.output_dir is None:
            return None
        suffix = f"-rank{self.rank}" if self.world_size > 1 else ""
        path = save_batch(batch, self.output_dir / f"{name}{suffix}.safetensors")
        return str(path) if path else None

    def write(self) -> None:
        """The report, on the main process. Inside the run: without an ``fsync`` (1-3 ms of the run's time on
        this machine's disk), which only guards against the machine going down in the seconds after."""
        if self.is_main and self.output_dir is not None:
            self.report.write_json(self.output_dir / "report.json", durable=False)

    def stats(self, seconds: float, share: float | None, **counts: int) -> dict[str, Any]:
        """The report's stats: the run's counts, the callback's own ``seconds`` and their ``share`` of the run
        (:class:`hf_sanity.training.instrument.OwnClock`), and the seconds the checks took (the five costliest)."""
        timings = sorted(self.timings.items(), key=lambda kv: -kv[1])[:5]
        return {
            **counts,
            "callback_seconds": round(seconds, 3),
            "callback_share": None if share is None else round(share, 4),
            "callback_seconds_by_check": {k: round(v, 3) for k, v in timings},
            "world_size": self.world_size,
            "objective": self.objective.kind,
            "objective_detail": self.objective.describe(),
        }

    def say(self, renderable, *, soft_wrap: bool = False, always: bool = False) -> None:
        """Print on the main process, through ``tqdm.write``: a progress bar on the terminal (Trainer's) is
        cleared first and redrawn below, so the text gets lines of its own (``soft_wrap``: one line, unwrapped;
        ``always``: also with ``print_findings=False``, for what the user asked to see)."""
        if self.is_main and (self.print_findings or always):
            with contextlib.suppress(Exception):
                from rich.console import Console
                from tqdm.auto import tqdm

                console = Console(stderr=True)
                with console.capture() as captured:
                    console.print(renderable, soft_wrap=soft_wrap)
                tqdm.write(captured.get().rstrip("\n"), file=sys.stderr)

    def _duplicate(self, finding: Finding) -> bool:
        """The same finding again: one per rule, but one per broken check (internal-error) and one per reason
        a check was skipped (checks-skipped: several reasons, each said once)."""
        if finding.rule in catalog.ALWAYS_REPORTED:
            same = ("check",) if finding.rule == catalog.INTERNAL_ERROR.slug else ("why", "needs", "skipped")
            return any(
                all(f.evidence.get(k) == finding.evidence.get(k) for k in same)
                for f in self.report.by_rule(finding.rule)
            )
        if finding.rule not in self.counts:
            return False
        # A rule fires once, unless what it sees grows worse: a loss spike reported as a transient info at one
        # evaluation is a warning at a later one when the spikes keep coming back.
        rank = SEVERITY_RANK[finding.severity]
        return any(SEVERITY_RANK[f.severity] <= rank for f in self.report.by_rule(finding.rule))

    def _add(self, finding: Finding) -> None:
        self.report.add(finding)
        self.counts[finding.rule] = self.counts.get(finding.rule, 0) + 1
        self._print(finding)

    def _print(self, finding: Finding) -> None:
        """Print a finding once, when it first fires (main process)."""
        from hf_sanity.report import render_finding

        self.say(render_finding(finding))
