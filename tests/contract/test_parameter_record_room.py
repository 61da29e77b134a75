"""The parameter record has room for so many media items and mrope segments (``MAX_ITEM_WORDS``): a batch past
it is refused with the same ``ValueError`` on every path (the reference has no block but answers as the kernel
does), before anything is written."""

import pytest
import torch

import slabstage as ss
from slabstage import MropeLayout
from slabstage.kernels.layout import MAX_ITEM_WORDS

W, V = 8, 30
ITEM_WORDS = 1 + 4  # an item of one column block


def test_the_room_has_one_name():
    from slabstage.staging import stager, validate
    assert validate.MAX_ITEM_WORDS is MAX_ITEM_WORDS and stager.MAX_ITEM_WORDS is MAX_ITEM_WORDS


def _media_batch(items: int, device):
    g = torch.Generator().manual_seed(items)
    media = [torch.randn(1, W, generator=g).to(device) for _ in range(items)]
    n = items + 3
    index = torch.full((n,), -1, dtype=torch.int64)
    index[3:] = torch.arange(items)
    return media, index.to(device), torch.randint(0, V, (n,), generator=g).to(device), n


@pytest.mark.parametrize("items", [MAX_ITEM_WORDS // ITEM_WORDS + 1, 4200])
def test_media_items_past_the_room_are_refused_on_every_path(items, device, stage_path):
    media, index, ids, n = _media_batch(items, device)
    table = torch.randn(V, W, device=device)
    slab = torch.full((n + 2, W), float("nan"), device=device)
    with pytest.raises(ValueError, match=f"media has {items} items .* at most {MAX_ITEM_WORDS} fit the parameter"):
        ss.stage_embeddings(slab, ids, table, media=media, media_index=index)
    assert torch.isnan(slab).all()


def _layouts(segments_wanted: int):
    """One request of text, item, text, ...: two segments an item."""
    items = segments_wanted // 2 + 1
    return MropeLayout(2 * items, starts=list(range(1, 2 * items, 2)), grids=[(1, 1, 1)] * items), 2 * items


@pytest.mark.parametrize("segments", [MAX_ITEM_WORDS // 8 + 1, 4200])
def test_mrope_segments_past_the_room_are_refused_on_every_path(segments, device, stage_path):
    layout, n = _layouts(segments)
    buf = ss.StagingBuffers.allocate(max_num_tokens=n + 4, max_batch_size=2, embed_width=W,
                                     embed_dtype=torch.float32, device=device, mrope=True)
    for name in buf.registry:
        buf.registry[name].fill_(float("nan") if buf.registry[name].dtype.is_floating_point else -5)
    before = {name: buf.registry[name].clone() for name in buf.registry}
    errors = buf.errors.clone()
    with pytest.raises(ValueError, match=f"the mrope layouts make .* segments: .* at most {MAX_ITEM_WORDS} fit"):
        ss.stage_token_inputs(buf, input_ids=torch.randint(0, V, (n,), device=device),
                              positions=torch.arange(n, device=device), mrope_positions=[layout], pad_to=n)
    for name, t in before.items():
        assert torch.equal(buf.registry[name].nan_to_num(7.0), t.nan_to_num(7.0)), f"{name} was written"
    assert torch.equal(buf.errors, errors)
