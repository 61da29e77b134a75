"""Soak: thousands of random batches through PrefillGraphRunner.run, each checked against eager.

Every step draws a batch (1..capacity tokens, 1..8 sequences, a media fraction
in [0, 1], integer inputs on the host or the device) from the toy model's
``make_batch``, runs it, and checks:

- the output equals the model's eager forward on the same staged buffers
  (``views(bucket)`` on the graph path, ``views(n)`` on the eager one), bit for bit;
- the slab holds the batch's rows (text from the table, media from the encoder,
  widened by the model's expand policy) and zeros in ``[n, bucket)``;
- the error word is clean; about one step in fifty gets a bad token id on a text
  row, which must zero that row and raise ``StagingError`` naming it;
- on CUDA, after a fixed warm-up that touches every bucket and the eager sizes:
  ``torch.cuda.memory_allocated`` never moves (0 bytes of drift) and
  ``memory_reserved`` stays within one allocator segment; the runner never
  re-captures (the graphs dict, its graphs and the registry signature are the
  same objects at the end).

Sizes above the largest bucket and batches the padding ratio refuses run
eagerly, so both paths are soaked. ``SLABSTAGE_SOAK_STEPS`` (default 10000)
sets the CUDA step count; ``SLABSTAGE_SOAK_OUT`` names a JSON file for the
one-line summary (also printed; run pytest with ``-s`` to see it). The CPU
variant (a few dozen steps, eager, Triton under the interpreter) always runs.

    SLABSTAGE_SOAK_STEPS=10000 SLABSTAGE_SOAK_OUT=soak.json python -m pytest tests/runner/test_soak.py -m slow -s
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import time
from collections import Counter

import pytest
import torch

from slabstage import BAD_TOKEN_ID, PrefillGraphRunner, StagingBuffers, StagingError, raise_if_errors, reset_errors
from slabstage.models import ToyMultimodalModel, make_batch

from expected import expected_slab  # noqa: I001 - tests/expected.py

NO_ROW = 2**31 - 1
CLEAN = [0, 0, NO_ROW, 0]
MAX_SEQS = 8
BAD_EVERY = 50  # about one step in BAD_EVERY carries a bad token id
# The caching allocator maps memory in segments (2 MiB small, 20 MiB large); a new mix of sizes can
# fragment its cache into one more segment. A leak grows without bound, and shows in memory_allocated,
# which must not move at all.
RESERVED_SLACK = 20 * 2**20


def _draw(rng: random.Random, capacity: int) -> tuple[int, float, int, bool]:
    """(tokens, media fraction, sequences, integer inputs on the device?) for one step."""
    if rng.random() < 0.5:
        n = rng.randint(1, capacity)
    else:  # log-uniform: small batches, where the buckets are dense, get their share
        n = min(capacity, int(math.exp(rng.uniform(0, math.log(capacity + 1)))))
        n = max(1, n)
    u = rng.random()
    fraction = 0.0 if u < 0.15 else 1.0 if u < 0.3 else rng.random()
    return n, fraction, rng.randint(1, min(MAX_SEQS, n)), rng.random() < 0.5


def _expected_slab(model, batch, bad_row: int | None) -> torch.Tensor:
    """Rows [0, n) as the contract says (tests/expected.py); the planted bad id's row is zero there."""
    before = torch.zeros(batch.num_tokens, model.embed_width, dtype=model.dtype)
    out, word = expected_slab(before, batch.input_ids, batch.table, batch.media, batch.media_index,
                              expand=model.expand)
    assert (word[1] == 1) == (bad_row is not None) and (bad_row is None or word[2] == bad_row)
    return out.to(model.device)


def _corrupt(model, batch, rng: random.Random) -> int | None:
    """Give one text row an id past the vocabulary; return the row (None: the batch has no text row)."""
    n = batch.num_tokens
    if batch.media_index is None:
        text_rows = list(range(n))
    else:
        text_rows = [r for r, i in enumerate(batch.media_index.tolist()) if i < 0]
    if not text_rows:
        return None
    row = rng.choice(text_rows)
    batch.input_ids[row] = model.vocab_size
    return row


