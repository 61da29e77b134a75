"""Prompts and runs the slabstage.hf tests share: text and placeholder runs, pixel rows, a video-first prompt
with its HF keyword arguments and media items, the HF base model's hidden states, and a packed batch through
the runner compared with them."""

import pytest
import torch

import slabstage as ss

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf.tiny import IMAGE, PATCH, TEMPORAL, VIDEO, VISION_END, VISION_START  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)


def _text(n, g):
    return torch.randint(0, VISION_START - 8, (n,), generator=g)


def _placeholders(token, rows):
    return torch.cat([torch.tensor([VISION_START]), torch.full((rows,), token), torch.tensor([VISION_END])])


def _pixels(grid, g):
    return torch.randn(int(grid.prod(-1).sum()), 3 * TEMPORAL * PATCH * PATCH, generator=g)


def _video(family, t, rows_per_frame, g):
    """A video's placeholders: Qwen3-VL parts its frames by (text) timestamps, one run per frame."""
    if family.startswith("qwen3"):
        return torch.cat([torch.cat([_text(2, g), _placeholders(VIDEO, rows_per_frame)]) for _ in range(t)])
    return _placeholders(VIDEO, t * rows_per_frame)


def _video_first_prompt(model, family, image_grids, seed=0):
    """Text, a video of grid (2, 4, 4) (8 rows), text, then one image per grid row: ``(ids, hf kwargs, image
    items, video items)``, the items from media_items."""
    g = torch.Generator().manual_seed(seed)
    vgrid, igrid = torch.tensor([[2, 4, 4]]), torch.tensor(image_grids)
    parts = [_text(3, g), _video(family, 2, 4, g), _text(2, g)]
    for t, h, w in image_grids:
        parts += [_placeholders(IMAGE, t * h * w // 4), _text(2, g)]
    ids = torch.cat(parts)
    pv, pvv = _pixels(igrid, g), _pixels(vgrid, g)
    images = sshf.media_items(model, pixel_values=pv, image_grid_thw=igrid)
    videos = sshf.media_items(model, pixel_values_videos=pvv, video_grid_thw=vgrid)
    hf = dict(pixel_values=pv, image_grid_thw=igrid, pixel_values_videos=pvv, video_grid_thw=vgrid)
    return ids, hf, images, videos, igrid, vgrid


def _hf(model, ids, **media):
    """The HF base model's last hidden states for one prompt."""
    kw = dict(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], use_cache=False, **media)
    if media:
        kw["mm_token_type_ids"] = sshf.mm_token_type_ids(model, ids[None])
    with torch.no_grad():
        return model.base_model(**kw).last_hidden_state[0]


def _run(model, requests, capacity=256):
    """The packed requests through PrefillGraphRunner (eager on CPU): ``(batch, out)``."""
    buffers = ss.StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=4,
                                         embed_width=sshf.input_embeds_width(model), embed_dtype=torch.float32,
                                         device="cpu", mrope="vl" in model.config.model_type)
    runner = ss.PrefillGraphRunner(sshf.prefill_forward(model), buffers, progress=False)
    runner.capture()  # no CUDA: eager
    batch = sshf.pack_requests(model, requests)
    with torch.no_grad():
        return batch, runner.run(batch, clone=True)


def _assert_matches_hf(model, requests, hf_media):
    batch, out = _run(model, requests)
    for req, media, s, n in zip(requests, hf_media, batch.extend_start_loc.tolist(), batch.seq_lens.tolist()):
        torch.testing.assert_close(out[s:s + n], _hf(model, req.input_ids, **media), **TOL)
