"""A Report collects findings and renders them: to the terminal with rich, to JSON (atomically)."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.padding import Padding
from rich.text import Text

from hf_sanity.findings import SEVERITY_RANK, Finding
from hf_sanity.jsonvalues import jsonable
from hf_sanity.numbers import fmt
from hf_sanity.report_schema import ReportRecord

if TYPE_CHECKING:
    from hf_sanity.remedies import Remedy

SEVERITY_STYLE = {"error": "bold red", "warning": "bold yellow", "info": "bold cyan"}


def version() -> str:
    from hf_sanity.version import __version__

    return __version__


@dataclass
class Report:
    title: str = "hf-sanity"
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    # Figures that belong to the report (title -> PNG bytes): shown by the HTML page, not part of the JSON.
    plots: dict[str, bytes] = field(default_factory=dict)
    # What was not checked, and why, one line each (checks that could not run, a run that was skipped): said
    # under the summary, so that "no findings" never stands for checks that did not run.
    notes: list[str] = field(default_factory=list)
    # What the report shows besides its findings (the decoded batch of `show`, doctor's per-class table):
    # renderables with ``data()`` for the JSON (``views``); the HTML page draws each (`html.render_view`).
    views: list[Any] = field(default_factory=list)
    # Said instead of "no findings" by a report that runs no checks (`show`: what it shows).
    headline: str | None = None
    # One line under the summary saying what the checks assumed about the run (preflight: which tokens carry
    # loss and what decided it; `stats.loss_mask` has it as fields).
    header: str | None = None
    # The command that applies the findings' remedies (the CLI names its own paths); shown with each finding that
    # has one, as ruff marks a fixable diagnostic [*].
    fix_command: str | None = field(default=None, repr=False)

    def add(self, finding: Finding) -> None:
        self.findings.append(finding)

    def extend(self, findings: Iterable[Finding]) -> None:
        self.findings.extend(findings)

    @property
    def has_errors(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    @property
    def exit_code(self) -> int:
        """0: no error findings; 1: the checks ran and found errors. (2 is bad input, raised earlier.)"""
        return 1 if self.has_errors else 0

    def rules(self) -> set[str]:
        return {f.rule for f in self.findings}

    def by_rule(self, slug: str) -> list[Finding]:
        return [f for f in self.findings if f.rule == slug]

    def remedies(self) -> list[tuple[Finding, Remedy]]:
        """(finding, remedy) for every finding that has one, errors first: what `hf-sanity fix` applies to a
        copy of the setup (safe ones; unsafe ones with --unsafe-fixes, ``unsafe=True``; display-only ones are
        shown, never applied)."""
        return [(f, f.remedy) for f in self.ordered() if f.remedy is not None]

    def apply_command(self, unsafe: bool = False) -> str:
        """How to apply the remedies: the CLI's ``hf-sanity fix ...``, or ``hf_sanity.fix(...)`` in Python."""
        if self.fix_command:
            return self.fix_command + (" --unsafe-fixes" if unsafe else "")
        return f"hf_sanity.fix(model, tokenizer, dataset{', unsafe=True' if unsafe else ''})"

    def counts(self) -> Counter:
        return Counter(f.severity for f in self.findings)

    def ordered(self) -> list[Finding]:
        """Errors first, then warnings, then info; findings of one rule together, in order of arrival."""
        first_seen = {}
        for i, f in enumerate(self.findings):
            first_seen.setdefault(f.rule, i)
        return sorted(self.findings, key=lambda f: (SEVERITY_RANK[f.severity], first_seen[f.rule]))

    # -- JSON --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The report as its file has it: hf_sanity.report_schema.ReportRecord, with ``schema_version``."""
        return ReportRecord.from_report(self).to_dict()

    @classmethod
    def from_record(cls, record: ReportRecord) -> Report:
        """A report read from its file (``report_schema.read``): its findings without their example objects
        (the text is in the file) and without the code of their remedies, which only the process that found
        them can apply (a display-only remedy, which has none, is kept)."""
        from hf_sanity.remedies import Remedy

        report = cls(title=record.title, stats=dict(record.stats), notes=list(record.notes))
        for found in record.findings:
            remedy = found.remedy
            report.add(
                Finding(
                    rule=found.rule, severity=found.severity, message=found.message,
                    evidence=dict(found.evidence), fix=found.fix, step=found.step,
                    remedy=Remedy(remedy.title, remedy.safety, tuple(remedy.changes), detail=remedy.detail)
                    if remedy is not None and remedy.safety == "display" else None,
                )
            )  # fmt: skip
        return report

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    def write_json(self, path: str | os.PathLike, *, durable: bool = True) -> Path:
        return write_atomic(path, self.to_json() + "\n", durable=durable)

    def offending_rows(self) -> dict[str, list[int]]:
        """Every offending row index per rule (a finding's evidence lists the first ten), for
        ``dataset.filter(lambda _, i: i not in drop, with_indices=True)``. split-leakage's rows index the eval
        split; rules that judge a sample, not every row, are absent."""
        rows: dict[str, set[int]] = {}
        for finding in self.ordered():
            if finding.rows is not None:
                rows.setdefault(finding.rule, set()).update(finding.rows)
        return {rule: sorted(indices) for rule, indices in rows.items()}

    def write_rows(self, path: str | os.PathLike) -> Path:
        """:meth:`offending_rows` as JSON, ``{rule: [rows...]}``."""
        return write_atomic(path, json.dumps(self.offending_rows()) + "\n")

    # -- terminal ----------------------------------------------------------------------------------
    def summary(self) -> str:
        counts = self.counts()
        if not self.findings:
            return f"{self.title}: {self.headline or 'no findings'}"
        parts = [
            f"{counts[s]} {s}{'s' if counts[s] != 1 else ''}"
            for s in ("error", "warning", "info")
            if counts[s]
        ]
        return f"{self.title}: " + ", ".join(parts)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        counts = self.counts()
        style = "bold red" if counts["error"] else "bold yellow" if counts["warning"] else "bold green"
        yield Text(self.summary(), style=style)
        if self.header:
            yield Text(self.header, style="dim")
        yield from self.rendered_notes()
        for finding in self.ordered():
            yield Text()
            yield render_finding(finding, self.apply_command)
        fixable = [r for _, r in self.remedies() if r.applicable]
        if fixable:
            unsafe = sum(r.safety == "unsafe" for r in fixable)
            yield Text()
            line = Text("[*] ", style="bold green")
            line.append(f"{len(fixable)} finding{'s' if len(fixable) != 1 else ''} with a remedy: ")
            line.append(self.apply_command(), style="bold")
            if unsafe:
                more = "add --unsafe-fixes" if self.fix_command else self.apply_command(unsafe=True)
                line.append(f" ({unsafe} unsafe: {more})")
            yield line
        for view in self.views:
            yield Text()
            yield view
        if self.stats:
            yield Text()
            yield Text("stats: " + ", ".join(f"{k}={_short(v)}" for k, v in self.stats.items()), style="dim")

    def rendered_notes(self) -> list[Text]:
        return [Text(f"note: {note}", style="yellow") for note in self.notes]

    def print(self, console: Console | None = None) -> None:
        (console or Console()).print(self)


