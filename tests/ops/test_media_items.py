"""Media as items: lists of tensors, tuples of column blocks, pinned host items, src_start.

Every staged slab is compared, byte for byte, with an independent expectation
built row by row (``expected_slab``, tests/expected.py); it does not use
slabstage's own reference. The item forms must behave exactly as one tensor equal to
``torch.cat([torch.cat(blocks, 1) if tuple else item for item in items], 0)``.

- Interpreter tests run through the ``device`` fixture (CPU under
  TRITON_INTERPRET=1, and CUDA when present).
- Bad inputs are refused before launch: the slab and the error words keep every byte.
- Runner tests: eager on CPU; tests marked ``cuda`` capture, replay under
  ``torch.cuda.set_sync_debug_mode("error")`` and read pinned host items.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from slabstage import (BAD_MEDIA_INDEX, MEDIA_COUNT_MISMATCH, PrefillBatch, PrefillGraphRunner,
                       StagingBuffers, StagingError, WidthContractError, media_index_from_mask, new_error_word,
                       stage_embeddings)
from slabstage.staging import default_error_word
from slabstage.models import VARIANTS, make_batch

from builders import gen, poisoned, randint, randn, same_bytes, toy, toy_buffers  # noqa: I001 - tests/builders.py
from expected import blocks_of, expected_slab  # noqa: I001 - tests/expected.py

NO_ROW = 2**31 - 1
CLEAN = [0, 0, NO_ROW, 0]
NAN = float("nan")
HUGE = 3.0e38  # sentinel around sources: read by mistake, it shows in any dtype
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = (F32, BF16, F16)


# -- inputs (gen, randn, randint, poisoned: tests/builders.py) -----------------------------------

def make_items(g, rows, width, dtype, device, splits=None):
    """One item per entry of ``rows``; ``splits[i]`` is None (a 2-D tensor) or block widths (a tuple)."""
    items = []
    for i, r in enumerate(rows):
        split = None if splits is None else splits[i]
        if split is None:
            items.append(randn(g, r, width, dtype, device))
        else:
            assert sum(split) == width
            items.append(tuple(randn(g, r, w, dtype, device) for w in split))
    return items


def item_edges(rows):
    """The logical rows at the first and last row of each non-empty item."""
    edges, start = [], 0
    for r in rows:
        if r:
            edges += [start, start + r - 1]
        start += r
    return list(dict.fromkeys(edges))


def scattered_index(g, n, rows, media_rows, *, dtype=torch.int64, device="cpu"):
    """``media_index`` of ``n`` tokens, ``media_rows`` of them media rows at random places.

    The values take every item's first and last row first, then random rows (a row
    may come twice); the other tokens are text (-1).
    """
    total = sum(rows)
    assert media_rows <= n
    values = item_edges(rows)
    values += [k for k in torch.randperm(total, generator=g).tolist() if k not in values]
    while total and len(values) < media_rows:
        values.append(int(torch.randint(0, total, (1,), generator=g)))
    values = values[:media_rows]
    index = torch.full((n,), -1, dtype=dtype)
    index[torch.randperm(n, generator=g)[:len(values)]] = torch.tensor(values, dtype=dtype)
    return index.to(device)


# -- the independent expectation (expected_slab: tests/expected.py) ------------------------------------

def assert_same_slab(got, want, what="slab"):
    got = got.detach().cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if same_bytes(got, want):
        return
    as_int = {4: torch.int32, 2: torch.int16}[got.element_size()]
    rows = (got.view(as_int) != want.view(as_int)).any(1).nonzero().flatten().tolist()
    r = rows[0]
    raise AssertionError(f"{what}: rows {rows[:12]}{' ...' if len(rows) > 12 else ''} differ; row {r}: "
                         f"got {got[r, :6].tolist()} want {want[r, :6].tolist()}")


def stage_and_check(slab, ids, table, *, media=None, media_index=None, **kw):
    """Stage into ``slab``; its every byte must equal the expectation, the error word too."""
    want, want_word = expected_slab(slab, ids, table, media, media_index, **kw)
    errors = new_error_word(slab.device)
    assert stage_embeddings(slab, ids, table, media=media, media_index=media_index, errors=errors, **kw) is slab
    assert_same_slab(slab, want)
    assert errors.tolist() == want_word, f"error word {errors.tolist()}, expected {want_word}"
    return errors


def splits_for(form, width, count):
    """Block widths per item for ``form``: all tensors, all tuples, or alternating."""
    tuples = [(width,), (width // 3, width - width // 3), (8, width - 24, 16)]
    out = []
    for i in range(count):
        plain = form == "tensors" or (form == "mixed" and i % 2 == 0)
        out.append(None if plain else tuples[i % len(tuples)])
    return out


ITEM_ROWS = {
    1: [11],
    2: [6, 9],
    17: [(i * 7) % 5 for i in range(17)],  # 0, 2, 4, 1, 3, 0, ...: empty items among them, the first one too
    70: [(i * 5) % 3 for i in range(70)],  # past the 32 item starts the kernel may read at once
}


# ==================================================================================================
# Interpreter (and CUDA): item lists, blocks, strides, dtypes, guards
# ==================================================================================================
@pytest.mark.parametrize("form", ["tensors", "blocks", "mixed"])
@pytest.mark.parametrize("num_items", sorted(ITEM_ROWS))
def test_item_lists(num_items, form, device):
    g = gen(100 + num_items + len(form))
    W, V = 48, 40
    rows = ITEM_ROWS[num_items]
    total = sum(rows)
    n = total + 13
    items = make_items(g, rows, W, F32, device, splits_for(form, W, num_items))
    ids = randint(g, 0, V, n, device=device)
    index = scattered_index(g, n, rows, total + 2, device=device)
    table = randn(g, V, W, BF16, device)
    errors = stage_and_check(poisoned(n + 5, W, BF16, device), ids, table, media=items, media_index=index,
                             pad_to=n + 3)
    assert errors.tolist() == CLEAN


@pytest.mark.parametrize("rows", [[0, 5], [5, 0], [0, 0, 4, 0], [1, 1, 1], [7, 0, 0, 2, 0], [3, 12, 1]],
                         ids=lambda r: "-".join(map(str, r)))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_row_counts_and_empty_items(rows, index_dtype, device):
    g = gen(sum(rows) * 31 + len(rows))
    W, V, n = 32, 30, 21
    total = sum(rows)
    items = make_items(g, rows, W, F16, device, [None if i % 2 else (12, 20) for i in range(len(rows))])
    ids = randint(g, 0, V, n, dtype=index_dtype, device=device)
    index = scattered_index(g, n, rows, min(n - 3, total + 3), dtype=index_dtype, device=device)
    errors = stage_and_check(poisoned(n + 4, W, F32, device), ids, randn(g, V, W, F32, device), media=items,
                             media_index=index, pad_to=n + 2)
    assert errors.tolist() == CLEAN


def test_all_items_empty(device):
    """Items with no rows at all: text rows are staged; a media row has nothing to read and is flagged."""
    g = gen(5)
    W, V, n = 24, 20, 9
    items = [randn(g, 0, W, F32, device), (randn(g, 0, 8, F32, device), randn(g, 0, 16, F32, device))]
    ids = randint(g, 0, V, n, device=device)
    table = randn(g, V, W, F32, device)
    text_only = torch.full((n,), -1, device=device)
    errors = stage_and_check(poisoned(n + 2, W, BF16, device), ids, table, media=items, media_index=text_only,
                             pad_to=n + 1)
    assert errors.tolist() == CLEAN
    index = text_only.clone()
    index[4] = 0
    errors = stage_and_check(poisoned(n + 2, W, BF16, device), ids, table, media=items, media_index=index)
    assert errors.tolist() == [BAD_MEDIA_INDEX, 1, 4, 0]


def test_media_forms_agree_with_one_tensor(device):
    """Each item form gives the bytes of the one-tensor path (today's code) on the concatenation."""
    g = gen(6)
    W, V, n = 40, 30, 23
    a, b, c = randn(g, 4, W, F32, device), randn(g, 0, W, F32, device), randn(g, 7, W, F32, device)
    cat = torch.cat([a, b, c])
    ids = randint(g, 0, V, n, device=device)
    index = scattered_index(g, n, [4, 0, 7], 13, device=device)
    table = randn(g, V, W, BF16, device)
    want = poisoned(n + 3, W, BF16, device)
    stage_embeddings(want, ids, table, media=cat, media_index=index, pad_to=n + 1, errors=new_error_word(device))
    forms = {
        "list": [a, b, c],
        "tuple of items": (a, b, c),
        "one-item list": [cat],
        "one-item tuple": (cat,),
        "one block": [(cat,)],
        "block views": [(a[:, :16], a[:, 16:]), b, (c[:, :8], c[:, 8:20], c[:, 20:])],
        "block copies": [(a[:, :16].clone(), a[:, 16:].clone()), (b[:, :1].clone(), b[:, 1:].clone()),
                         (c[:, :8].clone(), c[:, 8:].clone())],
    }
    for name, media in forms.items():
        slab = poisoned(n + 3, W, BF16, device)
        stage_embeddings(slab, ids, table, media=media, media_index=index, pad_to=n + 1,
                         errors=new_error_word(device))
        assert_same_slab(slab, want.cpu(), name)


def test_top_level_tuple_is_items_not_blocks(device):
    """``media=(x, y)`` is two items stacked on rows; ``media=[(x, y)]`` is one item of two column blocks."""
    g = gen(7)
    H, V, n = 16, 20, 10
    x, y = randn(g, 5, H, F32, device), randn(g, 5, H, F32, device)
    ids = randint(g, 0, V, n, device=device)
    index = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6, 9, -1], device=device)
    table = randn(g, V, H, F32, device)
    errors = stage_and_check(poisoned(n, 2 * H, F32, device), ids, table, media=(x, y), media_index=index)
    assert errors.tolist() == CLEAN
    side = torch.where(index < 5, index, torch.full_like(index, -1))  # one item of 5 rows
    slab = poisoned(n, 2 * H, F32, device)
    stage_and_check(slab, ids, table, media=[(x, y)], media_index=side)
    assert torch.equal(slab[1:6].cpu(), torch.cat([x, y], 1).cpu())


