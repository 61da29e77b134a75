"""Vocab-parallel staging: each rank stages with its table shard, one all-reduce completes the slab.

The claim under test: after the all-reduce every rank's slab equals, bit for bit,
what one process stages with the whole table (bf16 and fp32), and the runner's
outputs equal the single-process ones.

- CPU: two processes on gloo (torch.multiprocessing spawn, a ``file://``
  rendezvous in a temporary folder); the kernels run under the Triton interpreter
  (conftest sets TRITON_INTERPRET=1 and the children inherit it). One spawn serves
  the module in a test session (``spawn_ranks`` in tests/tp/conftest.py): the ranks run
  every case and save what they hold; the tests compare it with the single-process
  result computed here.
- Two GPUs (``cuda`` + ``multigpu``): the same over NCCL with CUDA graphs, for
  both placements of the all-reduce (before replay, inside the graph).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import sys
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from slabstage import PrefillGraphRunner, StagingBuffers, stage_embeddings
from slabstage.distributed import SlabAllReduce, all_reduce_in_forward, vocab_parallel_args, vocab_shard
from slabstage.staging.stager import stage_batch
from slabstage.models import ToyMultimodalModel, make_batch

import builders  # noqa: I001 - tests/builders.py
import interpreter_speedups  # noqa: I001 - tests/interpreter_speedups.py
from builders import shard_table  # noqa: I001

interpreter_speedups.speed_up()  # (the spawned ranks import this module: they interpret faster too)

WORLD = 2
POISON = 12345.0  # finite, so whole slabs compare with torch.equal; rows past pad_to must keep it
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PLACEMENTS = ("before_replay", "in_graph")


def multicast_off() -> None:
    """The GPU machines keep NVLink multicast off; a collective must not turn it on."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def init(backend: str, rank: int, world: int, folder: str, **kw) -> None:
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120), **kw)


# ==================================================================================================
# vocab_shard and vocab_parallel_args (no processes)
# ==================================================================================================
@pytest.mark.parametrize("vocab_size, world, padding", [
    (50, 2, 1), (37, 2, 8), (32000, 2, 64), (32001, 2, 64), (151936, 4, 64), (7, 3, 1), (5, 8, 1), (1, 2, 1)])
def test_vocab_shards_tile_the_vocabulary(vocab_size, world, padding):
    shards = [vocab_shard(vocab_size, r, world, padding=padding) for r in range(world)]
    rows = math.ceil(math.ceil(vocab_size / padding) * padding / world)
    assert shards[0][0] == 0 and shards[-1][1] == vocab_size
    for r, (start, end) in enumerate(shards):
        assert start == min(r * rows, vocab_size) and 0 <= end - start <= rows
        if r:
            assert start == shards[r - 1][1]  # contiguous, no gap, no overlap


def test_vocab_shard_matches_the_engines_split():
    # vLLM / SGLang VocabParallelEmbedding: pad to 64, then divide by the TP size
    assert [vocab_shard(32001, r, 2, padding=64) for r in range(2)] == [(0, 16032), (16032, 32001)]
    assert [vocab_shard(32000, r, 4, padding=64) for r in range(4)] == [(0, 8000), (8000, 16000),
                                                                         (16000, 24000), (24000, 32000)]
    # Megatron: pad to make_vocab_size_divisible_by * tp = 128 * 2
    assert vocab_shard(50257, 1, 2, padding=256) == (25216, 50257)
    assert vocab_shard(5, 7, 8) == (5, 5)  # past the end: empty


@pytest.mark.parametrize("args, match", [
    ((0, 0, 2), "vocab_size"), ((10, 2, 2), "rank 2"), ((10, -1, 2), "rank"), ((10, 0, 0), "world_size"),
    ((10.0, 0, 2), "vocab_size"), ((10, True, 2), "rank")])
def test_vocab_shard_checks(args, match):
    with pytest.raises(ValueError, match=match):
        vocab_shard(*args)
    with pytest.raises(ValueError, match="padding"):
        vocab_shard(10, 0, 2, padding=0)


