"""A chunk carries only the media items it reads (docs/hf.md): with a prompt of image A, a video and image B
(items: the images, then the video), a chunk from inside A to inside the video reads A and the video, not B;
its staged rows are the whole prompt's rows, on every path."""

import pytest
import torch

import slabstage as ss

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf.tiny import IMAGE, PATCH, TEMPORAL, VIDEO, VISION_END, VISION_START, tiny_model  # noqa: E402


def _prompt(family, g):
    """text, image A (6 rows), text, a video (2, 4, 4) (8 rows; Qwen3-VL: two frame runs), text, image B (4 rows),
    text: ``(ids, items, grids)``."""
    def text(k):
        return torch.randint(0, VISION_START - 8, (k,), generator=g)

    def block(token, rows):
        return [torch.tensor([VISION_START]), torch.full((rows,), token), torch.tensor([VISION_END])]

    video = (block(VIDEO, 4) + [text(2)] + block(VIDEO, 4)) if family == "qwen3_vl" else block(VIDEO, 8)
    ids = torch.cat([text(3), *block(IMAGE, 6), text(2), *video, text(3), *block(IMAGE, 4), text(2)])
    igrid, vgrid = torch.tensor([[1, 4, 6], [1, 4, 4]]), torch.tensor([[2, 4, 4]])
    model = tiny_model(family)

    def pixels(grid):
        return torch.randn(int(grid.prod(-1).sum()), 3 * TEMPORAL * PATCH * PATCH, generator=g)
    items = (list(sshf.media_items(model, pixel_values=pixels(igrid), image_grid_thw=igrid))
             + list(sshf.media_items(model, pixel_values_videos=pixels(vgrid), video_grid_thw=vgrid)))
    return model, ids, items, dict(image_grid_thw=igrid, video_grid_thw=vgrid)


def _stage(model, batch, n):
    slab = torch.full((n + 2, sshf.input_embeds_width(model)), float("nan"))
    return ss.stage_embeddings(slab, batch.input_ids, batch.table, media=batch.media, media_index=batch.media_index,
                               expand=batch.expand, pad_to=n)[:n]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("chunk, read", [((6, 16), (0, 2)), ((15, 24), (2,)), ((6, 33), (0, 1, 2)), ((0, 3), ()),
                                         ((21, 34), (1, 2))],
                         ids=["A-to-video", "video", "A-to-B", "text", "video-to-B"])
def test_a_chunk_carries_only_the_items_it_reads(family, chunk, read, stage_path):
    g = torch.Generator().manual_seed(11)
    model, ids, items, grids = _prompt(family, g)
    whole = sshf.pack_requests(model, [sshf.Request(ids, items, **grids)])
    part = sshf.pack_requests(model, [sshf.Request(ids[:4].clone()), sshf.Request(ids, items, chunk=chunk, **grids)])
    taken = part.media or []
    assert len(taken) == len(read) and all(a is items[k] for a, k in zip(taken, read))
    want = _stage(model, whole, ids.shape[0])[chunk[0]:chunk[1]]
    got = _stage(model, part, part.input_ids.shape[0])[4:]
    assert torch.equal(got, want)
    if part.media_index is not None:
        index = part.media_index[4:]
        assert torch.equal(index < 0, whole.media_index[chunk[0]:chunk[1]] < 0)