@pytest.mark.parametrize("bad", ["total", "total+1", "into-trailing-empty", 2**31 - 1, 2**40])
def test_bad_media_index_past_all_items(bad, device):
    g = gen(8)
    W, V, n = 32, 25, 14
    rows = [3, 0, 4, 0]  # the last item is empty: index 7 is past every row
    items = make_items(g, rows, W, F32, device, [None, None, (16, 16), None])
    bad = {"total": 7, "total+1": 8, "into-trailing-empty": 7}.get(bad, bad)
    index = torch.full((n,), -1, dtype=torch.int64)
    index[[1, 2, 3, 6, 7, 8, 9]] = torch.tensor([0, 2, 3, 6, 4, 5, 1])
    index[5] = bad
    index[11] = bad
    ids = randint(g, 0, V, n, device=device)
    slab = poisoned(n + 2, W, F16, device)
    errors = stage_and_check(slab, ids, randn(g, V, W, F32, device), media=items, media_index=index.to(device),
                             pad_to=n + 1)
    assert errors.tolist() == [BAD_MEDIA_INDEX, 2, 5, 0]
    assert (slab[[5, 11]] == 0).all()


@pytest.mark.parametrize("layout", ["uniform", "varied"])
@pytest.mark.parametrize("k, H", [(1, 40), (2, 24), (3, 24), (3, 40)])
def test_deepstack_column_blocks(k, H, layout, device):
    """Slab H * (1 + k): block 0 the embedding, block i the DeepStack level i - 1; text rows zero past H."""
    g = gen(10 * k + H + len(layout))
    W, V, n = H * (1 + k), 33, 29
    rows = [5, 0, 8, 3]
    parts = [[randn(g, r, H, BF16, device) for _ in range(1 + k)] for r in rows]  # main, level 0, ..., k - 1
    items = []
    for i, (main, *levels) in enumerate(parts):
        if layout == "uniform" or i % 3 == 0:
            items.append((main, *levels))
        elif i % 3 == 1:
            items.append((main, torch.cat(levels, 1)))  # the levels side by side in one block
        else:
            items.append(torch.cat([main, *levels], 1))  # a plain tensor, already wide
    ids = randint(g, 0, V, n, device=device)
    index = scattered_index(g, n, rows, 16, device=device)
    slab = poisoned(n + 2, W, BF16, device)
    errors = stage_and_check(slab, ids, randn(g, V, H, BF16, device), media=items, media_index=index,
                             pad_to=n + 1, expand="zeros")
    assert errors.tolist() == CLEAN
    got, idx = slab[:n].cpu(), index.cpu()
    assert (got[idx < 0][:, H:] == 0).all(), "text rows must carry zeros in blocks 1..k"
    flat = [[torch.cat([p[j].cpu() for p in blocks]) for j in range(r)] for blocks, r in zip(parts, rows)]
    flat = [row for item in flat for row in item]
    for r in (idx >= 0).nonzero().flatten().tolist():
        src = flat[idx[r]]
        for level in range(1 + k):  # block by block, as the model reads them
            assert torch.equal(got[r, level * H:(level + 1) * H], src[level * H:(level + 1) * H]), (r, level)


@pytest.mark.parametrize("W, splits", [
    (96, [(24, 40, 32), (96,), (40, 56), None]),
    (40, [(24, 16), None, (1, 39)]),
    (24, [(8, 16), (24,), None, (3, 5, 16)]),
], ids=["96", "40", "24"])
def test_odd_widths_and_block_splits(W, splits, device):
    g = gen(W)
    V, n = 27, 37
    rows = [7, 5, 0, 9][:len(splits)]
    items = make_items(g, rows, W, F32, device, splits)
    ids = randint(g, 0, V, n, device=device)
    index = scattered_index(g, n, rows, sum(rows) + 4, device=device)
    errors = stage_and_check(poisoned(n + 4, W, BF16, device), ids, randn(g, V, W, F16, device), media=items,
                             media_index=index, pad_to=n + 2)
    assert errors.tolist() == CLEAN


