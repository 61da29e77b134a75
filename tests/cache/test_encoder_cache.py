"""EncoderCache: entries staged by handle equal the same rows staged as tensors, bit for bit; stale handles,
bad keys and wrong row counts are refused before anything is written; budgets and reads hold.

Interpreter tests run through the ``device`` fixture (CPU under TRITON_INTERPRET=1, CUDA when present);
tests marked ``cuda`` replay graphs and check the read events.
"""

from __future__ import annotations

import struct

import pytest
import torch
import torch.nn.functional as F
from builders import Later  # noqa: I001 - tests/builders.py

from slabstage import PrefillBatch, PrefillGraphRunner, StagingBuffers, new_error_word, stage_embeddings
from slabstage.cache import CacheFullError, EncoderCache, Entry, StaleEntryError
from slabstage.cache.rows import Rows

from builders import gen, poisoned, randint, randn, same_bytes  # noqa: I001 - tests/builders.py

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def index_for(g, n, rows_total, device):
    """A media index of ``n`` rows: media rows 0..rows_total-1 at scattered positions (in order), -1 elsewhere."""
    pos = torch.randperm(n, generator=g)[:rows_total].sort().values
    index = torch.full((n,), -1, dtype=torch.int64)
    index[pos] = torch.arange(rows_total)
    return index.to(device)


def wide(item, width):
    """An item (tensor or column blocks) as one tensor ``width`` wide, zeros past its blocks."""
    t = torch.cat(item, 1) if type(item) is tuple else item
    return F.pad(t, (0, width - t.shape[1]))


def cache_for(width, dtype, device, rows=64, host_rows=0):
    row = width * torch.empty((), dtype=dtype).element_size()
    return EncoderCache(width, dtype, device, device_budget_bytes=rows * row, host_budget_bytes=host_rows * row)


def stage(slab, ids, table, **kw):
    errors = new_error_word(slab.device)
    stage_embeddings(slab, ids, table, errors=errors, **kw)
    return errors


@pytest.mark.parametrize("cache_dtype, slab_dtype", [(F32, F32), (BF16, BF16), (F16, BF16), (F32, F16)])
@pytest.mark.parametrize("k, H", [(0, 40), (2, 24), (3, 8)])
def test_entries_equal_tensor(k, H, cache_dtype, slab_dtype, device):
    """DeepStack items of 1..k+1 blocks (zeros past their last), empty items, parts of entries."""
    g = gen(17 * k + H)
    W, V, n = H * (1 + k), 31, 53
    rows = [5, 0, 9, 3, 7]
    items = []
    for i, r in enumerate(rows):
        levels = 1 + (i % (k + 1))
        items.append(tuple(randn(g, r, H, cache_dtype, device) for _ in range(levels)) if k else
                     randn(g, r, H, cache_dtype, device))
    cache = cache_for(W, cache_dtype, device)
    entries = [cache.put(f"item-{i}", item) for i, item in enumerate(items)]
    entries[2] = entries[2].part(2, 8)  # a chunk of an item
    tensors = [wide(item, W) for item in items]
    tensors[2] = tensors[2][2:8]
    total = sum(e.rows for e in entries)
    ids, table = randint(g, 0, V, n, device=device), randn(g, V, H if k else W, slab_dtype, device)
    index = index_for(g, n, total, device)
    a, b = poisoned(n + 2, W, slab_dtype, device), poisoned(n + 2, W, slab_dtype, device)
    ea = stage(a, ids, table, media=entries, media_index=index, pad_to=n + 1)
    eb = stage(b, ids, table, media=torch.cat(tensors), media_index=index, pad_to=n + 1)
    assert same_bytes(a, b) and ea.tolist() == eb.tolist()
    assert a[:n + 1].isfinite().all() and a[n + 1].isnan().all()  # every row written and no other


