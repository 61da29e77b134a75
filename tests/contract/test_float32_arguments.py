"""``text_scale`` is an fp32 argument: a value float32 cannot hold (it would round to inf) is refused on every
path with the same ``ValueError`` naming it, before anything is written."""

import numpy as np
import pytest
import torch

import slabstage as ss
from slabstage.checks import check_float32
from slabstage.ops import HAS_CUSTOM_OPS, stage_embeddings_op

W, T, V = 24, 20, 37
PAST = [1e39, -1e39, 3.5e38, 10**40, np.float64(1e39)]


@pytest.mark.parametrize("scale", PAST, ids=repr)
def test_text_scale_past_float32_is_refused_on_every_path(scale, device, stage_path):
    g = torch.Generator().manual_seed(1)
    table = torch.randn(V, W, generator=g).to(device)
    ids = torch.randint(0, V, (11,), generator=g).to(device)
    slab = torch.full((T, W), float("nan"), device=device)
    with pytest.raises(ValueError, match="text_scale must be a finite number within float32's range"):
        ss.stage_embeddings(slab, ids, table, text_scale=scale)
    if HAS_CUSTOM_OPS:
        with pytest.raises(ValueError, match="text_scale must be a finite number within float32's range"):
            stage_embeddings_op(slab, ids, table, text_scale=scale)
    assert torch.isnan(slab).all()
    buf = ss.StagingBuffers.allocate(max_num_tokens=T, max_batch_size=2, embed_width=W, embed_dtype=torch.float32,
                                     device=device)
    buf.registry["input_embeds"].fill_(float("nan"))
    before = {name: buf.registry[name].clone() for name in buf.registry}
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"] * 1, buf, buckets=[16], progress=False).capture()
    with pytest.raises(ValueError, match="text_scale must be a finite number within float32's range"):
        runner.run(ss.PrefillBatch(input_ids=ids, positions=torch.arange(11, device=device), table=table,
                                   text_scale=scale))
    for name, t in before.items():
        assert torch.equal(buf.registry[name].nan_to_num(7.0), t.nan_to_num(7.0)), f"{name} was written"


@pytest.mark.parametrize("scale", [3.4028234e38, -3.4028234e38, 1e-45, 0.5], ids=repr)
def test_text_scale_float32_holds_is_staged_the_same_on_every_path(scale, device, stage_path):
    g = torch.Generator().manual_seed(2)
    table = torch.randn(V, W, generator=g).to(device)
    ids = torch.randint(0, V, (9,), generator=g).to(device)
    slab = torch.full((T, W), float("nan"), device=device)
    ss.stage_embeddings(slab, ids, table, text_scale=scale, pad_to=12)
    want = (table[ids].float() * torch.tensor(scale, dtype=torch.float32)).to(slab.dtype)
    assert torch.equal(slab[:9].nan_to_num(7.0), want.nan_to_num(7.0))
    assert (slab[9:12] == 0).all() and torch.isnan(slab[12:]).all()


def test_check_float32_names_the_argument():
    assert check_float32("x", 2) == 2.0
    with pytest.raises(ValueError, match="x must be a finite number within float32's range"):
        check_float32("x", 4e38)
    with pytest.raises(TypeError, match="x must be a real number"):
        check_float32("x", "1")
