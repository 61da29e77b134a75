"""The independent expected slab: what staging must leave in a slab, built row by row with plain torch indexing
from the ids, the table and the media (one tensor, a list of items, items as tuples of column blocks), never from
slabstage's own reference. The ops, contract and soak tests all check against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slabstage import BAD_MEDIA_INDEX, BAD_TOKEN_ID

NO_ROW = 2**31 - 1
CLEAN = [0, 0, NO_ROW, 0]  # an error word with nothing recorded: codes, count, first row, media count found


def items_of(media):
    """None -> []; one tensor -> [it]; a list or tuple -> its items (a top-level tuple is a sequence of items)."""
    if media is None:
        return []
    if isinstance(media, torch.Tensor):
        return [media]
    return list(media)


def blocks_of(item):
    return list(item) if isinstance(item, tuple) else [item]


def logical_row(items, k):
    """Row ``k`` of the items laid end to end, its column blocks side by side; None past the last row."""
    for item in items:
        blocks = blocks_of(item)
        rows = blocks[0].shape[0]
        if k < rows:
            return torch.cat([b[k].detach().cpu() for b in blocks])
        k -= rows
    return None


def widen(row, width, expand):
    if row.shape[0] == width:
        return row
    if expand == "repeat":
        return row.repeat(width // row.shape[0])
    return F.pad(row, (0, width - row.shape[0]))


def expected_slab(before, ids, table, media, media_index, *, pad_to=None, expand="zeros", text_scale=None,
                  vocab_range=None, vocab_size=None, media_owner=True, word=CLEAN):
    """(slab, error word) that staging into ``before`` must give, with ``word`` the error word before."""
    out = before.detach().cpu().clone()
    width, dtype = out.shape[1], out.dtype
    ids = ids.cpu().tolist()
    n = len(ids)
    pad_to = n if pad_to is None else pad_to
    index = media_index.cpu().tolist() if media_index is not None else [-1] * n
    table = table.detach().cpu()
    items = items_of(media)
    start, end = vocab_range if vocab_range is not None else (0, table.shape[0])
    vocab_size = end if vocab_size is None else vocab_size
    codes, count, first, found = word
    for r, (tok, mi) in enumerate(zip(ids, index)):
        row = torch.zeros(width, dtype=dtype)
        if mi >= 0:
            src = logical_row(items, mi)
            if src is None:
                codes, count, first = codes | BAD_MEDIA_INDEX, count + 1, min(first, r)
            elif media_owner:
                row = widen(src.to(dtype), width, expand)
        elif 0 <= tok < vocab_size:
            if start <= tok < end:
                src = table[tok - start]
                if text_scale is not None:
                    src = src.float() * text_scale
                row = widen(src.to(dtype), width, expand)
        else:
            codes, count, first = codes | BAD_TOKEN_ID, count + 1, min(first, r)
        out[r] = row
    out[n:pad_to] = 0
    return out, [codes, count, first, found]
