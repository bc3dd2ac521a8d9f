"""`fix()`: the findings' remedies applied to a copy of the setup, then the checks run again on the copy.

preflight -> each finding's remedy (the safe ones; the unsafe ones too with ``unsafe=True``; display-only ones
shown, never applied) -> applied to a :class:`~hf_sanity.remedies.Repair` (copies) -> the repaired tokenizer,
generation config and data written to a staging folder and loaded back, as ``from_pretrained`` will load them
-> preflight again on what was loaded -> per finding ``fixed``, ``not fixed`` (what remains) or
``display only``. Nothing of the user's is written: :meth:`Fixed.save` writes a new folder.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

from hf_sanity.errors import UserInputError
from hf_sanity.findings import Finding
from hf_sanity.jsonvalues import jsonable
from hf_sanity.remedies import Remedy, Repair
from hf_sanity.report import SEVERITY_STYLE, Report, _umask, version

# Per finding of the report the remedies came from (and "new": a finding the repaired copy has that the
# original did not).
STATUS_STYLE = {
    "fixed": "bold green",
    "not fixed": "bold red",
    "display only": "bold cyan",
    "not applied": "bold yellow",
    "no remedy": "dim",
    "new": "bold red",
}
# What save_pretrained writes for a tokenizer: never copied from the user's folder (the repaired one is written).
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json", "tekken.json"}  # fmt: skip
# The repaired data is written in the format it was given in (Parquet stays Parquet, with its types; a
# save_to_disk folder stays one): name per split, extension per format.
DATA_STEMS = {"train": "dataset", "eval": "eval_dataset"}
DATA_FORMATS = {"jsonl": ".jsonl", "json": ".json", "csv": ".csv", "parquet": ".parquet", "arrow": ""}
DATA_NAMES = {stem + ext for stem in DATA_STEMS.values() for ext in DATA_FORMATS.values()}
DIFF_LINES = 60  # lines of one file's diff shown; fixes.json has every change
DIFF_ROWS = 8  # rows of the dataset's diff shown (dropped rows first)


@dataclass
class Outcome:
    """What became of one finding of the original report."""

    finding: Finding
    status: str
    remaining: list[Finding] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = {"rule": self.finding.rule, "severity": self.finding.severity, "message": self.finding.message,
               "status": self.status}  # fmt: skip
        if self.finding.remedy is not None:
            out["remedy"] = self.finding.remedy.to_dict()
        if self.note:
            out["note"] = self.note
        if self.remaining and self.status != "new":
            out["remaining"] = [{"message": f.message, "evidence": f.evidence} for f in self.remaining]
        return out


@dataclass
class Fixed:
    """The repaired setup (objects in memory), what was changed, and the checks run again on it (``report``;
    ``before``: the report the remedies came from). ``exit_code`` is 0 only when the repaired setup has no
    error finding left."""

    tokenizer: Any
    model: Any
    dataset: Any
    eval_dataset: Any
    generation_config: Any
    training_args: dict[str, Any]
    before: Report
    report: Report
    outcomes: list[Outcome]
    applied: list[Finding] = field(default_factory=list)
    unsafe: bool = False
    model_changed: bool = False
    repair: Repair | None = field(default=None, repr=False)
    staging: Any = field(default=None, repr=False)  # the TemporaryDirectory the repaired files are staged in
    data_format: str = "jsonl"  # the format the repaired data is written in (:data:`DATA_FORMATS`)
    # Keys of the model's config.json a remedy made stale (the pad token's id): written into the copy's.
    config_updates: dict[str, Any] = field(default_factory=dict)
    # What the last save() did with each file of the model folder: "linked" (a hard link to the user's
    # unchanged file), "copied" (os.link failed: another file system), "written" (changed, or new).
    written: dict[str, str] = field(default_factory=dict, repr=False)
    link_error: str = ""  # why os.link failed, when a file was copied instead

    @property
    def changed(self) -> bool:
        return bool(self.applied)

    @property
    def exit_code(self) -> int:
        return self.report.exit_code

    def remedies(self) -> list[Remedy]:
        return [f.remedy for f in self.applied if f.remedy is not None]

    # -- what changed ------------------------------------------------------------------------------------
    def diff(self) -> str:
        """The changes as a unified diff of the files that differ (tokenizer files, generation_config.json),
        the training arguments, the model's weights in words, and the dataset rows edited or dropped."""
        if not self.changed:
            return ""
        out = [f"# [*] {f.rule} ({f.remedy.safety}): {f.remedy.title}" for f in self.applied if f.remedy]
        root = Path(self.staging.name)
        original, repaired = root / "original", root / "repaired"
        names = sorted({p.name for p in original.iterdir()} | {p.name for p in repaired.iterdir()})
        for name in names:
            if name in DATA_NAMES:
                continue
            before, after = _lines(original / name), _lines(repaired / name)
            if before != after:
                out.extend(_unified(before, after, name))
        given = self.before.stats.get("max_len")
        if self.training_args.get("max_length") != given:
            out += ["--- a/training arguments", "+++ b/training arguments", "@@ max_length @@",
                    f"-max_length: {given}", f"+max_length: {self.training_args.get('max_length')}"]  # fmt: skip
        if self.config_updates:
            out += ["--- a/config.json", "+++ b/config.json"]
            out += [f"@@ {key} @@\n+{key}: {json.dumps(value)}" for key, value in self.config_updates.items()]
        if self.model_changed:
            out += ["--- a/model weights", "+++ b/model weights"]
            out += [f"@@ {f.rule} @@\n {f.remedy.title}" for f in self.applied if "model" in f.remedy.changes]
        for split, stem in DATA_STEMS.items():
            if self.repair.data_changed(split):
                out.extend(_rows_diff(self.repair, split, stem + DATA_FORMATS[self.data_format]))
        return "\n".join(out) + "\n"

    # -- writing -----------------------------------------------------------------------------------------
    def save(self, out: str | os.PathLike, *, model_folder: str | os.PathLike | None = None,
             protect: tuple = ()) -> Path:  # fmt: skip
        """Write the repaired setup as a new model folder ``out`` (it must not exist, or be empty): the model's
        files, the repaired tokenizer and generation_config.json, the data when it changed (``dataset.jsonl``,
        or ``dataset.parquet`` ... in the format it was given in) and fixes.json / fixes.md. Only what changed
        is written: the files of ``model_folder`` no remedy changed (the weights, for a tokenizer or
        generation-config remedy) are hard links to the user's (copied only where the file system refuses a
        link: :attr:`written` and :attr:`link_error` say so); without a folder the model object is saved.
        With nothing changed, only fixes.json and fixes.md. Written to a sibling folder and renamed: never
        half a folder. ``protect``: the user's paths (model, tokenizer, data), which ``out`` may not be or
        lie in."""
        out = Path(out).expanduser()
        check_out(out, protect=(model_folder, *protect))
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
        self.written, self.link_error = {}, ""
        try:
            if self.changed:
                self._write_model(tmp, model_folder)
                for path in (Path(self.staging.name) / "repaired").iterdir():
                    if path.is_dir():  # a save_to_disk dataset
                        shutil.copytree(path, tmp / path.name)
                    else:
                        _replace_file(path, tmp / path.name)
                    self.written[path.name] = "written"
            (tmp / "fixes.json").write_text(
                json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
            )
            (tmp / "fixes.md").write_text(self.to_markdown(), encoding="utf-8")
            os.chmod(tmp, 0o777 & ~_umask())
            if out.exists():
                out.rmdir()  # empty (checked): the new folder takes its place
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out

    def _write_model(self, folder: Path, model_folder) -> None:
        if self.model_changed or model_folder is None:
            model = self.model
            if callable(model) and not hasattr(model, "save_pretrained"):
                model = model()  # a loader (a hub id): loaded to be saved
            if model is not None:
                model.save_pretrained(folder)
                self.written.update({p.name: "written" for p in folder.iterdir()})
        else:
            written = TOKENIZER_FILES | {"generation_config.json", "fixes.json", "fixes.md", *DATA_NAMES}
            for path in Path(model_folder).expanduser().iterdir():
                if not path.is_file() or path.name in written:
                    continue
                if path.name == "config.json" and self.config_updates:
                    continue  # written below, with the updated ids
                try:  # the user's unchanged file, not a copy of it: 140 GB of weights cost nothing
                    os.link(path, folder / path.name)  # follows a hub cache's links to its blobs
                    self.written[path.name] = "linked"
                except OSError as exc:  # another file system, or one without hard links
                    shutil.copy2(path, folder / path.name)
                    self.written[path.name] = "copied"
                    self.link_error = self.link_error or f"{type(exc).__name__}: {exc.strerror or exc}"
            source = Path(model_folder).expanduser() / "config.json"
            if self.config_updates and source.is_file():
                _replace_file(source, folder / "config.json")
        if self.config_updates and (folder / "config.json").is_file():
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            config.update(self.config_updates)
            _write_new(folder / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
            self.written["config.json"] = "written"

    def saved_summary(self, where: Path, model_folder=None) -> str:
        """What :meth:`save` wrote, in one line: the files written, and those linked to (or copied from) the
        user's folder."""
        by: dict[str, list[str]] = {}
        for name, how in sorted(self.written.items()):
            by.setdefault(how, []).append(name)
        written = sorted(
            {p.name for p in where.iterdir()} - set(by.get("linked", [])) - set(by.get("copied", []))
        )
        text = f"wrote {where}: {', '.join(written)}"
        if by.get("linked"):
            text += f"; hard-linked from {model_folder} (unchanged, no space used): {', '.join(by['linked'])}"
        if by.get("copied"):
            text += f"; copied (os.link failed, {self.link_error}): {', '.join(by['copied'])}"
        return text

    # -- reports -----------------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for outcome in self.outcomes:
            out[outcome.status] = out.get(outcome.status, 0) + 1
        return out

    def summary(self) -> str:
        counts = self.counts()
        parts = [
            f"{counts[s]} {s}" + (" (unsafe)" if s == "not applied" else "")
            for s in STATUS_STYLE
            if counts.get(s)
        ]
        errors = sum(1 for f in self.report.findings if f.severity == "error")
        verdict = (
            "every error fixed"
            if not errors
            else f"{errors} error{'s remain' if errors != 1 else ' remains'}"
        )
        if not self.outcomes:
            return "hf-sanity fix: nothing to fix"
        return f"hf-sanity fix: {', '.join(parts)}; {verdict}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "hf_sanity_version": version(),
            "summary": self.summary(),
            "unsafe_fixes": self.unsafe,
            "changes": [
                {"rule": f.rule, "finding": f.message, "remedy": f.remedy.to_dict()} for f in self.applied
            ],
            "training_args": jsonable(self.training_args),
            "outcomes": [o.to_dict() for o in self.outcomes],
            "verification": self.report.to_dict(),
        }

    def to_markdown(self) -> str:
        lines = [f"# {self.summary()}", ""]
        if self.applied:
            lines += ["## Changes", ""]
            lines += [f"- `{f.rule}` ({f.remedy.safety}): {f.remedy.title}" for f in self.applied]
            if self.training_args:
                args = ", ".join(f"`{k}={v}`" for k, v in self.training_args.items())
                lines += ["", f"Train with {args} (`SFTConfig`, or `--max-len` for `hf-sanity preflight`)."]
        else:
            lines += ["No change: no finding has a remedy to apply" + ("." if self.unsafe else
                      " (unsafe remedies need `--unsafe-fixes`).")]  # fmt: skip
        lines += [
            "",
            "## Findings after the fix",
            "",
            "| status | severity | rule | finding |",
            "|---|---|---|---|",
        ]
        for o in self.outcomes:
            message = o.finding.message.replace("|", "\\|").replace("\n", " ")
            note = f" ({o.note})" if o.note else ""
            lines.append(f"| {o.status} | {o.finding.severity} | `{o.finding.rule}` | {message}{note} |")
        remaining = [o for o in self.outcomes if o.status == "not fixed" and o.remaining]
        for o in remaining:
            lines += ["", f"### `{o.finding.rule}` remains", ""]
            lines += [f"- {f.message}" for f in o.remaining]
        lines += ["", f"Verification: {self.report.summary()}.", ""]
        linked = sorted(name for name, how in self.written.items() if how == "linked")
        if linked:
            lines += [f"Unchanged files are hard links to the original model folder's ({', '.join(linked)}): "
                      "saving a model into this folder in place would write into the original too; save "
                      "it to a new folder.", ""]  # fmt: skip
        return "\n".join(lines)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        errors = any(f.severity == "error" for f in self.report.findings)
        yield Text(self.summary(), style="bold red" if errors else "bold green")
        for outcome in self.outcomes:
            yield render_outcome(outcome)
        yield Text()
        yield Text(
            f"verification (the checks run again on the repaired copy): {self.report.summary()}", style="dim"
        )

    def print(self, console: Console | None = None) -> None:
        (console or Console()).print(self)


