"""The collectives of SanityCallback under DDP: one checksum per parameter (for `ranks-diverged`) and the
findings each rank has not sent yet, exchanged every few steps. Every rank must call them at the same steps,
in the same order: a collective one rank skips hangs the others.

Only parameters every rank holds in full are compared: a shard of an FSDP or ZeRO-3 parameter differs from the
other ranks' shards by design (see :mod:`hf_sanity.training.shards`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from hf_sanity.findings import Finding
from hf_sanity.training.shards import collective_device, local_tensor


def world() -> tuple[int, int]:
    """(rank, world size) of the process group the Trainer set up; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def checksums(params: Sequence[Any]):
    """One float64 number per parameter (its sum), computed on its device and stacked on the first one."""
    import torch

    if not params:
        return torch.zeros(0, dtype=torch.float64, device="cpu")
    values = [local_tensor(p) for p in params]  # a replicated DTensor: its local value is the whole
    device = values[0].device
    return torch.stack([v.sum(dtype=torch.float64).to(device) for v in values])


def all_max_min(vector, flags):
    """Element-wise max and min over ranks of ``vector``, and the max of ``flags``: one all_reduce."""
    import torch
    import torch.distributed as dist

    n = vector.numel()
    packed = torch.cat([vector.double(), -vector.double(), flags.double()])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return packed[:n], -packed[n : 2 * n], packed[2 * n :]


class RankExchange:
    """One exchange every ``sync_every`` steps: a single all_reduce carries every parameter's checksum range
    (max and min over ranks), how many findings each rank has not sent and whether one is an error; an
    all_gather_object follows only when some rank has something new, and the main process merges it."""

    def __init__(self, rank: int, world_size: int, *, compared: Sequence[str] | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        # Fixed at train begin (None: every parameter): FSDP2 swaps gathered plain tensors in for its sharded
        # parameters around a forward, and the vector must have the same length on every rank at every sync.
        self.names = list(compared) if compared is not None else None

    def compared(self, model) -> list[tuple[str, Any]]:
        """The parameters every rank holds in full, in the same order on every rank."""
        if self.names is None:
            return list(model.named_parameters())
        params = dict(model.named_parameters())
        return [(n, params[n]) for n in self.names]

    def sync(self, step: int, model, sink, feed: Callable[[int, dict[str, Any]], None]) -> bool:
        """Exchange at ``step`` (every rank, same steps, same order); True when some rank asks to stop."""
        import torch
        import torch.distributed as dist

        device = collective_device()
        vector = torch.zeros(0, dtype=torch.float64, device=device)
        names: list[str] = []
        if model is not None and sink.measures("checksum_max", "checksum_min"):
            names = self.names if self.names is not None else [n for n, _ in model.named_parameters()]
            # Same length on every rank whatever happens: a collective of mismatched sizes would hang.
            vector = torch.full((len(names),), math.nan, dtype=torch.float64, device=device)
            with sink.guard("ranks-diverged"):
                vector = checksums([p for _, p in self.compared(model)]).to(device)
        flags = torch.tensor(
            [len(sink.unsent), float(sink.errors_unsent or sink.stop_pending)], device=device
        )
        high, low, flags = all_max_min(vector, flags)
        diverged_before = "ranks-diverged" in sink.counts
        if vector.numel():  # every rank sees the same reduced checksums, so every rank decides alike
            feed(step, {"checksum_max": high.tolist(), "checksum_min": low.tolist(), "names": names})
        diverged_now = "ranks-diverged" in sink.counts and not diverged_before
        if int(flags[0].item()) > 0 or diverged_now:
            gathered: list[Any] = [None] * self.world_size
            unsent, _ = sink.take_unsent()
            dist.all_gather_object(gathered, [portable(f) for f in unsent])
            if sink.is_main:
                with sink.guard("callback-sync"):
                    for rank, items in enumerate(gathered):
                        if rank != self.rank and items:
                            sink.merge(items)
        sink.take_unsent()
        return bool(flags[1].item())


def portable(finding: Finding) -> dict[str, Any]:
    """A finding as plain data for another process (the token or side-by-side view stays behind): the fields
    ``Finding`` is built from."""
    return {k: v for k, v in finding.to_dict().items() if k not in ("example", "side_by_side")}
