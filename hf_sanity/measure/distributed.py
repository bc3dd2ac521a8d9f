"""Preflight under torchrun / accelerate launch: each process scans its shard, rank 0 judges.

The measurement columns of every shard are gathered on rank 0 (they are small: counts and hashes, not
tokens); rank 0 runs the rules and the report is broadcast, so every process returns the same report.
Token views on rank 0 re-encode the one row they show.
"""

from __future__ import annotations

import os


def world() -> tuple[int, int]:
    """(rank, world_size); joins the process group torchrun describes if nobody has yet."""
    import torch.distributed as dist

    if not dist.is_available():
        return 0, 1
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
            return 0, 1
        dist.init_process_group(backend="gloo")
    return dist.get_rank(), dist.get_world_size()


_object_group = None


def object_group():
    """A gloo group for Python objects (works beside an NCCL default group)."""
    global _object_group
    import torch.distributed as dist

    if _object_group is None:
        _object_group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return _object_group


def gather_columns(columns: dict[str, list]) -> dict[str, list] | None:
    """Every rank's columns, concatenated in rank order, on rank 0 (None elsewhere)."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    parts = [None] * size if rank == 0 else None
    dist.gather_object(columns, parts, dst=0, group=object_group())
    if rank != 0:
        return None
    return {key: [v for part in parts for v in part[key]] for key in columns}


def broadcast(obj):
    """rank 0's object, on every rank."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=object_group())
    return box[0]
