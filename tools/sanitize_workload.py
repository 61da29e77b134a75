"""A short CUDA workload for compute-sanitizer: every staging kernel form, its error paths, capture and replay.

    python tools/sanitize_workload.py            # natively first: fills Triton's compile cache
    compute-sanitizer --tool memcheck --error-exitcode 1 python tools/sanitize_workload.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python tools/sanitize_workload.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/sanitize_workload.py
    bash tools/gpu_sanitize.sh OUTDIR            # all of the above, one log per phase
    python tools/sanitize_workload.py --small    # no CUDA: the kernels under the Triton interpreter

With PyTorch's caching allocator on, tensors are carved out of large segments,
so memcheck sees an access only when it leaves a segment. With
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` every tensor is its own ``cudaMalloc`` and
an access one element past a table, a media tensor or the slab is reported;
graph capture needs the caching allocator, so the runners are then built with
``enforce_eager=True`` and every batch runs eagerly (same staging launch, no graph).

It uses slabstage's public API only and checks every result against its own
PyTorch reference (``reference`` below), bit for bit; slabs are poisoned with
NaN before each call, so a row written that should not be (or not written that
should) shows. On CUDA each form is staged twice (the first launch compiles,
the second takes slabstage's cached launch); under the interpreter, which has
no cached launch, once. The forms:

- ``stage_embeddings``: media as one 2-D tensor, as a list of items (several
  sizes, an empty one), as DeepStack column-block tuples, row-strided (a row
  slice of a wider tensor, strided items, block views with sentinel columns
  between), pinned host items (CUDA only); ``expand="repeat"`` and ``"zeros"``
  with narrow sources; ``text_scale``; a vocab-parallel shard
  (``vocab_range``, ``vocab_size``, ``media_owner=False``); fp32/bf16 sources
  into bf16/fp16/fp32 slabs; odd widths; ``pad_to > n``; the default error word.
  Every batch holds bad ids (negative, >= vocab) and a media index past the
  media rows: zero rows, and an error word checked through ``raise_if_errors``.
- ``media_index_from_mask`` with ``src_start > 0`` (a chunk starting inside an
  image) and with a count mismatch, each staged from; ``media_index_from_spans``.
- ``stage_token_inputs`` from host and device inputs: mrope positions, an int32
  ``out_cache_loc`` slot, per-request ``seq_lens`` / ``extend_start_loc``.
- ``PrefillGraphRunner`` (the combined launch: embeddings and integer slots)
  on a DeepStack and a hyper-connection toy model: batches that replay, one over
  the padding ratio and one past the largest bucket (eager), host and device
  integer inputs, media as one tensor, items and pinned host items (CUDA); each
  output equal to the model's eager forward on the staged buffers, each staged
  slot equal to the reference.

The toy model's attention runs on PyTorch's math SDPA backend here: racecheck
reports hazards inside cuDNN's flash-attention kernel (third party, not
slabstage's), which would fail ``--error-exitcode 1`` for nothing of ours.

On an H200 it takes 7.9 s under memcheck and 68 s under racecheck (tools/gpu_sanitize.sh's logs).
Without CUDA it runs on the CPU under the Triton interpreter (TRITON_INTERPRET=1,
set here before slabstage is imported), about 30 s at full size; ``--small``
shrinks the sizes (odd widths, item, DeepStack and strided forms kept; the
pinned cases need CUDA) to a few seconds. It counts
the calls it makes against the counts its case tables call for, then prints
``SANITIZE WORKLOAD OK`` last; any mismatch raises.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections import Counter
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CUDA = torch.cuda.is_available()
if not CUDA:  # must be chosen before slabstage defines its kernels; "0" would check the references against ours
    os.environ["TRITON_INTERPRET"] = "1"
if importlib.util.find_spec("triton") is None:
    sys.exit("sanitize_workload: triton is not installed: slabstage would run its PyTorch references, not kernels")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import slabstage as ss  # noqa: E402
from slabstage import BAD_MEDIA_INDEX, BAD_TOKEN_ID, MEDIA_COUNT_MISMATCH, StagingError  # noqa: E402
from slabstage.models import ToyMultimodalModel, make_batch  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
NO_CACHING = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
NAN = float("nan")
HUGE = 3.0e38  # around sources: a sentinel read by mistake shows in any slab dtype
POISON = -7  # integer slots' rows that must not be written
NO_ROW = 2**31 - 1
BOTH = BAD_TOKEN_ID | BAD_MEDIA_INDEX
G = torch.Generator().manual_seed(0)
SMALL = False
# each form is staged twice on CUDA: the first launch compiles, the second takes slabstage's cached launch.
# The interpreter has no cached launch: once is all it checks
REPEAT = 2 if CUDA else 1
CALLS: Counter = Counter()  # public calls made, by name


def pick(full, small):
    return small if SMALL else full


# -- inputs --------------------------------------------------------------------------------------------

def rand(rows, width, dtype=F32, device=None):
    return (torch.randn(rows, width, generator=G) * 2).to(dtype).to(DEV if device is None else device)


def make_items(rows, width, dtype, splits=None, device=None):
    """One item per entry of ``rows``; ``splits[i]``: None (a 2-D tensor) or block widths (a tuple of blocks)."""
    items = []
    for i, r in enumerate(rows):
        split = None if splits is None else splits[i]
        items.append(rand(r, width, dtype, device) if split is None
                     else tuple(rand(r, w, dtype, device) for w in split))
    return items


def row_slice(rows, width, dtype):
    """``rows x width`` of random values inside a wider, taller tensor of sentinels: row stride > width."""
    big = torch.full((rows + 3, width + 24), HUGE, dtype=dtype, device=DEV)
    big[2:2 + rows, :width] = rand(rows, width, dtype)
    return big[2:2 + rows, :width]


def strided_items(width, dtype):
    """Items that are not contiguous: a row slice, every other row, column views, blocks with sentinels between."""
    r = pick((7, 6, 5, 4), (3, 2, 2, 1))
    item0 = row_slice(r[0], width, dtype)
    tall = torch.full((2 * r[1] + 4, width), HUGE, dtype=dtype, device=DEV)
    tall[::2] = rand(r[1] + 2, width, dtype)
    item1 = tall[::2][:r[1]]  # row stride 2 * width
    enc = rand(r[2], width, dtype)
    item2 = tuple(enc.split([16, width - 16], 1))  # DeepStack-like column views of one encoder output
    gap = rand(r[3], width + 16, dtype)
    gap[:, 24:40] = HUGE
    item3 = (gap[:, :24], gap[:, 40:])  # blocks of a wider tensor, sentinel columns between them
    empty = item0[:0]  # no rows, row stride > width
    assert item0.stride(0) > width and item1.stride(0) == 2 * width and item3[1].stride(0) == width + 16
    return [item0, item1, empty, item2, item3]


def pinned(items):
    return [tuple(b.cpu().pin_memory() for b in it) if isinstance(it, tuple) else it.cpu().pin_memory()
            for it in items]


def num_rows(media) -> int:
    if isinstance(media, torch.Tensor):
        return media.shape[0]
    return sum((it[0] if isinstance(it, tuple) else it).shape[0] for it in media)


def ids_and_index(n, vocab, media_rows, *, bad=True, ids_dtype=torch.int64, index_dtype=torch.int64,
                  vocab_range=None):
    """Token ids and ``media_index`` of ``n`` rows: each media row placed once at a random row, the rest text.

    ``bad``: three text rows get bad ids (negative, ``vocab``, far past it) and one row a media index just
    past the media rows. A media row carries a negative id, which the kernels must ignore there.
    ``vocab_range``: text rows at the shard's edges and just outside it (valid ids that give zeros).
    """
    ids = torch.randint(0, vocab, (n,), generator=G)
    index = torch.full((n,), -1, dtype=torch.int64)
    values = torch.randperm(media_rows, generator=G).tolist() + ([media_rows] if bad else [])
    where = torch.randperm(n, generator=G).tolist()
    planted = [-1, vocab, 2**40 if ids_dtype == torch.int64 else 2**31 - 1] if bad else []
    if vocab_range is not None:
        start, end = vocab_range
        planted += [start, end - 1, end, max(start - 1, 0)]
    assert len(values) + len(planted) <= n, (n, len(values), len(planted))
    media_at, text_at = where[:len(values)], where[len(values):]
    index[media_at] = torch.tensor(values, dtype=torch.int64)
    if media_at:
        ids[media_at[0]] = -5
    ids[text_at[:len(planted)]] = torch.tensor(planted, dtype=torch.int64)
    return ids.to(ids_dtype).to(DEV), index.to(index_dtype).to(DEV)


# -- the reference ---------------------------------------------------------------------------------------

def media_rows_of(media) -> torch.Tensor | None:
    """The media as one CPU tensor: items laid end to end, a tuple item's column blocks side by side."""
    if media is None:
        return None
    if isinstance(media, torch.Tensor):
        return media.detach().cpu()
    rows = [torch.cat([b.detach().cpu() for b in it], 1) if isinstance(it, tuple) else it.detach().cpu()
            for it in media]
    return torch.cat(rows, 0)


