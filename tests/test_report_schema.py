"""The report as a file: written with ``schema_version`` through one typed model (hf_sanity.report_schema), read
back through it by `doctor` and `fix`; a report of version 0 (no ``schema_version``) is read, a newer or a
malformed one is refused with one line; docs/report.schema.json is generated from the same model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import datasets
import numpy as np
import pytest

from helpers import assert_one_line_error, cli
from hf_sanity.errors import UserInputError
from hf_sanity.findings import Finding
from hf_sanity.remedies import Remedy
from hf_sanity.report import Report
from hf_sanity.report_schema import SCHEMA_VERSION, ReportRecord, read, render_schema
from hf_sanity.testing import demo_conversations, tiny_setup

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_FILE = ROOT / "docs" / "report.schema.json"


# -- a JSON Schema validator for the keywords the generated schema uses (jsonschema is not a dependency) ----
def violations(value, schema: dict, root: dict | None = None, where: str = "$") -> list[str]:
    root = schema if root is None else root
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        return violations(value, root["$defs"][name], root, where)
    out: list[str] = []
    if "anyOf" in schema and all(violations(value, s, root, where) for s in schema["anyOf"]):
        out.append(f"{where}: matches none of anyOf")
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        out.append(f"{where}: {value!r} != {schema['const']!r}")
    kind = schema.get("type")
    checks = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "string": lambda v: isinstance(v, str), "null": lambda v: v is None,
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool)}  # fmt: skip
    if kind is not None and not checks[kind](value):
        return [*out, f"{where}: {value!r} is not of type {kind}"]
    if kind == "object":
        properties = schema.get("properties", {})
        out += [f"{where}: {key} is missing" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in properties:
                out += violations(item, properties[key], root, f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                out.append(f"{where}: {key} is not a property")
            elif isinstance(schema.get("additionalProperties"), dict):
                out += violations(item, schema["additionalProperties"], root, f"{where}.{key}")
    if kind == "array" and "items" in schema:
        for i, item in enumerate(value):
            out += violations(item, schema["items"], root, f"{where}[{i}]")
    return out


def committed_schema() -> dict:
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def test_the_committed_schema_is_the_generated_one():
    assert SCHEMA_FILE.read_text(encoding="utf-8") == render_schema(), (
        "docs/report.schema.json is stale: run `make docs`"
    )
    schema = committed_schema()
    assert schema["properties"]["schema_version"]["const"] == SCHEMA_VERSION
    assert schema["$defs"]["FindingRecord"]["properties"]["severity"]["enum"] == ["error", "warning", "info"]


# -- writing and reading ----------------------------------------------------------------------------------
def rich_report() -> Report:
    """A report with every optional part: a token-view example, remedies of each kind, a step, a view,
    numpy and non-finite values in evidence and stats."""
    from hf_sanity.tokenview import TokenView

    _, tok = tiny_setup("chatml", "distinct")
    ids = tok("hello world")["input_ids"]
    report = Report(title="hf-sanity preflight", notes=["model checks: skipped (no model)"])
    report.add(
        Finding(
            "eos-not-learned",
            "error",
            "5 end-of-turn tokens carry no loss",
            {"rows": (1, 2)},
            "keep EOS",
            example=TokenView.from_ids(tok, ids, [-100] * len(ids), title="row 1"),
            remedy=Remedy(
                "add the end-of-turn id",
                "safe",
                ("generation-config",),
                apply=lambda r: None,
                detail={"ids": np.array([3, 4])},
            ),
        )
    )
    report.add(Finding("lr-too-low", "warning", "updates are 1e-9", {"ratio": np.float32(1e-9)}, step=40,
                       remedy=Remedy("raise it", "display", ("training-args",))))  # fmt: skip
    report.add(Finding("lr-range", "info", "suggested lr", {"lr": float("nan")}))
    report.stats.update(examples=np.int64(10), seconds={"scan": 0.5})
    report.views.append(ClassTable())
    return report


class ClassTable:
    """A view as doctor's per-class table is one: its rows for the JSON."""

    def data(self):
        return [{"class": "positive", "count": np.int64(3)}]