def test_vocab_parallel_args_give_media_to_one_rank():
    args = [vocab_parallel_args(37, r, 2, padding=8) for r in range(2)]
    assert args == [{"vocab_range": (0, 20), "vocab_size": 37, "media_owner": True},
                    {"vocab_range": (20, 37), "vocab_size": 37, "media_owner": False}]
    assert [vocab_parallel_args(37, r, 3, media_rank=2)["media_owner"] for r in range(3)] == [False, False, True]
    with pytest.raises(ValueError, match="media_rank"):
        vocab_parallel_args(37, 0, 2, media_rank=2)


def test_all_reduce_helpers_check_their_arguments():
    buffers = StagingBuffers.allocate(max_num_tokens=8, max_batch_size=1, embed_width=4, embed_dtype=torch.float32,
                                      device="cpu")
    with pytest.raises(TypeError, match="StagingBuffers"):
        SlabAllReduce(buffers.input_embeds)
    with pytest.raises(TypeError, match="callable"):
        all_reduce_in_forward(None, buffers)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            SlabAllReduce(buffers)
        with pytest.raises(RuntimeError, match="init_process_group"):
            all_reduce_in_forward(lambda v: v, buffers)


# ==================================================================================================
# CPU: two gloo processes
# ==================================================================================================
def staging_case(name: str, dtype: torch.dtype) -> dict:
    """Inputs of one staging case, the same in every process (a fixed seed per case)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    c = dict(vocab=50, padding=1, width=48, text_width=48, media_width=48, n=32, pad_to=36, rows=40,
             num_media=12, expand="zeros", text_scale=None, media_dtype=dtype, owners=(0,), bad=False)
    c.update({
        "text_and_media": {},
        "padded_vocab": dict(vocab=37, padding=8, text_scale=2.5),  # shards [0, 20) and [20, 37) of 40 rows
        "narrow_text_fp32_media": dict(text_width=16, media_dtype=torch.float32),  # deepstack-like, a cast
        "repeat": dict(width=64, text_width=16, media_width=16, expand="repeat"),  # hyper-connections-like
        "text_only": dict(num_media=0, pad_to=32),
        "media_on_rank1": dict(owners=(1,)),
        "bad_id_and_index": dict(bad=True),
        "two_owners": dict(owners=(0, 1)),  # wrong on purpose: the comparison must catch it
    }[name])
    table = (torch.randn(c["vocab"], c["text_width"], generator=g) * 2).to(dtype)
    ids = torch.randint(0, c["vocab"], (c["n"],), generator=g)
    cut = vocab_shard(c["vocab"], 0, WORLD, padding=c["padding"])[1]
    ids[:4] = torch.tensor([0, cut - 1, cut, c["vocab"] - 1])  # both shards, every edge
    media = media_index = None
    if c["num_media"]:
        media = (torch.randn(c["num_media"], c["media_width"], generator=g) * 2).to(c["media_dtype"])
        media_index = torch.full((c["n"],), -1, dtype=torch.int64)
        media_index[6:12] = torch.arange(0, 6)  # two spans, text around them
        media_index[20:26] = torch.arange(6, 12)
        ids[media_index >= 0] = c["vocab"] - 1  # a placeholder id, never read at media rows
    if c["bad"]:
        ids[2] = c["vocab"] + 3  # outside the vocabulary: a zero row, flagged on every rank
        media_index[30] = c["num_media"] + 1  # past the media rows: the same
    c.update(table=table, ids=ids, media=media, media_index=media_index)
    return c


STAGING_CASES = ("text_and_media", "padded_vocab", "narrow_text_fp32_media", "repeat", "text_only",
                 "media_on_rank1", "bad_id_and_index", "two_owners")


def stage_case(c: dict, dtype: torch.dtype, table: torch.Tensor, **vocab) -> StagingBuffers:
    buffers = StagingBuffers.allocate(max_num_tokens=c["rows"], max_batch_size=1, embed_width=c["width"],
                                      embed_dtype=dtype, device="cpu")
    buffers.input_embeds.fill_(POISON)
    stage_embeddings(buffers.input_embeds, c["ids"], table, media=c["media"], media_index=c["media_index"],
                     pad_to=c["pad_to"], expand=c["expand"], text_scale=c["text_scale"], errors=buffers.errors,
                     **vocab)
    return buffers


RUNNER_CONFIGS = (("plain", "bf16"), ("deepstack", "fp32"), ("hc", "bf16"))
RUNNER_VOCAB, RUNNER_PADDING, RUNNER_SIZES = 97, 8, (5, 21)


def toy(variant: str, dtype: torch.dtype, device="cpu") -> ToyMultimodalModel:
    return builders.toy(variant, dtype, device, vocab=RUNNER_VOCAB, k=1)


def toy_buffers(model: ToyMultimodalModel, capacity: int, device="cpu") -> StagingBuffers:
    return builders.toy_buffers(model, capacity, device, batch=4)


def runner_batch(model: ToyMultimodalModel, n: int, g: torch.Generator):
    """make_batch, with the media rows drawn from ``g``: the same in every process and on every device,
    whatever the encoder's matmuls do there."""
    batch = make_batch(model, n, media_fraction=0.4, num_seqs=min(3, n), generator=g)
    if batch.media is None:
        return batch
    return replace(batch, media=torch.randn(batch.media.shape, generator=g).to(batch.media.device, model.dtype))


