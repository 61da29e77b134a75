"""The ops' cheap host path gives the answers of the full one: a view of a checked slab is checked from its
address and rows (and still refused where it overlaps the error word or is not row-contiguous), views made
under inference mode share their slab's stager, a custom op's destinations are checked once per set of
tensors, and the custom-op wrappers bump the version counters of what they write."""

import gc

import pytest
import torch

from slabstage import StagingBuffers, new_error_word, stage_embeddings
from slabstage.staging import op_stagers
from slabstage.staging import stager as stager_module
from slabstage.staging.slots import SLOTS
from slabstage.ops import HAS_CUSTOM_OPS, stage_embeddings_op, stage_token_inputs_op

from expected import expected_slab  # noqa: I001 - tests/expected.py

W, V = 16, 50


def _expected(ids, table, pad_to):
    return expected_slab(torch.zeros(pad_to, W, dtype=table.dtype), ids, table, None, None, pad_to=pad_to)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_of_one_slab_each_get_their_rows(path, dtype):
    """Views ``base[k:k + n]`` of one slab, new each call (odd starts and lengths): each gets exactly its rows
    and padding, nothing outside it is touched, and one stager serves them all."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(V, W, generator=g).to(dtype)
    base = torch.full((64, W), float("nan"), dtype=dtype)
    errors = new_error_word(torch.device("cpu"))
    for k, n in [(0, 5), (3, 7), (3, 11), (17, 1), (40, 0), (9, 13)]:
        base.fill_(float("nan"))
        ids = torch.randint(0, V, (n,), generator=g)
        stage_embeddings(base[k:k + n + 2], ids, table, pad_to=n + 1, errors=errors)
        assert torch.equal(base[k:k + n + 1], _expected(ids, table, n + 1)), (k, n)
        outside = torch.cat([base[:k], base[k + n + 1:]])
        assert outside.isnan().all(), (k, n)
    assert op_stagers.cached_stagers() == 1 and int(errors[0]) == 0  # (no error code)


def test_a_view_that_overlaps_the_error_word_is_refused(path):
    """The error word carved from the slab's storage past the rows first staged: a later, longer view that
    reaches it is refused (naming both), and nothing is written."""
    base = torch.randn(40, W)
    errors = base.view(-1)[30 * W:].view(torch.int32)[:16]
    errors.zero_()
    table = torch.randn(V, W)
    ids = torch.randint(0, V, (4,))
    stage_embeddings(base[:10], ids, table, errors=errors)
    before = base.clone()
    with pytest.raises(ValueError, match="the error word"):
        stage_embeddings(base[:35], ids, table, pad_to=35, errors=errors)
    assert torch.equal(base.view(torch.int32), before.view(torch.int32))


def test_a_view_with_gaps_between_rows_is_refused(path):
    base, table = torch.randn(40, W), torch.randn(V, W)
    errors = new_error_word(torch.device("cpu"))
    stage_embeddings(base[:10], torch.randint(0, V, (4,)), table, errors=errors)
    before = base.clone()
    with pytest.raises(ValueError, match="slab rows must be contiguous"):
        stage_embeddings(base[::2], torch.randint(0, V, (4,)), table, errors=errors)
    assert torch.equal(base, before)


def test_a_new_error_word_is_checked(path):
    """The same slab with another error word (a wrong one): refused as a first call would refuse it."""
    base, table = torch.randn(40, W), torch.randn(V, W)
    stage_embeddings(base[:10], torch.randint(0, V, (4,)), table, errors=new_error_word(torch.device("cpu")))
    with pytest.raises(ValueError, match="errors must be"):
        stage_embeddings(base[:12], torch.randint(0, V, (4,)), table, errors=torch.zeros(4, dtype=torch.int64))


def test_views_made_under_inference_mode_share_their_slab_stager(path):
    """Under inference mode a view has no ``_base``: its slab's storage keys the stager all the same, and the
    stager goes when the slab does."""
    with torch.inference_mode():
        base, table = torch.randn(64, W), torch.randn(V, W)
        errors = new_error_word(torch.device("cpu"))
        for n in range(1, 30):
            ids = torch.randint(0, V, (n,))
            stage_embeddings(base[:n], ids, table, errors=errors)
            assert torch.equal(base[:n], table[ids])
        assert op_stagers.cached_stagers() == 1
        del base
    gc.collect()
    assert op_stagers.cached_stagers() == 0


def _buffers():
    return StagingBuffers.allocate(max_num_tokens=24, max_batch_size=4, embed_width=W, embed_dtype=torch.float32,
                                   device="cpu")


@pytest.mark.skipif(not HAS_CUSTOM_OPS, reason="needs torch.library.custom_op")
def test_custom_op_wrappers_bump_what_they_write(path):
    """The wrappers' calls bump the version counters of the slab, the slots and the error word, as the op's
    own dispatch does; under inference mode (no counters) they stage all the same."""
    slab, table = torch.zeros(8, W), torch.randn(V, W)
    errors = new_error_word(torch.device("cpu"))
    ids = torch.randint(0, V, (5,))
    v_slab, v_err = slab._version, errors._version
    stage_embeddings_op(slab, ids, table, errors=errors)
    assert slab._version > v_slab and errors._version > v_err and torch.equal(slab[:5], table[ids])
    buf = _buffers()
    v_ids, v_word = buf.input_ids._version, buf.errors._version
    stage_token_inputs_op(buf, input_ids=ids, positions=torch.arange(5), pad_to=6)
    assert buf.input_ids._version > v_ids and buf.errors._version > v_word
    assert torch.equal(buf.input_ids[:5], ids)
    with torch.inference_mode():
        ids2 = torch.randint(0, V, (7,))
        stage_embeddings_op(slab, ids2, table, errors=errors)
        stage_token_inputs_op(buf, input_ids=ids2, positions=torch.arange(7), pad_to=7)
    assert torch.equal(slab[:7], table[ids2]) and torch.equal(buf.input_ids[:7], ids2)
    v_slab, v_err = slab._version, errors._version
    with pytest.raises(ValueError, match="pad_to"):  # a call the op refuses writes nothing and bumps nothing
        stage_embeddings_op(slab, ids, table, errors=errors, pad_to=4)
    assert slab._version == v_slab and errors._version == v_err


@pytest.mark.skipif(not HAS_CUSTOM_OPS, reason="needs torch.library.custom_op")
def test_custom_op_destinations_checked_again_when_a_slot_changes(path):
    """A slot tensor resized in place (the same object, fewer entries): the op checks the set again and
    refuses a batch past the new capacity that it took before, writing nothing."""
    buf = _buffers()
    ids = torch.randint(0, V, (14,))
    stage_token_inputs_op(buf, input_ids=ids, positions=torch.arange(14), pad_to=16)
    assert torch.equal(buf.input_ids[:14], ids)
    buf.registry.slot("positions").tensor.resize_(12)
    before = buf.input_ids.clone()
    with pytest.raises(ValueError, match="capacity of 12"):
        stage_token_inputs_op(buf, input_ids=ids + 1, positions=torch.arange(14), pad_to=16)
    assert torch.equal(buf.input_ids, before)
    stage_token_inputs_op(buf, input_ids=ids[:9], positions=torch.arange(9), pad_to=12)
    assert torch.equal(buf.input_ids[:9], ids[:9]) and torch.equal(buf.positions[:9], torch.arange(9))


def test_new_tensor_objects_over_the_same_slots_find_the_same_stager(path):
    """An engine that hands the token op new tensor objects over its buffers' memory each step (views made
    again, tensors re-wrapped) gets the one stager of that memory, not a new ring and device record a call."""
    buf = _buffers()
    slots = [buf.registry[s.name] if s.name in buf.registry else None for s in SLOTS]
    fills = tuple(None for _ in SLOTS)
    first = op_stagers.slots_destinations(slots, fills, buf.errors)[1]
    for _ in range(5):
        fresh = [None if t is None else t.view(t.shape) for t in slots]  # new objects, the same memory
        assert op_stagers.slots_destinations(fresh, fills, buf.errors)[1] is first
    assert op_stagers.cached_stagers() == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inference_mode_views_one_stager_then_freed():
    """On the GPU, under inference mode: 50 views ``base[:n]`` of one slab each get exactly their rows through
    one stager (checked from their address), and the stager is freed with the slab."""
    op_stagers.clear()
    gc.collect()
    live0 = stager_module.live_stagers()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        base = torch.full((80, W), float("nan"), dtype=torch.bfloat16, device=dev)
        table = torch.randn(V, W, generator=g).to(dev, torch.bfloat16)
        errors = new_error_word(dev)
        for n in range(1, 51):
            ids = torch.randint(0, V, (n,), generator=g).to(dev)
            stage_embeddings(base[:n + 3], ids, table, pad_to=n + 1, errors=errors)
            torch.cuda.synchronize()
            assert torch.equal(base[:n + 1].cpu(), _expected(ids.cpu(), table.cpu(), n + 1)), n
            assert base[n + 1:].isnan().all(), n
        assert op_stagers.cached_stagers() == 1 and int(errors[0]) == 0
        del base
    gc.collect()
    torch.cuda.synchronize()
    assert op_stagers.cached_stagers() == 0 and stager_module.live_stagers() == live0
