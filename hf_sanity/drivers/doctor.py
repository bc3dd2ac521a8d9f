"""`doctor()`: a post-mortem of finished runs, read from what Trainer left on disk.

Per run (see `hf_sanity.measure.runs` for what a RUN is and what is read): the curve detectors on its
``log_history``, with the vocabulary size from a ``config.json`` beside it, and the findings SanityCallback
wrote while it trained (``output_dir/hf-sanity/report.json``). Across runs: the "runs"
detectors, which compare what each run says about its setup and hyperparameters. With ``predictions=``:
the prediction rules on a JSONL of ``{"prediction", "label"}`` / ``{"score"}`` rows. No code of the run's
files runs (``training_args.bin`` is read inert) and nothing is written into the run folders.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from hf_sanity import catalog
from hf_sanity.classtable import ClassTable
from hf_sanity.drivers.curves import analyze
from hf_sanity.errors import UserInputError
from hf_sanity.findings import Finding
from hf_sanity.measure.objective import of_log_history
from hf_sanity.measure.runs import (
    RUN_HELP,
    Run,
    RunSet,
    changes,
    describe,
    global_step,
    read_predictions,
    read_run,
    series,
)
from hf_sanity.report import Report, _short
from hf_sanity.selection import Selection, resolve


# -- the analysis ----------------------------------------------------------------------------------
def _with_run(finding: Finding, run: Run, several: bool) -> Finding:
    finding.evidence = {"run": run.label, **finding.evidence}
    if several:
        finding.message = f"{run.label}: {finding.message}"
    return finding


CALLBACK = "SanityCallback"
NOT_EVIDENCE = {"run", "source", "report", "rank"}  # what marks a finding's origin, not what it found


def _from_callback(run: Run) -> list[Finding]:
    """The findings SanityCallback wrote while the run trained, marked as such."""
    out = []
    for record in run.callback_findings:
        evidence = {"source": CALLBACK, "report": str(run.callback_report), **record.evidence}
        if record.example is not None:  # a token view, written as plain text
            evidence["example"] = record.example
        out.append(
            Finding(
                rule=record.rule,
                severity=record.severity,
                message=f"{record.message} (found by {CALLBACK} during training)",
                evidence=evidence,
                fix=record.fix,
                step=record.step,
            )
        )
    return out


COUNTER = "hf_sanity/"


def _from_counters(run: Run) -> list[Finding]:
    """Without SanityCallback's report.json (a checkpoint copied elsewhere), what it counted per rule, as it
    logged into ``log_history``: the rule, how often, and the first step it was counted at."""
    rules = catalog.load()
    first: dict[str, int | None] = {}
    counts: dict[str, int] = {}
    for entry in run.state.get("log_history") or []:
        if not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            slug = key[len(COUNTER) :] if key.startswith(COUNTER) else None
            if slug not in rules or slug in catalog.ALWAYS_REPORTED or type(value) is not int or value < 1:
                continue
            counts[slug] = max(counts.get(slug, 0), value)
            if slug not in first:
                step = entry.get("step")
                first[slug] = step if type(step) is int else None
    out = []
    for slug, count in counts.items():
        rule = rules[slug]
        out.append(
            Finding(
                rule=slug,
                severity=rule.severity,
                message=f"{CALLBACK} counted {count} {slug} finding{'s' if count > 1 else ''} during training, "
                f"first logged at step {first[slug]} (its report.json, with the evidence, is not beside this run)",
                evidence={"source": CALLBACK, "counted": count, "first_logged_step": first[slug]},
                fix=rule.fix,
                step=first[slug],
            )
        )
    return out


def _merge_counters(from_curves: list[Finding], counted: list[Finding]) -> list[Finding]:
    """A rule the curves give too: its finding notes what the callback counted; the others are added."""
    by_rule = {f.rule: f for f in from_curves}
    added = []
    for found in counted:
        if found.rule in by_rule:
            same, since = by_rule[found.rule], found.evidence["first_logged_step"]
            same.evidence.update(callback_counted=found.evidence["counted"], callback_first_step=since)
            same.message += f" ({CALLBACK} counted it from step {since})"
        else:
            added.append(found)
    return from_curves + added


def _merge(from_curves: list[Finding], from_callback: list[Finding]) -> list[Finding]:
    """One run's findings: its curves', then what SanityCallback found while it trained. The callback saw
    every step, the logs only every logging_steps; so its finding of a rule the curves also give replaces
    theirs when it carries evidence they lack (a non-finite loss's cause and module, where the logs show a
    hidden 0.0), and is left out when it carries nothing more."""
    by_rule: dict[str, list[Finding]] = {}
    for finding in from_curves:
        by_rule.setdefault(finding.rule, []).append(finding)
    replaced: set[int] = set()  # ids of the curve findings a callback finding replaces
    added = []
    for found in from_callback:
        same = (
            by_rule.get(found.rule, []) if found.rule != "internal-error" else []
        )  # a broken check: its own
        if not same:
            added.append(found)
        elif set(found.evidence) - {key for f in same for key in f.evidence} - NOT_EVIDENCE:
            replaced |= {id(f) for f in same}
            added.append(found)
    return [f for f in from_curves if id(f) not in replaced] + added


def _failures(findings: Iterable[Finding], selection: Selection) -> frozenset[str]:
    """The slugs of a run's error and warning findings, as the user configured severities (ignored rules
    do not count)."""
    out = set()
    for finding in findings:
        if finding.rule in selection.ignore or finding.rule == "internal-error":
            continue
        severity = selection.severity.get(finding.rule, finding.severity)
        if severity in ("error", "warning"):
            out.add(finding.rule)
    return frozenset(out)


BASELINE_KINDS = ("human", "majority")


def check_baseline(baseline: float | None, kind: str, predictions) -> None:
    """--baseline and --baseline-kind, checked before anything is read."""
    if kind not in BASELINE_KINDS:
        raise UserInputError(f"--baseline-kind must be one of {', '.join(BASELINE_KINDS)}, got {kind!r}")
    if baseline is None:
        return
    if not 0 < baseline <= 1:
        raise UserInputError(f"--baseline is an accuracy between 0 and 1 (0.9 for 90%), got {baseline}")
    if predictions is None:
        raise UserInputError("--baseline judges eval predictions: pass them with --predictions")


def read_runs(paths: list[str | Path]) -> tuple[list[Run], list[tuple[str, str]]]:
    """The runs that can be read, and (path, why) for each that cannot: one bad RUN among several is skipped,
    not the end of the post-mortem; when none can be read, the first one's problem is the bad input."""
    loaded, skipped, first_error = [], [], None
    for path in paths:
        try:
            loaded.append(read_run(path))
        except UserInputError as exc:
            first_error = first_error or exc
            skipped.append((str(path), str(exc)))
    if not loaded:
        raise first_error
    return loaded, skipped


