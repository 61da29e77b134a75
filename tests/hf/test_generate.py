"""slabstage.hf.generate against HF's own greedy ``generate``, token for token.

Tiny random models (slabstage.hf.tiny), fp32 on the host: prompts of several lengths (images and videos for the
VLMs), packed several to a prefill step and cut into chunks by a small token budget (cuts inside images), at
least 16 new tokens, and an EOS id that ends the requests at different lengths. Skipped without transformers.
"""

import pytest
import torch

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf.generate import decode_buckets, hf_generate  # noqa: E402
from slabstage.hf.tiny import tiny_model, tiny_request  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
NEW = 16
# per family: the prompts' (images, videos) and Qwen2.5-VL's seconds per video grid
PROMPTS = {
    "llama": [((), ()), ((), ()), ((), ())],
    "qwen2": [((), ()), ((), ())],
    "qwen3": [((), ()), ((), ()), ((), ())],
    "qwen2_vl": [([(1, 4, 6)], ()), ([(1, 4, 4), (1, 6, 4)], [(2, 4, 4)]), ((), ())],
    "qwen2_5_vl": [([(1, 4, 4)], [(2, 4, 6)]), ((), [(2, 4, 4), (3, 4, 4)]), ([(1, 6, 4)], ())],
    "qwen3_vl": [([(1, 4, 6)], [(2, 4, 4)]), ([(1, 4, 4), (1, 6, 4)], ()), ((), [(3, 4, 4)])],
}
SECONDS = {1: [0.5, 2.0], 0: [1.0]}  # Qwen2.5-VL's second_per_grid_ts of the prompts with videos


