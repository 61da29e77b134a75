"""Edge cases of the staging kernels and the ops around them: every destination slot checked, overlapping
storage refused, non-finite scales refused and padding +0.0 whatever the scale, arguments checked before any
write, no silent narrowing into int32 slots, no autograd history on the reference path, the custom op's
errors, staging from several threads and bf16 subnormals. (Staging state, widths and spans:
tests/contract/test_staging_edge_cases.py.)
"""

import threading

import pytest
import torch

import slabstage as ss
from slabstage.kernels.reference import stage_embeddings_reference

V, W, T = 40, 24, 64


def _buffers(device="cpu", **kw):
    return ss.StagingBuffers.allocate(max_num_tokens=T, max_batch_size=4, embed_width=W,
                                      embed_dtype=torch.float32, device=device, **kw)


def _snapshot(buf):
    return {k: buf.registry[k].clone() for k in buf.registry}


def _unchanged(buf, snap):
    for k, v in snap.items():
        assert torch.equal(buf.registry[k].nan_to_num(1.5), v.nan_to_num(1.5)), k


def _inputs(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n,), generator=g), torch.randn(V, W, generator=g)


# -- every destination slot is checked ----------------------------------------------------------------
def test_empty_token_count_slot_is_refused():
    buf = _buffers()
    buf.registry.replace("num_tokens_non_padded", buf.num_tokens_non_padded[:0])
    ids, _ = _inputs()
    snap = _snapshot(buf)
    with pytest.raises(ValueError, match="num_tokens_non_padded"):
        ss.stage_token_inputs(buf, input_ids=ids, positions=torch.arange(10), pad_to=12)
    _unchanged(buf, snap)


def test_slot_of_another_dtype_or_device_is_refused():
    buf = _buffers()
    buf.registry.replace("seq_lens", torch.zeros(4, dtype=torch.float32))
    ids, _ = _inputs()
    with pytest.raises(TypeError, match="seq_lens"):
        ss.stage_token_inputs(buf, input_ids=ids, positions=torch.arange(10), pad_to=12)


# -- overlapping storage ---------------------------------------------------------------------------------
def test_table_overlapping_the_slab_is_refused():
    slab = torch.randn(T, W)
    ids = torch.randperm(T)[:20]
    before = slab.clone()
    with pytest.raises(ValueError, match="overlaps"):
        ss.stage_embeddings(slab, ids, slab, pad_to=20)
    assert torch.equal(slab, before)


def test_media_overlapping_the_slab_is_refused():
    slab = torch.randn(T, W)
    ids, table = _inputs()
    index = torch.tensor([0, 1, 2, 3] + [-1] * 6)
    before = slab.clone()
    with pytest.raises(ValueError, match="overlaps"):
        ss.stage_embeddings(slab, ids, table, media=slab[2:6], media_index=index, pad_to=12)
    assert torch.equal(slab, before)


# -- text_scale ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale_is_refused(scale):
    ids, table = _inputs()
    slab = torch.randn(T, W)
    with pytest.raises(ValueError, match="text_scale"):
        ss.stage_embeddings(slab, ids, table, text_scale=scale, pad_to=12)


def test_padding_and_bad_rows_are_plus_zero_whatever_the_scale():
    ids, table = _inputs()
    ids[3] = V + 5  # a bad id: the row is zero-filled
    slab = torch.full((T, W), float("nan"))
    errors = ss.new_error_word("cpu")
    ss.stage_embeddings(slab, ids, table, text_scale=-2.0, pad_to=16, errors=errors)
    zero_rows = torch.cat([slab[3:4], slab[10:16]])
    assert torch.equal(zero_rows.view(torch.int32), torch.zeros_like(zero_rows).view(torch.int32))  # +0.0 bits
    good = torch.tensor([r for r in range(10) if r != 3])
    assert torch.equal(slab[good], table[ids[good]] * -2.0)


