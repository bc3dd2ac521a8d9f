"""Extra work (a probe forward, a replay, a look at the dataloader) must not change the user's run.

:func:`untouched` is the one way hf-sanity runs extra passes on the user's model: every module's train/eval
mode, the RNG states and every parameter's ``.grad`` come back exactly as they were.
"""

from __future__ import annotations

import contextlib
import random


@contextlib.contextmanager
def preserved_rng():
    """Restore Python's, NumPy's and torch's (CPU and, where initialised, CUDA) global RNG states on exit. CUDA's
    only where initialised: reading a device's state would initialise it (a context on every GPU of a process
    that uses none, and one a forked child can no longer use)."""
    import numpy as np
    import torch

    py_state = random.getstate()
    np_state = np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


@contextlib.contextmanager
def untouched(model, *, train: bool = False, grad: bool = False):
    """Run extra passes on the user's model without leaving a trace.

    On exit every module's own train/eval mode (a submodule the user froze in eval mode stays in eval), the RNG
    states and every parameter's ``.grad`` are restored. ``train`` is the mode the passes run in; without
    ``grad`` they run under ``torch.no_grad()``.
    """
    import torch

    modes = [(module, module.training) for module in model.modules()]
    saved = {p: p.grad for p in model.parameters()}
    for p in saved:
        p.grad = None
    model.train(train)
    try:
        with preserved_rng(), contextlib.nullcontext() if grad else torch.no_grad():
            yield
    finally:
        for p, old in saved.items():
            p.grad = old
        for module, mode in modes:
            module.training = mode