def widen(rows: torch.Tensor, width: int, expand: str) -> torch.Tensor:
    if rows.shape[1] == width:
        return rows
    if expand == "repeat":
        assert width % rows.shape[1] == 0
        return rows.repeat(1, width // rows.shape[1])
    return F.pad(rows, (0, width - rows.shape[1]))


def reference(before, ids, table, media=None, media_index=None, *, pad_to=None, expand="zeros", text_scale=None,
              vocab_range=None, vocab_size=None, media_owner=True):
    """``(slab, (codes, rows flagged, first flagged row))`` that staging into ``before`` must give."""
    out = before.detach().cpu().clone()
    width, dtype = out.shape[1], out.dtype
    ids = ids.detach().cpu().long()
    n = ids.shape[0]
    pad_to = n if pad_to is None else pad_to
    index = media_index.detach().cpu().long() if media_index is not None else torch.full((n,), -1)
    table = table.detach().cpu()
    start, end = vocab_range if vocab_range is not None else (0, table.shape[0])
    vocab = end if vocab_size is None else vocab_size
    media = media_rows_of(media)
    num_media = 0 if media is None else media.shape[0]
    is_media = index >= 0
    bad_id = ~is_media & ((ids < 0) | (ids >= vocab))
    bad_media = is_media & (index >= num_media)
    rows = torch.zeros(n, width, dtype=dtype)
    text = ~is_media & ~bad_id & (ids >= start) & (ids < end)
    if text.any():
        src = table[ids[text] - start]
        if text_scale is not None:
            src = src.float() * text_scale
        rows[text] = widen(src.to(dtype), width, expand)
    good = is_media & ~bad_media
    if media_owner and good.any():
        rows[good] = widen(media[index[good]].to(dtype), width, expand)
    out[:n] = rows
    out[n:pad_to] = 0
    bad = bad_id | bad_media
    codes = (BAD_TOKEN_ID if bad_id.any() else 0) | (BAD_MEDIA_INDEX if bad_media.any() else 0)
    return out, (codes, int(bad.sum()), int(bad.nonzero()[0]) if bad.any() else None)


# -- checks ------------------------------------------------------------------------------------------------

def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit (NaN poison included)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    g, w = bits(got), bits(want)
    if torch.equal(g, w):
        return
    rows = (g != w).reshape(g.shape[0], -1).any(1).nonzero().flatten().tolist()
    r = rows[0]
    raise AssertionError(f"{what}: rows {rows[:12]}{' ...' if len(rows) > 12 else ''} differ from the reference; "
                         f"row {r}: got {got[r].flatten()[:6].tolist()}, want {want[r].flatten()[:6].tolist()}")


def expect_error(want: tuple, what: str, errors: torch.Tensor | None = None, count: int | None = None) -> None:
    """``raise_if_errors`` raises ``StagingError`` with ``(codes, rows, first_row)`` == ``want`` (no raise when
    codes is 0); it resets the word."""
    try:
        ss.raise_if_errors(errors, device=DEV)
    except StagingError as e:
        got = (e.codes, e.rows, e.first_row)
        assert got == tuple(want), f"{what}: error word {got}, expected {tuple(want)}"
        assert count is None or e.count == count, f"{what}: placeholder count {e.count}, expected {count}"
        return
    assert want[0] == 0, f"{what}: no StagingError raised, expected {tuple(want)}"


def stage(slab, ids, table, *, media=None, media_index=None, errors="new", **kw):
    """``stage_embeddings`` into ``slab``, checked bit for bit against the reference, error word included.

    ``errors="new"``: a fresh word; None: the device's default word. Returns the reference's slab, its
    ``(codes, rows, first_row)`` and the word staged into (checked by the caller after the comparison)."""
    want, word = reference(slab, ids, table, media, media_index, **kw)
    errors = ss.new_error_word(DEV) if isinstance(errors, str) else errors
    CALLS["stage_embeddings"] += 1
    got = ss.stage_embeddings(slab, ids, table, media=media, media_index=media_index, errors=errors, **kw)
    assert got is slab
    return want, word, errors


# -- stage_embeddings --------------------------------------------------------------------------------------

def embedding_cases() -> list[dict]:
    """Each case: name, slab (dtype, width), n, pad (pad_to - n; None: pad_to left out), table (dtype, rows,
    width), media (a callable making it), kw (more arguments), ids/index dtypes, errors (None: the default word)."""
    W1, W2, W3, W4 = pick(4097, 129), pick(777, 77), pick(1536, 64), pick(96, 48)
    H_whole, H_odd = 512, pick(100, 20)  # 512 bf16 columns: each program's columns in one block of every item
    M = pick(9, 5)  # media rows of a one-tensor case
    item_rows = pick([5, 0, 9, 1, 3], [2, 0, 3, 1, 1])
    ds_rows = pick([4, 6, 0, 3], [2, 3, 0, 1])
    cases = [
        dict(name="one tensor, odd width", slab=(BF16, W1), n=pick(37, 12), pad=3, table=(BF16, 50, W1),
             media=lambda: rand(M, W1, BF16)),
        dict(name="fp16 slab from fp32 table and bf16 media, text_scale, pad_to default", slab=(F16, W2),
             n=pick(64, 12), pad=None, table=(F32, 50, W2), media=lambda: rand(M, W2, BF16),
             kw=dict(text_scale=27.9), ids_dtype=torch.int32, index_dtype=torch.int32),
        dict(name="repeat: narrow table and fp32 media tiled", slab=(BF16, W3), n=pick(50, 12), pad=2,
             table=(BF16, 50, pick(W3 // 3, W3 // 2)), media=lambda: rand(M, pick(W3 // 3, W3 // 2), F32),
             kw=dict(expand="repeat")),
        dict(name="zeros: narrow table, full-width media", slab=(F32, W4), n=pick(129, 12), pad=2,
             table=(F32, 50, W4 // 3), media=lambda: rand(M, W4, F32)),
        dict(name="zeros: narrow table and media, text_scale", slab=(BF16, pick(300, 60)), n=pick(40, 12), pad=3,
             table=(BF16, 50, pick(100, 20)), media=lambda: rand(M, pick(100, 20), F32),
             kw=dict(text_scale=0.37)),
        dict(name="vocab-parallel shard, not the media owner", slab=(BF16, pick(1000, 40)), n=pick(33, 16), pad=2,
             table=(BF16, 40, pick(1000, 40)), media=lambda: rand(M, pick(1000, 40), BF16),
             kw=dict(vocab_range=(40, 80), vocab_size=160, media_owner=False)),
        dict(name="items: fp32 tensors of several sizes, one empty", slab=(BF16, pick(1000, 72)), n=pick(40, 12),
             pad=3, table=(BF16, 50, pick(1000, 72)), media=lambda: make_items(item_rows, pick(1000, 72), F32),
             index_dtype=torch.int32),
        dict(name="DeepStack (main, ds0, ds1) items, whole blocks", slab=(BF16, 3 * H_whole), n=pick(24, 12),
             pad=2, table=(BF16, 50, H_whole),
             media=lambda: make_items(ds_rows, 3 * H_whole, F32, [(H_whole,) * 3] * len(ds_rows))),
        dict(name="DeepStack items, odd blocks, mixed with plain items", slab=(F32, 3 * H_odd), n=pick(30, 12),
             pad=4, table=(F32, 50, H_odd),
             media=lambda: make_items(ds_rows, 3 * H_odd, BF16, [(H_odd,) * 3, None, (3 * H_odd,), (H_odd,) * 3])),
        dict(name="one tensor strided along rows, default error word", slab=(BF16, pick(256, 48)), n=pick(30, 12),
             pad=2, table=(F32, 50, pick(256, 48)), media=lambda: row_slice(M, pick(256, 48), F32),
             errors=None),
        dict(name="strided items and block views", slab=(F32, 48), n=pick(40, 14), pad=2, table=(F32, 50, 48),
             media=lambda: strided_items(48, F32)),
    ]
    if CUDA:
        rows = [6, 0, 9, 5]
        splits = [None, None, (32, 64), (32, 32, 32)]
        cases += [
            dict(name="pinned host items", slab=(BF16, 96), n=30, pad=2, table=(BF16, 50, 32),
                 media=lambda: pinned(make_items(rows, 96, F32, splits))),
            dict(name="pinned host and device items mixed", slab=(BF16, 96), n=30, pad=2, table=(BF16, 50, 32),
                 media=lambda: [*pinned(make_items(rows[:2], 96, F32, splits[:2])),
                                *make_items(rows[2:], 96, F32, splits[2:])]),
        ]
    return cases


def stage_embeddings_cases(cases: list[dict]) -> None:
    for case in cases:
        dtype, width = case["slab"]
        n, kw = case["n"], dict(case.get("kw", {}))
        t_dtype, t_rows, t_width = case["table"]
        table = rand(t_rows, t_width, t_dtype)
        media = case["media"]()
        vocab = kw.get("vocab_size", t_rows)
        ids, index = ids_and_index(n, vocab, num_rows(media), ids_dtype=case.get("ids_dtype", torch.int64),
                                   index_dtype=case.get("index_dtype", torch.int64),
                                   vocab_range=kw.get("vocab_range"))
        pad_to = None if case["pad"] is None else n + case["pad"]
        rows = n if pad_to is None else pad_to
        for _ in range(REPEAT):
            slab = torch.full((rows + 3, width), NAN, dtype=dtype, device=DEV)
            want, word, errors = stage(slab, ids, table, media=media, media_index=index, pad_to=pad_to,
                                       errors=case.get("errors", "new"), **kw)
            assert word == (BOTH, 4, word[2]), f"{case['name']}: the batch should hold 4 bad rows, {word}"
            assert_same(slab, want, case["name"])
            expect_error(word, case["name"], errors)


# -- media_index_from_mask ---------------------------------------------------------------------------------

def mask_of(n, placeholders):
    mask = torch.zeros(n, dtype=torch.bool)
    mask[placeholders] = True
    return mask.to(DEV)


def media_index_cases() -> None:
    # a chunk that starts inside an image: its first placeholder is media row src_start of the items
    W, n, src_start = 32, 14, 3
    items = make_items([5, 7], W, F32, [(8, 24), None])
    placeholders = [2, 3, 4, 9, 10, 11]  # media rows 3..8: the end of item 0, the start of item 1
    mask = mask_of(n, placeholders)
    ids = torch.randint(0, 20, (n,), generator=G).to(DEV)
    ids[0] = 20  # a bad id on a text row
    table = rand(20, W, BF16)
    for _ in range(REPEAT):
        errors = ss.new_error_word(DEV)
        CALLS["media_index_from_mask"] += 1
        index = ss.media_index_from_mask(mask, len(placeholders), src_start=src_start, errors=errors)
        want = torch.full((n,), -1, dtype=torch.int64)
        want[placeholders] = torch.arange(src_start, src_start + len(placeholders))
        assert index.cpu().long().tolist() == want.tolist(), index.tolist()
        assert errors.tolist() == [0, 0, NO_ROW, len(placeholders)], errors.tolist()
        slab = torch.full((n + 2, W), NAN, dtype=BF16, device=DEV)
        ref, word, errors = stage(slab, ids, table, media=items, media_index=index, pad_to=n + 1, errors=errors)
        assert word == (BAD_TOKEN_ID, 1, 0), word
        assert_same(slab, ref, "media_index_from_mask(src_start=3), staged")
        expect_error(word, "media_index_from_mask(src_start=3), staged", errors, count=len(placeholders))

    # a count mismatch: more placeholders than media rows; staging then flags the rows past them
    n, spans, num_media = pick((2500, [(100, 700), (2000, 2100)], 650), (60, [(5, 35), (45, 50)], 32))
    mask = torch.zeros(n, dtype=torch.bool)
    for lo, hi in spans:
        mask[lo:hi] = True
    found = int(mask.sum())
    mask = mask.to(DEV)
    table, media = rand(30, 64), rand(num_media, 64)
    ids = torch.randint(0, 30, (n,), generator=G).to(DEV)
    for _ in range(REPEAT):
        errors = ss.new_error_word(DEV)
        CALLS["media_index_from_mask"] += 1
        index = ss.media_index_from_mask(mask, num_media, errors=errors)
        want = torch.where(mask.cpu(), torch.cumsum(mask.cpu().int(), 0) - 1, -1)
        assert index.cpu().long().tolist() == want.tolist()
        assert errors.tolist() == [MEDIA_COUNT_MISMATCH, 0, NO_ROW, found], errors.tolist()
        slab = torch.full((n + 1, 64), NAN, device=DEV)
        ref, word, errors = stage(slab, ids, table, media=media, media_index=index, errors=errors)
        first = int((want >= num_media).nonzero()[0])
        assert word == (BAD_MEDIA_INDEX, found - num_media, first), word
        assert_same(slab, ref, "media_index_from_mask (count mismatch), staged")
        expect_error((MEDIA_COUNT_MISMATCH | BAD_MEDIA_INDEX, found - num_media, first),
                     "media_index_from_mask (count mismatch), staged", errors, count=found)

    spans = ss.media_index_from_spans([(5, 10, 0), (40, 3, 10)], 50, device=DEV, num_media_rows=13)
    assert spans.tolist() == [-1] * 5 + list(range(10)) + [-1] * 25 + [10, 11, 12] + [-1] * 7


# -- stage_token_inputs ------------------------------------------------------------------------------------

TOKEN_SLOTS = ("input_ids", "positions", "out_cache_loc")
REQUEST_SLOTS = ("seq_lens", "extend_start_loc")


def poison_slots(buffers) -> None:
    for name in (*TOKEN_SLOTS, *REQUEST_SLOTS, "num_tokens_non_padded"):
        getattr(buffers, name).fill_(POISON)
    if buffers.mrope_positions is not None:
        buffers.mrope_positions.fill_(POISON)


def split_lengths(n: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq_lens`` (int32, ``b`` lengths >= 1 adding up to ``n``) and ``extend_start_loc``."""
    cuts = sorted((torch.randperm(n - 1, generator=G)[:b - 1] + 1).tolist()) if b > 1 else []
    starts = [0, *cuts]
    lens = [e - s for s, e in zip(starts, [*cuts, n])]
    return torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)


def check_slots(buffers, given: dict, n: int, pad_to: int, b: int, what: str) -> None:
    """Token slots: ``[0, n)`` the input, ``[n, pad_to)`` zeros, the rest the poison; per-request slots the
    input then zeros up to ``max_batch_size``; ``num_tokens_non_padded`` = n."""
    for name, src in given.items():
        dst = getattr(buffers, name).cpu()
        src = src.cpu().to(dst.dtype)
        if name in REQUEST_SLOTS:
            want = torch.zeros_like(dst)
            want[:b] = src
        else:
            want = torch.full_like(dst, POISON)
            want[..., :n] = src
            want[..., n:pad_to] = 0
        assert torch.equal(dst, want), f"{what}: slot {name} differs from the reference"
    assert buffers.num_tokens_non_padded.item() == n, what


def token_input_cases() -> None:
    cap = pick(300, 64)
    buffers = ss.StagingBuffers.allocate(max_num_tokens=cap, max_batch_size=5, embed_width=48,
                                         embed_dtype=BF16, device=DEV, cache_loc_dtype=torch.int32, mrope=True)
    buffers.input_embeds.fill_(NAN)
    embeds = buffers.input_embeds.clone()
    for n, host, b in pick(((257, True, 3), (257, False, 3), (1, True, 1), (300, False, 5)),
                           ((50, True, 3), (50, False, 3), (1, True, 1), (64, False, 5))):
        where = torch.device("cpu") if host else DEV
        seq_lens, starts = split_lengths(n, b)
        positions = torch.cat([torch.arange(int(s)) for s in seq_lens])
        given = dict(input_ids=torch.randint(0, 99, (n,), generator=G), positions=positions,
                     out_cache_loc=torch.randint(0, 2**31 - 1, (n,), generator=G),  # int64 into the int32 slot
                     mrope_positions=torch.randint(0, 500, (3, n), generator=G),
                     seq_lens=seq_lens, extend_start_loc=starts)
        given = {k: v.to(where) for k, v in given.items()}
        pad_to = min(cap, n + pick(20, 6))
        poison_slots(buffers)
        CALLS["stage_token_inputs"] += 1
        ss.stage_token_inputs(buffers, **given, pad_to=pad_to)
        check_slots(buffers, given, n, pad_to, b, f"stage_token_inputs({n} tokens, {'host' if host else 'device'})")
        assert_same(buffers.input_embeds, embeds, "stage_token_inputs must not touch input_embeds")
    expect_error((0, 0, None), "stage_token_inputs", buffers.errors)


# -- the runner's combined launch --------------------------------------------------------------------------

def as_items(batch, model, form: str, g: torch.Generator):
    """``batch`` with its media (one tensor) cut into items: DeepStack ones as column blocks (views of the
    tensor, so strided along rows, or copies), an empty item among them; ``pinned``: in pinned host memory."""
    media = batch.media
    if form == "tensor" or media is None:
        return batch
    m = media.shape[0]
    cuts = sorted({0, m // 3, m // 3, (2 * m) // 3, m})
    items = []
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        part = media[lo:hi]
        if model.variant == "deepstack":
            blocks = part.split(model.hidden_size, 1)
            items.append(tuple(blocks) if i % 2 == 0 else tuple(b.clone() for b in blocks))
        else:
            items.append(part.clone())
    items.insert(1, media[:0].clone())  # an empty item
    if form == "pinned":
        items = pinned(items)
    return replace(batch, media=items)


def runner_cases() -> dict:
    """Per toy variant: model size, buckets, capacity, and batches (n, integer inputs on the device?,
    media form, a bad id?, text_scale, the bucket it must replay in: None = eager)."""
    host, dev = False, True
    deepstack = pick(
        [(3, host, "tensor", False, None, 4), (16, dev, "items", False, None, 16),
         (40, host, "items", False, None, 48), (11, dev, "tensor", True, None, 16),
         (47, host, "pinned" if CUDA else "items", False, None, 48), (60, host, "items", False, None, None)],
        [(3, host, "tensor", False, None, 4), (12, dev, "items", False, None, 16),
         (10, host, "items", True, None, 16), (20, host, "items", False, None, None)])
    hc = pick(  # 5 tokens: the next bucket, 16, is past max_padding_ratio (2) times 5
        [(5, host, "items", False, None, None), (30, dev, "tensor", False, 1.5, 48),
         (14, host, "tensor", True, None, 16), (64, host, "items", False, None, None)],
        [(5, host, "items", False, None, None), (12, dev, "tensor", False, 1.5, 16),
         (20, host, "items", True, None, None)])
    sizes = dict(hidden=pick(64, 32), buckets=pick([4, 16, 48], [4, 16]), cap=pick(64, 24), hc_mult=pick(3, 2))
    return {"deepstack": dict(sizes, batches=deepstack), "hc": dict(sizes, batches=hc)}


def runner_case(variant: str, spec: dict) -> None:
    model = ToyMultimodalModel(variant, hidden_size=spec["hidden"], vocab_size=97, num_layers=2, num_heads=2,
                               deepstack_k=2, hc_mult=spec["hc_mult"], device=DEV, dtype=BF16)
    buffers = ss.StagingBuffers.allocate(max_num_tokens=spec["cap"], max_batch_size=4, embed_width=model.embed_width,
                                         embed_dtype=model.dtype, device=DEV, cache_loc_dtype=torch.int32, mrope=True)
    # verify="off": the capture check times replay against eager, which under a sanitizer says nothing (racecheck
    # made a replay slower and the check dropped its bucket); every run below compares the output with eager
    runner = ss.PrefillGraphRunner(model, buffers, buckets=spec["buckets"], progress=False,
                                   enforce_eager=NO_CACHING, verify="off").capture()
    graphs = CUDA and not NO_CACHING
    g = torch.Generator().manual_seed(1)
    for n, on_device, form, bad, scale, bucket in spec["batches"]:
        where = DEV if on_device else torch.device("cpu")
        batch = make_batch(model, n, media_fraction=0.4, num_seqs=min(3, n), generator=g,
                           device=DEV if on_device else None)
        batch = as_items(batch, model, form, g)
        batch = replace(batch, out_cache_loc=torch.randint(0, 2**31 - 1, (n,), generator=g).to(where),
                        mrope_positions=torch.randint(0, 1000, (3, n), generator=g).to(where), text_scale=scale)
        if bad:  # a bad token id on the first text row
            index = batch.media_index.cpu() if batch.media_index is not None else torch.full((n,), -1)
            row = int((index < 0).nonzero()[0])
            batch.input_ids[row] = model.vocab_size
        what = f"{variant} runner, {n} tokens, {form}, {'device' if on_device else 'host'} inputs"
        for _ in range(REPEAT):  # CUDA: the first batch of a configuration takes the full path, the second the cached
            buffers.input_embeds.fill_(NAN)
            poison_slots(buffers)
            before = buffers.input_embeds.clone()
            CALLS["run"] += 1
            out = runner.run(batch, clone=True)
            got_bucket = runner.last_bucket
            assert got_bucket == (bucket if graphs else None), f"{what}: bucket {got_bucket}, expected {bucket}"
            CALLS["replay" if got_bucket is not None else "eager"] += 1
            pad_to = got_bucket or n
            eager = model(runner.buffers.registry.views(pad_to))[:n]
            assert torch.equal(out, eager), f"{what} (bucket {got_bucket}): the run's output != the eager forward"
            want, word = reference(before, batch.input_ids, batch.table, batch.media, batch.media_index,
                                   pad_to=pad_to, expand=batch.expand, text_scale=scale)
            assert_same(buffers.input_embeds, want, f"{what}: input_embeds")
            given = {k: getattr(batch, k) for k in (*TOKEN_SLOTS, *REQUEST_SLOTS, "mrope_positions")}
            check_slots(buffers, given, n, pad_to, batch.seq_lens.shape[0], what)
            assert word == ((BAD_TOKEN_ID, 1, word[2]) if bad else (0, 0, None)), (what, word)
            expect_error(word, what, buffers.errors)


# -- main ----------------------------------------------------------------------------------------------------

def main() -> None:
    global SMALL
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="smaller sizes (for the CPU interpreter)")
    SMALL = parser.parse_args().small
    start = time.perf_counter()
    where = torch.cuda.get_device_name() if CUDA else "CPU (Triton interpreter: no CUDA here)"
    print(f"slabstage sanitize workload on {where}" + (", small" if SMALL else "")
          + (", no caching allocator (runners eager)" if NO_CACHING else ""), flush=True)

    cases = embedding_cases()
    stage_embeddings_cases(cases)
    media_index_cases()
    token_input_cases()
    runners = runner_cases()
    # math SDPA: racecheck flags cuDNN's flash attention (the toy model's, not slabstage's)
    with sdpa_kernel(SDPBackend.MATH):
        for variant, spec in runners.items():
            runner_case(variant, spec)
    if CUDA:
        torch.cuda.synchronize()

    graphs = CUDA and not NO_CACHING
    batches = [b for spec in runners.values() for b in spec["batches"]]
    replays = REPEAT * sum(b[-1] is not None for b in batches) if graphs else 0
    expected = Counter(stage_embeddings=REPEAT * (len(cases) + 2), media_index_from_mask=REPEAT * 2,
                       stage_token_inputs=4, run=REPEAT * len(batches), replay=replays,
                       eager=REPEAT * len(batches) - replays)
    assert CALLS == +expected, f"calls made {dict(CALLS)}, expected {dict(+expected)}"
    print(f"stage_embeddings: {CALLS['stage_embeddings']} calls ({len(cases)} forms); media_index_from_mask: "
          f"{CALLS['media_index_from_mask']}; stage_token_inputs: {CALLS['stage_token_inputs']}; runners: "
          f"{CALLS['run']} runs ({CALLS['replay']} replays, {CALLS['eager']} eager); "
          f"{time.perf_counter() - start:.1f} s")
    print("SANITIZE WORKLOAD OK")


if __name__ == "__main__":
    main()
