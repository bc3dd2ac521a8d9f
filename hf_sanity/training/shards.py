"""Which parameters each rank holds only a part of, and how a measurement stays right on them.

Under FSDP2 a parameter is a ``DTensor`` whose local tensor is this rank's shard; under FSDP1 every parameter
the wrapper exposes is a flat view of this rank's part; under DeepSpeed ZeRO-3 a parameter is locally empty
(``numel() == 0``) and its part lives in ``ds_tensor``. A norm computed on such a local part is wrong by a
factor, and two ranks' parts are different numbers by design. So:

* a norm is a sum of squares over the local parts, weighted so that a value every rank holds counts once,
  then summed over ranks in one ``all_reduce`` that every rank calls at the same point of the step;
* `ranks-diverged` compares only parameters every rank holds in full;
* a check that needs a forward on one rank only (the NaN replay) is skipped on a sharded model, and one that
  runs a forward on every rank (the predictions probe) runs only where that forward is known to be safe
  (FSDP2, replicated parameters); every skipped check is named, with why, in the report's stats.

:func:`detect` reads it once at train begin, from the trainer (``is_fsdp_enabled``, ``is_deepspeed_enabled``)
and from the parameters themselves (a plain training loop has no trainer).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

REPLICATED = "replicated"  # every rank holds the whole value (single process, DDP, ZeRO-1/2, FSDP2-unmanaged)
DTENSOR = "dtensor"  # FSDP2 (or tensor parallel): a DTensor sharded over its device mesh
ZERO3 = "zero3"  # DeepSpeed ZeRO-3: locally empty, this rank's flat partition in ``ds_tensor``
FSDP1 = "fsdp1"  # FSDP1: a flat view of this rank's part (its full size is not known on every rank)


def is_dtensor(tensor) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


@functools.cache
def _dtensor_class() -> type | None:
    """DTensor, looked up once (a ``from`` import of a package costs a Python call at every step)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def is_zero3(param) -> bool:
    """A ZeRO-3 partitioned parameter (DeepSpeed's own test is ``hasattr(param, "ds_id")``)."""
    return hasattr(param, "ds_id") and hasattr(param, "ds_tensor")


def has_fsdp1(model) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def layout_of(param, *, fsdp1: bool = False) -> str:
    if is_dtensor(param):
        return DTENSOR if any(not p.is_replicate() for p in param.placements) else REPLICATED
    if is_zero3(param):
        return ZERO3
    return FSDP1 if fsdp1 else REPLICATED


def local_tensor(tensor):
    """What this rank holds of ``tensor`` (no copy): a DTensor's local shard, a ZeRO-3 parameter's partition
    (its padding left out), else the tensor itself."""
    if is_dtensor(tensor):
        return tensor.to_local().detach()
    if is_zero3(tensor):
        return zero3_partition(tensor)
    return tensor.detach()


def zero3_partition(param):
    """The elements of ``param`` this rank's ZeRO-3 partition holds: ``ds_tensor`` is padded to an equal size
    on every rank and its padding is never written, so only the first ``ds_numel - rank * size`` count."""
    import torch.distributed as dist

    part = param.ds_tensor.detach().reshape(-1)
    rank = 0
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank(group=getattr(param, "ds_process_group", None))
    valid = max(0, min(part.numel(), int(param.ds_numel) - part.numel() * rank))
    return part.narrow(0, 0, valid)


def full_numel(param) -> int:
    """Elements of the whole parameter (what every rank agrees on), not of this rank's part."""
    if is_zero3(param):
        return int(param.ds_numel)
    flat = getattr(param, "_unpadded_unsharded_size", None)  # an FSDP1 FlatParameter
    if flat is not None:
        return int(math.prod(flat))
    return int(param.numel())  # a DTensor's numel() is already its global one


