"""The reward dry run under torchrun (2 processes, gloo, CPU; tests/dist/grpo_run.py): the reward function is
called by the main process only (a paid judge is billed once), and every rank reports the same verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import torchrun

pytestmark = pytest.mark.slow  # subprocesses: `make test-fast` leaves them out

SCRIPT = Path(__file__).parent / "dist" / "grpo_run.py"


@pytest.mark.planted("reward-function-broken")
def test_the_dry_run_calls_the_reward_function_on_the_main_process_only(tmp_path):
    result = torchrun(SCRIPT, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    calls = [line.split() for line in (tmp_path / "calls.txt").read_text().splitlines()]
    main_pids = {str(r["pid"]) for r in ranks}
    dry_run = [(rank, size) for rank, pid, size in calls if pid not in main_pids]  # made in a child process
    trl = {rank for rank, pid, _ in calls if pid in main_pids}
    # On rank 0 only: 16 completions built from the dataset's answers, as messages, then as strings (the cause).
    assert dry_run == [("0", "16"), ("0", "16")]
    assert trl == {"0", "1"}  # TRL's own calls, on each rank, go on as before
    # Every rank reports the same verdict, and the finding it implies, though rank 1 never called the function.
    assert ranks[0]["reward_dry_run"] == ranks[1]["reward_dry_run"]
    assert ranks[0]["reward_dry_run"]["functions"]["counted"]["cause"] == "completion-type"
    for rank in ranks:
        broken = [f for f in rank["findings"] if f["rule"] == "reward-function-broken"]
        assert broken == [{"rule": "reward-function-broken", "step": 0, "cause": "completion-type"}]