# -- nothing written before an error; no OverflowError -----------------------------------------------------
@pytest.mark.parametrize("bad", [dict(vocab_size=2**64), dict(text_scale=10**400), dict(vocab_range=(0, 2**70))])
def test_out_of_range_arguments_are_refused_before_any_write(bad):
    buf = _buffers()
    ids, table = _inputs()
    batch = ss.PrefillBatch(input_ids=ids, positions=torch.arange(10), table=table, **bad)
    runner = ss.PrefillGraphRunner(lambda views: views["input_embeds"], buf, progress=False)
    snap = _snapshot(buf)
    with pytest.raises((TypeError, ValueError)) as info:
        runner.run(batch)
    assert not isinstance(info.value, OverflowError)
    assert any(word in str(info.value) for word in ("vocab", "text_scale"))
    _unchanged(buf, snap)


# -- no silent truncation into int32 slots --------------------------------------------------------------
@pytest.mark.parametrize("slot, value", [("out_cache_loc", 2**32 + 5), ("seq_lens", 2**31)])
def test_host_values_that_do_not_fit_are_refused(slot, value):
    buf = _buffers(cache_loc_dtype=torch.int32)
    ids, _ = _inputs()
    kw = dict(input_ids=ids, positions=torch.arange(10), pad_to=12)
    if slot == "out_cache_loc":
        kw["out_cache_loc"] = torch.full((10,), value, dtype=torch.int64)
    else:
        kw["seq_lens"] = torch.tensor([value, 5], dtype=torch.int64)
        kw["extend_start_loc"] = torch.tensor([0, 5], dtype=torch.int64)
    snap = _snapshot(buf)
    with pytest.raises(ValueError, match=slot):
        ss.stage_token_inputs(buf, **kw)
    _unchanged(buf, snap)


@pytest.mark.cuda
def test_device_values_that_do_not_fit_are_recorded():
    buf = _buffers("cuda", cache_loc_dtype=torch.int32)
    ids = torch.randint(0, V, (10,), device="cuda")
    loc = torch.full((10,), 2**32 + 5, dtype=torch.int64, device="cuda")
    ss.stage_token_inputs(buf, input_ids=ids, positions=torch.arange(10, device="cuda"), out_cache_loc=loc,
                          pad_to=12)
    with pytest.raises(ss.StagingError, match="does not fit"):
        ss.raise_if_errors(buf.errors)


# -- the reference path records no autograd history -------------------------------------------------------
def test_reference_path_records_no_history():
    ids, table = _inputs()
    table.requires_grad_(True)
    slab = torch.zeros(T, W)
    for _ in range(3):
        stage_embeddings_reference(slab, ids, table, pad_to=12, errors=ss.new_error_word("cpu"))
    assert not slab.requires_grad and slab.grad_fn is None


# -- clear errors from the custom op wrapper -----------------------------------------------------------------
def test_custom_op_with_a_list_names_the_argument():
    from slabstage.ops import HAS_CUSTOM_OPS, stage_embeddings_op

    if not HAS_CUSTOM_OPS:
        pytest.skip("needs torch.library.custom_op")
    _, table = _inputs()
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor"):
        stage_embeddings_op(torch.zeros(T, W), [1, 2, 3], table)


# -- interpreter limits ---------------------------------------------------------------------------------
def test_staging_from_several_threads():
    ids, table = _inputs(20)
    slabs = [torch.full((T, W), float("nan")) for _ in range(6)]
    failures = []

    def work(slab):
        try:
            ss.stage_embeddings(slab, ids, table, pad_to=24)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            failures.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in slabs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    for slab in slabs:
        assert torch.equal(slab[:20], table[ids]) and torch.equal(slab[20:24], torch.zeros(4, W))


def test_bf16_subnormals_are_staged_exactly():
    table = torch.tensor([[9.18e-41, -1e-40, 5e-39, 1.0]] * 4, dtype=torch.float32).to(torch.bfloat16)
    assert table[0, 0].item() != 0.0  # a bf16 subnormal
    slab = torch.full((8, 4), float("nan"))
    ss.stage_embeddings(slab, torch.tensor([0, 1, 2]), table, pad_to=4)
    assert torch.equal(slab[:3], table[:3].float())
