"""The encoder cache against queued device work, on a simulated GPU (tests/simgpu.py): no queued read ever sees
rows rewritten under it, a demotion copies what the put wrote, a full cache evicts only what a put needs, and the
host never waits."""

from __future__ import annotations

import random

import pytest
import torch

from slabstage.cache import EncoderCache, StaleEntryError

from simgpu import SIM, SimEvent, SimStream, cuda_like, partitioned, simulated_gpu  # noqa: I001 - tests/simgpu.py


@pytest.fixture
def sim():
    with simulated_gpu() as s:
        yield s


def value(rows: int, x: float, width: int = 4) -> torch.Tensor:
    return torch.full((rows, width), float(x))


def stage(cache: EncoderCache, entry, stream: SimStream, seen: list) -> None:
    """A staging launch on ``stream`` that reads ``entry``: what the device reads when it runs goes to ``seen``."""
    SIM["now"] = stream
    cache.locate([entry])  # (as the staging does: a wait for a demotion queued on another stream)
    view = cache.rows_of(entry)
    stream.enqueue(lambda: seen.append(view.clone()))
    cache.reads.note((entry.slot,), stream=(stream.cuda_stream, stream))


def test_a_put_into_a_full_tier_demotes_one_entry_and_the_host_never_waits(sim):
    """The device idle but for the demotion copy the put itself queues: one entry goes to the host tier."""
    cache = cuda_like(rows=8, host_rows=32)
    handles = [cache.put(k, value(2, i + 1)) for i, k in enumerate("abcd")]
    sim["A"].run()
    e = cache.put("e", value(2, 5))
    assert [cache.tier(h) for h in handles] == ["host", "device", "device", "device"]
    sim["A"].run()
    assert SimEvent.syncs == 0
    assert torch.equal(cache.rows_of(handles[0]), value(2, 1)) and torch.equal(cache.rows_of(e), value(2, 5))


def test_a_put_while_the_device_is_a_step_behind_evicts_one_entry(sim):
    """No host tier; a staging that reads "d" and a forward are queued. A put of 2 rows evicts the least
    recently used entry alone, and its copy runs after the queued read of the rows it takes."""
    A, seen = sim["A"], []
    cache = cuda_like(rows=8, host_rows=0)
    handles = [cache.put(k, value(2, i + 1)) for i, k in enumerate("abcd")]
    A.run()
    stage(cache, handles[0], A, seen)  # "a" read, then made the least recently used again below
    for h in handles[1:]:
        cache.get(h.cache.keys[h.slot])
    A.enqueue(lambda: None)  # the step's forward
    cache.put("e", value(2, 5))  # takes "a"'s rows
    assert [k for k in "abcd" if k in cache] == ["b", "c", "d"] and SimEvent.syncs == 0
    A.run()
    assert torch.equal(seen[0], value(2, 1))  # the queued read saw "a", not "e"
    with pytest.raises(StaleEntryError):
        cache.rows_of(handles[0])


def test_a_put_on_another_stream_waits_on_the_device_for_queued_reads(sim):
    """Stream A's queued staging reads "a"; a put on stream B that takes "a"'s rows queues a wait for it on B
    (device side): B's copy cannot land under A's read, and the host does not wait."""
    A, B, seen = sim["A"], sim["B"], []
    cache = cuda_like(rows=4, host_rows=0)
    a = cache.put("a", value(4, 1))
    A.run()
    stage(cache, a, A, seen)
    sim["now"] = B
    cache.put("b", value(4, 2))
    assert SimEvent.syncs == 0 and not seen
    assert B.run() and seen and torch.equal(seen[0], value(4, 1))  # B ran A as far as the read first
    assert torch.equal(cache.arena, value(4, 2))


def test_a_demotion_copies_what_a_put_on_another_stream_wrote(sim):
    """"x" is put on busy stream A; a put on stream B demotes it: B's copy to the host tier waits for A's write."""
    A, B = sim["A"], sim["B"]
    cache = cuda_like(rows=8, host_rows=2)
    sim["now"] = B
    cache.put("c", value(6, 3))
    B.run()
    sim["now"] = A
    A.enqueue(lambda: None)  # a long kernel ahead of the put
    x = cache.put("x", value(2, 7))
    cache.get("c")
    sim["now"] = B
    cache.put("y", value(6, 4))  # demotes "x" (a copy on B), drops "c" (too big for the host tier)
    assert cache.tier(x) == "host" and "c" not in cache and SimEvent.syncs == 0
    B.run()
    A.run()
    assert torch.equal(cache.rows_of(x), value(2, 7))


@pytest.mark.parametrize("seed", range(6))
def test_random_puts_reads_and_evictions_on_two_streams(sim, seed):
    """Random puts (new keys and overwrites), hits, evictions and staging reads on two streams, the streams run
    forward by random amounts: every read, when the device runs it, sees the rows its entry held when it was
    queued; live handles always hold their values; the host never waits."""
    rng = random.Random(seed)
    cache = cuda_like(rows=rng.choice([6, 9, 16]), host_rows=rng.choice([0, 4, 10]), width=3)
    truth, seen, stream_of_put, n = {}, [], {}, 0
    for _ in range(300):
        op = rng.random()
        stream = sim[rng.choice("AB")]
        sim["now"] = stream
        keys = [k for k in truth if k in cache]
        if op < 0.35:
            n += 1
            key = rng.choice(keys) if keys and rng.random() < 0.2 else f"k{n}"
            other = stream_of_put.get(key)
            if other is not None and other is not stream:  # (a caller orders its own writes to one key)
                stream.wait_event(other.record_event())
            truth[key] = value(rng.randint(1, 4), n, width=3)
            cache.put(key, truth[key])
            stream_of_put[key] = stream
        elif op < 0.75 and keys:
            key = rng.choice(keys)
            entry = cache.get(key)
            writer = stream_of_put[key]
            if writer is not stream:  # (the caller's own ordering of its put before a read on another stream)
                stream.wait_event(writer.record_event())
            view = cache.rows_of(entry)
            cache.locate([entry])
            stream.enqueue(lambda v=view, t=truth[key]: seen.append((v.clone(), t)))
            cache.reads.note((entry.slot,), stream=(stream.cuda_stream, stream))
        elif op < 0.8 and keys:
            key = rng.choice(keys)
            cache.evict(key)
            del truth[key]
        else:
            stream.run(min(len(stream.ops), stream.ran + rng.randint(0, 6)))
        partitioned(cache)
    for s in (sim["A"], sim["B"], sim["A"]):
        s.run()
    assert SimEvent.syncs == 0
    assert seen and all(torch.equal(got, want) for got, want in seen)
    for key, want in truth.items():
        if key in cache:
            assert torch.equal(cache.rows_of(cache.get(key)), want)


def test_the_reference_path_notes_the_entries_it_reads(sim, monkeypatch):
    """Staging through the PyTorch reference (CUDA without Triton) queues its reads on the current stream too: the
    entries it reads are noted, so a put that takes their rows orders itself after them."""
    from slabstage import stage_embeddings
    from slabstage.staging import op_stagers, stager

    monkeypatch.setattr(stager, "use_triton", lambda device: False)
    op_stagers.clear()
    cache = cuda_like(rows=4, host_rows=0)
    e = cache.put("a", value(2, 1))
    sim["A"].run()
    slab = torch.zeros(4, 4)
    stage_embeddings(slab, torch.zeros(4, dtype=torch.int64), torch.zeros(1, 4), media=[e],
                     media_index=torch.tensor([0, 1, -1, -1]))
    assert cache.reads.events[e.slot] and torch.equal(slab[:2], value(2, 1))
    op_stagers.clear()
