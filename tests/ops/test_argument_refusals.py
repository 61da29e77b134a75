"""Arguments refused with an error that names them, before any write: a table or media overlapping the slab,
a non-finite text_scale, values past what a slot holds (no OverflowError), a list where the custom op takes a
tensor.
"""

import pytest
import torch
import slabstage as ss

from builders import assert_registry_unchanged as _unchanged, ids_and_table, registry_snapshot as _snapshot  # noqa: I001
from builders import staging_buffers  # noqa: I001 - tests/builders.py

V, W, T = 40, 24, 64


def _buffers(device="cpu", **kw):
    return staging_buffers(T, W, device, **kw)


def _inputs(n=10, seed=0):
    return ids_and_table(V, W, n, seed)


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


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale_is_refused(scale):
    ids, table = _inputs()
    slab = torch.randn(T, W)
    with pytest.raises(ValueError, match="text_scale"):
        ss.stage_embeddings(slab, ids, table, text_scale=scale, pad_to=12)


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


def test_custom_op_with_a_list_names_the_argument():
    from slabstage.ops import HAS_CUSTOM_OPS, stage_embeddings_op

    if not HAS_CUSTOM_OPS:
        pytest.skip("needs torch.library.custom_op")
    _, table = _inputs()
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor"):
        stage_embeddings_op(torch.zeros(T, W), [1, 2, 3], table)
