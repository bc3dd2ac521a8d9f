"""The report as a file: one typed model of the JSON every command writes (``--json``, SanityCallback's
``output_dir/hf-sanity/report.json``), the one reader of it (``doctor`` reads the callback's, ``fix`` a
preflight's), and the JSON Schema generated from it (docs/report.schema.json, `make docs`).

Versions (``schema_version``, an integer raised whenever a field changes meaning or a required one is added):

* 0: the reports written before the field existed (no ``schema_version``). Read: what is missing gets its
  default, and a finding of another shape is left out and counted (:attr:`ReportRecord.left_out`), since the
  shape of a finding varied between those versions.
* 1: the shape of version 0, with ``schema_version``. Read strictly: a field of the wrong type, a missing
  one or one the schema does not know makes the file malformed.

A newer version, or a malformed file, is refused with one line (:class:`UserInputError`, exit 2): read with a
guess it would be misread silently.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hf_sanity.errors import UserInputError
from hf_sanity.jsonvalues import jsonable
from hf_sanity.remedies import SAFETIES, TARGETS

SCHEMA_VERSION = 1
READABLE_VERSIONS = range(SCHEMA_VERSION + 1)

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = typing.get_args(Severity)
Safety = Literal[SAFETIES]
Target = Literal[TARGETS]


def doc(text: str, **schema: Any) -> dict[str, Any]:
    """A field's description (and extra JSON Schema keywords) for the generated schema."""
    return {"doc": text, "schema": schema}


@dataclass
class RemedyRecord:
    """The repair `hf-sanity fix` can make for a finding (hf_sanity.remedies.Remedy without its code)."""

    title: str = field(metadata=doc("What the remedy does, in one line."))
    safety: Safety = field(
        metadata=doc("safe: applied by default; unsafe: with --unsafe-fixes; display: shown")
    )
    changes: list[Target] = field(metadata=doc("What the remedy edits."))
    detail: dict[str, Any] = field(metadata=doc("Its particulars (the rows it drops, the template it uses)."))

    @classmethod
    def from_remedy(cls, remedy: Any) -> RemedyRecord:
        return cls(remedy.title, remedy.safety, list(remedy.changes), jsonable(remedy.detail))


