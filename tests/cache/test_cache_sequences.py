"""Sequences of puts, hits, evictions and queued batches (hypothesis) on a simulated GPU (tests/simgpu.py): no
row a queued batch reads is written before it runs, nothing is read through a handle after its entry went,
budgets hold, the host never waits."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slabstage.cache import StaleEntryError

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