def render_outcome(outcome: Outcome) -> Text:
    """One finding's outcome on one line: status, severity, rule, the remedy (or the finding, without one);
    below a finding not fixed, what remains of it."""
    finding, remedy = outcome.finding, outcome.finding.remedy
    line = Text()
    line.append(f"{outcome.status:<13}", STATUS_STYLE[outcome.status])
    line.append(f"{finding.severity:<8}", SEVERITY_STYLE[finding.severity])
    line.append(finding.rule, "bold")
    if remedy is not None and outcome.status != "new":
        line.append(f"  {remedy.title}")
        line.append(f" [{remedy.safety}]", "dim")
    else:
        line.append(f"  {finding.message}")
    if outcome.note:
        line.append(f" ({outcome.note})", "dim")
    for left in outcome.remaining if outcome.status == "not fixed" else ():
        line.append("\n" + " " * 13 + "remains: ", "red")
        line.append(left.message)
        if left.evidence:
            line.append("\n" + " " * 22 + _evidence(left.evidence), "dim")
    return line


def render_diff(diff: str) -> Text:
    """A diff with its lines coloured as git colours them."""
    out = Text()
    for line in diff.splitlines():
        style = ("bold" if line.startswith(("---", "+++", "# ")) else "green" if line.startswith("+")
                 else "red" if line.startswith("-") else "cyan" if line.startswith("@@") else "")  # fmt: skip
        out.append(line + "\n", style)
    return out


