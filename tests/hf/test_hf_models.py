"""slabstage.hf against each model family's own Hugging Face forward.

Tiny random configs (slabstage.hf.tiny: nothing is downloaded), two or three packed
prompts (1-2 images each for the VLMs), staged through PrefillGraphRunner and compared
with the HF base model run per prompt with its attention mask. Skipped without transformers.
"""

import pytest
import torch

import slabstage as ss

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.cache import EncoderCache  # noqa: E402
from slabstage.hf.tiny import FAMILIES, tiny_model, tiny_prompt  # noqa: E402

VLMS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
GRIDS = [[(1, 4, 6)], [(1, 4, 4), (1, 6, 4)], [(1, 4, 4)]]
CAPACITY = 160


def hf_reference(model, ids, pv, grid):
    """The HF base model's last hidden states for one prompt, with its attention mask."""
    kw = dict(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], use_cache=False)
    if pv is not None:
        kw.update(pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=sshf.mm_token_type_ids(model, ids[None]))
    return model.base_model(**kw).last_hidden_state[0]


def make_requests(model, family, device, num=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    requests, prompts = [], []
    for k in range(num):
        if family in VLMS:
            ids, pv, grid = tiny_prompt(model, GRIDS[k], text_lens=[3 + k, 4, 2 + k][:len(GRIDS[k]) + 1], generator=g)
            pv = pv.to(device)
            items = sshf.media_items(model, pixel_values=pv, image_grid_thw=grid)
            requests.append(sshf.Request(ids, items, image_grid_thw=grid))
        else:
            ids, pv, grid = torch.randint(0, 80, (13 + 9 * k,), generator=g), None, None
            requests.append(sshf.Request(ids))
        prompts.append((ids, pv, grid))
    return requests, prompts


def setup(family, device="cpu", dtype=torch.float32, buckets=None, capacity=CAPACITY):
    model = tiny_model(family, device=device, dtype=dtype)
    buffers = ss.StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=4,
                                         embed_width=sshf.input_embeds_width(model), embed_dtype=dtype,
                                         device=device, mrope=family in VLMS)
    forward = sshf.prefill_forward(model)
    runner = ss.PrefillGraphRunner(forward, buffers, buckets=buckets, progress=False)
    return model, buffers, forward, runner


def compare_with_hf(model, batch, out, prompts, tol):
    starts, lens = batch.extend_start_loc.tolist(), batch.seq_lens.tolist()
    with torch.no_grad():
        for (ids, pv, grid), s, n in zip(prompts, starts, lens):
            ref = hf_reference(model, ids.to(out.device), pv, None if grid is None else grid.to(out.device))
            torch.testing.assert_close(out[s:s + n].float(), ref.float(), **tol)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_prompts_match_hf_on_cpu(family):
    model, buffers, forward, runner = setup(family)
    runner.capture()  # no CUDA: eager
    requests, prompts = make_requests(model, family, "cpu", num=3 if family == "qwen3_vl" else 2)
    batch = sshf.pack_requests(model, requests)
    with torch.no_grad():
        out = runner.run(batch, clone=True)
    assert out.shape == (batch.num_tokens, model.config.get_text_config().hidden_size)
    assert out.dtype == torch.float32
    compare_with_hf(model, batch, out, prompts, dict(rtol=1e-4, atol=1e-4))


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl", "llama"])
def test_padding_rows_never_reach_real_rows(family):
    model, buffers, forward, runner = setup(family)
    requests, _ = make_requests(model, family, "cpu")
    batch = sshf.pack_requests(model, requests)
    n, bucket = batch.num_tokens, batch.num_tokens + 13
    with torch.no_grad():
        out = runner.run(batch, clone=True)
        g = torch.Generator().manual_seed(3)
        buffers.input_embeds[n:bucket] = torch.randn(bucket - n, buffers.embed_width, generator=g)  # garbage past n
        buffers.positions[n:bucket] = 7
        if buffers.mrope_positions is not None:
            buffers.mrope_positions[:, n:bucket] = 5
        padded = forward(buffers.registry.views(bucket))
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[:n], out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_deepstack_columns_matter(family):
    model, buffers, forward, runner = setup(family)
    requests, _ = make_requests(model, family, "cpu")
    batch = sshf.pack_requests(model, requests)
    n, H = batch.num_tokens, model.config.text_config.hidden_size
    with torch.no_grad():
        out = runner.run(batch, clone=True)
        is_media = batch.media_index.cpu() >= 0
        assert buffers.input_embeds[:n, H:][~is_media].abs().max() == 0  # text rows carry zeros there
        assert buffers.input_embeds[:n, H:][is_media].abs().max() > 0
        buffers.input_embeds[:n, H:] = 0
        flat = forward(buffers.registry.views(n))
    assert (flat - out).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_vl"])
