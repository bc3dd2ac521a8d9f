"""Extra work (a probe forward, a look at the dataloader) must not change the user's run."""

from __future__ import annotations

import contextlib
import random


@contextlib.contextmanager
def preserved_rng():
    """Restore Python's, NumPy's and torch's (CPU and CUDA) global RNG states on exit."""
    import numpy as np
    import torch

    py_state = random.getstate()
    np_state = np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


@contextlib.contextmanager
def untouched(model, *, train: bool = False):
    """Run extra passes on the user's model without leaving a trace: its train/eval mode, the RNG states and
    every parameter's ``.grad`` are restored on exit. ``train`` is the mode the passes run in."""
    was_training = model.training
    saved = {p: p.grad for p in model.parameters()}
    for p in saved:
        p.grad = None
    model.train(train)
    try:
        with preserved_rng():
            yield
    finally:
        for p, grad in saved.items():
            p.grad = grad
        model.train(was_training)
