"""A GRPO run under torchrun (2 processes, gloo, CPU) for tests/test_callback_rl_dist.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist/grpo_run.py OUT_DIR

The reward function reads conversational completions as strings (`reward-function-broken`, cause
`completion-type`) and appends a line to ``OUT_DIR/calls.txt`` at every call: the rank, the process that called
it and how many completions it scored, so the test can tell the dry run's calls (made in a child process of a
rank's main process) from TRL's. Each process writes ``OUT_DIR/rank<R>.json``: its main process id, the dry run
it reports and its findings.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import trl_setups as setups  # noqa: E402

from hf_sanity import SanityCallback  # noqa: E402
from hf_sanity.testing import demo_rl_prompts  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
OUT = Path(sys.argv[1])


def counted(completions, answer, **kwargs):
    """The conversational bug (`in` on a list of messages is always False), with every call written down."""
    with (OUT / "calls.txt").open("a") as calls:
        calls.write(f"{RANK} {os.getpid()} {len(completions)}\n")
    return [1.0 if a.split()[-1].rstrip(".") in c else 0.0 for c, a in zip(completions, answer)]


if __name__ == "__main__":
    torch.set_num_threads(1)
    callback = SanityCallback(check_every=1, sync_every=1, use_config=False, print_findings=False)
    trainer = setups.grpo(OUT / "run", demo_rl_prompts(32, seed=3), [counted], callbacks=[callback], max_steps=2,
                          ddp_backend="gloo", use_cpu=True)  # fmt: skip
    trainer.train()
    seen = [{"rule": f.rule, "step": f.step, "cause": f.evidence.get("cause")} for f in callback.report.findings]
    (OUT / f"rank{RANK}.json").write_text(json.dumps({
        "pid": os.getpid(), "world_size": trainer.args.world_size, "findings": seen,
        "reward_dry_run": callback.report.stats.get("reward_dry_run"),
    }))  # fmt: skip
    torch.distributed.barrier()