def test_host_tier_entries_equal_tensor(device):
    """Entries the device tier evicted into the host tier are staged where they are, and equal the tensors."""
    g = gen(3)
    W, V, n = 48, 29, 40
    cache = cache_for(W, BF16, device, rows=16, host_rows=32)
    items = [randn(g, r, W, BF16, device) for r in (6, 7, 5, 4)]
    for i, item in enumerate(items):
        cache.put(i, item)
    tiers = [cache.tier(cache.get(i)) for i in range(4)]
    assert "host" in tiers and "device" in tiers
    entries = [cache.get(i, rows=item.shape[0]) for i, item in enumerate(items)]
    ids, table = randint(g, 0, V, n, device=device), randn(g, V, W, BF16, device)
    index = index_for(g, n, 22, device)
    a, b = poisoned(n, W, BF16, device), poisoned(n, W, BF16, device)
    stage(a, ids, table, media=entries, media_index=index)
    stage(b, ids, table, media=torch.cat(items), media_index=index)
    assert same_bytes(a, b)


def test_locate_gives_each_items_words_as_the_record_holds_them(device):
    """locate: entries (either tier) and parts of them give their item words packed as the parameter record's int64
    words: (address of the first row read, row stride, 0, width) per item, in order."""
    g = gen(5)
    W = 24
    cache = cache_for(W, BF16, device, rows=16, host_rows=32)
    for i, r in enumerate((6, 7, 5, 4)):
        cache.put(i, randn(g, r, W, BF16, device))
    entries = [cache.get(i) for i in (3, 0, 2, 1)]
    assert {cache.tier(e) for e in entries} == {"host", "device"}
    starts, fields, rows, _ = cache.locate(entries)
    assert type(fields) is bytes and starts == [0, 4, 10, 15] and rows == 22
    assert list(struct.unpack(f"<{len(fields) // 8}q", fields)) == [
        w for e in entries for w in (cache.rows_of(e).data_ptr(), W, 0, W)]
    parts = [entries[0].part(1, 3), entries[1]]
    starts, fields, rows, _ = cache.locate(parts)
    assert starts == [0, 2] and rows == 8
    assert struct.unpack("<8q", fields) == (cache.rows_of(parts[0]).data_ptr(), W, 0, W,
                                            cache.rows_of(parts[1]).data_ptr(), W, 0, W)


def test_reserve_writes_in_place(device):
    g = gen(5)
    cache = cache_for(16, F32, device)
    view = cache.reserve(b"\x00image", 6)
    view.copy_(randn(g, 6, 16, F32, device))
    e = cache.get(b"\x00image", rows=6)
    assert same_bytes(cache.rows_of(e), view)


def test_stale_handles_refused_nothing_written(device):
    g = gen(7)
    W, V, n = 16, 11, 12
    cache = cache_for(W, F32, device, rows=10)
    old = cache.put("a", randn(g, 6, W, F32, device))
    cache.put("b", randn(g, 6, W, F32, device))  # evicts "a" (no host tier)
    assert "a" not in cache and cache.get("a") is None
    slab = poisoned(n, W, F32, device)
    ids, table = randint(g, 0, V, n, device=device), randn(g, V, W, F32, device)
    errors = new_error_word(device)
    before = errors.clone()
    with pytest.raises(StaleEntryError, match="evicted or overwritten"):
        stage_embeddings(slab, ids, table, errors=errors, media=[old], media_index=index_for(g, n, 6, device))
    assert slab.isnan().all() and torch.equal(errors, before)
    again = cache.put("b", randn(g, 3, W, F32, device))  # an overwrite bumps the generation too
    with pytest.raises(StaleEntryError):
        cache.rows_of(Entry(cache, again.slot, again.gen - 1, 0, 3))


