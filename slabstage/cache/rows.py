"""A free list of row runs in one arena, each run freed with the events of queued work that still reads it."""

from __future__ import annotations

from bisect import insort

__all__ = ["Rows"]


def done(events) -> bool:
    """Every event in ``events`` (CUDA events, or nothing on the CPU) has completed."""
    return all(e.query() for e in events)


class Rows:
    """Runs ``[start, start + length)`` of ``total`` rows. :meth:`take` hands out the first run long enough
    whose readers are done (no host sync); :meth:`give` returns a run with the events that must complete
    before it is written again. Adjacent free runs that nobody reads merge."""

    def __init__(self, total: int) -> None:
        self.free = [[0, total, []]] if total else []  # sorted by start: [start, length, events]

    def free_rows(self) -> int:
        return sum(r[1] for r in self.free)

    def take(self, n: int) -> int | None:
        """The first row of a run of ``n`` rows nobody reads any more, or None."""
        at = self._take(n)
        if at is None and any(run[2] for run in self.free):  # readers done since: their runs merge
            self._tidy()
            at = self._take(n)
        return at

    def _take(self, n: int) -> int | None:
        for i, run in enumerate(self.free):
            start, length, events = run
            if length < n or not done(events):
                continue
            if length == n:
                del self.free[i]
            else:
                run[0], run[1], run[2] = start + n, length - n, []
            return start
        return None

    def pending(self) -> list:
        """The events of free runs not yet done (what a host far ahead of the device may wait for)."""
        return [e for run in self.free for e in run[2] if not e.query()]

    def give(self, start: int, n: int, events) -> None:
        """Rows ``[start, start + n)`` are free once ``events`` complete."""
        if not n:
            return
        insort(self.free, [start, n, [e for e in events if not e.query()]])
        self._tidy()

    def _tidy(self) -> None:
        """Forget readers that are done; merge adjacent runs nobody reads."""
        merged = []
        for run in self.free:
            if run[2] and done(run[2]):
                run[2] = []
            if merged and merged[-1][0] + merged[-1][1] == run[0] and not merged[-1][2] and not run[2]:
                merged[-1][1] += run[1]
            else:
                merged.append(run)
        self.free = merged
