"""Staging state belongs to its destinations: no stager shared between buffers or slabs, bounded and freed with
them, ring slots never rewritten while a launch may still read them, buffers that copy and pickle after staging.

Both staging paths run here (the Triton interpreter and the PyTorch reference); tests/ops/test_state_cuda.py
runs the same on a GPU with a busy device and several streams.
"""

import copy
import gc
import pickle
import weakref

import pytest
import torch

from slabstage import StagingBuffers, new_error_word, stage_embeddings, stage_token_inputs
from slabstage.staging import op_stagers
from slabstage.staging import stager as stager_module
from slabstage.staging.destinations import Destinations
from slabstage.ops import HAS_CUSTOM_OPS, stage_embeddings_op, stage_token_inputs_op

W, T = 32, 48


def allocate(device="cpu"):
    return StagingBuffers.allocate(max_num_tokens=T, max_batch_size=4, embed_width=W, embed_dtype=torch.bfloat16,
                                   device=device)


def ids_of(g, n, lo):
    return torch.randint(lo, lo + 1000, (n,), generator=g)


def test_two_buffers_of_one_layout_get_their_own_batches(path):
    """Buffers A and B, allocated alike, staged alternately through the plain function and the custom op:
    each holds exactly its own ids and positions, and the op keeps one stager for each (none shared)."""
    g = torch.Generator().manual_seed(1)
    a, b = allocate(), allocate()
    ops = [stage_token_inputs] + ([stage_token_inputs_op] if HAS_CUSTOM_OPS else [])
    for round_ in range(6):
        op = ops[round_ % len(ops)]
        n_a, n_b = 5 + round_, 17 - round_
        ia, ib = ids_of(g, n_a, 1000 * round_ + 1), ids_of(g, n_b, 1000 * round_ + 500_000)
        pa, pb = ids_of(g, n_a, 7), ids_of(g, n_b, 90_000)
        op(a, input_ids=ia, positions=pa, pad_to=n_a + 3)
        op(b, input_ids=ib, positions=pb, pad_to=n_b + 1)
        assert torch.equal(a.input_ids[:n_a], ia) and torch.equal(a.positions[:n_a], pa), round_
        assert torch.equal(b.input_ids[:n_b], ib) and torch.equal(b.positions[:n_b], pb), round_
        assert a.num_tokens_non_padded.item() == n_a and b.num_tokens_non_padded.item() == n_b
    assert a.errors.tolist()[0] == 0 and b.errors.tolist()[0] == 0
    if HAS_CUSTOM_OPS:
        assert op_stagers.cached_stagers() == 2  # one a set of destinations, never one a layout


def test_two_slabs_of_one_layout_get_their_own_batches(path):
    g = torch.Generator().manual_seed(2)
    table = torch.randn(64, W, generator=g)
    slabs = [torch.full((T, W), float("nan"), dtype=torch.bfloat16) for _ in range(2)]
    errors = new_error_word("cpu")
    stagers = set()
    for round_ in range(4):
        for k, slab in enumerate(slabs):
            n = 9 + 3 * k + round_
            ids = torch.randint(0, 64, (n,), generator=g)
            fn = stage_embeddings_op if HAS_CUSTOM_OPS and round_ % 2 else stage_embeddings
            fn(slab, ids, table, pad_to=n + 2, errors=errors)
            assert torch.equal(slab[:n], table[ids].to(torch.bfloat16)), (round_, k)
            assert (slab[n:n + 2] == 0).all() and slab[n + 2:].isnan().all()
            stagers.add(id(op_stagers.slab_stager(slab, errors)[1]))
    assert len(stagers) == 2


