"""The command line as a user meets it: exit codes, one-line errors, JSON output."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_one_line_error, cli, extractive_qa
from hf_sanity.testing import demo_conversations, tiny_model_dir

pytestmark = pytest.mark.slow  # subprocesses: `make test-fast` leaves them out


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_model_dir("chatml", "distinct"))


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in demo_conversations(24)) + "\n")
    return str(path)


def test_rules_lists_the_catalog():
    result = cli("rules")
    assert result.returncode == 0
    assert "prompt-in-loss" in result.stdout and "eos-not-learned" in result.stdout


def test_explain_prints_one_rule():
    result = cli("explain", "eos-not-learned")
    assert result.returncode == 0 and "pad == EOS" in result.stdout


def test_explain_unknown_slug():
    result = cli("explain", "nope")
    assert_one_line_error(result, "unknown rule 'nope'", "`hf-sanity rules` lists")
    assert "did you mean" not in result.stderr  # nothing is close: no guess


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("stop-token", "'stop-token-mismatch'"),
        ("prompt-in-los", "'prompt-in-loss'"),
        ("eos-not-lerned", "'eos-not-learned'"),
    ],
)
def test_explain_a_near_slug_says_did_you_mean(typed, meant):
    assert_one_line_error(cli("explain", typed), f"unknown rule '{typed}'", f"did you mean {meant}")


def test_clean_preflight_exits_0_and_writes_json(model_dir, data_file, tmp_path):
    out = tmp_path / "report.json"
    # `messages` rows whose run trains the answers only (TRL's default, every token, is a prompt-in-loss warning)
    result = cli(
        "preflight", "--model", model_dir, "--dataset", data_file, "--max-len", "128", "--json", str(out),
        "--loss-on", "completion",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert [f for f in report["findings"] if f["severity"] != "info"] == []
    assert report["stats"]["examples"] == 24
    # Where the time went: loading, the scan, the model (loaded only for the model checks), the checks.
    phases = report["stats"]["seconds_by_phase"]
    assert list(phases) == ["load", "setup", "scan", "model_load", "checks"]
    assert phases["model_load"] > 0 and phases["scan"] > 0
    assert sum(phases.values()) - phases["load"] <= report["stats"]["seconds"] + 0.05


def test_errors_exit_1(model_dir, data_file, tmp_path):
    out = tmp_path / "r.json"
    result = cli(
        "preflight", "--model", model_dir, "--dataset", data_file, "--max-len", "12", "--json", str(out)
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "truncated-completion" in {f["rule"] for f in json.loads(out.read_text())["findings"]}


def test_ignore_silences_a_rule(model_dir, data_file):
    result = cli("preflight", "--model", model_dir, "--dataset", data_file, "--max-len", "12",
                 "--ignore", "truncated-completion,empty-loss-mask")  # fmt: skip
    assert result.returncode == 0, result.stdout
    assert "truncated-completion" not in result.stdout


def test_missing_dataset(model_dir, tmp_path):
    assert_one_line_error(cli("preflight", "--model", model_dir, "--dataset", str(tmp_path / "nope.jsonl")),
                          "does not exist")  # fmt: skip


# The CLI run through a wrapper that says, after the command exits, which heavy libraries it imported.
IMPORTS_AFTER = (
    "import runpy, sys\n"
    "sys.argv = ['hf-sanity', *sys.argv[1:]]\n"
    "try:\n    runpy.run_module('hf_sanity.cli', run_name='__main__')\n"
    "except SystemExit as exc:\n    code = exc.code\n"
    "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))\n"
    "sys.exit(code)\n"
)


MISSING = ("nope.jsonl", "does not exist")


@pytest.mark.parametrize(
    "command, bad, needle",
    [
        (["preflight"], *MISSING),
        (["preflight"], "rows.txt", "unknown file type '.txt'"),
        (["preflight"], "empty.jsonl", "is empty"),
        (["show"], *MISSING),
        (["fix", "--diff"], *MISSING),
        (["outputs"], *MISSING),
        (["overfit"], *MISSING),
        (["diagnose"], *MISSING),
        (
            ["served", "--base", "M", "--adapter", "no-adapter"],
            "nope.jsonl",
            "adapter 'no-adapter' is not a folder",
        ),
    ],
)
def test_bad_paths_are_one_line_before_torch_or_transformers_is_imported(model_dir, tmp_path, command, bad,
                                                                          needle):  # fmt: skip
    """A missing dataset file, a file of an unknown type, an empty one (served: a missing adapter folder): one
    line and exit 2, told from the file system alone, before torch, transformers or datasets are imported (they
    take seconds to import)."""
    (tmp_path / "rows.txt").write_text("a row\n")
    (tmp_path / "empty.jsonl").write_text("")
    args = [model_dir if a == "M" else a for a in command]
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS_AFTER, *args, "--model", model_dir, "--dataset", str(tmp_path / bad)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert_one_line_error(result, needle)
    if command[0] != "served":
        assert f"dataset {str(tmp_path / bad)!r}" in result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_a_missing_model_folder_is_one_line_before_torch_is_imported(tmp_path, data_file):
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS_AFTER, "preflight", "--model", str(tmp_path / "nomodel"), "--dataset",
         data_file],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert_one_line_error(result, f"model {str(tmp_path / 'nomodel')!r} does not exist")
    assert result.stdout.strip() == "[]", result.stdout


def test_malformed_dataset(model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [\n')
    assert_one_line_error(
        cli("preflight", "--model", model_dir, "--dataset", str(bad)), "cannot read dataset"
    )


def test_unknown_columns(model_dir, tmp_path):
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"question": "a", "answer": "b"}\n')
    assert_one_line_error(cli("preflight", "--model", model_dir, "--dataset", str(odd)), "--format")


def test_model_folder_without_weights(tmp_path, data_file):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert_one_line_error(cli("preflight", "--model", str(folder), "--dataset", data_file), "has no weights")


def test_unknown_select(model_dir, data_file):
    assert_one_line_error(cli("preflight", "--model", model_dir, "--dataset", data_file, "--select", "nope"),
                          "unknown rule or stage 'nope'")  # fmt: skip
    assert_one_line_error(cli("preflight", "--model", model_dir, "--dataset", data_file, "--ignore", "loss-spik"),
                          "unknown rule or stage 'loss-spik'", "did you mean 'loss-spike'")  # fmt: skip


def test_usage_errors_are_one_line_too(model_dir):
    assert_one_line_error(cli("preflight", "--model", model_dir), "Missing option '--dataset'",
                          "preflight --help")  # fmt: skip
    assert_one_line_error(cli("preflight", "--bogus"), "No such option: --bogus")
    assert_one_line_error(cli("nosuch"), "No such command 'nosuch'", " --help)")


def test_nothing_written_into_the_model_folder(model_dir, data_file, tmp_path):
    from pathlib import Path

    before = sorted(p.name for p in Path(model_dir).iterdir())
    cli("preflight", "--model", model_dir, "--dataset", data_file, "--json", str(tmp_path / "r.json"))
    assert sorted(p.name for p in Path(model_dir).iterdir()) == before


def test_demo_shows_clean_and_broken(tmp_path):
    """`make demo`'s command: both setups shown, and nothing of it left in the temporary folder."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = cli("demo", env={"TMPDIR": str(scratch)})
    assert result.returncode == 0, result.stdout + result.stderr
    # torch's compile cache (torchinductor_<user>) is created by importing torch._dynamo, for any program
    # that imports transformers' Trainer: a per-user cache that is reused, not the demo's leftovers.
    left = [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == [], left
    assert "the demo's files were written under" in result.stdout
    for slug in (
        "prompt-in-loss",
        "eos-not-learned",
        "truncated-completion",
        "nonfinite-loss",
        "overfit-failed",
    ):
        assert slug in result.stdout
    assert "cause: unsafe-math" in result.stdout
    assert "demo: the correct setup is clean, the broken one is caught" in result.stdout


def test_html_report_page(model_dir, data_file, tmp_path):
    page = tmp_path / "report.html"
    result = cli(
        "preflight", "--model", model_dir, "--dataset", data_file, "--max-len", "12", "--html", str(page)
    )
    assert result.returncode == 1
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and 'data-rule="truncated-completion"' in text


def test_missing_adapter_folder(model_dir, data_file, tmp_path):
    assert_one_line_error(
        cli("preflight", "--model", model_dir, "--dataset", data_file, "--adapter", str(tmp_path / "nope")),
        "is not a folder",
    )


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.mark.planted("label-leakage")
def test_task_extractive_turns_label_leakage_off(model_dir, tmp_path):
    rows = extractive_qa(20)
    rows[5] = {**rows[5], "prompt": rows[5]["prompt"] + rows[5]["completion"]}  # the answer pasted at the end
    data = _jsonl(tmp_path / "qa.jsonl", rows)
    out = tmp_path / "r.json"
    result = cli(
        "preflight", "--model", model_dir, "--dataset", data, "--select", "label-leakage", "--json", out
    )
    (finding,) = json.loads(out.read_text())["findings"]
    assert finding["evidence"]["rows"] == [5] and finding["evidence"]["quoted_spans"] == 19, result.stdout
    result = cli("preflight", "--model", model_dir, "--dataset", data, "--select", "label-leakage",
                 "--task", "extractive", "--json", out)  # fmt: skip
    assert result.returncode == 0 and json.loads(out.read_text())["findings"] == [], result.stdout
    assert_one_line_error(cli("preflight", "--model", model_dir, "--dataset", data, "--task", "quoting"),
                          "--task must be one of generative, extractive")  # fmt: skip


def test_sharegpt_alpaca_and_json_strings_from_files(model_dir, tmp_path):
    """The formats people have, from the files they have them in: ShareGPT JSONL, Alpaca JSONL, a CSV whose
    `messages` cells are JSON strings; each is read, and the report says how."""
    rows = demo_conversations(24)
    sharegpt = [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                    "value": m["content"]} for m in r["messages"]]} for r in rows]  # fmt: skip
    alpaca = [{"instruction": f"{r['messages'][-2]['content']} ({i})", "input": "",
               "output": r["messages"][-1]["content"]} for i, r in enumerate(rows)]  # fmt: skip
    table = tmp_path / "train.csv"
    with table.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerows([["messages"], *([json.dumps(r["messages"])] for r in rows)])
    out = tmp_path / "r.json"
    cases = [
        (_jsonl(tmp_path / "sharegpt.jsonl", sharegpt), [], {"format": "sharegpt", "read_as": "messages"}),
        (_jsonl(tmp_path / "sharegpt.jsonl", sharegpt), ["--format", "sharegpt"], {"roles": {
            "gpt": "assistant", "human": "user", "system": "system"}}),
        (_jsonl(tmp_path / "alpaca.jsonl", alpaca), [], {"format": "alpaca", "alpaca_template": "chat"}),
        (_jsonl(tmp_path / "alpaca.jsonl", alpaca), ["--alpaca-template", "text"], {"alpaca_template": "text"}),
        (str(table), [], {"format": "messages", "json_columns": ["messages"]}),
    ]  # fmt: skip
    for data, options, stats in cases:
        # the loss on the answers, as these runs train (TRL's default for conversations would warn prompt-in-loss)
        result = cli("preflight", "--model", model_dir, "--dataset", data, "--select", "data,tokens",
                     "--loss-on", "completion", "--json", out, *options)  # fmt: skip
        report = json.loads(out.read_text())
        assert result.returncode == 0 and report["findings"] == [], result.stdout + result.stderr
        assert stats.items() <= report["stats"].items(), report["stats"]
    assert_one_line_error(
        cli("preflight", "--model", model_dir, "--dataset", str(table), "--alpaca-template", "md"),
        "--alpaca-template must be 'chat' or 'text'",
    )