def test_keys_and_rows_checked():
    cache = cache_for(8, F32, "cpu")
    long = b"\x01" * 64
    cache.put(long + b"a", torch.ones(2, 8))
    assert cache.get(long + b"b") is None  # keys compared whole, never a prefix or a short hash
    assert cache.get(1) is None and cache.get("1") is None
    with pytest.raises(TypeError, match="key must be bytes, str or int"):
        cache.put(1.5, torch.ones(1, 8))
    with pytest.raises(TypeError, match="key must be"):
        cache.get(True)
    with pytest.raises(ValueError, match="holds 2 rows but 3 were expected"):
        cache.get(long + b"a", rows=3)
    for odd in (True, 3.0, torch.tensor(3)):  # a count that is not an int is named so, not "3 rows but True"
        with pytest.raises(TypeError, match="rows must be an int"):
            cache.get(long + b"a", rows=odd)
    with pytest.raises(ValueError, match="9 columns wide"):
        cache.put("w", torch.ones(2, 9))
    with pytest.raises(ValueError, match="exceeds the cache's device budget"):
        cache.put("big", torch.ones(65, 8))
    with pytest.raises(ValueError, match="share their rows"):
        cache.put("blocks", (torch.ones(2, 4), torch.ones(3, 4)))
    with pytest.raises(ValueError, match=r"Entry.part"):
        cache.get(long + b"a").part(1, 3)
    cache.put(7, torch.ones(3, 8))
    assert cache.get_many([long + b"a", 7], [2, 3]) == [cache.get(long + b"a"), cache.get(7)]
    assert cache.get_many([7, "missing"]) == [cache.get(7), None]
    with pytest.raises(ValueError, match="holds 3 rows but 4 were expected"):
        cache.get_many([long + b"a", 7], [2, 4])
    with pytest.raises(TypeError, match="key must be"):
        cache.get_many([7, 2.0])


def test_media_mixing_and_other_cache_refused():
    g = gen(9)
    W, V, n = 8, 7, 10
    one, two = cache_for(W, F32, "cpu"), cache_for(W, F32, "cpu")
    a, b = one.put("x", randn(g, 2, W)), two.put("x", randn(g, 2, W))
    ids, table, index = randint(g, 0, V, n), randn(g, V, W), index_for(g, n, 4, "cpu")
    slab = poisoned(n, W, F32, "cpu")
    with pytest.raises(ValueError, match="another EncoderCache"):
        stage(slab, ids, table, media=[a, b], media_index=index)
    with pytest.raises(TypeError, match="cache entries or tensors, not both"):
        stage(slab, ids, table, media=[a, randn(g, 2, W)], media_index=index)
    assert slab.isnan().all()


def test_a_put_refused_or_of_the_caches_own_rows_leaves_every_entry_right():
    """A value on another device is refused before anything is evicted; a value that lies in the cache's own
    rows (a part of another entry) is copied out first, so the entry it is put as cannot take its rows under it."""
    cache = EncoderCache(2, F32, "cpu", 6 * 8)
    a = cache.put("a", torch.arange(8.0).view(4, 2))
    cache.put("b", torch.ones(2, 2))
    arena = cache.arena.clone()
    with pytest.raises(ValueError, match="value is on meta"):
        cache.put("c", torch.empty(2, 2, device="meta"))
    with pytest.raises(ValueError, match="value block 1 is on meta"):
        cache.put("c", (torch.ones(2, 1), torch.empty(2, 1, device="meta")))
    assert "a" in cache and "b" in cache and "c" not in cache and torch.equal(cache.arena, arena)
    cache.get("b")  # "a" is the least recently used: the next put evicts it and takes its rows
    c = cache.put("c", cache.rows_of(a)[1:])
    assert "a" not in cache and torch.equal(cache.rows_of(c), torch.arange(2.0, 8.0).view(3, 2))


def test_an_edited_handle_is_refused_before_anything_is_read():
    """Entry is a NamedTuple: a handle edited past its entry's rows, to a slot the cache does not have, or with
    rows that are not ints is refused naming the item (the kernel would read past the entry, or the arena)."""
    g = gen(31)
    cache = cache_for(8, F32, "cpu", rows=4)
    e = cache.put("a", randn(g, 2, 8))
    slab = poisoned(4, 8, F32, "cpu")
    ids, table = torch.zeros(4, dtype=torch.int64), randn(g, 1, 8)
    for bad, match in ((e._replace(first=1, rows=2), r"media item 1 names rows \[1, 1 \+ 2\) of an entry of 2"),
                       (e._replace(rows=3), "rows"), (e._replace(first=-1), "rows"),
                       (e._replace(slot=99), "slot 99"), (e._replace(slot=-1), "slot -1"),
                       (e._replace(rows=1.5), "rows"), (e._replace(slot=1.0), "slot 1.0")):
        with pytest.raises(ValueError, match=match):
            stage(slab, ids, table, media=[e, bad], media_index=torch.arange(4) % 2)
        assert slab.isnan().all()
    stage(slab, ids, table, media=[e.part(0, 1), e.part(1, 2)], media_index=torch.tensor([0, 1, -1, 0]))
    assert torch.equal(slab[:2], cache.rows_of(e)) and torch.equal(slab[3], cache.rows_of(e)[0])


