"""preflight under torchrun: 2 processes (gloo, CPU) give the same findings as one."""

import json
from pathlib import Path

import datasets
import pytest

from helpers import torchrun
from hf_sanity.drivers.preflight import preflight
from hf_sanity.testing import build_tokenizer, demo_conversations

pytestmark = pytest.mark.slow  # subprocesses: `make test-fast` leaves them out

SCRIPT = Path(__file__).parent / "dist" / "preflight_shards.py"


def comparable(report: dict) -> list:
    return [(f["rule"], f["severity"], f["message"], f["evidence"]) for f in report["findings"]]


def test_two_processes_match_one(tmp_path):
    out = tmp_path / "report.json"
    result = torchrun(SCRIPT, out, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sharded = json.loads(out.read_text())

    tok = build_tokenizer("chatml", "eos")
    rows = demo_conversations(40)
    rows[7] = {"messages": []}
    rows[33] = rows[25]
    rows[30] = rows[3]
    single = preflight(
        tokenizer=tok,
        dataset=datasets.Dataset.from_list(rows),
        max_len=40,  # TRL's default for `messages` rows, every token: prompt-in-loss warns (trainer-default)
        eval_dataset=datasets.Dataset.from_list(demo_conversations(44)[38:]),
        use_config=False,
    )
    assert comparable(sharded) == comparable(single.to_dict())
    assert {
        "bad-input-values",
        "duplicate-examples",
        "split-leakage",
        "prompt-in-loss",
        "truncated-completion",
    } <= {f["rule"] for f in sharded["findings"]}
    assert sharded["stats"]["processes"] == 2
