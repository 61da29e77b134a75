"""stage_token_inputs against one ``copy_`` + ``fill_`` per slot, device time and host time.

A batch of ``n`` tokens (7/8 of the bucket, so every token slot has a padded
tail) and 8 requests is staged into buffers padded to the bucket (``pad_to``,
256 or 8192 tokens): ``input_ids``, ``positions``, ``out_cache_loc`` (int64, ``[n]``),
``seq_lens``, ``extend_start_loc`` (int32, ``[8]``, padded to ``max_batch_size``) and
``num_tokens_non_padded``.

- ``slabstage``: :func:`slabstage.stage_token_inputs`, one launch (host inputs are
  packed into one pinned tensor and moved in one copy first).
- ``per_slot``: for each slot ``dst[:n].copy_(src, non_blocking=True)`` and
  ``dst[n:pad_to].fill_(pad)``, then ``num_tokens_non_padded.fill_(n)``: what
  engines do today, one or two launches (and, for host inputs, one H2D copy) per slot.

``inputs=host``: the batch's tensors live in pinned host memory (as a scheduler
builds them); ``inputs=device``: already on the device.
"""

from __future__ import annotations

import pytest
import torch

from slabstage import StagingBuffers, stage_token_inputs

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
SUITE = "stage_token_inputs"

BUCKETS = [256, 8192]
NUM_REQUESTS = 8
MAX_BATCH = 64
IMPLS = ("slabstage", "per_slot")
INPUTS = ("host", "device")
TOKEN_SLOTS = ("input_ids", "positions", "out_cache_loc")
REQUEST_SLOTS = ("seq_lens", "extend_start_loc")


def make_buffers(device, capacity: int = max(BUCKETS)) -> StagingBuffers:
    # the embedding slab is not used here: keep it narrow
    return StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=MAX_BATCH, embed_width=16,
                                   embed_dtype=torch.bfloat16, device=device)


def make_batch(bucket: int, where: str, device, seed: int = 0) -> dict:
    """The batch's integer inputs for a ``bucket``-token graph: ``n = 7/8 * bucket`` tokens."""
    n = bucket - bucket // 8
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[:NUM_REQUESTS - 1] + 1).values
    starts = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
    lens = torch.diff(torch.cat([starts, torch.tensor([n])]))
    batch = {
        "input_ids": torch.randint(0, 32000, (n,), generator=g),
        "positions": torch.cat([torch.arange(int(k)) for k in lens]),
        "out_cache_loc": torch.randperm(4 * n, generator=g)[:n],
        "seq_lens": lens.to(torch.int32),
        "extend_start_loc": starts.to(torch.int32),
    }
    if where == "device":
        return {k: v.to(device) for k, v in batch.items()}
    if torch.device(device).type == "cuda":
        return {k: v.pin_memory() for k, v in batch.items()}
    return batch


def build(impl: str, buf: StagingBuffers, batch: dict, pad_to: int):
    reg = buf.registry
    if impl == "slabstage":
        return lambda: stage_token_inputs(buf, **batch, pad_to=pad_to)

    n, b = batch["input_ids"].shape[0], batch["seq_lens"].shape[0]
    token = [(reg[k], batch[k], reg.slot(k).fill_value) for k in TOKEN_SLOTS]
    request = [(reg[k], batch[k], reg.slot(k).fill_value) for k in REQUEST_SLOTS]
    ntok = buf.num_tokens_non_padded

    def per_slot():
        for dst, src, pad in token:
            dst[:n].copy_(src, non_blocking=True)
            dst[n:pad_to].fill_(pad)
        for dst, src, pad in request:
            dst[:b].copy_(src, non_blocking=True)
            dst[b:].fill_(pad)
        ntok.fill_(n)
    return per_slot


def _state(buf: StagingBuffers, pad_to: int) -> dict:
    reg = buf.registry
    out = {k: reg[k][:pad_to].clone() for k in TOKEN_SLOTS}
    out.update({k: reg[k].clone() for k in (*REQUEST_SLOTS, "num_tokens_non_padded")})
    return out


def _poison(buf: StagingBuffers) -> None:
    for k in (*TOKEN_SLOTS, *REQUEST_SLOTS, "num_tokens_non_padded"):
        buf.registry[k].fill_(-7)


def checked(impl: str, buf: StagingBuffers, batch: dict, pad_to: int):
    """``build``, run once on poisoned buffers, compared with ``per_slot``'s result."""
    _poison(buf)
    build("per_slot", buf, batch, pad_to)()
    want = _state(buf, pad_to)
    _poison(buf)
    run = build(impl, buf, batch, pad_to)
    run()
    got = _state(buf, pad_to)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{impl}: slot {k} differs from per-slot staging"
    return run


def _meta(impl: str, where: str, bucket: int) -> dict:
    n = bucket - bucket // 8
    return {"suite": SUITE, "impl": f"{impl}/{where}", "shape": f"{bucket} tokens", "tokens": bucket,
            "num_tokens": n, "requests": NUM_REQUESTS, "inputs": where}


def _bytes(bucket: int) -> int:
    """Token slots read (n) and written (bucket) as int64, per-request slots, the count."""
    n = bucket - bucket // 8
    return len(TOKEN_SLOTS) * 8 * (n + bucket) + len(REQUEST_SLOTS) * 4 * (NUM_REQUESTS + MAX_BATCH) + 4


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_CUDA else []))
@pytest.mark.parametrize("where", INPUTS)
def test_paths_agree(where, device):
    buf = make_buffers(device, capacity=300)
    checked("slabstage", buf, make_batch(256, where, device, seed=3), pad_to=280)


@pytest.fixture(scope="module")
def buffers():
    return make_buffers(DEVICE)


@pytest.mark.cuda
@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("where", INPUTS)
@pytest.mark.parametrize("impl", IMPLS)
def test_stage_token_inputs(buffers, impl, where, bucket, device_bench):
    run = checked(impl, buffers, make_batch(bucket, where, DEVICE), bucket)
    device_bench.benchmark.group = f"{SUITE} {bucket} tokens"
    device_bench(run)
    device_bench.record_bandwidth(_bytes(bucket), **_meta(impl, where, bucket))


@pytest.mark.parametrize("bucket", BUCKETS if HAS_CUDA else [256])
@pytest.mark.parametrize("where", INPUTS)
@pytest.mark.parametrize("impl", IMPLS)
def test_stage_token_inputs_host_time(buffers, impl, where, bucket, host_bench):
    """CPU time of one staging call (host clock, no sync), median over many calls."""
    run = checked(impl, buffers, make_batch(bucket, where, DEVICE), bucket)
    host_bench.benchmark.group = f"{SUITE} host time {bucket} tokens"
    host_bench(run)
    host_bench.record_host_time(device=DEVICE.type, **_meta(impl, where, bucket))