def test_views_of_one_slab_share_one_stager_and_it_goes_with_the_slab(path):
    """200 views of one slab, staged and dropped: one stager, no reference to the slab; when the slab goes,
    so does its stager (weakly referenced here)."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(50, W, generator=g)
    errors = new_error_word("cpu")
    gc.collect()
    live0, cached0 = stager_module.live_stagers(), op_stagers.cached_stagers()
    base = torch.zeros(220, W, dtype=torch.bfloat16)
    for n in range(1, 201):  # (views of n rows and offsets; a few rows staged into each)
        ids = torch.randint(0, 50, (min(n, 3),), generator=g)
        view = base[n % 7:n % 7 + n]
        stage_embeddings(view, ids, table, errors=errors)
        assert torch.equal(view[:len(ids)], table[ids].to(torch.bfloat16)), n
    assert op_stagers.cached_stagers() == cached0 + 1
    stager = weakref.ref(op_stagers.slab_stager(base[:3], errors)[1])
    assert stager_module.live_stagers() == live0 + 1
    slab_ref = weakref.ref(base)
    del base, view
    gc.collect()
    assert slab_ref() is None, "a stager (or the cache) kept the slab alive"
    assert stager() is None and op_stagers.cached_stagers() == cached0 and stager_module.live_stagers() == live0


def test_the_ops_keep_a_bounded_number_of_stagers(path):
    """200 slabs, each staged once and kept: at most MAX_STAGERS stagers; dropped, none are left."""
    table = torch.randn(20, W)
    errors = new_error_word("cpu")
    gc.collect()
    live0 = stager_module.live_stagers()
    slabs = []
    for n in range(200):
        slabs.append(torch.zeros(4, W, dtype=torch.float16))
        stage_embeddings(slabs[-1], torch.tensor([n % 20, 1]), table, errors=errors)
        assert op_stagers.cached_stagers() <= op_stagers.MAX_STAGERS
    assert all(torch.equal(s[0], table[n % 20].half()) for n, s in enumerate(slabs))
    assert stager_module.live_stagers() <= live0 + op_stagers.MAX_STAGERS
    del slabs
    gc.collect()
    assert op_stagers.cached_stagers() == 0 and stager_module.live_stagers() == live0


def test_the_token_op_drops_the_stager_of_dropped_buffers(path):
    if not HAS_CUSTOM_OPS:
        pytest.skip("custom ops need torch >= 2.4")
    gc.collect()
    live0 = stager_module.live_stagers()
    for k in range(30):
        buf = allocate()
        stage_token_inputs_op(buf, input_ids=torch.arange(k + 1), positions=torch.arange(k + 1), pad_to=k + 2)
        assert buf.input_ids[:k + 1].tolist() == list(range(k + 1))
        del buf
    gc.collect()
    assert op_stagers.cached_stagers() == 0 and stager_module.live_stagers() == live0


def test_a_stager_serves_only_its_own_destinations(path):
    """An op's stager is keyed by its destinations' identity: buffers alike in every way but storage never
    share one, and one stager's blocks name its own destinations only."""
    a, b = allocate(), allocate()

    def dst_of(buf):
        reg = buf.registry
        from slabstage.staging.slots import SLOTS
        return Destinations(slots=[reg[s.name] if s.name in reg else None for s in SLOTS],
                            fills=[reg.slot(s.name).fill_value if s.name in reg else None for s in SLOTS],
                            errors=buf.errors, host_ok=True, device=buf.device)

    sa, sb = op_stagers.slots_stager(dst_of(a)), op_stagers.slots_stager(dst_of(b))
    assert sa is not sb and sa is op_stagers.slots_stager(dst_of(a))
    assert sa.ring.tensor.data_ptr() != sb.ring.tensor.data_ptr() and sa.params.data_ptr() != sb.params.data_ptr()
    assert a.input_ids.data_ptr() in sa._dest.tolist() and b.input_ids.data_ptr() not in sa._dest.tolist()


def test_a_ring_slot_is_not_rewritten_while_a_launch_may_read_it(monkeypatch, ring_of):
    """A ring of two slots; the device is made to look behind (the done word, which each launch's program 0
    sets after the copy or fetch that read its slot, reads an old step): the next block waits for it, and
    the slot it waits for is untouched until then."""
    ring_of(2)
    buf = allocate()
    st = stager_module.Stager.for_buffers(buf, embed=False)
    ring, waited = st.ring, []
    for step in range(1, 4):
        stage_token_inputs(buf, input_ids=torch.arange(step + 5), positions=torch.arange(step + 5), pad_to=8)
    assert ring.step == 3 and int(ring.done[0]) == 3
    ring.done[0] = 1  # step 2's slot (slot 0) would still be read by a launch queued behind a busy device
    slot = 4 % 2 * ring.slot_words
    before = ring.words[slot:slot + ring.slot_words].copy()

    def wait(step):
        assert step == 2
        assert (ring.words[slot:slot + ring.slot_words] == before).all(), "a slot was rewritten while pending"
        waited.append(step)
        ring.done[0] = 3  # the device catches up

    monkeypatch.setattr(ring, "_wait", wait)
    ids = torch.arange(100, 109)
    stage_token_inputs(buf, input_ids=ids, positions=ids + 1, pad_to=9)
    assert waited == [2] and torch.equal(buf.input_ids[:9], ids) and ring.step == 4


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_buffers_copy_and_pickle_after_staging(path, how):
    buf = allocate()
    ids = torch.arange(3, 14)
    stage_token_inputs(buf, input_ids=ids, positions=ids * 2, pad_to=12)
    twin = copy.deepcopy(buf) if how == "deepcopy" else pickle.loads(pickle.dumps(buf))
    assert torch.equal(twin.input_ids, buf.input_ids) and twin.input_ids.data_ptr() != buf.input_ids.data_ptr()
    other = torch.arange(40, 45)
    stage_token_inputs(twin, input_ids=other, positions=other, pad_to=5)
    assert torch.equal(twin.input_ids[:5], other) and torch.equal(buf.input_ids[:11], ids)
    stage_token_inputs(buf, input_ids=ids + 1, positions=ids, pad_to=11)
    assert torch.equal(twin.input_ids[:5], other) and torch.equal(buf.input_ids[:11], ids + 1)


