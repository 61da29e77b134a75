"""The staging kernel's parameter record, word by word: one name per word, for the host and the kernels alike
(docs/design.md, "One kernel, one parameter record").

Everything a batch changes reaches the kernel as int64 words of one parameter record, not as launch arguments,
so a captured launch serves every batch. Word offsets: the header (``H_*``); per integer slot
(:data:`~slabstage.staging.slots.SLOTS` order) its source (``S_*``), then per slot its destination (``D_*``),
the same for every batch of a stager, so every word a batch changes lies in one stretch at the start; then the
item list (each item's first media row, then per item and column block its ``C_*`` words) or the mrope slot's
segment list (``SEG_*``, built by :mod:`slabstage.staging.mrope`; its source is ``LAYOUT_CODE``: the list's
address, then its segment count); then host integer inputs, each 16-byte aligned (their device address is the
device parameter record's plus their offset).

The kernels read every upper-case integer here under the same name, as an attribute of :data:`device`
(``from .layout import device as K``; ``K.H_VOCAB_START``). A Triton launch compares each global its kernel
reads with the value it was compiled with (7.6 µs a launch on the H200's host for some fifty of them), but not
a module's attributes; ``KEY``, their checksum, is the one global each kernel reads (it keys the compile cache).
"""

from __future__ import annotations

import zlib

import torch

from . import runtime

__all__ = ["HEADER_WORDS", "MAX_ITEM_WORDS", "SOURCE_WORDS", "DEST_WORDS", "INT_CODE", "LAYOUT_CODE", "FLOAT_CODE",
           "FLOAT_BYTES", "device"]

# -- header ------------------------------------------------------------------------------
(H_STEP, H_DONE, H_WORDS, H_N, H_B, H_VOCAB_START, H_VOCAB_END, H_VOCAB_SIZE, H_SCALE, H_FLAGS,
 H_TABLE, H_TABLE_STRIDE, H_TABLE_WIDTH, H_TABLE_DTYPE, H_IDS, H_IDS_DTYPE, H_INDEX, H_INDEX_DTYPE,
 H_NUM_MEDIA, H_NUM_ITEMS, H_ITEM_BLOCKS, H_MEDIA_DTYPE, H_MEDIA_WIDTH, H_ITEMS, H_PAD_TO, H_LIVE,
 H_TICKET) = range(27)
HEADER_WORDS = 32
# H_LIVE: 1 in every record the host writes. H_TICKET: 0, or in a record for a graph's replay the address of an
# int32 word that counts the launch's programs: each counts once it has read H_LIVE (the one record word a launch
# writes), and the last to count clears H_LIVE, so that a replay with no record copied in for it (a bare
# graph.replay()) writes nothing, and puts the count back to 0

# switches in H_FLAGS
F_SCALE = 1  # multiply text rows by text_scale (in fp32)
F_MEDIA = 2  # write media rows (a media owner); off: media rows are zeros
F_TEXT_TILED = 4  # the text width divides the slab's and BLOCK (columns a program writes) divides it: tile by pieces
F_TEXT_WRAP = 8  # tiled, but BLOCK does not divide it: each column wraps on its own
F_MEDIA_TILED = 16
F_MEDIA_WRAP = 32
F_TEXT_VEC = 64  # table address, row stride and width in whole 16-byte vectors: vector loads
F_MEDIA_VEC = 128  # the same for every column block of every media item

# -- slot descriptors: the sources of every slot after the header, then their destinations -----------
S_ADDR, S_DTYPE, S_STRIDE = range(3)  # at HEADER_WORDS + SOURCE_WORDS * slot
SOURCE_WORDS = 3
D_ADDR, D_DTYPE, D_STRIDE, D_FILL, D_PAD, D_KIND, D_ROWS, D_LENGTH = range(8)  # after every source
DEST_WORDS = 8

# -- the item and segment lists after the destinations: their room in every parameter record (checked with
#    the batch)
MAX_ITEM_WORDS = 1 << 14  # 1 + 4 x column blocks words a media item, 8 words a segment of mrope positions
C_ADDR, C_STRIDE, C_FIRST_COL, C_END_COL = range(4)  # an item's column block, after the item starts
COLUMN_BLOCK_WORDS = 4

# -- how the kernels tile a batch -----------------------------------------------------------
TOKEN_ROWS = 128  # integer-slot rows per program
ITEM_CHUNK = 32  # item starts read per vector load when finding a media row's item

NO_INPUT, INT32_CODE, INT64_CODE = 0, 1, 2  # (4 bytes a code)
INT_CODE = {torch.int32: INT32_CODE, torch.int64: INT64_CODE}
LAYOUT_CODE = 3  # a source that is a segment list: positions computed from it
FLOAT16_CODE, BFLOAT16_CODE, FLOAT32_CODE = 0, 1, 2
FLOAT_CODE = {torch.float16: FLOAT16_CODE, torch.bfloat16: BFLOAT16_CODE, torch.float32: FLOAT32_CODE}
FLOAT_BYTES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}

# -- slot kinds: how a slot is laid out and what the kernel writes into it
TOKENS = 0  # [T]: rows [0, n) copied, [n, pad_to) padded
ROWS = 1  # [rows, T] (token axis 1): each row as TOKENS
REQUESTS = 2  # [max_batch_size]: [0, b) copied, the rest padded
COUNT = 3  # [1]: the batch's token count, never padded

# -- the error word (slabstage.staging.errors): int32 words, and the bits of its first
ERROR_CODES, ERROR_ROWS, ERROR_FIRST_ROW, ERROR_PLACEHOLDERS = range(4)  # OR of the bits, rows flagged, first
ERROR_WORD_SIZE = 4  # flagged row (NO_ROW when none), the last placeholder count media_index_from_mask found
NO_ROW = 2**31 - 1
BAD_TOKEN_ID = 1  # a text row's id is negative or >= the vocabulary size
BAD_MEDIA_INDEX = 2  # a media row's index is >= the number of media rows
MEDIA_COUNT_MISMATCH = 4  # placeholder rows in the mask != media rows given
VALUE_OUT_OF_RANGE = 8  # a device integer input does not fit its slot's dtype (stored truncated)

# -- an mrope segment's words: its first row, base, area, columns, first offset, interval code, interval (then
#    one spare)
SEG_FIRST_ROW, SEG_BASE, SEG_AREA, SEG_COLUMNS, SEG_OFFSET, SEG_CODE, SEG_INTERVAL = range(7)
SEGMENT_WORDS = 8
# interval codes: how the temporal offset floor(i * interval) is computed, as torch computes
# ``arange(t) * interval`` for an interval of that kind (an int; a float32; a float64)
INTERVAL_INT, INTERVAL_F32, INTERVAL_F64 = 0, 1, 2
SOFT_CASTS = runtime.SOFT_CASTS  # (the interpreter's casts: see slabstage.kernels.runtime)
PTX = runtime.PTX  # (inline PTX: the ticket's count_in / count_out; the interpreter has none)


def _device_view():
    """The module the kernels read: every upper-case int here as a ``tl.constexpr``, and ``KEY``."""
    view = type(runtime)(__name__ + ".device")
    values = {k: v for k, v in globals().items() if k.isupper() and type(v) in (int, bool)}
    for k, v in values.items():
        setattr(view, k, runtime.Constant(v))
    view.KEY = runtime.Constant(zlib.crc32(repr(sorted(values.items())).encode()))
    return view


device = _device_view() if runtime.Constant is not None else None