def weight(param, layout: str, world_size: int) -> float:
    """The share of this rank's sum of squares in the global one: a value ``k`` ranks hold alike counts 1/k."""
    import torch.distributed as dist

    if layout == REPLICATED:
        return 1.0 / world_size
    if layout == DTENSOR:
        mesh = param.device_mesh
        copies = math.prod(mesh.size(d) for d, p in enumerate(param.placements) if p.is_replicate())
        return 1.0 / copies
    if layout == ZERO3 and dist.is_available() and dist.is_initialized():
        group = getattr(param, "ds_process_group", None)
        return dist.get_world_size(group=group) / world_size  # hpZ / MiCS: partitioned over a subgroup
    return 1.0


def squares(tensor):
    """The sum of squares of a local part as a float32 device scalar (0 for an empty part)."""
    import torch

    return torch.linalg.vector_norm(tensor, dtype=torch.float32).square()


def collective_device():
    """Where this process group's collectives run: the current CUDA device for NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(vector, *, world_size: int):
    """``vector`` summed over every rank: one all_reduce, on the device the backend runs on, nothing read on
    the host. Every rank must call it at the same point with a vector of the same length."""
    if world_size <= 1:
        return vector
    import torch.distributed as dist

    summed = vector.to(collective_device())
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return summed.to(vector.device)


@contextlib.contextmanager
def kept_sharded(model):
    """Around an extra forward: leave an FSDP2 model's parameters sharded as they were. FSDP2 keeps the root
    module's parameters gathered after a forward, for the backward that frees them; after an extra no-grad
    forward none follows, and the run would go on holding them gathered (more memory, and a checkpoint saved
    then would hold plain tensors where its DTensors belong). Inside a training forward (the step-0 probe)
    they were gathered before and stay so. Resharding only frees local memory: no collective."""
    before = {id(p) for p in model.parameters()}
    try:
        yield
    finally:
        if any(id(p) not in before for p in model.parameters()):
            from torch.distributed.fsdp import FSDPModule

            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


def plain(value):
    """A DTensor scalar (the gradient norm clip_grad_norm_ returns under FSDP2) as a plain tensor: its local
    value when replicated, else the full tensor, a collective every rank reaches, as Trainer computes the norm
    on every rank."""
    if not is_dtensor(value):
        return value
    if all(p.is_replicate() for p in value.placements):
        return value.to_local()
    return value.full_tensor()


@dataclass
class Sharding:
    """How the parameters of this run are laid out, what hf-sanity can measure on them, and what it skips."""

    engine: str | None = None  # "fsdp" / "deepspeed": the trainer says so; None: a plain or DDP run
    layout: dict[int, str] = field(default_factory=dict)  # id(param) -> layout, for every parameter
    counts: dict[str, int] = field(default_factory=dict)  # parameters per layout
    skipped: dict[str, str] = field(default_factory=dict)  # check -> why it does not run
    replicated: list[str] = field(default_factory=list)  # names of the parameters every rank holds in full

    @property
    def sharded(self) -> bool:
        """Some rank holds only a part of some parameter."""
        return any(kind != REPLICATED for kind in self.counts)

    @property
    def kind(self) -> str:
        """One word for the report: fsdp2, fsdp1, zero3, deepspeed (ZeRO-1/2), dtensor or replicated."""
        if self.counts.get(FSDP1):
            return "fsdp1"
        if self.counts.get(ZERO3):
            return "zero3"
        if self.counts.get(DTENSOR):
            return "fsdp2" if self.engine != "deepspeed" else "dtensor"
        return self.engine or REPLICATED

    def layout_of(self, param) -> str:
        return self.layout.get(id(param), REPLICATED)

    def is_sharded(self, param) -> bool:
        return self.layout_of(param) != REPLICATED

    @property
    def gradients_in_params(self) -> bool:
        """``p.grad`` holds this step's gradient before the optimizer step. Not under DeepSpeed: its engine
        keeps gradients in its own partitioned buffers and steps inside ``backward``. Not under FSDP1: a rank
        holds gradients only for the parameters its shard covers."""
        return self.engine != "deepspeed" and not self.counts.get(FSDP1)

    @property
    def steps_in_backward(self) -> bool:
        """The optimizer has already stepped when Trainer's ``on_pre_optimizer_step`` fires (DeepSpeed's engine
        steps inside ``accelerator.backward``): an update is measured from the start of the step instead."""
        return self.engine == "deepspeed"

    @property
    def replay_skip(self) -> str | None:
        """Why the NaN replay (a forward on the one rank that saw the NaN) cannot run, or None."""
        return self.skipped.get("nonfinite-loss replay")

    @property
    def probe_skip(self) -> str | None:
        """Why the step-0 and predictions probes (a forward on every rank) cannot run, or None."""
        return self.skipped.get("probe forward")

    def weights(self, params: Sequence[Any], world_size: int) -> list[float]:
        """Per parameter, the share of this rank's sum of squares in the global one (see :func:`weight`)."""
        return [weight(p, self.layout_of(p), world_size) for p in params]

    def stats(self) -> dict[str, Any]:
        return {"kind": self.kind, "parameters": dict(self.counts), "skipped": dict(self.skipped)}


