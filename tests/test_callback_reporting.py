"""How a SanityCallback run goes on record, through real Trainer runs: the hf_sanity/<rule> counters in the
logs Trainer keeps (log_history, trainer_state.json) and in a real logger's files (TensorBoard), the stop at
the first error said once and recorded, and findings printed on lines of their own above tqdm's bar."""

from __future__ import annotations

import json
import re

import pytest
from dist import tinytrain as tt

from hf_sanity.callback import SanityCallback

NAN_STEP = 3  # tt.embeds_collator(..., 3): the third batch holds a NaN


def nan_run(output_dir, *, callback_kwargs=None, **overrides):
    """A tiny run whose third batch holds a NaN, watched by a SanityCallback; returns (trainer, callback)."""
    model, tok = tt.setup()
    kwargs = {"check_every": 5, "probe_every": 5, "use_config": False, "print_findings": False}
    callback = SanityCallback(**{**kwargs, **(callback_kwargs or {})})
    trainer = tt.trainer(
        output_dir, callbacks=[callback], model=model, tok=tok, collator=tt.embeds_collator(tok, model, NAN_STEP),
        **overrides,
    )  # fmt: skip
    trainer.train()
    assert not callback.report.by_rule("internal-error"), callback.report.by_rule("internal-error")
    return trainer, callback


def segments(text: str) -> list[str]:
    """What a terminal shows as lines: tqdm redraws its bar after a carriage return."""
    return [part.strip() for part in re.split(r"[\r\n]", text)]


# -- the counters in the logs Trainer keeps and in a real logger ----------------------------------------
@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    pytest.importorskip("tensorboard")
    out = tmp_path_factory.mktemp("logged")
    trainer, callback = nan_run(
        out / "run", callback_kwargs={"select": ["nonfinite-loss"]}, max_steps=6, logging_steps=1,
        report_to=["tensorboard"],
    )  # fmt: skip
    trainer.save_state()
    return out, trainer, callback


def test_counters_reach_trainer_state_json(logged_run):
    out, trainer, callback = logged_run
    assert [f.rule for f in callback.report.findings] == ["nonfinite-loss"]
    history = json.loads((out / "run" / "trainer_state.json").read_text())["log_history"]
    steps = [h for h in history if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5, 6]
    counted = {h["step"]: h.get("hf_sanity/nonfinite-loss") for h in steps}
    assert counted == {1: None, 2: None, 3: 1, 4: 1, 5: 1, 6: 1}  # from the step it fired, every log
    assert history[-1]["hf_sanity/nonfinite-loss"] == 1  # the end-of-training summary too
    assert [sorted(h) for h in trainer.state.log_history] == [sorted(h) for h in history]


