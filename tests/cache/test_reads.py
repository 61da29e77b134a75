"""Reads: launches on a stream share one mark; the mark records one event, on that stream, only when an entry
it covers is freed (CUDA events replaced by a fake recorder, so this runs on the CPU)."""

from __future__ import annotations

import pytest
import torch

from builders import Later  # noqa: I001 - tests/builders.py

from slabstage.cache import EncoderCache, reads as reads_mod
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


class FakeStream:
    """A stream as the cache sees it: its handle, events recorded on it, the events it was told to wait for."""

    def __init__(self, handle: int) -> None:
        self.cuda_stream, self.waits = handle, []

    def record_event(self):
        event = Later()
        event.stream = self
        return event

    def wait_event(self, event) -> None:
        self.waits.append(event)


def _cuda_cache(monkeypatch, rows: int, host_rows: int, streams: dict):
    """A host EncoderCache whose bookkeeping runs as on CUDA: fake events, the current stream ``streams["now"]``."""
    monkeypatch.setattr(reads_mod.torch.cuda, "Event", Later)
    monkeypatch.setattr(Later, "record", lambda self, stream: setattr(self, "stream", stream), raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams["now"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cache = EncoderCache(4, torch.float32, "cpu", rows * 16, host_budget_bytes=host_rows * 16)
    cache.reads.cuda = cache.writes.cuda = True
    return cache


def test_a_put_queued_on_one_stream_keeps_its_rows_from_a_put_on_another(monkeypatch):
    """An entry evicted while its put may still be queued: a put from another stream that takes its rows queues a
    wait for that write on its own stream (on the device: the host waits for nothing); one from the same
    stream needs none."""
    s1, s2 = FakeStream(1), FakeStream(2)
    streams = {"now": s1}
    cache = _cuda_cache(monkeypatch, rows=4, host_rows=0, streams=streams)
    monkeypatch.setattr(Later, "synchronize", lambda self: pytest.fail("the host waited"))
    cache.put("a", torch.ones(4, 4))
    cache.evict("a")
    (write,) = cache.free[0].free[0][2]  # the freed rows carry the put's event, not yet done
    assert write.stream is s1 and write.on == 1 and not write.done
    streams["now"] = s2
    cache.put("b", torch.ones(4, 4))
    assert s2.waits == [write] and not write.done
    cache.evict("b")
    streams["now"] = s1
    cache.put("c", torch.ones(4, 4))  # the rows' users: s2's put (and the wait before it) and s1's: s1 waits on s2
    assert [e.on for e in s1.waits] == [2]


def test_a_staging_on_another_stream_waits_for_a_demotions_copy(monkeypatch):
    """A demotion's device-to-host copy, queued on one stream: a staging of that entry on another stream waits
    for its event, one on the same stream does not, and once it is done nobody waits."""
    s0, s1, s2 = FakeStream(0), FakeStream(1), FakeStream(2)
    streams = {"now": s0}
    cache = _cuda_cache(monkeypatch, rows=9, host_rows=4, streams=streams)
    a = cache.put("a", torch.ones(4, 4))
    cache.put("c", torch.ones(5, 4))
    for run in cache.writes.events:  # their puts have run
        for mark in run:
            mark.event().done = True
    streams["now"] = s1
    cache.put("b", torch.ones(5, 4))  # demotes "a" (a copy queued on s1), drops "c" (too big for the host tier)
    assert cache.tier(a) == "host" and "c" not in cache
    copy, _ = cache._written[a.slot]
    assert copy.stream is s1
    cache.locate([a])  # the staging's stream is the copy's
    assert not s1.waits
    streams["now"] = s2
    cache.locate([a])
    assert s2.waits == [copy]
    copy.done = True
    cache.locate([a])
    assert s2.waits == [copy] and a.slot not in cache._written


def test_a_put_takes_rows_whose_work_is_queued_on_its_own_stream(monkeypatch):
    """A put that demotes an entry whose put and demotion copy are still queued on the same stream takes its
    rows at once, with no wait: the stream runs them in order (before, the host waited, and in a race the H200
    met it raised "fragmented" with every row free)."""
    streams = {"now": FakeStream(1)}
    cache = _cuda_cache(monkeypatch, rows=4, host_rows=4, streams=streams)
    monkeypatch.setattr(Later, "synchronize", lambda self: pytest.fail("the host waited"))
    cache.put("a", torch.ones(4, 4))
    b = cache.put("b", torch.full((4, 4), 2.0))  # demotes "a": its rows' users (its put, the copy) are on stream 1
    assert cache.tier(b) == "device" and cache.tier(cache.get("a")) == "host"
    assert torch.equal(cache.rows_of(b), torch.full((4, 4), 2.0)) and not streams["now"].waits
