"""The encoder-output cache against one media tensor, engine-style merges and LightLLM's kernel (issue targets).

Every comparison runs both sides in this process on the same inputs; each step gets new tensors (a new view of
a rotating pool) and, for the cache, keys hit or new at a stated rate (new keys are put outside the timed
region: the encoder's output copy is paid by any cache). Cases (bf16):

- ``host``: host time of :meth:`PrefillGraphRunner.run` (captured, forward almost nothing, 256 tokens x 4096,
  half media rows, host integer inputs), building the ``PrefillBatch`` inside the timed region: one media
  tensor, 16 cached entries (2 of 16 keys new each step; the 16 keys' ``get_many`` before the timed region,
  then again inside it), 16 DeepStack items of 4 blocks as entries, and as tensors (context);
- ``stage``: latency (host + device) and device time of ``stage_embeddings`` at 8192 x 4096, 16 cached items
  against one tensor;
- ``merge``: the Qwen3-VL-like merge (4096 tokens, 2320 media rows in 8 images, k = 3, H = 4096) from the cache
  against an engine-style merge over a dict-of-tensors cache (Python gather, ``cat``, ``F.embedding``,
  ``masked_scatter``, copy into the static buffer);
- ``host_tier``: 16 entries in the pinned host tier staged at 8192 x 4096 (device time) against one
  host-to-device copy of the same media bytes;
- ``replay``: device time of a runner's replay (fetch, staging, a forward of almost nothing) at 256 / 2048 /
  8192 x 4096, half media rows (16 entries), against LightLLM's kernel (``bench/peer_lightllm.py``) plus the
  same forward captured in a graph by hand.

Device time: CUDA events, the host given a head start by a device sleep; latency: the host clock around the
call and a synchronize; host time: the host clock around the call, the device drained every 4 calls outside
it. Medians. Prints ``RESULT`` lines and writes ``encoder_cache.json`` under ``--out``.

GPU: ``python bench/bench_encoder_cache.py --out $OUT``; ``--smoke``: tiny sizes, every path checked once
(CPU: the Triton interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

import slabstage as ss  # noqa: E402
from slabstage.cache import EncoderCache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_lightllm import image_ranges, lightllm_style_stage  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
BF16 = torch.bfloat16
RESULTS: list = []
SLEEP = [0]


def device_us(fn, reps):
    if not CUDA:
        fn()
        return float("nan")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(SLEEP[0])
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def latency_us(fn, reps):
    sync = torch.cuda.synchronize if CUDA else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def host_us(fn, reps):
    sync = torch.cuda.synchronize if CUDA else (lambda: None)
    for _ in range(5):
        fn()
    sync()
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        if i % 4 == 3:
            sync()
    sync()
    return statistics.median(times)


def result(case, what, ours, ref, bound, higher_better=False, **info):
    ratio = ref / ours if higher_better else ours / ref
    met = ratio >= bound if higher_better else ratio <= bound
    row = dict(case=case, what=what, ours_us=round(ours, 2), reference_us=round(ref, 2), ratio=round(ratio, 3),
               target=(">=" if higher_better else "<=") + str(bound), met=bool(met), **info)
    RESULTS.append(row)
    print(f"RESULT {case} {what}: {ours:.1f} us vs {ref:.1f} us -> {ratio:.3f}x (target {row['target']}: "
          f"{'met' if met else 'MISSED'}) {info or ''}", flush=True)


def media_index(n, media_rows, device):
    """Media rows spread over the batch in 16 runs, text between."""
    index = torch.full((n,), -1, dtype=torch.int64)
    runs, per = 16, media_rows // 16
    gap = (n - media_rows) // runs
    at = 0
    for r in range(runs):
        at += gap
        index[at:at + per] = torch.arange(r * per, (r + 1) * per)
        at += per
    return index.to(device)


def fill(cache, keys, rows, width, blocks=1):
    for k in keys:
        if k not in cache:
            h = width // blocks
            cache.put(k, tuple(torch.randn(rows, h, device=DEV, dtype=BF16) for _ in range(blocks)) if blocks > 1
                      else torch.randn(rows, width, device=DEV, dtype=BF16))


# -- host time of run() --------------------------------------------------------------------------------------
def case_host(n, width, reps):
    buffers = ss.StagingBuffers.allocate(max_num_tokens=n, max_batch_size=4, embed_width=width, embed_dtype=BF16,
                                         device=DEV)
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"][:1] * 2, buffers, buckets=[n], progress=False)
    runner.capture()
    rows = n // 2
    per = rows // 16
    table = torch.randn(1000, width, device=DEV, dtype=BF16)
    pool = 8
    ids = torch.randint(0, 1000, (pool, n))
    pos = torch.arange(n).repeat(pool, 1)
    mi = media_index(n, rows, "cpu").repeat(pool, 1)
    media = torch.randn(pool, rows, width, device=DEV, dtype=BF16)
    items = torch.randn(pool, 16, per, width, device=DEV, dtype=BF16)
    h = width // 4
    deep = torch.randn(pool, 16, 4, per, h, device=DEV, dtype=BF16)
    cache = EncoderCache(width, BF16, DEV, device_budget_bytes=64 * per * width * 2)
    state = {"i": 0, "next": 16}
    keys = list(range(16))
    fill(cache, keys, per, width)
    deep_cache = EncoderCache(width, BF16, DEV, device_budget_bytes=64 * per * width * 2)
    fill(deep_cache, keys, per, width, blocks=4)

    def step(media_of):
        i = state["i"] = state["i"] + 1
        j = i % pool
        return runner.run(ss.PrefillBatch(input_ids=ids[j], positions=pos[j], table=table, media=media_of(j),
                                          media_index=mi[j]))

    def new_keys(c, blocks):  # 2 of 16 keys new each step: put before the timed call
        for _ in range(2):
            keys.pop(0)
            keys.append(state["next"])
            state["next"] += 1
        fill(c, keys, per, width, blocks)

    def timed_entries(c, blocks, lookup):
        """Median host time of run() with 16 entries; ``lookup``: the 16 keys' get_many inside the timed
        region (else before it, as the engine's own lookup of its items is outside run())."""
        rows = [per] * 16
        times = []
        for r in range(reps + 5):  # (the first 5 warm up)
            new_keys(c, blocks)
            if lookup:
                t0 = time.perf_counter()
                step(lambda j: c.get_many(keys, rows))
            else:
                media_now = c.get_many(keys, rows)
                t0 = time.perf_counter()
                step(lambda j, media=media_now: media)
            times.append((time.perf_counter() - t0) * 1e6)
            if r % 4 == 3 and CUDA:
                torch.cuda.synchronize()
        return statistics.median(times[5:])

    one = host_us(lambda: step(lambda j: media[j]), reps)
    for lookup in (False, True):
        said = " (+ get_many of 16 keys)" if lookup else ""
        ent = timed_entries(cache, 1, lookup)
        result("host", f"run() {n} tokens: 16 cached entries{said} vs one media tensor", ent, one, 1.2,
               hit_rate=14 / 16)
        dent = timed_entries(deep_cache, 4, lookup)
        result("host", f"run() {n} tokens: 16 DeepStack entries (4 blocks){said} vs one media tensor", dent, one,
               1.3, hit_rate=14 / 16)
    items16 = host_us(lambda: step(lambda j: list(items[j])), reps)
    deep16 = host_us(lambda: step(lambda j: [tuple(deep[j, t]) for t in range(16)]), reps)
    print(f"INFO host: 16 new item tensors {items16:.1f} us, 16 new DeepStack items {deep16:.1f} us, "
          f"one tensor {one:.1f} us", flush=True)
    RESULTS.append(dict(case="host", what="context", items_us=items16, deepstack_items_us=deep16, one_us=one))


# -- staging latency and device time ----------------------------------------------------------------------
def stage_inputs(n, width, table_width=None, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, 1000, (n,), generator=g).to(DEV)
    table = torch.randn(1000, table_width or width, generator=g).to(DEV, BF16)
    slab = torch.empty(n, width, device=DEV, dtype=BF16)
    return ids, table, slab, ss.new_error_word(DEV)


def case_stage(n, width, reps):
    rows = n // 2
    per = rows // 16
    ids, table, slab, err = stage_inputs(n, width)
    mi = media_index(n, rows, DEV)
    cache = EncoderCache(width, BF16, DEV, device_budget_bytes=2 * rows * width * 2)
    keys = [f"image-{k}" for k in range(16)]
    fill(cache, keys, per, width)
    counts = [per] * 16
    one = torch.cat([cache.rows_of(cache.get(k)) for k in keys])

    def ours():
        ss.stage_embeddings(slab, ids, table, errors=err, media=cache.get_many(keys, counts),
                            media_index=mi)

    def ref():
        ss.stage_embeddings(slab, ids, table, errors=err, media=one[:], media_index=mi)

    check = slab.clone()
    ours()
    a = slab.clone()
    ref()
    assert torch.equal(a, slab), "entries and one tensor staged different slabs"
    del check
    result("stage", f"latency {n}x{width}: 16 cached items vs one tensor", latency_us(ours, reps),
           latency_us(ref, reps), 1.1)
    result("stage", f"device {n}x{width}: 16 cached items vs one tensor", device_us(ours, reps), device_us(ref, reps),
           1.03)


# -- the Qwen3-VL-like merge -----------------------------------------------------------------------------
def case_merge(n, hidden, media_rows, k, images, reps):
    width = hidden * (1 + k)
    ids, table, slab, err = stage_inputs(n, width, table_width=hidden, seed=1)
    per = media_rows // images
    mi = torch.full((n,), -1, dtype=torch.int64)
    gap = (n - media_rows) // images
    at = 0
    for i in range(images):
        at += gap
        mi[at:at + per] = torch.arange(i * per, (i + 1) * per)
        at += per
    mask = (mi >= 0).to(DEV)
    mi = mi.to(DEV)
    image_token = 7
    engine_ids = torch.where(mask, torch.full_like(ids, image_token), ids)
    keys = [f"img-{i}" for i in range(images)]
    encoder_dict = {key: tuple(torch.randn(per, hidden, device=DEV, dtype=BF16) for _ in range(1 + k))
                    for key in keys}
    cache = EncoderCache(width, BF16, DEV, device_budget_bytes=2 * media_rows * width * 2)
    for key in keys:
        cache.put(key, encoder_dict[key])
    static = torch.empty(n, width, device=DEV, dtype=BF16)
    counts = [per] * images

    def engine():  # vLLM-style: gather per item, cat, embed, masked_scatter, copy into the graph's buffer
        outs = [encoder_dict[key] for key in keys]
        main = torch.cat([o[0] for o in outs])
        x = F.embedding(engine_ids, table)
        x = x.masked_scatter(mask[:, None], main)
        ds = torch.cat([torch.cat([o[j] for o in outs]) for j in range(1, 1 + k)], 1)
        deep = torch.zeros(n, k * hidden, device=DEV, dtype=BF16)
        deep = deep.masked_scatter(mask[:, None], ds)
        static[:, :hidden].copy_(x)
        static[:, hidden:].copy_(deep)

    def ours():
        ss.stage_embeddings(slab, ids, table, errors=err, media=cache.get_many(keys, counts),
                            media_index=mi)

    engine()
    ours()
    m = mask.bool()
    assert torch.equal(slab[m], static[m]) and torch.equal(slab[~m][:, hidden:], static[~m][:, hidden:])
    result("merge", f"latency Qwen3-VL-like {n} tokens {media_rows} media rows k={k}: cache vs engine merge",
           latency_us(ours, reps), latency_us(engine, reps), 5.0, higher_better=True)
    result("merge", f"device Qwen3-VL-like {n} tokens {media_rows} media rows k={k}: cache vs engine merge",
           device_us(ours, reps), device_us(engine, reps), 10.0, higher_better=True)


# -- the host tier ---------------------------------------------------------------------------------------
def case_host_tier(n, width, reps):
    rows = n // 2
    per = rows // 16
    ids, table, slab, err = stage_inputs(n, width, seed=2)
    mi = media_index(n, rows, DEV)
    cache = EncoderCache(width, BF16, DEV, device_budget_bytes=per * width * 2,
                         host_budget_bytes=(rows + per) * width * 2)
    keys = [f"image-{k}" for k in range(16)]
    fill(cache, keys + ["last"], per, width)  # each put pushes the one before into the host tier
    assert all(cache.tier(cache.get(key)) == "host" for key in keys)
    entries = [cache.get(key, rows=per) for key in keys]
    pinned = torch.empty(rows, width, dtype=BF16, pin_memory=CUDA)
    dst = torch.empty(rows, width, dtype=BF16, device=DEV)

    def ours():
        ss.stage_embeddings(slab, ids, table, errors=err, media=entries, media_index=mi)

    def h2d():
        dst.copy_(pinned, non_blocking=True)

    result("host_tier", f"device {n}x{width}: 16 host-tier entries vs an H2D copy of the same bytes",
           device_us(ours, reps), device_us(h2d, reps), 1.1, media_bytes=rows * width * 2)


# -- a replay's staging against LightLLM's kernel in a hand-captured graph ----------------------------------
def case_replay(n, width, reps):
    rows = n // 2
    per = rows // 16
    buffers = ss.StagingBuffers.allocate(max_num_tokens=n, max_batch_size=4, embed_width=width, embed_dtype=BF16,
                                         device=DEV)

    def forward(v):
        return v["input_embeds"][:1] * 2

    runner = ss.PrefillGraphRunner(forward, buffers, buckets=[n], progress=False)
    runner.capture()
    ids, table, _, _ = stage_inputs(n, width, seed=3)
    mi = media_index(n, rows, DEV)
    cache = EncoderCache(width, BF16, DEV, device_budget_bytes=2 * rows * width * 2)
    keys = [f"image-{k}" for k in range(16)]
    fill(cache, keys, per, width)
    entries = [cache.get(key, rows=per) for key in keys]
    batch = ss.PrefillBatch(input_ids=ids, positions=torch.arange(n, device=DEV), table=table, media=entries,
                            media_index=mi)
    media = torch.cat([cache.rows_of(e) for e in entries])
    lens = [per] * 16
    start_ids, img_lens, locs = image_ranges(lens, 1000, DEV)
    fake = ids.clone()
    fake[mi >= 0] = 1000 + mi[mi >= 0]
    out = torch.empty(n, width, device=DEV, dtype=BF16)

    def peer():
        lightllm_style_stage(out, fake, table, media, start_ids, img_lens, locs)
        return out[:1] * 2

    if CUDA:
        peer()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            peer()
        replay_peer = graph.replay
    else:
        replay_peer = peer
    runner.run(batch)
    assert runner.last_bucket == n or not CUDA
    result("replay", f"device {n}x{width} replay: runner (16 entries) vs LightLLM kernel + forward in a graph",
           device_us(lambda: runner.run(batch), reps), device_us(replay_peer, reps), 1.2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="folder for encoder_cache.json")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: every path once (CPU: the interpreter)")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--cases", default="host,stage,merge,host_tier,replay")
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    reps = 2 if args.smoke else args.reps
    if CUDA:
        from harness import sleep_cycles_per_us
        SLEEP[0] = int(sleep_cycles_per_us() * 300)
    big, w = (64, 64) if args.smoke else (8192, 4096)
    torch.manual_seed(0)
    if "host" in cases:
        case_host(32 if args.smoke else 256, w, 20 if args.smoke else 400)
    if "stage" in cases:
        case_stage(big, w, reps)
    if "merge" in cases:
        if args.smoke:
            case_merge(64, 16, 32, 3, 4, reps)
        else:
            case_merge(4096, 4096, 2320, 3, 8, reps)
    if "host_tier" in cases:
        case_host_tier(big, w, reps)
    if "replay" in cases:
        for n in ((64,) if args.smoke else (256, 2048, 8192)):
            case_replay(n, w, reps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = dict(device=torch.cuda.get_device_name() if CUDA else "cpu", torch=torch.__version__, results=RESULTS)
    (out / "encoder_cache.json").write_text(json.dumps(info, indent=1, default=str))
    print(f"wrote {out / 'encoder_cache.json'}")


if __name__ == "__main__":
    main()
