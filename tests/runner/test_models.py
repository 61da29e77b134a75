"""The toy multimodal model: width contract, encoder widths, forward shapes, padding, make_batch."""

import pytest
import torch

import slabstage as ss
from slabstage.models import VARIANTS, ToyMultimodalModel, make_batch, packed_causal_mask

H, K, HC = 64, 2, 4  # small, so the CPU suite stays fast; the defaults are exercised by the demo tests


def toy(variant, device="cpu", **kw):
    return ToyMultimodalModel(variant, hidden_size=H, num_heads=4, deepstack_k=K, hc_mult=HC, vocab_size=97,
                              patch_dim=12, device=device, **kw)


def views(embeds, positions):
    return {"input_embeds": embeds, "positions": positions}


def packed_positions(lens, device):
    return torch.cat([torch.arange(n, device=device) for n in lens])


# -- width contract --------------------------------------------------------------------------------
@pytest.mark.parametrize("variant, width, expand", [
    ("plain", H, "zeros"), ("deepstack", H * (1 + K), "zeros"), ("hc", H * HC, "repeat")])
def test_width_contract(variant, width, expand):
    model = toy(variant)
    assert model.embed_width == width
    assert model.expand == expand
    assert ss.resolve_input_embeds_width(model, H) == width
    if variant == "plain":
        assert not hasattr(model, "input_embeds_hidden_size")  # declares nothing: the config width
    else:
        assert model.input_embeds_hidden_size == width


def test_default_sizes_declare_the_documented_widths():
    assert ToyMultimodalModel("plain").embed_width == 256
    assert ToyMultimodalModel("deepstack").embed_width == 256 * 3
    assert ToyMultimodalModel("hc").embed_width == 256 * 4


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="variant"):
        ToyMultimodalModel("wide")
    with pytest.raises(ValueError, match="head size"):
        ToyMultimodalModel("plain", hidden_size=60, num_heads=8)
    with pytest.raises(ValueError, match="deepstack_k"):
        ToyMultimodalModel("deepstack", hidden_size=H, num_layers=2, deepstack_k=3)
    with pytest.raises(ValueError, match="hidden_size"):
        ToyMultimodalModel("plain", hidden_size=0)


def test_weights_come_from_the_seed():
    a, b, c = toy("hc", seed=5), toy("hc", seed=5), toy("hc", seed=6)
    for (name, pa), pb, _pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert not pa.requires_grad
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)


# -- encoder, forward ------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_encode_width(device, variant):
    model = toy(variant, device)
    rows = model.encode(torch.randn(7, 12))  # host patches: encode moves them
    want = H * (1 + K) if variant == "deepstack" else H
    assert rows.shape == (7, want) and model.media_width == want
    assert rows.device.type == device.type and rows.dtype == model.dtype
    assert torch.isfinite(rows).all()
    with pytest.raises(ValueError, match="patches"):
        model.encode(torch.randn(7, 13))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_shape(device, variant, dtype):
    model = toy(variant, device, dtype=dtype)
    for T in (1, 13, 40):
        embeds = torch.randn(T, model.embed_width, device=device, dtype=dtype)
        out = model(views(embeds, packed_positions([T], device)))
        assert out.shape == (T, H) and out.dtype == dtype and out.device.type == device.type
        assert torch.isfinite(out.float()).all()


def test_forward_rejects_a_slab_of_the_wrong_width():
    model = toy("deepstack")
    with pytest.raises(ValueError, match=r"input_embeds \[T, 192\]"):
        model(views(torch.randn(5, H), torch.arange(5)))