def test_held_entries_stay_until_released():
    """hold() keeps an entry from eviction and demotion by puts (holds count; evict and a put under its key still
    replace it); a put that cannot fit beside the held entries raises before it evicts anything."""
    cache = EncoderCache(4, F32, "cpu", 10 * 16, host_budget_bytes=4 * 16)
    a = cache.put("a", torch.full((4, 4), 1.0))
    cache.put("b", torch.full((3, 4), 2.0))
    cache.hold(a)
    cache.hold(a)
    cache.put("c", torch.full((5, 4), 3.0))  # evicts (demotes) "b", not "a" though it is older
    assert cache.tier(a) == "device" and cache.tier(cache.get("b")) == "host"
    with pytest.raises(CacheFullError, match="kept by hold"):
        cache.put("d", torch.full((7, 4), 4.0))  # 6 rows beside "a" at most
    assert "c" in cache and "b" in cache and "d" not in cache  # nothing was evicted for it
    cache.release(a)
    cache.put("e", torch.full((6, 4), 5.0))  # still held once: "c" goes
    assert cache.tier(a) == "device" and "c" not in cache
    cache.release(a)
    cache.put("f", torch.full((6, 4), 6.0))  # released: "a" goes now (to the host tier, where "b" makes room)
    assert cache.tier(cache.get("a")) == "host" and "b" not in cache
    assert torch.equal(cache.rows_of(cache.get("f")), torch.full((6, 4), 6.0))
    g = cache.put("g", torch.full((2, 4), 7.0))
    cache.hold(g)
    whole = EncoderCache(4, F32, "cpu", 10 * 16)
    held = whole.put("k", torch.ones(8, 4))
    whole.hold(held)
    again = whole.put("k", torch.full((8, 4), 2.0))  # a put under a held entry's key replaces it
    assert torch.equal(whole.rows_of(again), torch.full((8, 4), 2.0)) and not whole._held
    cache.evict_unheld()
    assert [k for k in ("a", "b", "c", "e", "f", "g") if k in cache] == ["g"]
    cache.evict("g")  # evict drops a held entry; its hold goes with it
    assert "g" not in cache and not cache._held
    cache.release(g)  # (a release after the entry went does nothing)
    with pytest.raises(StaleEntryError):
        cache.hold(g)


def test_free_runs_hand_out_rows_with_what_a_writer_must_wait_for():
    """A freed run keeps the events of the work still using it: a writer on that work's stream takes it as it is
    (the stream runs in order); one on another stream gets the events to wait for (on the device), unless a run
    nobody else uses is free; adjacent runs merge, their events with them."""
    rows = Rows(10)
    assert rows.take(4) == (0, []) and rows.take(6) == (4, []) and rows.take(1) is None
    busy = Later()
    busy.on = 7  # recorded on stream 7
    rows.give(0, 4, [busy])
    assert rows.take(2, here=7) == (0, [])
    assert rows.take(2, here=8) == (2, [busy])
    rows.give(0, 2, [busy])
    rows.give(8, 2, [])
    assert rows.take(2, here=8) == (8, [])  # a run nobody uses first
    rows.give(8, 2, [])
    rows.give(2, 2, [])
    rows.give(4, 4, [])
    assert rows.free == [[0, 10, [busy]]]
    busy.done = True
    assert rows.take(10, here=8) == (0, [])