def test_block_items_of_the_nccl_deepstack_case_stage_the_same_slab():
    """The 2-GPU DeepStack case's items (as_block_items) stage, on one process, the slab of its one tensor."""
    model = gpu_toy("deepstack3_items", torch.float32, "cpu")
    assert model.embed_width == 4 * model.hidden_size
    g = torch.Generator().manual_seed(11)
    for n in (13, 40):
        batch = runner_batch(model, n, g)
        items = as_block_items(model, batch)
        assert len(items.media) == 3 and all(len(item) == 4 for item in items.media)
        slabs = []
        for b in (batch, items):
            buffers = toy_buffers(model, 48)
            stage_batch(buffers, input_ids=b.input_ids, positions=b.positions, table=b.table,
                             seq_lens=b.seq_lens, extend_start_loc=b.extend_start_loc, media=b.media,
                             media_index=b.media_index, expand=b.expand, pad_to=n)
            slabs.append(buffers.input_embeds[:n].clone())
        assert torch.equal(slabs[0], slabs[1])


def _gloo_worker(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)  # two processes share the machine; every process the same way
    init("gloo", rank, world, folder)
    saved = {"staging": {}, "runner": {}, "checks": {}}

    for name in STAGING_CASES:
        for dname, dtype in DTYPES.items():
            c = staging_case(name, dtype)
            vocab = vocab_parallel_args(c["vocab"], rank, world, padding=c["padding"], media_rank=c["owners"][0])
            vocab["media_owner"] = rank in c["owners"]
            local = shard_table(c["table"], c["vocab"], rank, WORLD, padding=c["padding"])
            buffers = stage_case(c, dtype, local, **vocab)
            SlabAllReduce(buffers)(c["pad_to"])
            saved["staging"][name, dname] = (buffers.input_embeds.clone(), buffers.errors.clone())

    for variant, dname in RUNNER_CONFIGS:
        model = toy(variant, DTYPES[dname])
        local = shard_table(model.embed_tokens.weight, RUNNER_VOCAB, rank, WORLD, padding=RUNNER_PADDING)
        vocab = vocab_parallel_args(RUNNER_VOCAB, rank, world, padding=RUNNER_PADDING)
        for placement in PLACEMENTS:
            tp_buffers, single_buffers = toy_buffers(model, 32), toy_buffers(model, 32)
            if placement == "in_graph":
                runner = PrefillGraphRunner(all_reduce_in_forward(model, tp_buffers), tp_buffers, buckets=[8, 16, 32],
                                            process_group=dist.group.WORLD)
            else:
                runner = PrefillGraphRunner(model, tp_buffers, buckets=[8, 16, 32],
                                            after_stage=SlabAllReduce(tp_buffers), process_group=dist.group.WORLD)
            single = PrefillGraphRunner(model, single_buffers, buckets=[8, 16, 32])
            runner.capture()  # no CUDA: eager, says so
            g = torch.Generator().manual_seed(7)
            runs = []
            for n in RUNNER_SIZES:
                batch = runner_batch(model, n, g)
                out = runner.run(replace(batch, table=local, **vocab), clone=True)
                ref = single.run(batch, clone=True)
                runs.append(dict(n=n, out=out, ref=ref, slab=tp_buffers.input_embeds[:n].clone(),
                                 single_slab=single_buffers.input_embeds[:n].clone()))
            saved["runner"][variant, dname, placement] = dict(runs=runs, is_rank0=runner.is_rank0,
                                                             progress=runner.progress)

    # the helpers' own checks, where a process group exists
    buffers = toy_buffers(toy("plain", torch.float32), 16)
    other = toy_buffers(toy("plain", torch.float32), 16)
    wrapped = all_reduce_in_forward(lambda v: v["input_embeds"], buffers)
    for what, call in (("pad_to 0", lambda: SlabAllReduce(buffers)(0)),
                       ("pad_to past the slab", lambda: SlabAllReduce(buffers)(17)),
                       ("other buffers", lambda: wrapped(other.registry.views(4)))):
        try:
            call()
            saved["checks"][what] = "nothing raised"
        except ValueError as e:
            saved["checks"][what] = f"ValueError: {e}"

    saved["capture_check"] = _capture_check(rank)

    def needing(views):  # a forward that names slots a batch must give, as prefill_forward(cache=) does
        return views["input_embeds"]

    needing.needs = ("out_cache_loc", "prefix_lens", "req_indices")
    saved["needs"] = getattr(all_reduce_in_forward(needing, buffers), "needs", None)
    torch.save(saved, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _capture_check(rank: int) -> dict:
    """The capture check of one bucket on each rank, its replay and timers faked (no CUDA here): rank 1's replay
    differs from its eager run, rank 0's does not."""
    from slabstage.graph_runner import capture

    class Event:
        def __init__(self, **_):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, _):
            return 0.001  # 1 µs: faster than the eager run

    class Stager:
        params, replays = torch.zeros(1), 0

        def prepare(self, *_, **__):
            return None

        def replay(self, _):
            Stager.replays += 1

    real, torch.cuda.Event = torch.cuda.Event, Event
    try:
        check = capture._check_one(Stager(), 4, None, torch.ones(4), None, torch.full((4,), float(rank == 0)),
                                   10.0, None, dist.group.WORLD)
    finally:
        torch.cuda.Event = real
    return dict(check, replays=Stager.replays)


