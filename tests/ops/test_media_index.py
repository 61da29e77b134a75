"""media_index_from_spans (host spans) and media_index_from_mask (device prefix sum)."""

import numpy as np
import pytest
import torch

from slabstage import (MEDIA_COUNT_MISMATCH, StagingError, media_index_from_mask, media_index_from_spans,
                       new_error_word, raise_if_errors, stage_embeddings)
from slabstage.staging import BAD_MEDIA_INDEX

NO_ROW = 2**31 - 1


def spans_reference(spans, num_tokens):
    index = [-1] * num_tokens
    for dst, length, src in spans:
        for i in range(length):
            index[dst + i] = src + i
    return torch.tensor(index, dtype=torch.int32)


def mask_reference(mask):
    counts = torch.cumsum(mask.cpu().long(), 0)
    return torch.where(mask.cpu(), counts - 1, torch.full_like(counts, -1)).to(torch.int32)


# -- spans ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spans, num_tokens", [
    ([(2, 3, 0), (9, 4, 3)], 16),
    ([(9, 4, 3), (2, 3, 0)], 13),  # any order
    ([(0, 7, 0)], 7),  # all media
    ([(0, 1, 5), (1, 1, 2), (5, 2, 0)], 7),  # adjacent spans, sources out of order
    ([(4, 0, 0), (3, 5, 10)], 11),  # a zero-length span
    ([(np.int64(1), np.int32(2), np.int64(4))], 5),  # numpy ints
    ([[30, 33, 0]], 64),
])
def test_spans(spans, num_tokens, device):
    index = media_index_from_spans(spans, num_tokens, device=device)
    assert index.dtype == torch.int32 and index.shape == (num_tokens,) and index.device.type == device.type
    assert torch.equal(index.cpu(), spans_reference(spans, num_tokens))


def test_spans_generator_and_num_media_rows(device):
    spans = ((3 * k, 2, 2 * k) for k in range(5))
    index = media_index_from_spans(spans, 17, device=device, num_media_rows=10)
    assert torch.equal(index.cpu(), spans_reference([(3 * k, 2, 2 * k) for k in range(5)], 17))


@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_spans_empty(num_tokens, device):
    index = media_index_from_spans([], num_tokens, device=device)
    assert index.dtype == torch.int32 and index.shape == (num_tokens,)
    assert (index == -1).all()


def test_spans_with_device_string(device):
    index = media_index_from_spans([(1, 2, 0)], 4, device=str(device))
    assert index.tolist() == [-1, 0, 1, -1]


@pytest.mark.parametrize("spans, num_tokens, num_media_rows, match", [
    ([(2, 4, 0), (5, 2, 4)], 16, None, "overlap"),
    ([(5, 2, 4), (2, 4, 0)], 16, None, "overlap"),
    ([(3, 3, 0), (3, 3, 3)], 16, None, "overlap"),
    ([(10, 7, 0)], 16, None, "past num_tokens"),
    ([(16, 1, 0)], 16, None, "past num_tokens"),
    ([(-1, 2, 0)], 16, None, "negative"),
    ([(0, -2, 0)], 16, None, "negative"),
    ([(0, 2, -1)], 16, None, "negative"),
    ([(0, 4, 3)], 16, 6, "media rows"),
    ([(0, 2, 0), (4, 3, 2)], 16, 4, "media rows"),
    ([(0, 1, 0)], 16, 0, "media rows"),
    ([(0, 2)], 16, None, "dst_start"),
    ([(0, 2, 0, 1)], 16, None, "dst_start"),
])
def test_spans_invalid(spans, num_tokens, num_media_rows, match, device):
    with pytest.raises(ValueError, match=match):
        media_index_from_spans(spans, num_tokens, device=device, num_media_rows=num_media_rows)


@pytest.mark.parametrize("spans, num_tokens", [([(0, 2.0, 0)], 8), ([(True, 2, 0)], 8), ([(0, 2, 0)], 8.0),
                                               ([(0, 2, 0)], True), ([(0, "2", 0)], 8)])
def test_spans_non_int(spans, num_tokens, device):
    with pytest.raises(TypeError):
        media_index_from_spans(spans, num_tokens, device=device)


