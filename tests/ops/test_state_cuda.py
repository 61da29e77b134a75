"""On a GPU: each destination gets exactly its own batch, whatever else is staged around it, and the ops' staging
state goes with their destinations. Two buffers of one layout on one stream with the device busy, two slabs
(and two views of one slab) on two streams, the ops and the runner interleaved on one set of buffers, 200
slab views staged then dropped. Every staging call runs under ``torch.cuda.set_sync_debug_mode("error")``.
"""

import contextlib
import gc

import pytest
import torch

from slabstage import (PrefillBatch, PrefillGraphRunner, StagingBuffers, new_error_word, stage_embeddings,
                       stage_token_inputs)
from slabstage.staging import op_stagers
from slabstage.staging import stager as stager_module
from slabstage.ops import HAS_CUSTOM_OPS, stage_embeddings_op, stage_token_inputs_op

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda")
BUSY = 50_000_000  # torch.cuda._sleep cycles: tens of ms, while the host queues everything after it
W = 64


@contextlib.contextmanager
def no_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def settled_stagers() -> int:
    """Stagers alive once the ops' cache is emptied, everything collectable is collected and the device has run all
    it was given: a baseline that tests before left no trace in. (The cache may hold stagers of destinations that
    earlier tests keep alive, which a test's own slabs then evict; a stager let go of while a graph was captured
    records its event only at the next sweep, which the second synchronize lets finish.)"""
    op_stagers.clear()
    gc.collect()
    torch.cuda.synchronize()
    stager_module.live_stagers()
    torch.cuda.synchronize()
    return stager_module.live_stagers()


def allocate(T=64):
    return StagingBuffers.allocate(max_num_tokens=T, max_batch_size=4, embed_width=W, embed_dtype=torch.bfloat16,
                                   device=DEV)


def test_two_buffers_of_one_layout_one_stream_busy_device():
    """Buffers A then B (allocated alike), the device busy with earlier work: after the sync, each holds
    exactly its own ids, positions and count, 12 rounds; device and host inputs, the function and the op."""
    g = torch.Generator().manual_seed(1)
    a, b = allocate(), allocate()
    ops = [stage_token_inputs] + ([stage_token_inputs_op] if HAS_CUSTOM_OPS else [])
    stage_token_inputs(a, input_ids=torch.arange(3, device=DEV), positions=torch.arange(3, device=DEV), pad_to=4)
    torch.cuda.synchronize()
    for round_ in range(12):
        op = ops[round_ % len(ops)]
        where = DEV if round_ % 3 else "cpu"  # (host inputs travel in the parameter record)
        n_a, n_b = 9 + round_, 40 - round_
        ia = torch.randint(1, 10**6, (n_a,), generator=g).to(where)
        ib = torch.randint(1, 10**6, (n_b,), generator=g).to(where)
        pa, pb = ia + 7, ib + 11
        torch.cuda._sleep(BUSY)
        with no_sync():
            op(a, input_ids=ia, positions=pa, pad_to=n_a + 2)
            op(b, input_ids=ib, positions=pb, pad_to=n_b + 5)
        torch.cuda.synchronize()
        assert torch.equal(a.input_ids[:n_a].cpu(), ia.cpu()) and torch.equal(a.positions[:n_a].cpu(), pa.cpu()), \
            f"round {round_}: buffers A do not hold their own batch"
        assert torch.equal(b.input_ids[:n_b].cpu(), ib.cpu()) and torch.equal(b.positions[:n_b].cpu(), pb.cpu()), \
            f"round {round_}: buffers B do not hold their own batch"
        assert (a.input_ids[n_a:n_a + 2] == 0).all() and (b.input_ids[n_b:n_b + 5] == 0).all()
        assert a.num_tokens_non_padded.item() == n_a and b.num_tokens_non_padded.item() == n_b
    assert a.errors[0].item() == 0 and b.errors[0].item() == 0


