"""Memory held across steps: `memory-growth` and `oom`.

:class:`MemoryMonitor` is fed, at each memory check, ``graph_tensors`` (live tensors that still carry
autograd history between steps: there should be none), ``holders`` (where they are held: attribute path ->
count), ``allocated`` (accelerator memory allocated, in bytes, where there is an accelerator) and, when
training died of it, ``oom`` (the error text and a memory breakdown).

:func:`graph_tensors` finds the held tensors by walking the attributes of the objects that live across
steps (trainer, model, callbacks, the loss function and the user's module globals); :func:`gc_graph_tensors`
scans every object the garbage collector tracks (slower; the callback spends a bounded share of time on it).
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any

from hf_sanity.findings import Finding
from hf_sanity.monitors.base import Monitor, fmt
from hf_sanity.rules.training import MEMORY_GROWTH, OOM

GROWTH_CHECKS = 3  # the measure rose at 3 consecutive checks ...
MIN_BYTES_PER_STEP = 1 << 20  # ... by >= 1 MiB per step (accelerator memory) ...
SKIP_STEPS = 2  # ... ignoring the first steps (optimizer state is allocated at the first step)


class MemoryMonitor(Monitor):
    rules = (MEMORY_GROWTH, OOM)

    def __init__(self) -> None:
        super().__init__()
        self.series: dict[str, list[tuple[int, float]]] = {"graph_tensors": [], "allocated": []}
        self.holders: dict[str, int] = {}

    def update(self, step: int, values: Mapping[str, Any]) -> list[Finding]:
        out: list[Finding] = []
        if values.get("holders"):
            self.holders = dict(values["holders"])
        for key in ("graph_tensors", "allocated"):
            value = values.get(key)
            if value is None or (key == "allocated" and step <= SKIP_STEPS):
                continue
            points = self.series[key]
            if points and points[-1][0] == step:
                points[-1] = (step, float(value))
            else:
                points.append((step, float(value)))
            out += self._growth(key, step)
        if values.get("oom"):
            out += self._oom(step, values["oom"])
        return out

    def growing(self, key: str) -> list[tuple[int, float]]:
        """The trailing run of points of ``key`` where each rose above the one before (with its base point)."""
        points = self.series[key]
        run = points[-1:]
        for prev, cur in zip(reversed(points[:-1]), reversed(points[1:])):
            rise = cur[1] - prev[1]
            need = MIN_BYTES_PER_STEP * (cur[0] - prev[0]) if key == "allocated" else 0
            if rise <= need:
                break
            run.insert(0, prev)
        return run if len(run) > 1 else []

    def _growth(self, key: str, step: int) -> list[Finding]:
        run = self.growing(key)
        if len(run) < GROWTH_CHECKS + 1:
            return []
        (s0, v0), (s1, v1) = run[0], run[-1]
        per_step = (v1 - v0) / max(s1 - s0, 1)
        first = run[1][0]
        holder = max(self.holders, key=self.holders.get) if self.holders else None
        if key == "graph_tensors":
            what = f"{fmt(per_step)} tensors with autograd history per step are kept alive ({int(v0)} -> {int(v1)})"
        else:
            what = f"allocated memory grows {per_step / 2**20:.1f} MiB per step ({v0 / 2**20:.0f} -> {v1 / 2**20:.0f} MiB)"
        where = f", held by {holder}" if holder else ""
        return self.fire(
            MEMORY_GROWTH,
            f"memory grows from step {first}: {what}{where}",
            step=first,
            evidence={
                "measure": key,
                "per_step": per_step,
                "start": v0,
                "end": v1,
                "steps": [s for s, _ in run],
                "holder": holder,
                "holders": dict(sorted(self.holders.items(), key=lambda kv: -kv[1])[:5]),
            },
        )

    def grew_before(self) -> bool:
        return MEMORY_GROWTH.slug in self.fired or any(len(self.growing(key)) >= 3 for key in self.series)

    def _oom(self, step: int, oom: Mapping[str, Any]) -> list[Finding]:
        grew = self.grew_before()
        verdict = "memory grew before it: fix the leak first" if grew else "memory was flat before it"
        return self.fire(
            OOM,
            f"out of memory at step {step}; {verdict}",
            step=step,
            evidence={"growth_before": grew, **{k: v for k, v in oom.items()}},
        )


# -- finding held tensors -----------------------------------------------------------------------------
_SKIP_MODULES = ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "hf_sanity", "numpy")


_ATOMS = (
    str, bytes, int, float, bool, type(None), type, types.ModuleType, types.FunctionType,
    types.BuiltinFunctionType, types.MethodType,
)  # fmt: skip


def graph_tensors(
    roots: Iterable[tuple[str, Any]], *, depth: int = 4, limit: int = 200_000
) -> dict[str, int]:
    """Tensors with autograd history reachable from ``roots`` (name, object), counted per holding path.

    Walks instance attributes, lists, tuples, dicts, sets and deques (not into tensors, modules' parameters
    or library internals), each object once, up to ``limit`` objects.
    """
    import collections

    import torch

    found: dict[str, int] = {}
    seen: set[int] = set()
    counted: set[int] = set()
    stack: list[tuple[str, Any, int]] = [(name, obj, 0) for name, obj in roots]
    visited = 0
    while stack and visited < limit:
        path, obj, level = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        visited += 1
        if isinstance(obj, torch.Tensor):
            if obj.grad_fn is not None and id(obj) not in counted:
                counted.add(id(obj))
                holder = path.rsplit("[", 1)[0]
                found[holder] = found.get(holder, 0) + 1
            continue
        if level >= depth or isinstance(obj, _ATOMS):
            continue
        if isinstance(obj, dict):
            items = list(obj.items())[:10_000]
            stack.extend((f"{path}[{k!r}]", v, level + 1) for k, v in items)
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend((f"{path}[{i}]", v, level + 1) for i, v in enumerate(list(obj)[:10_000]))
        elif isinstance(obj, torch.nn.Module):
            attrs = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
            stack.extend((f"{path}.{k}", v, level + 1) for k, v in attrs.items())
            stack.extend((f"{path}.{k}", v, level) for k, v in obj.named_children())
        elif isinstance(obj, torch.optim.Optimizer):
            continue
        elif hasattr(obj, "__dict__") and (level == 0 or not _library_object(obj)):
            stack.extend((f"{path}.{k}", v, level + 1) for k, v in vars(obj).items())
    return found


def _library_object(obj) -> bool:
    module = type(obj).__module__ or ""
    return module.split(".")[0] in _SKIP_MODULES and not module.startswith("transformers.trainer")


def user_globals(*objects) -> list[tuple[str, Any]]:
    """The module globals of the user code behind ``objects`` (their classes and functions), as roots."""
    roots: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for obj in objects:
        if obj is None:
            continue
        if isinstance(
            obj, type
        ):  # class attributes of the user's subclasses (a list on the Trainer subclass)
            for cls in obj.__mro__:
                if (cls.__module__ or "").split(".")[0] not in (*_SKIP_MODULES, "builtins"):
                    roots.append(
                        (cls.__name__, {k: v for k, v in vars(cls).items() if not k.startswith("__")})
                    )
        func = getattr(obj, "__func__", obj)
        name = getattr(func, "__module__", None) if callable(func) and not isinstance(func, type) else None
        name = name or type(obj).__module__
        if not name or name in seen or name.split(".")[0] in _SKIP_MODULES or name == "builtins":
            continue
        seen.add(name)
        module = sys.modules.get(name)
        if module is not None:
            roots.append((name, {k: v for k, v in vars(module).items() if not k.startswith("__")}))
        closure = getattr(func, "__closure__", None)
        if closure:
            roots.extend(
                (f"{getattr(func, '__qualname__', 'closure')}.<closure>", c.cell_contents)
                for c in closure
                if _cell_ok(c)
            )
    return roots


def _cell_ok(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def roots(trainer, model, *, skip=None) -> list[tuple[str, Any]]:
    """Where tensors kept across steps live: the trainer (its model, attributes, callbacks), the user's
    subclass and module globals, the loss function's closure."""
    found: list[tuple[str, Any]] = []
    if trainer is None:
        return [("model", model)] if model is not None else []
    found.append(("trainer", trainer))
    found += user_globals(type(trainer), getattr(trainer, "compute_loss_func", None))
    for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", []):
        if callback is not skip:
            found.append((f"callbacks.{type(callback).__name__}", callback))
    return found


