"""The encoder-output cache against one media tensor, engine-style merges and LightLLM's kernel.

Each comparison is one test that times both sides in one loop, ours and the reference alternated round by
round (ABAB), so host noise hits both. Before every timed call both sides run the SAME untimed prologue: the
step's new encoder outputs made (new views of a rotating pool), put into the cache under new keys AND copied
into the one media tensor, the 16 keys looked up (``get_many``) and a new view of the media tensor taken;
then a sync (host time, latency) or an L2 flush and a device sleep (device time). Inside the timed region the
two sides differ only in the ``media`` argument. Medians, their ratio, the target and whether it was met go to
``extra_info`` (``metric="ab"``; a latency case adds each side's median host part, the time until its call
returned, as ``ours_host_us`` / ``reference_host_us``; ``python bench/report.py`` tabulates them); the test's
own timing is the loop's wall time. Cases (bf16):

- ``test_run_host``: host time of :meth:`PrefillGraphRunner.run` (captured, forward almost nothing, 256 tokens
  x 4096, half media rows, host integer inputs), the ``PrefillBatch`` built inside the timed call: 16 cached
  entries (2 of 16 keys new each step) against one media tensor (target <= 1.2x); 16 DeepStack entries of 4
  column blocks against one media tensor (<= 1.3x);
- ``test_stage``: ``stage_embeddings`` at 8192 x 4096, 16 cached entries (2 new each step) against one tensor:
  latency, host and device together (<= 1.1x), and device time (<= 1.03x);
- ``test_merge``: the Qwen3-VL-like merge (4096 tokens, 2320 media rows in 8 images, k = 3, H = 4096) from the
  cache against an engine-style merge over a dict-of-tensors cache (Python gather, ``cat``, ``F.embedding``,
  ``masked_scatter``, copy into the static buffer), one image new each step in both: latency (>= 5x faster)
  and device time (>= 10x faster);
- ``test_host_tier``: device time of 16 entries in the pinned host tier staged at 8192 x 4096 against one
  host-to-device copy of the same media bytes (<= 1.1x);
- ``test_replay``: device time of a runner's replay (fetch, staging, a forward of almost nothing) at 256 /
  2048 / 8192 x 4096, half media rows in 16 entries and in one, against LightLLM's kernel (``peer_lightllm.py``,
  as many images: its grid has a program a row and image) plus the same forward captured in a graph by hand
  (<= 1.2x), the peer's image table static in its graph and, as an engine that builds it each step must, copied
  in from pinned host memory before each replay; then ``PROFILED_STEPS`` replays of each side under
  torch.profiler: each kernel's device time and the span from the first kernel's start to the last one's end
  (``extra_info["profile"]``);
- ``test_get_many``: host time of ``EncoderCache.get_many`` of 16 keys alone (a plain host-time benchmark).

Without CUDA the device-time cases skip and the others run once at tiny sizes through the Triton
interpreter: the staged slabs of both sides are compared, as on the GPU before any timing.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F

import slabstage as ss
from slabstage.cache import EncoderCache
from harness.profile import profile_steps
from peer_lightllm import image_ranges, lightllm_style_stage

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
BF16 = torch.bfloat16
SUITE = "encoder_cache"
ITEMS, NEW_PER_STEP, POOL = 16, 2, 8
PROFILED_STEPS = 20  # replays of each side under torch.profiler (test_replay's breakdown)
WIDTH = 4096 if HAS_CUDA else 64
HOST_TOKENS = 256 if HAS_CUDA else 32
BIG = 8192 if HAS_CUDA else 64
REPLAY_TOKENS = (256, 2048, 8192) if HAS_CUDA else (64,)
MERGE = dict(n=4096, hidden=4096, media_rows=2320, k=3, images=8) if HAS_CUDA else \
    dict(n=64, hidden=16, media_rows=32, k=3, images=4)


def _sync():
    if HAS_CUDA:
        torch.cuda.synchronize()


# -- the A/B loop ------------------------------------------------------------------------------------
def _time_once(measure, fn, arg, between_rounds) -> tuple[float, float]:
    """µs of one ``fn(arg)``: ``host`` (no sync inside), ``latency`` (up to a sync) or ``device`` (CUDA events);
    and the host's part of it (the time until ``fn`` returned: the same as the first for ``host``)."""
    if measure == "device":
        between_rounds()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(arg)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3, float("nan")
    _sync()
    t0 = time.perf_counter()
    fn(arg)
    host = time.perf_counter() - t0
    if measure == "latency":
        _sync()
    return (time.perf_counter() - t0) * 1e6, host * 1e6