def doctor(
    runs: list[str | Path],
    *,
    predictions: str | Path | None = None,
    select: str | Iterable[str] | None = None,
    ignore: str | Iterable[str] | None = None,
    plot: Path | None = None,
    with_plot: bool = False,
    use_config: bool = True,
    baseline: float | None = None,
    baseline_kind: str = "human",
) -> Report:
    """A post-mortem of finished runs: what the curves of each say, what they say together, and (with
    ``predictions``) what the eval predictions say, with their per-class table; ``baseline``: the accuracy to
    judge them against, a human one (``baseline_kind="human"``: above it is suspect) or a majority one
    (``"majority"``: not above it is). ``plot`` writes a PNG of the curves with every finding marked at its
    step; ``with_plot`` attaches the PNG to ``report.plots`` (for the HTML page)."""
    if not runs:
        raise UserInputError(f"doctor needs at least one run; {RUN_HELP}")
    check_baseline(baseline, baseline_kind, predictions)
    selection = resolve(select, ignore, use_config=use_config)
    started = time.perf_counter()
    loaded, skipped = read_runs(runs)
    rows = read_predictions(predictions) if predictions is not None else None
    if plot is not None or with_plot:
        from hf_sanity.plots import require_matplotlib

        require_matplotlib()  # fail on bad input before the analysis, not after

    several = len(loaded) > 1
    per_run: list[list[Finding]] = []
    objectives = []
    for run in loaded:
        objective = of_log_history(run.state.get("log_history"))
        objectives.append(objective.kind)
        narrowed = selection.for_objective(objective.kind)  # a DPO run's loss is not read as an SFT one
        from_curves = analyze(run.curves, final=True, selection=narrowed) if run.has_loss else []
        if run.callback_report is not None:
            merged = _merge(from_curves, _from_callback(run))
        else:
            merged = _merge_counters(from_curves, _from_counters(run))
        found = catalog.without_explained(merged)
        per_run.append([_with_run(f, run, several) for f in found if narrowed.enabled(f.rule)])

    run_set = RunSet(
        descriptions=[describe(run, kind) for run, kind in zip(loaded, objectives)],
        failures=[_failures(findings, selection) for findings in per_run],
        predictions=rows,
        baseline=baseline,
        baseline_kind=baseline_kind,
    )
    kept_together = catalog.run_all("runs", run_set, selection)

    report = DoctorReport(title="hf-sanity doctor")
    report.notes += [f"{run.label}: {run.missing}" for run in loaded if run.missing]
    report.notes += [f"{label}: skipped, {why}" for label, why in skipped]
    kept_per_run: list[list[Finding]] = []
    for findings in per_run:
        kept = [k for k in (selection.apply(f) for f in findings) if k is not None]
        kept_per_run.append(kept)
        report.extend(kept)
    report.extend(kept_together)

    report.stats["runs"] = [
        {
            "run": run.label,
            "state": str(run.state_path) if run.state_path is not None else None,
            "global_step": global_step(run.state),
            "train_points": len(run.curves.train_loss),
            "evaluations": len(run.curves.eval_steps),
            "vocab_size": run.curves.vocab_size,
            "side_files": run.files,
            "callback_findings": len(run.callback_findings) if run.callback_report is not None else None,
            "objective": objective,
            **row,
        }
        for run, objective, row in zip(loaded, objectives, run_table(run_set))
    ]
    if rows is not None:
        report.stats["predictions"] = len(rows)
        from hf_sanity.measure.runs import class_table

        table = class_table(rows)
        if table is not None:
            report.views.append(ClassTable(table, title=f"per class ({len(table)} labels)"))
    if plot is not None or with_plot:
        from hf_sanity.plots import plot_runs

        report.plots["loss curves"] = plot_runs(
            [(run.label, run.curves, kept) for run, kept in zip(loaded, kept_per_run)],
            plot,
            notes=kept_together,
        )
        if plot is not None:
            report.stats["plot"] = str(plot)
    report.stats["seconds"] = round(time.perf_counter() - started, 2)
    return report