def test_a_report_is_written_with_its_schema_version_and_read_back_as_written():
    report = rich_report()
    data = json.loads(report.to_json())
    assert data["schema_version"] == SCHEMA_VERSION and list(data)[:2] == [
        "schema_version",
        "hf_sanity_version",
    ]
    assert violations(data, committed_schema()) == []
    record = ReportRecord.from_dict(data, "a test report")
    assert record.to_dict() == data  # the round trip is exact
    assert record.findings[0].remedy.detail == {"ids": [3, 4]} and record.findings[0].example.startswith(
        "row 1"
    )
    again = Report.from_record(record)
    assert [(f.rule, f.severity, f.message, f.evidence, f.fix, f.step) for f in again.ordered()] == [
        (f.rule, f.severity, f.message, f.evidence, f.fix, f.step) for f in report.ordered()
    ]
    # A remedy's code stays with the process that found it; a display-only one has none and is kept.
    assert [f.remedy and f.remedy.safety for f in again.ordered()] == [None, "display", None]
    assert again.notes == report.notes and again.stats == {"examples": 10, "seconds": {"scan": 0.5}}
    assert record.views == [[{"class": "positive", "count": 3}]]


def version_0(data: dict) -> dict:
    """The same report as hf-sanity wrote it before schema_version existed."""
    return {k: v for k, v in data.items() if k != "schema_version"}


def test_a_report_of_version_0_is_read_and_a_finding_of_another_shape_is_left_out_and_counted():
    data = version_0(json.loads(rich_report().to_json()))
    record = ReportRecord.from_dict(data)
    assert record.to_dict() == {"schema_version": SCHEMA_VERSION, **data} and record.left_out == 0
    # An older writer: fewer fields, a finding without a step and one of a shape this version does not know.
    old = {"title": "hf-sanity training", "stats": {}, "findings": [
        {"rule": "lr-too-low", "severity": "warning", "message": "m", "evidence": {}, "fix": "f", "extra": 1},
        {"rule": "loss-flat"},
    ]}  # fmt: skip
    record = ReportRecord.from_dict(old)
    assert [(f.rule, f.step) for f in record.findings] == [("lr-too-low", None)] and record.left_out == 1
    assert (record.hf_sanity_version, record.notes) == ("unknown", [])


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            lambda d: d.update(schema_version=SCHEMA_VERSION + 1),
            f"its report schema version is {SCHEMA_VERSION + 1} (written by hf-sanity",
        ),
        (lambda d: d.update(schema_version="1"), 'schema_version is "1", not an integer'),
        (
            lambda d: d["findings"][0].update(severity="fatal"),
            'findings[0].severity is "fatal", not one of error, warning, info',
        ),
        (lambda d: d["findings"][1].pop("message"), "findings[1].message is missing"),
        (lambda d: d.update(colour="red"), "colour is not a field"),
        (lambda d: d["findings"][0]["remedy"].update(safety="maybe"), "findings[0].remedy.safety"),
        (lambda d: d.update(findings={}), "findings is {}, not a list"),
    ],
    ids=["newer", "version-not-int", "severity", "missing", "unknown-field", "remedy-safety", "not-a-list"],
)
def test_a_newer_or_malformed_report_is_refused_with_one_line(tmp_path, change, needle):
    data = json.loads(rich_report().to_json())
    change(data)
    assert violations(data, committed_schema()) != [] or data["schema_version"] != SCHEMA_VERSION
    path = tmp_path / "report.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserInputError) as caught:
        read(path)
    message = str(caught.value)
    assert message.startswith(f"cannot read report {path}: ") and needle in message and "\n" not in message