def _step(model, runner, n, fraction, seqs, on_device, g, rng, *, bad: bool) -> tuple[int | None, bool]:
    """One batch through the runner, checked; returns (bucket or None, whether a bad id was planted)."""
    buffers = runner.buffers
    batch = make_batch(model, n, media_fraction=fraction, num_seqs=seqs, generator=g,
                       device=model.device if on_device else None)
    bad_row = _corrupt(model, batch, rng) if bad else None
    out = runner.run(batch)
    bucket = runner.last_bucket
    ref = model(buffers.registry.views(bucket or n))[:n]
    where = f"{n} tokens, {seqs} seqs, media {fraction:.2f}, bucket {bucket}"
    assert torch.equal(out, ref), f"{where}: replay != eager, max |diff| {(out - ref).abs().max().item()}"
    slab = buffers.input_embeds
    assert torch.equal(slab[:n], _expected_slab(model, batch, bad_row)), f"{where}: staged rows"
    if bucket is not None:
        assert not slab[n:bucket].any() and not buffers.positions[n:bucket].any(), f"{where}: padding"
    if bad_row is None:
        assert buffers.errors.tolist() == CLEAN, f"{where}: error word {buffers.errors.tolist()}"
    else:
        # not pytest.raises: its ExceptionInfo would tie this frame (and the batch's GPU tensors) into a
        # reference cycle that only the garbage collector frees, and the memory check would see it
        try:
            raise_if_errors(buffers.errors)
            raised = None
        except StagingError as e:
            raised = (e.codes, e.rows, e.first_row)
        assert raised == (BAD_TOKEN_ID, 1, bad_row), f"{where}: planted a bad id at row {bad_row}, got {raised}"
    return bucket, bad_row is not None


def soak(device: str, *, steps: int, capacity: int, buckets: list[int], ratio: float, dtype: torch.dtype,
         variant: str = "deepstack", seed: int = 0, warmup: bool = True, bad_every: int = BAD_EVERY) -> dict:
    model = ToyMultimodalModel(variant, hidden_size=256, num_layers=2, num_heads=4, vocab_size=1000,
                               device=device, dtype=dtype, seed=seed)
    buffers = StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=MAX_SEQS,
                                      embed_width=model.embed_width, embed_dtype=dtype, device=device)
    runner = PrefillGraphRunner(model, buffers, buckets=buckets, max_padding_ratio=ratio, progress=False)
    runner.capture()
    reset_errors(buffers.errors)
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    cuda = runner.buffers.device.type == "cuda"

    warm = 0
    if warmup:  # every bucket, the largest eager size, both media extremes, host and device inputs
        sizes = sorted({*runner.buckets, capacity, max(1, capacity - 1)})
        for k, n in enumerate(sizes):
            for fraction, on_device in ((0.0, k % 2 == 0), (1.0, k % 2 == 1), (0.5, True)):
                _step(model, runner, n, fraction, min(MAX_SEQS, n), on_device, g, rng, bad=fraction == 0.5)
                warm += 1
    graphs, signature = runner._graphs, runner._signature
    graph_ids = {b: id(graph) for b, (graph, _) in graphs.items()}
    if cuda:
        gc.collect()  # whatever the warm-up left in cycles goes now, not at a random step
        torch.cuda.synchronize()
        alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    drift_alloc = drift_reserved = 0
    hits, bad_steps = Counter(), 0
    eager_above = eager_ratio = 0
    start = time.perf_counter()
    for i in range(steps):
        n, fraction, seqs, on_device = _draw(rng, capacity)
        bad = i % bad_every == bad_every - 1
        bucket, was_bad = _step(model, runner, n, fraction, seqs, on_device, g, rng, bad=bad)
        bad_steps += was_bad
        if bucket is None:
            if n > runner.buckets[-1]:
                eager_above += 1
            else:
                eager_ratio += 1
        else:
            hits[bucket] += 1
        if cuda:  # host-side counters: no sync
            drift_alloc = max(drift_alloc, abs(torch.cuda.memory_allocated() - alloc0))
            drift_reserved = max(drift_reserved, abs(torch.cuda.memory_reserved() - reserved0))
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start

    assert runner._graphs is graphs and runner._signature is signature, "the runner re-captured"
    assert {b: id(graph) for b, (graph, _) in runner._graphs.items()} == graph_ids, "a graph was replaced"
    assert len(runner._graphs) == len(graph_ids) == (len(runner.buckets) if runner.captured else 0)
    summary = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "variant": variant, "dtype": str(dtype).replace("torch.", ""), "capacity": capacity,
        "steps": steps, "warmup_steps": warm, "replayed": sum(hits.values()),
        "eager_fallbacks": eager_above + eager_ratio, "eager_above_largest_bucket": eager_above,
        "eager_padding_ratio": eager_ratio, "bad_batches_caught": bad_steps,
        "buckets_hit": len(hits), "buckets_total": len(runner._graphs),
        "bucket_counts": {str(b): hits[b] for b in sorted(hits)},
        "max_allocated_drift_bytes": drift_alloc if cuda else None,
        "max_reserved_drift_bytes": drift_reserved if cuda else None,
        "allocated_bytes": alloc0 if cuda else None, "reserved_bytes": reserved0 if cuda else None,
        "seconds": round(seconds, 2), "steps_per_second": round(steps / seconds, 1) if seconds else None,
    }
    return summary