def _evidence(evidence: dict) -> str:
    text = " · ".join(f"{k}={json.dumps(jsonable(v), ensure_ascii=False)}" for k, v in evidence.items())
    return text if len(text) <= 300 else text[:297] + "..."


# -- the run -----------------------------------------------------------------------------------------------
def fix(
    model=None,
    tokenizer=None,
    dataset=None,
    *,
    unsafe: bool = False,
    eval_dataset=None,
    max_len: int | None = None,
    generation_config=None,
    model_config=None,
    report: Report | str | os.PathLike | None = None,
    select=None,
    ignore=None,
    use_config: bool = True,
    data_format: str = "jsonl",
    **options: Any,
) -> Fixed:
    """Repair a fine-tuning setup and verify the repair: the remedies of ``report`` (preflight's findings on
    these objects, run here when not given) applied to copies (``unsafe``: the unsafe ones too), the checks
    run again on the copies. Returns :class:`Fixed`: the repaired tokenizer, model, dataset and generation
    config in memory, the training arguments to use (``max_length``), what changed, and per finding ``fixed``,
    ``not fixed`` or ``display only``. Your objects are not changed. ``data_format``: how changed data is
    written (:data:`DATA_FORMATS`; the CLI passes the format of the file given). ``options``: preflight's
    (``loss_on``, ``format``, ``alpaca_template``, ``task``, ``adapter``, ``inference_tokenizer``, ...).
    ``report`` may also be the path of a report's JSON (``preflight --json``, read through
    :mod:`hf_sanity.report_schema`): then only the rules whose findings there have a remedy are checked,
    before and after the repair, and the remedies are built afresh on these objects (a file holds what a
    remedy does, not the code that does it)."""
    from hf_sanity.drivers.preflight import preflight

    if tokenizer is None or dataset is None:
        raise UserInputError("fix needs a tokenizer and a dataset")
    if data_format not in DATA_FORMATS:
        raise UserInputError(f"unknown data format {data_format!r}; use one of {', '.join(DATA_FORMATS)}")
    given_model = model is not None and not (callable(model) and not hasattr(model, "forward"))
    if generation_config is None and given_model:
        generation_config = getattr(model, "generation_config", None)
    check = dict(select=select, ignore=ignore, use_config=use_config, model_config=model_config, **options)
    if report is not None and not isinstance(report, Report):
        report, check["select"] = _saved(report, select, ignore, use_config)
    if report is None:
        report = preflight(model=model, tokenizer=tokenizer, dataset=dataset, eval_dataset=eval_dataset,
                           max_len=max_len, generation_config=generation_config, **check)  # fmt: skip
    chosen = [
        f for f in report.ordered()
        if f.remedy is not None and f.remedy.applicable and (unsafe or f.remedy.safety == "safe")
    ]  # fmt: skip
    if not chosen:
        return Fixed(tokenizer, model, dataset, eval_dataset, generation_config,
                     {"max_length": max_len} if max_len else {}, report, report,
                     _outcomes(report, report, [], {}, unsafe), unsafe=unsafe)  # fmt: skip
    staging = tempfile.TemporaryDirectory(prefix="hf-sanity-fix-")
    root = Path(staging.name)
    repair = Repair(
        tokenizer=_reloaded(tokenizer, root / "original"),
        dataset=dataset,
        eval_dataset=eval_dataset,
        generation_config=copy.deepcopy(generation_config),
        model=model,
        training_args={"max_length": max_len} if max_len else {},
        options=_encode_options(dataset, max_len, options),
    )
    if generation_config is not None:
        generation_config.save_pretrained(root / "original")
    failed: dict[int, str] = {}
    for finding in chosen:
        try:
            finding.remedy.apply(repair)
        except Exception as exc:  # a remedy that breaks: said on its finding, the others still apply
            failed[id(finding)] = f"the remedy failed: {type(exc).__name__}: {exc}"
    updates = _synced_ids(repair, tokenizer)
    if updates and not repair.model_changed and model_config is not None:
        model_config = copy.deepcopy(model_config)  # the user's config object is not the copy's
        for key, value in updates.items():
            setattr(model_config, key, value)
    fixed = _staged(repair, root / "repaired", dataset, eval_dataset, data_format)
    max_length = repair.training_args.get("max_length", max_len)
    verified = preflight(
        model=repair.model if repair.model_changed else model,
        tokenizer=fixed["tokenizer"], dataset=fixed["dataset"], eval_dataset=fixed["eval_dataset"],
        max_len=max_length, generation_config=fixed["generation_config"],
        **{**check, "model_config": repair.model.config if repair.model_changed else model_config},
    )  # fmt: skip
    return Fixed(
        fixed["tokenizer"], repair.model if repair.model_changed else model, fixed["dataset"],
        fixed["eval_dataset"], fixed["generation_config"], dict(repair.training_args), report, verified,
        _outcomes(report, verified, chosen, failed, unsafe), applied=chosen, unsafe=unsafe,
        model_changed=repair.model_changed, repair=repair, staging=staging, data_format=data_format,
        config_updates={} if repair.model_changed else updates,
    )  # fmt: skip


