"""Edge cases of slabstage.hf: clear errors (a grid that disagrees with the placeholders, a float chunk
bound, a float grid, placeholders without a grid); pack_requests refusing ids of two prompts, float ids and
media for a text-only model; items out of their order; the DeepStack level count for repeated indexes or
indexes past the vision tower; length-dependent (dynamic) rope; the transformers lower bound (the last test
installs that version into a temporary folder).

Tiny random configs (slabstage.hf.tiny), nothing downloaded but the lower-bound test's wheels.
"""

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import slabstage as ss

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf._family import MIN_TRANSFORMERS  # noqa: E402
from slabstage.hf.tiny import (IMAGE, PATCH, TEMPORAL, VIDEO, VISION_END, VISION_START, tiny_model,  # noqa: E402
                                tiny_prompt)

ROOT = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-4, atol=1e-4)


# -- helpers -------------------------------------------------------------------------------

def _text(n, g):
    return torch.randint(0, VISION_START - 8, (n,), generator=g)


def _block(token, rows):
    return torch.cat([torch.tensor([VISION_START]), torch.full((rows,), token), torch.tensor([VISION_END])])


def _pixels(grid, g):
    return torch.randn(int(grid.prod(-1).sum()), 3 * TEMPORAL * PATCH * PATCH, generator=g)


def _video(family, t, rows_per_frame, g):
    """A video's placeholders: Qwen3-VL parts its frames by (text) timestamps, one run per frame."""
    if family.startswith("qwen3"):
        return torch.cat([torch.cat([_text(2, g), _block(VIDEO, rows_per_frame)]) for _ in range(t)])
    return _block(VIDEO, t * rows_per_frame)


