"""`doctor()`: a post-mortem of finished runs, read from what Trainer left on disk.

A RUN is a ``trainer_state.json``, a checkpoint folder that holds one, or a Trainer ``output_dir`` (its own
``trainer_state.json``, written by ``trainer.save_state()``, or the one of its latest ``checkpoint-*``,
whichever has more steps). Nothing is unpickled (``training_args.bin`` is never opened) and nothing is
written into the run folders.

Per run: the curve rules (`hf_sanity.rules.curves`) on its ``log_history``, with the vocabulary size from a
``config.json`` beside it. Across runs: the run rules (`hf_sanity.rules.runs`), which compare what each run
says about its setup and hyperparameters (see :func:`hf_sanity.rules.runs.describe`). With
``predictions=``: the prediction rules on a JSONL of ``{"prediction", "label"}`` / ``{"score"}`` rows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_sanity.errors import UserInputError
from hf_sanity.findings import Finding
from hf_sanity.report import Report
from hf_sanity.rules import runs as run_rules
from hf_sanity.rules.curves import Curves, analyze
from hf_sanity.rules.internal import internal_error
from hf_sanity.selection import Selection, resolve

STATE = "trainer_state.json"
ARGS_FILES = ("training_args.json", "args.json")
RUN_HELP = "pass a trainer_state.json, a checkpoint folder or a Trainer output_dir"


@dataclass
class Run:
    """One finished run as read from disk."""

    label: str
    state_path: Path
    state: dict[str, Any]
    curves: Curves
    model_config: dict[str, Any] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)  # the side files that were read


# -- reading runs ----------------------------------------------------------------------------------
def read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserInputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserInputError(
            f"cannot read {what} {path}: malformed JSON ({exc.msg} at line {exc.lineno}); "
            "restore the file Trainer wrote or remove it"
        ) from None


def _checkpoint_number(path: Path) -> int:
    try:
        return int(path.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def find_state(path: str | Path) -> Path:
    """The trainer_state.json a RUN argument stands for."""
    path = Path(path)
    if not path.exists():
        raise UserInputError(f"run {path} does not exist; {RUN_HELP}")
    if path.is_file():
        return path
    candidates = []
    if (path / STATE).is_file():
        candidates.append(path / STATE)
    checkpoints = sorted(
        (p for p in path.glob("checkpoint-*") if (p / STATE).is_file()), key=_checkpoint_number
    )
    if checkpoints:
        candidates.append(checkpoints[-1] / STATE)
    if not candidates:
        inside = sorted(
            {p.parent.parent if p.parent.name.startswith("checkpoint-") else p.parent
             for p in [*path.glob(f"*/{STATE}"), *path.glob(f"*/checkpoint-*/{STATE}")]}
        )  # fmt: skip
        if inside:
            raise UserInputError(
                f"{path} is not a run but holds {len(inside)} (e.g. {inside[0]}); pass them one by one, "
                f"e.g. `hf-sanity doctor {path}/*`"
            )
        raise UserInputError(
            f"no {STATE} in {path} nor in a checkpoint-* folder under it; {RUN_HELP} "
            "(Trainer writes it with each checkpoint, and at the end with trainer.save_state())"
        )
    if len(candidates) == 1:
        return candidates[0]
    # The top-level file (save_state at the end) unless the latest checkpoint went further.
    steps = [_global_step(read_json(c, "trainer state")) for c in candidates]
    return candidates[1] if steps[1] > steps[0] else candidates[0]


def _global_step(state: Any) -> int:
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if isinstance(step, int) else -1


def _side_files(state_path: Path) -> list[Path]:
    """Folders whose side files describe the run: the state's folder, then (for a checkpoint) its parent."""
    folder = state_path.parent
    folders = [folder]
    if folder.name.startswith("checkpoint-"):
        folders.append(folder.parent)
    return folders


