"""Staging as an engine meets it: new tensors at new addresses every round, never the same objects again.

Each round gets inputs made for it beforehand (outside timing), as an encoder hands over new
outputs every step. Two metrics per implementation: ``device`` (CUDA events, behind the L2 flush
and head start of ``device_bench``: the device's time alone) and ``latency`` (host clock around
the call and a sync after it, the device idle before: what a step waits when the GPU is not ahead).
Cases (bf16, vocabulary 32000):

- ``one_tensor``: 32768x4096 and 8192x16384, half the rows media (alternating 64-row spans), one
  new media tensor; against ``copy_new_source`` (the slab's bytes copied from a new tensor: the
  ceiling) and the LightLLM-style kernel (``bench/peer_lightllm.py``).
- ``items16``: 8192x4096, the media as 16 new item tensors; against one new tensor of the same rows
  and ``torch.cat`` of the items then staging.
- ``deepstack``: 8192 tokens into a 4 x 2048 slab, 8 new items of 4 column blocks; against one new
  pre-concatenated wide tensor.
- ``qwen3_vl``: 4096 tokens, 4 images of 580 rows, k = 3 (``qwen3_vl_batch``); against
  the engine-style merge (embedding, masked scatter per level, copies).
- ``op``: ``stage_embeddings`` at 256 and 2048 x 4096 (into one slab, into a new view of one slab each call,
  and as the custom op) against the LightLLM-style kernel: latency, and ``host`` (the host time of a call
  alone: the clock around the call behind ``between_rounds``' head start, so the device is busy and no call
  waits for it).

``python bench/run.py --suite new_inputs -k test_op`` measures the op's cases alone.
"""

from __future__ import annotations

import time

import pytest
import torch
from peer_lightllm import image_ranges, lightllm_style_stage

import slabstage as ss
from slabstage.ops import stage_embeddings_op

HAS_CUDA = torch.cuda.is_available()

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="new inputs every round: the figures are the GPU's")
DEV = torch.device("cuda")


def _time(bench, metric, request, calls):
    """Time ``calls[i]()`` in round ``i``: device time (``bench`` is ``device_bench``), latency, or the host time
    of the call alone behind a busy device (the queue drained, then the head start; no sync in the call: without
    the drain the host would run rounds ahead and meet the stager's ring full, timing the device instead)."""
    between = request.getfixturevalue("between_rounds") if metric != "latency" else torch.cuda.synchronize
    it = iter(calls)

    def setup():
        if metric == "host":
            torch.cuda.synchronize()
        between()
        return (next(it),), {}

    def call(c):
        c()
        if metric == "latency":
            torch.cuda.synchronize()

    b = bench.benchmark
    if metric != "device":
        b._timer = time.perf_counter  # (as host_bench does: the host clock)
    b.extra_info.update(metric=metric)
    b.pedantic(call, setup=setup, rounds=len(calls) - bench.warmup_rounds, warmup_rounds=bench.warmup_rounds)