def _synced_ids(repair: Repair, tokenizer) -> dict[str, Any]:
    """The ids the model's config and generation config keep of the tokenizer's special tokens, brought in
    line with the repaired tokenizer where a remedy changed them (a new pad token: a config.json and a
    generation_config.json still naming the old one would put it back at load or generate time). Returns the
    config.json keys to update (the model object's config is updated where a remedy changed the model)."""
    new, old = repair.tokenizer.pad_token_id, tokenizer.pad_token_id
    if new is None or new == old:
        return {}
    if repair.generation_config is not None:
        repair.generation_config.pad_token_id = new
    if repair.model_changed:
        repair.model.config.pad_token_id = new
        if getattr(repair.model, "generation_config", None) is not None:
            repair.model.generation_config.pad_token_id = new
    return {"pad_token_id": new}


def _saved(path, select, ignore, use_config: bool) -> tuple[Report | None, list[str] | None]:
    """(None, the rules to check again) for the report file at ``path``: those of its findings with a remedy
    that can be applied, within ``select``/``ignore``; (the report as read, None) when it has none."""
    from hf_sanity.report_schema import read
    from hf_sanity.selection import resolve

    saved = read(path)
    selection = resolve(select, ignore, use_config=use_config)
    rules = sorted(
        {
            f.rule
            for f in saved.findings
            if f.remedy is not None and f.remedy.safety != "display" and selection.enabled(f.rule)
        }
    )
    return (None, rules) if rules else (Report.from_record(saved), None)


