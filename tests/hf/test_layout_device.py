"""Layout positions are built on an explicit device (the host), not on torch's default device: under
``torch.set_default_device`` (``"cuda"`` on a GPU machine; ``"meta"`` here, which fails loudly where a tensor
lands on it), pack_requests with a request that gives its own mrope positions beside layout requests packs
what it packs under the default default device, and staging it gives the same rows on every path."""

import pytest
import torch

import slabstage as ss

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf.tiny import tiny_model, tiny_prompt  # noqa: E402
from slabstage.staging.mrope import mrope_segments
from slabstage.staging.reference import mrope_from_segments  # noqa: E402


def _requests(model):
    g = torch.Generator().manual_seed(12)
    reqs = []
    for grids in ([(1, 4, 6)], [(1, 2, 4), (1, 4, 4)]):
        ids, pv, grid = tiny_prompt(model, grids, generator=g)
        reqs.append(sshf.Request(ids, sshf.media_items(model, pixel_values=pv, image_grid_thw=grid),
                                 image_grid_thw=grid))
    own = sshf.mrope_positions(model, reqs[0].input_ids, reqs[0].image_grid_thw)
    reqs.append(sshf.Request(reqs[0].input_ids, reqs[0].media, image_grid_thw=reqs[0].image_grid_thw,
                             mrope_positions=own))
    return reqs


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_pack_requests_ignores_the_default_device(family, device, stage_path):
    model = tiny_model(family)
    reqs = _requests(model)
    want = sshf.pack_requests(model, reqs)
    layouts_only = sshf.pack_requests(model, reqs[:2])
    assert isinstance(want.mrope_positions, torch.Tensor) and want.mrope_positions.device.type == "cpu"
    torch.set_default_device("cuda" if device.type == "cuda" else "meta")
    try:
        got = sshf.pack_requests(model, reqs)
        got_layouts = sshf.pack_requests(model, reqs[:2])
        n = got_layouts.input_ids.shape[0]
        positions = mrope_from_segments(mrope_segments(got_layouts.mrope_positions, n), n)
    finally:
        torch.set_default_device(None)
    assert got.mrope_positions.device.type == "cpu" and torch.equal(got.mrope_positions, want.mrope_positions)
    assert positions.device.type == "cpu" and torch.equal(positions, want.mrope_positions[:, :n])
    assert got_layouts.mrope_positions == layouts_only.mrope_positions
    buf = ss.StagingBuffers.allocate(max_num_tokens=64, max_batch_size=4, embed_width=8, embed_dtype=torch.float32,
                                     device=device, mrope=True)
    buf.registry["mrope_positions"].fill_(-1)
    ss.stage_token_inputs(buf, input_ids=got_layouts.input_ids, positions=got_layouts.positions,
                          mrope_positions=got_layouts.mrope_positions, pad_to=n)
    assert torch.equal(buf.registry["mrope_positions"][:, :n].cpu(), want.mrope_positions[:, :n])