def _rounds(request, measure) -> tuple[int, int]:
    if not HAS_CUDA:
        return 2, 1
    name = "--bench-host-rounds" if measure == "host" else "--bench-rounds"
    rounds = max(1, request.config.getoption(name, default=400 if measure == "host" else 100))
    return rounds, max(3, request.config.getoption("--bench-warmup", default=10))


def ab(benchmark, request, between_rounds, *, measure, prologue, ours, reference, target, higher_better=False,
       **info):
    """Time ``ours(prep)`` and ``reference(prep)`` alternated, ``prep = prologue(step)`` untimed before each;
    medians, ratio and target into ``extra_info`` (for latency also each side's median host part, the time
    until its call returned). ``higher_better``: the target is the reference's time over ours (how many times
    faster), else ours over the reference's."""
    rounds, warmup = _rounds(request, measure)
    times = {"ours": [], "reference": []}
    host = {"ours": [], "reference": []}
    step = [0]

    def loop():
        for r in range(warmup + rounds):
            for name, fn in (("ours", ours), ("reference", reference)):
                step[0] += 1
                t, h = _time_once(measure, fn, prologue(step[0]), between_rounds)
                if r >= warmup:
                    times[name].append(t)
                    host[name].append(h)

    benchmark._timer = time.perf_counter
    benchmark.pedantic(loop, rounds=1, iterations=1)
    if not times["ours"]:  # benchmarks disabled: pedantic ran nothing
        loop()
    a, b = statistics.median(times["ours"]), statistics.median(times["reference"])
    ratio = b / a if higher_better else a / b
    benchmark.extra_info.update(
        suite=SUITE, metric="ab", measure=measure, ours_us=a, reference_us=b, ratio=ratio,
        target=(">=" if higher_better else "<=") + str(target),
        met=bool(ratio >= target if higher_better else ratio <= target), rounds=rounds, **info)
    if measure == "latency":
        benchmark.extra_info.update(ours_host_us=statistics.median(host["ours"]),
                                    reference_host_us=statistics.median(host["reference"]))
    return ratio


# -- inputs ------------------------------------------------------------------------------------------
def media_index(n, media_rows, runs=ITEMS):
    """Media rows spread over the batch in ``runs`` equal runs, text between."""
    index = torch.full((n,), -1, dtype=torch.int64)
    per, gap, at = media_rows // runs, (n - media_rows) // runs, 0
    for r in range(runs):
        at += gap
        index[at:at + per] = torch.arange(r * per, (r + 1) * per)
        at += per
    return index


def stage_inputs(n, width, table_width=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (n,), generator=g).to(DEV)
    table = torch.randn(1000, table_width or width, generator=g).to(DEV, BF16)
    return ids, table, torch.empty(n, width, device=DEV, dtype=BF16), ss.new_error_word(DEV)


