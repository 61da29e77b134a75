"""Vocab-parallel staging on two GPUs: where should the slab's all-reduce run?

    python bench/run.py --suite tp                  # 8192 and 1024 tokens x 4096, bf16

``test_tp`` spawns one process per GPU inside the test (torch.multiprocessing, NCCL,
NVLink multicast left off: ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``),
times every case below in the same session on the same inputs and checks that both
tensor-parallel placements give the single-GPU slab bit for bit. The figures (per case
and timing, the larger rank's median; the verdict; the machine and NCCL version) go to
``extra_info`` (``metric="figures"``; the test's own timing is the ranks' wall time).
It skips without two CUDA GPUs and NCCL.

Inputs per token count ``n``: bf16, width 4096, vocabulary 32000 split in two
contiguous shards (:func:`slabstage.distributed.vocab_shard`), half the rows media
in 64-row blocks alternating with text, media rows owned by rank 0.

Cases (each rank runs each one; a step is done when both ranks are done):

- ``single``: :func:`stage_embeddings` with the whole table on one GPU, no
  communication: what staging costs without tensor parallelism.
- ``stage_tp``: the per-rank staging alone (shard, media on rank 0 only).
- ``all_reduce``: ``dist.all_reduce`` of ``slab[:n]`` alone, from the host.
- ``all_reduce_graph``: the replay of a CUDA graph that holds only that all-reduce.
- ``before_replay``: per-rank staging, the all-reduce from the host
  (:class:`SlabAllReduce`, the runner's ``after_stage`` hook), then the replay of a
  graph holding the forward stand-in.
- ``in_graph``: per-rank staging, then the replay of a graph holding the
  all-reduce and the forward stand-in (what :func:`all_reduce_in_forward` captures).

The forward stand-in is one small kernel that reads the slab (a row copy), so that
both placements replay a graph, as an engine does: they differ only in where the
all-reduce is issued.

Three timings per case, medians over ``OPTS["rounds"]`` rounds after ``OPTS["warmup"]``:

- ``device_us``: CUDA events around the step, each round preceded (untimed) by a
  barrier, an L2 flush and a ``head_start_us`` device sleep, so the host has
  queued the whole step before it starts: the device time alone;
- ``latency_us``: CUDA events around the step issued to an idle device (barrier,
  flush, sync, then the step): device time plus the host's launch gaps, what one
  prefill step waits for when the host is the bottleneck (small batches);
- ``host_us``: the host clock around issuing the step in the latency rounds (no
  sync inside): the CPU time the step costs the engine's scheduler thread.

Each is reported per rank and as the larger of the two ranks' medians.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slabstage import StagingBuffers, stage_embeddings
from harness import sleep_cycles_per_us
from slabstage.distributed import SlabAllReduce, vocab_parallel_args

WORLD = 2
# tokens; slab width; vocabulary; rows per text/media block; timed rounds per case and timing and untimed ones
# before them; L2 flush between rounds (MiB, 0: none); device sleep before device-time rounds (µs)
OPTS = dict(tokens=[8192, 1024], width=4096, vocab=32000, block=64, rounds=200, warmup=20, flush_mib=256,
            head_start_us=500.0)
CASES = ("single", "stage_tp", "all_reduce", "all_reduce_graph", "before_replay", "in_graph")
POISON = 12345.0


def multicast_off() -> None:
    """NVLink multicast stays off (NCCL NVLS, symmetric memory, NVSHMEM): set before any init."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


