"""Rules about hf-sanity itself."""

from __future__ import annotations

import traceback

from hf_sanity.catalog import define
from hf_sanity.findings import Finding

INTERNAL_ERROR = define(
    "internal-error",
    severity="warning",
    stage="internal",
    symptom="A check of hf-sanity raised an exception. Your run was not affected; the check was skipped.",
    detects="Every check runs inside a guard; an exception becomes this finding instead of reaching your code.",
    fix="Report it at the hf-sanity issue tracker with the evidence below; silence it with --ignore <slug>.",
)


def internal_error(check: str, exc: BaseException, step: int | None = None) -> Finding:
    """A broken check, as a finding: the run goes on."""
    tail = traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]
    return INTERNAL_ERROR.finding(
        f"check {check!r} failed with {type(exc).__name__}: {exc}",
        evidence={"check": check, "exception": type(exc).__name__, "traceback": "".join(tail).strip()},
        step=step,
    )
