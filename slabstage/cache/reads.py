"""Which queued device work reads which cache entries: one event per staging launch or replay.

:meth:`Reads.note` is called by the stager right after it queues a launch (or a replay) that reads entries:
it records one event on the current stream and files it under each entry read. An entry is evicted or
overwritten only after its events complete (its rows go back to the free list with them). On the CPU every
launch has finished when it returns: nothing is recorded.
"""

from __future__ import annotations

import torch

__all__ = ["Reads"]


class Reads:
    """Per entry slot, the events of queued work that reads it (a list per slot; one stream at a time keeps
    only the last: work on one stream completes in order)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.events: list = []  # per slot: events of work still queued that may read it
        self._stream = None  # the one stream every event so far was recorded on (None: none yet, or several)
        self._mixed = False

    def grow(self, slots: int) -> None:
        self.events.extend([] for _ in range(slots - len(self.events)))

    def note(self, slots, event=None) -> None:
        """Queued work on the current stream reads entry ``slots``: an event is recorded there (or ``event``,
        anything with ``query()`` and ``synchronize()``, stands for that work)."""
        if event is None:
            if not self.cuda:
                return
            stream = torch.cuda.current_stream(self.device)
            event = torch.cuda.Event()
            event.record(stream)
        else:
            stream = self._stream
        if self._stream is None and not self._mixed:
            self._stream = stream
        elif self._stream != stream:
            self._mixed, self._stream = True, None
        events = self.events
        if self._mixed:  # several streams: keep every event not yet done
            for s in slots:
                kept = [e for e in events[s] if not e.query()]
                kept.append(event)
                events[s] = kept
        else:  # one stream: the last event covers every earlier one
            for s in slots:
                events[s] = [event]

    def take(self, slot: int) -> list:
        """The events of ``slot``'s readers (the slot is being freed or rewritten): they travel with its rows."""
        events, self.events[slot] = self.events[slot], []
        return events