def _line(s: dict) -> str:
    drift = (f", max drift allocated {s['max_allocated_drift_bytes']} B / reserved {s['max_reserved_drift_bytes']} B"
             if s["max_allocated_drift_bytes"] is not None else "")
    return (f"slabstage soak on {s['device']}: {s['steps']} steps ({s['replayed']} replayed, {s['eager_fallbacks']} "
            f"eager: {s['eager_above_largest_bucket']} above the largest bucket, {s['eager_padding_ratio']} over the "
            f"padding ratio), {s['buckets_hit']}/{s['buckets_total']} buckets hit, {s['bad_batches_caught']} bad "
            f"batches caught{drift}, {s['seconds']} s")


def _report(summary: dict) -> None:
    summary["summary"] = _line(summary)
    print("\n" + summary["summary"])
    out = os.environ.get("SLABSTAGE_SOAK_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")


CUDA_BUCKETS = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 320, 384]


@pytest.mark.cuda
@pytest.mark.slow
def test_soak_cuda():
    steps = int(os.environ.get("SLABSTAGE_SOAK_STEPS", "10000"))
    summary = soak("cuda", steps=steps, capacity=512, buckets=CUDA_BUCKETS, ratio=1.5, dtype=torch.bfloat16)
    _report(summary)
    assert summary["max_allocated_drift_bytes"] == 0, summary["summary"]
    assert summary["max_reserved_drift_bytes"] <= RESERVED_SLACK, summary["summary"]
    if steps >= 200:  # enough draws to see every path
        assert summary["replayed"] and summary["eager_above_largest_bucket"] and summary["eager_padding_ratio"]


@pytest.mark.parametrize("variant", ["plain", "deepstack", "hc"])
def test_soak_cpu(variant):
    """Ten eager steps per variant (30 in all), Triton under the interpreter: the soak's checks, small."""
    summary = soak("cpu", steps=10, capacity=48, buckets=[4, 16, 32], ratio=1.5, dtype=torch.float32,
                   variant=variant, seed=1, warmup=False, bad_every=3)
    assert summary["eager_fallbacks"] == 10 and summary["replayed"] == 0
