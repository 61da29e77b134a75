"""PrefillGraphRunner on the toy model: replay against eager, host time per run, capture cost.

- ``test_step``: one prefill step end to end (stage + forward, then a device
  sync), wall-clock time: ``replay`` (:meth:`PrefillGraphRunner.run` on the graph
  path) against ``eager`` (the same runner API with ``enforce_eager=True``: the
  same staging, then ``forward`` launched op by op).
- ``test_run_host_time``: host (CPU) time of one ``run`` call (staging launch +
  replay launch), no sync inside, with the batch's integer inputs on the device
  or on the host.
- ``test_capture``: seconds per bucket and GPU memory for the whole ladder
  against the largest bucket alone.

Toy model: plain variant, hidden 1024, 4 layers, 16 heads, vocab 32000, bf16,
half of each batch media, 4 packed sequences; buckets ``default_token_buckets(4096)``.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

from slabstage import PrefillGraphRunner, StagingBuffers, default_token_buckets
from slabstage.models import ToyMultimodalModel, make_batch

HAS_CUDA = torch.cuda.is_available()
SUITE = "graph_runner"
MAX_TOKENS = 4096
TOKENS = [16, 256, 1000, 4096]

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="graph runner benchmarks need a CUDA device")


def _model():
    return ToyMultimodalModel("plain", hidden_size=1024, vocab_size=32000, num_layers=4, num_heads=16,
                              device="cuda", dtype=torch.bfloat16, seed=0)


@pytest.fixture(scope="module")
def setup():
    model = _model()
    buffers = StagingBuffers.allocate(max_num_tokens=MAX_TOKENS, max_batch_size=16, embed_width=model.embed_width,
                                      embed_dtype=torch.bfloat16, device="cuda")
    replay = PrefillGraphRunner(model, buffers, progress=False).capture()
    eager = PrefillGraphRunner(model, buffers, enforce_eager=True, progress=False)
    g = torch.Generator().manual_seed(0)
    batches = {n: make_batch(model, n, media_fraction=0.5, num_seqs=min(4, n), generator=g) for n in TOKENS}
    dev_batches = {n: make_batch(model, n, media_fraction=0.5, num_seqs=min(4, n), generator=g, device="cuda")
                   for n in TOKENS}
    yield model, replay, eager, batches, dev_batches
    replay.reset()


def _wall_step(runner, batch):
    def step():
        runner.run(batch)
        torch.cuda.synchronize()
    return step


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("impl", ["replay", "eager"])
def test_step(benchmark, setup, impl, tokens):
    model, replay, eager, batches, _ = setup
    runner = replay if impl == "replay" else eager
    batch = batches[tokens]
    out = runner.run(batch, clone=True)
    ref = model(runner.registry.views(runner.last_bucket or tokens))[:tokens]
    assert torch.equal(out, ref), "benchmark inputs must give the eager result"
    benchmark._timer = time.perf_counter
    benchmark.pedantic(_wall_step(runner, batch), setup=torch.cuda.synchronize, rounds=200, warmup_rounds=20,
                       iterations=1)
    benchmark.extra_info.update(suite=SUITE, impl=impl, tokens=tokens, metric="wall", bucket=runner.last_bucket,
                                timer="perf_counter+sync")


@pytest.mark.parametrize("tokens", [16, 256, 4096])
@pytest.mark.parametrize("inputs", ["device", "host"])
def test_run_host_time(benchmark, setup, inputs, tokens):
    _, replay, _, batches, dev_batches = setup
    batch = (dev_batches if inputs == "device" else batches)[tokens]
    benchmark._timer = time.perf_counter
    benchmark.pedantic(lambda: replay.run(batch), setup=torch.cuda.synchronize, rounds=1000, warmup_rounds=100,
                       iterations=1)
    benchmark.extra_info.update(suite=SUITE, impl=f"run_{inputs}_inputs", tokens=tokens, metric="host",
                                timer="perf_counter")


def _capture_cost(buckets):
    model = _model()
    buffers = StagingBuffers.allocate(max_num_tokens=MAX_TOKENS, max_batch_size=16, embed_width=model.embed_width,
                                      embed_dtype=torch.bfloat16, device="cuda")
    runner = PrefillGraphRunner(model, buffers, buckets=buckets, progress=False).capture()
    cost = runner.capture_seconds, runner.capture_bytes
    runner.reset()
    del runner, buffers, model
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return cost


def test_capture(benchmark):
    largest_s, largest_bytes = _capture_cost([MAX_TOKENS])
    ladder = default_token_buckets(MAX_TOKENS)
    result = {}

    def capture_all():
        result["cost"] = _capture_cost(ladder)

    benchmark._timer = time.perf_counter
    benchmark.pedantic(capture_all, rounds=1, iterations=1)
    seconds, nbytes = result["cost"]
    benchmark.extra_info.update(
        suite=SUITE, impl="capture", metric="capture", buckets=len(ladder), capture_s=seconds,
        s_per_bucket=seconds / len(ladder), bytes_all=nbytes, bytes_largest=largest_bytes,
        memory_ratio=nbytes / max(1, largest_bytes), largest_alone_s=largest_s)
