"""The optimizer of a working copy: the user's own rebuilt over the copy's parameters (same class, same param
groups, fresh state), or AdamW."""

from __future__ import annotations

from hf_sanity.protocol.pipeline import NullOptimizer


def adamw(model, lr: float):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if params else NullOptimizer()


def remap_optimizer(optimizer, original, model, lr: float):
    """The user's optimizer rebuilt over ``model`` (a copy of ``original``): same class, same param groups (by
    parameter name), fresh state. Parameters the original model does not own are dropped (counted)."""
    names = {id(p): n for n, p in original.named_parameters()}
    copied = dict(model.named_parameters())
    groups, foreign = [], 0
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None or name not in copied:
                foreign += 1
                continue
            params.append(copied[name])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params, "lr": lr})
    if not any(g["params"] for g in groups):
        rebuilt = NullOptimizer()
        rebuilt.param_groups = groups
    else:
        rebuilt = _same_class(optimizer, [g for g in groups if g["params"]], lr)
    rebuilt._hf_sanity_foreign = foreign
    return rebuilt


def _same_class(optimizer, groups: list[dict], lr: float):
    """A fresh optimizer of ``optimizer``'s class over ``groups``, with its defaults."""
    import inspect

    import torch

    cls = type(optimizer)
    defaults = {k: v for k, v in optimizer.defaults.items() if k != "lr"}
    try:
        accepted = inspect.signature(cls.__init__).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            defaults = {k: v for k, v in defaults.items() if k in accepted}
        return cls(groups, lr=lr, **defaults)
    except Exception:  # a constructor we cannot call: the same class, initialised as torch's base class does
        rebuilt = cls.__new__(cls)
        torch.optim.Optimizer.__init__(rebuilt, groups, {**optimizer.defaults, "lr": lr})
        return rebuilt