@dataclass
class FindingRecord:
    """One finding: which rule, how bad, the key number, the evidence, and the fix."""

    rule: str = field(metadata=doc("The rule's slug (`hf-sanity explain SLUG`)."))
    severity: Severity = field(metadata=doc("How bad it is."))
    message: str = field(metadata=doc("What is wrong, with its key number."))
    evidence: dict[str, Any] = field(metadata=doc("The measurements behind the verdict (JSON values)."))
    fix: str = field(metadata=doc("How to fix it, in words (empty when the rule has none)."))
    step: int | None = field(metadata=doc("The training step it was found at (null: before training)."))
    example: str | None = field(default=None, metadata=doc("The first offending example, as plain text."))
    side_by_side: list[dict[str, Any]] | None = field(
        default=None,
        metadata=doc("A generated output's columns (prompt, generation, reference) per example."),
    )
    remedy: RemedyRecord | None = field(default=None, metadata=doc("What `hf-sanity fix` can do about it."))

    @classmethod
    def from_finding(cls, finding: Any) -> FindingRecord:
        """The record of a :class:`hf_sanity.findings.Finding` (its example rendered as text)."""
        example = finding.example
        return cls(
            rule=finding.rule,
            severity=finding.severity,
            message=finding.message,
            evidence=jsonable(finding.evidence),
            fix=finding.fix,
            step=finding.step,
            example=example.plain() if example is not None else None,
            side_by_side=jsonable(example.data()) if hasattr(example, "data") else None,
            remedy=RemedyRecord.from_remedy(finding.remedy) if finding.remedy is not None else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return to_json_value(self)


@dataclass(kw_only=True)
class ReportRecord:
    """A report of hf-sanity as written to JSON: its findings (errors first), what was not checked (notes),
    what it shows besides (views) and its figures (stats)."""

    schema_version: int = field(
        metadata=doc("The version of this schema the file follows.", const=SCHEMA_VERSION)
    )
    hf_sanity_version: str = field(metadata=doc("The hf-sanity that wrote it."))
    title: str = field(metadata=doc("Which command wrote it (hf-sanity preflight, hf-sanity doctor, ...)."))
    findings: list[FindingRecord] = field(
        metadata=doc("Every finding, errors first, then warnings, then info.")
    )
    notes: list[str] = field(metadata=doc("What was not checked, and why, one line each."))
    views: list[Any] | None = field(
        default=None, metadata=doc("What the report shows besides its findings (show's decoded batch, ...).")
    )
    stats: dict[str, Any] = field(metadata=doc("Figures of the run (counts, seconds, what was read)."))
    # Findings of a version-0 file that were of another shape and so left out (not part of the file).
    left_out: int = field(default=0, repr=False, compare=False, metadata={"internal": True})

    @classmethod
    def from_report(cls, report: Any) -> ReportRecord:
        from hf_sanity.version import __version__

        return cls(
            schema_version=SCHEMA_VERSION,
            hf_sanity_version=__version__,
            title=report.title,
            findings=[FindingRecord.from_finding(f) for f in report.ordered()],
            notes=list(report.notes),
            views=[jsonable(view.data()) for view in report.views] if report.views else None,
            stats=jsonable(report.stats),
        )

    def to_dict(self) -> dict[str, Any]:
        return to_json_value(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: Any, source: str = "the report") -> ReportRecord:
        """Read a report's JSON value: version 0 or :data:`SCHEMA_VERSION`; anything else is refused with one
        line naming ``source``, what is wrong and what to do."""
        if not isinstance(data, dict):
            raise _malformed(source, "the report", "is not a JSON object")
        version = data.get("schema_version", 0)
        if type(version) is not int:
            raise _malformed(source, "schema_version", f"is {json.dumps(version)}, not an integer")
        if version < 0:
            raise _malformed(source, "schema_version", f"is {version}, not a version")
        if version not in READABLE_VERSIONS:
            writer = data.get("hf_sanity_version")
            by = f" (written by hf-sanity {writer})" if isinstance(writer, str) else ""
            raise UserInputError(
                f"cannot read {source}: its report schema version is {version}{by}, this hf-sanity reads "
                f"versions {READABLE_VERSIONS[0]} to {READABLE_VERSIONS[-1]}; upgrade hf-sanity to read it"
            )
        if version == SCHEMA_VERSION:
            return decode(cls, data, source, "")
        return _read_version_0(data, source)


def _read_version_0(data: dict[str, Any], source: str) -> ReportRecord:
    """A report written before schema_version: the same fields, each with its default where missing; its
    findings of the known shape (FindingRecord, unknown keys ignored), the others left out and counted."""
    findings = data.get("findings", [])
    if not isinstance(findings, list):
        raise _malformed(source, "findings", "is not a list")
    kept: list[FindingRecord] = []
    known = {f.name for f in dataclasses.fields(FindingRecord)}
    for raw in findings:
        try:
            if not isinstance(raw, dict):
                raise UserInputError("not an object")
            kept.append(
                decode(
                    FindingRecord, {"step": None, **{k: v for k, v in raw.items() if k in known}}, source, ""
                )
            )
        except UserInputError:
            continue
    upgraded = {
        "schema_version": SCHEMA_VERSION,
        "hf_sanity_version": data.get("hf_sanity_version") or "unknown",
        "title": data.get("title") or "hf-sanity",
        "findings": [],
        "notes": data.get("notes", []),
        "stats": data.get("stats", {}),
        **({"views": data["views"]} if data.get("views") is not None else {}),
    }
    record = decode(ReportRecord, upgraded, source, "")
    record.findings = kept
    record.left_out = len(findings) - len(kept)
    return record


def read(path: str | Path, what: str = "report") -> ReportRecord:
    """The report file at ``path``; a missing, unreadable, malformed or too new one is bad input (one line)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserInputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserInputError(
            f"cannot read {what} {path}: malformed JSON ({exc.msg} at line {exc.lineno}); "
            "restore the file as it was written or remove it"
        ) from None
    return ReportRecord.from_dict(data, f"{what} {path}")


# -- one definition, three uses: writing, reading, the JSON Schema ------------------------------------------
@functools.cache  # resolving the hints compiles each annotation: once a class, not at every report written
def _fields(cls: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls) if not f.metadata.get("internal"))


def _optional(f: dataclasses.Field) -> bool:
    """Written only when set: a field whose default is None."""
    return f.default is None


def to_json_value(record: Any) -> Any:
    """A record as JSON values, fields in their declared order; an optional field that is None is left out."""
    if dataclasses.is_dataclass(record):
        return {
            f.name: to_json_value(getattr(record, f.name))
            for f, _ in _fields(type(record))
            if not (_optional(f) and getattr(record, f.name) is None)
        }
    if isinstance(record, list):
        return [to_json_value(v) for v in record]
    return record


def _malformed(source: str, where: str, what: str) -> UserInputError:
    return UserInputError(
        f"cannot read {source}: it is not a report of this schema ({where} {what}); pass the JSON that "
        "hf-sanity wrote, unedited"
    )


def _describe(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def decode(kind: Any, value: Any, source: str, where: str) -> Any:
    """``value`` checked against type ``kind`` (a record class, list[...], dict[str, ...], a Literal, X | None,
    str, int, float, bool, Any); records are built, the rest returned as it is."""
    here = where or "the report"
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return value
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise _malformed(source, here, "is not an object")
        known = {f.name: (f, hint) for f, hint in _fields(kind)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise _malformed(source, f"{where}.{unknown[0]}" if where else unknown[0], "is not a field")
        built = {}
        for name, (f, hint) in known.items():
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if name not in value:
                if required:
                    raise _malformed(source, f"{where}.{name}" if where else name, "is missing")
                continue
            built[name] = decode(hint, value[name], source, f"{where}.{name}" if where else name)
            const = f.metadata.get("schema", {}).get("const")
            if const is not None and built[name] != const:
                raise _malformed(source, name, f"is {_describe(value[name])}, not {const}")
        return kind(**built)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return decode(inner[0], value, source, where)
    if origin is Literal:
        if value not in args:
            raise _malformed(source, here, f"is {_describe(value)}, not one of {', '.join(map(str, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise _malformed(source, here, f"is {_describe(value)}, not a list")
        return [decode(args[0], v, source, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _malformed(source, here, f"is {_describe(value)}, not an object")
        return {k: decode(args[1], v, source, f"{where}.{k}") for k, v in value.items()}
    expected = {str: (str,), int: (int,), float: (int, float), bool: (bool,)}[kind]
    if not isinstance(value, expected) or (kind is not bool and isinstance(value, bool)):
        raise _malformed(source, here, f"is {_describe(value)}, not {JSON_TYPES[kind]}")
    return value


JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a report file of :data:`SCHEMA_VERSION`, from the records' types."""
    defs: dict[str, Any] = {}

    def of(kind: Any) -> dict[str, Any]:
        origin, args = typing.get_origin(kind), typing.get_args(kind)
        if kind is Any:
            return {}
        if dataclasses.is_dataclass(kind):
            if kind.__name__ not in defs:
                defs[kind.__name__] = {}  # reserved first: a record may refer to itself
                defs[kind.__name__] = record(kind)
            return {"$ref": f"#/$defs/{kind.__name__}"}
        if origin in (typing.Union, types.UnionType):
            inner = [a for a in args if a is not type(None)]
            return {"anyOf": [of(inner[0]), {"type": "null"}]}
        if origin is Literal:
            return {"enum": list(args)}
        if origin is list:
            return {"type": "array", "items": of(args[0])}
        if origin is dict:
            return {"type": "object", "additionalProperties": of(args[1])}
        return {"type": JSON_TYPES[kind]}

    def record(kind: type) -> dict[str, Any]:
        properties, required = {}, []
        for f, hint in _fields(kind):
            meta = f.metadata.get("schema", {})
            properties[f.name] = {"description": f.metadata.get("doc", ""), **of(hint), **meta}
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required.append(f.name)
        return {
            "type": "object",
            "description": " ".join((kind.__doc__ or "").split()),
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }

    top = record(ReportRecord)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"hf-sanity report, schema version {SCHEMA_VERSION}",
        **top,
        "$defs": dict(sorted(defs.items())),
    }


def render_schema() -> str:
    """docs/report.schema.json's text."""
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"