def test_runner_with_entries_equals_tensors():
    g = gen(11)
    H, k = 16, 2
    W, V = H * (1 + k), 41
    buffers = StagingBuffers.allocate(max_num_tokens=64, max_batch_size=4, embed_width=W, embed_dtype=F32,
                                      device="cpu")
    runner = PrefillGraphRunner(lambda v: v["input_embeds"] * 1, buffers, buckets=[32, 64], progress=False)
    cache = cache_for(W, F32, "cpu", rows=40, host_rows=40)
    table = randn(g, V, H)
    for step in range(4):  # new keys and hits every step
        items = {f"img{step}-{j}": tuple(randn(g, 5 + j, H) for _ in range(1 + (j % 3))) for j in range(3)}
        for key, item in items.items():
            if key not in cache:
                cache.put(key, item)
        n = 37
        ids = randint(g, 0, V, n)
        index = index_for(g, n, 18, "cpu")
        kw = dict(input_ids=ids, positions=torch.arange(n), table=table, media_index=index)
        entries = [cache.get(key, rows=item[0].shape[0]) for key, item in items.items()]
        got = runner.run(PrefillBatch(media=entries, **kw), clone=True)
        want = runner.run(PrefillBatch(media=torch.cat([wide(i, W) for i in items.values()]), **kw), clone=True)
        assert same_bytes(got, want)


@pytest.mark.cuda
def test_cuda_replay_with_entries_equals_eager_and_notes_reads():
    g = gen(13)
    W, V, n = 64, 50, 100
    buffers = StagingBuffers.allocate(max_num_tokens=128, max_batch_size=4, embed_width=W, embed_dtype=BF16,
                                      device="cuda")
    runner = PrefillGraphRunner(lambda v: v["input_embeds"] * 2, buffers, buckets=[128], progress=False).capture()
    cache = cache_for(W, BF16, "cuda", rows=64, host_rows=64)
    table = randn(g, V, W, BF16, "cuda")
    for step in range(6):
        items = [randn(g, 9, W, BF16, "cuda") for _ in range(3)]
        entries = [cache.put(step * 10 + j, it) for j, it in enumerate(items)]
        ids, index = randint(g, 0, V, n, device="cuda"), index_for(g, n, 27, "cuda")
        kw = dict(input_ids=ids, positions=torch.arange(n, device="cuda"), table=table, media_index=index)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = runner.run(PrefillBatch(media=entries, **kw), clone=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert runner.last_bucket == 128
        assert all(cache.reads.events[e.slot] for e in entries)  # the replay's event is filed under each
        want = runner.run(PrefillBatch(media=torch.cat(items), **kw), clone=True)
        assert same_bytes(got, want)
    assert any(cache.tier(cache.get(key)) == "host" for key in range(60) if key in cache)


@pytest.mark.cuda
def test_cuda_caller_capture_refuses_entries():
    cache = cache_for(16, F32, "cuda")
    e = cache.put("x", torch.randn(4, 16, device="cuda"))
    slab = torch.zeros(8, 16, device="cuda")
    ids, table = torch.zeros(8, dtype=torch.int64, device="cuda"), torch.randn(4, 16, device="cuda")
    index = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], device="cuda")
    stage(slab, ids, table, media=[e], media_index=index)  # (loads the kernel outside the capture)
    media = cache.rows_of(e).clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    refused, errors = None, new_error_word(torch.device("cuda"))
    put_refused = None
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        stage_embeddings(slab, ids, table, errors=errors, media=media, media_index=index)  # tensors: captured
        try:
            stage_embeddings(slab, ids, table, errors=errors, media=[e], media_index=index)
        except ValueError as exc:
            refused = exc
        try:
            cache.put("y", torch.ones(2, 16, device="cuda"))
        except RuntimeError as exc:
            put_refused = exc
    assert refused is not None and "inside a graph the caller captures" in str(refused)
    assert put_refused is not None and "while the current stream captures a graph" in str(put_refused)
    assert "y" not in cache and cache.get("x") == e