def test_counters_reach_tensorboard_at_their_step(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, _ = logged_run
    folders = {p.parent for p in out.rglob("events.out.tfevents.*")}
    assert len(folders) == 1, folders
    events = EventAccumulator(str(folders.pop()))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "train/loss" in tags
    counter = [(e.step, e.value) for e in events.Scalars("train/hf_sanity/nonfinite-loss")]
    assert counter[0] == (NAN_STEP, 1.0)  # the logger saw it at the step the NaN happened, not later
    assert {step for step, _ in counter} >= {3, 4, 5, 6}


# -- abort_on="error": said once, recorded in the report and in trainer.state ---------------------------
def test_abort_says_why_once_and_records_the_step(tmp_path, capsys):
    trainer, callback = nan_run(
        tmp_path / "out", callback_kwargs={"abort_on": "error", "print_findings": True}, max_steps=12,
        logging_steps=5,
    )  # fmt: skip
    assert trainer.state.global_step == NAN_STEP
    assert trainer.state.hf_sanity_aborted_at_step == NAN_STEP
    stats = callback.report.stats
    assert (stats["aborted_at_step"], stats["aborted_by"]) == (NAN_STEP, "nonfinite-loss")
    assert stats["abort_reason"].startswith(f"nonfinite-loss @ step {NAN_STEP}: the loss is nan")
    written = json.loads((tmp_path / "out" / "hf-sanity" / "report.json").read_text())
    assert written["stats"]["aborted_at_step"] == NAN_STEP
    assert written["stats"]["aborted_by"] == "nonfinite-loss"
    said = [line for line in segments(capsys.readouterr().err) if "stopping training" in line]
    assert len(said) == 1, said
    assert said[0].startswith(f'hf-sanity: stopping training after step {NAN_STEP} (abort_on="error"): ')
    assert "nonfinite-loss @ step 3" in said[0] and "report.json" in said[0]
    # The stop survives save_to_json: the summary log Trainer keeps carries it.
    trainer.save_state()
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    assert history[-1]["hf_sanity/aborted_at_step"] == NAN_STEP and "train_loss" in history[-1]


def test_a_run_that_is_not_stopped_says_so(tmp_path, capsys):
    trainer, callback = nan_run(tmp_path / "out", callback_kwargs={"abort_on": "never"}, max_steps=5)
    assert trainer.state.global_step == 5 and callback.report.by_rule("nonfinite-loss")
    assert trainer.state.hf_sanity_aborted_at_step is None
    assert "aborted_at_step" not in callback.report.stats
    assert not any("hf_sanity/aborted_at_step" in h for h in trainer.state.log_history)
    assert "stopping training" not in capsys.readouterr().err


# -- printing above the progress bar ---------------------------------------------------------------------
def test_findings_print_on_lines_of_their_own_above_the_progress_bar(tmp_path, capsys):
    _, callback = nan_run(
        tmp_path / "out", callback_kwargs={"print_findings": True, "check_every": 2}, max_steps=8,
        disable_tqdm=False, logging_steps=4,
    )  # fmt: skip
    err = capsys.readouterr().err
    assert "it/s]" in err or "s/it]" in err  # tqdm's bar was drawn on this stream
    found = callback.report.findings
    assert found and {f.rule for f in found} >= {"nonfinite-loss"}
    lines = segments(err)
    for finding in found:
        head = f"{finding.severity:<8}{finding.rule} @ step {finding.step}"
        whole = [line for line in lines if line.startswith(head)]
        assert len(whole) == 1, (head, [line for line in lines if finding.rule in line and "step" in line])
        assert err.count(head) == 1  # printed once, whatever the steps and reads that followed


def test_counters_touch_only_the_entry_of_this_log():
    """A log Trainer did not keep (a subclass's own log()) leaves the last kept entry as it was."""
    from types import SimpleNamespace

    from hf_sanity.selection import Selection
    from hf_sanity.training import outcome
    from hf_sanity.training.sink import FindingSink

    sink = FindingSink(Selection())
    sink.counts["nonfinite-loss"] = 1
    loss = float("nan")
    kept = {"loss": loss, "step": 4}
    state = SimpleNamespace(global_step=4, log_history=[{"loss": 1.0, "step": 3}, kept])
    logs = {"loss": loss}
    outcome.log_counts(sink, state, logs)  # Trainer's own copy of these logs: updated (a NaN is itself)
    assert kept["hf_sanity/nonfinite-loss"] == 1 and logs["hf_sanity/nonfinite-loss"] == 1
    other = {"my_metric": 0.5}
    outcome.log_counts(sink, state, other)  # a log Trainer did not keep: only the logs get the counters
    assert other["hf_sanity/nonfinite-loss"] == 1 and "my_metric" not in kept
    assert state.log_history[0] == {"loss": 1.0, "step": 3}
    assert not sink.report.findings  # nothing broke


def test_a_finding_with_a_side_by_side_view_crosses_to_another_rank_and_back():
    """Under DDP a rank's findings travel as plain data (`ranks.portable`) and the main process rebuilds them:
    an output check's finding carries a side-by-side view, which stays behind like a token view does."""
    from hf_sanity.findings import Finding
    from hf_sanity.outputview import OutputExample, OutputView
    from hf_sanity.training.ranks import portable

    view = OutputView(
        "never stops", (OutputExample.of(0, [("prompt", "Hi"), ("generation", "Hello Hello")]),)
    )
    finding = Finding(rule="never-stops", severity="error", message="m", example=view, step=3)
    assert "side_by_side" in finding.to_dict()
    rebuilt = Finding(**portable(finding))
    assert (rebuilt.rule, rebuilt.step, rebuilt.example) == ("never-stops", 3, None)


@pytest.mark.internal_error_expected
def test_a_check_guarded_again_inside_its_own_guard_is_timed_once(monkeypatch):
    """stats.callback_seconds_by_check: on_log's "callback-trl-metrics" guard holds ObjectiveFeed.log's own guard
    of that name; its seconds are the outer block's (once), and another check inside it keeps its own."""
    from hf_sanity.selection import Selection
    from hf_sanity.training import sink as sinks

    now = [0.0]
    monkeypatch.setattr(sinks, "perf_counter", lambda: now[0])
    sink = sinks.FindingSink(Selection())
    for _ in range(2):
        with sink.guard("callback-trl-metrics"):
            now[0] += 1.0
            with sink.guard("callback-trl-metrics"):
                now[0] += 2.0
            with sink.guard("callback-read"):
                now[0] += 4.0
    assert sink.timings == {"callback-trl-metrics": 14.0, "callback-read": 8.0}
    with sink.guard("callback-trl-metrics"), sink.guard("callback-trl-metrics"):
        raise ValueError("broken inside")  # the inner guard reports it; both close
    assert sink.open_checks == set() and [f.rule for f in sink.report.findings] == ["internal-error"]