@pytest.fixture(scope="module")
def gloo(spawn_ranks):
    return spawn_ranks(_gloo_worker, "gloo")


def media_rows(c: dict) -> torch.Tensor:
    rows = torch.zeros(c["rows"], dtype=torch.bool)
    if c["media_index"] is not None:
        rows[:c["n"]] = (c["media_index"] >= 0) & (c["media_index"] < c["num_media"])
    return rows


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("name", [n for n in STAGING_CASES if n != "two_owners"])
def test_gloo_staged_slab_equals_single_process(gloo, name, dname):
    dtype = DTYPES[dname]
    c = staging_case(name, dtype)
    single = stage_case(c, dtype, c["table"])  # one process, the whole table
    want = single.input_embeds
    assert torch.equal(want[c["n"]:c["pad_to"]], torch.zeros_like(want[c["n"]:c["pad_to"]]))
    assert (want[c["pad_to"]:] == POISON).all()
    if c["media"] is not None:  # the case has rows of each kind worth comparing
        assert want[media_rows(c)].abs().sum() > 0 and want[:c["n"]][c["media_index"] < 0].abs().sum() > 0
    for rank, saved in gloo.items():
        slab, errors = saved["staging"][name, dname]
        bad = (slab != want) & ~(slab.isnan() & want.isnan())
        assert torch.equal(slab, want), f"rank {rank}: rows {bad.any(1).nonzero().flatten().tolist()} differ"
        assert torch.equal(errors, single.errors), f"rank {rank}: error word {errors.tolist()}"
    if name == "bad_id_and_index":
        assert single.errors[1].item() == 2  # both bad rows were seen, on every rank