@pytest.mark.parametrize("dtype, unit", [(F32, 512), (BF16, 512), (F16, 1024)])
def test_programs_inside_one_column_block(dtype, unit, device):
    """Block widths in multiples of a unit (1 KiB of bf16 slab row), split differently per item: each program's
    columns lie in one block of every item (it reads no other block's rows) and every row is right."""
    g = gen(unit)
    W, V, n = 4 * unit, 19, 31
    splits = [(unit,) * 4, (2 * unit, unit, unit), (unit, 3 * unit), None, (W,), (3 * unit, unit)]
    rows = [5, 3, 0, 6, 2, 4]
    items = make_items(g, rows, W, dtype, device, splits)
    slab = poisoned(n + 3, W, BF16, device)
    ids = randint(g, 0, V, n, device=device)
    index = scattered_index(g, n, rows, sum(rows) + 3, device=device)
    errors = stage_and_check(slab, ids, randn(g, V, W, BF16, device), media=items, media_index=index, pad_to=n + 2)
    assert errors.tolist() == CLEAN
    narrow = make_items(g, [4], W, dtype, device, [(64, W - 64)])  # a boundary 128 bytes of slab row in
    index = scattered_index(g, n, [4], 4, device=device)
    errors = stage_and_check(poisoned(n, W, BF16, device), ids, randn(g, V, W, BF16, device), media=narrow,
                             media_index=index)
    assert errors.tolist() == CLEAN


@pytest.mark.parametrize("W, Ht, Hm, expand, split", [
    (96, 32, 32, "repeat", None),
    (96, 32, 32, "repeat", (32,)),
    (96, 32, 32, "zeros", None),
    (96, 32, 96, "repeat", (32, 64)),
    (96, 32, 96, "zeros", (32, 32, 32)),
    (60, 20, 20, "repeat", (20,)),
])
def test_items_narrower_than_the_slab(W, Ht, Hm, expand, split, device):
    """Media width equal to the text width (expanded by the policy) or to the slab width."""
    g = gen(W + Ht + Hm + len(expand))
    V, n = 23, 19
    rows = [4, 0, 6]
    items = make_items(g, rows, Hm, BF16, device, [split, None, split])
    ids = randint(g, 0, V, n, device=device)
    index = scattered_index(g, n, rows, 12, device=device)
    stage_and_check(poisoned(n + 2, W, F32, device), ids, randn(g, V, Ht, F32, device), media=items,
                    media_index=index, pad_to=n + 1, expand=expand)


def test_strided_items(device):
    """Row strides other than the width, offset starts and column views; sentinels all around them."""
    g = gen(11)
    W, V, n = 48, 20, 33

    def planted(rows, cols, r0, c0, r, c):
        big = torch.full((rows, cols), HUGE, device=device)
        big[r0:r0 + r, c0:c0 + c] = randn(g, r, c, F32, device)
        return big

    wide = planted(12, 64, 2, 0, 7, W)
    item0 = wide[2:9, :W]  # row stride 64, starting two rows in
    tall = torch.full((16, W), HUGE, device=device)
    tall[::2] = randn(g, 8, W, F32, device)
    item1 = tall[::2][:6]  # row stride 2W
    enc = randn(g, 5, W, F32, device)
    item2 = tuple(enc.split([16, 32], 1))  # DeepStack-like views of one encoder output
    gap = planted(6, 80, 0, 0, 6, 80)
    gap[:, 24:40] = HUGE
    item3 = (gap[:4, :24], gap[:4, 40:64])  # blocks of a wider tensor, sentinel columns between them
    empty = wide[9:9, :W]  # no rows, row stride 64
    items = [item0, item1, empty, item2, item3]
    rows = [7, 6, 0, 5, 4]
    assert item0.stride() == (64, 1) and item1.stride() == (2 * W, 1) and item3[1].stride() == (80, 1)
    ids = randint(g, 0, V, n, device=device)
    index = scattered_index(g, n, rows, 26, device=device)
    index[[3, 30]] = torch.tensor([22, 23], device=device)  # just past the last row: nothing read
    slab = poisoned(n + 3, W, F32, device)
    errors = stage_and_check(slab, ids, randn(g, V, W, F32, device), media=items, media_index=index,
                             pad_to=n + 2)
    assert errors.tolist()[:2] == [BAD_MEDIA_INDEX, 2]
    assert slab[:n + 2].abs().max() < 100, "a sentinel was read"


@pytest.mark.parametrize("slab_dtype", DTYPES)
@pytest.mark.parametrize("guard", ["rows", "flat", "flat-odd"])
def test_poisoned_slab_in_guard_regions(guard, slab_dtype, device):
    """The slab is a window of a larger NaN-filled tensor: every row below pad_to is written, nothing else."""
    g = gen(12 + len(guard))
    W, V, n, pad_to, rows = 40, 25, 23, 27, 30
    if guard == "rows":
        big = poisoned(rows + 6, W, slab_dtype, device)
        slab, inside = big[3:3 + rows], (slice(3, 3 + rows),)
    else:
        off = 8 if guard == "flat" else 3  # "flat-odd": the slab starts mid-row of nothing, unaligned
        big = torch.full((off + rows * W + 11,), NAN, dtype=slab_dtype, device=device)
        slab, inside = big[off:off + rows * W].view(rows, W), (slice(off, off + rows * W),)
    big_before = big.clone()
    items = make_items(g, [6, 0, 9], W, F32, device, [None, None, (16, 24)])
    ids = randint(g, 0, V, n, device=device)
    index = scattered_index(g, n, [6, 0, 9], 15, device=device)
    stage_and_check(slab, ids, randn(g, V, W, F32, device), media=items, media_index=index, pad_to=pad_to)
    assert not torch.isnan(slab[:pad_to].float()).any()
    assert torch.isnan(slab[pad_to:].float()).all()
    outside = torch.ones(big.shape[0], dtype=torch.bool)
    outside[inside] = False
    assert same_bytes(big[outside.to(big.device)], big_before[outside.to(big.device)]), "a guard was written"


@pytest.mark.parametrize("slab_dtype, media_dtype, table_dtype", [
    (F32, F32, F32), (BF16, BF16, BF16), (F16, F16, F16),
    (BF16, F32, BF16),  # an fp32 encoder output into a bf16 slab
    (F16, F32, BF16), (F32, BF16, F16), (BF16, F16, F32),
])
def test_dtypes(slab_dtype, media_dtype, table_dtype, device):
    g = gen(13)
    W, V, n = 64, 31, 21
    rows = [5, 0, 7, 2]
    items = make_items(g, rows, W, media_dtype, device, [None, (32, 32), (16, 48), None])
    ids = randint(g, 0, V, n, device=device)
    index = scattered_index(g, n, rows, 14, device=device)
    stage_and_check(poisoned(n + 3, W, slab_dtype, device), ids, randn(g, V, W, table_dtype, device),
                    media=items, media_index=index, pad_to=n + 2)


