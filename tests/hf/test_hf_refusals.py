"""What slabstage.hf refuses, with an error naming the request and the argument: a grid that disagrees with
the placeholders, a float chunk bound or grid, placeholders without a grid, ids of two prompts, float ids,
media for a text-only model, items out of prompt order.
Tiny random configs (slabstage.hf.tiny), nothing downloaded.
"""

import pytest
import torch

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf.tiny import tiny_prompt  # noqa: E402

from hf_prompts import _assert_matches_hf, _video_first_prompt  # noqa: E402, I001


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_grid_that_disagrees_with_the_placeholders_is_a_value_error(models, family):
    model = models(family)
    ids, pv, grid = tiny_prompt(model, [(1, 4, 6)])  # 6 placeholder tokens
    items = sshf.media_items(model, pixel_values=pv, image_grid_thw=grid)
    short = torch.tensor([[1, 4, 4]])  # 4 rows
    with pytest.raises(ValueError, match=r"mrope_positions: the image placeholder run .* holds 6 tokens but "
                                         r"image_grid_thw\[0\] = \(1, 4, 4\) gives 4 rows"):
        sshf.mrope_positions(model, ids, short)
    with pytest.raises(ValueError, match=r"pack_requests: request 0: the image placeholder run .* image_grid_thw\[0\]"):
        sshf.pack_requests(model, [sshf.Request(ids, items, image_grid_thw=short)])
    two = torch.tensor([[1, 4, 6], [1, 4, 4]])  # a grid row without its placeholders
    with pytest.raises(ValueError, match=r"1 runs of image placeholder tokens but image_grid_thw \(2 rows\)"):
        sshf.mrope_positions(model, ids, two)


def test_the_first_bad_request_is_named(models):
    """pack_requests checks the whole batch one kind of check at a time (the placeholders of all the prompts
    in one pass): the error it raises is still the first bad request's, as checking them in turn would find."""
    model = models("qwen2_vl")
    ids, pv, grid = tiny_prompt(model, [(1, 4, 6)])
    items = sshf.media_items(model, pixel_values=pv, image_grid_thw=grid)
    short = sshf.Request(ids, items, image_grid_thw=torch.tensor([[1, 4, 4]]))  # its placeholders disagree
    float_chunk = sshf.Request(ids, items, image_grid_thw=grid, chunk=(0.0, 5))  # a check made before them
    good = sshf.Request(ids, items, image_grid_thw=grid)
    with pytest.raises(ValueError, match=r"request 1: the image placeholder run .* image_grid_thw\[0\]"):
        sshf.pack_requests(model, [good, short, float_chunk])
    with pytest.raises(TypeError, match=r"request 1: chunk must be two ints"):
        sshf.pack_requests(model, [good, float_chunk, short])


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_float_chunk_bound_is_a_type_error(models, family):
    model = models(family)
    ids, pv, grid = tiny_prompt(model, [] if family == "llama" else [(1, 4, 6)])
    req = dict(input_ids=ids)
    if pv is not None:
        req.update(media=sshf.media_items(model, pixel_values=pv, image_grid_thw=grid), image_grid_thw=grid)
    for chunk in [(0.0, 5), (0, 5.0), (True, 5), (0, 5, 7), 5]:
        with pytest.raises(TypeError, match=r"request 0: chunk must be two ints \(start, end\)"):
            sshf.pack_requests(model, [sshf.Request(**req, chunk=chunk)])
    with pytest.raises(ValueError, match="chunk .* is not inside"):
        sshf.pack_requests(model, [sshf.Request(**req, chunk=(3, 3))])
    assert sshf.pack_requests(model, [sshf.Request(**req, chunk=(torch.tensor(0), 5))]).num_tokens == 5


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_float_grid_is_a_type_error(models, family):
    model = models(family)
    ids, pv, grid = tiny_prompt(model, [(1, 4, 6)])
    items = sshf.media_items(model, pixel_values=pv, image_grid_thw=grid)
    match = r"image_grid_thw must be an integer tensor \[N, 3\] of \(t, h, w\), got dtype torch.float32"
    with pytest.raises(TypeError, match="mrope_positions: " + match):
        sshf.mrope_positions(model, ids, grid.float())
    with pytest.raises(TypeError, match="pack_requests: request 0: " + match):
        sshf.pack_requests(model, [sshf.Request(ids, items, image_grid_thw=grid.float())])
    with pytest.raises(TypeError, match="media_items: " + match):
        sshf.media_items(model, pixel_values=pv, image_grid_thw=grid.float())
    with pytest.raises(ValueError, match=r"video_grid_thw must be \[N, 3\]"):
        sshf.mrope_positions(model, ids, grid, torch.tensor([2, 4, 4]))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_placeholders_without_a_grid_are_a_value_error(models, family):
    model = models(family)
    ids, pv, grid = tiny_prompt(model, [(1, 4, 6)])
    items = sshf.media_items(model, pixel_values=pv, image_grid_thw=grid)
    with pytest.raises(ValueError, match="input_ids hold 6 image placeholder tokens .* but image_grid_thw is None"):
        sshf.mrope_positions(model, ids)
    with pytest.raises(ValueError, match="request 0: input_ids hold 6 image placeholder tokens .* image_grid_thw"):
        sshf.pack_requests(model, [sshf.Request(ids, items)])
    ids, _, _, _, igrid, _ = _video_first_prompt(model, family, [(1, 4, 6)])
    with pytest.raises(ValueError, match="video placeholder tokens .* but video_grid_thw is None"):
        sshf.mrope_positions(model, ids, igrid)