def test_chunk_that_cuts_an_image_stages_the_whole_prompts_rows(family):
    model, buffers, forward, runner = setup(family)
    requests, _ = make_requests(model, family, "cpu")
    req = requests[1]  # two images
    ids = req.input_ids
    image_rows = (ids == model.config.image_token_id).nonzero().flatten().tolist()
    start, end = image_rows[2], image_rows[-3] + 1  # starts inside image 0, ends inside image 1
    whole = sshf.pack_requests(model, [req])
    chunk = sshf.pack_requests(model, [requests[0], sshf.Request(**{**vars(req), "chunk": (start, end)})])
    first = requests[0].input_ids.shape[0]
    with torch.no_grad():
        runner.run(whole)
        rows = buffers.input_embeds[start:end].clone()
        positions, mrope = buffers.positions[start:end].clone(), buffers.mrope_positions[:, start:end].clone()
        runner.run(chunk)
    cut = slice(first, first + end - start)
    assert torch.equal(buffers.input_embeds[cut], rows)
    assert torch.equal(buffers.positions[cut], positions)
    assert torch.equal(buffers.mrope_positions[:, cut], mrope)
    assert chunk.seq_lens.tolist() == [first, end - start]


def test_width_contract():
    from transformers import GPT2Config, GPT2Model, Qwen3VLTextModel

    q3 = tiny_model("qwen3_vl", deepstack=3)
    assert sshf.input_embeds_width(q3) == 32 * 3  # 3 levels, 2 decoder layers: HF applies 2
    assert sshf.input_embeds_width(tiny_model("qwen3_vl", bare=True)) == 96  # Qwen3VLModel
    assert sshf.input_embeds_width(tiny_model("qwen2_5_vl")) == 32
    assert sshf.input_embeds_width(tiny_model("llama", bare=True)) == 32
    q3.input_embeds_hidden_size = 128  # a declaration wins
    assert sshf.input_embeds_width(q3) == 128
    q3.input_embeds_hidden_size = 64  # but never below what the model needs
    with pytest.raises(ss.WidthContractError, match="below"):
        sshf.input_embeds_width(q3)
    text = Qwen3VLTextModel(q3.config.text_config)
    for fn in (sshf.input_embeds_width, sshf.prefill_forward, sshf.media_items):
        with pytest.raises(ss.WidthContractError, match="text model of a VLM"):
            fn(text)
    wide = tiny_model("qwen2_5_vl")
    wide.config.vision_config.out_hidden_size = 48
    with pytest.raises(ss.WidthContractError, match="48"):
        sshf.input_embeds_width(wide)
    with pytest.raises(TypeError, match="not supported"):
        sshf.input_embeds_width(GPT2Model(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_an_empty_grid_gives_no_items(family):
    """A grid of no rows with no pixel rows: no items and no tower call, with or without a cache (HF's towers
    refuse an empty grid); a prompt without placeholders generates as with no media."""
    model = tiny_model(family)
    model.generation_config.eos_token_id = None
    none = torch.empty(0, 3, dtype=torch.int64)
    pixels = torch.empty(0, 3 * 2 * 4 * 4)  # (channels, temporal patch, patch, patch: tiny_model's)
    cache = EncoderCache(sshf.input_embeds_width(model), torch.float32, "cpu", 1 << 16)
    assert sshf.media_items(model, pixels, none, pixels, none) == []
    assert sshf.media_items(model, pixels, none, encoder_cache=cache, keys=[]) == []
    ids = torch.randint(0, 80, (9,), generator=torch.Generator().manual_seed(0))
    request = sshf.Request(ids, image_grid_thw=none, pixel_values=pixels)
    assert sshf.generate(model, [request], max_new_tokens=3) == sshf.generate(model, [sshf.Request(ids)],
                                                                              max_new_tokens=3)


def test_mrope_positions_need_token_types():
    model = tiny_model("qwen2_5_vl")
    ids, _, grid = tiny_prompt(model, [(1, 4, 6)])
    pos = sshf.mrope_positions(model, ids, grid)
    assert pos.shape == (3, ids.shape[0]) and pos.dtype == torch.int64
    assert not torch.equal(pos[1], pos[2])  # real 3-D positions, not the 1-D fallback
    with pytest.raises(TypeError, match="1-D positions"):
        sshf.mrope_positions(tiny_model("qwen3"), ids)


def test_placeholder_count_mismatch_is_refused():
    model = tiny_model("qwen3_vl")
    requests, _ = make_requests(model, "qwen3_vl", "cpu")
    bad = sshf.Request(requests[1].input_ids, requests[1].media[:1], image_grid_thw=requests[1].image_grid_thw)
    with pytest.raises(ValueError, match="placeholder"):
        sshf.pack_requests(model, [bad])


# -- CUDA: captured replay ------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_replay_matches_eager_and_hf(family, dtype):
    buckets = [16, 32, 64, 96, 128, 160]
    model, buffers, forward, runner = setup(family, "cuda", dtype, buckets=buckets)
    runner.max_padding_ratio = 64.0
    runner.capture()
    assert runner.captured
    requests, prompts = make_requests(model, family, "cuda")
    batch = sshf.pack_requests(model, requests)
    with torch.no_grad():
        out = runner.run(batch, clone=True)
        bucket = runner.last_bucket
        assert bucket is not None and bucket > batch.num_tokens  # replayed with padding
        ref = forward(buffers.registry.views(bucket))[:batch.num_tokens]
    assert torch.equal(out, ref)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=1e-1)
    compare_with_hf(model, batch, out, prompts, tol)


@pytest.mark.cuda
def test_capture_takes_no_host_sync():
    model, buffers, forward, runner = setup("qwen3_vl", "cuda", torch.bfloat16, buckets=[64, 128])
    runner.capture()
    requests, _ = make_requests(model, "qwen3_vl", "cuda")
    batch = sshf.pack_requests(model, requests)
    with torch.no_grad():
        runner.run(batch)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner.run(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_demo_main_runs_on_cpu(capsys):
    from slabstage.hf.demo import main

    assert main(["--device", "cpu", "--hidden", "32"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3VLForConditionalGeneration" in out and "OK: every request" in out
    assert "OK: every prompt generates HF's tokens, token for token" in out and out.count(": equal") == 3


@pytest.mark.parametrize("family", ["llama", "qwen2_5_vl", "qwen3_vl"])
def test_one_request_buffers_match_hf(family):
    """Buffers of one request a batch (``max_batch_size=1``) match HF."""
    model = tiny_model(family)
    buffers = ss.StagingBuffers.allocate(max_num_tokens=CAPACITY, max_batch_size=1,
                                         embed_width=sshf.input_embeds_width(model), embed_dtype=torch.float32,
                                         device="cpu", mrope=family in VLMS)
    runner = ss.PrefillGraphRunner(sshf.prefill_forward(model), buffers, progress=False)
    requests, prompts = make_requests(model, family, "cpu", num=1)
    batch = sshf.pack_requests(model, requests)
    with torch.no_grad():
        out = runner.run(batch, clone=True)
    compare_with_hf(model, batch, out, prompts, dict(rtol=1e-4, atol=1e-4))
