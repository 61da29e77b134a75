"""Triton for the kernels (or None), whether its interpreter runs them, the one helper that picks launch
settings, exact casts and programmatic dependent launch's device side."""

from __future__ import annotations

import os

try:  # triton is a Linux dependency; elsewhere the references serve
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on platforms without triton
    triton = None
    tl = None
    HAS_TRITON = False

# Read once, when the kernels are defined: the interpreter must be chosen before that.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The interpreter (triton 3.x) rounds fp32 -> bf16 half-up, flushes bf16 subnormals on the way
# to fp32 and casts bf16 -> fp16 through integers; the kernels then cast by bits so that CPU runs
# match torch bit for bit.
SOFT_CASTS = INTERPRET
# Inline PTX: on CUDA, not under the interpreter.
PTX = not INTERPRET

if HAS_TRITON:

    class Constant(tl.constexpr):
        """A ``tl.constexpr`` that a launch compares as fast as an int.

        Every launch checks that each global its kernel reads still equals the value it was compiled
        with (``!=`` against a copy); ``tl.constexpr``'s ``!=`` builds new objects (~0.7 µs on the CI
        machine). The staging kernels read their layout constants as attributes of a module, which
        no launch compares (:data:`slabstage.kernels.layout.device`); their checksum is the one global."""

        def __ne__(self, other):
            if type(other) is type(self):
                return self.value != other.value
            return super().__ne__(other)

        __hash__ = tl.constexpr.__hash__

    @triton.jit
    def cast_to(x, DST: tl.constexpr, SOFT: tl.constexpr):
        """x cast to DST with torch's rounding (round to nearest even), subnormals kept."""
        if x.dtype == DST:
            return x
        if SOFT and x.dtype == tl.bfloat16:  # exact: a bf16 is the top half of an fp32
            y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            y = x.to(tl.float32)  # exact for every other source dtype we accept
        if DST == tl.float32:
            return y
        if SOFT and DST == tl.bfloat16:
            bits = y.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            half = tl.where(y != y, 0x7FC0, bits >> 16).to(tl.uint16)
            return half.to(tl.bfloat16, bitcast=True)
        return y.to(DST)

    # A count of a launch's programs, taken early and read late (inline PTX, thread 0 of each program): the
    # count's trip to L2 runs beside the program's work rather than after it, and its result stays in thread
    # 0's register (no broadcast through shared memory, no barrier). The interpreter counts at the end instead.

    @triton.jit
    def count_in(counter, after):
        """Thread 0 adds 1 to the int32 at address ``counter`` (relaxed, GPU scope; nothing when ``counter`` is
        0) once ``after`` has arrived (a loaded value the count must follow: its register is an operand), and
        gets the count before; the other threads get -1. Nothing waits for the count until it is used."""
        return tl.inline_asm_elementwise(
            """{
            .reg .pred p, q;
            .reg .u32 t;
            mov.u32 t, %tid.x;
            setp.eq.u32 p, t, 0;
            setp.ne.u64 q, $1, 0;
            and.pred p, p, q;
            setp.ne.s64 q, $2, -9223372036854775808;
            and.pred p, p, q;
            mov.u32 $0, -1;
            @p atom.global.relaxed.gpu.add.u32 $0, [$1], 1;
            }""", "=r,l,l", [counter, after], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def count_out(count, last, word, counter):
        """Where :func:`count_in` gave ``last`` (thread 0 of the last program to count): store 0 into the int64 at
        address ``word`` and put the counter back to 0."""
        return tl.inline_asm_elementwise(
            """{
            .reg .pred p;
            setp.eq.s32 p, $1, $2;
            @p st.global.u64 [$3], 0;
            @p st.global.u32 [$4], 0;
            mov.u32 $0, 0;
            }""", "=r,r,r,l,l", [count, last, word, counter], dtype=tl.int32, is_pure=False, pack=1)
else:  # pragma: no cover
    Constant = cast_to = count_in = count_out = None


try:  # programmatic dependent launch (triton 3.4 and later)
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - older triton, or none
    gdc_wait = None


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def row_launch_config(width: int, elem_bytes: int, *, divides: tuple[int, ...] = (),
                      max_block_bytes: int = 8192) -> tuple[int, int]:
    """(BLOCK, num_warps) for kernels that move one row piece per program.

    BLOCK is a power of two of at most ``max_block_bytes`` that covers ``width``
    when it can; it also divides each width in ``divides`` (tiled sources need
    whole pieces). num_warps gives each thread about four 16-byte vectors.
    """
    block = min(next_pow2(width), max(16, max_block_bytes // elem_bytes))
    for w in divides:
        while w % block:
            block //= 2
    vectors = max(1, block * elem_bytes // 16)
    num_warps = min(8, max(1, vectors // (32 * 4)))
    return block, next_pow2(num_warps)