@pytest.mark.parametrize("dname", DTYPES)
def test_gloo_two_media_owners_are_caught(gloo, dname):
    """Control: with two owners the media rows come out doubled; the comparison above would fail."""
    dtype = DTYPES[dname]
    c = staging_case("two_owners", dtype)
    want = stage_case(c, dtype, c["table"]).input_embeds
    media, text = media_rows(c), ~media_rows(c)
    for saved in gloo.values():
        slab, _ = saved["staging"]["two_owners", dname]
        assert not torch.equal(slab, want)
        assert torch.equal(slab[media], want[media] * 2) and torch.equal(slab[text], want[text])


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("variant, dname", RUNNER_CONFIGS)
def test_gloo_eager_runner_equals_single_process(gloo, variant, dname, placement):
    dtype = DTYPES[dname]
    model = toy(variant, dtype)
    single_buffers = toy_buffers(model, 32)
    single = PrefillGraphRunner(model, single_buffers, buckets=[8, 16, 32])
    g = torch.Generator().manual_seed(7)
    for i, n in enumerate(RUNNER_SIZES):
        batch = runner_batch(model, n, g)
        single.run(batch)
        want_slab = single_buffers.input_embeds[:n]
        for rank, saved in gloo.items():
            run = saved["runner"][variant, dname, placement]["runs"][i]
            assert run["n"] == n
            assert torch.equal(run["slab"], want_slab), f"rank {rank}, {n} tokens: the staged slab"
            assert torch.equal(run["slab"], run["single_slab"])
            assert torch.equal(run["out"], run["ref"]), f"rank {rank}, {n} tokens: the outputs"
        assert torch.equal(gloo[0]["runner"][variant, dname, placement]["runs"][i]["out"],
                           gloo[1]["runner"][variant, dname, placement]["runs"][i]["out"])


def test_gloo_runner_progress_and_log_belong_to_rank0(gloo):
    for rank, saved in gloo.items():
        for key, record in saved["runner"].items():
            assert record["is_rank0"] == (rank == 0), key
            assert record["progress"] == (rank == 0), key


def test_gloo_helpers_refuse_bad_calls(gloo):
    for saved in gloo.values():
        checks = saved["checks"]
        assert "pad_to must be" in checks["pad_to 0"] and "pad_to must be" in checks["pad_to past the slab"]
        assert "other StagingBuffers" in checks["other buffers"]


# ==================================================================================================
# Two GPUs: NCCL, graphs, both placements
# ==================================================================================================
GPU_VOCAB, GPU_PADDING = 1000, 64
# deepstack3_items: slab H * (1 + 3), the media staged as column-block items
GPU_RUNNER_CONFIGS = (("plain", "bf16"), ("plain", "fp32"), ("deepstack", "bf16"), ("hc", "bf16"),
                      ("deepstack3_items", "bf16"), ("deepstack3_items", "fp32"))
GPU_SIZES = (8, 13, 40, 64, 90)  # 90: past the largest bucket, eager
GPU_BUCKETS = [8, 16, 32, 64]


def gpu_staging_inputs(seed: int, dtype: torch.dtype, device) -> dict:
    g = torch.Generator().manual_seed(seed)
    n, num_media, width = 300, 150, 512
    media_index = torch.full((n,), -1, dtype=torch.int64)
    rows = torch.arange(n)
    media_rows = (rows // 25) % 2 == 1  # blocks of 25 rows, alternating text and media
    media_index[media_rows] = torch.arange(int(media_rows.sum()))
    return dict(ids=torch.randint(0, GPU_VOCAB, (n,), generator=g).to(device),
                table=torch.randn(GPU_VOCAB, width, generator=g).to(device, dtype),
                media=torch.randn(num_media, width, generator=g).to(device, dtype),
                media_index=media_index.to(device), pad_to=320, rows=384, width=width)


def gpu_stage(x: dict, slab: torch.Tensor, table: torch.Tensor, **vocab) -> None:
    slab.fill_(POISON)
    stage_embeddings(slab, x["ids"], table, media=x["media"], media_index=x["media_index"], pad_to=x["pad_to"],
                     **vocab)


def _nccl_staging(rank: int, world: int, device) -> dict:
    """Per dtype and placement: does the all-reduced slab equal the single-GPU slab, for two batches?"""
    results = {}
    for dname, dtype in DTYPES.items():
        vocab = vocab_parallel_args(GPU_VOCAB, rank, world, padding=GPU_PADDING)
        batches = [gpu_staging_inputs(seed, dtype, device) for seed in (1, 2)]
        x0 = batches[0]
        buffers = StagingBuffers.allocate(max_num_tokens=x0["rows"], max_batch_size=1, embed_width=x0["width"],
                                          embed_dtype=dtype, device=device)
        slab, single = buffers.input_embeds, torch.empty_like(buffers.input_embeds)
        hook = SlabAllReduce(buffers)
        graph = None
        for placement in PLACEMENTS:
            if placement == "in_graph":  # the all-reduce of the first pad_to rows, captured once
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    hook(x0["pad_to"])  # warm-up outside the capture
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    hook(x0["pad_to"])
            same, first = [], None
            for x in batches:
                gpu_stage(x, single, x["table"])
                gpu_stage(x, slab, shard_table(x["table"], GPU_VOCAB, rank, WORLD, padding=GPU_PADDING), **vocab)
                if graph is not None:
                    graph.replay()
                else:
                    hook(x["pad_to"])
                torch.cuda.synchronize()
                same.append(torch.equal(slab, single))
                first = slab.cpu() if first is None else first
            kept = bool((slab[x0["pad_to"]:] == POISON).all())
            results[placement, dname] = dict(same=same, slab=first, poison_kept=kept)
        del graph
    torch.cuda.synchronize()
    return results


@contextlib.contextmanager
def captured_output():
    """Log records of the 'slabstage' logger (all levels) and what is written to stderr, meanwhile."""
    records, logger, stderr = [], logging.getLogger("slabstage"), sys.stderr

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelno, record.getMessage()))

    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    sys.stderr = text = io.StringIO()
    try:
        yield records, text
    finally:
        sys.stderr = stderr
        logger.removeHandler(handler)
        logger.setLevel(level)


