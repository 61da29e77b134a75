"""Rope as slabstage.hf supports it: length-dependent (dynamic, longrope) rope is refused, fixed-frequency rope
matches HF, and mrope positions need no mm_token_type_ids from get_rope_index.
Tiny random configs (slabstage.hf.tiny), nothing downloaded.
"""

import inspect
import pytest
import torch

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf.tiny import tiny_model  # noqa: E402

from hf_prompts import _assert_matches_hf, _video_first_prompt  # noqa: E402, I001


DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.0, 2.0, 3.0, 4.0],
            "short_factor": [1.0] * 4, "original_max_position_embeddings": 64, "factor": 4.0}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("rope", [DYNAMIC, LONGROPE], ids=["dynamic", "longrope"])
def test_rope_that_depends_on_the_sequence_length_is_refused(family, rope):
    model = tiny_model(family, rope=rope)
    kind = rope["rope_type"]
    with pytest.raises(ValueError, match=f"prefill_forward: .* uses rope type '{kind}'.* not supported"):
        sshf.prefill_forward(model)
    with pytest.raises(ValueError, match=f"pack_requests: .* uses rope type '{kind}'"):
        sshf.pack_requests(model, [sshf.Request(torch.randint(0, 80, (9,)))])
    assert sshf.input_embeds_width(model) == 32  # the width does not depend on the rope


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                  {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 1024}], ids=["linear", "yarn"])
def test_fixed_frequency_rope_still_matches_hf(rope):
    model = tiny_model("llama", rope=rope)
    g = torch.Generator().manual_seed(0)
    requests = [sshf.Request(torch.randint(0, 80, (n,), generator=g)) for n in (7, 30)]
    _assert_matches_hf(model, requests, [{}, {}])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_get_rope_index_without_mm_token_type_ids(models, family, monkeypatch):
    """transformers 5.1's get_rope_index takes no mm_token_type_ids (it finds the placeholders from the ids)."""
    model = models(family)
    ids, hf, _, _, igrid, vgrid = _video_first_prompt(model, family, [(1, 4, 6)])
    want = sshf.mrope_positions(model, ids, igrid, vgrid)
    base, new = model.base_model, model.base_model.get_rope_index
    types = "mm_token_type_ids" in inspect.signature(new).parameters  # the installed version's own needs

    def old(input_ids=None, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None, attention_mask=None):
        kw = {} if second_per_grid_ts is None else dict(second_per_grid_ts=second_per_grid_ts)
        if types:
            kw["mm_token_type_ids"] = sshf.mm_token_type_ids(model, input_ids)
        return new(input_ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                   attention_mask=attention_mask, **kw)

    monkeypatch.setattr(base, "get_rope_index", old)
    assert torch.equal(sshf.mrope_positions(model, ids, igrid, vgrid), want)
