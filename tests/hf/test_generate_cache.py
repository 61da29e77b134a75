"""slabstage.hf.generate with an encoder cache: requests give pixels, keyed by content and encoded through the
cache; the ids equal HF's generate and generation without the cache; a shared image is encoded once, a second call
hits, a budget that evicts mid-run changes nothing. Tiny fp32 models on the host."""

import importlib
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.cache import EncoderCache, StaleEntryError  # noqa: E402
from slabstage.hf._checks import grid_rows  # noqa: E402
from slabstage.hf.generate import content_keys, hf_generate  # noqa: E402
from slabstage.hf.pack import item_spans  # noqa: E402
from slabstage.hf.tiny import tiny_model, tiny_request  # noqa: E402
from slabstage.hf.width import input_embeds_width  # noqa: E402

NEW = 16
# (images, videos) per prompt; prompt 2 repeats prompt 0's first image (same pixels, same grid)
PROMPTS = [([(1, 4, 6)], [(2, 4, 4)]), ([(1, 4, 4), (1, 6, 4)], ()), ([(1, 4, 6)], ()), ((), ())]


def _prompts(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, (images, videos) in enumerate(PROMPTS):
        lens = [3 + 4 * k + j for j in range(len(images) + len(videos) + 1)]
        req, hf = tiny_request(model, images, videos, text_lens=lens, generator=g)
        out.append([req, hf])
    # prompt 2's image: prompt 0's pixels (its first 24 patch rows)
    out[2][1]["pixel_values"] = out[0][1]["pixel_values"][:24].clone()
    reqs = []
    for req, hf in out:
        reqs.append(sshf.Request(req.input_ids, image_grid_thw=req.image_grid_thw,
                                 video_grid_thw=req.video_grid_thw, pixel_values=hf.get("pixel_values"),
                                 pixel_values_videos=hf.get("pixel_values_videos")))
    return reqs, [hf for _, hf in out]


class _Count:
    """Counts the vision tower's calls and the items it encodes (wraps the base model's feature getters; a call
    inside another, as Qwen3-VL's video getter makes to its image getter, is the same encode)."""

    def __init__(self, model, monkeypatch):
        self.calls, self.items, self.depth = 0, 0, 0
        base = model.model
        for name in ("get_image_features", "get_video_features"):
            real = getattr(base, name)

            def wrapped(pixels, grid, *a, _real=real, **k):
                if not self.depth:
                    self.calls += 1
                    self.items += len(grid)
                self.depth += 1
                try:
                    return _real(pixels, grid, *a, **k)
                finally:
                    self.depth -= 1
            monkeypatch.setattr(base, name, wrapped)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_generate_through_the_cache_equals_hf_and_uncached(family, monkeypatch):
    model = tiny_model(family, seed=3)
    model.generation_config.eos_token_id = None
    reqs, hfs = _prompts(model)
    ref = [hf_generate(model, NEW, **hf) for hf in hfs]
    plain = sshf.generate(model, reqs, max_new_tokens=NEW, token_budget=24)  # pixels encoded up front, no cache
    assert plain == ref
    count = _Count(model, monkeypatch)
    gen = sshf.Generator(model, max_running=4, max_context=128, token_budget=24, encoder_cache=1 << 20)
    assert gen.generate(reqs, max_new_tokens=NEW) == ref
    assert count.items == 4 and len(gen.encoder_cache) == 4  # 5 items, the shared image encoded once
    calls = count.calls
    assert gen.generate(reqs, max_new_tokens=NEW) == ref  # a second call: every item a hit
    assert count.calls == calls and count.items == 4
    # items given as tensors (tiny_request's) through the same cache: equal too, and the call's entries go after it
    given = [tiny_request(model, i, v, text_lens=[3 + 4 * k + j for j in range(len(i) + len(v) + 1)],
                          generator=torch.Generator().manual_seed(9))[0] for k, (i, v) in enumerate(PROMPTS[:2])]
    assert gen.generate(given, max_new_tokens=4) == sshf.generate(model, given, max_new_tokens=4, token_budget=24)
    assert len(gen.encoder_cache) == 4


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_a_cache_that_evicts_mid_run_gives_the_same_ids(family, monkeypatch):
    model = tiny_model(family, seed=4)
    model.generation_config.eos_token_id = None
    reqs, hfs = _prompts(model, seed=1)
    ref = [hf_generate(model, NEW, **hf) for hf in hfs]
    width = input_embeds_width(model)
    cache = EncoderCache(width, torch.float32, "cpu", device_budget_bytes=14 * width * 4)  # 14 rows: one request's
    count = _Count(model, monkeypatch)
    for budget, running in ((24, 4), (7, 1), (64, 2)):
        assert sshf.generate(model, reqs, max_new_tokens=NEW, token_budget=budget, max_running=running,
                             encoder_cache=cache) == ref
    assert count.items > 4  # evicted items were encoded again


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_a_chunk_encodes_and_holds_the_items_it_reads_alone(family, monkeypatch):
    """A budget of the largest item's rows (no request's items fit at once) gives HF's ids; a prompt's items are
    encoded at the step whose chunk first reads them, not all at its first chunk."""
    model = tiny_model(family, seed=5)
    model.generation_config.eos_token_id = None
    reqs, hfs = _prompts(model, seed=2)
    ref = [hf_generate(model, NEW, **hf) for hf in hfs]
    width = input_embeds_width(model)
    largest = max(rows for r in reqs for rows in
                  grid_rows(r.image_grid_thw, 2) + grid_rows(r.video_grid_thw, 2))
    for budget, running in ((24, 4), (5, 2)):
        cache = EncoderCache(width, torch.float32, "cpu", device_budget_bytes=largest * width * 4)
        assert sshf.generate(model, reqs, max_new_tokens=NEW, token_budget=budget, max_running=running,
                             encoder_cache=cache) == ref
    # prompt 1: text, image (4, 4), text, image (6, 4); a first chunk that ends before the second image
    count = _Count(model, monkeypatch)
    spans = item_spans(model, [replace(reqs[1], media=[torch.empty(4, 0), torch.empty(6, 0)])])[0]
    assert spans[0][1] < spans[1][0]
    assert sshf.generate(model, [reqs[1]], max_new_tokens=2, token_budget=spans[1][0],
                         encoder_cache=1 << 20) == [ref[1][:2]]
    assert (count.calls, count.items) == (2, 2)


def test_text_requests_beside_pixels_through_the_cache():
    """Requests without media (``media=None`` or none given) share a cached call with one that gives pixels."""
    model = tiny_model("qwen2_vl", seed=6)
    model.generation_config.eos_token_id = None
    reqs, hfs = _prompts(model, seed=3)
    g = torch.Generator().manual_seed(8)
    texts = [torch.randint(0, 80, (n,), generator=g) for n in (7, 12)]
    got = sshf.generate(model, [sshf.Request(texts[0], media=None), reqs[2], sshf.Request(texts[1])],
                        max_new_tokens=4, token_budget=9, encoder_cache=1 << 20)
    assert got == [hf_generate(model, 4, input_ids=texts[0][None]), hf_generate(model, 4, **hfs[2]),
                   hf_generate(model, 4, input_ids=texts[1][None])]


def test_two_models_share_a_cache_without_sharing_entries(monkeypatch):
    """Two models of one config (other weights) and one cache: each gets its own tower's rows, HF's ids; a
    second Generator of the first model hits the first's entries."""
    a, b = tiny_model("qwen2_vl", seed=1), tiny_model("qwen2_vl", seed=2)
    for m in (a, b):
        m.generation_config.eos_token_id = None
    reqs, hfs = _prompts(a, seed=4)
    cache = EncoderCache(input_embeds_width(a), torch.float32, "cpu", 1 << 20)
    for m in (a, b):
        assert sshf.generate(m, reqs, max_new_tokens=8, encoder_cache=cache) == [hf_generate(m, 8, **h) for h in hfs]
    assert len(cache) == 8  # 4 items a model
    count = _Count(a, monkeypatch)
    sshf.generate(a, reqs, max_new_tokens=1, encoder_cache=cache)
    assert count.items == 0


def test_media_keys_name_items_in_place_of_their_pixels(monkeypatch):
    """``media_keys`` (an engine's own hashes) name the entries: no pixel is hashed, a shared key is encoded once,
    items given as tensors under keys stay after the call, ``1``, ``"1"`` and ``b"1"`` are three keys."""
    model = tiny_model("qwen3_vl", seed=7)
    model.generation_config.eos_token_id = None
    reqs, hfs = _prompts(model, seed=5)
    ref = [hf_generate(model, 6, **h) for h in hfs]
    named = [replace(reqs[0], media_keys=["img-A", b"vid"]), replace(reqs[1], media_keys=[1, "1"]),
             replace(reqs[2], media_keys=["img-A"]), reqs[3]]  # prompt 2's image is prompt 0's
    gen = importlib.import_module("slabstage.hf.generate")  # (the module: slabstage.hf.generate is a function too)
    monkeypatch.setattr(gen, "content_keys", lambda *a, **k: pytest.fail("pixels hashed despite media_keys"))
    count = _Count(model, monkeypatch)
    cache = EncoderCache(input_embeds_width(model), torch.float32, "cpu", 1 << 20)
    for _ in range(2):
        assert sshf.generate(model, named, max_new_tokens=6, token_budget=16, encoder_cache=cache) == ref
    assert count.items == 4 and len(cache) == 4
    given = tiny_request(model, [(1, 4, 4)], (), text_lens=[3, 2], generator=torch.Generator().manual_seed(2))[0]
    want = sshf.generate(model, [given], max_new_tokens=3)
    assert sshf.generate(model, [replace(given, media_keys=[b"1"])], max_new_tokens=3, encoder_cache=cache) == want
    assert len(cache) == 5  # kept: it has a name
    with pytest.raises(ValueError, match="holds 4 rows but 6 were expected"):  # a name reused for other rows
        sshf.generate(model, [replace(reqs[1], media_keys=["x", b"1"])], encoder_cache=cache)
    with pytest.raises(ValueError, match=r"request 0: media_keys must be a list of 2 keys"):
        sshf.generate(model, [replace(reqs[0], media_keys=["a"])], encoder_cache=cache)
    with pytest.raises(TypeError, match=r"request 0: media_keys\[1\] must be bytes, str or int"):
        sshf.generate(model, [replace(reqs[0], media_keys=["a", 2.0])], encoder_cache=cache)
    with pytest.raises(ValueError, match="media_keys but .* is a text-only model"):
        sshf.pack_requests(tiny_model("qwen2"), [sshf.Request(torch.arange(4), media_keys=["a"])])


def test_content_keys_are_whole_digests_of_content():
    pixels = torch.randn(40, 8)
    grid = torch.tensor([[1, 4, 6], [1, 4, 4]])
    a, b = content_keys(pixels, grid, "image")
    assert len(a) == 32 and a != b
    assert content_keys(pixels[:24].clone(), grid[:1], "image") == [a]
    assert content_keys(pixels[:24], grid[:1], "video") != [a]
    assert content_keys(pixels[:24].double(), grid[:1], "image") != [a]
    assert content_keys(pixels[:24], torch.tensor([[1, 6, 4]]), "image") != [a]
    assert content_keys(pixels[:24], grid[:1], "image", b"another encoder") != [a]


def test_bad_encoder_cache_arguments():
    model = tiny_model("qwen2_vl")
    with pytest.raises(TypeError, match="encoder_cache"):
        sshf.Generator(model, max_running=1, max_context=64, encoder_cache="big")
    with pytest.raises(ValueError, match="encoder_cache holds rows of 7 columns"):
        sshf.Generator(model, max_running=1, max_context=64, encoder_cache=EncoderCache(7, torch.float32, "cpu", 4096))
    with pytest.raises(ValueError, match="text-only"):
        sshf.Generator(tiny_model("qwen2"), max_running=1, max_context=64, encoder_cache=1 << 20)
    reqs, _ = _prompts(model)
    both = sshf.Request(reqs[2].input_ids, [torch.zeros(6, 32)], image_grid_thw=reqs[2].image_grid_thw,
                        pixel_values=reqs[2].pixel_values)
    with pytest.raises(ValueError, match="request 1: it gives both media and pixels"):
        sshf.generate(model, [reqs[0], both], encoder_cache=1 << 20)
    small = EncoderCache(input_embeds_width(model), torch.float32, "cpu", 3 * input_embeds_width(model) * 4)
    with pytest.raises(ValueError, match=r"request 0: item 0 has 6 rows: an entry of 6 rows exceeds the encoder "
                                         r"cache's device budget of 3 rows \(128 bytes a row\); give it at least "
                                         r"768 bytes"):
        sshf.generate(model, [reqs[0]], token_budget=8, encoder_cache=small)
    with pytest.raises(ValueError, match="pixel_values has shape"):
        sshf.generate(model, [sshf.Request(reqs[2].input_ids, image_grid_thw=reqs[2].image_grid_thw,
                                           pixel_values=reqs[2].pixel_values[:5])], encoder_cache=1 << 20)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_generate_through_the_cache_on_cuda(family, monkeypatch):
    """Through captured graphs on the GPU, fp32: entries staged by handle give HF's ids, with a cache that holds
    everything (a second call all hits) and with one that evicts mid-run."""
    model = tiny_model(family, seed=3, device="cuda")
    model.generation_config.eos_token_id = None
    reqs, hfs = _prompts(model)
    ref = [hf_generate(model, NEW, **hf) for hf in hfs]
    count = _Count(model, monkeypatch)
    gen = sshf.Generator(model, max_running=4, max_context=128, token_budget=24, encoder_cache=1 << 20)
    assert gen.generate(reqs, max_new_tokens=NEW) == ref
    assert gen.generate(reqs, max_new_tokens=NEW) == ref and count.items == 4
    assert gen.encoder_cache.device.type == "cuda" and gen.runner.stats()["replays"]
    width = input_embeds_width(model)
    small = EncoderCache(width, torch.float32, "cuda", device_budget_bytes=14 * width * 4)
    assert sshf.generate(model, reqs, max_new_tokens=NEW, token_budget=7, max_running=2, encoder_cache=small) == ref


def test_an_item_larger_than_the_cache_is_refused_before_anything_runs(monkeypatch):
    """An item of more rows than the encoder cache's device arena could never be staged: generate refuses it as
    it checks the requests, naming the request and the item, before any request is encoded or prefilled; items
    given as tensors alike."""
    model = tiny_model("qwen2_vl")
    reqs, _ = _prompts(model)
    width = input_embeds_width(model)
    count = _Count(model, monkeypatch)
    small = EncoderCache(width, torch.float32, "cpu", 6 * width * 4)  # 6 rows: request 2's image (6 rows) fits
    ids = torch.cat([torch.tensor([92]), torch.full((8,), 90), torch.tensor([93, 5, 6])])  # an image of 8 rows
    grid = torch.tensor([[1, 4, 8]])
    large = sshf.Request(ids, image_grid_thw=grid, pixel_values=torch.randn(32, reqs[2].pixel_values.shape[1]))
    with pytest.raises(ValueError, match=r"request 1: item 0 has 8 rows: an entry of 8 rows exceeds the encoder "
                                         r"cache's device budget of 6 rows"):
        sshf.generate(model, [reqs[2], large], encoder_cache=small)
    assert count.calls == 0 and len(small) == 0  # nothing encoded, nothing put
    with pytest.raises(ValueError, match=r"request 0: item 0 has 8 rows"):
        sshf.generate(model, [sshf.Request(ids, [torch.randn(8, width)], image_grid_thw=grid)], encoder_cache=small)
    assert len(small) == 0


def test_cache_entries_given_as_media_beside_tensors_and_other_caches():
    """Requests whose media are cache entries beside requests (or items) given as tensors, and entries of two
    caches, packed into the same steps: with the generator's encoder cache, its own entries are staged where they
    lie and another cache's are copied in as tensors are; without one, a step that mixes the kinds stages the
    entries as views of their rows. The ids are HF's every way, and the given entries stay valid."""
    model = tiny_model("qwen2_vl", seed=2)
    model.generation_config.eos_token_id = None
    width = input_embeds_width(model)
    g = torch.Generator().manual_seed(4)
    made = [tiny_request(model, grids, [], text_lens=[3 + k] * (len(grids) + 1), generator=g)
            for k, grids in enumerate(([(1, 4, 6), (1, 4, 4)], [(1, 6, 4)], [(1, 4, 4)]))]
    ref = [hf_generate(model, 4, **hf) for _, hf in made]
    for mine in (None, EncoderCache(width, torch.float32, "cpu", 1 << 16)):
        other = EncoderCache(width, torch.float32, "cpu", 1 << 16)
        holders = [mine if mine is not None else EncoderCache(width, torch.float32, "cpu", 1 << 16), other]
        (r0, _), (r1, _), (r2, _) = made
        given = [holders[0].put("a", r0.media[0]), other.put("b", r1.media[0]), holders[0].put("c", r2.media[0])]
        reqs = [sshf.Request(r0.input_ids, [given[0], r0.media[1]], image_grid_thw=r0.image_grid_thw),
                sshf.Request(r1.input_ids, [given[1]], image_grid_thw=r1.image_grid_thw),
                sshf.Request(r2.input_ids, [given[2]], image_grid_thw=r2.image_grid_thw)]
        for budget in (7, 64):
            assert sshf.generate(model, reqs, max_new_tokens=4, token_budget=budget, encoder_cache=mine) == ref
        for entry, req in zip(given, (r0, r1, r2)):
            assert torch.equal(entry.cache.rows_of(entry), req.media[0])
        if mine is not None:
            assert len(mine) == 2  # its own two given entries; the call's copies dropped after it


def test_an_entry_a_request_gives_is_not_evicted_before_its_request_is_prefilled():
    """Request 0 gives its image as an entry of the generator's own cache, request 1 a tensor item, and the cache
    holds one of them at a time: request 1's put does not evict request 0's entry in the step that reads it (the
    step prefills request 0 alone first), and the ids are HF's."""
    model = tiny_model("qwen2_vl", seed=2)
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(4)
    (ra, ha), (rb, hb) = [tiny_request(model, grids, [], text_lens=[3, 4], generator=g)
                          for grids in ([(1, 4, 6)], [(1, 6, 4)])]
    ref = [hf_generate(model, 4, **ha), hf_generate(model, 4, **hb)]
    width = input_embeds_width(model)
    cache = EncoderCache(width, torch.float32, "cpu", 10 * width * 4)  # 10 rows: either 6-row item, not both
    entry = cache.put("a", ra.media[0])
    reqs = [sshf.Request(ra.input_ids, [entry], image_grid_thw=ra.image_grid_thw), rb]
    assert sshf.generate(model, reqs, max_new_tokens=4, token_budget=64, encoder_cache=cache) == ref
    assert not cache._held  # (released as its request was prefilled)
    stale = cache.put("x", torch.zeros(10, width))  # evicts "a"
    with pytest.raises(StaleEntryError, match="request 0: item 0"):
        sshf.generate(model, [sshf.Request(ra.input_ids, [entry], image_grid_thw=ra.image_grid_thw)],
                      max_new_tokens=4, encoder_cache=cache)
    assert cache.get("x") == stale