def test_a_typo_in_the_model_path_says_so(model_dir, data_file, tmp_path):
    """Not a folder here, and not fetchable as a hub id: said in words, not the hub library's disk cache."""
    result = cli("preflight", "--model", "my-modle", "--dataset", data_file, cwd=tmp_path)
    assert_one_line_error(result, "model 'my-modle': there is no file or folder", "HF_HUB_OFFLINE is set")
    assert "outgoing traffic" not in result.stderr
    result = cli("preflight", "--model", model_dir, "--tokenizer", "org/tokenizr", "--dataset", data_file)
    assert_one_line_error(result, "tokenizer 'org/tokenizr': there is no file or folder")


def test_a_model_folder_without_tokenizer_files_points_to_tokenizer(model_dir, data_file, tmp_path):
    import shutil

    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(model_dir) / name, folder / name)
    result = cli("preflight", "--model", folder, "--dataset", data_file)
    assert_one_line_error(
        result, "model folder", "has no tokenizer files (tokenizer.json", "pass --tokenizer"
    )
    result = cli("preflight", "--model", folder, "--tokenizer", model_dir, "--dataset", data_file)
    assert result.returncode == 0, result.stdout + result.stderr


def test_malformed_jsonl_names_the_line(model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    rows = [json.dumps(r) for r in demo_conversations(4)]
    bad.write_text("\n".join([*rows[:2], '{"messages": [oops]}', *rows[2:]]) + "\n")
    assert_one_line_error(
        cli("preflight", "--model", model_dir, "--dataset", bad), "line 3 is not valid JSON (Expecting value"
    )


def test_one_long_row_under_a_large_max_len(model_dir, tmp_path):
    """The truncated-completion message of one very long row: how many rows exceed max_len and what dropping
    or raising costs, never a suggestion to "raise" max_len to less than it is."""
    rows = demo_conversations(24)
    rows.append({"messages": [{"role": "user", "content": "Count."},
                              {"role": "assistant", "content": " ".join(["one two three"] * 600)}]})  # fmt: skip
    data = _jsonl(tmp_path / "long.jsonl", rows)
    result = cli("preflight", "--model", model_dir, "--dataset", data, "--max-len", "1024",
                 "--select", "truncated-completion")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr  # one row of 25 is a warning
    text = " ".join(result.stdout.split())
    assert "max_len=1,024 cuts into the completion of 1 of 25 examples (4.0%)" in text
    assert "Drop or split the 1 example longer than max_len" in text and "or raise max_len to" in text
    assert "Raise max_len to the suggested value" not in text and "keeps 99%" not in text


@pytest.mark.parametrize("command", ["preflight", "doctor", "overfit", "diagnose", "rules"])
def test_help_is_readable_at_80_columns(command):
    """Every option name in full, no line past the terminal: `--inference-toke…` helps nobody."""
    import typer

    from hf_sanity.cli import app

    click_command = typer.main.get_command(app).commands[command]
    shown = [param for param in click_command.params if not getattr(param, "hidden", False)]
    names = [name for param in shown for name in (*param.opts, *param.secondary_opts)]
    result = cli(command, "--help", env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    words = set(result.stdout.replace(",", " ").split())
    assert [name for name in names if name.startswith("-") and name not in words] == []
    assert max(map(len, result.stdout.splitlines())) <= 80 and "…" not in result.stdout


def test_rows_out_lists_every_offending_row_with_the_users_umask(model_dir, data_file, tmp_path):
    import os

    rows_file, report_file = tmp_path / "rows.json", tmp_path / "report.json"
    previous = os.umask(0o002)  # the child process inherits it
    try:
        result = cli("preflight", "--model", model_dir, "--dataset", data_file, "--max-len", "12",
                     "--rows-out", rows_file, "--json", report_file)  # fmt: skip
    finally:
        os.umask(previous)
    assert result.returncode == 1, result.stdout + result.stderr
    rows, report = json.loads(rows_file.read_text()), json.loads(report_file.read_text())
    truncated = next(f for f in report["findings"] if f["rule"] == "truncated-completion")
    assert len(rows["truncated-completion"]) == truncated["evidence"]["cut"] > 10  # the report shows ten
    assert rows["truncated-completion"][:10] == truncated["evidence"]["rows"]
    assert report["stats"]["rows_file"] == str(rows_file)
    assert {p.stat().st_mode & 0o777 for p in (rows_file, report_file)} == {0o664}


def test_a_file_that_is_not_utf8_is_one_line_naming_the_byte(model_dir, tmp_path):
    """A JSONL saved as Latin-1: pyarrow's JSON reader takes the bytes in silently and raised deep inside it
    later; preflight and outputs say which byte, once."""
    rows = demo_conversations(24)
    rows[3]["messages"][-1]["content"] += " Café au lait."
    data = tmp_path / "latin1.jsonl"
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    data.write_bytes(text.encode("latin-1"))
    offset = text.encode("latin-1").index(b"\xe9")
    for command in ("preflight", "outputs"):
        assert_one_line_error(
            cli(command, "--model", model_dir, "--dataset", data),
            f"dataset '{data}' is not UTF-8: byte {offset} (line 4) is 0xe9",
        )


def test_no_progress_bar_on_redirected_stderr(model_dir, tmp_path):
    """README: progress shows on a terminal only; 5,000 rows used to draw datasets' bar into a redirected
    stderr."""
    from hf_sanity.testing import synthetic_conversations

    data = _jsonl(tmp_path / "big.jsonl", synthetic_conversations(5200, words=4))
    result = cli("preflight", "--model", model_dir, "--dataset", data, "--select", "data,tokens")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == "" and "examples=5200" in result.stdout.replace(",", "")


def test_ignore_model_needs_no_weights(model_dir, data_file, tmp_path):
    """A folder with the config and tokenizer only (weights not downloaded yet): the data, token and template
    checks run with the model stage ignored; without --ignore the missing weights are the one-line error."""
    folder = tmp_path / "no-weights"
    folder.mkdir()
    for path in Path(model_dir).iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    out = tmp_path / "r.json"
    result = cli("preflight", "--model", folder, "--dataset", data_file, "--ignore", "model", "--json", out,
                 "--loss-on", "completion")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["findings"] == [] and report["notes"] == [] and report["stats"]["examples"] == 24
    result = cli(
        "preflight", "--model", folder, "--dataset", data_file, "--max-len", "12", "--ignore", "model"
    )
    assert result.returncode == 1 and "truncated-completion" in result.stdout  # the other checks did run
    assert_one_line_error(cli("preflight", "--model", folder, "--dataset", data_file), "has no weights")
