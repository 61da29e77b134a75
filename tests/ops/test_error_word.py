"""The device error word and strict mode: this file is their spec.

The word is ``int32[4]`` on the slab's device (``new_error_word(device)``,
``StagingBuffers.errors``, or the module-level default word of the device):

======== ======================================================================
word[0]  OR of the codes: BAD_TOKEN_ID = 1 (a text row's id < 0 or >= the
         vocabulary), BAD_MEDIA_INDEX = 2 (a media row's index >= the media
         rows), MEDIA_COUNT_MISMATCH = 4 (placeholders in the mask != media rows)
word[1]  rows zero-filled for a bad id or media index since the last reset
word[2]  the smallest such row; 2**31 - 1 when none
word[3]  the placeholder count found by the last ``media_index_from_mask``
======== ======================================================================

Kernels only write the word (atomics on the device, no host sync). Codes and row
counts accumulate until a reset. ``raise_if_errors`` reads it (one sync): a clean
word (codes 0) raises nothing and is left as it is; otherwise the word is reset
and ``StagingError`` (a ``RuntimeError``) is raised with ``.codes``, ``.rows``,
``.first_row`` (None when no row was flagged) and ``.count``. ``strict=True``
does the same right after the launch; the slab is staged all the same (bad rows
zero-filled). Calls given no ``errors`` report into the default word of the
slab's device, which ``raise_if_errors(device=...)`` reads.
"""

import pytest
import torch

import slabstage as ss
from slabstage import (BAD_MEDIA_INDEX, BAD_TOKEN_ID, MEDIA_COUNT_MISMATCH, PrefillBatch, PrefillGraphRunner,
                       StagingError, media_index_from_mask, new_error_word, raise_if_errors, reset_errors,
                       stage_embeddings)
from slabstage.staging import default_error_word
from slabstage.staging.stager import stage_batch

NO_ROW = 2**31 - 1
CLEAN = [0, 0, NO_ROW, 0]
V, M, W = 30, 5, 24  # vocabulary, media rows, slab width
POISON = 777.0