def test_spans_negative_num_tokens(device):
    with pytest.raises(ValueError, match="num_tokens"):
        media_index_from_spans([], -1, device=device)


# -- mask -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 64, 1000, 2500])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_mask_matches_cumsum(n, p, device):
    g = torch.Generator().manual_seed(n * 10 + int(p * 10))
    mask = (torch.rand(n, generator=g) < p).to(device)
    count = int(mask.sum())
    errors = new_error_word(device)
    index = media_index_from_mask(mask, count, errors=errors)
    assert index.dtype == torch.int32 and index.shape == (n,) and index.device == mask.device
    assert torch.equal(index.cpu(), mask_reference(mask))
    assert errors.tolist() == [0, 0, NO_ROW, count]


@pytest.mark.parametrize("n, extra", [(7, 1), (64, -1), (1000, 5), (2500, -3), (1, 1)])
def test_mask_count_mismatch(n, extra, device):
    g = torch.Generator().manual_seed(n + extra)
    mask = (torch.rand(n, generator=g) < 0.5).to(device)
    mask[0] = True
    count = int(mask.sum())
    errors = new_error_word(device)
    index = media_index_from_mask(mask, count + extra, errors=errors)
    assert torch.equal(index.cpu(), mask_reference(mask))  # the index is still the prefix sum
    codes, rows, first, found = errors.tolist()
    assert codes == MEDIA_COUNT_MISMATCH and found == count
    assert rows == 0 and first == NO_ROW  # no row was flagged: nothing was staged yet
    with pytest.raises(StagingError) as info:
        raise_if_errors(errors)
    assert info.value.codes == MEDIA_COUNT_MISMATCH and info.value.count == count
    assert str(count) in str(info.value)
    assert errors.tolist() == [0, 0, NO_ROW, 0]
    raise_if_errors(errors)  # reset: no second raise


def test_mask_keeps_earlier_codes(device):
    errors = new_error_word(device)
    errors[0] = BAD_MEDIA_INDEX
    mask = torch.tensor([True, False, True], device=device)
    media_index_from_mask(mask, 5, errors=errors)
    assert errors[0].item() == BAD_MEDIA_INDEX | MEDIA_COUNT_MISMATCH and errors[3].item() == 2
    media_index_from_mask(torch.tensor([False, True], device=device), 1, errors=errors)
    assert errors[0].item() == BAD_MEDIA_INDEX | MEDIA_COUNT_MISMATCH  # sticky until reset
    assert errors[3].item() == 1  # the last call's count


def test_mask_empty(device):
    mask = torch.zeros(0, dtype=torch.bool, device=device)
    errors = new_error_word(device)
    index = media_index_from_mask(mask, 0, errors=errors)
    assert index.shape == (0,) and index.dtype == torch.int32
    assert errors.tolist() == [0, 0, NO_ROW, 0]
    index = media_index_from_mask(mask, 3, errors=errors)
    assert index.shape == (0,)
    assert errors.tolist() == [MEDIA_COUNT_MISMATCH, 0, NO_ROW, 0]


def test_mask_non_contiguous(device):
    g = torch.Generator().manual_seed(5)
    full = (torch.rand(66, generator=g) < 0.4).to(device)
    mask = full[::2]
    errors = new_error_word(device)
    index = media_index_from_mask(mask, int(mask.sum()), errors=errors)
    assert torch.equal(index.cpu(), mask_reference(mask))
    assert errors[0].item() == 0


def test_mask_default_error_word(device):
    from slabstage.staging import default_error_word, reset_errors
    word = default_error_word(device)
    reset_errors(word)
    media_index_from_mask(torch.tensor([True, True, False], device=device), 1)
    assert word[0].item() == MEDIA_COUNT_MISMATCH and word[3].item() == 2
    with pytest.raises(StagingError):
        raise_if_errors(device=device)
    assert word.tolist() == [0, 0, NO_ROW, 0]


