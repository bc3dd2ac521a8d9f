"""SanityCallback under torchrun: 2 processes, gloo, CPU (tests/dist/ddp_run.py). No deadlock; a NaN on one
rank is reported at its step with that rank, in one report written by the main process; replicas that
bypass DDP and drift apart are ranks-diverged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import sft_online_detectors, torchrun

pytestmark = pytest.mark.slow  # subprocesses: `make test-fast` leaves them out

SCRIPT = Path(__file__).parent / "dist" / "ddp_run.py"


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    result = torchrun(SCRIPT, out)
    assert result.returncode == 0, result.stderr[-3000:]
    (out / "stderr.txt").write_text(result.stderr)  # both ranks' (torchrun passes them through)
    return out


def findings(path: Path) -> list[tuple]:
    data = json.loads(path.read_text())
    return [(f["rule"], f["step"], f["evidence"].get("rank")) for f in data["findings"]]


def test_a_nan_on_one_rank_is_reported_once_by_the_main_process(ddp_runs):
    run = ddp_runs / "nan"
    assert sorted(p.name for p in (run / "hf-sanity").glob("*.json")) == ["report.json"]  # one report
    report = json.loads((run / "hf-sanity" / "report.json").read_text())
    loss = next(f for f in report["findings"] if f["rule"] == "nonfinite-loss")
    assert (loss["step"], loss["evidence"]["rank"], loss["evidence"]["cause"]) == (3, 1, "input")
    assert Path(loss["evidence"]["batch_file"]).name == "nonfinite-loss-step3-rank1.safetensors"
    # DDP averaged rank 1's NaN gradient into rank 0's: there the loss was finite, the gradient not.
    assert ("nonfinite-grad", 3, 0) in findings(run / "hf-sanity" / "report.json")
    for rank in (0, 1):  # both ranks trained to the end: nobody waited on a collective the other skipped
        assert json.loads((run / f"rank{rank}.json").read_text())["steps"] == 8


@pytest.mark.planted("ranks-diverged")
def test_replicas_that_bypass_ddp_are_ranks_diverged(ddp_runs):
    run = ddp_runs / "drift"
    assert findings(run / "hf-sanity" / "report.json") == [("ranks-diverged", 3, 0)]
    for rank in (0, 1):
        seen = json.loads((run / f"rank{rank}.json").read_text())
        assert seen["steps"] == 8 and [f["rule"] for f in seen["findings"]] == ["ranks-diverged"]


@pytest.mark.clean("training", "curves", "tokens", "internal-error", "ranks-diverged")
def test_a_clean_two_process_run_is_silent_and_runs_every_online_detector(ddp_runs):
    run = ddp_runs / "clean"
    assert findings(run / "hf-sanity" / "report.json") == []
    main = json.loads((run / "rank0.json").read_text())
    assert main["steps"] == 8 and main["findings"] == []
    online = sft_online_detectors()  # the preference and RL monitors are for their own objectives
    assert sorted(online - set(main["ran"])) == []  # every online detector was fed what it reads


@pytest.mark.parametrize(("seed", "batch"), [(1, 2), (1, 4), (2, 2), (2, 4)])
@pytest.mark.clean("curves", "training")
def test_clean_two_process_runs_are_silent_at_several_seeds_and_batch_sizes(ddp_runs, seed, batch):
    """The curve detectors judge the loss the user sees (the mean over ranks that Trainer logs), not one rank's
    batch-to-batch noise: no loss-oscillation on a run whose logged loss falls steadily."""
    run = ddp_runs / f"clean-s{seed}-b{batch}"
    assert findings(run / "hf-sanity" / "report.json") == []
    logged = [
        h["loss"] for h in json.loads((run / "trainer_state.json").read_text())["log_history"] if "loss" in h
    ]
    assert logged[-1] < logged[0]  # it learned: silence is not blindness


@pytest.mark.planted("loss-diverged")
def test_a_learning_rate_far_too_high_under_ddp_is_caught(ddp_runs):
    report = json.loads((ddp_runs / "hot" / "hf-sanity" / "report.json").read_text())
    diverged = [f for f in report["findings"] if f["rule"] == "loss-diverged"]
    assert diverged and diverged[0]["evidence"]["cause"] == "lr-too-high"


def test_an_abort_stops_every_rank_after_the_step_and_says_so_once(ddp_runs):
    run = ddp_runs / "abort"
    for rank in (0, 1):  # the stop was agreed in the exchange: every rank stopped after the same step
        seen = json.loads((run / f"rank{rank}.json").read_text())
        assert (seen["steps"], seen["aborted_at_step"]) == (3, 3)
    stats = json.loads((run / "hf-sanity" / "report.json").read_text())["stats"]
    assert stats["aborted_at_step"] == 3 and stats["aborted_by"] in ("nonfinite-loss", "nonfinite-grad")
    said = [
        line for line in (ddp_runs / "stderr.txt").read_text().splitlines() if "stopping training" in line
    ]
    assert len(said) == 1, said  # the main process alone says it
    assert "after step 3" in said[0] and f"{stats['aborted_by']} @ step 3" in said[0]
