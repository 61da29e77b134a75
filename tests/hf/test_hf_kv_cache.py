"""prefill_forward(model, cache=...): the KV cache written at out_cache_loc equals HF's past_key_values, padding
rows write only the sink (slot 0), and a prompt prefilled in chunks equals one whole prefill (hidden states and
cache). Tiny random models, fp32, on CPU (the PyTorch attention path); the CUDA tests run the Triton kernel and
check replay against eager bit for bit."""

import sys
from pathlib import Path

import pytest
import torch

import slabstage as ss

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf.tiny import FAMILIES, tiny_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from hf_prompts import _video_first_prompt  # noqa: E402
from test_hf_models import VLMS, make_requests  # noqa: E402

CONTEXT = 96
TOL = dict(rtol=1e-4, atol=1e-4)


def setup(family, device="cpu", dtype=torch.float32, capacity=160, buckets=None, requests=4):
    model = tiny_model(family, device=device, dtype=dtype)
    buffers = ss.StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=4,
                                         embed_width=sshf.input_embeds_width(model), embed_dtype=dtype,
                                         device=device, mrope=family in VLMS)
    cache = sshf.KVCache.allocate(model, requests, CONTEXT)
    g = torch.Generator(device="cpu").manual_seed(11)
    for t in cache.k + cache.v:  # poison: a slot nobody writes keeps it
        t.copy_(torch.randn(t.shape, generator=g))
    forward = sshf.prefill_forward(model, cache=cache)
    runner = ss.PrefillGraphRunner(forward, buffers, buckets=buckets, progress=False)
    return model, buffers, cache, forward, runner


def hf_run(model, ids, **media):
    """``(last hidden [L, H], [(K [L, kv, d], V) per layer])`` of HF's base model for one prompt."""
    dev = model.device  # (HF's forward takes its inputs on the model's device)
    ids = ids.to(dev)
    media = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in media.items()}
    kw = dict(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], use_cache=True, **media)
    if media:
        kw["mm_token_type_ids"] = sshf.mm_token_type_ids(model, ids[None])
    with torch.no_grad():
        out = model.base_model(**kw)
    pkv = out.past_key_values
    if hasattr(pkv, "layers"):
        kv = [(layer.keys, layer.values) for layer in pkv.layers]
    else:  # older caches
        kv = list(zip(pkv.key_cache, pkv.value_cache))
    return out.last_hidden_state[0], [(k[0].transpose(0, 1), v[0].transpose(0, 1)) for k, v in kv]


def media_of(prompt):
    ids, pv, grid = prompt
    return {} if pv is None else dict(pixel_values=pv, image_grid_thw=grid)


def cached(cache, row, length):
    slots = cache.req_to_token[row, :length].long()
    return [(k[slots], v[slots]) for k, v in zip(cache.k, cache.v)]


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_and_hidden_states_match_hf(family):
    model, buffers, cache, forward, runner = setup(family)
    requests, prompts = make_requests(model, family, "cpu", num=3 if family == "qwen3_vl" else 2)
    requests = [sshf.Request(**{**vars(r), "req_index": 3 - k}) for k, r in enumerate(requests)]  # any rows
    batch = sshf.pack_requests(model, requests, cache=cache)
    with torch.no_grad():
        out = runner.run(batch, clone=True)
    for k, (prompt, s, n) in enumerate(zip(prompts, batch.extend_start_loc.tolist(), batch.seq_lens.tolist())):
        hidden, kv = hf_run(model, prompt[0], **media_of(prompt))
        torch.testing.assert_close(out[s:s + n], hidden, **TOL)
        assert torch.equal(batch.out_cache_loc[s:s + n], cache.slots(3 - k, 0, n))
        for (k_ours, v_ours), (k_hf, v_hf) in zip(cached(cache, 3 - k, n), kv):
            torch.testing.assert_close(k_ours, k_hf, **TOL)
            torch.testing.assert_close(v_ours, v_hf, **TOL)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl", "llama"])
def test_padding_rows_write_only_the_sink(family):
    model, buffers, cache, forward, runner = setup(family)
    requests, _ = make_requests(model, family, "cpu")
    batch = sshf.pack_requests(model, requests, cache=cache)
    n, bucket = batch.num_tokens, batch.num_tokens + 13
    before = [t.clone() for t in cache.k + cache.v]
    with torch.no_grad():
        out = runner.run(batch, clone=True)
        written = [t.clone() for t in cache.k + cache.v]
        g = torch.Generator().manual_seed(3)
        buffers.input_embeds[n:bucket] = torch.randn(bucket - n, buffers.embed_width, generator=g)  # garbage
        assert buffers.out_cache_loc[n:bucket].eq(0).all()  # padding rows: slot 0
        padded = forward(buffers.registry.views(bucket))
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[:n], out, rtol=1e-5, atol=1e-5)
    real = torch.zeros(cache.num_slots, dtype=torch.bool)
    real[batch.out_cache_loc] = True
    for b, w, after in zip(before, written, cache.k + cache.v):
        assert torch.equal(after[1:][~real[1:]], b[1:][~real[1:]])  # no other slot touched
        assert torch.equal(after[real], w[real])  # the padded forward rewrote the real slots with the same values
        assert not torch.equal(after[0], b[0])  # the sink took the padding rows


