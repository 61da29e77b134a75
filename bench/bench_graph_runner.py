"""PrefillGraphRunner on the toy model: replay against eager, host time per run, capture cost.

- ``test_step``: one prefill step end to end (stage + forward, then a device
  sync), wall-clock time: ``replay`` (:meth:`PrefillGraphRunner.run` on the graph
  path) against ``eager`` (the same runner API with ``enforce_eager=True``: the
  same staging, then ``forward`` launched op by op).
- ``test_run_host_time``: host (CPU) time per ``run`` call (staging launch +
  replay launch), no sync inside, with the batch's integer inputs on the device
  or on the host: one call right after a device sync, and each of 8 calls made
  back to back after one; and ``graph.replay()`` alone (the model's graph
  launch, part of every ``run``).
- ``test_capture``: seconds per bucket and GPU memory for the whole ladder
  against the largest bucket alone, each captured in a process of its own:
  the growth of reserved memory over ``capture()`` and the graph pool's size.

Toy model: plain variant, hidden 1024, 4 layers, 16 heads, vocab 32000, bf16,
half of each batch media, 4 packed sequences; buckets ``default_token_buckets(4096)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


BURST = 8


@pytest.mark.parametrize("tokens", [16, 256, 4096])
@pytest.mark.parametrize("inputs", ["device", "host"])
@pytest.mark.parametrize("calls", [1, BURST])
def test_run_host_time(benchmark, setup, inputs, tokens, calls):
    """Host time per ``run``, from a device sync: one call, or each of ``BURST`` back-to-back calls.

    One call right after a sync is what a step costs when the engine waits for the
    GPU before building the next batch; back-to-back calls are the steady state of
    an engine that overlaps the next batch's scheduling with the GPU.
    """
    _, replay, _, batches, dev_batches = setup
    batch = (dev_batches if inputs == "device" else batches)[tokens]

    def burst():
        for _ in range(calls):
            replay.run(batch)

    benchmark._timer = (lambda: time.perf_counter() / calls) if calls > 1 else time.perf_counter  # per call
    benchmark.pedantic(burst, setup=torch.cuda.synchronize, rounds=1000 // calls, warmup_rounds=20, iterations=1)
    mode = "1 call after a sync" if calls == 1 else f"{calls} calls back to back"
    benchmark.extra_info.update(suite=SUITE, impl=f"{inputs} inputs, {mode}", shape=f"{tokens} tokens",
                                tokens=tokens, metric="host", timer="perf_counter", calls=calls)


@pytest.mark.parametrize("tokens", [16, 256, 4096])
def test_replay_launch_host_time(benchmark, setup, tokens):
    """Host time of the bucket's ``graph.replay()`` alone, one call after a sync: the model's share of ``run``."""
    _, replay, _, _, _ = setup
    graph, _ = replay.graphs[replay.bucket_for(tokens)]
    benchmark._timer = time.perf_counter
    benchmark.pedantic(graph.replay, setup=torch.cuda.synchronize, rounds=1000, warmup_rounds=20, iterations=1)
    torch.cuda.synchronize()  # (bare replays run before the next run() writes its parameter record)
    benchmark.extra_info.update(suite=SUITE, impl="graph.replay() alone, 1 call after a sync",
                                shape=f"{tokens} tokens", tokens=tokens, metric="host", timer="perf_counter")


def _capture_cost(which: str) -> dict:
    """Capture the largest bucket alone or the whole ladder in a fresh process; its cost as a dict.

    A process of its own for each, so neither inherits the other's allocator cache
    or the capture stream's cuBLAS workspace.
    """
    model = _model()
    buffers = StagingBuffers.allocate(max_num_tokens=MAX_TOKENS, max_batch_size=16, embed_width=model.embed_width,
                                      embed_dtype=torch.bfloat16, device="cuda")
    buckets = [MAX_TOKENS] if which == "largest" else default_token_buckets(MAX_TOKENS)
    runner = PrefillGraphRunner(model, buffers, buckets=buckets, progress=False).capture()
    pool = tuple(runner.pool)
    pool_bytes = sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                     if tuple(s.get("segment_pool_id", ())) == pool)
    return dict(buckets=len(buckets), seconds=runner.capture_seconds, bytes=runner.capture_bytes,
                pool_bytes=pool_bytes)


def _capture_cost_in_child(which: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--capture-cost", which], check=True, capture_output=True,
                          text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_capture(benchmark):
    largest = _capture_cost_in_child("largest")
    result = {}

    def capture_all():
        result["ladder"] = _capture_cost_in_child("ladder")

    benchmark._timer = time.perf_counter
    benchmark.pedantic(capture_all, rounds=1, iterations=1)
    ladder = result["ladder"]
    benchmark.extra_info.update(
        suite=SUITE, impl="capture", metric="capture", buckets=ladder["buckets"], capture_s=ladder["seconds"],
        s_per_bucket=ladder["seconds"] / ladder["buckets"], bytes_all=ladder["bytes"], bytes_largest=largest["bytes"],
        memory_ratio=ladder["bytes"] / max(1, largest["bytes"]), pool_bytes_all=ladder["pool_bytes"],
        pool_bytes_largest=largest["pool_bytes"], pool_ratio=ladder["pool_bytes"] / max(1, largest["pool_bytes"]),
        largest_alone_s=largest["seconds"])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--capture-cost":
        print(json.dumps(_capture_cost(sys.argv[2])))
