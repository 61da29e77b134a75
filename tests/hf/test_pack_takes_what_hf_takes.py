"""pack_requests takes what Hugging Face takes, with HF's answer, or refuses it at once naming it:
``second_per_grid_ts`` as a float32, float16 or bfloat16 tensor, a list of 0-d tensors, a numpy array, or
Python floats (the mrope positions those of the model's own ``get_rope_index``, staged the same on every
path); a Qwen3-VL item given as a list of column blocks (taken as the tuple of them)."""

import numpy as np
import pytest
import torch

import slabstage as ss

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf.tiny import IMAGE, PATCH, TEMPORAL, VIDEO, VISION_END, VISION_START, tiny_model  # noqa: E402
from slabstage.staging.mrope import MropeLayout, mrope_segments
from slabstage.staging.reference import mrope_from_segments  # noqa: E402

VGRID = [(6, 4, 4), (3, 2, 4)]  # 24 and 6 placeholder rows
IGRID = [(1, 4, 6)]  # 6 rows


@pytest.fixture(scope="module")
def qwen25():
    return tiny_model("qwen2_5_vl")


def _prompt(g):
    def text(k):
        return torch.randint(0, VISION_START - 8, (k,), generator=g)

    def block(token, rows):
        return torch.cat([torch.tensor([VISION_START]), torch.full((rows,), token), torch.tensor([VISION_END])])

    ids = torch.cat([text(3), block(VIDEO, 24), text(2), block(IMAGE, 6), text(4), block(VIDEO, 6), text(3)])
    vgrid, igrid = torch.tensor(VGRID), torch.tensor(IGRID)
    return ids, igrid, vgrid


def _items(model, igrid, vgrid, g):
    def pixels(grid):
        return torch.randn(int(grid.prod(-1).sum()), 3 * TEMPORAL * PATCH * PATCH, generator=g)
    return (list(sshf.media_items(model, pixel_values=pixels(igrid), image_grid_thw=igrid))
            + list(sshf.media_items(model, pixel_values_videos=pixels(vgrid), video_grid_thw=vgrid)))


def _positions(batch):
    m = batch.mrope_positions
    if isinstance(m, torch.Tensor):
        return m
    layouts = [m] if isinstance(m, MropeLayout) else m
    n = batch.input_ids.shape[0]
    return mrope_from_segments(mrope_segments(layouts, n), n)


SECONDS = {
    "float32 tensor": lambda: torch.tensor([37.3, 1.9]),
    "bfloat16 tensor": lambda: torch.tensor([37.3, 1.9]).to(torch.bfloat16),
    "float16 tensor": lambda: torch.tensor([37.3, 1.9], dtype=torch.float16),
    "float64 tensor": lambda: torch.tensor([37.3, 1.9], dtype=torch.float64),
    "list of bfloat16 0-d tensors": lambda: list(torch.tensor([37.3, 1.9]).to(torch.bfloat16)),
    "numpy float32": lambda: np.array([37.3, 1.9], dtype=np.float32),
    "numpy float64": lambda: np.array([37.3, 1.9]),
    "list of floats": lambda: [37.3, 1.9],
}


@pytest.mark.parametrize("kind", SECONDS)
@pytest.mark.parametrize("chunk", [None, (5, 40)], ids=["whole", "chunk"])
def test_second_per_grid_ts_as_hf_takes_it(qwen25, kind, chunk, stage_path):
    g = torch.Generator().manual_seed(7)
    ids, igrid, vgrid = _prompt(g)
    seconds = SECONDS[kind]()
    hf = sshf.mrope_positions(qwen25, ids, igrid, vgrid, seconds)  # the model's own get_rope_index
    start, end = chunk or (0, ids.shape[0])
    layout_req = sshf.Request(ids, _items(qwen25, igrid, vgrid, g), image_grid_thw=igrid, video_grid_thw=vgrid,
                              second_per_grid_ts=seconds, chunk=chunk)
    text = sshf.Request(torch.randint(0, VISION_START - 8, (5,), generator=g))
    batch = sshf.pack_requests(qwen25, [text, layout_req])
    want = torch.cat([torch.arange(5).expand(3, 5), hf[:, start:end]], 1)
    assert torch.equal(_positions(batch), want)
    n = batch.input_ids.shape[0]
    buf = ss.StagingBuffers.allocate(max_num_tokens=n + 3, max_batch_size=2, embed_width=8,
                                     embed_dtype=torch.float32, device="cpu", mrope=True)
    buf.registry["mrope_positions"].fill_(-9)
    ss.stage_token_inputs(buf, input_ids=batch.input_ids, positions=batch.positions,
                          mrope_positions=batch.mrope_positions, pad_to=n)
    assert torch.equal(buf.registry["mrope_positions"][:, :n], want)


def test_second_per_grid_ts_of_another_kind_is_refused_at_once(qwen25):
    g = torch.Generator().manual_seed(8)
    ids, igrid, vgrid = _prompt(g)
    items = _items(qwen25, igrid, vgrid, g)
    with pytest.raises(TypeError, match="second_per_grid_ts"):
        sshf.pack_requests(qwen25, [sshf.Request(ids, items, image_grid_thw=igrid, video_grid_thw=vgrid,
                                                 second_per_grid_ts=3.0)])


def test_a_qwen3_vl_item_as_a_list_of_blocks_is_its_tuple(stage_path):
    model = tiny_model("qwen3_vl")
    g = torch.Generator().manual_seed(9)
    ids = torch.cat([torch.randint(0, VISION_START - 8, (4,), generator=g), torch.tensor([VISION_START]),
                     torch.full((6,), IMAGE), torch.tensor([VISION_END]),
                     torch.randint(0, VISION_START - 8, (3,), generator=g)])
    igrid = torch.tensor(IGRID)
    pv = torch.randn(int(igrid.prod(-1).sum()), 3 * TEMPORAL * PATCH * PATCH, generator=g)
    items = sshf.media_items(model, pixel_values=pv, image_grid_thw=igrid)
    assert isinstance(items[0], tuple) and len(items[0]) > 1  # DeepStack: column blocks
    as_tuple = sshf.pack_requests(model, [sshf.Request(ids, items, image_grid_thw=igrid)])
    as_list = sshf.pack_requests(model, [sshf.Request(ids, [list(items[0])], image_grid_thw=igrid)])
    assert isinstance(as_list.media[0], tuple)
    assert all(a is b for a, b in zip(as_list.media[0], as_tuple.media[0]))
    buffers = ss.StagingBuffers.allocate(max_num_tokens=32, max_batch_size=2,
                                         embed_width=sshf.input_embeds_width(model), embed_dtype=torch.float32,
                                         device="cpu", mrope=True)
    runner = ss.PrefillGraphRunner(sshf.prefill_forward(model), buffers, progress=False).capture()
    with torch.no_grad():
        a = runner.run(as_tuple, clone=True)
        b = runner.run(as_list, clone=True)
    assert torch.equal(a, b)