@pytest.mark.parametrize("slab_dtype", [BF16, F16])
def test_rounding_of_fp32_items(slab_dtype, device):
    """Values halfway between neighbours, tiny and subnormal: torch's rounding, item by item and block by block."""
    base = torch.tensor([1.0, 1.00390625, 1.01171875, -1.00390625, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 2**-24,
                         2**-25, 1000.5, 1e-40])
    W = base.numel()
    a = (base[None] * (1 + torch.arange(3.0))[:, None]).to(device)
    b = (base[None] * -(1 + torch.arange(4.0))[:, None]).to(device)
    items = [a, (b[:, :4], b[:, 4:])]
    ids = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], device=device)
    index = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6], device=device)
    table = (base[None] * 0.5).repeat(8, 1).to(device)
    stage_and_check(poisoned(9, W, slab_dtype, device), ids, table, media=items, media_index=index, pad_to=9)


@pytest.mark.parametrize("media_owner", [True, False])
def test_items_with_vocab_shard_and_text_scale(media_owner, device):
    g = gen(14)
    W, vocab, n = 32, 60, 25
    table = randn(g, 20, W, BF16, device)  # vocabulary rows [20, 40)
    rows = [4, 3, 0, 5]
    items = make_items(g, rows, W, F32, device, [(8, 24), None, None, (16, 16)])
    ids = randint(g, 0, vocab, n, device=device)
    index = scattered_index(g, n, rows, 10, device=device)
    slab = poisoned(n + 1, W, BF16, device)
    errors = stage_and_check(slab, ids, table, media=items, media_index=index, pad_to=n + 1, vocab_range=(20, 40),
                             vocab_size=vocab, media_owner=media_owner, text_scale=1.7)
    assert errors.tolist() == CLEAN
    if not media_owner:
        assert (slab[:n][index >= 0] == 0).all()


def test_items_back_to_back(device):
    """Each call reads the items it is given: no stale item list after the list or its tensors change."""
    g = gen(15)
    W, V, n = 32, 20, 17
    table = randn(g, V, W, F32, device)
    ids = randint(g, 0, V, n, device=device)
    items = make_items(g, [4, 5], W, F32, device, [None, (8, 24)])
    index = scattered_index(g, n, [4, 5], 9, device=device)

    def check(media, index, dtype=BF16, expand="zeros"):
        stage_and_check(poisoned(n + 2, W, dtype, device), ids, table, media=media, media_index=index,
                        pad_to=n + 1, expand=expand)

    check(items, index)
    items[1] = (randn(g, 5, 8, F32, device), randn(g, 5, 24, F32, device))  # same list, same shapes, new tensors
    check(items, index)
    items[0].mul_(-3)  # same tensor, new values
    check(items, index)
    items.append((randn(g, 3, 16, F32, device), randn(g, 3, 16, F32, device)))  # one more item, another split
    check(items, scattered_index(g, n, [4, 5, 3], 12, device=device))
    check(tuple(items[::-1]), scattered_index(g, n, [3, 5, 4], 12, device=device))
    check([randn(g, 9, W, BF16, device)], index, dtype=F16)  # another dtype, one item
    check(items, scattered_index(g, n, [4, 5, 3], 12, device=device), dtype=F32)
    check(randn(g, 9, W, F32, device), index)  # back to one tensor
    narrow = [randn(g, 4, 16, F32, device), (randn(g, 5, 16, F32, device),)]  # the text width, tiled
    stage_and_check(poisoned(n + 2, 2 * W, BF16, device), ids, randn(g, V, 16, F32, device), media=narrow,
                    media_index=index, pad_to=n + 1, expand="repeat")
    check(items[:2], index)



def test_strict_and_the_error_word_with_items(device):
    g = gen(16)
    W, V, n = 16, 12, 9
    items = make_items(g, [2, 3], W, F32, device, [None, (4, 12)])
    ids = randint(g, 0, V, n, device=device)
    index = torch.tensor([-1, 0, 1, 2, 3, 4, 5, -1, -1], device=device)
    slab = poisoned(n, W, F32, device)
    errors = new_error_word(device)
    with pytest.raises(StagingError) as info:
        stage_embeddings(slab, ids, randn(g, V, W, F32, device), media=items, media_index=index, errors=errors,
                         strict=True)
    assert (info.value.codes, info.value.rows, info.value.first_row) == (BAD_MEDIA_INDEX, 1, 6)
    assert errors.tolist() == CLEAN
    assert (slab[6] == 0).all()
    assert torch.equal(slab[5].cpu(), torch.cat([items[1][0][2], items[1][1][2]]).cpu())  # row 2 of item 1


# -- src_start: chunked prefill by mask ---------------------------------------------------------------

def mask_of(n, placeholders, device):
    mask = torch.zeros(n, dtype=torch.bool)
    mask[placeholders] = True
    return mask.to(device)


SRC_START_CASES = {  # rows of the items, the chunk's placeholder positions, src_start
    "first-chunk": ([10], [3, 4, 5, 6], 0),
    "second-chunk": ([10], [0, 1, 2, 3, 4, 5], 4),
    "across-items": ([5, 7], [2, 3, 4, 9, 10, 11], 3),  # rows 3..8: the end of item 0, the start of item 1
    "past-an-empty-item": ([4, 0, 6], [0, 1, 2, 3, 4], 2),
    "deepstack": ([6, 6], [1, 2, 3, 4, 5, 6, 7], 5),
}


@pytest.mark.parametrize("case", list(SRC_START_CASES))
def test_src_start_from_mask(case, device):
    """The k-th placeholder of the chunk takes media row src_start + k of the items laid end to end."""
    rows, placeholders, src_start = SRC_START_CASES[case]
    g = gen(17 + src_start)
    H, V, n = 16, 20, 14
    if case == "deepstack":
        W, Ht = 3 * H, H
        items = [tuple(randn(g, r, H, F32, device) for _ in range(3)) for r in rows]
    else:
        W = Ht = 2 * H
        items = make_items(g, rows, W, F32, device, [(8, 24)] + [None] * (len(rows) - 1))
    mask = mask_of(n, placeholders, device)
    errors = new_error_word(device)
    index = media_index_from_mask(mask, len(placeholders), src_start=src_start, errors=errors)
    want = torch.full((n,), -1, dtype=torch.int64)
    want[placeholders] = torch.arange(src_start, src_start + len(placeholders))
    assert index.shape == (n,) and index.dtype in (torch.int32, torch.int64)
    assert index.cpu().long().tolist() == want.tolist()
    assert errors.tolist() == [0, 0, NO_ROW, len(placeholders)], "the count found goes to word[3]"
    ids = randint(g, 0, V, n, device=device)
    table = randn(g, V, Ht, BF16, device)
    word = errors.tolist()
    slab = poisoned(n + 2, W, BF16, device)
    want_slab, want_word = expected_slab(slab, ids, table, items, index, pad_to=n + 1, word=word)
    stage_embeddings(slab, ids, table, media=items, media_index=index, pad_to=n + 1, errors=errors)
    assert_same_slab(slab, want_slab)
    assert errors.tolist() == want_word == word


