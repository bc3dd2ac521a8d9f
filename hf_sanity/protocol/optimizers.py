"""The optimizer of a working copy: the user's own rebuilt over the copy's parameters (same class, same param
groups, fresh state), or AdamW."""

from __future__ import annotations

from hf_sanity.errors import UserInputError
from hf_sanity.protocol.loop import first_line
from hf_sanity.protocol.pipeline import NullOptimizer


def adamw(model, lr: float):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if params else NullOptimizer()


def unwrapped(optimizer):
    """The optimizer a wrapper steps: Trainer puts accelerate's ``AcceleratedOptimizer`` around its optimizer
    in ``train()`` (``.optimizer``); the class to rebuild is the one inside."""
    import torch

    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def remap_optimizer(optimizer, original, model, lr: float):
    """The user's optimizer rebuilt over ``model`` (a copy of ``original``): same class, built by its own
    constructor, same param groups (by parameter name), fresh state. Parameters the original model does not
    own are dropped (counted)."""
    optimizer = unwrapped(optimizer)
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
    """A fresh optimizer of ``optimizer``'s class over ``groups``: ``type(optimizer)(groups, **defaults)``, so
    that whatever its ``__init__`` sets up is there (torch's optimizers keep every constructor argument in
    ``defaults``). One that cannot be built that way is bad input, said in one line: an optimizer assembled
    without its constructor would step differently from the user's, or not at all."""
    import inspect

    cls = type(optimizer)
    defaults = {**optimizer.defaults, "lr": lr}
    accepted = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        defaults = {k: v for k, v in defaults.items() if k in accepted}
    try:
        return cls(groups, **defaults)
    except Exception as exc:
        raise UserInputError(
            f"cannot rebuild the optimizer {cls.__name__} for the copy of the model that overfit and diagnose "
            f"train: {cls.__name__}(param_groups, **optimizer.defaults) raised {first_line(exc)}; keep its "
            "constructor's arguments in optimizer.defaults (as torch's optimizers do), or leave the optimizer to "
            "the Trainer (or to overfit: AdamW)"
        ) from None