def _vocab_size(config: dict[str, Any]) -> int | None:
    for source in (config, config.get("text_config") or {}):
        value = source.get("vocab_size") if isinstance(source, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return None


def read_run(path: str | Path) -> Run:
    """Read one RUN: its trainer state and the config.json / training_args.json / args.json beside it."""
    state_path = find_state(path)
    state = read_json(state_path, "trainer state")
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise UserInputError(f"{state_path} has no log_history list, so it is not a {STATE}; {RUN_HELP}")
    model_config: dict[str, Any] = {}
    args: dict[str, Any] = {}
    files: list[str] = []
    for folder in _side_files(state_path):
        config_path = folder / "config.json"
        if not model_config and config_path.is_file():
            data = read_json(config_path, "model config")
            if isinstance(data, dict):
                model_config = data
                files.append(str(config_path))
        for name in ARGS_FILES:
            args_path = folder / name
            if not args and args_path.is_file():
                data = read_json(args_path, "training arguments")
                if isinstance(data, dict):
                    args = data
                    files.append(str(args_path))
    curves = Curves.from_log_history(state["log_history"], vocab_size=_vocab_size(model_config))
    if not curves.train_loss and not curves.eval_loss:
        raise UserInputError(
            f"{state_path} logs no loss (log_history has no 'loss' nor 'eval_loss' entry); "
            "train with logging_steps set so that at least one step is logged"
        )
    return Run(str(path), state_path, state, curves, model_config, args, files)


# -- predictions -----------------------------------------------------------------------------------
def read_predictions(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a predictions JSONL: {"prediction": ..., "label": ...} and/or {"score": ...}."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(
            f"predictions file {path} does not exist; pass a JSONL of "
            '{"prediction": ..., "label": ...} and/or {"score": ...} rows'
        )
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserInputError(f"cannot read predictions file {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserInputError(
                f"cannot read predictions file {path}: line {number} is not JSON ({exc.msg}); "
                'each line must be an object like {"prediction": "yes", "label": "no"} or {"score": 4}'
            ) from None
        if not isinstance(row, dict):
            raise UserInputError(
                f"predictions file {path}: line {number} is not a JSON object; "
                'each line must be an object like {"prediction": "yes", "label": "no"} or {"score": 4}'
            )
        rows.append(row)
    if not any(("prediction" in r and "label" in r) or "score" in r for r in rows):
        raise UserInputError(
            f"predictions file {path} has no row with both 'prediction' and 'label', nor with 'score'; "
            "write one JSON object per line with those keys"
        )
    return rows


# -- the analysis ----------------------------------------------------------------------------------
def _with_run(finding: Finding, run: Run, several: bool) -> Finding:
    finding.evidence = {"run": run.label, **finding.evidence}
    if several:
        finding.message = f"{run.label}: {finding.message}"
    return finding


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


def doctor(
    runs: list[str | Path],
    *,
    predictions: str | Path | None = None,
    select: str | Iterable[str] | None = None,
    ignore: str | Iterable[str] | None = None,
    plot: Path | None = None,
    with_plot: bool = False,
    use_config: bool = True,
) -> Report:
    """A post-mortem of finished runs: what the curves of each say, what they say together, and (with
    ``predictions``) what the eval predictions say. ``plot`` writes a PNG of the curves with every
    finding marked at its step; ``with_plot`` attaches the PNG to ``report.plots`` (for the HTML page)."""
    if not runs:
        raise UserInputError(f"doctor needs at least one run; {RUN_HELP}")
    selection = resolve(select, ignore, use_config=use_config)
    started = time.perf_counter()
    loaded = [read_run(path) for path in runs]
    rows = read_predictions(predictions) if predictions is not None else None
    if plot is not None or with_plot:
        from hf_sanity.plots import require_matplotlib

        require_matplotlib()  # fail on bad input before the analysis, not after

    several = len(loaded) > 1
    per_run: list[list[Finding]] = []
    for run in loaded:
        per_run.append([_with_run(f, run, several) for f in analyze(run.curves, final=True)])

    together: list[Finding] = []
    descriptions = [run_rules.describe(run) for run in loaded]
    failures = [_failures(findings, selection) for findings in per_run]
    for name, check in (
        ("hyperparameter-churn", lambda: run_rules.hyperparameter_churn(descriptions, failures)),
        ("seed-unfixed", lambda: run_rules.seed_unfixed(descriptions)),
        ("predictions", lambda: run_rules.check_predictions(rows) if rows is not None else []),
    ):
        try:
            together.extend(check())
        except Exception as exc:
            together.append(internal_error(name, exc))

    report = Report(title="hf-sanity doctor")
    kept_per_run: list[list[Finding]] = []
    for findings in per_run:
        kept = [k for k in (selection.apply(f) for f in findings) if k is not None]
        kept_per_run.append(kept)
        report.extend(kept)
    kept_together = [k for k in (selection.apply(f) for f in together) if k is not None]
    report.extend(kept_together)

    report.stats["runs"] = [
        {
            "run": run.label,
            "state": str(run.state_path),
            "global_step": _global_step(run.state),
            "train_points": len(run.curves.train_loss),
            "evaluations": len(run.curves.eval_steps),
            "vocab_size": run.curves.vocab_size,
            "side_files": run.files,
        }
        for run in loaded
    ]
    if rows is not None:
        report.stats["predictions"] = len(rows)
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
