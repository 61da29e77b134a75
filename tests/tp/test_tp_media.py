"""Vocab-parallel staging with media items: two gloo processes on CPU.

Each rank stages the batch with its vocab shard (``vocab_parallel_args``) and the
media in one of the new forms: a list of items, tuples of column blocks
(DeepStack, slab ``H * (1 + 3)``), an index from ``media_index_from_mask(...,
src_start=...)``. One sum all-reduce completes the slab, which must equal bit for
bit the slab one process stages with the whole table and the media concatenated
into one tensor (the one-tensor path). The runner does the same in eager mode,
with the all-reduce before the forward and inside it.

As in tests/tp/test_tp.py: one spawn serves the module (the kernels run under the
Triton interpreter, which conftest turns on and the children inherit); the
workers save what they hold and the tests compare. A case that raises on a rank
is recorded with its traceback (the ranks agree on it before any collective, so
a failure never leaves the other rank waiting) and fails its own test.
"""

from __future__ import annotations

import functools
import os
import traceback
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from slabstage import PrefillGraphRunner, StagingBuffers, media_index_from_mask, new_error_word, stage_embeddings
from slabstage.distributed import SlabAllReduce, all_reduce_in_forward, vocab_parallel_args, vocab_shard
from slabstage.models import ToyMultimodalModel, make_batch

import builders  # noqa: I001 - tests/builders.py
import interpreter_speedups  # noqa: I001 - tests/interpreter_speedups.py
from builders import shard_table  # noqa: I001

interpreter_speedups.speed_up()  # (the spawned ranks import this module: they interpret faster too)

WORLD = 2
POISON = 12345.0  # finite, so whole slabs compare with torch.equal; rows past pad_to must keep it
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PLACEMENTS = ("before_replay", "in_graph")


def init(rank: int, world: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))