def _reloaded(tokenizer, folder: Path):
    """``tokenizer`` saved to ``folder`` and loaded back: a copy of its own, as from_pretrained gives it."""
    from transformers import AutoTokenizer

    _save_tokenizer(tokenizer, folder)
    return AutoTokenizer.from_pretrained(folder)


# What from_pretrained records about where it loaded from, which save_pretrained would write into the folder.
LOADING_KWARGS = ("local_files_only", "is_local", "_commit_hash", "cache_dir", "revision")


def _save_tokenizer(tokenizer, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)`` without how it was loaded (``local_files_only``: a folder loaded
    offline would say so forever), on a shallow copy: the object given is not touched."""
    clean = copy.copy(tokenizer)
    clean.init_kwargs = {k: v for k, v in tokenizer.init_kwargs.items() if k not in LOADING_KWARGS}
    clean.save_pretrained(folder)


def _encode_options(dataset, max_len, options):
    from hf_sanity.measure.encode import EncodeOptions
    from hf_sanity.measure.formats import detect_format

    fmt = detect_format(dataset.column_names, options.get("format"), features=dataset.features)
    return EncodeOptions(fmt=fmt, loss_on=options.get("loss_on"), max_len=max_len,
                         alpaca_template=options.get("alpaca_template"))  # fmt: skip


def _staged(
    repair: Repair, folder: Path, dataset, eval_dataset, data_format: str = "jsonl"
) -> dict[str, Any]:
    """The repaired tokenizer, generation config and data written to ``folder`` and loaded back from it; the
    data in ``data_format``, with the types of the columns as given."""
    from transformers import AutoTokenizer, GenerationConfig

    from hf_sanity.measure.sources import load_dataset_ref

    _save_tokenizer(repair.tokenizer, folder)
    out = {"tokenizer": AutoTokenizer.from_pretrained(folder), "generation_config": None,
           "dataset": dataset, "eval_dataset": eval_dataset}  # fmt: skip
    if repair.generation_config is not None:
        repair.generation_config.save_pretrained(folder)
        out["generation_config"] = GenerationConfig.from_pretrained(folder)
    given = {"train": dataset, "eval": eval_dataset}
    for split, stem in DATA_STEMS.items():
        if not repair.data_changed(split):
            continue
        rows = repair.kept(split)
        if not rows:
            raise UserInputError(
                f"the remedies would drop every row of the {split} split; nothing is left to check"
            )
        path = folder / (stem + DATA_FORMATS[data_format])
        write_rows(rows, path, data_format, features=getattr(given[split], "features", None))
        out["dataset" if split == "train" else "eval_dataset"] = load_dataset_ref(str(path))
    return out


def write_rows(rows: list[dict[str, Any]], path: Path, data_format: str, *, features=None) -> None:
    """``rows`` written to ``path`` as ``data_format``: JSON lines keep NaN as NaN (Python's json and the
    datasets JSON reader both read it back as a float), the others go through a datasets.Dataset with the
    columns' ``features`` as given (Parquet keeps its types; where an edit no longer fits them, they are
    inferred)."""
    if data_format in ("jsonl", "json"):
        with open(path, "w", encoding="utf-8") as handle:
            if data_format == "json":
                json.dump([_plain(row) for row in rows], handle, ensure_ascii=False)
            else:
                for row in rows:
                    handle.write(json.dumps(_plain(row), ensure_ascii=False) + "\n")
        return
    import datasets

    try:
        data = datasets.Dataset.from_list(rows, features=features)
    except (TypeError, ValueError, KeyError):  # an edit changed a column's type: inferred from the rows
        data = datasets.Dataset.from_list(rows)
    quiet = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        if data_format == "parquet":
            data.to_parquet(str(path))
        elif data_format == "csv":
            data.to_csv(str(path), index=False)
        else:
            data.save_to_disk(str(path))
    finally:
        if quiet:
            datasets.enable_progress_bars()


def _plain(value: Any) -> Any:
    """A row's value as JSON: numpy and torch values made plain, non-finite floats kept (NaN stays NaN, not
    the string "nan" of :func:`jsonable`); dates and bytes as text."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return _plain(value.item())
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def _outcomes(before: Report, after: Report, chosen: list[Finding], failed: dict[int, str], unsafe: bool):
    remaining: dict[str, list[Finding]] = {}
    for finding in after.findings:
        remaining.setdefault(finding.rule, []).append(finding)
    applied = {id(f) for f in chosen}
    out = []
    for finding in before.ordered():
        left, remedy = remaining.get(finding.rule, []), finding.remedy
        if id(finding) in applied:
            status = "not fixed" if left or id(finding) in failed else "fixed"
            note = failed.get(id(finding), "")
        elif remedy is not None and remedy.safety == "display":
            status, note = "display only", ""
        elif remedy is not None and remedy.applicable and not unsafe and remedy.safety == "unsafe":
            status, note = "not applied", "pass --unsafe-fixes"
        elif chosen and not left:
            status, note = "fixed", "by another remedy"
        else:
            status, note = "no remedy", ""
        out.append(Outcome(finding, status, left, note))
    seen = {f.rule for f in before.findings}
    out += [
        Outcome(f, "new", [f], "a finding of the repaired copy only")
        for f in after.ordered()
        if f.rule not in seen
    ]
    return out