def test_forward_without_cache_writes_nothing_and_ignores_prefix_lens():
    model, buffers, cache, _, runner_cached = setup("qwen2")
    forward = sshf.prefill_forward(model)
    runner = ss.PrefillGraphRunner(forward, buffers, progress=False)
    requests, prompts = make_requests(model, "qwen2", "cpu")
    before = [t.clone() for t in cache.k + cache.v]
    batch = sshf.pack_requests(model, requests)
    assert batch.prefix_lens.eq(0).all() and batch.out_cache_loc is None
    with torch.no_grad():
        out = runner.run(batch, clone=True)
        buffers.prefix_lens[:2] = 5  # nothing to read: ignored
        again = forward(buffers.registry.views(batch.num_tokens))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v))
    assert torch.equal(out, again)
    for prompt, s, n in zip(prompts, batch.extend_start_loc.tolist(), batch.seq_lens.tolist()):
        torch.testing.assert_close(out[s:s + n], hf_run(model, prompt[0])[0], **TOL)


def _chunked_vs_whole(family, requests, hf_media, cuts, device="cpu"):
    """Prefill ``requests`` whole (rows 0..k), then in chunks at ``cuts`` (per request, one batch per cut step,
    every request in each batch, rows k+1..): hidden states of each chunk and the cache contents agree."""
    model, buffers, cache, forward, runner = setup(family, device, capacity=200, requests=2 * len(requests))
    k = len(requests)
    with torch.no_grad():
        whole = sshf.pack_requests(model, [sshf.Request(**{**vars(r), "req_index": i})
                                           for i, r in enumerate(requests)], cache=cache)
        out = runner.run(whole, clone=True)
        steps = len(cuts[0]) + 1
        for step in range(steps):
            batch_requests = []
            for i, r in enumerate(requests):
                bounds = [0, *cuts[i], r.input_ids.shape[0]]
                batch_requests.append(sshf.Request(**{**vars(r), "req_index": k + i,
                                                      "chunk": (bounds[step], bounds[step + 1])}))
            batch = sshf.pack_requests(model, batch_requests, cache=cache)
            part = runner.run(batch, clone=True)
            for i, r in enumerate(batch_requests):
                s, n = batch.extend_start_loc[i].item(), batch.seq_lens[i].item()
                a = r.chunk[0] + whole.extend_start_loc[i].item()
                torch.testing.assert_close(part[s:s + n], out[a:a + n], **TOL)
    for i, (r, media) in enumerate(zip(requests, hf_media)):
        L = r.input_ids.shape[0]
        hidden, kv = hf_run(model, r.input_ids, **media)
        s = whole.extend_start_loc[i].item()
        torch.testing.assert_close(out[s:s + L], hidden, **TOL)
        for (kw, vw), (kc, vc), (kh, vh) in zip(cached(cache, i, L), cached(cache, k + i, L), kv):
            torch.testing.assert_close(kc, kw, **TOL)
            torch.testing.assert_close(vc, vw, **TOL)
            torch.testing.assert_close(kc, kh, **TOL)
            torch.testing.assert_close(vc, vh, **TOL)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_vl", "llama", "qwen3"])
