"""MropeLayout values past what the positions' slot holds are refused up front on every path, naming the field
(or the request and its offset), before anything is written: past int64 (a start, a grid, an interval, an
offset that would wrap positions negative), a float interval past float32, and positions past an int32 slot."""

import pytest
import torch

import slabstage as ss
from slabstage import MropeLayout
from slabstage.staging.mrope import mrope_segments
from slabstage.staging.reference import mrope_from_segments

T, V = 40, 50
BIG = 2**63


def buffers(device, mrope_dtype=torch.int64):
    buf = ss.StagingBuffers.allocate(max_num_tokens=T, max_batch_size=4, embed_width=8, embed_dtype=torch.float32,
                                     device=device, mrope=True)
    if mrope_dtype != torch.int64:
        buf.registry.replace("mrope_positions", torch.zeros(3, T, dtype=mrope_dtype, device=device))
    for name in buf.registry:
        buf.registry[name].fill_(-7 if not buf.registry[name].dtype.is_floating_point else float("nan"))
    return buf


def snapshot(buf):
    return {name: buf.registry[name].clone() for name in buf.registry} | {"errors": buf.errors.clone()}


def stage(buf, layouts, n, device):
    g = torch.Generator().manual_seed(n)
    ss.stage_token_inputs(buf, input_ids=torch.randint(0, V, (n,), generator=g).to(device),
                          positions=torch.arange(n, device=device), mrope_positions=layouts, pad_to=n + 3)


def refused(buf, layouts, n, device, match):
    before = snapshot(buf)
    with pytest.raises(ValueError, match=match):
        stage(buf, layouts, n, device)
    for name, t in before.items():
        now = buf.errors if name == "errors" else buf.registry[name]
        assert torch.equal(now.nan_to_num(7.0), t.nan_to_num(7.0)), f"{name} was written"


PAST_INT64 = [
    ("start", MropeLayout(6, starts=[BIG], grids=[(1, 2, 2)], merge=2), r"starts\[0\]"),
    ("grid area", MropeLayout(6, starts=[1], grids=[(1, 2**32, 2**32)]), r"grids\[0\]"),
    ("grid frames", MropeLayout(6, starts=[1], grids=[(BIG, 2, 2)], merge=2), r"grids\[0\]"),
    ("grid height", MropeLayout(6, starts=[1], grids=[(1, 2 * BIG, 2)], merge=2), r"grids\[0\]"),
    ("int interval", MropeLayout(6, starts=[1], grids=[(3, 2, 2)], merge=2, intervals=[BIG]), r"intervals\[0\]"),
    ("int interval product", MropeLayout(6, starts=[0], grids=[(3, 2, 2)], merge=2, intervals=[2**62]),
     r"positions reach"),
    ("float interval past float32", MropeLayout(6, starts=[1], grids=[(3, 2, 2)], merge=2, intervals=[1e39]),
     r"intervals\[0\]"),
    ("float32 interval product", MropeLayout(6, starts=[0], grids=[(3, 2, 2)], merge=2,
                                              intervals=torch.tensor([3e38])), r"positions reach"),
    ("offset", MropeLayout(6, offset=BIG - 3), r"positions reach .*offset=9223372036854775805"),
    ("offset past int64", MropeLayout(6, offset=BIG), r"offset"),
    ("tokens", MropeLayout(BIG), r"tokens"),
]


@pytest.mark.parametrize("what, layout, match", PAST_INT64, ids=[c[0] for c in PAST_INT64])
def test_layout_values_past_int64_are_refused_before_anything_is_written(what, layout, match, device, stage_path):
    refused(buffers(device), [MropeLayout(4), layout], 10, device, match)


INT32_PAST = [
    ("offset", MropeLayout(6, offset=2**31 - 4)),
    ("start", MropeLayout(6, starts=[2**31], grids=[(1, 2, 2)], merge=2, offset=2**31 - 2)),
    ("interval", MropeLayout(6, starts=[0], grids=[(3, 2, 2)], merge=2, intervals=[2**30])),
    ("negative interval", MropeLayout(6, starts=[0], grids=[(3, 2, 2)], merge=2, intervals=[-2**31])),
]


@pytest.mark.parametrize("what, layout", INT32_PAST, ids=[c[0] for c in INT32_PAST])
def test_positions_past_an_int32_slot_are_refused_on_every_path(what, layout, device, stage_path):
    refused(buffers(device, torch.int32), [layout, MropeLayout(4)], 10, device,
            r"mrope_positions\[0\]: its positions reach .*torch.int32 mrope_positions slot")


def test_positions_an_int32_slot_holds_are_staged_on_every_path(device, stage_path):
    layouts = [MropeLayout(6, offset=2**31 - 7), MropeLayout(4, starts=[0], grids=[(2, 2, 2)], merge=2,
                                                             intervals=[2**30 - 1])]
    want = mrope_from_segments(mrope_segments(layouts, 10), 10)
    assert want.max() == 2**31 - 2
    for dtype in (torch.int32, torch.int64):
        buf = buffers(device, dtype)
        stage(buf, layouts, 10, device)
        got = buf.registry["mrope_positions"]
        assert torch.equal(got[:, :10].cpu().long(), want)
        assert int(buf.errors[0]) == 0


def test_an_item_past_int64_that_the_chunk_does_not_reach_is_not_refused(device, stage_path):
    # the chunk ends before the item; its later frames' positions are never staged
    layouts = [MropeLayout(5, starts=[20], grids=[(1, 2, 2)], merge=2)]
    buf = buffers(device)
    stage(buf, layouts, 5, device)
    assert torch.equal(buf.registry["mrope_positions"][:, :5].cpu(), torch.arange(5).expand(3, 5))