def allocated(model) -> int | None:
    """Accelerator memory allocated on the model's device (a host-side counter: no synchronisation)."""
    import torch

    param = next(iter(model.parameters()), None) if model is not None else None
    if param is None or not param.is_cuda:
        return None
    return torch.cuda.memory_allocated(param.device)


def is_oom(exc: BaseException) -> bool:
    import torch

    oom_type = getattr(torch, "OutOfMemoryError", None)
    return (oom_type is not None and isinstance(exc, oom_type)) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def gc_graph_tensors() -> int:
    """Every live tensor with autograd history the garbage collector knows of."""
    import gc

    import torch

    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.grad_fn is not None)


def memory_breakdown(model, optimizer) -> dict[str, Any]:
    """Bytes held by parameters, gradients and optimizer state, and the allocator's view where there is one."""
    import torch

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    params = list(model.parameters()) if model is not None else []
    out: dict[str, Any] = {
        "parameters_bytes": nbytes(params),
        "gradients_bytes": nbytes(p.grad for p in params if p.grad is not None),
    }
    if optimizer is not None:
        state = getattr(optimizer, "state", {}) or {}
        out["optimizer_state_bytes"] = nbytes(
            v for s in state.values() for v in (s.values() if isinstance(s, dict) else ())
        )
    if torch.cuda.is_available() and params and params[0].is_cuda:
        device = params[0].device
        out["allocated_bytes"] = torch.cuda.memory_allocated(device)
        out["reserved_bytes"] = torch.cuda.memory_reserved(device)
        out["max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out["total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return {k: v for k, v in out.items() if not (isinstance(v, float) and math.isnan(v))}