@pytest.mark.parametrize("family", ["llama", "qwen2_vl"])
def test_ids_of_two_prompts_are_refused(models, family):
    model = models(family)
    if family == "llama":
        ids, media = torch.randint(0, 80, (12,)), {}
    else:
        ids, pv, grid = tiny_prompt(model, [(1, 4, 6)])
        media = dict(media=sshf.media_items(model, pixel_values=pv, image_grid_thw=grid), image_grid_thw=grid)
    two = torch.stack([ids, ids])
    with pytest.raises(ValueError, match=r"request 0: input_ids must be one prompt, \[L\] or \[1, L\], got shape"):
        sshf.pack_requests(model, [sshf.Request(two, **media)])
    one = sshf.pack_requests(model, [sshf.Request(ids[None], **media)])  # [1, L] is one prompt
    assert torch.equal(one.input_ids, ids)
    if media:  # a request's own mrope positions are the whole prompt's
        whole = sshf.mrope_positions(model, ids, media["image_grid_thw"])
        with pytest.raises(ValueError, match=rf"mrope_positions must be the whole prompt's \[3, {ids.shape[0]}\]"):
            sshf.pack_requests(model, [sshf.Request(ids, **media, mrope_positions=whole[:, 1:])])
        with pytest.raises(TypeError, match="mrope_positions must be an integer tensor"):
            sshf.pack_requests(model, [sshf.Request(ids, **media, mrope_positions=whole.float())])


def test_ids_that_are_not_integers_are_refused(models):
    model = models("llama")
    for bad in (torch.tensor([3.7, 1.0, 2.0]), torch.tensor([True, False])):
        with pytest.raises(TypeError, match="request 0: input_ids must hold integer token ids"):
            sshf.pack_requests(model, [sshf.Request(bad)])
    with pytest.raises(TypeError, match="input_ids must hold integer token ids"):
        sshf.mrope_positions(models("qwen2_vl"), torch.tensor([3.7, 1.0]))
    assert sshf.pack_requests(model, [sshf.Request(torch.tensor([3, 1], dtype=torch.int32))]).num_tokens == 2


def test_meta_ids_and_bad_request_rows_are_refused_naming_them(models):
    """A meta tensor of ids, and a ``req_index`` that is not an int row of an int32 slot (with or without a KV
    cache), are refused naming the request and the argument."""
    model = models("llama")
    ids = torch.tensor([3, 1, 4])
    with pytest.raises(ValueError, match="request 0: input_ids is a meta tensor"):
        sshf.pack_requests(model, [sshf.Request(ids.to("meta"))])
    for bad in (-1, True, 1.5, "0", 2**70):
        with pytest.raises(ValueError, match="request 1: req_index must be an int"):
            sshf.pack_requests(model, [sshf.Request(ids), sshf.Request(ids, req_index=bad)])
    assert sshf.pack_requests(model, [sshf.Request(ids, req_index=3)]).req_indices.tolist() == [3]


def test_media_for_a_text_only_model_are_refused(models):
    vlm, llama = models("qwen2_vl"), models("llama")
    ids, pv, grid = tiny_prompt(vlm, [(1, 4, 6)])
    items = sshf.media_items(vlm, pixel_values=pv, image_grid_thw=grid)
    text = torch.randint(0, 80, (10,))
    with pytest.raises(ValueError, match="request 0: it gives media but LlamaForCausalLM .* is a text-only model"):
        sshf.pack_requests(llama, [sshf.Request(text, items)])
    with pytest.raises(ValueError, match="request 1: it gives image_grid_thw but .* text-only"):
        sshf.pack_requests(llama, [sshf.Request(text), sshf.Request(text, image_grid_thw=grid)])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_items_in_prompt_order_with_a_video_first_are_refused(models, family):
    model = models(family)
    # video 8 rows, images 6 and 8 rows: the first two items (video, image 0) hold the 14 rows of both images
    ids, hf, images, videos, igrid, vgrid = _video_first_prompt(model, family, [(1, 4, 6), (1, 4, 8)])
    right = sshf.Request(ids, images + videos, image_grid_thw=igrid, video_grid_thw=vgrid)
    _assert_matches_hf(model, [right], [hf])
    order = "items are the images in image_grid_thw order, then the videos in video_grid_thw order"
    with pytest.raises(ValueError, match=rf"request 0: media item 0 holds 8 rows but it is image 0, "
                                         rf"image_grid_thw\[0\] = \(1, 4, 6\) gives 6: {order}"):
        sshf.pack_requests(model, [sshf.Request(ids, videos + images, image_grid_thw=igrid, video_grid_thw=vgrid)])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_swapped_images_are_refused(models, family):
    model = models(family)
    ids, pv, grid = tiny_prompt(model, [(1, 4, 6), (1, 8, 8)])  # 6 and 16 rows
    items = sshf.media_items(model, pixel_values=pv, image_grid_thw=grid)
    with pytest.raises(ValueError, match=r"media item 0 holds 16 rows but it is image 0"):
        sshf.pack_requests(model, [sshf.Request(ids, items[::-1], image_grid_thw=grid)])
    with pytest.raises(ValueError, match="1 media items were given for 2 images and 0 videos"):
        sshf.pack_requests(model, [sshf.Request(ids, items[:1], image_grid_thw=grid)])
    # an item that is no tensor is named before an earlier item's wrong rows
    with pytest.raises(TypeError, match="request 0: media item 1 must be a 2-D tensor"):
        sshf.pack_requests(model, [sshf.Request(ids, [items[1], "rows"], image_grid_thw=grid)])
