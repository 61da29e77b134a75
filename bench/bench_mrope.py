"""mrope positions on the device: pack_requests' host time, the staging launch's device time with them.

Every timed round gets new requests: new ids tensors and new encoder outputs, made untimed before it.

- ``test_pack_host``: host time of ``slabstage.hf.pack_requests`` (``host_bench``) for a 4096-token
  Qwen2.5-VL request with 4 images, and 4-request batches (2 images each, ~4000 tokens) of Qwen3-VL
  and Qwen2.5-VL. ``layout``: positions as one ``MropeLayout`` a request (what the kernel computes
  them from); ``rope_index``: positions from HF's ``get_rope_index`` on the host (the path before
  layouts, and what an engine without them does). Runs without CUDA too (host work alone).
- ``test_pack_run_host``: host time of ``pack_requests`` + ``runner.run`` (the replay of a graph
  holding the staging launch and an empty forward), both paths, new encoder outputs every step.
- ``test_staging_device``: device time of that step (``device_bench``, a head start hides the host)
  for the Qwen3-VL batch: mrope from layouts, from a device tensor, and no mrope slot at all.
- ``test_merge``: the whole merge, from encoder outputs ready to the replay done, against the
  engine-style merge with the engine's own host-side mrope (``get_rope_index`` per request, embedding,
  ``masked_scatter``, a DeepStack side buffer, copies into the static buffers): latency (host and
  device, synced, median) and device time, one run.
- ``test_first_call``: in a fresh process (this file run as a script), the first ``pack_requests`` call
  and the first ``run()`` of a captured runner against the calls after them (what a server's first
  request pays). The benchmark's own time is the process's wall time; the figures are in ``extra_info``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

if __name__ == "__main__":  # the fresh process of test_first_call: the checkout's slabstage
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import slabstage as ss  # noqa: E402
from harness import synced_us  # noqa: E402

transformers = pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
import slabstage.hf.pack as pack  # noqa: E402
from slabstage.hf.tiny import IMAGE, VISION_END, VISION_START, tiny_model  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
SUITE = "mrope"
MAX_TOKENS = 4096
LATENCY_ROUNDS = 50
ROUNDS = 200  # timed rounds, each on new requests and encoder outputs
# the mid-size configs of bench_hf.py (text hidden 2048, 4 layers); on the CPU a small one (host work alone)
SIZE = dict(hidden=2048, layers=4, heads=16, kv_heads=8, intermediate=6144, vocab=32000) if HAS_CUDA else \
    dict(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=64, vocab=32000)
_MODELS: dict = {}


def _model(family):
    if family not in _MODELS:
        extra = dict(deepstack=3) if family == "qwen3_vl" else {}
        _MODELS[family] = tiny_model(family, **SIZE, **extra, dtype=torch.bfloat16, device=DEVICE)
    return _MODELS[family]


def _requests(model, case: str, g: torch.Generator):
    """``1x4096``: one request of 4080 tokens, 4 images of 768 rows between text; ``4x2``: 4 requests x 2
    images of 448 rows."""
    count, images, grid, text = (1, 4, (1, 32, 96), 200) if case == "1x4096" else (4, 2, (1, 32, 56), 40)
    rows = grid[0] * grid[1] * grid[2] // 4
    hidden, k = model.config.text_config.hidden_size, 3 if model.config.model_type == "qwen3_vl" else 0
    requests = []
    for _ in range(count):
        parts = [torch.randint(0, 80, (text,), generator=g)]
        for _ in range(images):
            parts += [torch.tensor([VISION_START]), torch.full((rows,), IMAGE), torch.tensor([VISION_END]),
                      torch.randint(0, 80, (text,), generator=g)]
        ids = torch.cat(parts)
        items = [tuple(torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16) for _ in range(1 + k))
                 if k else torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16) for _ in range(images)]
        requests.append(sshf.Request(ids, items, image_grid_thw=torch.tensor([grid] * images)))
    return requests


def _rope_index_path(monkeypatch):
    """pack_requests as before layouts: positions from get_rope_index on the host, one [3, n] tensor."""
    monkeypatch.setattr(pack, "layout_rule", lambda version: None)


CASES = [("qwen2_5_vl", "1x4096"), ("qwen3_vl", "4x2"), ("qwen2_5_vl", "4x2")]


@pytest.mark.parametrize("path", ["layout", "rope_index"])
@pytest.mark.parametrize("family, case", CASES)
def test_pack_host(host_bench, monkeypatch, family, case, path):
    model = _model(family)
    requests = _requests(model, case, torch.Generator().manual_seed(0))
    if path == "rope_index":
        _rope_index_path(monkeypatch)
    batch = sshf.pack_requests(model, requests)
    assert isinstance(batch.mrope_positions, list if path == "layout" else torch.Tensor)
    _each_round(host_bench, lambda reqs: sshf.pack_requests(model, reqs), requests)
    host_bench.extra_info.update(suite=SUITE, case=f"{family} {case}", path=path, tokens=batch.num_tokens,
                                 requests=len(requests), items=sum(len(r.media) for r in requests))


def _runner(model, mrope: bool, bucket: int):
    buffers = ss.StagingBuffers.allocate(max_num_tokens=MAX_TOKENS, max_batch_size=16,
                                         embed_width=sshf.input_embeds_width(model), embed_dtype=torch.bfloat16,
                                         device="cuda", mrope=mrope)
    return ss.PrefillGraphRunner(lambda views: views["input_embeds"][:, :1] * 1, buffers, buckets=[bucket],
                                 progress=False).capture()


def _fresh(requests):
    """The same prompts as new requests: new ids tensors and new encoder outputs (new tensors), as a scheduler
    and an encoder make them each step."""
    return [sshf.Request(r.input_ids.clone(), [tuple(torch.randn_like(b) for b in m) if isinstance(m, tuple)
                                               else torch.randn_like(m) for m in r.media],
                         image_grid_thw=r.image_grid_thw.clone()) for r in requests]


def _each_round(bench, fn, requests, make=None, rounds=ROUNDS):
    """``bench`` times ``fn(x)`` where ``x`` is made before each round, untimed: ``make(fresh requests)`` (by
    default the fresh requests themselves), then the bench's own round setup (a sync; or the L2 flush and
    head start of device time)."""
    def setup():
        x = _fresh(requests)
        x = x if make is None else make(x)
        bench.setup()
        return (x,), {}
    return bench.benchmark.pedantic(fn, setup=setup, rounds=rounds, warmup_rounds=max(1, rounds // 10),
                                    iterations=1)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("path", ["layout", "rope_index"])
@pytest.mark.parametrize("family, case", CASES)
def test_pack_run_host(host_bench, monkeypatch, family, case, path):
    model = _model(family)
    requests = _requests(model, case, torch.Generator().manual_seed(1))
    if path == "rope_index":
        _rope_index_path(monkeypatch)
    n = sshf.pack_requests(model, requests).num_tokens
    runner = _runner(model, True, next(b for b in ss.default_token_buckets(MAX_TOKENS) if b >= n))
    _each_round(host_bench, lambda reqs: runner.run(sshf.pack_requests(model, reqs)), requests)
    host_bench.extra_info.update(suite=SUITE, case=f"{family} {case}", path=path, tokens=n,
                                 fallback=runner.last_fallback)
    runner.reset()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("mrope", ["layout", "device_tensor", "none"])
def test_staging_device(device_bench, mrope):
    model = _model("qwen3_vl")
    requests = _requests(model, "4x2", torch.Generator().manual_seed(2))
    batch = sshf.pack_requests(model, requests)
    n = batch.num_tokens
    bucket = next(b for b in ss.default_token_buckets(MAX_TOKENS) if b >= n)
    positions = torch.cat([sshf.mrope_positions(model, r.input_ids, r.image_grid_thw) for r in requests], 1)

    def make(reqs):  # a batch of new requests and encoder outputs, its mrope as the case gives it
        batch = sshf.pack_requests(model, reqs)
        if mrope == "device_tensor":
            batch.mrope_positions = positions.cuda()
        elif mrope == "none":
            batch.mrope_positions = None
        return batch
    batch = make(requests)
    runner = _runner(model, mrope != "none", bucket)
    want = runner.run(batch, clone=True)
    assert runner.last_fallback is None and want is not None
    if mrope == "layout":  # the staged positions are get_rope_index's
        assert torch.equal(runner.buffers.mrope_positions[:, :n].cpu(), positions)
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner.run(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    _each_round(device_bench, runner.run, requests, make)
    device_bench.extra_info.update(suite=SUITE, case="qwen3_vl 4x2 staging", mrope=mrope, tokens=n, bucket=bucket)
    runner.reset()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("impl", ["slabstage", "engine"])
def test_merge(device_bench, impl):
    from bench_hf import PeerMerge  # the engine-style merge of bench_hf.py

    model = _model("qwen3_vl")
    requests = _requests(model, "4x2", torch.Generator().manual_seed(3))
    n = sshf.pack_requests(model, requests).num_tokens
    bucket = next(b for b in ss.default_token_buckets(MAX_TOKENS) if b >= n)
    runner = _runner(model, True, bucket)
    if impl == "slabstage":
        def merge(reqs):
            runner.run(sshf.pack_requests(model, reqs))
    else:
        buffers = runner.buffers
        graph = torch.cuda.CUDAGraph()
        views = buffers.registry.views(bucket)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            views["input_embeds"][:, :1] * 1

        def merge(reqs):  # the engine's own host-side mrope (HF's rope index), its merge into the same buffers
            lens = [r.input_ids.shape[0] for r in reqs]
            batch = SimpleNamespace(
                num_tokens=sum(lens), input_ids=torch.cat([r.input_ids for r in reqs]),
                positions=torch.cat([torch.arange(k) for k in lens]),
                mrope_positions=torch.cat([sshf.mrope_positions(model, r.input_ids, r.image_grid_thw)
                                           for r in reqs], 1),
                seq_lens=torch.tensor(lens, dtype=torch.int32),
                extend_start_loc=torch.tensor([sum(lens[:i]) for i in range(len(lens))], dtype=torch.int32))
            PeerMerge(model, buffers, batch, reqs).engine(bucket)
            graph.replay()
    latency = []
    for _ in range(LATENCY_ROUNDS):
        reqs = _fresh(requests)
        latency.append(synced_us(lambda reqs=reqs: merge(reqs)))
    latency = statistics.median(latency)
    _each_round(device_bench, merge, requests)
    device_bench.extra_info.update(suite=SUITE, case="qwen3_vl 4x2 merge", impl=impl, tokens=n, bucket=bucket,
                                   latency_us=latency)
    runner.reset()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("family, case", CASES)
def test_first_call(benchmark, family, case):
    def worker():
        out = subprocess.run([sys.executable, __file__, family, case], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    figures = benchmark.pedantic(worker, rounds=1, iterations=1)
    benchmark.extra_info.update(suite=SUITE, case=f"{family} {case} first call", metric="first_call",
                                timer="process wall time", **figures)


def _first_calls(family: str, case: str) -> dict:
    """A fresh process: the first pack_requests and run() against the next ones (µs, new requests each)."""
    model = _model(family)
    requests = _requests(model, case, torch.Generator().manual_seed(4))
    start = time.perf_counter()
    batch = sshf.pack_requests(model, _fresh(requests))
    first_pack = time.perf_counter() - start
    packs = []
    for _ in range(20):
        reqs = _fresh(requests)
        start = time.perf_counter()
        sshf.pack_requests(model, reqs)
        packs.append(time.perf_counter() - start)
    runner = _runner(model, True, next(b for b in ss.default_token_buckets(MAX_TOKENS) if b >= batch.num_tokens))
    torch.cuda.synchronize()
    first_run = synced_us(lambda: runner.run(batch))
    runs = [synced_us(lambda b=sshf.pack_requests(model, _fresh(requests)): runner.run(b)) for _ in range(20)]
    return dict(first_pack_us=first_pack * 1e6, next_pack_us=statistics.median(packs) * 1e6,
                first_run_latency_us=first_run, next_run_latency_us=statistics.median(runs),
                capture_s=runner.capture_seconds)


if __name__ == "__main__":  # the fresh process of test_first_call
    print(json.dumps(_first_calls(sys.argv[1], sys.argv[2])))
