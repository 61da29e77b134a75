"""media_index_from_spans and media_index_from_mask refuse what they cannot hold (no OverflowError, nothing
written) and name the span and the form they expected.
"""

import pytest
import torch
from slabstage import media_index_from_mask, media_index_from_spans, new_error_word


NO_ROW = 2**31 - 1


CLEAN = [0, 0, NO_ROW, 0]


@pytest.mark.parametrize("call, exc, match", [
    (lambda d: media_index_from_spans([(0, 2, 0), (2, 2, 2**31)], 8, device=d), ValueError, "span 1.*src_start"),
    (lambda d: media_index_from_spans([(0, 2, 2**31 - 1)], 8, device=d), ValueError, "span 0"),
    (lambda d: media_index_from_spans([(0, 2, 2**64)], 8, device=d), ValueError, "span 0"),
    (lambda d: media_index_from_spans([(0, 2, 0)], 8, device=d, num_media_rows=2**64), ValueError,
     "num_media_rows"),
    (lambda d: media_index_from_spans([], 2**64, device=d), ValueError, "num_tokens"),
    (lambda d: media_index_from_mask(torch.tensor([True, False], device=d), 2**64, errors=new_error_word(d)),
     ValueError, "num_media_rows"),
    (lambda d: media_index_from_mask(torch.tensor([True, False], device=d), 2**31, errors=new_error_word(d)),
     ValueError, "num_media_rows"),
])
def test_overflow_refused_before_any_write(call, exc, match, device):
    word = new_error_word(device)
    with pytest.raises(exc, match=match):
        call(device)
    assert word.tolist() == CLEAN


@pytest.mark.parametrize("spans, exc, match", [
    ([5], TypeError, r"span 0 .*\(dst_start, length, src_start\)"),
    ([(0, 1, 0), 7], TypeError, r"span 1 .*\(dst_start, length, src_start\)"),
    (None, TypeError, "spans must be"),
    (5, TypeError, "spans must be"),
    ([(0, 1, 2**31)], ValueError, r"span 0 .*src_start.*int32"),
    ([(0, 1, 0), (1, 1, 2**40)], ValueError, r"span 1 .*src_start.*int32"),
], ids=repr)
def test_unclear_span_errors(spans, exc, match, device):
    with pytest.raises(exc, match=match):
        media_index_from_spans(spans, 8, device=device)


def test_an_error_word_over_the_mask_is_refused(device):
    """The error word the mask kernel writes may not share memory with the mask it reads (nothing is written)."""
    memory = torch.zeros(32, dtype=torch.int32, device=device)
    word = memory[:4]
    mask = memory.view(torch.bool)[:12]  # the word's first bytes, read as a mask
    mask[::3] = True
    before = memory.clone()
    with pytest.raises(ValueError, match="is_media overlaps errors"):
        media_index_from_mask(mask, 4, errors=word)
    assert torch.equal(memory, before)