# -- inputs and steps (in each rank's process) -----------------------------------------------
def make_inputs(n: int, opts: dict, device: torch.device) -> dict:
    """The same inputs on every rank: drawn on the host from one seed, then copied."""
    g = torch.Generator().manual_seed(n)
    is_media = (torch.arange(n) // opts["block"]) % 2 == 1
    media_index = torch.where(is_media, torch.cumsum(is_media, 0) - 1, -1).to(torch.int32)
    return dict(
        ids=torch.randint(0, opts["vocab"], (n,), generator=g).to(device),
        table=torch.randn(opts["vocab"], opts["width"], generator=g, dtype=torch.bfloat16).to(device),
        media=torch.randn(int(is_media.sum()), opts["width"], generator=g, dtype=torch.bfloat16).to(device),
        media_index=media_index.to(device))


def capture(fn) -> torch.cuda.CUDAGraph:
    """``fn`` warmed up on a side stream, then captured into a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def build_steps(n: int, opts: dict, rank: int, device: torch.device):
    """Every case's step for ``n`` tokens, the slabs they fill, and the graphs (kept alive)."""
    x = make_inputs(n, opts, device)
    vocab = vocab_parallel_args(opts["vocab"], rank, WORLD)
    start, end = vocab["vocab_range"]
    shard = x["table"][start:end]  # this rank's table, as an engine holds it
    buffers = StagingBuffers.allocate(max_num_tokens=n, max_batch_size=1, embed_width=opts["width"],
                                      embed_dtype=torch.bfloat16, device=device)
    slab, single_slab = buffers.input_embeds, torch.empty_like(buffers.input_embeds)
    probe = torch.empty(opts["width"], dtype=slab.dtype, device=device)
    all_reduce = SlabAllReduce(buffers)

    def stage_single():
        stage_embeddings(single_slab, x["ids"], x["table"], media=x["media"], media_index=x["media_index"],
                         errors=buffers.errors)

    def stage_tp():
        stage_embeddings(slab, x["ids"], shard, media=x["media"], media_index=x["media_index"],
                         errors=buffers.errors, **vocab)

    def forward():  # the stand-in for the model: one kernel that reads the slab
        probe.copy_(slab[n - 1])

    def slab_all_reduce():
        all_reduce(n)

    def all_reduce_then_forward():
        all_reduce(n)
        forward()

    stage_single()
    stage_tp()
    graph_fwd = capture(forward)
    graph_ar = capture(slab_all_reduce)
    graph_in = capture(all_reduce_then_forward)

    def before_replay():
        stage_tp()
        all_reduce(n)
        graph_fwd.replay()

    def in_graph():
        stage_tp()
        graph_in.replay()

    steps = {"single": stage_single, "stage_tp": stage_tp, "all_reduce": slab_all_reduce,
             "all_reduce_graph": graph_ar.replay, "before_replay": before_replay, "in_graph": in_graph}
    return steps, slab, single_slab, (graph_fwd, graph_ar, graph_in)


# -- timing --------------------------------------------------------------------------------------
class Timer:
    def __init__(self, opts: dict, device: torch.device) -> None:
        mib = opts["flush_mib"]
        self.scratch = torch.empty(mib << 20, dtype=torch.uint8, device=device) if mib > 0 else None
        self.sleep = int(opts["head_start_us"] * sleep_cycles_per_us()) if opts["head_start_us"] > 0 else 0
        self.rounds, self.warmup = opts["rounds"], opts["warmup"]

    def _settle(self) -> None:
        """Both ranks idle and in step, L2 holding nothing of the inputs."""
        torch.cuda.synchronize()
        dist.barrier()
        if self.scratch is not None:
            self.scratch.fill_(1)

    def time(self, step) -> dict[str, list[float]]:
        device_us, latency_us, host_us = [], [], []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i in range(self.warmup + self.rounds):
            self._settle()
            if self.sleep:
                torch.cuda._sleep(self.sleep)  # the host queues the whole step before it starts
            start.record()
            step()
            end.record()
            end.synchronize()
            if i >= self.warmup:
                device_us.append(start.elapsed_time(end) * 1e3)
        for i in range(self.warmup + self.rounds):
            self._settle()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            step()
            end.record()
            t1 = time.perf_counter()
            end.synchronize()
            if i >= self.warmup:
                latency_us.append(start.elapsed_time(end) * 1e3)
                host_us.append((t1 - t0) * 1e6)
        return {"device_us": device_us, "latency_us": latency_us, "host_us": host_us}


def exact(steps: dict, slab: torch.Tensor, single_slab: torch.Tensor) -> dict[str, bool]:
    """Does each placement leave the single-GPU slab, bit for bit?"""
    single_slab.fill_(POISON)
    steps["single"]()
    same = {}
    for placement in ("before_replay", "in_graph"):
        slab.fill_(POISON)
        torch.cuda.synchronize()
        dist.barrier()
        steps[placement]()
        torch.cuda.synchronize()
        same[placement] = torch.equal(slab, single_slab)
    return same


def _setup(rank: int, world: int, folder: str) -> torch.device:
    """This rank's GPU and its NCCL process group (rendezvous through a file in ``folder``)."""
    multicast_off()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world,
                            device_id=device)
    return device