@pytest.mark.cuda
def test_cuda_a_staging_on_another_stream_reads_a_demoted_entry_after_its_copy():
    """A put on a busy stream demotes entry "a" (its device-to-host copy queued behind a long sleep) and drops
    "c" (too big for the host tier) for its rows, so the host does not wait; a staging of "a" on another stream,
    which never waits for the busy one, reads the host rows after that copy."""
    g = gen(22)
    W, V, n = 64, 30, 40
    cache = cache_for(W, BF16, "cuda", rows=36, host_rows=16)
    A, B, C = randn(g, 16, W, BF16, "cuda"), randn(g, 20, W, BF16, "cuda"), randn(g, 20, W, BF16, "cuda")
    ids, table = randint(g, 0, V, n, device="cuda"), randn(g, V, W, BF16, "cuda")
    index = index_for(g, n, 16, "cuda")
    want = poisoned(n, W, BF16, "cuda")
    stage(want, ids, table, media=A, media_index=index)
    a = cache.put("a", A)
    cache.put("c", C)
    torch.cuda.synchronize()
    busy, other = torch.cuda.Stream(), torch.cuda.Stream()
    slab, errors = poisoned(n, W, BF16, "cuda"), new_error_word(torch.device("cuda"))
    with torch.cuda.stream(busy):
        torch.cuda._sleep(200_000_000)  # a busy GPU
        cache.put("b", B)  # "a" goes to the host tier (a copy queued behind the sleep), "c" is dropped
    assert cache.tier(a) == "host" and "c" not in cache and not busy.query()  # (the host did not wait)
    with torch.cuda.stream(other):
        stage_embeddings(slab, ids, table, errors=errors, media=[a], media_index=index)
    torch.cuda.synchronize()
    assert same_bytes(slab, want)


@pytest.mark.cuda
def test_cuda_rows_of_an_entry_whose_put_is_queued_are_not_reused_from_another_stream():
    """Entry "a" is put behind a long sleep and evicted at once; "b", put from another stream, takes its rows
    with a wait for that copy queued on its stream (else the late copy of "a" would land on "b"): the host does
    not wait."""
    g = gen(23)
    W = 64
    cache = cache_for(W, BF16, "cuda", rows=16)
    A, B = randn(g, 16, W, BF16, "cuda"), randn(g, 16, W, BF16, "cuda")
    torch.cuda.synchronize()
    busy, other = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(200_000_000)
        cache.put("a", A)
        cache.evict("a")
    with torch.cuda.stream(other):
        b = cache.put("b", B)  # every row is written by the queued put: this stream waits for it, then writes
    assert not busy.query()  # (the host did not wait)
    torch.cuda.synchronize()
    assert same_bytes(cache.rows_of(b), B)


@pytest.mark.cuda
def test_cuda_host_far_ahead_never_overwrites_rows_a_queued_staging_reads():
    """A staging queued behind a long device sleep on one stream reads entries; the host then evicts them and
    puts new items from another stream: the new rows are written only after that staging read the old ones (a
    wait queued on the other stream; the host does not wait)."""
    g = gen(21)
    W, V, n = 64, 30, 48
    cache = cache_for(W, BF16, "cuda", rows=32)
    A, B, C, D = (randn(g, 16, W, BF16, "cuda") for _ in range(4))
    ids, table = randint(g, 0, V, n, device="cuda"), randn(g, V, W, BF16, "cuda")
    index = index_for(g, n, 32, "cuda")
    want = poisoned(n, W, BF16, "cuda")
    stage(want, ids, table, media=torch.cat([A, B]), media_index=index)
    slab = poisoned(n, W, BF16, "cuda")
    busy, other = torch.cuda.Stream(), torch.cuda.Stream()
    errors = new_error_word(torch.device("cuda"))
    busy.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(busy):
        torch.cuda._sleep(200_000_000)  # a busy GPU
        entries = [cache.put("a", A), cache.put("b", B)]
        stage_embeddings(slab, ids, table, errors=errors, media=entries, media_index=index)
    with torch.cuda.stream(other):
        cache.put("c", C)  # every row is read by the queued staging: this stream waits for it, then writes
        cache.put("d", D)
    assert not busy.query()  # (the host did not wait)
    torch.cuda.synchronize()
    assert same_bytes(slab, want)
    assert same_bytes(cache.rows_of(cache.get("c")), C) and same_bytes(cache.rows_of(cache.get("d")), D)