def all_ranks_ok(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# ==================================================================================================
# Cases: the same inputs in every process (a fixed seed per case)
# ==================================================================================================
CASES = {
    # rows of the items; how each item splits into column blocks (None: one tensor); slab width; text width
    "items": dict(rows=[5, 0, 7, 3], splits=[None] * 4),
    "items_mixed_forms": dict(rows=[4, 6, 0, 5], splits=[None, (16, 32), (48,), (8, 24, 16)]),
    "deepstack_k3": dict(rows=[6, 0, 5, 4], width=64, text_width=16,
                         splits=[(16, 16, 16, 16), (16, 16, 16, 16), (16, 48), (16, 16, 16, 16)]),
    "src_start": dict(rows=[6, 5], splits=[(16, 32), None], src_start=2),
    "deepstack_src_start": dict(rows=[9], width=64, text_width=16, splits=[(16, 16, 16, 16)], src_start=3),
    "items_media_on_rank1": dict(rows=[5, 7], splits=[(24, 24), None], owner=1),
    "items_padded_vocab_scaled": dict(rows=[3, 8], splits=[None, (16, 32)], vocab=37, padding=8, text_scale=2.5),
    "items_bad_id_and_index": dict(rows=[4, 0, 6], splits=[None, None, (32, 16)], bad=True),
}


def case_inputs(name: str, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    c = dict(vocab=50, padding=1, width=48, text_width=48, n=32, pad_to=36, slab_rows=40, src_start=None,
             owner=0, text_scale=None, bad=False)
    c.update(CASES[name])
    table = (torch.randn(c["vocab"], c["text_width"], generator=g) * 2).to(dtype)
    ids = torch.randint(0, c["vocab"], (c["n"],), generator=g)
    cut = vocab_shard(c["vocab"], 0, WORLD, padding=c["padding"])[1]
    ids[:4] = torch.tensor([0, cut - 1, cut, c["vocab"] - 1])  # both shards, every edge
    media_width = c["width"]
    items = []
    for r, split in zip(c["rows"], c["splits"]):  # fp32, as an encoder emits it: cast into a bf16 slab
        if split is None:
            items.append(torch.randn(r, media_width, generator=g) * 2)
        else:
            items.append(tuple(torch.randn(r, w, generator=g) * 2 for w in split))
    total = sum(c["rows"])
    index = torch.full((c["n"],), -1, dtype=torch.int64)
    if c["src_start"] is None:  # two spans, text around them
        first = total // 2
        index[6:6 + first] = torch.arange(0, first)
        index[20:20 + total - first] = torch.arange(first, total)
        mask = None
    else:  # a chunk whose placeholders continue an item cut by the previous chunk
        count = total - c["src_start"]
        mask = torch.zeros(c["n"], dtype=torch.bool)
        mask[10:10 + count] = True
        index[mask] = torch.arange(c["src_start"], total)
    ids[index >= 0] = c["vocab"] - 1  # a placeholder id, never read at media rows
    if c["bad"]:
        ids[2] = c["vocab"] + 3  # outside the vocabulary: a zero row, flagged on every rank
        index[30] = total + 1  # past the items' rows: the same
    c.update(table=table, ids=ids, items=items, index=index, mask=mask, total=total)
    return c


def concatenated(items) -> torch.Tensor:
    return torch.cat([torch.cat(list(it), 1) if isinstance(it, tuple) else it for it in items], 0)


def stage_case(c: dict, dtype: torch.dtype, table: torch.Tensor, media, index, *, errors_word3=None,
               **vocab) -> StagingBuffers:
    buffers = StagingBuffers.allocate(max_num_tokens=c["slab_rows"], max_batch_size=1, embed_width=c["width"],
                                      embed_dtype=dtype, device="cpu")
    buffers.input_embeds.fill_(POISON)
    if errors_word3 is not None:
        buffers.errors[3] = errors_word3
    stage_embeddings(buffers.input_embeds, c["ids"], table, media=media, media_index=index, pad_to=c["pad_to"],
                     expand="zeros", text_scale=c["text_scale"], errors=buffers.errors, **vocab)
    return buffers


def worker_index(c: dict, errors: torch.Tensor) -> torch.Tensor:
    """The index as an engine builds it: by hand from spans, or from the chunk's mask with src_start."""
    if c["mask"] is None:
        return c["index"]
    index = media_index_from_mask(c["mask"], int(c["mask"].sum()), src_start=c["src_start"], errors=errors)
    if c["bad"]:
        index = index.clone()
        index[30] = c["total"] + 1
    return index


# ==================================================================================================
# Runner cases: the toy model with items
# ==================================================================================================
RUNNER_CONFIGS = (("plain", "bf16"), ("deepstack", "fp32"), ("deepstack", "bf16"))
RUNNER_VOCAB, RUNNER_PADDING, RUNNER_SIZES = 97, 8, (5, 21)


def toy(variant: str, dtype: torch.dtype) -> ToyMultimodalModel:
    return builders.toy(variant, dtype, vocab=RUNNER_VOCAB, layers=3, k=3)


def toy_buffers(model: ToyMultimodalModel, capacity: int) -> StagingBuffers:
    return builders.toy_buffers(model, capacity, batch=4)


def runner_batches(model: ToyMultimodalModel, n: int, g: torch.Generator):
    """(one-tensor batch, the same media as items): items cut on rows, DeepStack ones on columns too."""
    batch = make_batch(model, n, media_fraction=0.4, num_seqs=min(3, n), generator=g)
    if batch.media is None:
        return batch, batch
    media = torch.randn(batch.media.shape, generator=g).to(model.dtype)
    m = media.shape[0]
    bounds = sorted({0, m // 3, (2 * m) // 3, m})
    bounds = [0, *bounds]  # an empty first item
    items = []
    for lo, hi in zip(bounds, bounds[1:]):
        part = media[lo:hi]
        items.append(tuple(b.clone() for b in part.split(model.hidden_size, 1)) if model.variant == "deepstack"
                     else part.clone())
    return replace(batch, media=media), replace(batch, media=items)


def _runner_case(rank, world, variant, dname, placement):
    model = toy(variant, DTYPES[dname])
    local = shard_table(model.embed_tokens.weight.detach(), RUNNER_VOCAB, rank, WORLD, padding=RUNNER_PADDING)
    vocab = vocab_parallel_args(RUNNER_VOCAB, rank, world, padding=RUNNER_PADDING)
    buffers, single_buffers = toy_buffers(model, 32), toy_buffers(model, 32)
    single = PrefillGraphRunner(model, single_buffers, buckets=[8, 16, 32])  # this process, the whole table
    if placement == "in_graph":
        runner = PrefillGraphRunner(all_reduce_in_forward(model, buffers), buffers, buckets=[8, 16, 32],
                                    process_group=dist.group.WORLD)
    else:
        runner = PrefillGraphRunner(model, buffers, buckets=[8, 16, 32], after_stage=SlabAllReduce(buffers),
                                    process_group=dist.group.WORLD)
    runner.capture()  # no CUDA: eager
    g = torch.Generator().manual_seed(7)
    runs = []
    for n in RUNNER_SIZES:
        ok, failure = True, None
        try:  # the batch and its staging alone first, so that no rank enters the runner's collective alone
            cat, items = runner_batches(model, n, g)
            tp_batch = replace(items, table=local, **vocab)
            scratch = torch.empty_like(buffers.input_embeds)
            stage_embeddings(scratch, tp_batch.input_ids, tp_batch.table, media=tp_batch.media,
                             media_index=tp_batch.media_index, expand=tp_batch.expand, errors=new_error_word("cpu"),
                             vocab_range=tp_batch.vocab_range, vocab_size=tp_batch.vocab_size,
                             media_owner=tp_batch.media_owner)
        except Exception:
            ok, failure = False, traceback.format_exc()
        if not all_ranks_ok(ok):
            return dict(failed=failure or "another rank failed")
        out = runner.run(tp_batch, clone=True)
        ref = single.run(cat, clone=True)  # the forward's float math may differ between processes: compare here
        runs.append(dict(n=n, out=out, ref=ref, slab=buffers.input_embeds[:n].clone()))
    return dict(runs=runs)


def _gloo_worker(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    init(rank, world, folder)
    saved = {"staging": {}, "runner": {}}
    for name in CASES:
        for dname, dtype in DTYPES.items():
            c = case_inputs(name, dtype)
            vocab = vocab_parallel_args(c["vocab"], rank, world, padding=c["padding"], media_rank=c["owner"])
            ok, failure = True, None
            try:
                errors = new_error_word("cpu")
                index = worker_index(c, errors)
                buffers = stage_case(c, dtype, shard_table(c["table"], c["vocab"], rank, WORLD, padding=c["padding"]),
                                     c["items"], index, errors_word3=int(errors[3]), **vocab)
                buffers.errors[0] |= errors[0]  # what media_index_from_mask found, beside the staging's word
            except Exception:
                ok, failure = False, traceback.format_exc()
            if all_ranks_ok(ok):
                SlabAllReduce(buffers)(c["pad_to"])
                saved["staging"][name, dname] = dict(slab=buffers.input_embeds.clone(),
                                                     errors=buffers.errors.clone(), index=index.clone())
            else:
                saved["staging"][name, dname] = dict(failed=failure or "another rank failed")
    for variant, dname in RUNNER_CONFIGS:
        for placement in PLACEMENTS:
            saved["runner"][variant, dname, placement] = _runner_case(rank, world, variant, dname, placement)
    torch.save(saved, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo(spawn_ranks):
    return spawn_ranks(_gloo_worker, "gloo_items")


# ==================================================================================================
# Tests
# ==================================================================================================
@functools.cache
def single_process(name: str, dname: str) -> StagingBuffers:
    """One process, the whole table, the media concatenated into one tensor, the index by hand (made once a
    case: two tests read it, neither writes it)."""
    dtype = DTYPES[dname]
    c = case_inputs(name, dtype)
    word3 = int(c["mask"].sum()) if c["mask"] is not None else None
    return stage_case(c, dtype, c["table"], concatenated(c["items"]), c["index"], errors_word3=word3)


def got(saved: dict, key) -> dict:
    record = saved[key]
    assert "failed" not in record, f"{key} raised on a rank:\n{record['failed']}"
    return record


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_gloo_item_slab_equals_single_process(gloo, name, dname):
    dtype = DTYPES[dname]
    c = case_inputs(name, dtype)
    single = single_process(name, dname)
    want = single.input_embeds
    n, pad_to = c["n"], c["pad_to"]
    media = (c["index"] >= 0) & (c["index"] < c["total"])
    assert want[:n][media].abs().sum() > 0 and want[:n][c["index"] < 0].abs().sum() > 0  # both kinds are there
    assert (want[n:pad_to] == 0).all() and (want[pad_to:] == POISON).all()
    if c["text_width"] < c["width"]:  # DeepStack: text rows carry zeros in blocks 1..k
        assert (want[:n][c["index"] < 0][:, c["text_width"]:] == 0).all()
    for rank, saved in gloo.items():
        record = got(saved["staging"], (name, dname))
        assert record["index"].long().tolist() == c["index"].tolist(), f"rank {rank}: media_index"
        slab = record["slab"]
        differ = (slab != want).any(1).nonzero().flatten().tolist()
        assert torch.equal(slab, want), f"rank {rank}: rows {differ} differ from the single-process slab"
        assert record["errors"].tolist() == single.errors.tolist(), f"rank {rank}: error word"
    if c["bad"]:
        assert single.errors[1].item() == 2  # both bad rows were seen, on every rank


@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_single_process_items_equal_concatenated(name, dname):
    """The single-process reference itself: items give the bytes of the one concatenated tensor."""
    dtype = DTYPES[dname]
    c = case_inputs(name, dtype)
    want = single_process(name, dname)
    errors = new_error_word("cpu")
    index = worker_index(c, errors)
    items = stage_case(c, dtype, c["table"], c["items"], index, errors_word3=int(errors[3]))
    assert torch.equal(items.input_embeds, want.input_embeds)
    items.errors[0] |= errors[0]
    assert items.errors.tolist() == want.errors.tolist()


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("variant, dname", RUNNER_CONFIGS)
def test_gloo_eager_runner_with_items_equals_single_process(gloo, variant, dname, placement):
    model = toy(variant, DTYPES[dname])
    buffers = toy_buffers(model, 32)
    single = PrefillGraphRunner(model, buffers, buckets=[8, 16, 32])
    g = torch.Generator().manual_seed(7)
    records = {rank: got(saved["runner"], (variant, dname, placement)) for rank, saved in gloo.items()}
    for i, n in enumerate(RUNNER_SIZES):
        cat, _ = runner_batches(model, n, g)
        single.run(cat)
        want_slab = buffers.input_embeds[:n].clone()
        for rank, record in records.items():
            run = record["runs"][i]
            assert run["n"] == n
            assert torch.equal(run["slab"], want_slab), f"rank {rank}, {n} tokens: the staged slab"
            assert torch.equal(run["out"], run["ref"]), f"rank {rank}, {n} tokens: output != single-process output"
        assert torch.equal(records[0]["runs"][i]["out"], records[1]["runs"][i]["out"]), f"{n} tokens: ranks differ"