def _worker(rank: int, world: int, folder: str, opts: dict) -> None:
    device = _setup(rank, world, folder)
    dist.barrier()
    timer = Timer(opts, device)
    mine = {"timings": {}, "exact": {}}
    for n in opts["tokens"]:
        steps, slab, single_slab, graphs = build_steps(n, opts, rank, device)
        for case in CASES:
            mine["timings"][f"{n}/{case}"] = timer.time(steps[case])
        mine["exact"][str(n)] = exact(steps, slab, single_slab)
        del steps, graphs
        torch.cuda.synchronize()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(folder, "ranks.json").write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


# -- report --------------------------------------------------------------------------------------
def summarize(ranks: list[dict], opts: dict) -> dict:
    rows = []
    for n in opts["tokens"]:
        for case in CASES:
            row = {"tokens": n, "width": opts["width"], "case": case}
            for metric in ("device_us", "latency_us", "host_us"):
                per_rank = [statistics.median(r["timings"][f"{n}/{case}"][metric]) for r in ranks]
                spread = [[round(q, 2) for q in statistics.quantiles(r["timings"][f"{n}/{case}"][metric], n=10)[::8]]
                          for r in ranks]  # p10, p90
                row[metric] = {"max": max(per_rank), "per_rank": per_rank, "p10_p90_per_rank": spread}
            if case in ("all_reduce", "all_reduce_graph"):
                nbytes = n * opts["width"] * 2
                row["bytes"] = nbytes
                row["algbw_gbps"] = nbytes / (row["device_us"]["max"] * 1e-6) / 1e9  # = busbw on 2 ranks
            rows.append(row)
    exactness = {n: [r["exact"][str(n)] for r in ranks] for n in opts["tokens"]}
    verdict = {}
    for n in opts["tokens"]:
        get = {r["case"]: r for r in rows if r["tokens"] == n}
        before, inside = get["before_replay"], get["in_graph"]
        verdict[str(n)] = {m: {"before_replay": before[m]["max"], "in_graph": inside[m]["max"],
                               "in_graph_saves": before[m]["max"] - inside[m]["max"]}
                           for m in ("device_us", "latency_us", "host_us")}
        verdict[str(n)]["faster_step"] = ("in_graph" if inside["latency_us"]["max"] <= before["latency_us"]["max"]
                                          else "before_replay")
    return {"rows": rows, "exact": {str(k): v for k, v in exactness.items()}, "verdict": verdict}


def machine_info() -> dict:
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0), "gpus": WORLD, "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl), "triton": triton_version,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                "NVSHMEM_DISABLE_NVLS", "NCCL_ALGO", "NCCL_PROTO")},
    }


def _why_not() -> str | None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < WORLD:
        return f"needs {WORLD} CUDA GPUs; found {count}"
    return None if dist.is_nccl_available() else "needs NCCL"


@pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
def test_tp(benchmark):
    multicast_off()  # before any process group exists; the children inherit it
    result = {}

    def spawn():
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(_worker, args=(WORLD, folder, OPTS), nprocs=WORLD, join=True)
            ranks = json.loads(Path(folder, "ranks.json").read_text())
        result.update(summarize(ranks, OPTS))

    benchmark._timer = time.perf_counter
    benchmark.pedantic(spawn, rounds=1, iterations=1)
    benchmark.extra_info.update(suite="tp", metric="figures", impl="vocab-parallel staging", machine=machine_info(),
                                settings=dict(OPTS, dtype="bfloat16", media="half", ranks=WORLD), **result)
    differ = [(n, rank) for n, ranks in result["exact"].items() for rank, ok in enumerate(ranks)
              if not all(ok.values())]
    assert not differ, f"a tensor-parallel placement differs from the single-GPU slab: {differ}"