def test_src_start_default_is_zero(device):
    mask = mask_of(12, [2, 3, 7, 8, 9], device)
    a = media_index_from_mask(mask, 5, errors=new_error_word(device))
    b = media_index_from_mask(mask, 5, src_start=0, errors=new_error_word(device))
    assert a.cpu().tolist() == b.cpu().tolist() == [-1, -1, 0, 1, -1, -1, -1, 2, 3, 4, -1, -1]


@pytest.mark.parametrize("num_media_rows", [3, 5])
def test_src_start_count_mismatch_is_flagged(num_media_rows, device):
    """num_media_rows is the chunk's placeholder count (4 here): another number flags the word, no sync."""
    g = gen(18)
    W, V, n = 16, 10, 10
    items = make_items(g, [3, 6], W, F32, device)  # 9 rows
    mask = mask_of(n, [1, 2, 3, 4], device)
    errors = new_error_word(device)
    index = media_index_from_mask(mask, num_media_rows, src_start=6, errors=errors)
    assert index.cpu().tolist() == [-1, 6, 7, 8, 9, -1, -1, -1, -1, -1]
    assert errors.tolist() == [MEDIA_COUNT_MISMATCH, 0, NO_ROW, 4]
    slab = poisoned(n, W, F32, device)
    stage_embeddings(slab, randint(g, 0, V, n, device=device), randn(g, V, W, F32, device), media=items,
                     media_index=index, errors=errors)
    # row 4 asks for media row 9, past the 9 rows: zero, and flagged as well
    assert errors.tolist() == [MEDIA_COUNT_MISMATCH | BAD_MEDIA_INDEX, 1, 4, 4]
    assert (slab[4] == 0).all() and torch.equal(slab[3].cpu(), items[1][5].cpu())  # row 8: item 1, row 5


@pytest.mark.parametrize("src_start, exc", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_src_start_checked(src_start, exc, device):
    errors = new_error_word(device)
    with pytest.raises(exc, match="src_start"):
        media_index_from_mask(mask_of(6, [1, 2], device), 2, src_start=src_start, errors=errors)
    assert errors.tolist() == CLEAN


# ==================================================================================================
# Bad inputs: refused before launch, nothing written
# ==================================================================================================
def names(message: str, what: str, k: int) -> bool:
    """``message`` names ``what`` number ``k``: "item 1", "item #1", "item[1]", "items[1]", "media[1]" ..."""
    pattern = rf"\b{what}s?\s*(?:#|\[|no\.?\s*|index\s*|number\s*)?\s*{k}(?!\d)"
    if re.search(pattern, message, re.IGNORECASE):
        return True
    if what == "item":
        return re.search(rf"\bmedia\s*\[\s*{k}\s*\]", message) is not None
    return re.search(rf"\bmedia\s*\[\s*\d+\s*\]\s*\[\s*{k}\s*\]", message) is not None


def _bad_base(device, g):
    n, V, W = 8, 16, 32
    return dict(
        slab=poisoned(12, W, F32, device, value=12345.0),
        input_ids=randint(g, 0, V, n, device=device),
        table=randn(g, V, W, F32, device),
        media=[randn(g, 3, W, F32, device), randn(g, 2, W, F32, device)],
        media_index=torch.tensor([-1, 0, 1, 2, -1, 3, 4, -1], device=device),
        pad_to=10,
    )


def _deepstack(a, device, g, items):
    """Slab 96 wide, text 32: column block 0 of every tuple must be 32 wide."""
    a.update(slab=poisoned(12, 96, F32, device, value=12345.0), table=randn(g, 16, 32, F32, device),
             media=[tuple(randn(g, r, w, F32, device) for w in widths) for r, widths in items])


def _r(g, device, rows, width, dtype=F32):
    return randn(g, rows, width, dtype, device)


BAD_ITEMS = [  # (name, change(args, device, g), exception, item named, block named, other words)
    ("block rows differ", lambda a, d, g: a.update(media=[_r(g, d, 4, 32), (_r(g, d, 3, 16), _r(g, d, 2, 16))]),
     ValueError, 1, 1, ()),
    ("block rows differ in the first item", lambda a, d, g: a.update(
        media=[(_r(g, d, 3, 8), _r(g, d, 3, 8), _r(g, d, 4, 16)), _r(g, d, 2, 32)]), ValueError, 0, 2, ()),
    ("item widths differ", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), _r(g, d, 2, 32), _r(g, d, 2, 16)]),
     WidthContractError, 2, None, ()),
    ("tuple adds up to less", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), (_r(g, d, 2, 16), _r(g, d, 2, 8))]),
     WidthContractError, 1, None, ()),
    ("tuple adds up to more", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), (_r(g, d, 2, 16), _r(g, d, 2, 24))]),
     WidthContractError, 1, None, ()),
    ("tuple wider than the slab", lambda a, d, g: a.update(media=[(_r(g, d, 3, 32), _r(g, d, 3, 16))]),
     WidthContractError, 0, None, ()),
    ("first block not the text width", lambda a, d, g: _deepstack(a, d, g, [(3, (64, 32)), (2, (32, 64))]),
     WidthContractError, 0, 0, ()),
    ("first block not the text width, item 1", lambda a, d, g: _deepstack(a, d, g, [(3, (32, 64)), (2, (48, 48))]),
     WidthContractError, 1, 0, ()),
    ("deepstack tuple short", lambda a, d, g: _deepstack(a, d, g, [(3, (32, 32, 32)), (2, (32, 32))]),
     WidthContractError, 1, None, ()),
    ("mixed dtypes", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), _r(g, d, 2, 32, BF16)]), TypeError, 1, None,
     ()),
    ("mixed dtypes, item 2", lambda a, d, g: a.update(
        media=[_r(g, d, 3, 32, BF16), _r(g, d, 1, 32, BF16), _r(g, d, 1, 32, F16)]), TypeError, 2, None, ()),
    ("mixed dtypes in a tuple", lambda a, d, g: a.update(
        media=[_r(g, d, 3, 32, BF16), (_r(g, d, 2, 16, BF16), _r(g, d, 2, 16, F16))]), TypeError, 1, None, ()),
    ("int item", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), _r(g, d, 2, 32).int()]), TypeError, 1, None, ()),
    ("float64 item", lambda a, d, g: a.update(media=[_r(g, d, 3, 32).double(), _r(g, d, 2, 32).double()]),
     TypeError, 0, None, ()),
    ("None in the list", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), None]), TypeError, 1, None, ()),
    ("nested list in the list", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), [[0.0] * 32] * 2]), TypeError, 1,
     None, ()),
    ("number in the list", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), 3]), TypeError, 1, None, ()),
    ("string block", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), (_r(g, d, 2, 16), "x")]), TypeError, 1, None,
     ()),
    ("tuple inside a tuple", lambda a, d, g: a.update(
        media=[_r(g, d, 3, 32), ((_r(g, d, 2, 8), _r(g, d, 2, 8)), _r(g, d, 2, 16))]), TypeError, 1, None, ()),
    ("3-D item", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), _r(g, d, 2, 32)[None]]), ValueError, 1, None, ()),
    ("1-D item", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), _r(g, d, 1, 32)[0]]), ValueError, 1, None, ()),
    ("1-D block", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), (_r(g, d, 2, 16), _r(g, d, 1, 16)[0])]),
     ValueError, 1, None, ()),
    ("item on another device", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), torch.zeros(2, 32, device="meta")]),
     ValueError, 1, None, ()),
    ("item columns strided", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), _r(g, d, 32, 2).t()]), ValueError, 1,
     None, ()),
    ("block columns strided",
     lambda a, d, g: a.update(media=[(_r(g, d, 3, 16), _r(g, d, 16, 3).t()), _r(g, d, 2, 32)]),
     ValueError, 0, None, ()),
    ("item is slab rows", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), a["slab"][2:4]]), ValueError, None, None,
     ("overlap",)),
    ("item is slab rows past pad_to", lambda a, d, g: a.update(media=[_r(g, d, 3, 32), a["slab"][10:12]]),
     ValueError, None, None, ("overlap",)),
    ("block views the slab",
     lambda a, d, g: a.update(media=[(a["slab"][4:7, :16], _r(g, d, 3, 16)), _r(g, d, 2, 32)]),
     ValueError, None, None, ("overlap",)),
]


