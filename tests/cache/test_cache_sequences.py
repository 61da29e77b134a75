"""Sequences of puts, hits, evictions and queued batches (hypothesis) on a simulated GPU (tests/simgpu.py): no
row a queued batch reads is written before it runs, nothing is read through a handle after its entry went,
budgets hold, the host never waits."""

from __future__ import annotations

import random
import struct

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slabstage.cache import CacheFullError, StaleEntryError

from simgpu import SimEvent, cuda_like, partitioned, simulated_gpu  # noqa: I001 - tests/simgpu.py

W = 4


ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 9), st.integers(0, 7), st.integers(1, 3)),
    st.tuples(st.just("get"), st.integers(0, 9)),
    st.tuples(st.just("evict"), st.integers(0, 9)),
    st.tuples(st.just("stage"), st.lists(st.integers(0, 9), min_size=1, max_size=4)),
    st.tuples(st.just("complete"), st.integers(0, 3)),
), max_size=40)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, device_rows=st.integers(7, 20), host_rows=st.sampled_from([0, 6, 15]))
@example(ops=[("put", 0, 1, 1), ("stage", [0]), ("put", 0, 7, 1)], device_rows=7, host_rows=0)  # (a freed run
# still read takes a larger entry after a wait, not a "fragmented" refusal)
def test_sequences(ops, device_rows, host_rows):
    with simulated_gpu() as sim:
        stream = sim["A"]
        cache = cuda_like(device_rows, host_rows, W)
        values, handles, seen = {}, {}, []  # key -> tensor put; key -> last handle; (rows read, rows expected)
        counter = 0
        for op in ops:
            if op[0] == "put":
                _, key, rows, blocks = op
                counter += 1
                value = torch.arange(counter * 100, counter * 100 + rows * W, dtype=torch.float32).reshape(rows, W)
                widths = [W // blocks] * (blocks - 1)
                widths.append(W - sum(widths))
                parts = tuple(value.split(widths, 1)) if blocks > 1 else value
                handles[key] = cache.put(key, parts)
                values[key] = value
            elif op[0] == "get":
                e = cache.get(op[1])
                if e is not None:
                    handles[op[1]] = e
            elif op[0] == "evict":
                cache.evict(op[1])
            elif op[0] == "stage":
                entries = [handles[k] for k in op[1] if k in handles]
                if not entries:
                    continue
                live = all(k in cache and cache.get(k).gen == handles[k].gen for k in op[1] if k in handles)
                try:
                    starts, fields, total, slots = cache.locate(entries)
                except StaleEntryError:
                    assert not live  # refused only when an entry went
                    continue
                assert live, "a handle to an entry that went was not refused"
                reads = [(cache.rows_of(e), values[k]) for k, e in zip([k for k in op[1] if k in handles], entries)]
                stream.enqueue(lambda reads=reads: seen.extend((view.clone(), want) for view, want in reads))
                cache.reads.note(slots, stream=(stream.cuda_stream, stream))
            else:  # the device runs the oldest queued work
                stream.run(min(len(stream.ops), stream.ran + op[1]))
            partitioned(cache)
        stream.run()
        assert SimEvent.syncs == 0
        for got, want in seen:  # rows a queued batch read were as they were when it was queued
            assert torch.equal(got, want)
        for key, value in values.items():  # nothing live was overwritten
            if key in cache:
                assert torch.equal(cache.rows_of(cache.get(key)), value)


# -- two streams, in-place writes, holds and row ranges ------------------------------------------------------------
K2 = st.integers(0, 4)  # keys
put2 = st.tuples(st.just("put"), K2, st.integers(0, 6), st.integers(1, 3), st.booleans())
stage2 = st.tuples(st.just("stage"), st.lists(st.tuples(K2, st.integers(0, 6), st.integers(0, 6)), min_size=1,
                                              max_size=4), st.booleans())  # (True: the handles taken again first)
ops2 = st.lists(st.one_of(  # (puts and stagings twice: sequences that put, stage and reuse rows)
    put2, put2, stage2, stage2,
    st.tuples(st.just("on"), st.sampled_from("AB")),
    st.tuples(st.just("reserve"), K2, st.integers(0, 6)),
    st.tuples(st.just("get"), K2, st.booleans()),
    st.tuples(st.just("hold"), K2),
    st.tuples(st.just("release"), K2),
    st.tuples(st.just("evict"), K2),
    st.just(("evict_unheld",)),
    st.tuples(st.just("run"), st.sampled_from("AB"), st.integers(0, 4)),
), min_size=6, max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops2, device_rows=st.integers(6, 16), host_rows=st.sampled_from([0, 5, 12]))
def test_sequences_on_two_streams(ops, device_rows, host_rows):
    """Puts (some narrower than the rows: the rest zeros), reserves an encoder then writes in place, hits,
    holds, evictions and stagings of row ranges, each on stream A or B, the streams run forward by turns. The
    caller orders its own write of a key before a read of it on the other stream (and nothing more): every read
    sees, when the device runs it, the rows its entry held when it was queued; a held entry stays where it is
    until its release; a put refused for room changes nothing; the host never waits."""
    run_two_streams(ops, device_rows, host_rows)


@pytest.mark.parametrize("seed", range(16))
def test_long_sequences_on_two_streams(seed):
    """The same, 600 operations drawn at random (most puts, stagings and runs): long enough that rows are reused
    many times over, entries are demoted and read from the host tier, and holds pile up."""
    rng = random.Random(seed)
    kinds = ["put"] * 6 + ["stage"] * 6 + ["run"] * 4 + ["on"] * 2 + ["reserve", "get", "hold", "release", "evict"]
    key, rows = (lambda: rng.randint(0, 6)), (lambda: rng.randint(0, 5))
    make = {
        "put": lambda: ("put", key(), rows(), rng.randint(1, 3), rng.random() < 0.3),
        "stage": lambda: ("stage", [(key(), rng.randint(0, 5), rng.randint(0, 6)) for _ in range(rng.randint(1, 4))],
                          rng.random() < 0.7),
        "run": lambda: ("run", rng.choice("AB"), rng.randint(0, 5)),
        "on": lambda: ("on", rng.choice("AB")),
        "reserve": lambda: ("reserve", key(), rows()),
        "get": lambda: ("get", key(), rng.random() < 0.2),
        "hold": lambda: ("hold", key()),
        "release": lambda: ("release", key()),
        "evict": lambda: ("evict", key()) if rng.random() < 0.9 else ("evict_unheld",),
    }
    ops = [make[rng.choice(kinds)]() for _ in range(600)]
    run_two_streams(ops, device_rows=rng.choice([8, 12, 20]), host_rows=rng.choice([0, 6, 14]))


def current(cache, key):
    """``key``'s handle now, without a hit (the least recently used order as it was)."""
    return cache.handles[cache.keys.index(key)]


def run_two_streams(ops, device_rows: int, host_rows: int) -> None:
    """Run ``ops`` (see ``ops2``) on a cache of ``device_rows`` and ``host_rows`` rows on a simulated GPU of two
    streams, checking as it goes and at the end."""
    with simulated_gpu() as sim:
        cache = cuda_like(device_rows, host_rows, W)
        values, handles, writer, holds, seen = {}, {}, {}, {}, []  # key -> ...: rows, handle, stream it was
        # written on, (slot, holds, (tier, first row)); (rows a read saw, rows it should see)
        counter = 0
        for op in ops:
            stream = sim["now"]
            if op[0] == "on":
                sim["now"] = sim[op[1]]
            elif op[0] in ("put", "reserve"):
                key, rows = op[1], op[2]
                counter += 1
                cols = W if op[0] == "reserve" or not op[4] else W - 1
                value = torch.arange(counter * 100, counter * 100 + rows * cols, dtype=torch.float32)
                value = value.reshape(rows, cols)
                if writer.get(key, stream) is not stream:  # (the caller orders its writes to one key)
                    stream.wait_event(writer[key].record_event())
                before = tuple(zip(cache.keys, cache.gens, cache.tiers, cache.ats))
                try:
                    if op[0] == "put":
                        blocks = op[3] if cols >= op[3] else 1
                        widths = [cols // blocks] * (blocks - 1)
                        widths.append(cols - sum(widths))
                        handles[key] = cache.put(key, tuple(value.split(widths, 1)) if blocks > 1 else value)
                    else:
                        view = cache.reserve(key, rows)
                        stream.enqueue(lambda v=view, t=value: v.copy_(t))  # the encoder's output, in place
                        handles[key] = cache.get(key, rows)
                except CacheFullError:
                    assert holds, "refused for room with nothing held"
                    assert tuple(zip(cache.keys, cache.gens, cache.tiers, cache.ats)) == before, \
                        "a refused put changed the cache"
                    continue
                values[key] = torch.cat([value, torch.zeros(rows, W - cols)], 1)
                writer[key] = stream
                holds.pop(key, None)  # (replaced: a put under a held key drops its hold)
            elif op[0] == "get":
                if op[2] and op[1] in cache:  # a hit checked against other rows than the entry's
                    with pytest.raises(ValueError, match="rows but"):
                        cache.get(op[1], len(values[op[1]]) + 1)
                else:
                    e = cache.get(op[1], len(values[op[1]]) if op[1] in cache else None)
                    if e is not None:
                        handles[op[1]] = e
            elif op[0] == "hold":
                if op[1] in cache:
                    e = handles[op[1]] = cache.get(op[1])
                    cache.hold(e)
                    slot, n, _ = holds.get(op[1], (e.slot, 0, None))
                    holds[op[1]] = (slot, n + 1, (cache.tiers[slot], cache.ats[slot]))
            elif op[0] == "release":
                if op[1] in holds:
                    cache.release(handles[op[1]])
                    slot, n, where = holds[op[1]]
                    if n > 1:
                        holds[op[1]] = (slot, n - 1, where)
                    else:
                        del holds[op[1]]
            elif op[0] in ("evict", "evict_unheld"):
                if op[0] == "evict":
                    cache.evict(op[1])
                    holds.pop(op[1], None)
                else:
                    cache.evict_unheld()
                    assert sorted(k for k in cache.keys if k is not None) == sorted(holds)
            elif op[0] == "stage":
                if op[2]:  # an engine's step: its items' handles looked up, then staged
                    for k, _, _ in op[1]:
                        e = cache.get(k)
                        if e is not None:
                            handles[k] = e
                picked = [(k, a, b) for k, a, b in op[1] if k in handles and (k in cache or not op[2])]
                if not picked:
                    continue
                parts = []
                for k, a, b in picked:
                    h = handles[k]
                    a, b = min(a, h.rows), min(max(a, b), h.rows)
                    parts.append((k, h.part(a, b), a, b))
                live = all(k in cache and current(cache, k).gen == handles[k].gen for k, _, _, _ in parts)
                for k, _, _, _ in parts:  # (the caller orders its own write before a read on the other stream)
                    if writer.get(k, stream) is not stream:
                        stream.wait_event(writer[k].record_event())
                try:
                    starts, fields, total, slots = cache.locate([p for _, p, _, _ in parts])
                except StaleEntryError:
                    assert not live, "a live entry was refused"
                    continue
                assert live, "a handle to an entry that went was not refused"
                assert total == sum(b - a for _, _, a, b in parts) and starts == [
                    sum(b - a for _, _, a, b in parts[:i]) for i in range(len(parts))]
                reads = [(cache.rows_of(p), values[k][a:b]) for k, p, a, b in parts]
                fields = struct.unpack(f"<{len(fields) // 8}q", fields)  # (packed as the parameter record holds them)
                assert all(f[0] == v.data_ptr() for f, (v, _) in zip(zip(*[iter(fields)] * 4), reads) if v.numel())
                stream.enqueue(lambda reads=reads: seen.extend((v.clone(), want) for v, want in reads))
                cache.reads.note(slots, stream=(stream.cuda_stream, stream))
            else:
                s = sim[op[1]]
                s.run(min(len(s.ops), s.ran + op[2]))
            for k, (slot, _, where) in holds.items():  # a held entry stays where it was
                assert k in cache and current(cache, k).slot == slot and (cache.tiers[slot], cache.ats[slot]) == where
            partitioned(cache)
        for s in (sim["A"], sim["B"], sim["A"]):
            s.run()
        assert SimEvent.syncs == 0
        for got, want in seen:  # rows a queued read saw were those its entry held when it was queued
            assert torch.equal(got, want)
        for key, value in values.items():  # nothing live was overwritten
            if key in cache:
                assert torch.equal(cache.rows_of(cache.get(key)), value)
