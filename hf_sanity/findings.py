"""The one result type every check produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hf_sanity.jsonvalues import jsonable
from hf_sanity.report_schema import SEVERITIES, FindingRecord, Severity

if TYPE_CHECKING:
    from hf_sanity.outputview import OutputView
    from hf_sanity.remedies import Remedy
    from hf_sanity.tokenview import TokenView

SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}


@dataclass
class Finding:
    """One diagnosed problem: which rule, how bad, the key number, the evidence, and the fix.

    ``evidence`` must be JSON-serialisable (counts, fractions, row indices, the offending step);
    ``example`` is the token view of the first offending example, where tokens are involved, or the
    side-by-side view (prompt / generation / reference) of a generated output; ``remedy`` is the repair
    `hf-sanity fix` can apply to a copy of the setup (``hf_sanity.remedies``), where the rule has one.
    """

    rule: str
    severity: Severity
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""
    step: int | None = None
    example: TokenView | OutputView | None = None
    # Every offending row (``evidence["rows"]`` lists the first ten): for `--rows-out` and dataset.filter.
    rows: list[int] | None = field(default=None, repr=False)
    remedy: Remedy | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")
        self.evidence = jsonable(self.evidence)

    def to_dict(self) -> dict[str, Any]:
        """The finding as the report file has it (hf_sanity.report_schema.FindingRecord)."""
        return FindingRecord.from_finding(self).to_dict()