@pytest.mark.parametrize("seed", [0, 1])
def test_runner_steps_with_puts_hits_and_evictions_under_queued_work(seed, device):
    """Random steps through the runner (graph replays on CUDA): each puts new items (column blocks or not;
    on CUDA some from another stream) into a cache small enough that they evict entries queued staging
    still reads, demoting some to the host tier, then stages a batch of cached entries (new and hit)
    with host integer inputs while, on CUDA, the device is still busy with earlier steps (nothing here waits
    for it before the end). A snapshot of each step's slab, queued behind it, equals the slab built from the
    items' values; a handle taken before its entry went is refused."""
    import random
    rnd, dg = random.Random(seed), torch.Generator(device=device).manual_seed(seed)
    cuda = device.type == "cuda"
    H, k, V = 16, 2, 40
    W = H * (1 + k)
    buffers = StagingBuffers.allocate(max_num_tokens=96, max_batch_size=4, embed_width=W, embed_dtype=BF16,
                                      device=device)
    runner = PrefillGraphRunner(lambda v: v["input_embeds"] * 2, buffers, buckets=[48, 96], progress=False)
    runner.capture()
    cache = cache_for(W, BF16, device, rows=40, host_rows=16)
    table = torch.randn(V, H, generator=dg, device=device).to(BF16)
    main = torch.cuda.current_stream() if cuda else None
    other = torch.cuda.Stream() if cuda else None
    items, stale, snaps, steps, refused = {}, [], [], [], 0
    g = gen(seed)
    for step in range(16):
        if cuda and rnd.random() < 0.7:
            torch.cuda._sleep(20_000_000)  # the device busy: the host queues this step behind earlier ones
        for j in range(rnd.randint(1, 2)):  # new items: each may evict entries the queued steps read
            key, rows, blocks = f"s{step}-{j}", rnd.randint(3, 12), rnd.choice([1, 2, 3])
            widths = [H] * blocks if blocks > 1 else [W if rnd.random() < 0.5 else H]
            item = tuple(torch.randn(rows, w, generator=dg, device=device).to(BF16) for w in widths)
            item = item if blocks > 1 else item[0]
            if cuda and rnd.random() < 0.5:
                other.wait_stream(main)  # (the item was made on the current stream)
                with torch.cuda.stream(other):
                    cache.put(key, item)
                main.wait_stream(other)  # (staging it on the current stream: the caller's ordering)
            else:
                cache.put(key, item)
            items[key] = item
        live = [key for key in items if key in cache]
        keys = rnd.sample(live, min(len(live), rnd.randint(1, 3)))
        entries = [cache.get(key, rows=blocks_rows(items[key])) for key in keys]
        total = sum(map(blocks_rows, map(items.get, keys)))
        n = rnd.randint(total, 96)
        ids, index = randint(g, 0, V, n), index_for(g, n, total, "cpu")  # (host inputs: no copy, no sync)
        batch = PrefillBatch(input_ids=ids, positions=torch.arange(n), table=table, media=entries,
                             media_index=index, expand="zeros")
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            runner.run(batch)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
        snaps.append(buffers.input_embeds[:n].clone())  # (queued behind the step)
        steps.append((ids, index, keys))
        stale += [(key, e) for key, e in zip(keys, entries)]
        for _, e in [(key, e) for key, e in stale if key not in cache or cache.get(key).gen != e.gen][:1]:
            with pytest.raises(StaleEntryError):  # refused before anything is written or queued
                runner.run(PrefillBatch(input_ids=randint(g, 0, V, e.rows), positions=torch.arange(e.rows),
                                        table=table, media=[e], media_index=torch.arange(e.rows), expand="zeros"))
            stale = [s for s in stale if s[1] is not e]
            refused += 1
    host_table = table.cpu()
    for step, (snap, (ids, index, keys)) in enumerate(zip(snaps, steps)):
        want = F.pad(host_table[ids], (0, W - H))
        rows = index >= 0
        want[rows] = torch.cat([wide(items[key], W).cpu() for key in keys])[index[rows]]
        assert same_bytes(snap.cpu(), want), f"step {step}: the slab differs from the items' values"
    assert runner.stats()["replays" if cuda else "eager"], runner.stats()
    assert refused and len(items) > len(cache), "the steps evicted nothing"


def blocks_rows(item) -> int:
    return (item[0] if type(item) is tuple else item).shape[0]