def inputs(device, n=12, seed=0):
    """Good inputs: media rows at 3, 4, 5 (media rows 0..2) and 9 (media row 3); the rest text."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(V, W, generator=g).to(device)
    media = torch.randn(M, W, generator=g).to(device)
    ids = torch.randint(0, V, (n,), generator=g).to(device)
    index = torch.full((n,), -1, dtype=torch.int64)
    index[3:6] = torch.arange(3)
    index[9] = 3
    return table, media, ids, index.to(device)


def slab_for(device, rows=16):
    return torch.full((rows, W), POISON, device=device)


def stage(device, *, errors, ids=None, index=None, media="given", n=12, pad_to=None, **kw):
    table, good_media, good_ids, good_index = inputs(device, n)
    slab = slab_for(device, max(16, n + 2))
    stage_embeddings(slab, good_ids if ids is None else ids.to(device), table,
                     media=good_media if media == "given" else media,
                     media_index=good_index if index is None else index.to(device), pad_to=pad_to, errors=errors, **kw)
    return slab


def with_ids(device, **rows):
    ids = inputs(device)[2].clone()
    for row, value in rows.items():
        ids[int(row[1:])] = value
    return ids


def with_index(device, **rows):
    index = inputs(device)[3].clone()
    for row, value in rows.items():
        index[int(row[1:])] = value
    return index


# ==================================================================================================
# Layout
# ==================================================================================================
def test_codes_are_distinct_bits():
    assert (BAD_TOKEN_ID, BAD_MEDIA_INDEX, MEDIA_COUNT_MISMATCH) == (1, 2, 4)
    assert ss.staging.ERROR_WORD_SIZE == 4


def test_a_fresh_word_is_clean(device):
    for word in (new_error_word(device), ss.StagingBuffers.allocate(
            max_num_tokens=8, max_batch_size=2, embed_width=W, embed_dtype=torch.float32, device=device).errors):
        assert word.dtype == torch.int32 and word.shape == (4,) and word.device.type == device.type
        assert word.tolist() == CLEAN
    word = new_error_word(device)
    word.copy_(torch.tensor([7, 3, 1, 9]))
    reset_errors(word)
    assert word.tolist() == CLEAN


# ==================================================================================================
# Each code, set by its situation (and only by it)
# ==================================================================================================
SITUATIONS = [
    # id, how the batch is staged, the word afterwards
    ("text id -1", lambda d, w: stage(d, errors=w, ids=with_ids(d, r1=-1)), [BAD_TOKEN_ID, 1, 1, 0]),
    ("text id = vocabulary", lambda d, w: stage(d, errors=w, ids=with_ids(d, r7=V)), [BAD_TOKEN_ID, 1, 7, 0]),
    ("text id >= vocab_size, vocab-parallel shard",
     lambda d, w: stage(d, errors=w, ids=with_ids(d, r2=3 * V), vocab_range=(V, 2 * V), vocab_size=3 * V),
     [BAD_TOKEN_ID, 1, 2, 0]),
    ("media index = media rows", lambda d, w: stage(d, errors=w, index=with_index(d, r4=M)),
     [BAD_MEDIA_INDEX, 1, 4, 0]),
    ("media index with no media given", lambda d, w: stage(d, errors=w, media=None),
     [BAD_MEDIA_INDEX, 4, 3, 0]),
    ("mask with fewer placeholders than media rows",
     lambda d, w: media_index_from_mask(inputs(d)[3] >= 0, M, errors=w), [MEDIA_COUNT_MISMATCH, 0, NO_ROW, 4]),
    ("mask with more placeholders than media rows",
     lambda d, w: media_index_from_mask(inputs(d)[3] >= 0, 2, errors=w), [MEDIA_COUNT_MISMATCH, 0, NO_ROW, 4]),
    # not errors
    ("mask count equal to media rows: the count only",
     lambda d, w: media_index_from_mask(inputs(d)[3] >= 0, 4, errors=w), [0, 0, NO_ROW, 4]),
    ("id in another rank's shard: a zero row, no error",
     lambda d, w: stage(d, errors=w, ids=with_ids(d, r2=V + 1), vocab_range=(0, V), vocab_size=2 * V), CLEAN),
    ("bad id on a media row: the id is not read", lambda d, w: stage(d, errors=w, ids=with_ids(d, r4=-1, r9=V)), CLEAN),
    ("any negative media index is a text row", lambda d, w: stage(d, errors=w, index=with_index(d, r0=-7)), CLEAN),
    ("bad ids past n are not looked at", lambda d, w: stage(d, errors=w, ids=with_ids(d, r11=V)[:11],
                                                            index=inputs(d)[3][:11], pad_to=13), CLEAN),
]


@pytest.mark.parametrize("what, run, word", SITUATIONS, ids=[s[0] for s in SITUATIONS])
def test_each_code_is_set_by_its_situation(what, run, word, device):
    errors = new_error_word(device)
    run(device, errors)
    assert errors.tolist() == word


def test_codes_or_together_and_rows_add_up(device):
    errors = new_error_word(device)
    stage(device, errors=errors, ids=with_ids(device, r8=V), index=with_index(device, r5=M + 1))
    assert errors.tolist() == [BAD_TOKEN_ID | BAD_MEDIA_INDEX, 2, 5, 0]
    media_index_from_mask(inputs(device)[3] >= 0, M, errors=errors)
    assert errors.tolist() == [BAD_TOKEN_ID | BAD_MEDIA_INDEX | MEDIA_COUNT_MISMATCH, 2, 5, 4]
    stage(device, errors=errors, ids=with_ids(device, r0=-3, r11=V))  # a second batch before anyone looked
    assert errors.tolist() == [BAD_TOKEN_ID | BAD_MEDIA_INDEX | MEDIA_COUNT_MISMATCH, 4, 0, 4]


def test_first_row_is_the_smallest_across_programs_and_calls(device):
    # many programs race for word[2] on a GPU; the smallest row must win (the interpreter runs them in turn:
    # fewer rows there, the same rows reported)
    n = 300 if device.type == "cuda" else 136
    g = torch.Generator().manual_seed(3)
    table = torch.randn(V, W, generator=g).to(device)
    ids = torch.randint(0, V, (n,), generator=g)
    ids[[n - 1, n - 3, 130, 131]] = torch.tensor([V, -1, V + 5, 2**40])
    errors = new_error_word(device)
    slab = torch.full((n, W), POISON, device=device)
    stage_embeddings(slab, ids.to(device), table, errors=errors)
    assert errors.tolist() == [BAD_TOKEN_ID, 4, 130, 0]
    ids2 = torch.randint(0, V, (n,), generator=g)
    ids2[133] = V
    stage_embeddings(slab, ids2.to(device), table, errors=errors)  # a later, larger bad row: first stays
    assert errors.tolist() == [BAD_TOKEN_ID, 5, 130, 0]
    ids2[17] = -1
    stage_embeddings(slab, ids2.to(device), table, errors=errors)  # a later, smaller one: first moves
    assert errors.tolist() == [BAD_TOKEN_ID, 7, 17, 0]


# ==================================================================================================
# raise_if_errors
# ==================================================================================================
def test_raise_if_errors_reports_and_resets(device):
    errors = new_error_word(device)
    stage(device, errors=errors, ids=with_ids(device, r10=V, r6=-2), index=with_index(device, r9=M))
    with pytest.raises(StagingError) as info:
        raise_if_errors(errors)
    e = info.value
    assert isinstance(e, RuntimeError)
    assert (e.codes, e.rows, e.first_row, e.count) == (BAD_TOKEN_ID | BAD_MEDIA_INDEX, 3, 6, 0)
    msg = str(e)
    assert "token id outside the vocabulary" in msg and "media index past the media rows" in msg
    assert "3 row(s) zero-filled, first at row 6" in msg
    assert errors.tolist() == CLEAN  # reset
    raise_if_errors(errors)  # and nothing to raise now


def test_raise_if_errors_for_a_count_mismatch_alone(device):
    errors = new_error_word(device)
    media_index_from_mask(inputs(device)[3] >= 0, 2, errors=errors)
    with pytest.raises(StagingError, match="placeholder mask had 4 media rows") as info:
        raise_if_errors(errors)
    e = info.value
    assert (e.codes, e.rows, e.first_row, e.count) == (MEDIA_COUNT_MISMATCH, 0, None, 4)
    assert "no rows written from bad sources" in str(e)
    assert errors.tolist() == CLEAN


def test_a_clean_word_raises_nothing_and_is_left_alone(device):
    errors = new_error_word(device)
    raise_if_errors(errors)
    assert errors.tolist() == CLEAN
    media_index_from_mask(inputs(device)[3] >= 0, 4, errors=errors)  # a matching count: recorded, not an error
    raise_if_errors(errors)
    assert errors.tolist() == [0, 0, NO_ROW, 4]


@pytest.mark.parametrize("word", [torch.zeros(4, dtype=torch.int64), torch.zeros(3, dtype=torch.int32),
                                  torch.zeros(8, dtype=torch.int32)[::2], [0, 0, 0, 0]],
                         ids=["int64", "three words", "strided", "a list"])
def test_raise_if_errors_refuses_what_is_not_a_word(word):
    with pytest.raises(ValueError, match="errors must be a contiguous 1-D int32 tensor of at least 4"):
        raise_if_errors(word)


# ==================================================================================================
# strict mode
# ==================================================================================================
def test_strict_raises_at_once_and_the_slab_is_still_staged(device):
    table, media, _, index = inputs(device)
    errors = new_error_word(device)
    ids = with_ids(device, r7=V)
    slab = slab_for(device)
    with pytest.raises(StagingError) as info:
        stage_embeddings(slab, ids, table, media=media, media_index=index, pad_to=14, errors=errors, strict=True)
    assert (info.value.codes, info.value.rows, info.value.first_row) == (BAD_TOKEN_ID, 1, 7)
    assert errors.tolist() == CLEAN  # strict read and reset the word
    want = torch.where((index >= 0)[:, None], media[index.clamp(min=0)], table[ids.clamp(0, V - 1)])
    want[7] = 0  # the bad row is zero-filled
    assert torch.equal(slab[:12], want)
    assert (slab[12:14] == 0).all() and (slab[14:] == POISON).all()


def test_strict_on_a_good_batch_returns_the_slab(device):
    table, media, ids, index = inputs(device)
    slab = slab_for(device)
    errors = new_error_word(device)
    assert stage_embeddings(slab, ids, table, media=media, media_index=index, errors=errors, strict=True) is slab
    assert errors.tolist() == CLEAN


def test_strict_reads_the_word_it_was_given_only(device):
    """A problem already in the default word does not make a strict call with its own word raise, and back."""
    default = default_error_word(device)
    reset_errors(default)
    stage(device, errors=None, ids=with_ids(device, r1=-1))
    own = new_error_word(device)
    stage(device, errors=own, strict=True)  # clean batch, own word: no raise despite the default word
    with pytest.raises(StagingError):
        stage(device, errors=None, strict=True)  # clean batch, but the default word holds the earlier error
    assert default.tolist() == CLEAN


# ==================================================================================================
# The default word, and who reports where
# ==================================================================================================
def test_calls_without_errors_use_the_default_word_of_the_device(device):
    default = default_error_word(device)
    assert default_error_word(device) is default and default_error_word(str(device)) is default
    reset_errors(default)
    own = new_error_word(device)
    stage(device, errors=None, ids=with_ids(device, r2=V))
    assert default.tolist() == [BAD_TOKEN_ID, 1, 2, 0] and own.tolist() == CLEAN
    media_index_from_mask(inputs(device)[3] >= 0, 1)
    assert default.tolist() == [BAD_TOKEN_ID | MEDIA_COUNT_MISMATCH, 1, 2, 4]
    stage(device, errors=own, ids=with_ids(device, r0=V))  # an explicit word: the default is not touched
    assert default.tolist() == [BAD_TOKEN_ID | MEDIA_COUNT_MISMATCH, 1, 2, 4]
    assert own.tolist() == [BAD_TOKEN_ID, 1, 0, 0]
    with pytest.raises(StagingError) as info:
        raise_if_errors(device=device)
    assert info.value.count == 4
    assert default.tolist() == CLEAN
    raise_if_errors(device=device)


@pytest.mark.cuda
def test_default_word_of_cuda_is_the_current_devices():
    assert default_error_word("cuda") is default_error_word(torch.device("cuda", torch.cuda.current_device()))
    assert default_error_word("cuda") is not default_error_word("cpu")
    reset_errors(default_error_word("cpu"))
    reset_errors(default_error_word("cuda"))
    stage(torch.device("cuda"), errors=None, ids=with_ids("cuda", r1=-1))
    assert default_error_word("cpu").tolist() == CLEAN
    with pytest.raises(StagingError):
        raise_if_errors()  # no device: the current CUDA device's word


def test_batch_staging_and_the_runner_report_into_the_buffers_word(device):
    buffers = ss.StagingBuffers.allocate(max_num_tokens=16, max_batch_size=2, embed_width=W,
                                         embed_dtype=torch.float32, device=device)
    default = default_error_word(device)
    reset_errors(default)
    reset_errors(buffers.errors)
    table, media, _, index = inputs(device)
    ids = with_ids(device, r11=V)
    stage_batch(buffers, input_ids=ids, positions=torch.arange(12, device=device), table=table, media=media,
                     media_index=index, pad_to=12)
    assert buffers.errors.tolist() == [BAD_TOKEN_ID, 1, 11, 0] and default.tolist() == CLEAN
    runner = PrefillGraphRunner(lambda v: v["input_embeds"] * 1, buffers, buckets=[16], progress=False).capture()
    runner.run(PrefillBatch(input_ids=ids.cpu(), positions=torch.arange(12), table=table, media=media,
                            media_index=with_index(device, r0=M + 9)))
    assert buffers.errors.tolist() == [BAD_TOKEN_ID | BAD_MEDIA_INDEX, 3, 0, 0] and default.tolist() == CLEAN
    with pytest.raises(StagingError):
        raise_if_errors(buffers.errors)


@pytest.mark.cuda
def test_recording_errors_does_not_synchronise():
    device = torch.device("cuda")
    errors = new_error_word(device)
    table, media, _, index = inputs(device)
    bad = with_ids(device, r1=-1)
    slab = slab_for(device)
    stage_embeddings(slab, bad, table, media=media, media_index=index, errors=errors)  # compile outside the check
    mask = index >= 0
    media_index_from_mask(mask, 1, errors=errors)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stage_embeddings(slab, bad, table, media=media, media_index=index, errors=errors)
        media_index_from_mask(mask, 1, errors=errors)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(StagingError) as info:
        raise_if_errors(errors)  # the one sync, when the engine chooses
    assert info.value.codes == BAD_TOKEN_ID | MEDIA_COUNT_MISMATCH and info.value.rows == 2
