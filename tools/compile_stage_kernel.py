"""Compile the staging kernel for sm_90 on any machine (no GPU needed) and count its global loads by width.

    python tools/compile_stage_kernel.py            # one JSON line per configuration

Triton's wheel carries ptxas, so the PTX of a configuration can be read where no GPU is:
a media path whose 16-byte loads fell back to 2-byte ones (a mask or offset Triton cannot
prove aligned) shows here as ``scalar_b16`` loads. tests/test_stage_kernel_codegen.py runs it.
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # before the kernel is defined: compile it, do not interpret it

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from slabstage.kernels.stage_kernel import MEDIA_ITEMS, MEDIA_TENSOR, STAGE, stage_kernel  # noqa: E402

_FLOAT_PTRS = ("slab_ptr", "table_ptr", "media_ptr")


def load_counts(media_mode: int, width: int, blocks: int, block: int = 4096) -> dict:
    """Global load and store counts of the embedding half, bf16, every pointer and stride 16-byte aligned."""
    names = [*STAGE.runtime, *STAGE.constexprs]
    signature = {}
    for name in STAGE.runtime:
        if name.endswith("_ptr"):
            signature[name] = "*bf16" if name in _FLOAT_PTRS else ("*i32" if name == "errors_ptr" else "*i64")
        else:
            signature[name] = "fp32" if name == "text_scale" else "i32"
    constexprs = dict(STAGE.defaults)
    constexprs.update(EMBED=True, TOKENS=False, WIDTH=width, TEXT_WIDTH=width // blocks, MEDIA_WIDTH=width,
                      BLOCK=min(block, width), COL_BLOCKS=-(-width // min(block, width)), MEDIA_MODE=media_mode,
                      ITEM_BLOCKS=blocks, ITEM_VEC=8, MEDIA_OWNER=True)
    for name in STAGE.constexprs:
        signature[name] = "constexpr"
    aligned = [k for k in STAGE.runtime if k.endswith("_ptr") or k.startswith("stride_")]
    source = ASTSource(stage_kernel, signature,
                       constexprs={(names.index(k),): constexprs[k] for k in STAGE.constexprs},
                       attrs={(names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
    return dict(media_mode=media_mode, width=width, blocks=blocks,
                loads=len(re.findall(r"ld\.global", ptx)), loads_v4=len(re.findall(r"ld\.global[^\n]*\.v4", ptx)),
                scalar_b16=len(re.findall(r"ld\.global(\.[a-z0-9]+)*\.b16 ", ptx)))


if __name__ == "__main__":
    for mode, width, blocks in ((MEDIA_TENSOR, 4096, 1), (MEDIA_ITEMS, 4096, 1), (MEDIA_ITEMS, 8192, 4)):
        print(json.dumps(load_counts(mode, width, blocks)))
    sys.exit(0)