class Items:
    """``count`` items (default 16) of ``per`` rows, in an :class:`EncoderCache` under keys and in one media
    tensor, kept equal.

    ``step(i)`` is the shared prologue: ``NEW_PER_STEP`` items get new encoder outputs (views of a rotating
    pool, ``blocks`` column blocks each) under new keys: each is put into the cache and copied into its rows
    of the media tensor. It returns ``{"ours": the 16 handles (get_many), "reference": a new view of the
    media tensor}``.
    """

    def __init__(self, per, width, blocks=1, count=ITEMS):
        self.per, self.width, self.blocks, self.count = per, width, blocks, count
        rows = count * per
        budget = 4 * rows * width * 2
        self.cache = EncoderCache(width, BF16, DEV, device_budget_bytes=budget)
        self.one = torch.empty(rows, width, device=DEV, dtype=BF16)
        h = width // blocks
        self.pool = torch.randn(POOL, blocks, per, h, generator=torch.Generator().manual_seed(5)).to(DEV, BF16)
        self.keys = [None] * count
        self.next_key = 0
        for slot in range(count):
            self.renew(slot)

    def renew(self, slot):
        value = tuple(self.pool[self.next_key % POOL])  # the encoder's new output: column blocks
        self.keys[slot] = key = f"image-{self.next_key}"
        self.next_key += 1
        self.cache.put(key, value if self.blocks > 1 else value[0])
        h = self.width // self.blocks
        for b, block in enumerate(value):
            self.one[slot * self.per:(slot + 1) * self.per, b * h:(b + 1) * h].copy_(block)

    def step(self, i):
        for j in range(NEW_PER_STEP):
            self.renew((NEW_PER_STEP * i + j) % self.count)
        return {"ours": self.cache.get_many(self.keys, [self.per] * self.count), "reference": self.one[:]}


# -- run() host time ---------------------------------------------------------------------------------
@pytest.mark.parametrize("blocks, target", [(1, 1.2), (4, 1.3)], ids=["entries", "deepstack_entries"])
def test_run_host(benchmark, request, between_rounds, blocks, target):
    n, width = HOST_TOKENS, WIDTH
    rows = n // 2
    items = Items(rows // ITEMS, width, blocks)
    buffers = ss.StagingBuffers.allocate(max_num_tokens=n, max_batch_size=4, embed_width=width, embed_dtype=BF16,
                                         device=DEV)
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"][:1] * 2, buffers, buckets=[n], progress=False,
                                   verify="off")  # (the replay's host path is what is timed: see test_replay)
    runner.capture()
    table = torch.randn(1000, width, device=DEV, dtype=BF16)
    ids = torch.randint(0, 1000, (POOL, n))
    pos = torch.arange(n).repeat(POOL, 1)
    mi = media_index(n, rows).repeat(POOL, 1)

    def run(media, i):  # new host integer inputs each call (views of a pool)
        j = i % POOL
        runner.run(ss.PrefillBatch(input_ids=ids[j], positions=pos[j], table=table, media=media, media_index=mi[j]))

    def prologue(i):
        return dict(items.step(i), i=i)

    slabs, prep = [], prologue(0)
    for side in ("ours", "reference"):
        run(prep[side], 0)
        slabs.append(buffers.input_embeds[:n].clone())
    assert torch.equal(*slabs), "cached entries and one media tensor staged different slabs"
    assert runner.last_bucket == (n if DEV.type == "cuda" else None), "run() did not replay the graph"
    ab(benchmark, request, between_rounds, measure="host", prologue=prologue,
       ours=lambda p: run(p["ours"], p["i"]), reference=lambda p: run(p["reference"], p["i"]), target=target,
       case="run() host", impl=f"{ITEMS} cached {'DeepStack entries of 4 blocks' if blocks > 1 else 'entries'}",
       reference_impl="one media tensor", tokens=n, width=width, hit_rate=1 - NEW_PER_STEP / ITEMS)


def test_get_many(host_bench):
    items = Items(4, WIDTH)
    keys, rows = list(items.keys), [items.per] * ITEMS
    handles = host_bench(lambda: items.cache.get_many(keys, rows))
    assert [items.cache.rows_of(h).shape[0] for h in handles] == rows
    host_bench.record_host_time(suite=SUITE, impl="EncoderCache.get_many", shape=f"{ITEMS} keys")


# -- staging latency and device time ---------------------------------------------------------------------
@pytest.mark.parametrize("measure, target", [("latency", 1.1), pytest.param("device", 1.03, marks=pytest.mark.cuda)],
                         ids=["latency", "device"])
