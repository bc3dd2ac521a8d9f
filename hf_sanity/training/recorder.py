"""Per-step numbers kept where they are computed, read in one transfer.

A training step produces a handful of scalars on the device (the loss of each micro-batch, the gradient
norm, an update ratio). Reading each one would synchronise the device with the host every step;
:class:`Recorder` copies them into a preallocated device buffer instead and :meth:`Recorder.read` moves the
whole buffer to the host at once (every N steps, at logging steps, or when a check needs it now). Plain
Python numbers (the learning rate, counts) are kept on the host as they come.

:class:`EarlyFlags` answers "was a loss of this step non-finite?" *before* the optimizer step without a
synchronisation: on the CPU the value is simply there; on CUDA a pinned copy is queued with an event, and
the answer is read only once the event has completed (Trainer synchronises after every micro-batch when
``logging_nan_inf_filter`` is on, the default, so it has by then).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any


class Recorder:
    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self.buffer = None
        self._host_view = None  # the buffer as a numpy array, when it lives on the CPU
        self._exact: tuple = ()
        self.slots: list[tuple[int, str]] = []
        self.host: list[tuple[int, str, Any]] = []
        self.transfers = 0

    def push(self, step: int, name: str, value: Any) -> float | None:
        """Record ``value`` for ``step``; returns it as a float when a one-element tensor was on the CPU (read
        without a synchronisation, as it was already on the host), else None."""
        import torch

        if isinstance(value, torch.Tensor):
            value = value.detach()
            if self.buffer is None:
                self._allocate(self.capacity, value.device)
            index = len(self.slots)
            if index >= self.buffer.numel():  # grow without a transfer
                old = self.buffer
                self._allocate(2 * old.numel(), old.device)
                self.buffer[: old.numel()].copy_(old)
            host = None
            if self._host_view is not None and value.is_cpu and value.dtype in self._exact and value.numel():
                # On the CPU the value is already on the host: written into the same float32 buffer without a
                # tensor operation (these dtypes hold float32 values: nothing to round).
                single = value.numel() == 1
                first = value.item() if single else value.reshape(-1)[0].item()
                self._host_view[index] = first
                host = first if single else None
            else:
                self.buffer[index].copy_(value.reshape(-1)[0] if value.numel() else value.new_zeros(()))
            self.slots.append((step, name))
            return host
        self.host.append((step, name, value))
        return None

    def _allocate(self, size: int, device) -> None:
        import torch

        self._exact = (torch.float32, torch.bfloat16, torch.float16)  # float32 holds their values exactly
        self.buffer = torch.zeros(size, dtype=torch.float32, device=device)
        self._host_view = self.buffer.numpy() if self.buffer.device.type == "cpu" else None

    def __len__(self) -> int:
        return len(self.slots) + len(self.host)

    def read(self) -> dict[int, dict[str, list[Any]]]:
        """Everything recorded since the last read, by step then name (values in recording order)."""
        values = self.buffer[: len(self.slots)].tolist() if self.slots else []
        if self.slots:
            self.transfers += 1
        records: dict[int, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
        for (step, name), value in zip(self.slots, values):
            records[step][name].append(value)
        for step, name, value in self.host:
            records[step][name].append(value)
        self.slots, self.host = [], []
        return {step: dict(records[step]) for step in sorted(records)}


class EarlyFlags:
    """Non-finite losses of the current step, known without waiting for the device."""

    def __init__(self, ring: int = 64) -> None:
        self.ring = ring
        self._pinned = None
        self._next = 0
        self.pending: list[tuple[int, int, Any, Any]] = []  # (step, micro, host flag or tensor, event)

    def mark(self, step: int, micro: int, loss, *, host: float | None = None) -> None:
        """``host``: the loss as a float, when it was already read on the host."""
        import torch

        if host is not None:
            self.pending.append((step, micro, not math.isfinite(host), None))
            return
        loss = loss.detach()
        if loss.device.type == "cpu":
            finite = math.isfinite(loss.item()) if loss.numel() == 1 else bool(torch.isfinite(loss).all())
            self.pending.append((step, micro, not finite, None))
        elif loss.device.type == "cuda":
            if self._pinned is None:
                self._pinned = torch.zeros(self.ring, dtype=torch.bool, device="cpu", pin_memory=True)
            slot = self._pinned[self._next % self.ring : self._next % self.ring + 1]
            self._next += 1
            slot.copy_(~torch.isfinite(loss).all().reshape(1), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending.append((step, micro, slot, event))

    def nonfinite(self) -> tuple[int, int] | None:
        """(step, micro-batch) of a known non-finite loss among the pending ones; forgets what it has read."""
        found = None
        keep = []
        for step, micro, flag, event in self.pending:
            if event is not None and not event.query():
                keep.append((step, micro, flag, event))
                continue
            bad = flag if event is None else bool(flag[0])
            if bad and found is None:
                found = (step, micro)
        self.pending = keep[-self.ring // 2 :]
        return found
