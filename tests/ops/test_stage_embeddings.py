"""stage_embeddings against its PyTorch reference and a hand-written expectation, bit for bit."""

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slabstage import (BAD_MEDIA_INDEX, BAD_TOKEN_ID, StagingError, WidthContractError, new_error_word,
                       raise_if_errors, reset_errors, stage_embeddings)
from slabstage.staging import default_error_word
from slabstage.staging.reference import stage_embeddings_reference

import builders  # noqa: I001 - tests/builders.py
from builders import randint, randn, same_bytes  # noqa: I001
from expected import expected_slab  # noqa: I001 - tests/expected.py

NO_ROW = 2**31 - 1
POISON = 12345.0  # finite, so the untouched tail compares with torch.equal
CLEAN = [0, 0, NO_ROW, 0]


# -- inputs (randn, randint: tests/builders.py) ---------------------------------------------------

poisoned = partial(builders.poisoned, value=POISON)


def spans_index(n, spans, device, dtype=torch.int64):
    """media_index from (dst, length, src) spans, written out by hand."""
    index = torch.full((n,), -1, dtype=dtype)
    for dst, length, src in spans:
        index[dst:dst + length] = torch.arange(src, src + length, dtype=dtype)
    return index.to(device)


def interleaved(n, num_media, device, dtype=torch.int64):
    """Media rows in two runs inside the batch, text around them; uses num_media rows."""
    if n == 0 or num_media == 0:
        return torch.full((n,), -1, dtype=dtype, device=device)
    first = max(1, min(num_media // 2, n // 3))
    a = min(first, n)
    start_b = min(n, a + 1 + n // 4)
    b = max(0, min(num_media - a, n - start_b - 1))
    return spans_index(n, [(n // 8, min(a, n - n // 8), 0), (start_b, b, a)], device, dtype)


# -- what the slab must hold --------------------------------------------------------------------

def expected_rows(ids, table, media, media_index, width, dtype, *, expand="zeros", text_scale=None,
                  vocab_range=None, vocab_size=None, media_owner=True):
    """Rows [0, n) of the independent expectation (tests/expected.py)."""
    before = torch.zeros(ids.shape[0], width, dtype=dtype)
    return expected_slab(before, ids, table, media, media_index, expand=expand, text_scale=text_scale,
                         vocab_range=vocab_range, vocab_size=vocab_size, media_owner=media_owner)[0]


def run_reference(slab, ids, table, *, media=None, media_index=None, pad_to=None, expand="zeros",
                  text_scale=None, vocab_range=None, vocab_size=None, media_owner=True):
    out = slab.clone()
    errors = new_error_word(slab.device)
    stage_embeddings_reference(out, ids, table, media=media, media_index=media_index, pad_to=pad_to, expand=expand,
                               text_scale=text_scale, vocab_range=vocab_range, vocab_size=vocab_size,
                               media_owner=media_owner, errors=errors)
    return out, errors


def stage_and_check(slab, ids, table, **kw):
    """Stage into the poisoned ``slab``; check it against the reference and the expectation."""
    n = ids.shape[0]
    pad_to = kw.get("pad_to") if kw.get("pad_to") is not None else n
    before = slab.clone()
    ref, ref_errors = run_reference(before, ids, table, **kw)
    errors = new_error_word(slab.device)
    assert stage_embeddings(slab, ids, table, errors=errors, **kw) is slab
    assert torch.equal(slab[:pad_to], ref[:pad_to]), "differs from the reference"
    assert errors.tolist() == ref_errors.tolist(), "error word differs from the reference"
    exp = expected_rows(ids, table, kw.get("media"), kw.get("media_index"), slab.shape[1], slab.dtype,
                        **{k: kw[k] for k in ("expand", "text_scale", "vocab_range", "vocab_size", "media_owner")
                           if k in kw})
    assert torch.equal(slab[:n].cpu(), exp), "differs from the hand-written expectation"
    assert (slab[n:pad_to] == 0).all(), "padding rows are not zero"
    assert same_bytes(slab[pad_to:], before[pad_to:]), "rows past pad_to were touched"
    return errors


# -- dtypes ------------------------------------------------------------------------------------

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("slab_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
def test_dtypes(slab_dtype, src_dtype, device):
    g = torch.Generator().manual_seed(1)
    n, V, M, W = 13, 41, 6, 64
    table = randn(g, V, W, dtype=src_dtype, device=device)
    media = randn(g, M, W, dtype=src_dtype, device=device)
    ids = randint(g, 0, V, n, device=device)
    errors = stage_and_check(poisoned(20, W, slab_dtype, device), ids, table, media=media,
                             media_index=interleaved(n, M, device), pad_to=16)
    assert errors.tolist() == CLEAN


@pytest.mark.parametrize("slab_dtype, table_dtype, media_dtype", [
    (torch.bfloat16, torch.float16, torch.float32),  # fp16 table, fp32 encoder output, bf16 slab
    (torch.bfloat16, torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16, torch.float32),
    (torch.float32, torch.float16, torch.bfloat16),
])
def test_mixed_source_dtypes(slab_dtype, table_dtype, media_dtype, device):
    g = torch.Generator().manual_seed(2)
    n, V, M, W = 17, 29, 9, 96
    table = randn(g, V, W, dtype=table_dtype, device=device)
    media = randn(g, M, W, dtype=media_dtype, device=device)
    ids = randint(g, 0, V, n, device=device)
    stage_and_check(poisoned(24, W, slab_dtype, device), ids, table, media=media,
                    media_index=interleaved(n, M, device), pad_to=21)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 3e38 -> fp16 is inf
def test_rounding_edge_values(device):
    """fp32 values halfway between bf16/fp16 neighbours, tiny and huge: torch's rounding exactly."""
    base = torch.tensor([1.0, 1.00390625, 1.01171875, -1.00390625, 3.0e38, -3.0e38, 1e-40, 65504.0, 65520.0,
                         70000.0, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 2**-24, 2**-25, float("inf"), float("-inf")])
    W = base.numel()
    g = torch.Generator().manual_seed(3)
    table = (base[None, :] * (1 + torch.arange(5)[:, None])).to(device)
    media = (base[None, :] * -(1 + torch.arange(3)[:, None])).to(device)
    ids = randint(g, 0, 5, 8, device=device)
    index = spans_index(8, [(2, 3, 0)], device)
    for slab_dtype in DTYPES:
        stage_and_check(poisoned(10, W, slab_dtype, device), ids, table, media=media, media_index=index, pad_to=9)


def test_nan_source_rows(device):
    table = torch.full((4, 16), float("nan"), device=device)
    table[1] = 1.5
    ids = torch.tensor([0, 1, 2, 1], device=device)
    for slab_dtype in DTYPES:
        slab = poisoned(6, 16, slab_dtype, device)
        stage_embeddings(slab, ids, table, errors=new_error_word(device))
        assert torch.isnan(slab[[0, 2]].float()).all() and (slab[[1, 3]] == 1.5).all()
        assert (slab[4:].float() == torch.tensor(POISON, dtype=slab_dtype).float()).all()


# -- widths and expand policies -------------------------------------------------------------------

WIDTH_CASES = [  # (slab width W, table width, media width, expand)
    pytest.param(64, 64, 64, "zeros", id="W==H"),
    pytest.param(1000, 1000, 1000, "zeros", id="W==H=1000"),
    pytest.param(4097, 4097, 4097, "zeros", id="W==H=4097"),
    pytest.param(4 * 48, 48, 48, "repeat", id="hc-4x48"),
    pytest.param(4 * 13, 13, 13, "repeat", id="hc-4x13"),
    pytest.param(4 * 1024, 1024, 1024, "repeat", id="hc-4x1024"),
    pytest.param(3 * 40, 40, 3 * 40, "zeros", id="deepstack-3x40"),
    pytest.param(3 * 333, 333, 3 * 333, "zeros", id="deepstack-3x333"),
    pytest.param(96, 32, 96, "repeat", id="repeat-text-only"),
    pytest.param(96, 48, 48, "repeat", id="repeat-both-narrow"),
    pytest.param(96, 48, 96, "repeat", id="repeat-text-only-48"),
    pytest.param(100, 37, 37, "zeros", id="zeros-both-narrow"),
    pytest.param(100, 37, 100, "zeros", id="zeros-text-only"),
    pytest.param(4097, 1000, 4097, "zeros", id="zeros-4097"),  # unpromised loads, PIECE columns at a time
    pytest.param(3000, 1000, 1000, "repeat", id="repeat-wraps-3000"),  # a wrapping piece, in pieces
    pytest.param(15, 5, 15, "repeat", id="repeat-odd-5"),
    pytest.param(7, 1, 1, "repeat", id="repeat-1"),
]


@pytest.mark.parametrize("W, Ht, Hm, expand", WIDTH_CASES)
@pytest.mark.parametrize("slab_dtype", [torch.bfloat16, torch.float32])
def test_widths(W, Ht, Hm, expand, slab_dtype, device):
    g = torch.Generator().manual_seed(W + Ht + Hm)
    n = 9 if W * 1 < 1000 else 5
    V, M = 23, 5
    table = randn(g, V, Ht, device=device)
    media = randn(g, M, Hm, dtype=torch.bfloat16, device=device)
    ids = randint(g, 0, V, n, device=device)
    stage_and_check(poisoned(n + 3, W, slab_dtype, device), ids, table, media=media,
                    media_index=interleaved(n, M, device), pad_to=n + 2, expand=expand)


REFUSED_WIDTH_CASES = [  # media neither as wide as the slab nor as the text: refused (width contract)
    pytest.param(96, 96, 48, "repeat", id="repeat-media-only"),
    pytest.param(3 * 32, 32, 48, "repeat", id="repeat-two-widths"),
    pytest.param(100, 37, 64, "zeros", id="zeros-both-narrow"),
]


@pytest.mark.parametrize("W, Ht, Hm, expand", REFUSED_WIDTH_CASES)
def test_media_width_neither_slab_nor_text_is_refused(W, Ht, Hm, expand, device):
    g = torch.Generator().manual_seed(W + Ht + Hm)
    n, V, M = 9, 23, 5
    table = randn(g, V, Ht, device=device)
    media = randn(g, M, Hm, dtype=torch.bfloat16, device=device)
    slab = poisoned(n + 3, W, torch.float32, device)
    errors = new_error_word(device)
    with pytest.raises(WidthContractError, match=rf"media rows are {Hm} wide, but media must be as wide as the "
                                                 rf"input_embeds slab \({W}\) or as the text rows \({Ht}"):
        stage_embeddings(slab, randint(g, 0, V, n, device=device), table, media=media,
                         media_index=interleaved(n, M, device), pad_to=n + 2, expand=expand, errors=errors)
    assert (slab == POISON).all() and errors.tolist() == CLEAN


# -- batch sizes, padding, media layouts -----------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 7, 16, 33, 64])
@pytest.mark.parametrize("pad", ["none", "n", "n+3", "all"])
def test_batch_and_padding(n, pad, device):
    g = torch.Generator().manual_seed(n)
    rows, V, M, W = 67, 50, 12, 48
    pad_to = {"none": None, "n": n, "n+3": n + 3, "all": rows}[pad]
    table = randn(g, V, W, device=device)
    media = randn(g, M, W, device=device)
    ids = randint(g, 0, V, n, device=device)
    stage_and_check(poisoned(rows, W, torch.float16, device), ids, table, media=media,
                    media_index=interleaved(n, M, device), pad_to=pad_to)


@pytest.mark.parametrize("layout", ["no-media", "index-all-text", "all-media", "interleaved", "first-and-last",
                                    "empty-media"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_media_layouts(layout, index_dtype, device):
    g = torch.Generator().manual_seed(7)
    n, V, M, W = 21, 30, 21, 40
    table = randn(g, V, W, device=device)
    media = randn(g, M, W, device=device)
    ids = randint(g, 0, V, n, dtype=index_dtype, device=device)
    kw = {}
    if layout == "index-all-text":
        kw = dict(media=media, media_index=torch.full((n,), -1, dtype=index_dtype, device=device))
    elif layout == "all-media":
        perm = torch.randperm(M, generator=g)[:n]  # any order of media rows, not just 0..n-1
        kw = dict(media=media, media_index=perm.to(index_dtype).to(device))
    elif layout == "interleaved":
        kw = dict(media=media, media_index=spans_index(n, [(1, 3, 0), (6, 1, 3), (9, 5, 4), (17, 2, 9)], device,
                                                       index_dtype))
    elif layout == "first-and-last":
        kw = dict(media=media, media_index=spans_index(n, [(0, 2, 5), (n - 2, 2, 0)], device, index_dtype))
    elif layout == "empty-media":
        kw = dict(media=media[:0], media_index=torch.full((n,), -1, dtype=index_dtype, device=device))
    errors = stage_and_check(poisoned(n + 4, W, torch.bfloat16, device), ids, table, pad_to=n + 2, **kw)
    assert errors.tolist() == CLEAN


def test_empty_table(device):
    """A table with no rows (a rank holding no vocabulary): media rows work, text rows are bad ids."""
    g = torch.Generator().manual_seed(31)
    n, M, W = 6, 4, 16
    table = torch.zeros(0, W, device=device)
    media = randn(g, M, W, device=device)
    ids = randint(g, 0, 50, n, device=device)
    errors = stage_and_check(poisoned(n, W, torch.float32, device), ids, table, media=media,
                             media_index=torch.tensor([0, 1, 2, 3, 0, 1], device=device))
    assert errors.tolist() == CLEAN
    errors = stage_and_check(poisoned(n, W, torch.float32, device), ids, table, media=media,
                             media_index=torch.tensor([0, -1, 2, 3, -1, 1], device=device))
    assert errors.tolist() == [BAD_TOKEN_ID, 2, 1, 0]


def test_empty_slab(device):
    table = torch.randn(5, 16, device=device)
    slab = torch.empty(0, 16, device=device)
    ids = torch.zeros(0, dtype=torch.int64, device=device)
    errors = new_error_word(device)
    assert stage_embeddings(slab, ids, table, pad_to=0, errors=errors) is slab
    assert errors.tolist() == CLEAN


def test_any_negative_index_is_text(device):
    g = torch.Generator().manual_seed(8)
    n, V, M, W = 10, 20, 4, 32
    table, media = randn(g, V, W, device=device), randn(g, M, W, device=device)
    ids = randint(g, 0, V, n, device=device)
    index = torch.tensor([-1, -2, 0, -7, 1, -(2**40), 2, -100, 3, -1], device=device)
    errors = stage_and_check(poisoned(n, W, torch.float32, device), ids, table, media=media, media_index=index)
    assert errors.tolist() == CLEAN


def test_placeholder_ids_at_media_rows_are_not_errors(device):
    """Engines put placeholder ids (often outside the vocabulary) at media rows: ignored."""
    g = torch.Generator().manual_seed(9)
    n, V, M, W = 12, 20, 5, 32
    table, media = randn(g, V, W, device=device), randn(g, M, W, device=device)
    ids = randint(g, 0, V, n, device=device)
    index = spans_index(n, [(3, 5, 0)], device)
    ids[3:8] = torch.tensor([V, -1, 2**40, 151655, -(2**40)], device=device)
    errors = stage_and_check(poisoned(n, W, torch.bfloat16, device), ids, table, media=media, media_index=index)
    assert errors.tolist() == CLEAN


def test_media_rows_past_n_are_ignored(device):
    """Only media_index[:n] exists; media rows never referenced are never read."""
    g = torch.Generator().manual_seed(10)
    n, V, M, W = 6, 20, 40, 16
    table, media = randn(g, V, W, device=device), randn(g, M, W, device=device)
    ids = randint(g, 0, V, n, device=device)
    stage_and_check(poisoned(10, W, torch.float32, device), ids, table, media=media,
                    media_index=spans_index(n, [(2, 2, 37)], device), pad_to=8)


# -- text scale, vocab shards, media owner ----------------------------------------------------------

@pytest.mark.parametrize("scale", [math.sqrt(1000), math.sqrt(4096), 0.5, 3, -1.25, 1e-3])
@pytest.mark.parametrize("slab_dtype, table_dtype", [(torch.bfloat16, torch.bfloat16),
                                                     (torch.bfloat16, torch.float32),
                                                     (torch.float16, torch.float16),
                                                     (torch.float32, torch.float32)])
def test_text_scale(scale, slab_dtype, table_dtype, device):
    g = torch.Generator().manual_seed(11)
    n, V, M, W = 11, 25, 4, 48
    table = randn(g, V, W, dtype=table_dtype, device=device)
    media = randn(g, M, W, device=device)
    ids = randint(g, 0, V, n, device=device)
    stage_and_check(poisoned(14, W, slab_dtype, device), ids, table, media=media,
                    media_index=interleaved(n, M, device), pad_to=13, text_scale=scale)


def test_text_scale_with_repeat(device):
    g = torch.Generator().manual_seed(12)
    n, V, M, H = 9, 25, 4, 24
    table = randn(g, V, H, dtype=torch.bfloat16, device=device)
    media = randn(g, M, H, device=device)
    ids = randint(g, 0, V, n, device=device)
    stage_and_check(poisoned(10, 4 * H, torch.bfloat16, device), ids, table, media=media,
                    media_index=interleaved(n, M, device), expand="repeat", text_scale=math.sqrt(H))


@pytest.mark.parametrize("shard, table_rows", [((0, 17), 17), ((20, 37), 17), ((33, 50), 17), ((20, 37), 24),
                                               ((0, 0), 3)])
def test_vocab_shard(shard, table_rows, device):
    g = torch.Generator().manual_seed(13)
    n, vocab, M, W = 40, 50, 6, 32
    table = randn(g, table_rows, W, device=device)
    media = randn(g, M, W, device=device)
    ids = randint(g, 0, vocab, n, device=device)
    ids[:4] = torch.tensor([shard[0], max(shard[1] - 1, 0), vocab - 1, 0], device=device)
    errors = stage_and_check(poisoned(44, W, torch.bfloat16, device), ids, table, media=media,
                             media_index=interleaved(n, M, device), pad_to=42, vocab_range=shard,
                             vocab_size=vocab)
    assert errors.tolist() == CLEAN  # ids of other shards are not errors
    in_shard = (ids >= shard[0]) & (ids < shard[1])
    assert in_shard.any() or shard == (0, 0)
    assert (~in_shard).any()


def test_vocab_shard_bad_ids_flagged(device):
    g = torch.Generator().manual_seed(14)
    n, vocab, W = 16, 50, 32
    table = randn(g, 17, W, device=device)
    ids = randint(g, 0, vocab, n, device=device)
    ids[5], ids[11] = -3, vocab
    errors = stage_and_check(poisoned(n, W, torch.float32, device), ids, table, vocab_range=(20, 37),
                             vocab_size=vocab)
    assert errors.tolist() == [BAD_TOKEN_ID, 2, 5, 0]


def test_vocab_shard_default_vocab_size_is_shard_end(device):
    g = torch.Generator().manual_seed(15)
    n, W = 12, 16
    table = randn(g, 10, W, device=device)
    ids = torch.tensor([0, 5, 9, 10, 12, 19, 20, 25, 3, 30, 14, 29], device=device)
    errors = stage_and_check(poisoned(n, W, torch.bfloat16, device), ids, table, vocab_range=(10, 20))
    # ids >= 20 are past the (default) vocabulary end: rows 6, 7, 9 and 11
    assert errors.tolist() == [BAD_TOKEN_ID, 4, 6, 0]


def test_vocab_size_larger_than_table(device):
    g = torch.Generator().manual_seed(16)
    table = randn(g, 10, 16, device=device)
    ids = torch.tensor([1, 9, 10, 15, 16, 2], device=device)
    errors = stage_and_check(poisoned(6, 16, torch.float32, device), ids, table, vocab_size=16)
    assert errors.tolist() == [BAD_TOKEN_ID, 1, 4, 0]  # 10 and 15 are in the vocabulary, not in the table


@pytest.mark.parametrize("expand, Hm", [("zeros", 32), ("zeros", 16), ("repeat", 8)])
def test_media_owner_false(expand, Hm, device):
    g = torch.Generator().manual_seed(17)
    n, V, M, W = 15, 20, 7, 32
    table = randn(g, V, Hm, device=device)  # narrow media must be as wide as the text
    media = randn(g, M, Hm, device=device)
    ids = randint(g, 0, V, n, device=device)
    index = interleaved(n, M, device)
    slab = poisoned(18, W, torch.bfloat16, device)
    errors = stage_and_check(slab, ids, table, media=media, media_index=index, pad_to=17, media_owner=False,
                             expand=expand)
    assert errors.tolist() == CLEAN
    is_media = (index >= 0).cpu()
    assert is_media.any() and (slab[:n].cpu()[is_media] == 0).all()
    text = table.cpu()[ids.cpu()[~is_media]].to(torch.bfloat16)
    text = text.repeat(1, W // Hm) if expand == "repeat" else F.pad(text, (0, W - Hm))
    assert torch.equal(slab[:n].cpu()[~is_media], text)


def test_media_owner_false_still_flags_bad_index(device):
    g = torch.Generator().manual_seed(18)
    table, media = randn(g, 10, 16, device=device), randn(g, 3, 16, device=device)
    ids = randint(g, 0, 10, 6, device=device)
    index = torch.tensor([-1, 0, 3, -1, 2, 9], device=device)
    errors = stage_and_check(poisoned(6, 16, torch.float32, device), ids, table, media=media, media_index=index,
                             media_owner=False)
    assert errors.tolist() == [BAD_MEDIA_INDEX, 2, 2, 0]


def test_media_index_without_media(device):
    """media_index alone: zero media rows exist, so every media row is flagged and zero."""
    g = torch.Generator().manual_seed(19)
    table = randn(g, 10, 16, device=device)
    ids = randint(g, 0, 10, 6, device=device)
    index = torch.tensor([-1, 0, -1, -1, 1, -1], device=device)
    errors = stage_and_check(poisoned(6, 16, torch.float32, device), ids, table, media_index=index)
    assert errors.tolist() == [BAD_MEDIA_INDEX, 2, 1, 0]


# -- poison --------------------------------------------------------------------------------------

@pytest.mark.parametrize("slab_dtype", DTYPES)
@pytest.mark.parametrize("n, pad_to, rows", [(0, 5, 9), (7, 7, 12), (9, 13, 20), (31, 40, 40)])
def test_nan_poison(slab_dtype, n, pad_to, rows, device):
    g = torch.Generator().manual_seed(20 + n)
    V, M, W = 33, 8, 72
    table, media = randn(g, V, W, device=device), randn(g, M, W, dtype=slab_dtype, device=device)
    ids = randint(g, 0, V, n, device=device)
    slab = poisoned(rows, W, slab_dtype, device, value=float("nan"))
    stage_and_check(slab, ids, table, media=media, media_index=interleaved(n, M, device), pad_to=pad_to)
    assert not torch.isnan(slab[:pad_to].float()).any()
    assert torch.isnan(slab[pad_to:].float()).all()


def test_sentinel_poison_every_row_written(device):
    """With a sentinel equal to no possible output, each row below pad_to is overwritten."""
    g = torch.Generator().manual_seed(21)
    n, V, M, W, rows = 19, 30, 6, 56, 30
    table, media = randn(g, V, W, device=device), randn(g, M, W, device=device)
    ids = randint(g, 0, V, n, device=device)
    ids[4] = -1  # a zero-filled bad row is written too
    slab = poisoned(rows, W, torch.float32, device, value=-777.0)
    stage_and_check(slab, ids, table, media=media, media_index=interleaved(n, M, device), pad_to=25)
    assert not (slab[:25] == -777.0).any()
    assert (slab[25:] == -777.0).all()


# -- bad data on the device ------------------------------------------------------------------------

@pytest.mark.parametrize("bad, ids_dtype", [(-1, torch.int64), (-(2**31), torch.int32), ("V", torch.int64),
                                            ("V+1", torch.int32), (2**31 - 1, torch.int32),
                                            (2**40, torch.int64), (-(2**62), torch.int64)])
def test_bad_token_ids(bad, ids_dtype, device):
    g = torch.Generator().manual_seed(22)
    n, V, M, W = 14, 25, 4, 40
    bad = {"V": V, "V+1": V + 1}.get(bad, bad)
    table, media = randn(g, V, W, device=device), randn(g, M, W, device=device)
    ids = randint(g, 0, V, n, dtype=ids_dtype, device=device)
    index = spans_index(n, [(0, 2, 0), (9, 2, 2)], device)
    ids[3] = bad
    ids[12] = bad
    slab = poisoned(16, W, torch.bfloat16, device)
    errors = stage_and_check(slab, ids, table, media=media, media_index=index, pad_to=15)
    assert errors.tolist() == [BAD_TOKEN_ID, 2, 3, 0]
    assert (slab[[3, 12]] == 0).all()
    with pytest.raises(StagingError) as info:
        raise_if_errors(errors)
    e = info.value
    assert (e.codes, e.rows, e.first_row) == (BAD_TOKEN_ID, 2, 3)
    assert "vocabulary" in str(e) and "row 3" in str(e)
    assert errors.tolist() == CLEAN  # reset
    raise_if_errors(errors)


@pytest.mark.parametrize("bad", ["M", "M+1", 2**31 - 1, 2**40])
def test_bad_media_index(bad, device):
    g = torch.Generator().manual_seed(23)
    n, V, M, W = 12, 25, 5, 40
    bad = {"M": M, "M+1": M + 1}.get(bad, bad)
    table, media = randn(g, V, W, device=device), randn(g, M, W, device=device)
    ids = randint(g, 0, V, n, device=device)
    index = spans_index(n, [(2, 5, 0)], device)
    index[4] = bad
    index[9] = bad
    slab = poisoned(12, W, torch.float16, device)
    errors = stage_and_check(slab, ids, table, media=media, media_index=index)
    assert errors.tolist() == [BAD_MEDIA_INDEX, 2, 4, 0]
    assert (slab[[4, 9]] == 0).all()
    with pytest.raises(StagingError) as info:
        raise_if_errors(errors)
    assert (info.value.codes, info.value.rows, info.value.first_row) == (BAD_MEDIA_INDEX, 2, 4)
    assert errors.tolist() == CLEAN


def test_bad_ids_and_media_together_and_accumulating(device):
    g = torch.Generator().manual_seed(24)
    n, V, M, W = 10, 20, 3, 16
    table, media = randn(g, V, W, device=device), randn(g, M, W, device=device)
    ids = randint(g, 0, V, n, device=device)
    ids[7] = V
    index = torch.tensor([-1, -1, -1, -1, -1, 0, 3, -1, -1, 2], device=device)
    errors = new_error_word(device)
    slab = poisoned(n, W, torch.float32, device)
    stage_embeddings(slab, ids, table, media=media, media_index=index, errors=errors)
    assert errors.tolist() == [BAD_TOKEN_ID | BAD_MEDIA_INDEX, 2, 6, 0]
    ids2 = ids.clone()
    ids2[1] = -5
    stage_embeddings(slab, ids2, table, errors=errors)  # a second batch, before anyone looked
    assert errors.tolist() == [BAD_TOKEN_ID | BAD_MEDIA_INDEX, 4, 1, 0]
    with pytest.raises(StagingError) as info:
        raise_if_errors(errors)
    assert info.value.rows == 4 and info.value.first_row == 1
    assert "vocabulary" in str(info.value) and "media" in str(info.value)


def test_strict(device):
    g = torch.Generator().manual_seed(25)
    n, V, W = 9, 20, 24
    table = randn(g, V, W, device=device)
    ids = randint(g, 0, V, n, device=device)
    errors = new_error_word(device)
    slab = poisoned(n + 2, W, torch.bfloat16, device)
    assert stage_embeddings(slab, ids, table, pad_to=n + 1, errors=errors, strict=True) is slab
    ids[6] = V + 3
    with pytest.raises(StagingError) as info:
        stage_embeddings(slab, ids, table, pad_to=n + 1, errors=errors, strict=True)
    assert (info.value.codes, info.value.rows, info.value.first_row) == (BAD_TOKEN_ID, 1, 6)
    assert errors.tolist() == CLEAN
    exp = expected_rows(ids, table, None, None, W, torch.bfloat16)
    assert torch.equal(slab[:n].cpu(), exp)  # the batch was still staged, the bad row zeroed
    assert (slab[n] == 0).all() and (slab[n + 1] == POISON).all()


def test_default_error_word(device):
    g = torch.Generator().manual_seed(26)
    word = default_error_word(device)
    reset_errors(word)
    table = randn(g, 8, 16, device=device)
    ids = torch.tensor([1, 8, 2], device=device)
    stage_embeddings(poisoned(3, 16, torch.float32, device), ids, table)
    assert word.tolist() == [BAD_TOKEN_ID, 1, 1, 0]
    with pytest.raises(StagingError):
        raise_if_errors(device=device)
    raise_if_errors(device=device)
    strict_ids = torch.tensor([1, 2, -1], device=device)
    with pytest.raises(StagingError):
        stage_embeddings(poisoned(3, 16, torch.float32, device), strict_ids, table, strict=True)
    assert word.tolist() == CLEAN


# -- no out-of-bounds reads ---------------------------------------------------------------------

@pytest.mark.parametrize("slab_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("expand, Ht, Hm, W", [("zeros", 64, 64, 64), ("zeros", 24, 24, 64), ("zeros", 40, 64, 64),
                                               ("repeat", 16, 16, 64), ("repeat", 16, 64, 64),
                                               ("zeros", 1000, 1000, 1000)])
def test_no_out_of_bounds_read(slab_dtype, expand, Ht, Hm, W, device):
    """Sentinel rows before and after the sources and sentinel columns past their widths."""
    g = torch.Generator().manual_seed(27)
    n, V, M, huge = 16, 11, 4, 3.0e38
    big_table = torch.full((V + 8, Ht + 16), huge, device=device)
    big_table[4:4 + V, :Ht] = randn(g, V, Ht, device=device)
    table = big_table[4:4 + V, :Ht]  # row stride Ht + 16: the kernel must use it, and read only Ht columns
    big_media = torch.full((M + 8, Hm + 8), huge, device=device)
    big_media[:M, :Hm] = randn(g, M, Hm, device=device)
    media = big_media[:M, :Hm]
    assert table.stride() == (Ht + 16, 1) and media.stride() == (Hm + 8, 1)
    ids = randint(g, 0, V, n, device=device)
    ids[[1, 2, 3]] = torch.tensor([-1, V, -4], device=device)  # row -1, row V, row -4: all sentinel
    index = torch.full((n,), -1, device=device)
    index[[6, 7, 8, 9, 13]] = torch.tensor([0, M, 3, M + 1, 1], device=device)
    slab = poisoned(n + 4, W, slab_dtype, device, value=float("nan"))
    errors = stage_and_check(slab, ids, table, media=media, media_index=index, pad_to=n + 2, expand=expand)
    assert errors.tolist() == [BAD_TOKEN_ID | BAD_MEDIA_INDEX, 5, 1, 0]
    written = slab[:n + 2].float()
    assert torch.isfinite(written).all() and written.abs().max() < 100, "a sentinel was read"


def test_no_out_of_bounds_read_in_shard(device):
    g = torch.Generator().manual_seed(28)
    n, vocab, W, huge = 20, 40, 32, 3.0e38
    big = torch.full((30, W), huge, device=device)
    big[10:20] = randn(g, 10, W, device=device)
    table = big[10:20]  # shard (10, 20): every id outside it would land on a sentinel row
    ids = randint(g, 0, vocab, n, device=device)
    ids[:4] = torch.tensor([0, 9, 20, 39], device=device)
    slab = poisoned(n, W, torch.float32, device)
    stage_and_check(slab, ids, table, vocab_range=(10, 20), vocab_size=vocab)
    assert slab.abs().max() < 100


def _offset(t, k):
    """The same values in a fresh tensor that starts ``k`` elements into its storage (misaligned)."""
    flat = torch.empty(t.numel() + k, dtype=t.dtype, device=t.device)
    out = flat[k:].view(t.shape)
    out.copy_(t)
    return out


def test_layouts_back_to_back(device):
    """One launch after another with alignments, strides and widths that a compiled-kernel cache keys on."""
    g = torch.Generator().manual_seed(32)
    V, M = 20, 5
    for step in range(9):
        W = {6: 1, 7: 16}.get(step, 64)
        n = 1 if step == 5 else 11
        table = randn(g, V, W, device=device)
        media = randn(g, M, W, dtype=torch.bfloat16, device=device)
        ids = randint(g, 0, V, n, device=device)
        index = interleaved(n, M, device)
        slab = poisoned(n + 3, W, torch.bfloat16, device, value=float("nan"))
        if step == 1:
            table = torch.cat([table, randn(g, V, 1, device=device)], 1)[:, :W]  # row stride W + 1
        elif step == 2:
            table = _offset(table, 1)  # 4 bytes off
        elif step == 3:
            slab = _offset(slab, 1)  # 2 bytes off, rows still (W, 1)
        elif step == 4:
            ids, index = _offset(ids, 1), _offset(index, 3)
            media = _offset(media, 5)
        elif step == 8:
            media = torch.cat([media, media], 1)[:, :W]  # row stride 2W
        stage_and_check(slab, ids, table, media=media, media_index=index, pad_to=n + 2)



def test_repeated_calls_into_one_slab(device):
    """Calls into one slab with one error word, as an engine makes them, n and pad_to changing, no host
    sync: every call matches the reference and leaves the rows past its pad_to alone, and all of them go
    through the one stager of that slab (no graph of the op's own launch is captured)."""
    from slabstage.staging.op_stagers import slab_stager
    g = torch.Generator().manual_seed(33)
    V, M, W = 50, 40, 64
    table = randn(g, V, W, device=device)
    slab = poisoned(200, W, torch.bfloat16, device)
    errors = new_error_word(slab.device)
    sizes = [(13, 16), (9, 9), (16, 30), (5, 5), (100, 128), (70, 100), (12, 12), (3, 3), (0, 0), (128, 200)]
    if device.type == "cpu":  # (the interpreter: the same checks on fewer rows)
        sizes = [(13, 16), (9, 9), (5, 5), (3, 3), (0, 0), (20, 24)]
    for step in range(3 if device.type == "cuda" else 1):
        for n, pad_to in sizes:
            ids, media = randint(g, 0, V, n, device=device), randn(g, M, W, dtype=torch.bfloat16, device=device)
            index = interleaved(n, M, device)
            slab.fill_(POISON)
            ref, _ = run_reference(slab.clone(), ids, table, media=media, media_index=index, pad_to=pad_to)
            if device.type == "cuda" and step:
                torch.cuda.set_sync_debug_mode("error")
            try:
                stage_embeddings(slab, ids, table, media=media, media_index=index, pad_to=pad_to, errors=errors)
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            assert torch.equal(slab[:pad_to], ref[:pad_to]), (step, n, pad_to)
            assert (slab[pad_to:] == POISON).all(), f"rows past pad_to={pad_to} were touched"
    assert errors.tolist() == CLEAN
    stager = slab_stager(slab, errors)[1]
    assert stager is slab_stager(slab[:7], errors)[1] and not hasattr(stager, "_graphs")
    if device.type == "cuda":
        assert stager.ring.step == 3 * (len(sizes) - 1)  # one launch a call (none for n = pad_to = 0)

# -- host-side validation -------------------------------------------------------------------------

def _base(device):
    g = torch.Generator().manual_seed(29)
    n, V, M, W = 8, 16, 3, 32
    return dict(
        slab=poisoned(12, W, torch.bfloat16, device),
        input_ids=randint(g, 0, V, n, device=device),
        table=randn(g, V, W, device=device),
        media=randn(g, M, W, device=device),
        media_index=spans_index(n, [(2, 3, 0)], device),
        pad_to=10,
    )


def _other(device):
    return "meta"  # never the slab's device


INVALID = [  # (name, change to the valid arguments, exception type, words in the message)
    ("slab int", lambda a, d: a.update(slab=torch.zeros(12, 32, dtype=torch.int32, device=d)), TypeError, "slab"),
    ("slab fp64", lambda a, d: a.update(slab=torch.zeros(12, 32, dtype=torch.float64, device=d)), TypeError,
     "slab"),
    ("slab 1-D", lambda a, d: a.update(slab=torch.zeros(12 * 32, device=d)), ValueError, "slab"),
    ("slab 3-D", lambda a, d: a.update(slab=torch.zeros(2, 12, 32, device=d)), ValueError, "slab"),
    ("slab not tensor", lambda a, d: a.update(slab=[[0.0] * 32] * 12), TypeError, "slab"),
    ("slab column slice", lambda a, d: a.update(slab=torch.zeros(12, 40, dtype=torch.bfloat16, device=d)[:, :32]),
     ValueError, "stride"),
    ("slab transposed", lambda a, d: a.update(slab=torch.zeros(32, 12, dtype=torch.bfloat16, device=d).t()),
     ValueError, "stride"),
    ("slab row step", lambda a, d: a.update(slab=torch.zeros(24, 32, dtype=torch.bfloat16, device=d)[::2]),
     ValueError, "stride"),
    ("ids float", lambda a, d: a.update(input_ids=a["input_ids"].float()), TypeError, "input_ids"),
    ("ids int16", lambda a, d: a.update(input_ids=a["input_ids"].to(torch.int16)), TypeError, "input_ids"),
    ("ids 2-D", lambda a, d: a.update(input_ids=a["input_ids"][None]), ValueError, "input_ids"),
    ("ids 0-D", lambda a, d: a.update(input_ids=a["input_ids"][0]), ValueError, "input_ids"),
    ("ids strided", lambda a, d: a.update(input_ids=a["input_ids"].repeat(2)[::2]), ValueError, "input_ids"),
    ("ids device", lambda a, d: a.update(input_ids=torch.zeros(8, dtype=torch.int64, device=_other(d))),
     ValueError, "input_ids"),
    ("ids list", lambda a, d: a.update(input_ids=[1, 2, 3]), TypeError, "input_ids"),
    ("table int", lambda a, d: a.update(table=a["table"].long()), TypeError, "table"),
    ("table 1-D", lambda a, d: a.update(table=a["table"][0]), ValueError, "table"),
    ("table columns strided", lambda a, d: a.update(table=torch.zeros(32, 16, device=d).t()), ValueError, "table"),
    ("table device", lambda a, d: a.update(table=torch.zeros(16, 32, device=_other(d))), ValueError, "table"),
    ("table too wide", lambda a, d: a.update(table=torch.zeros(16, 33, device=d)), WidthContractError, "33"),
    ("media too wide", lambda a, d: a.update(media=torch.zeros(3, 64, device=d)), WidthContractError, "64"),
    ("media int", lambda a, d: a.update(media=a["media"].int()), TypeError, "media"),
    ("media 3-D", lambda a, d: a.update(media=a["media"][None]), ValueError, "media"),
    ("media device", lambda a, d: a.update(media=torch.zeros(3, 32, device=_other(d))), ValueError, "media"),
    ("repeat does not divide", lambda a, d: a.update(table=torch.zeros(16, 12, device=d), expand="repeat"),
     WidthContractError, "12"),
    ("media repeat does not divide", lambda a, d: a.update(media=torch.zeros(3, 24, device=d), expand="repeat"),
     WidthContractError, "24"),
    ("unknown expand", lambda a, d: a.update(table=torch.zeros(16, 16, device=d), expand="tile"), ValueError,
     "expand"),
    ("unknown expand at full width", lambda a, d: a.update(expand="tile"), ValueError, "expand"),
    ("narrow without expand", lambda a, d: a.update(table=torch.zeros(16, 16, device=d), expand=None),
     ValueError, "expand"),
    ("pad_to below n", lambda a, d: a.update(pad_to=7), ValueError, "pad_to"),
    ("pad_to past rows", lambda a, d: a.update(pad_to=13), ValueError, "pad_to"),
    ("pad_to float", lambda a, d: a.update(pad_to=10.0), ValueError, "pad_to"),
    ("pad_to bool", lambda a, d: a.update(pad_to=True), ValueError, "pad_to"),
    ("pad_to negative", lambda a, d: a.update(pad_to=-1), ValueError, "pad_to"),
    ("n past rows", lambda a, d: a.update(input_ids=torch.zeros(13, dtype=torch.int64, device=d),
                                          media_index=None, media=None, pad_to=None), ValueError, "13"),
    ("media without media_index", lambda a, d: a.update(media_index=None), ValueError, "media_index"),
    ("media_index short", lambda a, d: a.update(media_index=a["media_index"][:7]), ValueError, "media_index"),
    ("media_index long", lambda a, d: a.update(media_index=a["media_index"].repeat(2)), ValueError, "media_index"),
    ("media_index float", lambda a, d: a.update(media_index=a["media_index"].float()), TypeError, "media_index"),
    ("media_index device", lambda a, d: a.update(media_index=torch.zeros(8, dtype=torch.int64, device=_other(d))),
     ValueError, "media_index"),
    ("text_scale str", lambda a, d: a.update(text_scale="2"), TypeError, "text_scale"),
    ("text_scale bool", lambda a, d: a.update(text_scale=True), TypeError, "text_scale"),
    ("text_scale tensor", lambda a, d: a.update(text_scale=torch.tensor(2.0)), TypeError, "text_scale"),
    ("vocab_range one", lambda a, d: a.update(vocab_range=(5,)), TypeError, "vocab_range"),
    ("vocab_range reversed", lambda a, d: a.update(vocab_range=(10, 5)), ValueError, "vocab_range"),
    ("vocab_range negative", lambda a, d: a.update(vocab_range=(-1, 5)), ValueError, "vocab_range"),
    ("vocab_range past table", lambda a, d: a.update(vocab_range=(0, 17)), ValueError, "vocab_range"),
    ("vocab_range floats", lambda a, d: a.update(vocab_range=(0.0, 16.0)), ValueError, "vocab_range"),
    ("vocab_size below end", lambda a, d: a.update(vocab_size=15), ValueError, "vocab_size"),
    ("vocab_size float", lambda a, d: a.update(vocab_size=100.0), ValueError, "vocab_size"),
    ("errors int64", lambda a, d: a.update(errors=torch.zeros(4, dtype=torch.int64, device=d)), ValueError,
     "errors"),
    ("errors short", lambda a, d: a.update(errors=torch.zeros(3, dtype=torch.int32, device=d)), ValueError,
     "errors"),
    ("errors device", lambda a, d: a.update(errors=torch.zeros(4, dtype=torch.int32, device=_other(d))),
     ValueError, "errors"),
]


@pytest.mark.parametrize("name, change, exc, words", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_arguments_raise_before_writing(name, change, exc, words, device):
    args = _base(device)
    change(args, device)
    slab = args.pop("slab")
    before = slab.clone() if isinstance(slab, torch.Tensor) else None
    errors = args.pop("errors", new_error_word(device))
    errors_before = errors.clone()
    default_before = default_error_word(device).clone()
    with pytest.raises(exc) as info:
        stage_embeddings(slab, args.pop("input_ids"), args.pop("table"), errors=errors, **args)
    assert words in str(info.value)
    if before is not None:
        assert same_bytes(slab, before), "the slab was written before the error"
    if errors.device.type != "meta":
        assert same_bytes(errors, errors_before)
    assert same_bytes(default_error_word(device), default_before)


def test_valid_base_arguments_pass(device):
    args = _base(device)
    stage_and_check(args.pop("slab"), args.pop("input_ids"), args.pop("table"), **args)


def test_zero_wide_table_with_repeat_is_a_width_error(device):
    slab = poisoned(4, 16, torch.float32, device)
    with pytest.raises(WidthContractError):
        stage_embeddings(slab, torch.zeros(2, dtype=torch.int64, device=device),
                         torch.zeros(5, 0, device=device), expand="repeat", errors=new_error_word(device))
    assert (slab == POISON).all()


# -- property test ---------------------------------------------------------------------------------

@st.composite
def staging_cases(draw):
    expand = draw(st.sampled_from(["zeros", "repeat"]))
    if expand == "repeat":
        Ht = draw(st.sampled_from([3, 8, 12, 16, 24]))
        W = Ht * draw(st.integers(1, 4))
        Hm = draw(st.sampled_from([Ht, W]))  # media is as wide as the slab or as the text (width contract)
    else:
        W = draw(st.integers(1, 80))
        Ht = draw(st.integers(1, W))
        Hm = draw(st.sampled_from([Ht, W]))
    n = draw(st.integers(0, 20))
    pad_to = n + draw(st.integers(0, 3))
    rows = pad_to + draw(st.integers(0, 3))
    V = draw(st.integers(1, 30))
    M = draw(st.integers(0, 10))
    return dict(
        W=W, Ht=Ht, Hm=Hm, n=n, pad_to=pad_to, rows=rows, V=V, M=M, expand=expand,
        slab_dtype=draw(st.sampled_from(DTYPES)), table_dtype=draw(st.sampled_from(DTYPES)),
        media_dtype=draw(st.sampled_from(DTYPES)), ids_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        media_kind=draw(st.sampled_from(["none", "index-only", "media"])),
        media_frac=draw(st.floats(0, 1)), bad_frac=draw(st.sampled_from([0.0, 0.1, 0.3])),
        shard=draw(st.sampled_from([None, "low", "high"])),
        text_scale=draw(st.sampled_from([None, 0.5, math.sqrt(1000)])),
        media_owner=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=staging_cases())
def test_property_matches_reference(case, device):
    c = case
    g = torch.Generator().manual_seed(c["seed"])
    n, V, M = c["n"], c["V"], c["M"]
    table = randn(g, V, c["Ht"], dtype=c["table_dtype"], device=device)
    vocab_range, vocab_size, vocab = None, None, V
    if c["shard"] is not None:  # this table is one shard of a vocabulary three times as large
        vocab = 3 * V
        start = 0 if c["shard"] == "low" else 2 * V
        vocab_range, vocab_size = (start, start + V), vocab
    ids = torch.randint(0, vocab, (n,), generator=g)
    bad = torch.rand(n, generator=g) < c["bad_frac"]
    ids = torch.where(bad, torch.where(torch.rand(n, generator=g) < 0.5, -1 - ids, vocab + ids), ids)
    ids = ids.to(c["ids_dtype"]).to(device)
    kw = dict(pad_to=c["pad_to"], expand=c["expand"], text_scale=c["text_scale"], vocab_range=vocab_range,
              vocab_size=vocab_size, media_owner=c["media_owner"])
    if c["media_kind"] != "none":
        is_media = torch.rand(n, generator=g) < c["media_frac"]
        index = torch.randint(0, M + 2, (n,), generator=g)  # M and M + 1 are bad indices
        index = torch.where(is_media, index, -1).to(c["ids_dtype"]).to(device)
        kw["media_index"] = index
        if c["media_kind"] == "media":
            kw["media"] = randn(g, M, c["Hm"], dtype=c["media_dtype"], device=device)
    slab = poisoned(c["rows"], c["W"], c["slab_dtype"], device, value=float("nan"))
    stage_and_check(slab, ids, table, **kw)


def test_triton_kernel_runs_not_the_reference(device, kernel_only):
    """Under the interpreter (CPU) and on CUDA the Triton kernel is what these tests check."""
    g = torch.Generator().manual_seed(30)
    table = randn(g, 9, 16, device=device)
    ids = randint(g, 0, 9, 5, device=device)
    slab = poisoned(6, 16, torch.bfloat16, device)
    stage_embeddings(slab, ids, table, pad_to=6, errors=new_error_word(device))
    assert torch.equal(slab[:5].cpu(), table[ids].to(torch.bfloat16).cpu()) and (slab[5] == 0).all()