def gpu_toy(variant: str, dtype: torch.dtype, device) -> ToyMultimodalModel:
    """The runner cases' model; ``deepstack3_items``: DeepStack with k = 3 (its batches become items)."""
    if variant == "deepstack3_items":
        return ToyMultimodalModel("deepstack", hidden_size=128, vocab_size=GPU_VOCAB, num_layers=3, deepstack_k=3,
                                  device=device, dtype=dtype, seed=0)
    return ToyMultimodalModel(variant, hidden_size=128, vocab_size=GPU_VOCAB, device=device, dtype=dtype, seed=0)


def as_block_items(model: ToyMultimodalModel, batch):
    """``batch`` with its media as three items, each a tuple ``(main, ds_0, .., ds_k-1)`` of ``[rows, H]``
    column blocks, as an encoder emits DeepStack features (the rows and the slab are the same)."""
    if batch.media is None:
        return batch
    media = batch.media
    m = media.shape[0]
    cuts = [0, m // 3, (2 * m) // 3, m]
    items = [tuple(b.clone() for b in media[lo:hi].split(model.hidden_size, 1)) for lo, hi in zip(cuts, cuts[1:])]
    return replace(batch, media=items)


def _nccl_runner(rank: int, world: int, device) -> dict:
    results = {}
    for placement in PLACEMENTS:
        for variant, dname in GPU_RUNNER_CONFIGS:
            dtype = DTYPES[dname]
            model = gpu_toy(variant, dtype, device)
            local = shard_table(model.embed_tokens.weight, GPU_VOCAB, rank, WORLD, padding=GPU_PADDING)
            vocab = vocab_parallel_args(GPU_VOCAB, rank, world, padding=GPU_PADDING)
            tp_buffers, single_buffers = toy_buffers(model, 96, device), toy_buffers(model, 96, device)
            if placement == "in_graph":
                runner = PrefillGraphRunner(all_reduce_in_forward(model, tp_buffers), tp_buffers, buckets=GPU_BUCKETS,
                                            process_group=dist.group.WORLD)
            else:
                runner = PrefillGraphRunner(model, tp_buffers, buckets=GPU_BUCKETS,
                                            after_stage=SlabAllReduce(tp_buffers), process_group=dist.group.WORLD)
            with captured_output() as (records, stderr):
                runner.capture()
            record = dict(log=list(records), stderr=stderr.getvalue(), captured=runner.captured, runs=[])
            g = torch.Generator().manual_seed(11)
            for n in GPU_SIZES:
                batch = runner_batch(model, n, g)
                staged = as_block_items(model, batch) if variant == "deepstack3_items" else batch
                out = runner.run(replace(staged, table=local, **vocab), clone=True)
                bucket = runner.last_bucket
                rows = bucket or n
                stage_batch(single_buffers, input_ids=batch.input_ids, positions=batch.positions,
                                 table=batch.table, seq_lens=batch.seq_lens, extend_start_loc=batch.extend_start_loc,
                                 media=batch.media, media_index=batch.media_index, expand=batch.expand,
                                 pad_to=rows)
                ref = model(single_buffers.registry.views(rows))[:n]  # the single-GPU eager result, same shape
                torch.cuda.synchronize()
                record["runs"].append(dict(
                    n=n, bucket=bucket, out=out.cpu(), same_out=torch.equal(out, ref),
                    same_slab=torch.equal(tp_buffers.input_embeds[:rows], single_buffers.input_embeds[:rows])))
            runner.reset()
            del runner
            torch.cuda.synchronize()
            results[placement, variant, dname] = record
    return results


def _nccl_worker(rank: int, world: int, folder: str) -> None:
    multicast_off()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    init("nccl", rank, world, folder, device_id=device)
    saved = {"staging": _nccl_staging(rank, world, device), "runner": _nccl_runner(rank, world, device)}
    torch.save(saved, os.path.join(folder, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def nccl(spawn_ranks):
    multicast_off()
    return spawn_ranks(_nccl_worker, "nccl")


@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_nccl_all_reduced_slab_equals_single_gpu(nccl, placement, dname):
    for rank, saved in nccl.items():
        r = saved["staging"][placement, dname]
        assert r["same"] == [True, True], f"rank {rank}: slab == single-GPU slab, per batch: {r['same']}"
        assert r["poison_kept"], f"rank {rank}: rows past pad_to were written"
    assert torch.equal(nccl[0]["staging"][placement, dname]["slab"], nccl[1]["staging"][placement, dname]["slab"])


@pytest.mark.cuda
@pytest.mark.multigpu
@pytest.mark.parametrize("variant, dname", GPU_RUNNER_CONFIGS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_nccl_runner_equals_single_gpu_eager_and_ranks_agree(nccl, placement, variant, dname):
    records = {rank: saved["runner"][placement, variant, dname] for rank, saved in nccl.items()}
    for rank, record in records.items():
        assert record["captured"]
        buckets = [run["bucket"] for run in record["runs"]]
        assert buckets == [8, 16, 64, 64, None], buckets  # replays, and the eager fallback past 64
        for run in record["runs"]:
            assert run["same_slab"], f"rank {rank}, {run['n']} tokens: slab != single-GPU slab"
            assert run["same_out"], f"rank {rank}, {run['n']} tokens: output != single-GPU eager output"
    for run0, run1 in zip(records[0]["runs"], records[1]["runs"]):
        assert torch.equal(run0["out"], run1["out"]), f"{run0['n']} tokens: the ranks' outputs differ"


@pytest.mark.cuda
@pytest.mark.multigpu
def test_nccl_capture_log_and_progress_bar_on_rank0_only(nccl):
    try:
        import tqdm  # noqa: F401
        has_tqdm = True
    except ImportError:
        has_tqdm = False
    for rank, saved in nccl.items():
        for key, record in saved["runner"].items():
            said = [(level, msg) for level, msg in record["log"] if "prefill graphs" in msg]
            assert len(said) == 1, (rank, key, record["log"])
            assert (said[0][0] >= logging.INFO) == (rank == 0), (rank, key, said)
            bar = "slabstage capture" in record["stderr"]
            assert bar == (rank == 0 and has_tqdm), (rank, key, record["stderr"][-500:])


def test_gloo_ranks_agree_on_the_capture_check(gloo):
    """Under a process group every rank replays a bucket as often in the capture check and drops it when any
    rank's check does (a rank that dropped a bucket another kept would run other collectives than it)."""
    for rank, saved in gloo.items():
        check = saved["capture_check"]
        assert check["dropped"] == "replay_differs" and not check["equal"] and check["replays"] == 2, (rank, check)
    assert "another rank" in gloo[0]["capture_check"]["detail"]
    assert "another rank" not in gloo[1]["capture_check"]["detail"]


def test_gloo_the_all_reduce_wrapper_keeps_the_slots_its_forward_needs(gloo):
    """all_reduce_in_forward keeps the wrapped forward's ``needs``: the runner still refuses a batch without them
    (else the forward would read the last batch's KV-cache slots)."""
    for saved in gloo.values():
        assert saved["needs"] == ("out_cache_loc", "prefix_lens", "req_indices")
