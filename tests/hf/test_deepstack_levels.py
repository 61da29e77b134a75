"""The DeepStack level count is the one HF applies, for repeated indexes and indexes past the vision tower.
Tiny random configs (slabstage.hf.tiny), nothing downloaded.
"""

import pytest
import torch

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf.tiny import tiny_model, tiny_prompt  # noqa: E402

from hf_prompts import _assert_matches_hf  # noqa: E402, I001


@pytest.mark.parametrize("family, indexes, depth, layers, levels", [
    ("qwen3_vl", (1, 3, 9), 5, 3, 2),  # 9 is past the tower: two features
    ("qwen3_vl", (1, 1), 2, 2, 1),  # a repeated index emits once
    ("qwen3_vl", (0, 0), 2, 2, 1),
    ("qwen3_vl", (3, 1), 4, 2, 2),  # features come in block order: block 1's first
    ("qwen3_vl_moe", (1, 1, 5), 3, 2, 1),
])
def test_deepstack_levels_are_those_hf_applies(family, indexes, depth, layers, levels):
    model = tiny_model(family, deepstack_indexes=indexes, vision_depth=depth, layers=layers)
    assert sshf.input_embeds_width(model) == 32 * (1 + levels)
    g = torch.Generator().manual_seed(1)
    requests, media = [], []
    for grids in ([(1, 4, 6)], [(1, 4, 4), (1, 6, 4)]):
        ids, pv, grid = tiny_prompt(model, grids, generator=g)
        items = sshf.media_items(model, pixel_values=pv, image_grid_thw=grid)
        assert all(len(item) == 1 + levels for item in items)
        requests.append(sshf.Request(ids, items, image_grid_thw=grid))
        media.append(dict(pixel_values=pv, image_grid_thw=grid))
    _assert_matches_hf(model, requests, media)