def half_media(n):
    """A batch of ``n`` rows, every other block of 64 rows media: ``(ids, media_index)`` on the device."""
    ids = torch.randint(0, 32000, (n,), device=DEV)
    index = torch.full((n,), -1, dtype=torch.int64)
    media = (torch.arange(n) // 64) % 2 == 1
    index[media] = torch.arange(int(media.sum()))
    return ids, index.to(DEV)


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


def _rounds(bench):
    return bench.rounds + bench.warmup_rounds


@pytest.mark.parametrize("metric", ["device", "latency"])
@pytest.mark.parametrize("impl", ["slabstage", "copy_new_source", "lightllm_style"])
@pytest.mark.parametrize("shape", [(32768, 4096), (8192, 16384)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_one_tensor(device_bench, request, shape, impl, metric):
    n, width = shape
    table = torch.randn(32000 if width == 4096 else 8000, width, dtype=BF16, device=DEV)
    slab = torch.empty(n, width, dtype=BF16, device=DEV)
    ids, index = half_media(n)
    ids %= table.shape[0]
    errors = ss.new_error_word(DEV)
    k = _rounds(device_bench)
    if impl == "copy_new_source":
        calls = [lambda s=torch.randn(n, width, dtype=BF16, device=DEV): slab.copy_(s) for _ in range(k)]
    else:
        media = [torch.randn(n // 2, width, dtype=BF16, device=DEV) for _ in range(k)]
        if impl == "slabstage":
            calls = [lambda m=m: ss.stage_embeddings(slab, ids, table, media=m, media_index=index, errors=errors)
                     for m in media]
        else:
            starts, lengths, locs = image_ranges([64] * (n // 128), table.shape[0], DEV)
            fake = torch.where(index >= 0, table.shape[0] + index, ids)
            calls = [lambda m=m: lightllm_style_stage(slab, fake, table, m, starts, lengths, locs) for m in media]
    device_bench.extra_info.update(case="one_tensor", shape=f"{n}x{width}", impl=impl)
    _time(device_bench, metric, request, calls)


@pytest.mark.parametrize("metric", ["device", "latency"])
@pytest.mark.parametrize("impl", ["slabstage_items", "slabstage_one_tensor", "cat_then_stage"])
def test_items16(device_bench, request, impl, metric):
    stage, new = items16(_rounds(device_bench))
    if impl == "slabstage_one_tensor":
        new = [torch.cat(it) for it in new]
    prep = (lambda m: torch.cat(m)) if impl == "cat_then_stage" else (lambda m: m)
    device_bench.extra_info.update(case="items16", shape="8192x4096", impl=impl)
    _time(device_bench, metric, request, [lambda m=m: stage(prep(m)) for m in new])


@pytest.mark.parametrize("metric", ["device", "latency"])
@pytest.mark.parametrize("impl", ["slabstage_items", "slabstage_wide_tensor"])
def test_deepstack(device_bench, request, impl, metric):
    n, h, k = 8192, 2048, 3
    table = torch.randn(32000, h, dtype=BF16, device=DEV)
    slab = torch.empty(n, h * (1 + k), dtype=BF16, device=DEV)
    ids, index = half_media(n)
    errors = ss.new_error_word(DEV)
    rows = n // 2 // 8
    new = [[tuple(torch.randn(rows, h, dtype=BF16, device=DEV) for _ in range(1 + k)) for _ in range(8)]
           for _ in range(_rounds(device_bench))]
    if impl == "slabstage_wide_tensor":
        new = [torch.cat([torch.cat(item, 1) for item in it]) for it in new]
    device_bench.extra_info.update(case="deepstack", shape=f"{n}x4x{h}", impl=impl)
    _time(device_bench, metric, request, [
        lambda m=m: ss.stage_embeddings(slab, ids, table, media=m, media_index=index, errors=errors) for m in new])


@pytest.mark.parametrize("metric", ["device", "latency"])
@pytest.mark.parametrize("impl", ["slabstage", "engine_style"])
def test_qwen3_vl(device_bench, request, impl, metric):
    table, slab, ids, index, dmask, sizes, h, k = qwen3_vl_batch()
    errors = ss.new_error_word(DEV)
    new = [[tuple(torch.randn(s, h, dtype=BF16, device=DEV) for _ in range(1 + k)) for s in sizes]
           for _ in range(_rounds(device_bench))]
    if impl == "slabstage":
        calls = [lambda m=m: ss.stage_embeddings(slab, ids, table, media=m, media_index=index, errors=errors)
                 for m in new]
    else:
        calls = [lambda m=m: engine_style_merge(slab, ids, table, dmask, m) for m in new]
    device_bench.extra_info.update(case="qwen3_vl", shape=f"{ids.shape[0]}x{slab.shape[1]}", impl=impl)
    _time(device_bench, metric, request, calls)


@pytest.mark.parametrize("metric", ["latency", "host"])
@pytest.mark.parametrize("impl", ["slabstage", "slabstage_views", "custom_op", "lightllm_style"])
@pytest.mark.parametrize("n", [256, 2048])
def test_op(device_bench, request, n, impl, metric):
    width = 4096
    table = torch.randn(32000, width, dtype=BF16, device=DEV)
    slab = torch.empty(n, width, dtype=BF16, device=DEV)
    ids, index = half_media(n)
    errors = ss.new_error_word(DEV)
    media = [torch.randn(n // 2, width, dtype=BF16, device=DEV) for _ in range(_rounds(device_bench))]
    if impl == "slabstage":
        calls = [lambda m=m: ss.stage_embeddings(slab, ids, table, media=m, media_index=index, errors=errors)
                 for m in media]
    elif impl == "slabstage_views":  # a new view base[k:k + n] of one slab each call, as an engine stages
        base = torch.empty(n + 64, width, dtype=BF16, device=DEV)
        calls = [lambda m=m, k=k % 64: ss.stage_embeddings(base[k:k + n], ids, table, media=m, media_index=index,
                                                            errors=errors) for k, m in enumerate(media)]
    elif impl == "custom_op":
        calls = [lambda m=m: stage_embeddings_op(slab, ids, table, media=m, media_index=index, errors=errors)
                 for m in media]
    else:
        starts, lengths, locs = image_ranges([64] * max(1, n // 128), 32000, DEV)
        fake = torch.where(index >= 0, 32000 + index, ids)
        calls = [lambda m=m: lightllm_style_stage(slab, fake, table, m, starts, lengths, locs) for m in media]
    device_bench.extra_info.update(case="op", shape=f"{n}x{width}", impl=impl)
    _time(device_bench, metric, request, calls)