def _video_first_prompt(model, family, image_grids, seed=0):
    """Text, a video of grid (2, 4, 4) (8 rows), text, then one image per grid row: ``(ids, hf kwargs, image
    items, video items)``, the items from media_items."""
    g = torch.Generator().manual_seed(seed)
    vgrid, igrid = torch.tensor([[2, 4, 4]]), torch.tensor(image_grids)
    parts = [_text(3, g), _video(family, 2, 4, g), _text(2, g)]
    for t, h, w in image_grids:
        parts += [_block(IMAGE, t * h * w // 4), _text(2, g)]
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


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = tiny_model(family)
        return cache[family]

    return get


# -- clear errors -----------------------------------------------------------------------

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


# -- pack_requests refuses bad requests ------------------------------------------------

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


def test_media_for_a_text_only_model_are_refused(models):
    vlm, llama = models("qwen2_vl"), models("llama")
    ids, pv, grid = tiny_prompt(vlm, [(1, 4, 6)])
    items = sshf.media_items(vlm, pixel_values=pv, image_grid_thw=grid)
    text = torch.randint(0, 80, (10,))
    with pytest.raises(ValueError, match="request 0: it gives media but LlamaForCausalLM .* is a text-only model"):
        sshf.pack_requests(llama, [sshf.Request(text, items)])
    with pytest.raises(ValueError, match="request 1: it gives image_grid_thw but .* text-only"):
        sshf.pack_requests(llama, [sshf.Request(text), sshf.Request(text, image_grid_thw=grid)])


# -- items in their order --------------------------------------------------------------

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


# -- DeepStack levels as HF applies them ---------------------------------------------------

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


# -- length-dependent rope -------------------------------------------------------------

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


# -- the transformers lower bound -----------------------------------------------------------

def test_older_transformers_is_refused_on_first_use(models, monkeypatch):
    import transformers

    model = models("qwen2_vl")
    monkeypatch.setattr(transformers, "__version__", "5.0.0")
    for fn in (sshf.input_embeds_width, sshf.prefill_forward, sshf.media_items):
        with pytest.raises(ImportError, match=rf"needs transformers>={MIN_TRANSFORMERS},<6, found 5.0.0"):
            fn(model)
    monkeypatch.setattr(transformers, "__version__", MIN_TRANSFORMERS)
    assert sshf.input_embeds_width(model) == 32


def test_extras_pin_the_supported_minimum():
    text = (ROOT / "pyproject.toml").read_text()
    major_minor = ".".join(MIN_TRANSFORMERS.split(".")[:2])
    for extra in ("hf", "test"):
        body = re.search(rf"^{extra} = \[(.*?)\]", text, re.M | re.S).group(1)
        assert f'"transformers>={major_minor},<6"' in body, f"[project.optional-dependencies] {extra}: {body}"
    assert f"transformers>={major_minor},<6" in (ROOT / "docs" / "hf.md").read_text()


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


# What the lower-bound test runs at transformers MIN_TRANSFORMERS: every VLM path, against HF's own forward.
_LOWER_BOUND_CHECK = r'''
import json, os, sys
import torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import transformers
assert transformers.__version__ == sys.argv[1], (transformers.__version__, transformers.__file__)
import slabstage as ss, slabstage.hf as sshf
from slabstage.hf.tiny import tiny_model, tiny_prompt

worst = {}
for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
    model = tiny_model(family)
    width = sshf.input_embeds_width(model)
    assert width == 32 * (3 if family.startswith("qwen3") else 1), (family, width)
    g = torch.Generator().manual_seed(0)
    requests, refs = [], []
    for grids in ([(1, 4, 6)], [(1, 4, 4), (1, 6, 4)]):
        ids, pv, grid = tiny_prompt(model, grids, generator=g)
        pos = sshf.mrope_positions(model, ids, grid)
        assert pos.shape == (3, ids.shape[0]) and not torch.equal(pos[1], pos[2]), family
        requests.append(sshf.Request(ids, sshf.media_items(model, pixel_values=pv, image_grid_thw=grid),
                                     image_grid_thw=grid))
        kw = dict(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], use_cache=False,
                  pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=sshf.mm_token_type_ids(model, ids[None]))
        with torch.no_grad():
            refs.append(model.base_model(**kw).last_hidden_state[0])
    buffers = ss.StagingBuffers.allocate(max_num_tokens=128, max_batch_size=4, embed_width=width,
                                         embed_dtype=torch.float32, device="cpu", mrope=True)
    runner = ss.PrefillGraphRunner(sshf.prefill_forward(model), buffers, progress=False)
    runner.capture()
    batch = sshf.pack_requests(model, requests)
    with torch.no_grad():
        out = runner.run(batch, clone=True)
    worst[family] = max((out[s:s + n] - ref).abs().max().item() for ref, s, n in
                        zip(refs, batch.extend_start_loc.tolist(), batch.seq_lens.tolist()))
print(json.dumps({"version": transformers.__version__, "file": transformers.__file__, "worst": worst}))
'''


def _pip(*args, timeout=240):
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *map(str, args)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 1, "", f"timed out after {timeout} s")


def _lower_bound_site(version: str) -> Path:
    """A folder holding transformers ``version`` and the packages this environment lacks for it (an older
    huggingface_hub, tokenizers, ...), cached in the temp dir by version; skips when pip cannot fetch them."""
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    cache = Path(tempfile.gettempdir()) / f"slabstage-transformers-{version}-{python}"
    site, done = cache / "site", cache / "site.ok"
    if done.exists():
        return site
    cache.mkdir(parents=True, exist_ok=True)
    report = cache / "report.json"
    # what installing that version here would add or replace: only that goes to the folder, the rest
    # (torch, numpy, ...) stays this environment's (a dry run: nothing here is installed)
    r = _pip("install", "--dry-run", "--quiet", "--report", report, f"transformers=={version}")
    if r.returncode:
        pytest.skip(f"pip could not resolve transformers=={version} (offline?): {r.stderr.strip()[-300:]}")
    pins = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in json.loads(report.read_text())["install"]]
    wheels = cache / "wheels"
    r = _pip("download", "--no-deps", "--quiet", "-d", wheels, *pins) if pins else r
    if r.returncode:
        pytest.skip(f"pip could not download {' '.join(pins)} (offline?): {r.stderr.strip()[-300:]}")
    part = cache / f"site-{os.getpid()}"
    if pins:
        r = _pip("install", "--no-deps", "--no-index", "--no-compile", "--quiet", "--find-links", wheels,
                 "--target", part, *pins)
        assert r.returncode == 0, f"installing the downloaded wheels failed:\n{r.stderr[-3000:]}"
    else:  # this environment has that version already
        part.mkdir()
    try:
        part.rename(site)
    except OSError:  # another run got there first
        assert site.is_dir()
    done.touch()
    return site


@pytest.mark.slow  # (40 s on the 2-core machine: pip resolves, downloads and installs that version first)
def test_vlm_paths_work_and_match_hf_at_the_minimum_transformers():
    site = _lower_bound_site(MIN_TRANSFORMERS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    proc = subprocess.run([sys.executable, "-c", _LOWER_BOUND_CHECK, MIN_TRANSFORMERS], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, f"at transformers {MIN_TRANSFORMERS}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["version"] == MIN_TRANSFORMERS
    assert all(err <= 1e-4 for err in result["worst"].values()), result