# -- the runs table --------------------------------------------------------------------------------
def run_table(runs: RunSet) -> list[dict]:
    """Per run, in the order given: what changed from the run before (readable in both) and its outcome."""
    previous: dict[int, int] = {}  # each run's predecessor among the runs of its objective
    for group in series(runs.descriptions):
        previous.update(itertools.pairwise(group[::-1]))
    rows = []
    for i, (description, failed) in enumerate(zip(runs.descriptions, runs.failures)):
        before = previous.get(i)
        found = changes(runs.descriptions[before], description) if before is not None else []
        lr, lr_source = description.learning_rate
        rows.append(
            {
                "changed": [c.describe() for c in found] if before is not None else None,
                "outcome": ", ".join(sorted(failed)) if failed else "no failure",
                "learning_rate": lr,
                "learning_rate_source": lr_source,
            }
        )
    return rows


@dataclass
class DoctorReport(Report):
    """doctor's report: with several runs, a table of them in the order given (the objective where they mix,
    the configured learning rate, what changed from the run before of the same objective, outcome) under the
    findings."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        runs = self.stats.get("runs") or []
        if len(runs) < 2:
            yield from super().__rich_console__(console, options)
            return
        yield from Report(self.title, self.findings, {}, self.plots, self.notes).__rich_console__(
            console, options
        )
        table = Table(title="runs, in the order given", title_justify="left", title_style="bold",
                      show_edge=False, header_style="bold")  # fmt: skip
        kinds = {row["objective"] for row in runs}
        columns = ["#", "run", *(["objective"] if len(kinds) > 1 else []), "learning rate"]
        for column in (*columns, "changed from the run before", "outcome"):
            table.add_column(column, overflow="fold")
        labels = short_labels([row["run"] for row in runs])
        seen: set[str] = set()
        for i, (row, label) in enumerate(zip(runs, labels), 1):
            kind = row["objective"]
            first = kind not in seen
            seen.add(kind)
            changed = (
                "; ".join(row["changed"])
                if row["changed"]
                else (f"(first {kind} run)" if len(kinds) > 1 else "(first)")
                if first
                else "nothing readable"
            )
            outcome = Text(row["outcome"], style="green" if row["outcome"] == "no failure" else "red")
            lr = row.get("learning_rate")
            shown = (
                "?"
                if lr is None
                else f"{lr:.3g}" + ("" if row["learning_rate_source"] == "arguments" else " (peak logged)")
            )
            table.add_row(str(i), label, *([kind] if len(kinds) > 1 else []), shown, changed, outcome)
        yield Text()
        yield table
        rest = {k: v for k, v in self.stats.items() if k != "runs"}
        yield Text()
        yield Text("stats: " + ", ".join(f"{k}={_short(v)}" for k, v in rest.items()), style="dim")


def short_labels(labels: list[str]) -> list[str]:
    """The runs' paths without the folder they all share (out/a, out/b -> a, b), for the table."""
    try:
        common = os.path.commonpath(labels)
    except ValueError:  # absolute and relative paths mixed
        return labels
    if not common or common in labels:
        return labels
    return [os.path.relpath(label, common) for label in labels]