# -- folders -----------------------------------------------------------------------------------------------
def check_out(out: Path, *, protect=()) -> None:
    """``out`` can be written: new or empty, and not one of the user's folders or inside one. A data file's
    folder is one of the user's (a folder of data files loads every file in it: a repaired copy inside would be
    read as more data), except the working directory: ``--dataset train.jsonl --out fixed`` writes beside
    it."""
    target = out.expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserInputError(f"--out {str(out)!r} exists and is not an empty folder; pass a new folder")
    here = Path.cwd().resolve()
    for path in protect:
        if path is None or not Path(str(path)).expanduser().exists():
            continue
        mine = Path(str(path)).expanduser().resolve()
        folder = mine if mine.is_dir() else mine.parent
        if not mine.is_dir() and folder == here:
            folder = None
        if target == mine or (folder is not None and (folder == target or folder in target.parents)):
            raise UserInputError(
                f"--out {str(out)!r} is inside the folder of {str(path)!r}, one of your inputs: pass a folder "
                "outside it (hf-sanity never writes into your model or data folders)"
            )


def _write_new(path: Path, text: str) -> None:
    """``text`` as a new file at ``path``: a hard link there is removed first, so the user's file it shares
    its bytes with is never written through."""
    if path.exists() or path.is_symlink():
        path.unlink()
    path.write_text(text, encoding="utf-8")


