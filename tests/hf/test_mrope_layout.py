"""mrope positions computed by the staging launch from each request's layout (slabstage.MropeLayout).

Ground truth: the installed transformers' own get_rope_index, on random prompts with several images and
videos per request, text before, between and after them, several requests packed and chunks that cut
items. pack_requests must not call get_rope_index (it is made to fail here)."""

from __future__ import annotations

import random

import pytest
import torch

import slabstage
import slabstage.hf as sshf
from slabstage import MropeLayout, StagingBuffers, stage_token_inputs
from slabstage.hf.mrope import layout_rule, mm_token_type_ids
from slabstage.hf.tiny import IMAGE, MERGE, VIDEO, VISION_END, VISION_START
from slabstage.staging.mrope import mrope_segments
from slabstage.staging.reference import mrope_from_segments

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(layout_rule(transformers.__version__) is None,
                                reason="layouts follow transformers >= 5.6")

VLMS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def _prompt(rng: random.Random, family: str):
    """Random ids with 1-4 images/videos, and their grids (Qwen3-VL: a video's frames parted by text)."""
    parts, images, videos = [], [], []

    def text(k):
        parts.extend(rng.randrange(0, 80) for _ in range(k))
    text(rng.randrange(0, 6))
    for _ in range(rng.randrange(1, 5)):
        t, h, w = rng.randrange(1, 4), MERGE * rng.randrange(1, 4), MERGE * rng.randrange(1, 5)
        if rng.random() < 0.5:
            t = 1 if family == "qwen3_vl" else t
            images.append((t, h, w))
            parts += [VISION_START] + [IMAGE] * (t * h * w // MERGE ** 2) + [VISION_END]
        else:
            videos.append((t, h, w))
            for _ in range(t if family == "qwen3_vl" else 1):
                if family == "qwen3_vl":
                    text(rng.randrange(1, 3))  # the frame's timestamp
                rows = (1 if family == "qwen3_vl" else t) * h * w // MERGE ** 2
                parts += [VISION_START] + [VIDEO] * rows + [VISION_END]
        text(rng.randrange(0, 6))
    grid = (lambda g: torch.tensor(g) if g else None)
    return torch.tensor(parts), grid(images), grid(videos)


def _seconds(rng: random.Random, family: str, videos):
    if family != "qwen2_5_vl" or videos is None or rng.random() < 0.2:
        return None
    values = [rng.choice([0.5, 1.0, 2.0, 0.3, 1 / 3, 0.7, rng.random() * 3]) for _ in range(videos.shape[0])]
    return rng.choice([torch.tensor(values, dtype=torch.float32), torch.tensor(values, dtype=torch.float64),
                       values])


def _hf(model, ids, images, videos, seconds):
    """(positions [3, L], delta) from the installed transformers' get_rope_index."""
    kw = dict(image_grid_thw=images, video_grid_thw=None if videos is None else videos.clone(),
              mm_token_type_ids=mm_token_type_ids(model, ids.view(1, -1)))
    if seconds is not None:
        kw["second_per_grid_ts"] = seconds
    positions, delta = model.base_model.get_rope_index(ids.view(1, -1), **kw)
    return positions[:, 0], int(delta)


def _no_rope_index(monkeypatch, model):
    def fail(*args, **kwargs):
        raise AssertionError("pack_requests called get_rope_index")
    for obj in (type(model), type(model.base_model)):
        if hasattr(obj, "get_rope_index"):
            monkeypatch.setattr(obj, "get_rope_index", fail)


def _media(model, images, videos):
    """One item a grid row (images, then videos), random rows: only their count matters to the positions."""
    rows = [t * h * w // MERGE ** 2 for g in (images, videos) if g is not None for t, h, w in g.tolist()]
    return [torch.randn(r, model.config.get_text_config().hidden_size) for r in rows]


@pytest.mark.parametrize("family", VLMS)
def test_packed_layouts_stage_get_rope_index_positions(models, family, monkeypatch, device):
    """Several requests, each a random prompt or a chunk of one: the kernel's positions are HF's columns."""
    model = models(family)
    rng = random.Random(sum(map(ord, family)))
    buffers = StagingBuffers.allocate(max_num_tokens=1024, max_batch_size=8, embed_width=8,
                                      embed_dtype=torch.float32, device=device, mrope=True)
    for trial in range(6):
        requests, want = [], []
        for _ in range(rng.randrange(1, 4)):
            ids, images, videos = _prompt(rng, family)
            seconds = _seconds(rng, family, videos)
            L = ids.shape[0]
            a = rng.randrange(0, L) if rng.random() < 0.6 else 0
            b = rng.randrange(a + 1, L + 1) if rng.random() < 0.6 else L
            requests.append(sshf.Request(ids, media=_media(model, images, videos), image_grid_thw=images,
                                         video_grid_thw=videos, second_per_grid_ts=seconds, chunk=(a, b)))
            want.append(_hf(model, ids, images, videos, seconds)[0][:, a:b])
        want = torch.cat(want, 1).to(device)
        with monkeypatch.context() as m:
            _no_rope_index(m, model)
            batch = sshf.pack_requests(model, requests)
        assert isinstance(batch.mrope_positions, list)
        assert all(isinstance(x, MropeLayout) for x in batch.mrope_positions)
        n = batch.num_tokens
        buffers.mrope_positions.fill_(-7)
        stage_token_inputs(buffers, input_ids=batch.input_ids, positions=batch.positions,
                           mrope_positions=batch.mrope_positions, pad_to=n + 5)
        assert torch.equal(buffers.mrope_positions[:, :n], want), (family, trial)
        assert (buffers.mrope_positions[:, n:n + 5] == 0).all()  # its pad value
        assert (buffers.mrope_positions[:, n + 5:] == -7).all()  # nothing past pad_to


@pytest.mark.parametrize("family", VLMS)
def test_placeholder_runs_at_the_prompts_edges_stay_apart(models, family, monkeypatch):
    """pack_requests finds the placeholders of all the prompts in one pass over them laid end to end: a run
    that ends one prompt and one that starts the next stay two images, each its own request's."""
    model = models(family)
    text = torch.arange(3, 9)
    ends = torch.cat([torch.full((4,), IMAGE), text, torch.full((6,), IMAGE)])  # (1, 4, 4), text, (1, 4, 6)
    starts = torch.cat([torch.full((6,), IMAGE), text])  # (1, 4, 6), text
    grids = [torch.tensor([[1, 4, 4], [1, 4, 6]]), torch.tensor([[1, 4, 6]])]
    requests = [sshf.Request(ids, media=_media(model, grid, None), image_grid_thw=grid)
                for ids, grid in ((ends, grids[0]), (starts, grids[1]), (ends, grids[0]))]
    with monkeypatch.context() as m:
        _no_rope_index(m, model)
        batch = sshf.pack_requests(model, requests)
    n = batch.num_tokens
    want = torch.cat([_hf(model, r.input_ids, r.image_grid_thw, None, None)[0] for r in requests], 1)
    assert torch.equal(mrope_from_segments(mrope_segments(batch.mrope_positions, n), n), want)
    placeholders = batch.input_ids == IMAGE  # the items' rows in prompt order: images alone, in order
    index = torch.full((n,), -1)
    index[placeholders] = torch.arange(int(placeholders.sum()))
    assert torch.equal(batch.media_index, index)
    assert [item.shape[0] for item in batch.media] == [4, 6, 6, 4, 6]


@pytest.mark.parametrize("family", VLMS)
def test_rope_index_path_packs_what_the_layouts_do(models, family, monkeypatch):
    """Before transformers 5.6 (no layout rule) the positions come from get_rope_index, one [3, n] tensor:
    HF's columns, and the rest of the batch as the layouts' path packs it."""
    model = models(family)
    rng = random.Random(5 + len(family))
    for _ in range(4):
        requests, want = [], []
        for _ in range(rng.randrange(1, 4)):
            ids, images, videos = _prompt(rng, family)
            seconds = _seconds(rng, family, videos)
            a = rng.randrange(0, ids.shape[0])
            b = rng.randrange(a + 1, ids.shape[0] + 1)
            requests.append(sshf.Request(ids, media=_media(model, images, videos), image_grid_thw=images,
                                         video_grid_thw=videos, second_per_grid_ts=seconds, chunk=(a, b)))
            want.append(_hf(model, ids, images, videos, seconds)[0][:, a:b])
        layouts = sshf.pack_requests(model, requests)
        with monkeypatch.context() as m:
            m.setattr(sshf.pack, "layout_rule", lambda version: None)
            tensor = sshf.pack_requests(model, requests)
        assert torch.equal(tensor.mrope_positions, torch.cat(want, 1))
        for name in ("input_ids", "positions", "seq_lens", "extend_start_loc", "media_index"):
            got, same = getattr(tensor, name), getattr(layouts, name)
            assert (got is None and same is None) or torch.equal(got, same), name
        assert [id(x) for x in tensor.media or ()] == [id(x) for x in layouts.media or ()]


@pytest.mark.parametrize("family", VLMS)
def test_reference_and_delta_match_get_rope_index(models, family):
    """Many prompts through the PyTorch reference (what the CPU path stages), and the offset the positions
    after the prompt continue from (HF's mrope_position_deltas)."""
    model = models(family)
    rng = random.Random(7 + len(family))
    rule = layout_rule(transformers.__version__)
    fam = sshf._family.family_of(model, "pack_requests")
    for _ in range(60):
        ids, images, videos = _prompt(rng, family)
        seconds = _seconds(rng, family, videos)
        positions, delta = _hf(model, ids, images, videos, seconds)
        L = ids.shape[0]
        a = rng.randrange(0, L)
        b = rng.randrange(a + 1, L + 1)
        images, videos, runs = sshf.mrope.check_vlm_prompt(fam, ids, images, videos, seconds, "test")
        chunk = sshf.mrope.rope_layout(fam, runs, images, videos, seconds, a, b, rule)
        assert torch.equal(mrope_from_segments(mrope_segments(chunk, b - a), b - a), positions[:, a:b])
        whole = sshf.mrope.rope_layout(fam, runs, images, videos, seconds, 0, L, rule)
        assert whole.position_delta(L) == delta


def test_a_request_with_its_own_positions_makes_one_tensor(models):
    model = models("qwen2_vl")
    rng = random.Random(3)
    ids, images, videos = _prompt(rng, "qwen2_vl")
    own = sshf.mrope_positions(model, ids, images, videos)
    reqs = [sshf.Request(ids, media=_media(model, images, videos), image_grid_thw=images, video_grid_thw=videos),
            sshf.Request(ids, media=_media(model, images, videos), image_grid_thw=images, video_grid_thw=videos,
                         mrope_positions=own + 1000)]
    batch = sshf.pack_requests(model, reqs)
    assert torch.equal(batch.mrope_positions, torch.cat([own, own + 1000], 1))


def _layout(**kw):
    base = dict(tokens=20, starts=[2, 10], grids=[(1, 2, 4), (2, 2, 2)], merge=2, intervals=None, offset=0)
    base.update(kw)
    return MropeLayout(**base)


@pytest.mark.parametrize("kw, err, match", [
    (dict(grids=[(1, 3, 4), (2, 2, 2)]), ValueError, r"grids\[0\] = \(1, 3, 4\): .* multiples of merge=2"),
    (dict(grids=[(0, 2, 4), (2, 2, 2)]), ValueError, r"grids\[0\]"),
    (dict(grids=[(1, 2, 4)]), ValueError, "2 starts but 1 grids"),
    (dict(starts=[10, 2]), ValueError, r"starts\[1\] = 2: items start at ints, ascending"),
    (dict(starts=[2, 3]), ValueError, r"starts\[1\] = 3: .* after the end of the one before \(4\)"),
    (dict(starts=[-1, 10]), ValueError, r"starts\[0\] = -1"),
    (dict(tokens=0), ValueError, "tokens must be an int >= 1"),
    (dict(tokens=2.0), TypeError, "tokens must be an int"),
    (dict(offset=-3), ValueError, "offset must be an int >= 0"),
    (dict(merge=0), ValueError, "merge must be an int >= 1"),
    (dict(intervals=[1]), ValueError, "intervals has 1 entries for 2 items"),
    (dict(intervals=[1, float("nan")]), ValueError, r"intervals\[1\] is nan"),
    (dict(intervals=[1, "2"]), TypeError, r"intervals\[1\] must be an int or a float"),
    (dict(intervals=torch.ones(2, dtype=torch.float16)), TypeError, "integer, float32 or float64 tensor"),
    (dict(tokens=19), ValueError, "the layouts' tokens add up to 19 but the batch has 20 rows"),
])
def test_bad_layouts_are_refused_and_nothing_is_written(kw, err, match):
    buffers = StagingBuffers.allocate(max_num_tokens=64, max_batch_size=4, embed_width=8,
                                      embed_dtype=torch.float32, device="cpu", mrope=True)
    before = {k: v.clone() for k, v in buffers.registry.views(64).items()}
    ids = torch.randint(0, 50, (20,))
    with pytest.raises(err, match=match):
        stage_token_inputs(buffers, input_ids=ids, positions=torch.arange(20), mrope_positions=[_layout(**kw)],
                           pad_to=24)
    for k, v in buffers.registry.views(64).items():
        assert torch.equal(v, before[k]), k


def test_layouts_need_an_mrope_slot_and_the_right_kind():
    plain = StagingBuffers.allocate(max_num_tokens=64, max_batch_size=4, embed_width=8, embed_dtype=torch.float32,
                                    device="cpu")
    ids = torch.randint(0, 50, (20,))
    with pytest.raises(ValueError, match="allocated without mrope=True"):
        stage_token_inputs(plain, input_ids=ids, positions=torch.arange(20), mrope_positions=[_layout()], pad_to=20)
    buffers = StagingBuffers.allocate(max_num_tokens=64, max_batch_size=4, embed_width=8, embed_dtype=torch.float32,
                                      device="cpu", mrope=True)
    for bad in ([], {"a": 1}, [(20, [], [])]):
        with pytest.raises((TypeError, ValueError), match="mrope_positions|MropeLayout"):
            stage_token_inputs(buffers, input_ids=ids, positions=torch.arange(20), mrope_positions=bad, pad_to=20)
        with pytest.raises((TypeError, ValueError), match="mrope_positions|MropeLayout"):  # and when made
            slabstage.PrefillBatch(input_ids=ids, positions=torch.arange(20), table=torch.randn(50, 8),
                                   mrope_positions=bad)


def test_kernel_equals_reference_on_random_layouts(device):
    """Layouts an engine builds itself (any starts, grids, float and int intervals, chunk offsets), several
    requests a batch, every row written below pad_to and none past it."""
    rng = random.Random(11)
    buffers = StagingBuffers.allocate(max_num_tokens=300, max_batch_size=8, embed_width=8,
                                      embed_dtype=torch.float32, device=device, mrope=True)

    def layout(tokens):
        starts, grids, intervals, p = [], [], [], rng.randrange(0, 5)
        for _ in range(rng.randrange(0, 4)):
            t, h, w = rng.randrange(1, 3), 2 * rng.randrange(1, 3), 2 * rng.randrange(1, 3)
            starts.append(p)
            grids.append((t, h, w))
            intervals.append(rng.choice([1, 3, 0.5, 1 / 3, 25 * 0.7, torch.tensor(0.35, dtype=torch.float64)]))
            p += t * h * w // 4 + rng.randrange(0, 5)
        return MropeLayout(tokens, starts, grids, 2, intervals, rng.randrange(0, max(1, p)))

    for _ in range(8):
        tokens = [rng.randrange(1, 60) for _ in range(rng.randrange(1, 4))]
        n = sum(tokens)
        layouts = [layout(t) for t in tokens]
        want = mrope_from_segments(mrope_segments(layouts, n), n, device)
        pad = min(300, n + rng.randrange(0, 20))
        buffers.mrope_positions.fill_(-9)
        stage_token_inputs(buffers, input_ids=torch.randint(0, 50, (n,)), positions=torch.arange(n),
                           mrope_positions=layouts, pad_to=pad)
        assert torch.equal(buffers.mrope_positions[:, :n], want)
        assert (buffers.mrope_positions[:, n:pad] == 0).all() and (buffers.mrope_positions[:, pad:] == -9).all()


def test_float_intervals_follow_torch_arithmetic():
    """floor(i * interval) as torch.arange(t) * interval computes it: float32 for a Python float, float64 for a
    float64 tensor (values chosen where the two differ)."""
    t = 40
    for interval in (0.1, 1 / 3, 0.7, 2.9):
        for given, dtype in ((interval, torch.float32), (torch.tensor([interval], dtype=torch.float64),
                                                         torch.float64)):
            layout = MropeLayout(t, [0], [(t, 2, 2)], 2, given if isinstance(given, torch.Tensor) else [given])
            got = mrope_from_segments(mrope_segments(layout, t), t)[0]
            iv = given if isinstance(given, torch.Tensor) else interval
            assert torch.equal(got, (torch.arange(t) * iv).long()), (interval, dtype)