def detect(trainer, model, world_size: int = 1) -> Sharding:
    """The run's sharding, read once at train begin."""
    engine = None
    if getattr(trainer, "is_deepspeed_enabled", False):
        engine = "deepspeed"
    elif getattr(trainer, "is_fsdp_enabled", False):
        engine = "fsdp"
    fsdp1 = has_fsdp1(model) if model is not None else False
    named = list(model.named_parameters()) if model is not None else []
    if engine == "fsdp" and not fsdp1 and not any(is_dtensor(p) for _, p in named):
        fsdp1 = True  # FSDP by the trainer's word, yet no DTensor: FSDP1 under another wrapper
    layout = {id(p): layout_of(p, fsdp1=fsdp1) for _, p in named}
    counts: dict[str, int] = {}
    for kind in layout.values():
        counts[kind] = counts.get(kind, 0) + 1
    replicated = [n for n, p in named if layout[id(p)] == REPLICATED]
    sharding = Sharding(engine=engine, layout=layout, counts=counts, replicated=replicated)
    sharding.skipped = skipped_checks(sharding)
    return sharding


def skipped_checks(sharding: Sharding) -> dict[str, str]:
    """The checks that cannot run on this layout, each with why (the report's ``stats.sharding.skipped``)."""
    skipped: dict[str, str] = {}
    sharded = sharding.sharded
    if sharded:
        parts = sum(n for kind, n in sharding.counts.items() if kind != REPLICATED)
        skipped["ranks-diverged"] = (
            f"{parts} sharded parameters are not compared: each rank holds a different part by design (only the "
            f"{sharding.counts.get(REPLICATED, 0)} parameters every rank holds in full are)"
        )
    if sharded:
        skipped["nonfinite-loss replay"] = (
            f"{sharding.kind}: a forward on the one rank that saw the non-finite loss would wait forever for the "
            "others (every forward gathers the sharded parameters from every rank)"
        )
    elif sharding.engine is not None:
        skipped["nonfinite-loss replay"] = (
            f"{sharding.kind}: a forward of one rank alone through the {sharding.engine} engine is not verified"
        )
    if sharding.counts.get(FSDP1) or sharding.counts.get(ZERO3):
        skipped["probe forward"] = (
            f"{sharding.kind}: an extra forward inside the training forward is not verified on this layout "
            "(init-loss-off-chance, predictions-frozen and grad-accum-loss-scaling go without their probe)"
        )
    if sharding.engine == "deepspeed":
        skipped["stale-gradients"] = "DeepSpeed keeps gradients in its own buffers and clears them itself"
        skipped["gradient path (no-grad)"] = "DeepSpeed keeps gradients in its own buffers: p.grad stays None"
    if sharding.counts.get(FSDP1):
        skipped["stale-gradients"] = "FSDP1: a rank holds gradients only for the parameters its shard covers"
        skipped["gradient path (no-grad)"] = "FSDP1: a rank holds gradients only for its shard's parameters"
        skipped["update ratio"] = (
            "FSDP1: a parameter's full size is not known on every rank, so no sample is the same on every rank "
            "(lr-too-low and loss-flat's lr-too-low cause go without it); use fsdp_version: 2"
        )
    return skipped
