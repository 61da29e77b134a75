"""Staging figures measured as an engine meets them: new tensors every step, device time and latency.

    python bench/staging_figures.py [--quick] [--out FILE.json]

Every case builds its inputs (new tensors at new addresses) before timing, one set per step:

- device time: rounds of 8 calls between two CUDA events, each round behind a 4 ms device sleep
  queued first (the host's launches hide behind it); the median per-call time of the rounds;
- latency: host + device of one call, synchronised before and after, median of ``steps``.

Cases: the large one-tensor merge against the same-run device-to-device copy of its bytes and
a LightLLM-style kernel; 16 new media items against one tensor and against ``torch.cat`` then
staging; DeepStack (k = 3) items of 4 column blocks against the wide tensor; the standalone op
(into one slab, into a new view of one slab each call, and as the custom op) against the LightLLM-style
kernel in the same run: a call back to back, its host time alone (behind a busy device) and its latency;
a Qwen3-VL-like merge (4096 tokens, 2320 media rows, k = 3) against the engine-style merge (embedding,
``masked_scatter_`` per block, copies).
Prints one line per case; the JSON holds every figure and the machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path[:1]:
    sys.path.insert(0, _ROOT)  # the checkout's slabstage (also when bench_new_inputs.py imports this)

import slabstage as ss  # noqa: E402
from slabstage.bench import sleep_cycles_per_us, synced_us  # noqa: E402
from slabstage.ops import stage_embeddings_op  # noqa: E402
from bench.peer_lightllm import image_ranges, lightllm_style_stage  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16


@functools.cache
def _cycles_per_us() -> float:
    return sleep_cycles_per_us()  # torch.cuda._sleep cycles a µs, measured once


def device_us(calls, steps: int, per_round: int = 8, head_start_ms: float = 4.0) -> float:
    """Device time per call of ``calls[i]()`` for ``i < steps``: the median over rounds of ``per_round`` calls,
    each round queued behind a head start that hides the host's time. (Rounds of 8: the staging ring lets the
    host run at most 8 steps ahead of the device, so a longer run would measure the host.)"""
    for c in calls[:3]:
        c()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles_per_us = _cycles_per_us()
    per_call = []
    for r in range(3, 3 + steps, per_round):
        chunk = calls[r:min(r + per_round, 3 + steps)]
        torch.cuda.synchronize()
        torch.cuda._sleep(int(head_start_ms * 1e3 * cycles_per_us))
        start.record()
        for c in chunk:
            c()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / len(chunk))
    return statistics.median(per_call)


def latency_us(calls, steps: int) -> float:
    return statistics.median(synced_us(c) for c in calls[:steps])


def both(fn, inputs, steps: int, name: str) -> dict:
    """``{name_us: device time, name_latency_us: latency}`` of ``fn(x)`` over the new ``inputs``."""
    calls = [lambda x=x: fn(x) for x in inputs]
    return {f"{name}_us": device_us(calls, steps), f"{name}_latency_us": latency_us(calls, steps)}


def copy_ceiling_us(n: int, width: int, steps: int) -> dict:
    """Same-run device-to-device copies of an ``n x width`` bf16 slab's bytes (each source row read once, each
    slab row written once: the staging floor), timed as staging is: from a new source each step, and from one
    source again and again."""
    dst = torch.empty(n, width, dtype=BF16, device=DEV)
    fresh = [torch.randn(n, width, dtype=BF16, device=DEV) for _ in range(steps + 3)]
    out = dict(new_source_us=device_us([lambda s=s: dst.copy_(s) for s in fresh], steps),
               same_source_us=device_us([lambda s=fresh[0]: dst.copy_(s)] * (steps + 3), steps))
    del fresh
    return out


def half_media(n):
    """A batch of ``n`` rows, every other block of 64 rows media: ``(ids, media_index)`` on the device."""
    ids = torch.randint(0, 32000, (n,), device=DEV)
    index = torch.full((n,), -1, dtype=torch.int64)
    media = (torch.arange(n) // 64) % 2 == 1
    index[media] = torch.arange(int(media.sum()))
    return ids, index.to(DEV)


def large_cases(out, steps):
    for n, width in ((32768, 4096), (8192, 16384)):
        r = out[f"large {n}x{width}"] = _large(n, width, steps)
        print(f"large {n}x{width}: {r['ours_us']:.1f} us, {100 * r['of_ceiling']:.1f}% of the copy ceiling "
              f"({r['copy_us']:.1f} us); same input {100 * r['of_ceiling_same_input']:.1f}%; a call back to back "
              f"{r['call_us']:.1f} us; LightLLM-style {r['lightllm_us']:.1f} us ({r['vs_lightllm']:.2f}x)",
              flush=True)
        torch.cuda.empty_cache()


def _large(n: int, width: int, steps: int) -> dict:
    tbl = torch.randn(32000 if width == 4096 else 8000, width, dtype=BF16, device=DEV)
    slab = torch.empty(n, width, dtype=BF16, device=DEV)
    ids, index = half_media(n)
    ids = ids % tbl.shape[0]
    medias = [torch.randn(n // 2, width, dtype=BF16, device=DEV) for _ in range(steps + 3)]
    errors = ss.new_error_word(DEV)
    ours = device_us([lambda m=m: ss.stage_embeddings(slab, ids, tbl, media=m, media_index=index, errors=errors)
                      for m in medias], steps)
    again = device_us([lambda m=medias[0]: ss.stage_embeddings(slab, ids, tbl, media=m, media_index=index,
                                                            errors=errors)] * (steps + 3), steps)
    host = _per_call([lambda m=m: ss.stage_embeddings(slab, ids, tbl, media=m, media_index=index, errors=errors)
                      for m in medias], steps)
    # the LightLLM-style peer: media rows found by fake ids past the vocabulary, images of 64 rows end to end
    starts, lengths, locs = image_ranges([64] * (n // 128), tbl.shape[0], DEV)
    fake = ids.clone()
    mrow = index >= 0
    fake[mrow] = tbl.shape[0] + index[mrow]
    peer = device_us([lambda m=m: lightllm_style_stage(slab, fake, tbl, m, starts, lengths, locs) for m in medias],
                     steps)
    del medias
    torch.cuda.empty_cache()
    ceiling = copy_ceiling_us(n, width, steps)
    # of_ceiling: new media each step against copies from a new source each step; same_input: both re-read one
    # source. call_us: a call back to back, host and device (when it exceeds ours_us, ours_us is host-bound)
    return dict(ours_us=ours, copy_us=ceiling["new_source_us"], of_ceiling=ceiling["new_source_us"] / ours,
                ours_same_input_us=again, copy_same_source_us=ceiling["same_source_us"],
                of_ceiling_same_input=ceiling["same_source_us"] / again, call_us=host,
                lightllm_us=peer, vs_lightllm=peer / ours)


def items16(sets: int):
    """The 16-items case (8192 x 4096 bf16, half the rows media): ``(stage(media), sets of 16 new items)``."""
    n, width = 8192, 4096
    table = torch.randn(32000, width, dtype=BF16, device=DEV)
    slab = torch.empty(n, width, dtype=BF16, device=DEV)
    ids, index = half_media(n)
    errors = ss.new_error_word(DEV)
    rows = n // 2 // 16
    items = [[torch.randn(rows, width, dtype=BF16, device=DEV) for _ in range(16)] for _ in range(sets)]
    return (lambda m: ss.stage_embeddings(slab, ids, table, media=m, media_index=index, errors=errors)), items


def items_cases(out, steps):
    stage, items = items16(steps + 3)
    tensors = [torch.cat(it) for it in items]
    r = {**both(stage, items, steps, "items"), **both(stage, tensors, steps, "tensor"),
         **both(lambda m: stage(torch.cat(m)), items, steps, "cat")}
    r["items_vs_tensor"] = r["items_us"] / r["tensor_us"]
    r["cat_vs_items"] = r["cat_us"] / r["items_us"]
    out["16 new items 8192x4096"] = r
    print(f"16 new items: {r['items_us']:.1f} us = {r['items_vs_tensor']:.3f}x one tensor; cat + stage "
          f"{r['cat_vs_items']:.2f}x slower; latency {r['items_latency_us']:.0f} / tensor "
          f"{r['tensor_latency_us']:.0f} / cat {r['cat_latency_us']:.0f} us", flush=True)
    del items, tensors
    # DeepStack k = 3: 8 items of 4 blocks into a slab 4 x 2048 wide
    n, (h, k) = 8192, (2048, 3)
    ids, index = half_media(n)
    errors = ss.new_error_word(DEV)
    wide = torch.empty(n, h * (1 + k), dtype=BF16, device=DEV)
    table = torch.randn(32000, h, dtype=BF16, device=DEV)
    rows = n // 2 // 8
    ds = [[tuple(torch.randn(rows, h, dtype=BF16, device=DEV) for _ in range(1 + k)) for _ in range(8)]
          for _ in range(steps + 3)]
    flat = [torch.cat([torch.cat(item, 1) for item in it]) for it in ds]
    stage = lambda m: ss.stage_embeddings(wide, ids, table, media=m, media_index=index, errors=errors)  # noqa: E731
    r = {**both(stage, ds, steps, "items"), "wide_us": device_us([lambda m=m: stage(m) for m in flat], steps)}
    r["items_vs_wide"] = r["items_us"] / r["wide_us"]
    out["DeepStack k=3 8 new items 8192x4x2048"] = r
    print(f"DeepStack k=3, 8 new items: {r['items_us']:.1f} us = {r['items_vs_wide']:.3f}x the wide tensor",
          flush=True)


def op_back_to_back(out, steps):
    """The standalone op against the LightLLM-style kernel, in the same run, new tensors every call (a new
    media tensor; and a new view ``base[:n]`` of one slab, as an engine stages): a call back to back (host
    and device together), the host time of a call alone (behind a busy device: no wait in it) and latency."""
    for n in (256, 2048):
        r = out[f"op back to back {n}x4096"] = _back_to_back(n, 4096, steps)
        print(f"stage_embeddings {n}x4096: back to back {r['ours_us']:.1f} us a call (new views "
              f"{r['views_us']:.1f}, custom op {r['custom_op_us']:.1f}), LightLLM-style {r['lightllm_us']:.1f} "
              f"({r['ratio']:.2f}x); host {r['ours_host_us']:.1f} (views {r['views_host_us']:.1f}, custom op "
              f"{r['custom_op_host_us']:.1f}) vs {r['lightllm_host_us']:.1f} us; latency "
              f"{r['ours_latency_us']:.0f} vs {r['lightllm_latency_us']:.0f} us", flush=True)


def host_us(calls, steps: int, per_round: int = 8, head_start_ms: float = 4.0) -> float:
    """The host time of a call alone: the median over ``calls[3:3 + steps]`` of the time each takes to return,
    in rounds of ``per_round`` behind a device sleep (the device is busy, so no call waits for it)."""
    for c in calls[:3]:
        c()
    torch.cuda.synchronize()
    cycles_per_us = _cycles_per_us()
    times = []
    for r in range(3, 3 + steps, per_round):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(head_start_ms * 1e3 * cycles_per_us))
        for c in calls[r:min(r + per_round, 3 + steps)]:
            t0 = time.perf_counter()
            c()
            times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _per_call(calls, steps: int) -> float:
    for c in calls[:3]:
        c()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for c in calls[3:3 + steps]:
        c()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / steps


def _back_to_back(n: int, width: int, steps: int) -> dict:
    table = torch.randn(32000, width, dtype=BF16, device=DEV)
    slab = torch.empty(n, width, dtype=BF16, device=DEV)
    ids, index = half_media(n)
    medias = [torch.randn(n // 2, width, dtype=BF16, device=DEV) for _ in range(steps + 3)]
    errors = ss.new_error_word(DEV)
    starts, lengths, locs = image_ranges([64] * max(1, n // 128), 32000, DEV)
    fake = ids.clone()
    mrow = index >= 0
    fake[mrow] = 32000 + index[mrow]
    base = torch.empty(n + 64, width, dtype=BF16, device=DEV)
    ways = dict(
        ours=[lambda m=m: ss.stage_embeddings(slab, ids, table, media=m, media_index=index, errors=errors)
              for m in medias],
        views=[lambda m=m, k=k: ss.stage_embeddings(base[k % 64:k % 64 + n], ids, table, media=m, media_index=index,
                                                    errors=errors) for k, m in enumerate(medias)],
        custom_op=[lambda m=m: stage_embeddings_op(slab, ids, table, media=m, media_index=index, errors=errors)
                   for m in medias],
        lightllm=[lambda m=m: lightllm_style_stage(slab, fake, table, m, starts, lengths, locs) for m in medias])
    r = {}
    for name, calls in ways.items():
        r[f"{name}_us"] = _per_call(calls, steps)
        r[f"{name}_host_us"] = host_us(calls, steps)
        r[f"{name}_latency_us"] = latency_us(calls[3:], steps)
    r["ratio"] = r["ours_us"] / r["lightllm_us"]
    r["host_ratio"] = r["ours_host_us"] / r["lightllm_host_us"]
    return r


def engine_style_merge(slab, ids, table, dmask, items):
    """What an engine does today with DeepStack items: the embedding, a masked scatter of each block's rows
    (concatenated across items), each copied into its columns of ``slab``."""
    n, h = ids.shape[0], table.shape[1]
    emb = torch.nn.functional.embedding(ids, table)
    emb.masked_scatter_(dmask[:, None], torch.cat([i[0] for i in items]))
    slab[:, :h].copy_(emb)
    for j in range(1, len(items[0])):
        level = torch.zeros(n, h, dtype=slab.dtype, device=slab.device)
        level.masked_scatter_(dmask[:, None], torch.cat([i[j] for i in items]))
        slab[:, h * j:h * (j + 1)].copy_(level)


def qwen3_vl_batch():
    """4096 tokens, 2320 media rows in 4 images of 580, k = 3 DeepStack levels, hidden 2048: ``(table, slab, ids,
    index, dmask, sizes, h, k)``."""
    n, h, k = 4096, 2048, 3
    table = torch.randn(32000, h, dtype=BF16, device=DEV)
    slab = torch.empty(n, h * (1 + k), dtype=BF16, device=DEV)
    sizes = [580] * 4
    ids = torch.randint(0, 32000, (n,), device=DEV)
    starts = [16 + i * 980 for i in range(4)]
    mask = torch.zeros(n, dtype=torch.bool)
    for start, size in zip(starts, sizes):
        mask[start:start + size] = True
    spans = [(start, size, sum(sizes[:i])) for i, (start, size) in enumerate(zip(starts, sizes))]
    index = ss.media_index_from_spans(spans, n, device=DEV)
    return table, slab, ids, index, mask.to(DEV), sizes, h, k


def qwen3_vl_like(out, steps):
    """The Qwen3-VL-like batch (:func:`qwen3_vl_batch`), new items each step."""
    table, slab, ids, index, dmask, sizes, h, k = qwen3_vl_batch()
    errors = ss.new_error_word(DEV)
    items = [[tuple(torch.randn(s, h, dtype=BF16, device=DEV) for _ in range(1 + k)) for s in sizes]
             for _ in range(steps + 3)]

    def ours(it):
        ss.stage_embeddings(slab, ids, table, media=it, media_index=index, errors=errors)

    def engine(it):
        engine_style_merge(slab, ids, table, dmask, it)

    r = {**both(ours, items, steps, "ours"), **both(engine, items, steps, "engine")}
    r["device_speedup"] = r["engine_us"] / r["ours_us"]
    r["latency_speedup"] = r["engine_latency_us"] / r["ours_latency_us"]
    out["Qwen3-VL-like merge 4096 tokens k=3"] = r
    print(f"Qwen3-VL-like merge: device {r['ours_us']:.1f} vs engine-style {r['engine_us']:.1f} us "
          f"({r['device_speedup']:.1f}x); latency {r['ours_latency_us']:.0f} vs {r['engine_latency_us']:.0f} us "
          f"({r['latency_speedup']:.1f}x)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "staging_figures.json"))
    cases = dict(large=large_cases, items=items_cases, op=op_back_to_back, qwen3_vl=qwen3_vl_like)
    p.add_argument("--cases", default=",".join(cases), help="comma-separated, of: " + ", ".join(cases))
    args = p.parse_args()
    steps = 10 if args.quick else 40
    out = dict(machine=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                            triton=__import__("triton").__version__, python=platform.python_version(),
                            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())))
    for name in args.cases.split(","):
        cases[name](out, steps)
        torch.cuda.empty_cache()
    json.dump(out, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