def _requests(model, family, seed=0, text=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, (images, videos) in enumerate(PROMPTS[family]):
        lens = text or [3 + 4 * k + j for j in range(len(images) + len(videos) + 1)]
        if not images and not videos:
            lens = [11 + 13 * k]  # text-only prompts of several lengths
        seconds = torch.tensor(SECONDS[k]) if family == "qwen2_5_vl" and videos else None
        out.append(tiny_request(model, images, videos, text_lens=lens, seconds=seconds, generator=g))
    return out


def _hf(model, prompts, eos=None):
    return [hf_generate(model, NEW, eos_token_id=eos, **hf) for _, hf in prompts]


@pytest.mark.parametrize("family", list(PROMPTS))
def test_generate_equals_hf_generate(family):
    """Packed and chunked prefill (the budget cuts prompts, images among them), then decode; an EOS id taken from
    HF's own output ends the requests at different lengths."""
    model = tiny_model(family, seed=3)
    model.generation_config.eos_token_id = None  # (Llama's config has one)
    prompts = _requests(model, family)
    free = _hf(model, prompts)
    assert all(len(ids) == NEW for ids in free)
    eos = free[0][NEW // 2]  # an id HF generates half way through the first request: it ends there (or earlier)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    ref = _hf(model, prompts, eos)
    assert len({len(ids) for ids in ref}) > 1 or len(ref[0]) < NEW  # the EOS ends them at different lengths
    ours = sshf.generate(model, [r for r, _ in prompts], max_new_tokens=NEW, token_budget=24)
    assert ours == ref
    # without EOS: every request NEW ids, equal to HF's as well
    assert sshf.generate(model, [r for r, _ in prompts], max_new_tokens=NEW, token_budget=24, eos_token_id=[]) \
        == free


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2"])
def test_a_model_whose_parameters_require_grad_leaves_no_autograd_history(family):
    """A model as from_pretrained leaves it (parameters require grad), generate called without no_grad, as HF's
    generate is: the ids are HF's, and neither the KV cache, the encoder cache's arena nor the media items record
    autograd history (it would keep every step's activations alive)."""
    from slabstage.cache import EncoderCache
    from slabstage.hf.width import input_embeds_width

    model = tiny_model(family, seed=4)
    model.generation_config.eos_token_id = None
    prompts = _requests(model, family)
    ref = [hf_generate(model, 4, **hf) for _, hf in prompts]
    model.requires_grad_(True)
    items = sshf.media_items(model, **{k: v for k, v in prompts[0][1].items() if k in (
        "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}) if model.config.model_type \
        != "qwen2" else []
    assert all(not t.requires_grad for item in items for t in (item if isinstance(item, tuple) else (item,)))
    cache = EncoderCache(input_embeds_width(model), torch.float32, "cpu", 1 << 16) if items else None
    gen = sshf.Generator(model, max_running=2, max_context=128, token_budget=16, encoder_cache=cache)
    reqs = [sshf.Request(r.input_ids, image_grid_thw=r.image_grid_thw, video_grid_thw=r.video_grid_thw,
                         pixel_values=hf.get("pixel_values"), pixel_values_videos=hf.get("pixel_values_videos"))
            for r, hf in prompts] if items else [r for r, _ in prompts]
    assert gen.generate(reqs, max_new_tokens=4) == ref
    for t in [*gen.cache.k, *gen.cache.v] + ([cache.arena] if cache is not None else []):
        assert not t.requires_grad and t.grad_fn is None
    if cache is not None:
        cache.put("a tensor that requires grad", torch.randn(3, cache.width, requires_grad=True))
        assert not cache.arena.requires_grad and cache.arena.grad_fn is None


def test_requests_queue_for_cache_rows_and_budgets_vary():
    """Fewer cache rows than requests (a finished request's row is reused) and other budgets (7 tokens a step cuts
    the first prompt's image at its third row): the same ids."""
    model = tiny_model("qwen3_vl", seed=5)
    prompts = _requests(model, "qwen3_vl", seed=2, text=[4, 9, 2, 6])
    model.generation_config.eos_token_id = None
    ref = _hf(model, prompts)
    reqs = [r for r, _ in prompts]
    for budget, running in ((7, 1), (64, 2), (2, 3)):  # (a budget under the running requests: decode fits)
        assert sshf.generate(model, reqs, max_new_tokens=NEW, token_budget=budget, max_running=running) == ref


def test_bad_arguments_are_refused():
    model = tiny_model("qwen3")
    req = sshf.Request(torch.arange(5))
    for kw, match in ((dict(max_new_tokens=0), "max_new_tokens"), (dict(token_budget=True), "token_budget"),
                      (dict(max_running=0), "max_running")):
        with pytest.raises(ValueError, match=match):
            sshf.generate(model, [req], **kw)
    with pytest.raises(TypeError, match="request 1"):
        sshf.generate(model, [req, torch.arange(3)])
    assert sshf.generate(model, []) == []
    gen = sshf.Generator(model, max_running=1, max_context=8, token_budget=16)
    with pytest.raises(ValueError, match="request 0: 5 prompt tokens and 4 new ones exceed the cache's max_context"):
        gen.generate([req], max_new_tokens=4)
    vlm = tiny_model("qwen2_vl")
    (good, _), = _requests(vlm, "qwen2_vl")[:1]
    bad = sshf.Request(good.input_ids, good.media, image_grid_thw=torch.tensor([[1, 4, 4]]))  # the grid is (1, 4, 6)
    with pytest.raises(ValueError, match="request 1"):
        sshf.generate(vlm, [good, bad])
    for option in ("buckets", "enforce_eager"):
        with pytest.raises(ValueError, match=f"runner_options sets '{option}'"):
            sshf.generate(model, [req], runner_options={option: [16] if option == "buckets" else True})


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(12) == [1, 2, 4, 8, 12]


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl", "qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_through_graphs_on_cuda(family, dtype):
    """Through captured graphs on the GPU: fp32 equals HF; bf16 reports where each request first differs."""
    model = tiny_model(family, seed=3, device="cuda", dtype=dtype)
    model.generation_config.eos_token_id = None
    prompts = _requests(model, family)
    ref = _hf(model, prompts)
    ours = sshf.generate(model, [r for r, _ in prompts], max_new_tokens=NEW, token_budget=24)
    if dtype == torch.float32:
        assert ours == ref
        return
    first = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(ours, ref)]
    print(f"{family} bf16: first differing new token per request (None: all equal): {first}")


@pytest.mark.cuda
def test_one_host_sync_a_step_on_cuda():
    """Under CUDA's sync debug mode, a generation syncs the host at most once a step (the ids read back)."""
    import warnings

    from slabstage.hf.generate import Generator

    model = tiny_model("qwen3_vl", seed=3, device="cuda")
    requests = [r for r, _ in _requests(model, "qwen3_vl")]
    gen = Generator(model, max_running=len(requests), max_context=256, token_budget=24)
    gen.generate(requests, max_new_tokens=4, eos_token_id=[])  # warm-up
    before = sum(gen.runner.stats()["replays"].values()) + sum(gen.runner.stats()["eager"].values())
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            gen.generate(requests, max_new_tokens=NEW, eos_token_id=[])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    stats = gen.runner.stats()
    steps = sum(stats["replays"].values()) + sum(stats["eager"].values()) - before
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    assert steps > NEW and stats["replays"] and len(syncs) <= steps, (steps, [str(w.message) for w in syncs[:5]])


def test_demo_generates_beside_hf_and_fails_on_a_difference(capsys, monkeypatch):
    import sys

    from slabstage.hf import demo

    generate_module = sys.modules["slabstage.hf.generate"]  # (slabstage.hf.generate is the function)

    assert demo.main(["--device", "cpu", "--model", "llama", "--hidden", "32", "--new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "OK: every prompt generates HF's tokens, token for token" in out and out.count(": equal") == 3
    real = generate_module.hf_generate
    monkeypatch.setattr(generate_module, "hf_generate", lambda *a, **k: [t + 1 for t in real(*a, **k)])
    assert demo.main(["--device", "cpu", "--model", "qwen2", "--hidden", "32", "--new-tokens", "16"]) == 1
    out = capsys.readouterr().out
    assert "first differs at new token 0" in out and "FAILED: 3 of 3 prompts" in out
