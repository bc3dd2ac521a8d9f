"""Run under `torchrun --nproc_per_node 2`: preflight scans one shard per process; rank 0 writes the report."""

import json
import sys

import datasets

from hf_sanity.drivers.preflight import preflight
from hf_sanity.testing import build_tokenizer, demo_conversations


def main(out: str) -> None:
    tok = build_tokenizer("chatml", "eos")
    rows = demo_conversations(40)
    rows[7] = {"messages": []}  # a bad row in the first shard
    rows[33] = rows[25]  # a duplicate across... the same shard
    rows[30] = rows[3]  # and one across shards
    report = preflight(tokenizer=tok, dataset=datasets.Dataset.from_list(rows), max_len=40,
                       eval_dataset=datasets.Dataset.from_list(demo_conversations(44)[38:]), use_config=False)  # fmt: skip
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(report.to_dict(), handle)
    # Every rank got the same report back.
    assert report.stats["processes"] == 2 and report.findings
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
