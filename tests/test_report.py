import io
import json
import os

import pytest
from rich.console import Console

from hf_sanity import Finding, Report
from hf_sanity.report import write_atomic


def sample_report() -> Report:
    report = Report(title="t")
    report.add(
        Finding(
            "duplicate-examples", "warning", "3 of 10 examples repeat an earlier one", {"count": 3}, "dedupe"
        )
    )
    report.add(
        Finding(
            "eos-not-learned",
            "error",
            "5 end-of-turn tokens carry no loss",
            {"rows": [1, 2]},
            "keep EOS",
            step=0,
        )
    )
    report.add(Finding("lr-range", "info", "suggested lr 3e-4", {"lr": float("nan")}))
    report.stats["examples"] = 10
    return report


def test_errors_first_and_exit_code():
    report = sample_report()
    assert [f.severity for f in report.ordered()] == ["error", "warning", "info"]
    assert report.has_errors and report.exit_code == 1
    assert Report().exit_code == 0


def test_json_schema():
    data = json.loads(sample_report().to_json())
    assert set(data) >= {"hf_sanity_version", "findings", "stats"}
    first = data["findings"][0]
    assert set(first) >= {"rule", "severity", "message", "evidence", "fix", "step"}
    assert first["rule"] == "eos-not-learned" and first["step"] == 0
    assert data["findings"][2]["evidence"]["lr"] == "nan"  # non-finite floats stay valid JSON
    assert data["stats"] == {"examples": 10}


def test_terminal_rendering_is_exact():
    out = io.StringIO()
    report = Report(title="t")
    report.add(
        Finding(
            "eos-not-learned", "error", "5 end-of-turn tokens carry no loss", {"rows": [1, 2]}, "keep EOS"
        )
    )
    Console(file=out, width=100, color_system=None).print(report)
    assert out.getvalue().splitlines() == [
        "t: 1 error",
        "",
        "error   eos-not-learned  5 end-of-turn tokens carry no loss",
        "        rows=[1, 2]",
        "        fix: keep EOS",
    ]


def test_write_json_is_atomic(tmp_path):
    target = tmp_path / "sub" / "report.json"
    sample_report().write_json(target)
    assert json.loads(target.read_text())["findings"]
    assert [p.name for p in target.parent.iterdir()] == ["report.json"]


def test_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    target.write_text("old")

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        write_atomic(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_the_callbacks_report_is_written_whole_without_waiting_for_the_disk(tmp_path, monkeypatch):
    """The report the callback writes inside the run: atomic for every reader, with the user's umask, and no
    fsync (it would cost the run milliseconds); what the CLI writes still waits for the disk."""
    from hf_sanity.selection import Selection
    from hf_sanity.training.sink import FindingSink

    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    sink = FindingSink(Selection())
    sink.report = sample_report()
    sink.output_dir = tmp_path / "hf-sanity"
    (sink.output_dir).mkdir()
    (sink.output_dir / "report.json").write_text("old")
    sink.write()
    assert json.loads((sink.output_dir / "report.json").read_text()) == json.loads(sink.report.to_json())
    assert synced == [] and [p.name for p in sink.output_dir.iterdir()] == ["report.json"]
    sample_report().write_json(tmp_path / "cli.json")
    assert len(synced) == 1


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_report_files_get_the_users_umask(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        written = sample_report().write_json(tmp_path / "report.json")
    finally:
        os.umask(previous)
    assert written.stat().st_mode & 0o777 == mode


def test_rewriting_a_report_keeps_its_mode(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")
    target.chmod(0o640)
    write_atomic(target, "new")
    assert target.read_text() == "new" and target.stat().st_mode & 0o777 == 0o640


def test_offending_rows_are_every_row_per_rule(tmp_path):
    report = Report()
    report.add(Finding("bad-input-values", "error", "m", {"rows": list(range(10))}, rows=list(range(25))))
    report.add(Finding("truncated-completion", "warning", "m", {"rows": [3]}, rows=[3, 40]))
    report.add(Finding("truncated-completion", "warning", "m", {"rows": [4]}, rows=[4]))
    report.add(Finding("lr-range", "info", "suggested lr 3e-4"))  # no rows: not listed
    expected = {"bad-input-values": list(range(25)), "truncated-completion": [3, 4, 40]}
    assert report.offending_rows() == expected
    assert json.loads(report.write_rows(tmp_path / "rows.json").read_text()) == expected
    assert "rows" not in report.to_dict()["findings"][0]  # the JSON report keeps its short lists


def test_finding_rejects_unknown_severity():
    with pytest.raises(ValueError):
        Finding("x", "fatal", "m")
