"""Replicas that drifted apart under DDP: `ranks-diverged`; and the collectives that carry it.

:class:`RankMonitor` is fed ``checksum_max``/``checksum_min`` (element-wise max and min over ranks of one
checksum per parameter) and ``names``. The helpers below compute the checksums and exchange them; every rank
must call them at the same steps, in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hf_sanity.findings import Finding
from hf_sanity.monitors.base import Monitor
from hf_sanity.rules.training import RANKS_DIVERGED

RELATIVE_TOLERANCE = 1e-6  # replicas are bit-identical; this only absorbs a reduction done differently


class RankMonitor(Monitor):
    rules = (RANKS_DIVERGED,)

    def __init__(self, world_size: int = 1) -> None:
        super().__init__()
        self.world_size = world_size

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        high, low = values.get("checksum_max"), values.get("checksum_min")
        if high is None or low is None:
            return []
        names: Sequence[str] = values.get("names") or [str(i) for i in range(len(high))]
        differing = []
        worst = 0.0
        for name, hi, lo in zip(names, high, low):
            gap = abs(hi - lo)
            scale = max(abs(hi), abs(lo), 1e-30)
            if gap > RELATIVE_TOLERANCE * scale:
                differing.append(name)
                worst = max(worst, gap / scale)
        if not differing:
            return []
        return self.fire(
            RANKS_DIVERGED,
            f"{len(differing)} of {len(high)} parameters differ between the {self.world_size} ranks at step {step} "
            f"(first: {differing[0]}, relative gap up to {worst:.2g})",
            step=step,
            evidence={
                "differing": len(differing),
                "parameters": len(high),
                "names": differing[:10],
                "max_relative_gap": worst,
                "world_size": self.world_size,
            },
        )


def checksums(params: Sequence[Any]):
    """One float64 number per parameter (its sum), computed on its device and stacked on the first one."""
    import torch

    if not params:
        return torch.zeros(0, dtype=torch.float64)
    device = params[0].device
    return torch.stack([p.detach().sum(dtype=torch.float64).to(device) for p in params])


def all_max_min(vector, flags):
    """Element-wise max and min over ranks of ``vector``, and the max of ``flags``: one all_reduce."""
    import torch
    import torch.distributed as dist

    n = vector.numel()
    packed = torch.cat([vector.double(), -vector.double(), flags.double()])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return packed[:n], -packed[n : 2 * n], packed[2 * n :]


def collective_device():
    """Where this process group's collectives run: the current CUDA device for NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
