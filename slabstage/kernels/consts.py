"""The staging kernels' layout constants, as attributes of this module (``from . import consts as K``).

A Triton launch compares each global its kernel reads with the value it was compiled with (51 of them:
7.6 µs a launch on the H200's host), but not a module's attributes, which the kernels read here. ``KEY``,
the values' checksum, is the one global each kernel reads: it puts them into Triton's compile-cache key.
"""

from __future__ import annotations

import zlib

from ..staging.slots import COUNT, REQUESTS
from .errors import BAD_MEDIA_INDEX, BAD_TOKEN_ID, VALUE_OUT_OF_RANGE
from .mrope import I_F32, I_F64, I_INT, SEGMENT_WORDS
from .params import (D_ADDR, D_DTYPE, D_FILL, D_KIND, D_LENGTH, D_PAD, D_ROWS, D_STRIDE, DEST_WORDS, F_MEDIA,
                     F_MEDIA_TILED, F_MEDIA_VEC, F_MEDIA_WRAP, F_SCALE, F_TEXT_TILED, F_TEXT_VEC, F_TEXT_WRAP, H_B,
                     H_COUNTER, H_DONE, H_FLAGS, H_IDS, H_IDS_DTYPE, H_INDEX, H_INDEX_DTYPE, H_ITEM_BLOCKS, H_ITEMS,
                     H_MEDIA_DTYPE, H_MEDIA_WIDTH, H_N, H_PAD_TO, H_NUM_ITEMS, H_NUM_MEDIA, H_SCALE, H_STEP, H_TABLE,
                     H_TABLE_DTYPE, H_TABLE_STRIDE, H_TABLE_WIDTH, H_VOCAB_END, H_VOCAB_SIZE, H_VOCAB_START,
                     H_WORDS, HEADER_WORDS, ITEM_CHUNK, LAYOUT_CODE, S_ADDR, S_DTYPE, S_STRIDE, SOURCE_WORDS,
                     TOK_BLOCK)
from .runtime import SOFT_CASTS, Constant

if Constant is not None:
    SOFT = Constant(SOFT_CASTS)
    BAD_ID = Constant(BAD_TOKEN_ID)
    BAD_MEDIA = Constant(BAD_MEDIA_INDEX)
    RANGE = Constant(VALUE_OUT_OF_RANGE)
    TOK_BLOCK = Constant(TOK_BLOCK)
    ITEM_CHUNK = Constant(ITEM_CHUNK)
    HEADER = Constant(HEADER_WORDS)
    SRC_WORDS = Constant(SOURCE_WORDS)
    DST_WORDS = Constant(DEST_WORDS)
    H_STEP = Constant(H_STEP)
    H_DONE = Constant(H_DONE)
    H_N = Constant(H_N)
    H_B = Constant(H_B)
    H_VS = Constant(H_VOCAB_START)
    H_VE = Constant(H_VOCAB_END)
    H_VZ = Constant(H_VOCAB_SIZE)
    H_SCALE = Constant(H_SCALE)
    H_FLAGS = Constant(H_FLAGS)
    H_TABLE = Constant(H_TABLE)
    H_TSTRIDE = Constant(H_TABLE_STRIDE)
    H_TWIDTH = Constant(H_TABLE_WIDTH)
    H_TDTYPE = Constant(H_TABLE_DTYPE)
    H_IDS = Constant(H_IDS)
    H_IDS_DT = Constant(H_IDS_DTYPE)
    H_INDEX = Constant(H_INDEX)
    H_INDEX_DT = Constant(H_INDEX_DTYPE)
    H_NUM_MEDIA = Constant(H_NUM_MEDIA)
    H_NUM_ITEMS = Constant(H_NUM_ITEMS)
    H_ITEM_BLOCKS = Constant(H_ITEM_BLOCKS)
    H_MDTYPE = Constant(H_MEDIA_DTYPE)
    H_MWIDTH = Constant(H_MEDIA_WIDTH)
    H_ITEMS = Constant(H_ITEMS)
    H_PAD_TO = Constant(H_PAD_TO)
    H_COUNTER = Constant(H_COUNTER)
    H_WORDS = Constant(H_WORDS)
    S_ADDR = Constant(S_ADDR)
    S_DTYPE = Constant(S_DTYPE)
    S_STRIDE = Constant(S_STRIDE)
    D_ADDR = Constant(D_ADDR)
    D_DTYPE = Constant(D_DTYPE)
    D_STRIDE = Constant(D_STRIDE)
    D_FILL = Constant(D_FILL)
    D_PAD = Constant(D_PAD)
    D_KIND = Constant(D_KIND)
    D_ROWS = Constant(D_ROWS)
    D_LENGTH = Constant(D_LENGTH)
    F_SCALE = Constant(F_SCALE)
    F_MEDIA = Constant(F_MEDIA)
    F_TEXT_TILED = Constant(F_TEXT_TILED)
    F_TEXT_WRAP = Constant(F_TEXT_WRAP)
    F_MEDIA_TILED = Constant(F_MEDIA_TILED)
    F_MEDIA_WRAP = Constant(F_MEDIA_WRAP)
    F_TEXT_VEC = Constant(F_TEXT_VEC)
    F_MEDIA_VEC = Constant(F_MEDIA_VEC)
    REQUESTS = Constant(REQUESTS)
    COUNT = Constant(COUNT)
    LAYOUT = Constant(LAYOUT_CODE)
    SEG_WORDS = Constant(SEGMENT_WORDS)
    I_INT = Constant(I_INT)
    I_F32 = Constant(I_F32)
    I_F64 = Constant(I_F64)
    KEY = Constant(zlib.crc32(repr(sorted((k, v.value) for k, v in globals().items()
                                          if isinstance(v, Constant))).encode()))
