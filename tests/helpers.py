"""Small helpers for rule tests: run preflight with only the rules under test selected."""

from __future__ import annotations

import datasets

from hf_sanity.preflight import preflight


def run(tokenizer, rows, *, select=None, **kwargs):
    data = rows if isinstance(rows, datasets.Dataset) else datasets.Dataset.from_list(rows)
    return preflight(tokenizer=tokenizer, dataset=data, select=select, use_config=False, **kwargs)


def slugs(report) -> set[str]:
    return {f.rule for f in report.findings}


def above_info(report) -> list[str]:
    return [f"{f.rule}: {f.message}" for f in report.findings if f.severity != "info"]
