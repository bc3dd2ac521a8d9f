"""Plain JSON values out of what checks measure: a leaf module (nothing of hf_sanity imported), so that the
finding, the remedy and the report can all use it without importing one another."""

from __future__ import annotations

import math
from typing import Any


def jsonable(value: Any) -> Any:
    """Turn numpy/torch scalars, tuples, sets and non-finite floats into plain JSON values."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [jsonable(v) for v in items]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # numpy / torch scalar
        return jsonable(value.item())
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    return str(value)
