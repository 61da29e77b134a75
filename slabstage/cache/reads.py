"""Which queued device work reads which cache entries, at no CUDA call per launch (docs/encoder_cache.md).

:meth:`Reads.note` files the stream's *mark* under each entry a launch just queued reads; only when the entry's
rows are freed or rewritten (:meth:`Reads.take`) does the mark record one CUDA event, which covers every launch
filed under it (work on one stream completes in order) and names its stream (``event.on``, the raw handle): a
writer on that stream needs no wait for it. On the CPU nothing is filed: a launch has finished when
it returns.
"""

from __future__ import annotations

import torch

__all__ = ["Reads"]


class _Mark:
    """Launches queued on one stream since the mark was made; :meth:`event` records the event that follows
    them all (once: later launches are filed under a new mark), its ``on`` the stream's raw handle."""

    __slots__ = ("stream", "raw", "recorded")

    def __init__(self, stream, raw) -> None:
        self.stream, self.raw, self.recorded = stream, raw, None

    def event(self) -> torch.cuda.Event:
        if self.recorded is None:
            self.recorded = torch.cuda.Event()
            self.recorded.record(self.stream)
            self.recorded.on = self.raw
        return self.recorded

    def query(self) -> bool:  # (not yet turned into an event: its launches may still be queued)
        return self.recorded is not None and self.recorded.query()


def _recorded(events) -> list:
    """``events`` as events: each mark recorded (once) after the launches filed under it."""
    return [e.event() if type(e) is _Mark else e for e in events]


class Reads:
    """Per entry slot, what queued work reads it (a list per slot; one stream at a time keeps only the last:
    work on one stream completes in order)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.events: list = []  # per slot: marks or events of work still queued that may read it
        self._marks: dict = {}  # raw stream handle -> its mark not yet turned into an event
        self._stream = None  # the raw handle of the one stream every launch so far was noted on
        self._mixed = False

    def grow(self, slots: int) -> None:
        self.events.extend([] for _ in range(slots - len(self.events)))

    def note(self, slots, event=None, stream=None) -> None:
        """Queued work reads entry ``slots``: on CUDA, work just queued on ``stream`` (``(raw handle,
        torch.cuda.Stream)``; None: the current stream); or ``event``, anything with ``query()`` and
        ``synchronize()``, stands for that work."""
        if event is None:
            if not self.cuda:
                return
            if stream is None:
                s = torch.cuda.current_stream(self.device)
                stream = (s.cuda_stream, s)
            raw = stream[0]
            event = self._marks.get(raw)
            if event is None or event.recorded is not None:
                event = self._marks[raw] = _Mark(stream[1], raw)
        else:  # (its stream unknown: it does not cover the readers before it, nor they it)
            raw = None
            self._mixed, self._stream = True, None
        if raw is not None and not self._mixed:
            if self._stream is None:
                self._stream = raw
            elif self._stream != raw:
                self._mixed, self._stream = True, None
        events = self.events
        if raw is None or self._mixed:  # several streams, or one unknown: keep every reader not yet done
            for s in slots:
                kept = [e for e in events[s] if e is not event and not e.query()]
                kept.append(event)
                events[s] = kept
        else:  # one stream: the last reader covers every earlier one
            one = [event]
            for s in slots:
                events[s] = one  # (shared: a slot's list is replaced, never changed in place)

    def take(self, slot: int) -> list:
        """The events of ``slot``'s readers (the slot is being freed or rewritten): they travel with its rows."""
        events, self.events[slot] = self.events[slot], []
        return _recorded(events)

    def pending(self, slot: int) -> list:
        """The events of ``slot``'s users not yet done, which stay filed (work that must run before its rows
        are read elsewhere)."""
        return [e for e in _recorded(self.events[slot]) if not e.query()]