def test_chunked_prefill_equals_one_whole_prefill(family):
    model = tiny_model(family)
    requests, prompts = make_requests(model, family, "cpu")
    cuts = []
    for r in requests:
        ids = r.input_ids
        if family in VLMS:
            image = (ids == model.config.image_token_id).nonzero().flatten().tolist()
            cuts.append([image[1], image[len(image) // 2] + 1])  # both cuts inside images
        else:
            cuts.append([3, ids.shape[0] - 4])
    _chunked_vs_whole(family, requests, [media_of(p) for p in prompts], cuts)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_chunked_prefill_through_a_video(family):
    model = tiny_model(family)
    ids, hf, images, videos, igrid, vgrid = _video_first_prompt(model, family, [[1, 4, 4]])
    request = sshf.Request(ids, images + videos, image_grid_thw=igrid, video_grid_thw=vgrid)
    video = (ids == model.config.video_token_id).nonzero().flatten().tolist()
    _chunked_vs_whole(family, [request], [hf], [[video[3], video[-2]]])


def test_refusals():
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="max_context"):
        sshf.KVCache.allocate(model, 2, 0)
    cache = sshf.KVCache.allocate(model, 2, 16)
    assert cache.req_to_token[1, 0].item() == 17 and cache.k[0].shape == (33, 2, 8)
    ids = torch.arange(10)
    with pytest.raises(ValueError, match="share a req_index"):
        sshf.pack_requests(model, [sshf.Request(ids), sshf.Request(ids, req_index=0)], cache=cache)
    table = cache.req_to_token.clone()
    with pytest.raises(ValueError, match="request 1: .*max_context"):
        sshf.pack_requests(model, [sshf.Request(ids), sshf.Request(torch.arange(20))], cache=cache)
    assert torch.equal(cache.req_to_token, table)  # nothing written
    with pytest.raises(ValueError, match="request rows"):
        sshf.pack_requests(model, [sshf.Request(ids, req_index=2)], cache=cache)
    other = sshf.KVCache.allocate(tiny_model("qwen2", kv_heads=4), 2, 16)
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        sshf.prefill_forward(model, cache=other)
    with pytest.raises(TypeError, match="KVCache"):
        sshf.prefill_forward(model, cache=object())
    sliding = tiny_model("qwen2")
    sliding.config.layer_types = ["sliding_attention"] * 2
    with pytest.raises(ValueError, match="full-attention"):
        sshf.KVCache.allocate(sliding, 2, 16)


# -- CUDA: the Triton kernel, captured replay ---------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_replay_with_cache_matches_eager_bitwise(family, dtype):
    model, buffers, cache, forward, runner = setup(family, "cuda", dtype, buckets=[32, 64, 96, 128, 160])
    runner.max_padding_ratio = 64.0
    runner.capture()
    assert runner.captured
    requests, prompts = make_requests(model, family, "cuda")
    batch = sshf.pack_requests(model, requests, cache=cache)
    with torch.no_grad():
        out = runner.run(batch, clone=True)
        bucket = runner.last_bucket
        assert bucket is not None and bucket > batch.num_tokens
        replayed = [t.clone() for t in cache.k + cache.v]
        ref = forward(buffers.registry.views(bucket))[:batch.num_tokens]
    assert torch.equal(out, ref)
    real = batch.out_cache_loc.to("cuda")
    for a, b in zip(replayed, cache.k + cache.v):
        assert torch.equal(a[real], b[real])
    if dtype == torch.float32:
        for k, (prompt, s, n) in enumerate(zip(prompts, batch.extend_start_loc.tolist(), batch.seq_lens.tolist())):
            hidden, kv = hf_run(model, *prompt[:1], **media_of(prompt))
            torch.testing.assert_close(out[s:s + n], hidden, **TOL)
            for (ko, vo), (kh, vh) in zip(cached(cache, k, n), kv):
                torch.testing.assert_close(ko, kh, **TOL)
                torch.testing.assert_close(vo, vh, **TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["qwen3_vl", "llama"])
def test_chunked_prefill_on_cuda(family):
    model = tiny_model(family, device="cuda")
    requests, prompts = make_requests(model, family, "cuda")
    cuts = [[5, r.input_ids.shape[0] - 7] for r in requests]
    _chunked_vs_whole(family, requests, [media_of(p) for p in prompts], cuts, device="cuda")


def test_forwards_on_two_threads_each_attend_their_own_batch():
    """Two threads run eager forwards of one model at once: the attention implementation the forward swaps in
    is never restored under the other's feet, and each gets its single-thread answer."""
    import threading

    model, buffers, _, _, _ = setup("qwen2")
    forward = sshf.prefill_forward(model)
    requests, _ = make_requests(model, "qwen2", "cpu")
    batch = sshf.pack_requests(model, requests)
    with torch.no_grad():
        ss.PrefillGraphRunner(forward, buffers, progress=False).run(batch)
        views = {k: v.clone() for k, v in buffers.registry.views(batch.num_tokens).items()}
        want = forward(views)
    got, errors = [], []

    def work():
        try:
            with torch.no_grad():
                for _ in range(4):
                    got.append(forward(views))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 8 and all(torch.equal(g, want) for g in got)
    assert all(layer.self_attn.config._attn_implementation != sshf.attention.NAME for layer in model.model.layers)


def test_a_batch_without_the_cache_slots_is_refused_by_a_cache_forward():
    """pack_requests without cache= gives no out_cache_loc: a forward that writes the cache would write this
    batch's K and V at the last batch's slots (maybe other requests'). The runner refuses it, writing nothing."""
    model, buffers, cache, forward, runner = setup("qwen2")
    requests, _ = make_requests(model, "qwen2", "cpu")
    before = [t.clone() for t in cache.k + cache.v]
    with pytest.raises(ValueError, match="out_cache_loc"):
        runner.run(sshf.pack_requests(model, requests))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v))
    runner.run(sshf.pack_requests(model, requests, cache=cache))  # the same requests with the cache's slots