def _replace_file(source: Path, path: Path) -> None:
    """``source`` copied to ``path``, as a new file (never written through a hard link)."""
    if path.exists() or path.is_symlink():
        path.unlink()
    shutil.copy2(source, path)


# -- diffs -------------------------------------------------------------------------------------------------
def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.is_file() else []


def _unified(before: list[str], after: list[str], name: str, context: int = 2) -> list[str]:
    """A unified diff of one file, cut to :data:`DIFF_LINES` lines. The common head and tail are skipped
    before difflib runs (a tokenizer.json of 300,000 lines, with one change)."""
    head = 0
    while head < min(len(before), len(after)) and before[head] == after[head]:
        head += 1
    tail = 0
    while tail < min(len(before), len(after)) - head and before[-1 - tail] == after[-1 - tail]:
        tail += 1
    lo = max(0, head - context)
    a, b = before[lo : len(before) - max(0, tail - context)], after[lo : len(after) - max(0, tail - context)]
    lines = list(difflib.unified_diff(a, b, f"a/{name}", f"b/{name}", n=context, lineterm=""))

    def shifted(match: re.Match) -> str:
        a0, a1, b0, b1 = match.groups()
        return f"@@ -{int(a0) + lo}{a1 or ''} +{int(b0) + lo}{b1 or ''} @@"

    lines = [re.sub(r"^@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@", shifted, line) for line in lines]
    if len(lines) > DIFF_LINES:
        lines = [*lines[:DIFF_LINES], f"... {len(lines) - DIFF_LINES} more lines of {name}"]
    return lines


