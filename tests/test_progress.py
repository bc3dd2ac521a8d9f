"""Progress on long work: the CLI on a terminal says what it is doing (loading, tokenizing, each check, the
model's passes, the overfit's runs); piped, or from Python, it says nothing extra and its outputs stay clean."""

from __future__ import annotations

import io
import json
import sys

import pytest

from helpers import cli, cli_on_terminal
from hf_sanity import progress
from hf_sanity.testing import demo_conversations, tiny_model_dir

PREFLIGHT_PHASES = ("loading the tokenizer", "loading the dataset", "tokenizing 40 rows", "running checks",
                    "loading the model", "model: loss on")  # fmt: skip


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in demo_conversations(40)) + "\n")
    return path


# -- the module ------------------------------------------------------------------------------------------
def test_phases_show_on_an_enabled_display_and_nothing_once_disabled():
    from rich.console import Console

    screen = Terminal()
    console = Console(file=screen, force_terminal=True, width=120)
    assert progress.enable(console, enabled=True) and progress.active()
    try:
        with progress.phase("outer work", total=3):
            for item in progress.each(["a", "b", "c"], detail=lambda x: f"item {x}"):
                with progress.phase(f"inner {item}"):
                    pass
    finally:
        progress.disable()
    shown = screen.getvalue()
    for text in ("outer work", "inner a", "inner c", "outer work: item b"):
        assert text in shown, shown
    assert not progress.active()
    before = screen.getvalue()
    with progress.phase("after"):
        progress.advance()
        progress.describe("x")
    assert screen.getvalue() == before


def test_only_a_terminal_on_the_main_process_wants_progress(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert progress.wanted(Terminal()) is True
    assert progress.wanted(io.StringIO()) is False  # piped, redirected to a file, captured
    monkeypatch.setenv("RANK", "1")  # torchrun's other ranks share the terminal: rank 0 alone draws
    assert progress.wanted(Terminal()) is False
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TERM", "dumb")
    assert progress.wanted(Terminal()) is False


def test_a_broken_display_never_breaks_the_work():
    from rich.console import Console

    class Broken(Terminal):
        def write(self, text):
            raise OSError("the terminal went away")

    progress.enable(Console(file=Broken(), force_terminal=True), enabled=True)
    try:
        done = []
        with progress.phase("work", total=2):
            for x in progress.each([1, 2], detail=str):
                done.append(x)
    finally:
        progress.disable()
    assert done == [1, 2]


def test_the_python_api_prints_nothing_even_on_a_terminal(monkeypatch, capsys):
    """From Python nothing turns a display on: a preflight on a terminal stderr prints no phase."""
    import datasets

    from hf_sanity.drivers.preflight import preflight
    from hf_sanity.testing import tiny_setup

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    model, tok = tiny_setup("chatml", "distinct")
    report = preflight(
        model=model,
        tokenizer=tok,
        dataset=datasets.Dataset.from_list(demo_conversations(16)),
        use_config=False,
    )
    assert not report.by_rule("internal-error")
    captured = capsys.readouterr()
    for text in ("tokenizing", "running checks", "model: loss"):
        assert text not in screen.getvalue() + captured.out + captured.err
    assert not progress.active()


# -- the command line ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_preflight_on_a_terminal_shows_its_phases_and_the_report_stays_on_stdout(data_file, tmp_path):
    model = tiny_model_dir("chatml", "distinct")
    code, out, shown = cli_on_terminal(
        "preflight", "--model", model, "--dataset", data_file, "--json", tmp_path / "r.json"
    )
    assert code == 0, out + shown
    for phase in PREFLIGHT_PHASES:
        assert phase in shown, (phase, shown[-2000:])
    assert "running checks: init-loss-off-chance" in shown  # the check that runs is named
    assert out.startswith("hf-sanity preflight") and not any(p in out for p in PREFLIGHT_PHASES)
    assert json.loads((tmp_path / "r.json").read_text())["stats"]["examples"] == 40


@pytest.mark.slow
def test_preflight_piped_shows_no_progress(data_file, tmp_path):
    model = tiny_model_dir("chatml", "distinct")
    result = cli("preflight", "--model", model, "--dataset", data_file, "--json", tmp_path / "r.json")
    assert result.returncode == 0, result.stdout + result.stderr
    for phase in PREFLIGHT_PHASES:
        assert phase not in result.stderr + result.stdout
    assert result.stderr.strip() == ""
    assert json.loads((tmp_path / "r.json").read_text())["stats"]["examples"] == 40


@pytest.mark.slow
def test_overfit_on_a_terminal_shows_the_lr_search_and_its_runs(data_file, tmp_path):
    model = tiny_model_dir("chatml", "distinct")
    code, out, shown = cli_on_terminal(
        "overfit", "--model", model, "--dataset", data_file, "--steps", "60", "--json", tmp_path / "r.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert code in (0, 1), out + shown
    for phase in ("loading the model", "overfit: the first step", "LR range test", "LR search: lr "):
        assert phase in shown, (phase, shown[-2000:])
    assert "hf-sanity overfit" in out and "LR range test" not in out
    assert json.loads((tmp_path / "r.json").read_text())["stats"]["overfit"]["lr_chosen_by"] == "search"


@pytest.mark.slow
def test_diagnose_on_a_terminal_names_each_layer(data_file, tmp_path):
    model = tiny_model_dir("chatml", "distinct")
    code, out, shown = cli_on_terminal(
        "diagnose", "--model", model, "--dataset", data_file, "--lr", "1e-2", "--steps", "150", cwd=tmp_path
    )  # 150: near zero (0.05) takes ~80 steps at 1e-2; short of it, layer 1 would be broken and 5 not run
    assert code in (0, 1), out + shown
    for layer in ("layer 1 of 5: overfit one batch", "overfit at lr 0.01", "layer 4 of 5", "layer 5 of 5"):
        assert layer in shown, (layer, shown[-2000:])
    assert "hf-sanity diagnose" in out and "layer 1 of 5" not in out
