"""Sequences of puts, hits, evictions and queued batches (hypothesis): no row a queued batch reads is written
before its reader completes, nothing is read through a handle after its entry went, budgets hold."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slabstage.cache import EncoderCache, StaleEntryError
from slabstage.cache.encoder_cache import DEVICE, HOST

from builders import Later  # noqa: I001 - tests/builders.py

W = 4


Reader = Later  # queued work reading some rows; completes when the test says so


ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 9), st.integers(0, 7), st.integers(1, 3)),
    st.tuples(st.just("get"), st.integers(0, 9)),
    st.tuples(st.just("evict"), st.integers(0, 9)),
    st.tuples(st.just("stage"), st.lists(st.integers(0, 9), min_size=1, max_size=4)),
    st.tuples(st.just("complete"), st.integers(0, 3)),
), max_size=40)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, device_rows=st.integers(7, 20), host_rows=st.sampled_from([0, 6, 15]))
@example(ops=[("put", 0, 1, 1), ("stage", [0]), ("put", 0, 7, 1)], device_rows=7, host_rows=0)  # (freed runs
# whose readers are done merge before a larger entry is refused as fragmented)
def test_sequences(ops, device_rows, host_rows):
    cache = EncoderCache(W, torch.float32, "cpu", device_budget_bytes=device_rows * 4 * W,
                         host_budget_bytes=host_rows * 4 * W)
    values, handles, queued = {}, {}, []  # key -> tensor put; key -> last handle; [(reader, [(view, rows)])]
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
            reader = Reader()
            cache.reads.note(slots, reader)
            queued.append((reader, [(cache.rows_of(e), cache.rows_of(e).clone()) for e in entries]))
        else:  # the oldest queued readers complete (a stream completes in order)
            for reader, _ in queued[:op[1]]:
                reader.done = True
            queued = queued[op[1]:]
        for reader, reads in queued:  # rows a queued batch reads are as they were when it was queued
            if not reader.done:
                for view, was in reads:
                    assert torch.equal(view, was)
        queued = [q for q in queued if not q[0].done]
        check_cache(cache, values)


def check_cache(cache, values):
    used = {DEVICE: [], HOST: []}
    for key in list(values):
        if key not in cache:
            continue
        e = cache.get(key)
        assert torch.equal(cache.rows_of(e), values[key])  # nothing live was overwritten
        used[cache.tiers[e.slot]].append((cache.ats[e.slot], e.rows))
    for tier, runs in used.items():  # runs lie inside their arena, apart (budgets hold)
        limit = cache.arenas[tier].shape[0]
        runs = sorted(r for r in runs if r[1])
        for (a, n), (b, _) in zip(runs, runs[1:]):
            assert a + n <= b
        assert all(a + n <= limit for a, n in runs)
