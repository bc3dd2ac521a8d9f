"""Token ids the model's embedding has no row for (a tokenizer grown past the model, no resize): the checks that
run the model on them are skipped with `checks-skipped` naming vocab-size-mismatch, never an `internal-error`
from a forward of hf-sanity's; the run's own crash is the user's, unchanged, with no hf-sanity frame in it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from dist import tinytrain as tt

from helpers import cli
from hf_sanity.drivers.preflight import preflight
from hf_sanity.launch import tracebacks

SCRIPT = Path(__file__).parent / "dist" / "launched.py"
PROBE_RULES = {"init-loss-off-chance", "future-token-leak"}  # the first batch's forwards


@pytest.fixture
def probes(monkeypatch) -> list[int]:
    """The rows of every probe forward the callback runs (its step-0 and predictions probes)."""
    from hf_sanity.training import probe

    calls, real = [], probe.probe

    def counted(model, batch, **kwargs):
        calls.append(int(batch["input_ids"].shape[0]))
        return real(model, batch, **kwargs)

    monkeypatch.setattr(probe, "probe", counted)
    return calls


def printed_frames(stderr: str) -> list[str]:
    """The `File ..., in NAME` lines of the last traceback printed, without line numbers (torch's Module.__call__
    runs another branch of itself while a hook is registered)."""
    lines = stderr[stderr.rindex("Traceback") :].splitlines()
    return [re.sub(r", line \d+,", ",", line) for line in lines if line.startswith('  File "')]


def skipped_for_vocab(findings) -> set[str]:
    (skipped,) = [f for f in findings if f.rule == "checks-skipped"]
    assert skipped.severity == "info" and skipped.evidence["needs"] == "vocab-size-mismatch"
    return set(skipped.evidence["skipped"])


@pytest.mark.planted("vocab-size-mismatch", "checks-skipped")
def test_preflight_on_ids_past_the_embedding_skips_the_model_checks(tmp_path):
    trainer = tt.vocab_beyond_trainer(tmp_path / "out")
    model, tok, rows = trainer.model, trainer.processing_class, trainer.train_dataset.to_list()
    report = preflight(model, tok, rows, format="tokens", use_config=False)
    assert "internal-error" not in {f.rule for f in report.findings}
    (mismatch,) = report.by_rule("vocab-size-mismatch")
    assert mismatch.severity == "error" and mismatch.evidence["max_token_id"] == 1000
    assert mismatch.evidence["embedding_rows"] == 1000 and len(mismatch.evidence["rows"]) == 10
    assert skipped_for_vocab(report.findings) >= PROBE_RULES


@pytest.mark.planted("vocab-size-mismatch", "checks-skipped")
def test_the_callback_skips_its_probe_and_the_users_crash_is_theirs(tmp_path, probes):
    from hf_sanity import SanityCallback

    plain = tt.vocab_beyond_trainer(tmp_path / "plain", max_steps=2)
    with pytest.raises(IndexError) as without:
        plain.train()
    cb = SanityCallback(use_config=False, print_findings=False)
    watched = tt.vocab_beyond_trainer(tmp_path / "watched", callbacks=[cb], max_steps=2)
    with pytest.raises(IndexError) as caught:
        watched.train()
    assert type(caught.value) is IndexError and str(caught.value) == str(without.value)
    assert cb.report.by_rule("internal-error") == [] and probes == []  # no forward of hf-sanity's on the ids
    (mismatch,) = cb.report.by_rule("vocab-size-mismatch")
    assert mismatch.severity == "error" and mismatch.evidence["max_token_id"] == 1000
    assert skipped_for_vocab(cb.report.findings) >= PROBE_RULES
    # The traceback the launch path prints: the user's frames, none of hf-sanity's wrappers.
    tracebacks.clean(caught.value)
    shown = [(Path(f.filename).name, f.name) for f in traceback.extract_tb(caught.value.__traceback__)]
    plain_frames = [
        (Path(f.filename).name, f.name) for f in traceback.extract_tb(without.value.__traceback__)
    ]
    # torch's own `inner` frame is the path Module.__call__ takes while a forward hook is registered (the
    # callback's, on the model): torch's frame, not hf-sanity's; every other frame is the plain run's.
    assert [frame for frame in shown if frame != ("module.py", "inner")] == plain_frames
    assert not any("hf_sanity" in f.filename for f in traceback.extract_tb(caught.value.__traceback__))


@pytest.mark.clean("checks-skipped")
def test_ids_inside_the_embedding_are_probed(tmp_path, probes):
    from hf_sanity import SanityCallback

    cb = SanityCallback(use_config=False, print_findings=False)
    tt.trainer(tmp_path / "out", callbacks=[cb], max_steps=2).train()
    assert cb.report.by_rule("checks-skipped") == [] and cb.report.by_rule("internal-error") == []
    assert cb.report.by_rule("vocab-size-mismatch") == []
    assert probes and probes[0] == 4  # the step-0 probe ran on the first batch's rows


@pytest.mark.slow
@pytest.mark.planted("vocab-size-mismatch")
def test_under_run_the_printed_traceback_is_the_commands_own(tmp_path):
    command = [sys.executable, str(SCRIPT), "vocab-beyond"]
    plain = subprocess.run([*command, str(tmp_path / "plain")], capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)  # fmt: skip
    run = cli(
        "run", "--json", tmp_path / "r.json", "--", *command, tmp_path / "run", cwd=tmp_path, timeout=600
    )
    assert plain.returncode == run.returncode == 1, run.stderr[-3000:]
    shown, theirs = printed_frames(run.stderr), printed_frames(plain.stderr)
    assert not any("hf_sanity" in line for line in shown)
    assert run.stderr.strip().splitlines()[-1] == plain.stderr.strip().splitlines()[-1]  # the same error line
    assert [line for line in shown if not line.endswith(", in inner")] == theirs  # (torch's hook path: above)
    report = json.loads((tmp_path / "r.json").read_text())
    rules = {f["rule"] for f in report["findings"]}
    assert "vocab-size-mismatch" in rules and "internal-error" not in rules
