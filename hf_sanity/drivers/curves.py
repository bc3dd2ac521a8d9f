"""The curve detectors on one run's curves: `doctor` on a finished run, `SanityCallback` at each evaluation."""

from __future__ import annotations

from hf_sanity import catalog
from hf_sanity.findings import Finding
from hf_sanity.measure.curves import Curves
from hf_sanity.selection import Selection


def analyze(
    curves: Curves,
    *,
    final: bool,
    online: bool | None = None,
    selection: Selection | None = None,
    ran: set[str] | None = None,
) -> list[Finding]:
    """Every curve detector on ``curves``, each guarded (a detector that raises becomes an ``internal-error``
    finding). ``final=False`` while training still runs: the detectors that judge a whole run are skipped.
    ``online=True``: only those SanityCallback runs (the step monitors cover the others). ``ran`` collects the
    names of the detectors that ran."""
    found: list[Finding] = []
    for detector in catalog.detectors("curve", online=online):
        if detector.final and not final:
            continue
        if selection is not None and not selection.enabled(detector.rule):
            continue
        found.extend(catalog.run(detector, curves))
        if ran is not None:
            ran.add(detector.name)
    return found
