"""Reads: launches on a stream share one mark; the mark records one event, on that stream, only when an entry
it covers is freed (CUDA events replaced by a fake recorder, so this runs on the CPU)."""

from __future__ import annotations

import torch

from slabstage.cache import reads as reads_mod
from slabstage.cache.reads import Reads


class FakeEvent:
    made: list = []

    def __init__(self) -> None:
        self.stream, self.done = None, False
        FakeEvent.made.append(self)

    def record(self, stream) -> None:
        self.stream = stream

    def query(self) -> bool:
        return self.done


def test_one_mark_per_stream_until_an_entry_is_freed(monkeypatch):
    monkeypatch.setattr(reads_mod.torch.cuda, "Event", FakeEvent)
    FakeEvent.made = []
    r = Reads(torch.device("cuda", 0))
    r.grow(4)
    s = (11, "stream-a")
    r.note((0, 1), stream=s)
    r.note((1, 2), stream=s)
    assert not FakeEvent.made  # no event per launch
    assert r.events[0][0] is r.events[2][0]  # one mark for both launches
    got = r.take(1)
    assert len(FakeEvent.made) == 1 and got == FakeEvent.made and got[0].stream == "stream-a"
    assert r.take(0) == got  # the same event covers the first launch (recorded after it)
    r.note((3,), stream=s)  # a later launch: a new mark, a new event when freed
    later = r.take(3)
    assert len(FakeEvent.made) == 2 and later[0] is not got[0]
    assert r.take(2) == got and r.take(2) == []


def test_two_streams_keep_each_reader(monkeypatch):
    monkeypatch.setattr(reads_mod.torch.cuda, "Event", FakeEvent)
    FakeEvent.made = []
    r = Reads(torch.device("cuda", 0))
    r.grow(2)
    r.note((0,), stream=(1, "a"))
    r.note((0,), stream=(2, "b"))
    r.note((0, 1), stream=(1, "a"))  # (the same mark as the first launch: kept once)
    got = r.take(0)
    assert sorted(e.stream for e in got) == ["a", "b"] and len(FakeEvent.made) == 2
    assert [e.stream for e in r.take(1)] == ["a"] and len(FakeEvent.made) == 2


def test_cpu_files_nothing():
    r = Reads(torch.device("cpu"))
    r.grow(1)
    r.note((0,))
    assert r.take(0) == []


def test_a_reader_given_as_an_event_is_kept_beside_later_stream_readers(monkeypatch):
    """An explicit event (its stream unknown) covers nothing and is covered by nothing: a later launch on
    one stream does not replace it, so its rows wait for both."""
    monkeypatch.setattr(reads_mod.torch.cuda, "Event", FakeEvent)
    FakeEvent.made = []
    r = Reads(torch.device("cuda", 0))
    r.grow(1)
    explicit = FakeEvent()
    r.note((0,), event=explicit)
    r.note((0,), stream=(1, "a"))
    got = r.take(0)
    assert explicit in got and any(e.stream == "a" for e in got)