@pytest.mark.parametrize("bad, exc", [
    (lambda d: torch.tensor([1, 0, 1], device=d), TypeError),
    (lambda d: torch.tensor([1.0, 0.0], device=d), TypeError),
    (lambda d: torch.zeros(2, 3, dtype=torch.bool, device=d), ValueError),
    (lambda d: torch.tensor(True, device=d), ValueError),
    (lambda d: [True, False], ValueError),
])
def test_mask_invalid(bad, exc, device):
    with pytest.raises(exc):
        media_index_from_mask(bad(device), 1, errors=new_error_word(device))


@pytest.mark.parametrize("num_media", [-1, 1.0, True, None])
def test_mask_invalid_count(num_media, device):
    with pytest.raises((TypeError, ValueError)):
        media_index_from_mask(torch.tensor([True], device=device), num_media, errors=new_error_word(device))


def test_mask_invalid_error_word(device):
    mask = torch.tensor([True], device=device)
    for errors in (torch.zeros(4, dtype=torch.int64, device=device), torch.zeros(3, dtype=torch.int32, device=device),
                   torch.zeros(8, dtype=torch.int32, device=device)[::2], torch.zeros(4, dtype=torch.int32,
                                                                                     device="meta")):
        with pytest.raises(ValueError, match="errors"):
            media_index_from_mask(mask, 1, errors=errors)


# -- the two together with stage_embeddings ----------------------------------------------------

def test_mask_with_too_few_media_rows_flags_staging(device):
    """More placeholders than media rows: the extra rows are zero-filled and flagged, never read."""
    g = torch.Generator().manual_seed(11)
    n, V, M, W = 13, 40, 3, 24
    mask = torch.zeros(n, dtype=torch.bool)
    mask[[2, 3, 4, 8, 9]] = True  # five placeholders, three media rows
    mask = mask.to(device)
    table = torch.randn(V, W, generator=g).to(device)
    media = torch.randn(M, W, generator=g).to(device)
    ids = torch.randint(0, V, (n,), generator=g).to(device)
    errors = new_error_word(device)
    index = media_index_from_mask(mask, M, errors=errors)
    slab = torch.full((16, W), 12345.0, device=device)
    stage_embeddings(slab, ids, table, media=media, media_index=index, errors=errors)
    codes, rows, first, found = errors.tolist()
    assert codes == MEDIA_COUNT_MISMATCH | BAD_MEDIA_INDEX and rows == 2 and first == 8 and found == 5
    assert torch.equal(slab[[2, 3, 4]], media)
    assert (slab[[8, 9]] == 0).all()
    text = (~mask).nonzero().flatten()
    assert torch.equal(slab[text], table[ids[text]])
    assert (slab[n:] == 12345.0).all()


def test_spans_drive_staging(device):
    g = torch.Generator().manual_seed(12)
    n, V, M, W = 11, 30, 6, 16
    spans = [(1, 2, 4), (6, 4, 0)]
    index = media_index_from_spans(spans, n, device=device, num_media_rows=M)
    table = torch.randn(V, W, generator=g).to(device)
    media = torch.randn(M, W, generator=g).to(device)
    ids = torch.randint(0, V, (n,), generator=g).to(device)
    slab = torch.full((n, W), float("nan"), device=device)
    errors = new_error_word(device)
    stage_embeddings(slab, ids, table, media=media, media_index=index, errors=errors)
    expected = table[ids].clone()
    expected[1:3] = media[4:6]
    expected[6:10] = media[0:4]
    assert torch.equal(slab, expected)
    assert errors.tolist() == [0, 0, NO_ROW, 0]


# -- media_index_from_mask with src_start (chunked prefill cutting an image) ------------------------

INT32_MAX = 2**31 - 1


def chunk_reference(mask, src_start):
    """Independent of the kernels: a Python loop over the rows."""
    out, k = [], 0
    for placeholder in mask.cpu().tolist():
        out.append(src_start + k if placeholder else -1)
        k += placeholder
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("n", [1, 7, 64, 1023, 1025, 2500])
@pytest.mark.parametrize("src_start", [0, 1, 37, 4099])
def test_mask_src_start(n, src_start, device, mask_path):
    g = torch.Generator().manual_seed(n * 7 + src_start)
    mask = (torch.rand(n, generator=g) < 0.45).to(device)
    count = int(mask.sum())
    errors = new_error_word(device)
    index = media_index_from_mask(mask, count, src_start=src_start, errors=errors)
    assert index.dtype == torch.int32 and index.shape == (n,) and index.device == mask.device
    assert torch.equal(index.cpu(), chunk_reference(mask, src_start))
    assert errors.tolist() == [0, 0, NO_ROW, count]


