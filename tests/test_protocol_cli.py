"""`hf-sanity overfit` and `hf-sanity diagnose` as a user meets them: exit codes, --json, --html, --plot, the
reproduction folder and its script, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_one_line_error
from hf_sanity.testing import demo_conversations, tiny_model_dir

pytestmark = pytest.mark.slow  # subprocesses: `make test-fast` leaves them out

PNG = b"\x89PNG\r\n\x1a\n"


def run(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the tiny model is overhead-bound; 1 thread is steadier
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=300, env=env)


def cli(*args, cwd):
    return run(sys.executable, "-m", "hf_sanity.cli", *args, cwd=cwd)


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_model_dir("chatml", "distinct"))


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in demo_conversations(16)) + "\n")
    return str(path)


@pytest.fixture
def masked_file(tmp_path, model_dir):
    """Pre-tokenized rows whose labels are all -100: what a response template that never matches produces."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for row in demo_conversations(8):
        ids = tok.apply_chat_template(row["messages"])["input_ids"]
        rows.append({"input_ids": ids, "labels": [-100] * len(ids)})
    path = tmp_path / "masked.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_overfit_clean_exits_0_with_plot_json_and_html(model_dir, data_file, tmp_path):
    result = cli(
        "overfit",
        "--model",
        model_dir,
        "--dataset",
        data_file,
        "--lr",
        "1e-2",
        "--plot",
        "curve.png",
        "--json",
        "r.json",
        "--html",
        "r.html",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "near zero" in result.stdout and "verification checklist" in result.stdout
    assert (tmp_path / "curve.png").read_bytes().startswith(PNG)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["findings"] == [] and report["stats"]["overfit"]["passed"] is True
    assert report["stats"]["overfit"]["loss_final"] <= report["stats"]["overfit"]["near_zero"]
    page = (tmp_path / "r.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "data:image/png;base64," in page
    assert not (tmp_path / "hf-sanity-repro").exists()  # nothing is broken: nothing to reproduce
    # stderr is a pipe here, as in a job's log: one plain line per phase says what it is doing
    assert "hf-sanity: overfit: the first step (gradient path)\n" in result.stderr, result.stderr


def test_diagnose_broken_exits_1_names_the_layer_and_reproduces(model_dir, masked_file, tmp_path):
    before = sorted(p.name for p in Path(model_dir).iterdir())
    result = cli(
        "diagnose",
        "--model",
        model_dir,
        "--dataset",
        masked_file,
        "--json",
        "r.json",
        "--html",
        "r.html",
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "broken at layer 1 (overfit one batch): labels all masked" in " ".join(result.stdout.split())
    report = json.loads((tmp_path / "r.json").read_text())
    [finding] = report["findings"]
    assert finding["rule"] == "overfit-failed" and finding["evidence"]["cause"] == "labels-masked"
    assert [i["status"] for i in report["stats"]["checklist"] if i["layer"] > 1] == ["skipped"] * 4
    assert 'data-rule="overfit-failed"' in (tmp_path / "r.html").read_text()
    repro = report["stats"]["repro"]
    folder = Path(repro["folder"])
    assert folder.parent == tmp_path / "hf-sanity-repro" and (folder / "batch.safetensors").is_file()
    assert repro["diagnose"].startswith("hf-sanity diagnose --model ")
    # nothing was written into the model folder
    assert sorted(p.name for p in Path(model_dir).iterdir()) == before
    replay = run(sys.executable, str(folder / "reproduce.py"), cwd=tmp_path)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "0 label positions carry loss" in replay.stdout
    assert "hf-sanity: layer 1 of" in result.stderr, result.stderr  # one line per phase where stderr is piped


def test_bad_example_count_is_one_line(model_dir, data_file, tmp_path):
    assert_one_line_error(
        cli("overfit", "--model", model_dir, "--dataset", data_file, "--n", "50", cwd=tmp_path),
        "--n must be between 2 and 10",
    )


def test_lora_targets_that_match_nothing_are_one_line(model_dir, data_file, tmp_path):
    result = cli(
        "diagnose",
        "--model",
        model_dir,
        "--dataset",
        data_file,
        "--lora-r",
        "4",
        "--lora-target",
        "c_attn",
        cwd=tmp_path,
    )
    assert_one_line_error(result, "cannot attach the LoRA adapter")


def test_alpaca_rows_are_read_with_the_template_asked_for(model_dir, tmp_path):
    """overfit/diagnose read Alpaca rows as preflight does, with --alpaca-template; a bad value is one line."""
    from transformers import AutoTokenizer

    from hf_sanity.protocol.build import build
    from hf_sanity.protocol.options import ProtocolOptions

    rows = [{"instruction": f"Name a colour ({i}).", "input": "", "output": "Blue."} for i in range(8)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    for template, marker in (("text", "### Instruction:"), ("chat", "<|im_start|>user")):
        pipeline = build(model=object(), tokenizer=tok, dataset=rows,
                         options=ProtocolOptions(n=2, alpaca_template=template))  # fmt: skip
        assert marker in tok.decode(pipeline.batches[0]["input_ids"][0])
    path = tmp_path / "alpaca.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    bad = cli(
        "overfit", "--model", model_dir, "--dataset", str(path), "--alpaca-template", "markdown", cwd=tmp_path
    )
    assert_one_line_error(bad, "alpaca")


@pytest.mark.planted("overfit-failed")
def test_an_adapter_too_small_for_the_examples_is_named_capacity(model_dir, tmp_path):
    """LoRA rank 1 on q_proj only (256 of 202,304 weights): step 1 at the adapter's fixed LR (1e-3) gets nowhere,
    steps 2 and 3 pass, step 4 finds no LR that helps, and the same examples with every weight trainable do get
    there: the verdict is capacity, with the numbers. The search cuts runs once their loss falls too slowly;
    the LR with the best loss then trains the whole --steps (it used to stop at 51 of 100 and advise more)."""
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in demo_conversations(24)) + "\n")
    out = tmp_path / "r.json"
    result = cli("overfit", "--model", model_dir, "--dataset", str(data), "--steps", "60", "--n", "10",
                 "--lora-r", "1", "--lora-target", "q_proj", "--json", str(out), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(out.read_text())
    [finding] = [f for f in report["findings"] if f["rule"] == "overfit-failed"]
    evidence = finding["evidence"]
    assert evidence["cause"] == "capacity" and evidence["adapter"] == "LoRA r=1 on q_proj"
    assert evidence["trainable_elements"] == 256 and evidence["total_elements"] > 200_000
    assert evidence["step1"]["lr"] == 1e-3
    relaxed = evidence["all_weights_trainable"]
    assert relaxed["best_loss"] < 0.1 * evidence["loss_best"]  # every weight trainable: nearly all the way
    assert "raise the LoRA rank" in finding["fix"]
    stats = report["stats"]["overfit"]
    runs = stats["lr_search"]["tried"]
    assert any(run["steps"] < 60 for run in runs)  # the search did cut runs short
    assert not stats["passed"] and stats["steps_run"] == stats["step_budget"] == 60
    assert [run["steps"] for run in runs if run["lr"] == pytest.approx(stats["lr"], rel=1e-3)] == [60]
    assert "init_loss" in report["stats"] and "masks" in report["stats"]  # steps 2 and 3 ran before the LR
    shown = " ".join(result.stdout.split())
    assert "the trainable share is too small" in shown and "capacity: 256 of 202,304 weights train" in shown