def _short(value: Any) -> str:
    """One evidence value for the terminal: sentences in full (up to 200 characters), long lists and dicts
    cut at 100 (the JSON report has them whole)."""
    if isinstance(value, float):
        return fmt(value, 4)
    text = json.dumps(jsonable(value), ensure_ascii=False)
    limit = 200 if isinstance(value, str) else 100
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render_finding(finding: Finding, command: Callable[[bool], str] | None = None) -> Group:
    """One finding, pytest style: the verdict with its number, the evidence, the example, the fix; a finding
    with a remedy is marked [*] (ruff's mark), its remedy said after the fix with ``command(unsafe)``, how to apply it."""
    head = Text()
    head.append(f"{finding.severity:<8}", SEVERITY_STYLE[finding.severity])
    head.append(f"{finding.rule}", "bold")
    remedy = finding.remedy
    if remedy is not None and remedy.applicable:
        head.append(" [*]", "bold green")
    if finding.step is not None:
        head.append(f" @ step {finding.step}", "magenta")
    head.append(f"  {finding.message}")
    parts: list[Any] = [head]
    if finding.evidence:
        evidence = " · ".join(f"{key}={_short(value)}" for key, value in finding.evidence.items())
        parts.append(Padding(Text(evidence, style="dim"), (0, 0, 0, 8), expand=False))
    if finding.example is not None:
        parts.append(Padding(finding.example, (0, 0, 0, 8), expand=False))
    if finding.fix:
        fix = Text("fix: ", style="bold green")
        fix.append(finding.fix)
        parts.append(Padding(fix, (0, 0, 0, 8), expand=False))
    if remedy is not None:
        line = Text("[*] " if remedy.applicable else "", style="bold green")
        line.append(f"remedy ({remedy.safety}{' only' if not remedy.applicable else ''}): ", "bold green")
        line.append(remedy.title)
        if remedy.applicable and command is not None:
            line.append(" — ")
            line.append(command(remedy.safety == "unsafe"), "bold")
        parts.append(Padding(line, (0, 0, 0, 8), expand=False))
    return Group(*parts)


def write_atomic(path: str | os.PathLike, text: str | bytes, *, durable: bool = True) -> Path:
    """Write a file so that readers see the old content or the new one, never half of it; with the mode the
    file had, or a new file's mode under the user's umask (mkstemp's own 0600 would hide a report from the
    rest of a team). ``durable``: on disk before it replaces the old file (``fsync``), so that it survives the
    machine going down right after; without it, the rename is as atomic for every reader, and the data
    reaches the disk when the system flushes it (the way Trainer writes its own ``trainer_state.json``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8") if isinstance(text, str) else text
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    """The process's umask: from /proc (Linux), else by setting it and straight back (which other threads
    could see for that instant, hence not the first choice)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
