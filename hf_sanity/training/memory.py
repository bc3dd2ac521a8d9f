"""Memory held across steps, measured for `memory-growth` and `oom`.

:func:`graph_tensors` finds tensors that still carry autograd history between steps by walking the attributes
of the objects that live across steps (trainer, model, callbacks, the loss function and the user's module
globals); :func:`allocated` reads the accelerator's allocator; :func:`memory_breakdown` says what the memory
held when training died of it.
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Iterable
from typing import Any

# What memory-growth and oom read of a walk (:func:`held_now`).
WALKED = ("graph_tensors", "holders", "allocated")
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
    found: dict[str, int] = {}
    seen: set[int] = set()
    counted: set[int] = set()
    kinds = _KINDS
    # A path is spelled out only for a tensor found: each stack entry carries (parent, how, key) instead.
    stack: list[tuple[Any, Any, int]] = [((None, _ROOT, name), obj, 0) for name, obj in roots]
    visited = 0
    while stack and visited < limit:
        node, obj, level = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        visited += 1
        cls = type(obj)
        kind = kinds.get(cls)
        if kind is None:
            kind = _kind(cls)
        if kind == _TENSOR:
            if obj.grad_fn is not None and id(obj) not in counted:
                counted.add(id(obj))
                holder = _spelled(node).rsplit("[", 1)[0]
                found[holder] = found.get(holder, 0) + 1
            continue
        if level >= depth or kind in (_ATOM, _SKIPPED):
            continue
        if kind == _MAPPING:
            items = list(obj.items())[:10_000]
            stack.extend(((node, _KEY, k), v, level + 1) for k, v in items)
        elif kind == _SEQUENCE:
            stack.extend(((node, _INDEX, i), v, level + 1) for i, v in enumerate(list(obj)[:10_000]))
        elif kind == _MODULE:
            attrs = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
            stack.extend(((node, _ATTR, k), v, level + 1) for k, v in attrs.items())
            stack.extend(((node, _ATTR, k), v, level) for k, v in obj.named_children())
        elif hasattr(obj, "__dict__") and (level == 0 or kind == _PLAIN):
            stack.extend(((node, _ATTR, k), v, level + 1) for k, v in vars(obj).items())
    return found


# What the walk does with an object, by its class: decided once per class (a walk meets a few dozen classes and
# a few hundred objects; one lookup each instead of a row of isinstance checks).
_TENSOR, _ATOM, _MAPPING, _SEQUENCE, _MODULE, _SKIPPED, _LIBRARY, _PLAIN = range(8)
_KINDS: dict[type, int] = {}


def _kind(cls: type) -> int:
    import collections

    import torch

    if issubclass(cls, torch.Tensor):
        kind = _TENSOR
    elif issubclass(cls, _ATOMS):
        kind = _ATOM
    elif issubclass(cls, dict):
        kind = _MAPPING
    elif issubclass(cls, (list, tuple, set, frozenset, collections.deque)):
        kind = _SEQUENCE
    elif issubclass(cls, torch.nn.Module):
        kind = _MODULE
    elif issubclass(cls, torch.optim.Optimizer):
        kind = _SKIPPED
    else:  # a library's object is walked into only as a root
        kind = _LIBRARY if _library_class(cls) else _PLAIN
    _KINDS[cls] = kind
    return kind


_ROOT, _KEY, _INDEX, _ATTR = range(4)


def _spelled(node) -> str:
    """The path of a walk node: ``root.attr[index]['key']``."""
    parts = []
    while node is not None:
        node, how, key = node
        parts.append(
            key
            if how == _ROOT
            else f"[{key!r}]"
            if how == _KEY
            else f"[{key}]"
            if how == _INDEX
            else f".{key}"
        )
    return "".join(reversed(parts))


def _library_class(cls: type) -> bool:
    module = cls.__module__ or ""
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


def held_now(trainer, model, *, skip=None) -> dict[str, Any]:
    """One memory check: tensors with autograd history held across steps (and by whom), and the accelerator's
    allocated bytes where there is an accelerator."""
    holders = graph_tensors(roots(trainer, model, skip=skip))
    values: dict[str, Any] = {"graph_tensors": sum(holders.values()), "holders": holders}
    in_use = allocated(model)
    if in_use is not None:
        values["allocated"] = in_use
    return values


def oom_facts(exc: BaseException, model, optimizer, guard) -> dict[str, Any]:
    """What the out-of-memory error says and what memory held (the breakdown in its own ``guard(check)``: with
    memory short, the error is reported even if the breakdown fails)."""
    text = str(exc).strip()
    facts: dict[str, Any] = {"error": text.splitlines()[0][:300] if text else type(exc).__name__}
    with guard("oom"):
        facts.update(memory_breakdown(model, optimizer))
    return facts


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


def memory_breakdown(model, optimizer) -> dict[str, Any]:
    """Bytes this rank holds in parameters, gradients and optimizer state (its shards only, under FSDP or
    ZeRO-3), and the allocator's view where there is one."""
    import torch

    from hf_sanity.training.shards import local_tensor

    def nbytes(tensors) -> int:
        held = (local_tensor(t) for t in tensors if isinstance(t, torch.Tensor))
        return sum(t.numel() * t.element_size() for t in held)

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
