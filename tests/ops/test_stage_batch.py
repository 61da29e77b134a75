"""The fused batch launch (the runner's path) equals stage_token_inputs + stage_embeddings."""

import pytest
import torch

import slabstage as ss
from expected import expected_slab  # noqa: I001 - tests/expected.py
from slabstage.kernels.stage_kernel import grid_size
from slabstage.staging.stager import stage_batch


def _buffers(device, mrope=True):
    return ss.StagingBuffers.allocate(max_num_tokens=160, max_batch_size=5, embed_width=96,
                                      embed_dtype=torch.bfloat16, device=device, mrope=mrope)


def _poison(buf):
    for name in buf.registry:
        t = buf.registry[name]
        t.fill_(float("nan") if t.dtype.is_floating_point else -7)


@pytest.mark.parametrize("n,pad_to,expand,host", [(1, 1, "zeros", False), (37, 64, "repeat", False),
                                                   (129, 144, "zeros", True), (150, 150, "repeat", True)])
def test_fused_equals_separate_ops(device, n, pad_to, expand, host):
    g = torch.Generator().manual_seed(n)
    table = torch.randn(57, 32 if expand == "repeat" else 96, generator=g).to(device)
    # media as wide as the slab, or (repeat, n = 37) as the text rows: the width contract allows no third width
    media = torch.randn(23, 32 if (expand, n) == ("repeat", 37) else 96, generator=g).to(device)
    ids = torch.randint(0, 57, (n,), generator=g)
    ids[n // 2] = 57  # a bad id where it is a text row: flagged the same way
    spans = [(s, min(4, n - s), (s // 7) % 19) for s in range(0, n, 13) if s + 1 < n]
    index = ss.media_index_from_spans(spans, n, device="cpu")
    positions = torch.randint(0, 1000, (n,), generator=g)
    mrope = torch.randint(0, 1000, (3, n), generator=g)
    seq = torch.tensor([n - n // 2, n // 2], dtype=torch.int32)
    ext = torch.tensor([0, n - n // 2], dtype=torch.int32)
    loc = torch.randint(0, 10**6, (n,), generator=g)
    move = (lambda t: t) if host else (lambda t: t.to(device))
    inputs = dict(input_ids=move(ids), positions=move(positions), out_cache_loc=move(loc),
                  mrope_positions=move(mrope), seq_lens=move(seq), extend_start_loc=move(ext))

    fused, separate = _buffers(device), _buffers(device)
    _poison(fused)
    _poison(separate)
    stage_batch(fused, table=table, media=media, media_index=move(index), expand=expand, text_scale=0.5,
                     pad_to=pad_to, **inputs)
    ss.stage_token_inputs(separate, pad_to=pad_to, **{k: v.to(device) for k, v in inputs.items()})
    ss.stage_embeddings(separate.input_embeds, ids.to(device), table, media=media, media_index=index.to(device),
                        expand=expand, text_scale=0.5, pad_to=pad_to, errors=separate.errors)
    for name in fused.registry:
        a, b = fused.registry[name], separate.registry[name]
        assert torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0)), name
    assert torch.equal(fused.errors, separate.errors)
    assert torch.isnan(fused.input_embeds[pad_to:].float()).all()
    assert (fused.input_ids[pad_to:] == -7).all()


@pytest.mark.parametrize("n, pad_to, width", [(200, 256, 48), (300, 385, 48), (150, 260, 2100)])
def test_slab_and_slots_over_several_token_blocks(device, n, pad_to, width):
    """The slots' programs come first in the grid, the slab rows' after them (2100 fp32 columns: two programs a
    row): against independent expectations, every slab row and every slot row of every 128-row block is
    written, and nothing past ``pad_to``."""
    g = torch.Generator().manual_seed(n)
    buf = ss.StagingBuffers.allocate(max_num_tokens=400, max_batch_size=5, embed_width=width,
                                     embed_dtype=torch.float32, device=device, mrope=True)
    _poison(buf)
    before = buf.input_embeds.clone()
    table = torch.randn(57, width, generator=g).to(device)
    media = torch.randn(60, width, generator=g).to(device)
    ids = torch.randint(0, 57, (n,), generator=g)
    index = ss.media_index_from_spans([(s, 6, s // 20) for s in range(3, n - 6, 20)], n, device="cpu")
    inputs = dict(positions=torch.randint(1, 1000, (n,), generator=g),
                  out_cache_loc=torch.randint(1, 10**6, (n,), generator=g),
                  mrope_positions=torch.randint(1, 1000, (3, n), generator=g),
                  seq_lens=torch.tensor([n - 50, 50], dtype=torch.int32))
    stage_batch(buf, input_ids=ids.to(device), table=table, media=media, media_index=index.to(device), pad_to=pad_to,
                **{k: v.to(device) for k, v in inputs.items()})
    slab, word = expected_slab(before, ids, table, media, index, pad_to=pad_to)
    assert torch.equal(buf.input_embeds.cpu().nan_to_num(123.0), slab.nan_to_num(123.0))
    assert buf.errors.cpu().tolist() == word
    for name, src in dict(input_ids=ids, **inputs).items():
        now = buf.registry[name].cpu()
        stop, limit = (2, 5) if name == "seq_lens" else (n, pad_to)
        assert torch.equal(now[..., :stop], src.to(now.dtype)), name
        assert (now[..., stop:limit] == 0).all(), name
        assert (now[..., limit:] == -7).all(), name
    assert buf.registry["num_tokens_non_padded"].cpu().tolist() == [n]


def test_the_grid_is_counted_in_host_ints():
    """The launch's grid size is a Python int for every slab shape: counting it in the kernels' ``tl.constexpr``
    layout constants would build objects on every launch (~2 µs of host time a step)."""
    for pad_to, slots, row_programs in [(0, 3, 0), (1, 9, 1), (128, 9, 1), (129, 2, 2), (8192, 9, 1)]:
        size = grid_size(pad_to, slots, row_programs)
        assert type(size) is int
        assert size == -(-max(pad_to, 1) // 128) * slots + pad_to * row_programs


def test_fused_checks_before_writing(device):
    buf = _buffers(device)
    _poison(buf)
    before = {k: buf.registry[k].clone() for k in buf.registry}
    table = torch.randn(10, 200, device=device)  # wider than the slab
    with pytest.raises(ValueError, match="too narrow"):
        stage_batch(buf, input_ids=torch.zeros(4, dtype=torch.int64), positions=torch.arange(4),
                         table=table, pad_to=8)
    for k, t in before.items():
        assert torch.equal(buf.registry[k].nan_to_num(1.0), t.nan_to_num(1.0)), k