def _rows_diff(repair: Repair, split: str, name: str) -> list[str]:
    """The rows of ``split`` a remedy edited (the fields that changed) or dropped, by their index as given."""
    out = [f"--- a/{name}", f"+++ b/{name}"]
    dropped = sorted(repair.dropped[split])
    rows = dropped + sorted(set(repair.edited[split]) - set(dropped))
    for i in rows[:DIFF_ROWS]:
        if i in repair.dropped[split]:
            out.append(f"@@ row {i}: dropped ({repair.dropped[split][i]}) @@")
            out.append("-" + _short(repair.original(i, split)))
            continue
        out.append(f"@@ row {i}: {repair.edited[split][i]} @@")
        old, new = repair.original(i, split), repair.rows(split)[i]
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                out.extend(_field_diff(key, old.get(key), new.get(key)))
    if len(rows) > DIFF_ROWS:
        out.append(f"... {len(rows) - DIFF_ROWS} more rows changed (fixes.json counts them)")
    return out


def _field_diff(key: str, old, new) -> list[str]:
    scalars = (int, float, str, bool, type(None))
    same_shape = isinstance(old, list) and isinstance(new, list) and len(old) == len(new)
    if same_shape and all(isinstance(v, scalars) for v in old + new):
        changed = [k for k, (a, b) in enumerate(zip(old, new)) if a != b]
        shown = [f" {key}[{k}]: {old[k]!r} -> {new[k]!r}" for k in changed[:8]]
        return shown + ([f" ... {len(changed) - 8} more positions of {key}"] if len(changed) > 8 else [])
    return [f"-{key}: {_short(old)}", f"+{key}: {_short(new)}"]


def _short(value, limit: int = 300) -> str:
    text = json.dumps(jsonable(value), ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."