def _shared_storage(device, g):
    """A slab that is the first 12 rows of a larger tensor, an item that reaches into it from below."""
    args = _bad_base(device, g)
    big = torch.full((16, 32), 12345.0, device=device)
    args["slab"] = big[:12]
    args["media"] = [_r(g, device, 3, 32), big[11:13]]
    return args


@pytest.mark.parametrize("name, change, exc, item, block, words", BAD_ITEMS, ids=[c[0] for c in BAD_ITEMS])
def test_bad_items_are_refused_before_writing(name, change, exc, item, block, words, device):
    g = gen(19)
    args = _bad_base(device, g)
    change(args, device, g)
    refused(args, device, exc, item, block, words)


def test_item_overlapping_the_slab_through_a_shared_storage(device):
    refused(_shared_storage(device, gen(20)), device, ValueError, None, None, ("overlap",))


def refused(args, device, exc, item, block, words):
    slab = args.pop("slab")
    before = slab.clone()
    errors = new_error_word(device)
    default_before = default_error_word(device).clone()
    with pytest.raises(exc) as info:
        stage_embeddings(slab, args.pop("input_ids"), args.pop("table"), errors=errors, **args)
    message = str(info.value)
    if item is not None:
        assert names(message, "item", item), f"the message does not name item {item}: {message}"
    if block is not None:
        assert names(message, "block", block), f"the message does not name block {block}: {message}"
    for word in words:
        assert word in message.lower(), f"the message does not say {word!r}: {message}"
    assert same_bytes(slab, before), "the slab was written before the error"
    assert errors.tolist() == CLEAN
    assert same_bytes(default_error_word(device), default_before)


def test_item_forms_need_media_index(device):
    args = _bad_base(device, gen(21))
    args["media_index"] = None
    refused(args, device, ValueError, None, None, ("media_index",))


def test_valid_bases_pass(device):
    """The unchanged base arguments stage; so do DeepStack tuples with a 32-wide first block."""
    g = gen(19)
    args = _bad_base(device, g)
    stage_and_check(args.pop("slab"), args.pop("input_ids"), args.pop("table"), **args)
    args = _bad_base(device, g)
    _deepstack(args, device, g, [(3, (32, 64)), (2, (32, 32, 32))])
    stage_and_check(args.pop("slab"), args.pop("input_ids"), args.pop("table"), **args)


def test_item_in_the_slabs_storage_but_not_overlapping_is_accepted(device):
    """Sharing a storage is not overlapping: an item in rows just past the slab is read, as any item."""
    g = gen(22)
    args = _bad_base(device, g)
    big = torch.full((16, 32), 12345.0, device=device)
    big[12:15] = _r(g, device, 3, 32)
    args["slab"] = big[:12]
    args["media"] = [big[12:15], _r(g, device, 2, 32)]
    stage_and_check(args.pop("slab"), args.pop("input_ids"), args.pop("table"), **args)


# ==================================================================================================
# The runner: PrefillBatch with items (eager on CPU)
# ==================================================================================================
def as_items(media, model, cuts, *, pinned=False):
    """``media``'s rows cut at ``cuts`` into items (separate tensors); DeepStack items as column blocks."""
    bounds = [0, *cuts, media.shape[0]]
    items = []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        part = media[lo:hi]
        if model.variant == "deepstack":
            item = tuple(b.clone() for b in part.split(model.hidden_size, 1))
        elif i % 2:
            item = (part.clone(),)  # one block, as wide as the text
        else:
            item = part.clone()
        if pinned:
            item = tuple(b.cpu().pin_memory() for b in item) if isinstance(item, tuple) else item.cpu().pin_memory()
        items.append(item)
    return items


def random_media(batch, g):
    """make_batch's media redrawn from ``g``: the same values whatever the encoder does on this machine."""
    if batch.media is None:
        return batch
    return replace(batch, media=torch.randn(batch.media.shape, generator=g).to(batch.media.device,
                                                                              batch.media.dtype))


