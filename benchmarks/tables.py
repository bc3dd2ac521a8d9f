"""The benchmarks' tables: rows of one dict each, printed as markdown (docs/benchmarks.md takes them as they are).
Its own module, so that a benchmark run alone (``python -m benchmarks.callback_overhead``) and `make bench`
(``benchmarks.run``) share it without importing each other."""

from __future__ import annotations


def table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    keys = list(rows[0])
    fmt = {k: (lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)) for k in keys}
    cells = [[fmt[k](r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = "| " + " | ".join(k.ljust(w) for k, w in zip(keys, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join([line, rule, *body])
