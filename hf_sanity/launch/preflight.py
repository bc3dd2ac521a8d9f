"""``preflight(trainer=...)`` on the trainer a command built (``hf-sanity preflight -- CMD``), in the command's own
process, where its ``train()`` would have started.

Under a launcher every rank runs it on its own trainer (an SFT trainer's dataloader holds that rank's shard;
every rank must draw from it alike: accelerate synchronises the dataloaders' random state), then one gather
brings the other ranks' findings to rank 0, which keeps each rule once (its own finding, else the lowest rank's,
marked with its ``rank``) and reports. A rank whose checks raised sends its error instead, so that no rank waits
on a gather another never reaches.
"""

from __future__ import annotations

import dataclasses

from hf_sanity.launch.protocol import Settings


def check(trainer, settings: Settings):
    """The report of ``trainer`` on rank 0 (None on the other ranks); the checks' own error is raised on rank 0
    (a ``UserInputError``: one line for the parent)."""
    from hf_sanity.drivers.preflight import preflight

    report, failure = None, None
    try:
        report = preflight(
            trainer=trainer, select=settings.select, ignore=settings.ignore, sample=settings.sample,
            show=settings.show,
        )  # fmt: skip
    except Exception as exc:
        failure = exc
    rank, size = _world()
    if size > 1:
        report, failure = _gathered(report, failure, rank, size)
    if rank != 0:
        return None
    if failure is not None:
        raise failure
    return report


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gathered(report, failure, rank: int, size: int):
    """Every rank's findings (or error) on rank 0, merged into rank 0's report."""
    import torch.distributed as dist

    from hf_sanity.measure.distributed import object_group

    mine = {
        "failure": None if failure is None else f"{type(failure).__name__}: {failure}",
        "findings": [] if report is None else [dataclasses.replace(f, remedy=None) for f in report.findings],
    }
    parts = [None] * size if rank == 0 else None
    dist.gather_object(mine, parts, dst=0, group=object_group())
    if rank != 0 or report is None:
        return report, failure
    for other, part in enumerate(parts[1:], start=1):
        if part["failure"] is not None:
            report.notes.append(
                f"rank {other} could not be checked ({part['failure']}): its shard is not in the report"
            )
        for finding in part["findings"]:
            if finding.rule not in report.rules():
                finding.evidence["rank"] = other
                report.add(finding)
    report.stats["processes"] = size
    return report, failure
