"""A share of the run's wall time for an optional check that has no collective in it (the memory walk, the
predictions probe where it runs alone).

The check runs when what it has cost so far is within ``share`` of the time since its first run, so on a run
of short steps it runs at a sparser cadence than the reads that offer it, and on long steps at every one. Its
first ``free`` runs are always due: a growth needs a few consecutive points to show.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

SHARE = 0.001  # at most 0.1% of the run's wall time for each such check (a ~15 ms step has ~3% to share)
FREE_RUNS = 4  # a growth shows over 3 rises: the first 4 checks always run


class Budget:
    def __init__(
        self, share: float = SHARE, free: int = FREE_RUNS, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.share, self.free, self.clock = share, free, clock
        self.spent = 0.0
        self.runs = 0
        self.skipped = 0
        self._began: float | None = None

    def due(self) -> bool:
        now = self.clock()
        if self._began is None:
            self._began = now
        if self.runs < self.free or self.spent <= self.share * (now - self._began):
            return True
        self.skipped += 1
        return False

    @contextlib.contextmanager
    def spend(self) -> Iterator[None]:
        started = self.clock()
        try:
            yield
        finally:
            self.spent += self.clock() - started
            self.runs += 1
