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
