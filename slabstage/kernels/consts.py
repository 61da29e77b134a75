"""The staging kernels' layout constants, as attributes of this module (``from . import consts as K``).

Each constant has the one name the host uses: ``K.H_VOCAB_START`` is
:data:`slabstage.kernels.params.H_VOCAB_START`, ``K.SEG_BASE`` is :data:`slabstage.kernels.mrope.SEG_BASE`,
``K.VALUE_OUT_OF_RANGE`` is :data:`slabstage.kernels.errors.VALUE_OUT_OF_RANGE`. Every upper-case integer of
:mod:`~slabstage.kernels.params` is here, and the names below of the other modules.

A Triton launch compares each global its kernel reads with the value it was compiled with (7.6 µs a launch
on the H200's host for some fifty of them), but not a module's attributes, which the kernels read here.
``KEY``, the values' checksum, is the one global each kernel reads: it puts them into Triton's compile-cache
key.
"""

from __future__ import annotations

import zlib

from ..staging import slots
from . import errors, mrope, params, runtime

_SHARED = {  # module: the names the kernels read from it (params: every upper-case int)
    params: [k for k, v in vars(params).items() if k.isupper() and type(v) is int],
    mrope: ["SEGMENT_WORDS", "SEG_FIRST_ROW", "SEG_BASE", "SEG_AREA", "SEG_COLUMNS", "SEG_OFFSET", "SEG_CODE",
            "SEG_INTERVAL", "INTERVAL_INT", "INTERVAL_F32", "INTERVAL_F64"],
    errors: ["BAD_TOKEN_ID", "BAD_MEDIA_INDEX", "VALUE_OUT_OF_RANGE"],
    slots: ["REQUESTS", "COUNT"],
    runtime: ["SOFT_CASTS"],
}

if runtime.Constant is not None:
    for _module, _names in _SHARED.items():
        for _name in _names:
            globals()[_name] = runtime.Constant(getattr(_module, _name))
    KEY = runtime.Constant(zlib.crc32(repr(sorted((k, v.value) for k, v in globals().items()
                                                  if isinstance(v, runtime.Constant))).encode()))