def test_a_report_that_is_not_json_or_not_a_report_is_refused(tmp_path):
    (tmp_path / "cut.json").write_text('{"findings": [')
    with pytest.raises(UserInputError, match="malformed JSON"):
        read(tmp_path / "cut.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(UserInputError, match="the report is not a JSON object"):
        read(tmp_path / "list.json")


def test_the_json_of_a_real_preflight_run_follows_the_schema():
    from hf_sanity.drivers.preflight import preflight

    model, tok = tiny_setup("chatml", "distinct")
    rows = demo_conversations(24)
    rows[5] = copy.deepcopy(rows[4])  # a duplicate: a finding with rows and a remedy
    report = preflight(model=model, tokenizer=tok, dataset=datasets.Dataset.from_list(rows), use_config=False)
    assert "duplicate-examples" in report.rules()
    data = json.loads(report.to_json())
    assert data["schema_version"] == SCHEMA_VERSION
    assert violations(data, committed_schema()) == []
    assert any("remedy" in f for f in data["findings"])  # the optional parts were there to be checked
    assert ReportRecord.from_dict(data).to_dict() == data
    data["findings"][0]["step"] = "0"  # the validator does tell
    assert violations(data, committed_schema()) == [
        "$.findings[0].step: matches none of anyOf",
    ]


# -- fix reads a report -------------------------------------------------------------------------------------
def stop_token_setup():
    """A base tokenizer's end of text with a ChatML template: stop-token-mismatch, with a safe remedy."""
    model, tok = tiny_setup("chatml", "distinct")
    model, tok = copy.deepcopy(model), copy.deepcopy(tok)
    tok.eos_token, tok.pad_token = "<|endoftext|>", "<|pad|>"
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    return model, tok, datasets.Dataset.from_list(demo_conversations(32))


def test_fix_reads_a_report_file_and_checks_again_only_the_rules_it_has_remedies_for(tmp_path):
    """preflight --json, then fix with that file: the remedies built afresh for the rules the file has one for
    (stop-token-mismatch), the rules without one (prompt-in-loss, the loss on every token) not run again."""
    import hf_sanity

    model, tok, data = stop_token_setup()
    setup = dict(model=model, tokenizer=tok, dataset=data, loss_on="all", use_config=False)
    report = hf_sanity.preflight(**setup)
    assert report.rules() == {"stop-token-mismatch", "prompt-in-loss"}
    assert report.by_rule("prompt-in-loss")[0].remedy is None
    path = report.write_json(tmp_path / "report.json")
    fixed = hf_sanity.fix(**setup, report=path)
    assert [(o.finding.rule, o.status) for o in fixed.outcomes] == [("stop-token-mismatch", "fixed")]
    assert fixed.changed and fixed.report.findings == [] and fixed.exit_code == 0

    # A version-0 file is read the same way; one of a newer version is refused before anything runs.
    saved = json.loads(path.read_text())
    (tmp_path / "old.json").write_text(json.dumps(version_0(saved)))
    old = hf_sanity.fix(**setup, report=tmp_path / "old.json")
    assert [(o.finding.rule, o.status) for o in old.outcomes] == [("stop-token-mismatch", "fixed")]
    (tmp_path / "new.json").write_text(json.dumps({**saved, "schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(UserInputError, match="upgrade hf-sanity"):
        hf_sanity.fix(**setup, report=tmp_path / "new.json")


def test_fix_on_a_report_without_applicable_remedies_changes_nothing(tmp_path):
    import hf_sanity

    model, tok, data = stop_token_setup()
    saved = json.loads(rich_report().to_json())
    for finding in saved["findings"]:
        finding.pop("remedy", None)
    (tmp_path / "r.json").write_text(json.dumps(saved))
    fixed = hf_sanity.fix(
        model=model, tokenizer=tok, dataset=data, report=tmp_path / "r.json", use_config=False
    )
    assert not fixed.changed and {o.status for o in fixed.outcomes} == {"no remedy"}
    assert [f.rule for f in fixed.before.ordered()] == ["eos-not-learned", "lr-too-low", "lr-range"]


# -- doctor reads SanityCallback's report through the schema ------------------------------------------------
def run_with_callback_report(folder: Path, report: dict) -> Path:
    """A finished run (its trainer_state.json) and the report SanityCallback left beside it."""
    folder.mkdir(parents=True)
    history = [{"step": s, "loss": 2.0 * 0.99**s, "learning_rate": 1e-4} for s in range(1, 60)]
    (folder / "trainer_state.json").write_text(json.dumps({"log_history": history, "global_step": 59}))
    (folder / "hf-sanity").mkdir()
    (folder / "hf-sanity" / "report.json").write_text(json.dumps(report))
    return folder


LR_TOO_LOW = {"rule": "lr-too-low", "severity": "warning", "message": "updates are 1e-9 of the weights",
              "evidence": {"update_ratio": 1e-9}, "fix": "Raise the learning rate.", "step": 40}  # fmt: skip


def callback_report(**extra) -> dict:
    return {"hf_sanity_version": "0.3.0", "title": "hf-sanity training", "findings": [LR_TOO_LOW], "notes": [],
            "stats": {}, **extra}  # fmt: skip


def test_doctor_reads_a_version_0_callback_report_and_says_what_it_left_out(tmp_path):
    from hf_sanity.drivers.doctor import doctor

    run = run_with_callback_report(
        tmp_path / "run", {**callback_report(), "findings": [LR_TOO_LOW, {"rule": 1}]}
    )
    report = doctor([run], use_config=False)
    (low,) = report.by_rule("lr-too-low")
    assert (low.evidence["source"], low.step) == ("SanityCallback", 40)
    assert report.notes == [
        f"{run}: 1 finding(s) of {run / 'hf-sanity' / 'report.json'} have a shape this hf-sanity does not know "
        "(an older one wrote the file) and were left out"
    ]


@pytest.mark.slow
def test_cli_doctor_reads_an_old_report_and_refuses_a_newer_one_in_one_line(tmp_path):
    old = run_with_callback_report(tmp_path / "old", callback_report())
    out = tmp_path / "doctor.json"
    result = cli("doctor", old, "--json", out, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr  # a warning: exit 0
    assert "lr-too-low" in result.stdout and "SanityCallback" in result.stdout
    written = json.loads(out.read_text())
    assert written["schema_version"] == SCHEMA_VERSION and violations(written, committed_schema()) == []
    assert [f["rule"] for f in written["findings"]] == ["lr-too-low"]

    newer = run_with_callback_report(tmp_path / "newer", callback_report(schema_version=SCHEMA_VERSION + 1))
    assert_one_line_error(
        cli("doctor", newer, cwd=tmp_path, timeout=120),
        f"cannot read SanityCallback report {newer / 'hf-sanity' / 'report.json'}",
        f"schema version is {SCHEMA_VERSION + 1} (written by hf-sanity 0.3.0)",
        "upgrade hf-sanity",
    )
    broken = run_with_callback_report(
        tmp_path / "broken", callback_report(schema_version=SCHEMA_VERSION, findings=[{"rule": "lr-too-low"}])
    )
    assert_one_line_error(cli("doctor", broken, cwd=tmp_path, timeout=120), "findings[0].severity is missing")


def test_hf_sanity_launch_reads_a_processs_report_json_through_the_schema():
    """`hf-sanity launch` falls back to the JSON a launched process sent when it cannot unpickle its report
    (another hf-sanity there): read through the schema, and one it cannot read is said, not misread."""
    from hf_sanity.launch.command import from_json

    data = json.loads(rich_report().to_json())
    report = from_json(data)
    assert [f.rule for f in report.ordered()] == ["eos-not-learned", "lr-too-low", "lr-range"]
    assert report.by_rule("lr-too-low")[0].step == 40 and report.notes == data["notes"]
    unreadable = from_json({**data, "schema_version": SCHEMA_VERSION + 1})
    assert unreadable.findings == [] and "upgrade hf-sanity" in unreadable.notes[0]
    assert from_json({}).findings == []  # a process that sent no report
