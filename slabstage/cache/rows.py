"""A free list of row runs in one arena, each run freed with the events of queued work that still reads or
writes it."""

from __future__ import annotations

from bisect import insort

__all__ = ["Rows"]


def _live(events) -> list:
    """The events in ``events`` not yet complete (CUDA events; nothing on the CPU)."""
    return [e for e in events if not e.query()] if events else []


class Rows:
    """Runs ``[start, start + length)`` of ``total`` rows. :meth:`give` returns a run with the events of the queued
    work that still uses it; :meth:`take` hands out a run and the events a writer on another stream must wait for
    (on the device: the host never waits). Adjacent free runs merge, their events with them."""

    def __init__(self, total: int) -> None:
        self.free = [[0, total, []]] if total else []  # sorted by start: [start, length, events]

    def free_rows(self) -> int:
        return sum(r[1] for r in self.free)

    def take(self, n: int, here=None) -> tuple[int, list] | None:
        """``(first row, events)`` of ``n`` rows, or None when no free run is that long: the first run whose users
        are done or queued on the stream ``here`` (raw handle; work there runs before anything queued after it),
        else the first run long enough, with the events of its users on other streams (a writer queues a wait for
        each first). The rest of a run keeps its events."""
        first = None
        for i, run in enumerate(self.free):
            if run[1] < n:
                continue
            run[2] = live = _live(run[2])
            elsewhere = [e for e in live if here is None or getattr(e, "on", None) != here]
            if not elsewhere:
                return self._cut(i, n), []
            if first is None:
                first = i, elsewhere
        if first is None:
            return None
        return self._cut(first[0], n), first[1]

    def _cut(self, i: int, n: int) -> int:
        run = self.free[i]
        start = run[0]
        if run[1] == n:
            del self.free[i]
        else:
            run[0], run[1] = start + n, run[1] - n
        return start

    def give(self, start: int, n: int, events) -> None:
        """Rows ``[start, start + n)`` are free; ``events``: the queued work that still uses them."""
        if not n:
            return
        insort(self.free, [start, n, _live(events)])
        merged = []
        for run in self.free:
            last = merged[-1] if merged else None
            if last is not None and last[0] + last[1] == run[0]:
                last[1] += run[1]
                last[2] = list({id(e): e for e in _live(last[2]) + _live(run[2])}.values())  # (one mark's event once)
            else:
                merged.append(run)
        self.free = merged