def test_packed_causal_mask():
    mask = packed_causal_mask(torch.tensor([0, 1, 2, 0, 1, 0, 0]))
    want = torch.zeros(7, 7, dtype=torch.bool)
    for lo, hi in ((0, 3), (3, 5), (5, 6), (6, 7)):
        want[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    assert torch.equal(mask, want)


# Matmuls and attention over a different number of rows may block their reductions differently,
# so rows agree to rounding, not bit for bit: fp32 with a tight tolerance (a little looser on CUDA,
# where attention kernels tile the key axis). Bit-exactness is claimed, and tested, only between a
# graph replay and an eager forward at the same bucket (tests/runner/test_graph_runner.py).
def tight(device):
    return dict(rtol=1e-5, atol=1e-5) if device.type == "cpu" else dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pad_rows_do_not_change_real_rows(device, variant):
    torch.manual_seed(0)
    model = toy(variant, device)
    n, pad = 29, 19
    embeds = torch.randn(n + pad, model.embed_width, device=device)
    positions = torch.cat([packed_positions([11, 18], device), torch.zeros(pad, dtype=torch.long, device=device)])
    alone = model(views(embeds[:n], positions[:n]))
    zero_padded = embeds.clone()
    zero_padded[n:] = 0
    padded = model(views(zero_padded, positions))
    assert torch.allclose(padded[:n], alone, **tight(device))
    # pad rows are sequences of their own whatever they hold: garbage there changes nothing either
    garbage = model(views(embeds, positions))
    assert torch.allclose(garbage[:n], alone, **tight(device))


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_sequences_do_not_see_each_other(device, variant):
    torch.manual_seed(1)
    model = toy(variant, device)
    lens = [9, 1, 14]
    embeds = torch.randn(sum(lens), model.embed_width, device=device)
    packed = model(views(embeds, packed_positions(lens, device)))
    start = 0
    for n in lens:
        alone = model(views(embeds[start:start + n], packed_positions([n], device)))
        assert torch.allclose(packed[start:start + n], alone, **tight(device))
        start += n


def test_deepstack_columns_feed_early_layers():
    model = toy("deepstack")
    embeds = torch.randn(6, model.embed_width)
    base = model(views(embeds, torch.arange(6)))
    for block in range(1, K + 1):  # each extra column block changes the output
        poked = embeds.clone()
        poked[:, H * block:H * (block + 1)] += 1
        assert not torch.allclose(model(views(poked, torch.arange(6))), base)
    text_only = embeds.clone()
    text_only[:, H:] = 0  # what a text row carries: nothing past the hidden size
    assert torch.isfinite(model(views(text_only, torch.arange(6)))).all()


def test_hc_streams_are_mixed_with_learned_weights():
    model = toy("hc")
    embeds = torch.randn(5, H).repeat(1, HC)  # a repeated (text-like) row
    out = model(views(embeds, torch.arange(5)))
    with torch.no_grad():
        model.hc_scale.mul_(2)
    assert not torch.allclose(model(views(embeds, torch.arange(5))), out)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_has_no_host_sync(variant):
    model = toy(variant, "cuda", dtype=torch.bfloat16)
    embeds = torch.randn(48, model.embed_width, device="cuda", dtype=torch.bfloat16)
    positions = packed_positions([20, 28], "cuda")
    model(views(embeds, positions))  # warm-up outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(views(embeds, positions))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# -- make_batch ------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens, num_seqs, fraction", [(1, 1, 0.5), (37, 3, 0.4), (64, 4, 0.0), (23, 2, 1.0)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_make_batch(device, variant, num_tokens, num_seqs, fraction):
    model = toy(variant, device)
    g = torch.Generator().manual_seed(7)
    batch = make_batch(model, num_tokens, media_fraction=fraction, num_seqs=num_seqs, generator=g)
    n = num_tokens
    assert isinstance(batch, ss.PrefillBatch) and batch.num_tokens == n
    assert batch.input_ids.device.type == "cpu" and batch.positions.device.type == "cpu"  # host ints
    assert batch.table is model.embed_tokens.weight and batch.expand == model.expand
    assert batch.seq_lens.dtype == batch.extend_start_loc.dtype == torch.int32
    lens, starts = batch.seq_lens.tolist(), batch.extend_start_loc.tolist()
    assert len(lens) == num_seqs and min(lens) >= 1 and sum(lens) == n
    assert starts == [sum(lens[:i]) for i in range(num_seqs)]
    assert torch.equal(batch.positions, packed_positions(lens, "cpu"))
    ids = batch.input_ids
    assert ids.dtype == torch.int64 and 0 <= ids.min() and ids.max() < model.vocab_size

    if batch.media is None:
        assert batch.media_index is None
        assert fraction == 0.0 or all(round(length * fraction) == 0 for length in lens)
        return
    index = batch.media_index.cpu()
    media_rows = (index >= 0).nonzero().flatten()
    m = batch.media.shape[0]
    assert batch.media.shape == (m, model.media_width) and batch.media.device.type == device.type
    assert torch.equal(index[media_rows], torch.arange(m, dtype=index.dtype))  # every media row once, in order
    assert (ids[media_rows] == model.media_token_id).all()
    for start, length in zip(starts, lens):  # one contiguous span per sequence, inside it
        rows = media_rows[(media_rows >= start) & (media_rows < start + length)]
        assert len(rows) == round(length * fraction)
        if len(rows):
            assert rows[-1] - rows[0] == len(rows) - 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_make_batch_stages_into_the_slab(device, variant):
    """Staged through the buffers, text rows are table rows and media rows the encoder's, expanded."""
    model = toy(variant, device)
    batch = make_batch(model, 30, media_fraction=0.5, num_seqs=2, generator=torch.Generator().manual_seed(3),
                       device=device)
    assert batch.input_ids.device.type == device.type  # device-resident ints on request
    buffers = ss.StagingBuffers.allocate(max_num_tokens=40, max_batch_size=4, embed_width=model.embed_width,
                                         embed_dtype=model.dtype, device=device)
    buffers.input_embeds.fill_(float("nan"))
    ss.stage_embeddings(buffers.input_embeds, batch.input_ids, batch.table, media=batch.media,
                        media_index=batch.media_index, pad_to=32, expand=batch.expand, strict=True)
    slab = buffers.input_embeds
    is_media = batch.media_index >= 0
    reps = model.embed_width // H if model.expand == "repeat" else 1
    text = model.embed_tokens.weight[batch.input_ids].repeat(1, reps)
    media = batch.media[batch.media_index.clamp(min=0)].repeat(1, reps)
    want = torch.where(is_media[:, None], torch.nn.functional.pad(media, (0, model.embed_width - media.shape[1])),
                       torch.nn.functional.pad(text, (0, model.embed_width - text.shape[1])))
    assert torch.equal(slab[:30], want)
    assert (slab[30:32] == 0).all() and torch.isnan(slab[32:]).all()


def test_make_batch_rejects_bad_arguments():
    model = toy("plain")
    with pytest.raises(ValueError, match="num_seqs"):
        make_batch(model, 3, num_seqs=4)
    with pytest.raises(ValueError, match="media_fraction"):
        make_batch(model, 3, media_fraction=1.5)
    with pytest.raises(ValueError, match="num_tokens"):
        make_batch(model, 0)


def test_make_batch_is_reproducible():
    model = toy("deepstack")
    a, b = (make_batch(model, 50, num_seqs=3, generator=torch.Generator().manual_seed(11)) for _ in range(2))
    for name in ("input_ids", "positions", "seq_lens", "media", "media_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