# -- the order of launches across streams, and finalizers ----------------------------------------------------
class _Stream:
    """A stream as a stager's ``_order`` sees it: the streams it was told to wait for."""

    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_stream(self, other):
        self.waited.append(other.name)


@pytest.fixture
def streams(monkeypatch):
    """Streams "A" and "B"; ``streams["now"]`` names the current one (the stagers' CUDA ordering on the CPU)."""
    s = {"A": _Stream("A"), "B": _Stream("B"), "now": "A"}
    monkeypatch.setattr(stager_module, "_raw_stream", lambda index: id(s[s["now"]]))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: s[s["now"]])
    return s


def test_the_stagers_of_one_set_of_buffers_keep_one_order_across_streams(streams):
    """The runner's stager (slab and slots) and stage_token_inputs' (slots) write the same buffers: a launch of
    either on stream B after one of the other on stream A waits for A."""
    buf = allocate()
    run_st, tok_st = (stager_module.Stager.for_buffers(buf, embed=e) for e in (True, False))
    assert run_st is not tok_st
    run_st._order()  # runner.run on A
    streams["now"] = "B"
    tok_st._order()  # stage_token_inputs(buffers) on B
    assert streams["B"].waited == ["A"]
    streams["now"] = "A"
    run_st._order()
    assert streams["A"].waited == ["B"]


def test_a_slab_staged_again_after_the_ops_let_its_stager_go_keeps_its_order(streams, monkeypatch, path):
    """stage_embeddings(slab) on stream A, then more slabs than the ops keep stagers for (slab's is let go),
    then stage_embeddings(slab) on stream B: B still waits for A."""
    launch = stager_module.Stager.launch

    def ordered(self, c, pad_to):  # (the CUDA path's _order, on the CPU)
        self._order()
        return launch(self, c, pad_to)

    monkeypatch.setattr(stager_module.Stager, "launch", ordered)
    errors, table, ids = new_error_word("cpu"), torch.randn(20, 8), torch.arange(4)
    slab = torch.zeros(8, 8)
    stage_embeddings(slab, ids, table, errors=errors)
    others = [torch.zeros(4, 8) for _ in range(op_stagers.MAX_STAGERS)]
    for o in others:
        stage_embeddings(o, ids, table, errors=errors)
    assert op_stagers.cached_stagers() == op_stagers.MAX_STAGERS
    streams["B"].waited.clear()
    streams["now"] = "B"
    stage_embeddings(slab, ids, table, errors=errors)
    assert streams["B"].waited == ["A"]


def test_a_finalizer_the_collector_runs_inside_the_ops_lock_does_not_deadlock(monkeypatch, path):
    """A slab's finalizer (it drops the slab's stager) run by the cycle collector at an allocation made while the
    ops' lock is held, on the same thread: it queues the drop and takes no lock."""
    import threading

    errors, table, ids = new_error_word("cpu"), torch.randn(20, 8), torch.arange(4)
    gc.disable()
    try:
        slab = torch.zeros(8, 8)
        stage_embeddings(slab, ids, table, errors=errors)
        cycle = [slab]
        cycle.append(cycle)
        del slab, cycle  # garbage: the next collection frees it

        class Collecting(type(op_stagers._CACHE)):
            def popitem(self, last=True):  # (the collector running at an allocation under the lock)
                gc.collect()
                return super().popitem(last)

        monkeypatch.setattr(op_stagers, "_CACHE", Collecting(op_stagers._CACHE))
        monkeypatch.setattr(op_stagers, "MAX_STAGERS", 1)  # (so that a new slab's stager evicts under the lock)
        done = threading.Event()

        def call():
            stage_embeddings(torch.zeros(8, 8), ids, table, errors=errors)
            done.set()

        threading.Thread(target=call, daemon=True).start()
        assert done.wait(20), "deadlock: a finalizer waits for the lock its own thread holds"
        op_stagers.cached_stagers()  # (a drop queued under the lock is made at the next look)
        assert not op_stagers._DROPPED
    finally:
        gc.enable()