@pytest.mark.parametrize("slabs", ["two slabs", "two views of one slab"])
def test_two_slabs_on_two_streams_busy_device(slabs):
    """Slab A staged on a busy stream, slab B on another, 10 rounds, new inputs each: each slab exactly its own
    batch. Views of one slab share a stager: its launches are ordered across the streams."""
    g = torch.Generator().manual_seed(2)
    T, V, M = 96, 300, 40
    table = torch.randn(V, W, generator=g).to(DEV)
    if slabs == "two slabs":
        sa, sb = (torch.zeros(T, W, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    else:
        base = torch.zeros(2 * T, W, dtype=torch.bfloat16, device=DEV)
        sa, sb = base[:T], base[T:]
    errors = new_error_word(DEV)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    warm = torch.zeros(8, W, dtype=torch.bfloat16, device=DEV)  # (the kernel's variants compile outside the test)
    stage_embeddings(warm, torch.arange(8, device=DEV), table, errors=errors)
    stage_embeddings(warm, torch.arange(8, device=DEV), table, media=torch.randn(2, W, device=DEV).bfloat16(),
                     media_index=torch.tensor([-1, 0, 1, -1, -1, -1, -1, -1], device=DEV), errors=errors)
    for round_ in range(10):
        na, nb = 30 + round_, 70 - round_
        ia, ib = (torch.randint(0, V, (n,), generator=g).to(DEV) for n in (na, nb))
        media = torch.randn(M, W, generator=g).to(DEV, torch.bfloat16)
        index = torch.full((nb,), -1, dtype=torch.int64)
        index[5:5 + M] = torch.randperm(M, generator=g)
        index = index.to(DEV)
        expect_a = table[ia].to(torch.bfloat16)
        expect_b = torch.where(index[:, None] >= 0, media[index.clamp(min=0)], table[ib].to(torch.bfloat16))
        torch.cuda.synchronize()
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(torch.cuda.current_stream())
        with no_sync():
            with torch.cuda.stream(s1):
                torch.cuda._sleep(BUSY)
                stage_embeddings(sa, ia, table, pad_to=na + 3, errors=errors)
            with torch.cuda.stream(s2):
                fn = stage_embeddings_op if HAS_CUSTOM_OPS and round_ % 2 else stage_embeddings
                fn(sb, ib, table, media=media, media_index=index, errors=errors)
        torch.cuda.synchronize()
        assert torch.equal(sa[:na], expect_a), f"round {round_}: slab A does not hold its own batch"
        assert torch.equal(sb[:nb], expect_b), f"round {round_}: slab B does not hold its own batch"
        assert (sa[na:na + 3] == 0).all()
    assert errors[0].item() == 0


def test_ops_and_runner_interleaved_on_one_set_of_buffers():
    """The runner replays its graphs (staging inside them) between op calls into the same buffers, on one
    stream, the device busy: each step's outputs and the buffers hold that step's batch."""
    g = torch.Generator().manual_seed(3)
    buffers = allocate(T=64)
    V = 80
    table = torch.randn(V, W, generator=g).to(DEV, torch.bfloat16)

    def forward(v):
        return v["input_embeds"].float() * 2 + v["positions"][:, None].float()

    runner = PrefillGraphRunner(forward, buffers, buckets=[16, 32, 64], verify="off", progress=False,
                                max_padding_ratio=16).capture()  # (every step replays, 5 tokens in 16 too)
    for step in range(8):
        n = 5 + 7 * step
        ids = torch.randint(0, V, (n,), generator=g)
        pos = torch.randint(0, 1000, (n,), generator=g)
        batch = PrefillBatch(input_ids=ids.to(DEV), positions=pos, table=table)  # (host positions: in the record)
        op_ids = torch.randint(0, V, (n + 3,), generator=g)
        op_pos = op_ids + 5
        op_ids_dev, op_pos_dev = op_ids.to(DEV), op_pos.to(DEV)  # (a pageable copy syncs: before the checked calls)
        expect = table[ids.to(DEV)].float() * 2 + pos.to(DEV)[:, None].float()
        torch.cuda._sleep(BUSY)
        with no_sync():
            op = stage_token_inputs_op if HAS_CUSTOM_OPS and step % 2 else stage_token_inputs
            op(buffers, input_ids=op_ids, positions=op_pos, pad_to=n + 3)
            out = runner.run(batch, clone=True)
            kept = buffers.input_ids[:n].clone()
            op(buffers, input_ids=op_ids_dev, positions=op_pos_dev, pad_to=n + 3)
        torch.cuda.synchronize()
        assert runner.last_bucket is not None
        assert torch.equal(out, expect), f"step {step}: the runner's outputs are not its batch's"
        assert torch.equal(kept.cpu(), ids), f"step {step}: the runner's batch was not in the buffers"
        assert torch.equal(buffers.input_ids[:n + 3].cpu(), op_ids) and torch.equal(buffers.positions[:n + 3].cpu(),
                                                                                     op_pos)
    assert buffers.errors[0].item() == 0


def _toy_runner(buckets=(16, 32), T=64, seed=6):
    """A runner whose forward is elementwise (its outputs are known without it), its table, a batch maker."""
    g = torch.Generator().manual_seed(seed)
    buffers = allocate(T=T)
    V = 80
    table = torch.randn(V, W, generator=g).to(DEV, torch.bfloat16)

    def forward(v):
        return v["input_embeds"].float() * 2 + v["positions"][:, None].float()

    runner = PrefillGraphRunner(forward, buffers, buckets=list(buckets), verify="off", progress=False,
                                max_padding_ratio=16).capture()

    def batch(n, on_device):
        ids = torch.randint(0, V, (n,), generator=g)
        pos = torch.randint(0, 1000, (n,), generator=g)
        expect = table[ids.to(DEV)].float() * 2 + pos.to(DEV)[:, None].float()
        return PrefillBatch(input_ids=ids.to(DEV) if on_device else ids, positions=pos, table=table), ids, expect
    return buffers, runner, batch


@pytest.mark.parametrize("streams", ["one stream", "two streams"])
def test_steps_bare_replays_and_eager_steps_queued_behind_a_busy_device(streams):
    """Nothing synchronised between 12 steps queued behind a busy device: steps replayed in their buckets,
    steps run eagerly (more tokens than the largest bucket), and bare replays of every graph after every other
    step (no batch prepared for them: they stage nothing), on one stream or alternating between two: each
    step's outputs are its own batch's, and after the bare replays behind the last step the buffers hold it."""
    buffers, runner, make = _toy_runner()
    sizes = (5, 40, 17, 32, 60, 9, 25, 64, 3, 31, 48, 13)  # (over 32: eager)
    steps = [make(n, i % 3 == 0) for i, n in enumerate(sizes)]
    current, side = torch.cuda.current_stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    outs = []
    torch.cuda._sleep(BUSY)
    with no_sync():
        for i, (batch, _, _) in enumerate(steps):
            with torch.cuda.stream(side if streams == "two streams" and i % 2 else current):
                outs.append(runner.run(batch, clone=True))
                if i % 2 == 0 or i == len(steps) - 1:
                    for graph, _ in runner.graphs.values():
                        graph.replay()
    torch.cuda.synchronize()
    for n, out, (_, _, expect) in zip(sizes, outs, steps):
        assert torch.equal(out, expect), f"the {n}-token step's outputs are not its batch's"
    n, (_, ids, expect) = sizes[-1], steps[-1]
    assert torch.equal(buffers.input_ids[:n].cpu(), ids) and (buffers.input_ids[n:16] == 0).all()
    assert runner.stats()["eager"] and sum(runner.stats()["replays"].values()) == 8
    assert buffers.errors[0].item() == 0


def test_two_runners_of_one_layout_on_two_streams_busy_device():
    """Two runners over buffers allocated alike, each on a stream of its own behind a busy device, 10 steps
    each queued without a sync: every step's outputs are its own runner's batch (each stager copies its records
    on its own stream, into its own graphs' record)."""
    runs = [_toy_runner(seed=8), _toy_runner(seed=9)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    sizes = (5, 30, 17, 9, 32, 12, 25, 3, 16, 28)
    steps = [[make(n, i % 2 == 0) for i, n in enumerate(sizes)] for _, _, make in runs]
    torch.cuda.synchronize()
    outs = [[], []]
    with no_sync():
        for s in streams:
            with torch.cuda.stream(s):
                torch.cuda._sleep(BUSY)
        for i in range(len(sizes)):
            for r, ((_, runner, _), stream) in enumerate(zip(runs, streams)):
                with torch.cuda.stream(stream):
                    outs[r].append(runner.run(steps[r][i][0], clone=True))
    torch.cuda.synchronize()
    for r in range(2):
        for n, out, (_, _, expect) in zip(sizes, outs[r], steps[r]):
            assert torch.equal(out, expect), f"runner {r}, the {n}-token step's outputs are not its batch's"
        assert runs[r][0].errors[0].item() == 0


def test_a_step_run_on_a_new_thread():
    """``run()`` from a thread that has made no CUDA call yet: the replay's driver calls find no current context
    there at first (the device's primary context is made current, once), and the step is right."""
    import threading

    buffers, runner, make = _toy_runner(seed=7)
    batch, _, expect = make(20, False)
    got = []
    thread = threading.Thread(target=lambda: got.append(runner.run(batch, clone=True)))
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    assert runner.last_bucket == 32 and torch.equal(got[0], expect)


def test_slab_views_staged_then_dropped_give_memory_back():
    """200 views of one slab, then 200 slabs of their own: one stager, then at most MAX_STAGERS; all dropped,
    device memory and the stagers (pinned rings) are back where they started."""
    g = torch.Generator().manual_seed(4)
    table = torch.randn(50, W, generator=g).to(DEV)
    errors = new_error_word(DEV)
    warm = torch.zeros(4, W, dtype=torch.bfloat16, device=DEV)
    stage_embeddings(warm, torch.arange(3, device=DEV), table, errors=errors)  # (compiles the kernel)
    del warm
    live0, mem0 = settled_stagers(), torch.cuda.memory_allocated()
    base = torch.zeros(256, W, dtype=torch.bfloat16, device=DEV)
    ids = [torch.randint(0, 50, (n,), generator=g).to(DEV) for n in range(1, 201)]
    with no_sync():
        for n in range(1, 201):
            stage_embeddings(base[:n], ids[n - 1], table, errors=errors)
    assert stager_module.live_stagers() == live0 + 1
    torch.cuda.synchronize()
    assert torch.equal(base[:200], table[ids[-1]].to(torch.bfloat16))
    slabs = [torch.zeros(8, W, dtype=torch.bfloat16, device=DEV) for _ in range(200)]
    with no_sync():
        for slab, i in zip(slabs, ids):
            stage_embeddings(slab, i[:8], table, errors=errors)
    torch.cuda.synchronize()  # (a stager the cache let go of lives on until its queued work has run)
    assert stager_module.live_stagers() <= live0 + op_stagers.MAX_STAGERS
    assert all(torch.equal(s[:len(i[:8])], table[i[:8]].to(torch.bfloat16)) for s, i in zip(slabs, ids))
    del base, slabs, ids, slab, i  # (the loop's names hold the last slab too)
    gc.collect()
    torch.cuda.synchronize()
    assert stager_module.live_stagers() == live0, "stagers (pinned rings, device record) outlived their slabs"
    assert torch.cuda.memory_allocated() == mem0, "device memory was not given back"
    assert errors[0].item() == 0


def test_a_dropped_stager_outlives_its_queued_work():
    """A slab dropped while its staging is still queued behind a busy device: its stager's ring and device
    block stay until that work has run, then go; the next stager gets a fresh ring."""
    table = torch.randn(20, W).to(DEV)
    errors = new_error_word(DEV)
    live0 = settled_stagers()
    slab = torch.zeros(16, W, dtype=torch.bfloat16, device=DEV)
    ids = torch.arange(16, device=DEV) % 20
    torch.cuda._sleep(40 * BUSY)  # (~1 s: longer than a new stager's pinned ring and a full gc.collect() take)
    with no_sync():
        stage_embeddings(slab, ids, table, errors=errors)
        del slab
        gc.collect()
        assert stager_module.live_stagers() == live0 + 1  # collected, but its work is still queued
    torch.cuda.synchronize()
    assert stager_module.live_stagers() == live0


def test_an_op_captured_in_a_callers_graph_replays_after_its_stager_is_dropped():
    """stage_embeddings captured in the caller's graph; then more slabs than the ops keep stagers for push its
    stager out: each replay still stages the captured batch (its parameter record is kept for good)."""
    g = torch.Generator().manual_seed(5)
    table = torch.randn(40, W, generator=g).to(DEV)
    errors = new_error_word(DEV)
    slab = torch.zeros(32, W, dtype=torch.bfloat16, device=DEV)
    ids = torch.randint(0, 40, (20,), generator=g).to(DEV)
    stage_embeddings(slab, ids, table, pad_to=24, errors=errors)  # (compiles outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stage_embeddings(slab, ids, table, pad_to=24, errors=errors)
    others = [torch.zeros(4, W, dtype=torch.bfloat16, device=DEV) for _ in range(op_stagers.MAX_STAGERS + 4)]
    for o in others:
        stage_embeddings(o, ids[:4], table, errors=errors)
    del others
    gc.collect()
    torch.cuda.synchronize()
    for _ in range(3):
        slab.fill_(7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(slab[:20], table[ids].to(torch.bfloat16)) and (slab[20:24] == 0).all()
        assert (slab[24:] == 7).all()
    assert errors[0].item() == 0