@pytest.mark.parametrize("n, extra", [(9, 1), (1025, -2), (333, 4)])
def test_mask_src_start_count_mismatch(n, extra, device, mask_path):
    g = torch.Generator().manual_seed(n)
    mask = (torch.rand(n, generator=g) < 0.5).to(device)
    mask[0] = True
    count = int(mask.sum())
    errors = new_error_word(device)
    index = media_index_from_mask(mask, count + extra, src_start=11, errors=errors)
    assert torch.equal(index.cpu(), chunk_reference(mask, 11))
    assert errors.tolist() == [MEDIA_COUNT_MISMATCH, 0, NO_ROW, count]  # the chunk's count, not src_start + count


def test_mask_src_start_strided_and_at_the_int32_end(device, mask_path):
    full = torch.zeros(2 * 301, dtype=torch.bool)
    full[::3] = True
    mask = full.to(device)[::2]  # strided: the reference path in every mode
    n = mask.shape[0]
    for src_start in (5, INT32_MAX - n + 1):  # the largest start whose rows all fit int32
        errors = new_error_word(device)
        index = media_index_from_mask(mask, int(mask.sum()), src_start=src_start, errors=errors)
        assert torch.equal(index.cpu(), chunk_reference(mask, src_start))
        assert errors[0].item() == 0
    contiguous = mask.contiguous()
    index = media_index_from_mask(contiguous, int(mask.sum()), src_start=INT32_MAX - n + 1, errors=errors)
    assert torch.equal(index.cpu(), chunk_reference(mask, INT32_MAX - n + 1))


def test_mask_src_start_stages_the_second_chunk_of_an_image(device, mask_path):
    """An image of 9 rows cut by chunked prefill: rows 0..4 in chunk 1, rows 5..8 in chunk 2."""
    g = torch.Generator().manual_seed(21)
    V, W = 50, 16
    image = torch.randn(9, W, generator=g).to(device)
    table = torch.randn(V, W, generator=g).to(device)
    chunks = [(torch.tensor([0, 0, 1, 1, 1, 1, 1], dtype=torch.bool), 0),
              (torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool), 5)]
    for mask, src_start in chunks:
        n = mask.shape[0]
        ids = torch.randint(0, V, (n,), generator=g).to(device)
        errors = new_error_word(device)
        index = media_index_from_mask(mask.to(device), int(mask.sum()), src_start=src_start, errors=errors)
        slab = torch.full((n + 3, W), float("nan"), device=device)
        stage_embeddings(slab, ids, table, media=image, media_index=index, pad_to=n + 2, errors=errors)
        rows = mask.nonzero().flatten().tolist()
        assert torch.equal(slab[rows], image[src_start:src_start + len(rows)])
        text = (~mask).nonzero().flatten().tolist()
        assert torch.equal(slab[text], table[ids[text]])
        assert (slab[n:n + 2] == 0).all() and slab[n + 2].isnan().all()
        assert errors.tolist() == [0, 0, NO_ROW, len(rows)]


@pytest.mark.parametrize("src_start, exc", [(-1, ValueError), (1.0, TypeError), (True, TypeError), (None, TypeError),
                                            (2**31, ValueError), (2**64, ValueError),
                                            (INT32_MAX - 2, ValueError)])  # + 5 rows - 1 > INT32_MAX
def test_mask_src_start_invalid(src_start, exc, device):
    errors = new_error_word(device)
    with pytest.raises(exc, match="src_start"):
        media_index_from_mask(torch.tensor([True, False, True, False, False], device=device), 2,
                              src_start=src_start, errors=errors)
    assert errors.tolist() == [0, 0, NO_ROW, 0]  # refused before any write