def item_batch(batch, model, g, **kw):
    m = batch.media.shape[0]
    cuts = sorted({0, m // 3, m // 3, (2 * m) // 3}) if m > 2 else [0]
    return replace(batch, media=as_items(batch.media, model, cuts, **kw))


@pytest.mark.parametrize("variant", VARIANTS)
def test_runner_items_equal_one_tensor(variant):
    model = toy(variant)
    buffers = toy_buffers(model, 48)
    runner = PrefillGraphRunner(model, buffers, buckets=[8, 16, 32])
    runner.capture()
    g = gen(23)
    for n in (5, 29, 48):
        batch = random_media(make_batch(model, n, media_fraction=0.4, num_seqs=min(3, n), generator=g), g)
        items = item_batch(batch, model, g)
        out_items = runner.run(items, clone=True)
        slab_items = buffers.input_embeds[:n].clone()
        want, _ = expected_slab(torch.zeros(n, model.embed_width, dtype=model.dtype), batch.input_ids, batch.table,
                                items.media, batch.media_index, expand=batch.expand)
        assert_same_slab(slab_items, want, f"{n} tokens")
        out_cat = runner.run(batch, clone=True)
        assert same_bytes(buffers.input_embeds[:n], slab_items)
        assert same_bytes(out_items, out_cat), f"{n} tokens: outputs differ"


def test_runner_plain_forward_with_host_inputs_and_items():
    W, V, n = 40, 30, 19
    buffers = StagingBuffers.allocate(max_num_tokens=32, max_batch_size=4, embed_width=W, embed_dtype=BF16,
                                      device="cpu")
    buffers.input_embeds.fill_(NAN)
    runner = PrefillGraphRunner(lambda v: v["input_embeds"] * 1, buffers, buckets=[16, 32])
    g = gen(24)
    rows = [3, 0, 8, 2]
    items = make_items(g, rows, W, F32, "cpu", [(16, 24), None, (8, 8, 24), None])
    ids = randint(g, 0, V, n)
    index = scattered_index(g, n, rows, 12)
    table = randn(g, V, W, BF16)
    batch = PrefillBatch(input_ids=ids, positions=torch.arange(n), table=table, media=items, media_index=index)
    out = runner.run(batch, clone=True)
    want, _ = expected_slab(torch.zeros(n, W, dtype=BF16), ids, table, items, index)
    assert_same_slab(out, want, "output")
    assert_same_slab(buffers.input_embeds[:n], want)
    assert torch.equal(buffers.input_ids[:n], ids) and torch.equal(buffers.positions[:n], torch.arange(n))
    assert buffers.errors.tolist() == CLEAN
    tuple_batch = replace(batch, media=tuple(items))  # a top-level tuple is the same sequence of items
    assert same_bytes(runner.run(tuple_batch, clone=True), out)


RUNNER_BAD = [
    ("mixed dtypes", lambda g: [randn(g, 3, 24), randn(g, 2, 24, BF16)], TypeError),
    ("block rows differ", lambda g: [randn(g, 3, 24), (randn(g, 2, 8), randn(g, 3, 16))], ValueError),
    ("widths differ", lambda g: [randn(g, 3, 24), randn(g, 2, 16)], WidthContractError),
    ("non-tensor", lambda g: [randn(g, 3, 24), "image"], TypeError),
]


@pytest.mark.parametrize("name, media, exc", RUNNER_BAD, ids=[c[0] for c in RUNNER_BAD])
def test_runner_refuses_bad_items_before_any_write(name, media, exc):
    W, n = 24, 10
    buffers = StagingBuffers.allocate(max_num_tokens=16, max_batch_size=2, embed_width=W, embed_dtype=F32,
                                      device="cpu")
    runner = PrefillGraphRunner(lambda v: v["input_embeds"], buffers, buckets=[16])
    g = gen(25)
    table = randn(g, 20, W)
    runner.run(PrefillBatch(input_ids=randint(g, 0, 20, n), positions=torch.arange(n), table=table))
    before = {name: buffers.registry[name].clone() for name in buffers.registry}
    index = torch.tensor([-1, 0, 1, 2, 3, 4, -1, -1, -1, -1])
    with pytest.raises(exc):  # from PrefillBatch or from run: either way before anything is written
        runner.run(PrefillBatch(input_ids=randint(g, 0, 20, n), positions=torch.arange(n), table=table,
                                media=media(g), media_index=index))
    for slot, t in before.items():
        assert same_bytes(buffers.registry[slot], t), slot


# ==================================================================================================
# CUDA: capture and replay, sync-free, pinned host items
# ==================================================================================================
def cuda_runner(variant, buckets, *, hidden=128, k=3):
    model = toy(variant, BF16, "cuda", hidden=hidden, layers=max(2, k), k=k)
    buffers = toy_buffers(model, max(buckets), "cuda")
    runner = PrefillGraphRunner(model, buffers, buckets=buckets, max_padding_ratio=2.0, progress=False).capture()
    return model, buffers, runner


def no_sync_runs(runner, batches):
    for batch in batches:  # warm-up: kernels compiled, host blocks cached
        runner.run(batch)
    torch.cuda.synchronize()
    outs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches:
            outs.append((runner.run(batch, clone=True), runner.last_bucket))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return outs


@pytest.mark.cuda
@pytest.mark.parametrize("inputs", ["device", "host"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_replay_with_items_equals_eager_without_sync(variant, inputs):
    model, buffers, runner = cuda_runner(variant, [16, 64, 128])
    g = gen(26)
    where = "cuda" if inputs == "device" else None
    cat_batches = [random_media(make_batch(model, n, media_fraction=0.5, num_seqs=2, generator=g, device=where), g)
                   for n in (16, 50, 100)]
    batches = [item_batch(b, model, g) for b in cat_batches]
    outs = no_sync_runs(runner, batches)
    assert [bucket for _, bucket in outs] == [16, 64, 128]
    for batch, cat, (out, bucket) in zip(batches, cat_batches, outs):
        again = runner.run(batch, clone=True)
        assert torch.equal(out, again)
        eager = model(buffers.registry.views(bucket))[:batch.num_tokens]
        assert torch.equal(again, eager), "replay differs from eager on the same staged buffers"
        want, _ = expected_slab(torch.zeros(batch.num_tokens, model.embed_width, dtype=model.dtype),
                                batch.input_ids, batch.table, batch.media, batch.media_index, expand=batch.expand)
        assert_same_slab(buffers.input_embeds[:batch.num_tokens], want)
        assert torch.equal(runner.run(cat, clone=True), out), "items and one tensor differ"


@pytest.mark.cuda
@pytest.mark.parametrize("inputs", ["device", "host"])
def test_cuda_staging_is_one_launch_without_cat(inputs):
    """The runner stages a batch of DeepStack items with one kernel; no torch.cat runs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    H, k, V, n = 64, 3, 100, 50
    W = H * (1 + k)
    buffers = StagingBuffers.allocate(max_num_tokens=64, max_batch_size=2, embed_width=W, embed_dtype=BF16,
                                      device="cuda")
    runner = PrefillGraphRunner(lambda v: v["input_embeds"] * 2, buffers, buckets=[64], progress=False).capture()
    g = gen(27)
    rows = [9, 0, 12, 4]
    items = [tuple(randn(g, r, H, BF16, "cuda") for _ in range(1 + k)) for r in rows]
    where = "cuda" if inputs == "device" else "cpu"
    index = scattered_index(g, n, rows, 25, device=where)
    batch = PrefillBatch(input_ids=randint(g, 0, V, n, device=where), positions=torch.arange(n, device=where),
                         table=randn(g, V, H, BF16, "cuda"), media=items, media_index=index)
    runner.run(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = runner.run(batch, clone=True)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    assert sum("stage" in name.lower() for name in kernels) == 1, kernels
    assert not any("catarray" in name.lower() for name in kernels), kernels
    want, _ = expected_slab(torch.zeros(n, W, dtype=BF16), batch.input_ids, batch.table, items, index)
    assert_same_slab(out, (want.float() * 2).to(BF16), "output")


@pytest.mark.cuda
def test_cuda_pinned_host_items_are_read_directly():
    g = gen(28)
    W, V, n = 96, 50, 41
    rows = [6, 0, 9, 5]
    host = make_items(g, rows, W, F32, "cpu", [None, None, (32, 64), (32, 32, 32)])
    pinned = [tuple(b.pin_memory() for b in it) if isinstance(it, tuple) else it.pin_memory() for it in host]
    assert all(b.is_pinned() for it in pinned for b in blocks_of(it) if b.numel())  # an empty block has no memory
    mixed = [pinned[0], host[1].cuda(), pinned[2], tuple(b.cuda() for b in host[3])]  # host and device items
    ids = randint(g, 0, V, n, device="cuda")
    index = scattered_index(g, n, rows, 22, device="cuda")
    table = randn(g, V, 32, BF16, "cuda")
    for media in (pinned, mixed):
        slab = poisoned(n + 3, W, BF16, "cuda")
        stage_and_check(slab, ids, table, media=media, media_index=index, pad_to=n + 2)
    slab = poisoned(n + 3, W, BF16, "cuda")
    stage_embeddings(slab, ids, table, media=pinned, media_index=index, pad_to=n + 2)  # warm
    torch.cuda.synchronize()
    want, _ = expected_slab(slab, ids, table, pinned, index, pad_to=n + 2)
    torch.cuda.set_sync_debug_mode("error")
    try:
        stage_embeddings(slab, ids, table, media=pinned, media_index=index, pad_to=n + 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_same_slab(slab, want)


@pytest.mark.cuda
def test_cuda_runner_with_pinned_host_items():
    model, buffers, runner = cuda_runner("deepstack", [16, 64, 128])
    g = gen(29)
    cat_batches = [random_media(make_batch(model, n, media_fraction=0.5, num_seqs=2, generator=g), g)
                   for n in (16, 50, 100)]
    batches = [item_batch(b, model, g, pinned=True) for b in cat_batches]
    outs = no_sync_runs(runner, batches)
    for batch, cat, (out, bucket) in zip(batches, cat_batches, outs):
        assert torch.equal(out, runner.run(cat, clone=True)), f"{batch.num_tokens} tokens: pinned items differ"
        runner.run(batch)
        assert torch.equal(out, model(buffers.registry.views(bucket))[:batch.num_tokens])


@pytest.mark.cuda
def test_cuda_pageable_host_item_is_refused():
    g = gen(30)
    args = _bad_base("cuda", g)
    args["media"] = [args["media"][0], args["media"][1].cpu()]  # pageable: not pinned
    assert not args["media"][1].is_pinned()
    refused(args, "cuda", ValueError, 1, None, ())
    args = _bad_base("cuda", g)
    args["media"] = [args["media"][0], (args["media"][1][:, :16].cpu().pin_memory(), args["media"][1][:, 16:].cpu())]
    refused(args, "cuda", ValueError, 1, None, ())


@pytest.mark.cuda
def test_cuda_item_with_a_host_slab_is_refused():
    g = gen(33)
    args = _bad_base("cpu", g)
    args["media"] = [args["media"][0], (args["media"][1][:, :16], args["media"][1][:, 16:].cuda())]
    refused(args, "cpu", ValueError, 1, None, ())


@pytest.mark.cuda
def test_cuda_runner_refuses_pageable_items_before_any_write():
    model, buffers, runner = cuda_runner("deepstack", [16, 64])
    g = gen(31)
    batch = item_batch(random_media(make_batch(model, 40, media_fraction=0.5, num_seqs=2, generator=g), g), model, g)
    runner.run(batch)
    torch.cuda.synchronize()
    before = {name: buffers.registry[name].clone() for name in buffers.registry}
    with pytest.raises(ValueError):  # from PrefillBatch or from run: either way before anything is written
        runner.run(replace(batch, media=[tuple(b.cpu() for b in it) for it in batch.media]))
    torch.cuda.synchronize()
    for slot, t in before.items():
        assert same_bytes(buffers.registry[slot], t), slot



@pytest.mark.cuda
@pytest.mark.parametrize("where", ["device", "pinned"])
def test_cuda_captured_staging_reads_the_items_at_replay(where):
    """A caller captures stage_embeddings over items it keeps alive: each replay reads their current values."""
    g = gen(32)
    W, V, n, H = 64, 40, 30, 32
    rows = [5, 7, 4]
    host = make_items(g, rows, W, F32, "cpu", [None, (H, H), (H, 16, 16)])
    if where == "pinned":
        items = [tuple(b.pin_memory() for b in it) if isinstance(it, tuple) else it.pin_memory() for it in host]
    else:
        items = [tuple(b.cuda() for b in it) if isinstance(it, tuple) else it.cuda() for it in host]
    ids = randint(g, 0, V, n, device="cuda")
    index = scattered_index(g, n, rows, 16, device="cuda")
    table = randn(g, V, H, BF16, "cuda")
    slab = poisoned(n + 4, W, BF16, "cuda")
    errors = new_error_word("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stage_embeddings(slab, ids, table, media=items, media_index=index, pad_to=n + 2, errors=errors)  # warm
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stage_embeddings(slab, ids, table, media=items, media_index=index, pad_to=n + 2, errors=errors)
    for it in items:  # new values in place
        for b in blocks_of(it):
            b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
    other = make_items(g, [9, 3], W, F32, "cuda", [(H, H), None])  # an eager staging in between
    stage_embeddings(poisoned(n, W, BF16, "cuda"), ids, table, media=other,
                     media_index=scattered_index(g, n, [9, 3], 12, device="cuda"), errors=new_error_word("cuda"))
    slab.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    want, _ = expected_slab(poisoned(n + 4, W, BF16, "cpu"), ids, table, items, index, pad_to=n + 2)
    assert_same_slab(slab, want)
    assert errors.tolist() == CLEAN


@pytest.mark.parametrize("offset, width, stride", [(0, 16, 16), (1, 16, 16), (0, 12, 12), (0, 16, 24), (8, 16, 24)])
def test_item_plan_vector_flag_follows_every_address_and_stride(offset, width, stride):
    """The plan of items of one tensor each promises 16-byte loads only when every item's address, row stride
    and width are whole 16-byte vectors (bf16: 8 elements), as the plan of column-block items does."""
    from slabstage.staging.validate import describe_media
    pool = torch.zeros(4096, dtype=torch.bfloat16)
    items = [pool[offset + 512 * k:offset + 512 * k + 3 * stride].view(3, stride)[:, :width] for k in range(3)]
    items.append(torch.zeros(0, width, dtype=torch.bfloat16))  # an empty item is never read
    plan = describe_media(items, torch.device("cpu"), width, width, "zeros")
    aligned = all(t.data_ptr() % 16 == 0 for t in items[:3]) and width % 8 == 0 and stride % 8 == 0
    assert plan.vec == aligned
    assert plan.starts == [0, 3, 6, 9] and plan.rows == 9 and plan.width == width
    assert plan.fields[:4] == [items[0].data_ptr(), stride, 0, width]
    assert plan.fields[-4] == 0 and plan.fields[-2:] == [0, width]  # the empty item: no address
    assert plan.lows == [t.data_ptr() for t in items[:3]]
    assert plan.highs == [t.data_ptr() + (2 * stride + width) * 2 for t in items[:3]]