def test_stage(benchmark, request, between_rounds, measure, target):
    n, width = BIG, WIDTH
    ids, table, slab, err = stage_inputs(n, width)
    items = Items(n // 2 // ITEMS, width)
    mi = media_index(n, n // 2).to(DEV)

    def stage(media):
        ss.stage_embeddings(slab, ids, table, errors=err, media=media, media_index=mi)

    slabs, prep = [], items.step(0)
    for side in ("ours", "reference"):
        stage(prep[side])
        slabs.append(slab.clone())
    assert torch.equal(*slabs), "cached entries and one media tensor staged different slabs"
    ab(benchmark, request, between_rounds, measure=measure, prologue=items.step, ours=lambda p: stage(p["ours"]),
       reference=lambda p: stage(p["reference"]), target=target, case=f"stage {measure}",
       impl=f"{ITEMS} cached entries", reference_impl="one media tensor", tokens=n, width=width,
       hit_rate=1 - NEW_PER_STEP / ITEMS)


# -- the Qwen3-VL-like merge -------------------------------------------------------------------------------
@pytest.mark.parametrize("measure, target", [("latency", 5.0), pytest.param("device", 10.0, marks=pytest.mark.cuda)],
                         ids=["latency", "device"])
def test_merge(benchmark, request, between_rounds, measure, target):
    n, hidden, media_rows, k, images = (MERGE[x] for x in ("n", "hidden", "media_rows", "k", "images"))
    width = hidden * (1 + k)
    ids, table, slab, err = stage_inputs(n, width, table_width=hidden, seed=1)
    per = media_rows // images
    mi = media_index(n, media_rows, runs=images).to(DEV)
    mask = mi >= 0
    engine_ids = torch.where(mask, torch.full_like(ids, 7), ids)  # the image placeholder id
    pool = [tuple(torch.randn(per, hidden, device=DEV, dtype=BF16) for _ in range(1 + k)) for _ in range(POOL)]
    cache = EncoderCache(width, BF16, DEV, device_budget_bytes=2 * media_rows * width * 2)
    encoder_dict, keys = {}, [None] * images
    static = torch.empty(n, width, device=DEV, dtype=BF16)
    counts = [per] * images

    def renew(slot, i):  # a new image: put into both caches
        encoder_dict.pop(keys[slot], None)
        keys[slot] = key = f"img-{i}-{slot}"
        encoder_dict[key] = pool[i % POOL]
        cache.put(key, pool[i % POOL])

    for slot in range(images):
        renew(slot, slot)

    def prologue(i):
        renew(i % images, i)
        return None

    def engine(_=None):  # vLLM-style: gather per item, cat, embed, masked_scatter, copy into the graph's buffer
        outs = [encoder_dict[key] for key in keys]
        x = F.embedding(engine_ids, table).masked_scatter(mask[:, None], torch.cat([o[0] for o in outs]))
        ds = torch.cat([torch.cat([o[j] for o in outs]) for j in range(1, 1 + k)], 1)
        deep = torch.zeros(n, k * hidden, device=DEV, dtype=BF16).masked_scatter(mask[:, None], ds)
        static[:, :hidden].copy_(x)
        static[:, hidden:].copy_(deep)

    def ours(_=None):
        ss.stage_embeddings(slab, ids, table, errors=err, media=cache.get_many(keys, counts), media_index=mi)

    engine()
    ours()
    assert torch.equal(slab[mask], static[mask]) and torch.equal(slab[~mask][:, hidden:], static[~mask][:, hidden:])
    ab(benchmark, request, between_rounds, measure=measure, prologue=prologue, ours=ours, reference=engine,
       target=target, higher_better=True, case=f"merge {measure}", impl="stage_embeddings from the cache",
       reference_impl="engine-style merge over a dict of tensors", tokens=n, width=width, media_rows=media_rows,
       k=k)


# -- the host tier ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_host_tier(benchmark, request, between_rounds):
    n, width = BIG, WIDTH
    rows = n // 2
    per = rows // ITEMS
    ids, table, slab, err = stage_inputs(n, width, seed=2)
    mi = media_index(n, rows).to(DEV)
    cache = EncoderCache(width, BF16, DEV, device_budget_bytes=per * width * 2,
                         host_budget_bytes=(rows + per) * width * 2)
    keys = [f"image-{k}" for k in range(ITEMS)]
    for key in keys + ["last"]:  # each put pushes the one before into the host tier
        cache.put(key, torch.randn(per, width, device=DEV, dtype=BF16))
    assert all(cache.tier(cache.get(key)) == "host" for key in keys)
    entries = cache.get_many(keys, [per] * ITEMS)
    pinned = torch.empty(rows, width, dtype=BF16, pin_memory=True)
    dst = torch.empty(rows, width, dtype=BF16, device=DEV)
    ab(benchmark, request, between_rounds, measure="device", prologue=lambda i: None,
       ours=lambda _: ss.stage_embeddings(slab, ids, table, errors=err, media=entries, media_index=mi),
       reference=lambda _: dst.copy_(pinned, non_blocking=True), target=1.1, case="host tier device",
       impl=f"{ITEMS} host-tier entries", reference_impl="H2D copy of the same bytes", tokens=n, width=width,
       media_bytes=rows * width * 2)


# -- a replay's staging against LightLLM's kernel in a hand-captured graph ------------------------------------------
def peer_graph(ids, mi, table, media, image_table) -> tuple:
    """``(graph, out)``: LightLLM's kernel staging ``ids`` (media rows where ``mi >= 0``, ``media``'s rows, its
    image ids past the vocabulary of 1000) into ``out``, then the runner's forward of almost nothing, captured in
    one graph by hand."""
    fake = ids.clone()
    fake[mi >= 0] = 1000 + mi[mi >= 0]
    out = torch.empty(ids.shape[0], table.shape[1], device=DEV, dtype=BF16)

    def peer():
        lightllm_style_stage(out, fake, table, media, *image_table)
        return out[:1] * 2

    peer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        peer()
    return graph, out


@pytest.mark.cuda
@pytest.mark.parametrize("n", REPLAY_TOKENS)
@pytest.mark.parametrize("images", [ITEMS, 1])
@pytest.mark.parametrize("tables", ["on the device", "copied in"])
def test_replay(benchmark, request, between_rounds, n, images, tables):
    width = WIDTH
    rows = n // 2
    per = rows // images
    buffers = ss.StagingBuffers.allocate(max_num_tokens=n, max_batch_size=4, embed_width=width, embed_dtype=BF16,
                                         device=DEV)
    # (verify="off": the case times the replay, and the runner's speed check, an eager run against a replay timed
    # by events around host calls, is the host's launch speed for a forward of almost nothing and may drop the
    # bucket on a slow host; what the replay staged is checked against the peer's rows below)
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"][:1] * 2, buffers, buckets=[n], progress=False,
                                   verify="off")
    runner.capture()
    ids, table, _, _ = stage_inputs(n, width, seed=3)
    mi = media_index(n, rows, runs=images).to(DEV)
    items = Items(per, width, count=images)
    entries = items.cache.get_many(items.keys, [per] * images)
    batch = ss.PrefillBatch(input_ids=ids, positions=torch.arange(n, device=DEV), table=table, media=entries,
                            media_index=mi)
    # the peer's image table (start ids, lengths, start rows): static in its graph; "copied in": moved from
    # pinned host memory before each replay, as an engine that builds it on the host each step must
    image_table = torch.stack(image_ranges([per] * images, 1000, DEV))
    host_table = image_table.cpu().pin_memory()
    graph, out = peer_graph(ids, mi, table, items.one, image_table)

    def reference(_=None):
        if tables == "copied in":
            image_table.copy_(host_table, non_blocking=True)
        graph.replay()

    runner.run(batch)
    reference()
    assert runner.last_bucket == n and torch.equal(buffers.input_embeds[:n], out)
    ab(benchmark, request, between_rounds, measure="device", prologue=lambda i: None,
       ours=lambda _: runner.run(batch), reference=reference, target=1.2, case="replay device",
       impl=f"runner replay ({images} entries)", tokens=n, width=width, images=images,
       reference_impl=f"LightLLM kernel ({images} images) + forward in a graph"
                      + (", its image table copied in" if tables == "copied in" else ""))
    # where each side's device time goes: its kernels one by one, and the span from the first one's start to the
    # last one's end (the kernels and the gaps between them)
    benchmark.extra_info["profile"] = profile_steps({"ours": lambda: runner.run(batch), "reference": reference},
                                                    PROFILED_STEPS, "bench_encoder_cache")
