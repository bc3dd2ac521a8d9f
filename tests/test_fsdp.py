"""SanityCallback on parameters sharded with FSDP2 ``fully_shard``: 2 processes, gloo, CPU, a plain training
loop calling the callback's events in Trainer's order (tests/dist/fsdp_run.py; Trainer refuses FSDP on the
CPU). What the monitors are fed on the sharded run is what they are fed on the same run with replicated
parameters; a clean run is silent and leaves the weights bit-identical; a NaN on one rank and a real
divergence are caught; only the parameters every rank holds in full are compared across ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from helpers import sft_online_detectors, torchrun

pytestmark = pytest.mark.slow  # torchrun: `make test-fast` leaves it out

SCRIPT = Path(__file__).parent / "dist" / "fsdp_run.py"
TOLERANCE = 1e-4  # relative: the runs differ by float rounding (reduce-scatter vs all_reduce); a shard's own
# norm differs from the whole tensor's by tens of percent


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    result = torchrun(SCRIPT, out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def seen(run: Path, rank: int = 0) -> dict:
    return json.loads((run / f"rank{rank}.json").read_text())


def fed(run: Path, key: str, rank: int = 0) -> dict[int, float]:
    """What the monitors were fed under ``key``, by step."""
    return {step: values[key] for step, values in seen(run, rank)["fed"] if key in values}


def reported(run: Path) -> list[dict]:
    return json.loads((run / "hf-sanity" / "report.json").read_text())["findings"]


def close(a: dict[int, float], b: dict[int, float]) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[s], b[s], rel_tol=TOLERANCE, abs_tol=1e-9) for s in a)


@pytest.mark.clean("training", "curves", "tokens", "internal-error")
def test_a_clean_fully_sharded_run_is_silent_and_states_what_it_skips(fsdp_runs):
    run = fsdp_runs / "fsdp-clean"
    assert reported(run) == []
    main = seen(run)
    assert main["steps"] == 12 and main["findings"] == [] and seen(run, 1)["findings"] == []
    assert set(main["layouts"].values()) == {"DTensor"}  # every parameter sharded: nothing to compare
    sharding = main["stats"]["sharding"]
    assert sharding["kind"] == "fsdp2" and sharding["parameters"] == {"dtensor": 21}
    assert set(sharding["skipped"]) == {"ranks-diverged", "nonfinite-loss replay"}
    online = sft_online_detectors()  # the preference and RL monitors are for their own objectives
    # Every online detector was fed what it reads (the step-0 and predictions probes ran on every rank), but
    # for ranks-diverged: no parameter is held in full by every rank.
    assert sorted(online - set(main["ran"])) == ["hf_sanity.rules.training.ranks.RankMonitor"]


def test_sharded_measurements_equal_those_of_the_same_run_replicated(fsdp_runs):
    """Update ratio, gradient norm and gradient path on shards are the whole tensors' (summed over ranks),
    the same on every rank, and equal to what the same run measures on replicated parameters."""
    sharded, replicated = fsdp_runs / "fsdp-clean", fsdp_runs / "ddp-clean"
    ratios = fed(sharded, "update_ratio")
    assert sorted(ratios) == [*range(1, 11), 12]  # every early step, then every check_every (2) steps
    assert all(1e-4 < r < 1e-1 for r in ratios.values())  # a healthy AdamW at 1e-3
    for key in ("update_ratio", "grad_norm", "n_with_grad", "n_trainable"):
        assert close(fed(sharded, key), fed(replicated, key)), key
        assert fed(sharded, key) == fed(sharded, key, rank=1), key  # one global value, not a rank's part
    assert set(fed(sharded, "n_with_grad").values()) == {21}
    assert set(fed(sharded, "stale_norm").values()) == {0.0}


@pytest.mark.planted("stale-gradients")
def test_stale_gradients_of_a_sharded_run_are_measured_whole_and_caught(fsdp_runs):
    sharded, replicated = fsdp_runs / "fsdp-stale", fsdp_runs / "ddp-stale"
    norms = fed(sharded, "stale_norm")
    assert norms[1] == 0.0 and all(norms[s] > norms[s - 1] for s in range(2, 9))  # never cleared: it grows
    assert close(norms, fed(replicated, "stale_norm"))
    assert [(f["rule"], f["step"]) for f in reported(sharded)] == [("stale-gradients", 2)]


@pytest.mark.planted("nonfinite-loss")
def test_a_nan_on_one_rank_of_a_sharded_run_is_caught_without_a_replay(fsdp_runs):
    run = fsdp_runs / "fsdp-nan"
    findings = reported(run)
    loss = next(f for f in findings if f["rule"] == "nonfinite-loss")
    assert (loss["step"], loss["evidence"]["rank"], loss["evidence"]["cause"]) == (3, 1, "input")
    # A replay is a forward on rank 1 alone: under FSDP it would wait forever for rank 0's shards.
    assert loss["evidence"]["replay_skipped"].startswith("fsdp2: a forward on the one rank")
    assert Path(loss["evidence"]["batch_file"]).name == "nonfinite-loss-step3-rank1.safetensors"
    # The reduce-scatter averaged rank 1's NaN gradient into rank 0's shards: there the loss was finite.
    assert ("nonfinite-grad", 3, 0) in [(f["rule"], f["step"], f["evidence"].get("rank")) for f in findings]
    for rank in (0, 1):  # both ranks trained to the end: nobody waited on a collective the other skipped
        assert seen(run, rank)["steps"] == 8


@pytest.mark.planted("loss-diverged")
def test_a_learning_rate_far_too_high_under_fsdp_is_caught(fsdp_runs):
    run = fsdp_runs / "fsdp-hot"
    (diverged,) = [f for f in reported(run) if f["rule"] == "loss-diverged"]
    assert diverged["evidence"]["cause"] == "lr-too-high" and math.isfinite(diverged["evidence"]["peak_loss"])
    assert diverged["evidence"]["update_ratio"] > 1e-2  # the whole tensors' ratio names the cause


def test_the_probes_forwards_leave_a_sharded_run_bit_identical(fsdp_runs):
    """The step-0 probe (inside the first training forward) and the predictions probe (after a step) run a
    forward on every rank; the parameters stay sharded, and the weights at the end are those of the same run
    without the callback."""
    import torch

    # Resharded after the predictions probe (steps 4, 8, 12) as after every step: no parameter stays gathered.
    assert seen(fsdp_runs / "fsdp-clean")["layouts_after_steps"] == [["DTensor"]] * 12
    with_callback = torch.load(fsdp_runs / "fsdp-clean" / "weights.pt")
    without = torch.load(fsdp_runs / "fsdp-bare" / "weights.pt")
    assert with_callback.keys() == without.keys()
    assert all(torch.equal(with_callback[name], without[name]) for name in without)


@pytest.mark.planted("ranks-diverged")
def test_only_parameters_every_rank_holds_in_full_are_compared_across_ranks(fsdp_runs):
    """Decoder layers sharded, embeddings, final norm and head left plain and never averaged: those replicas
    drift apart and are reported; the shards, different on every rank by design, are not."""
    run = fsdp_runs / "fsdp-partial"
    (finding,) = reported(run)
    assert finding["rule"] == "ranks-diverged" and finding["step"] == 1
    assert finding["evidence"]["names"] == [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert finding["evidence"]["parameters"] == 3
    assert seen(run)["stats"]["sharding"]["parameters"] == {"replicated": 3, "dtensor": 18}
