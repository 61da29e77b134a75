"""The ladder of token-count buckets that prefill graphs are captured for."""

from __future__ import annotations

from ..checks import check_int

__all__ = ["default_token_buckets"]

# (upper end of a band, step inside it): fine steps where launch overhead dominates
# and padding is cheap in absolute terms, coarse steps where a bucket costs memory
# and capture time. Padding stays under 2x everywhere and under 1.34x from 64 up.
_BANDS = ((16, None), (256, 16), (1024, 64), (4096, 256), (16384, 1024), (None, 4096))


def default_token_buckets(max_num_tokens: int) -> list[int]:
    """Ascending bucket sizes ending at ``max_num_tokens``.

    1, 2, 4, 8, 16 (powers of two), then multiples of 16 up to 256, of 64 up to
    1024, of 256 up to 4096, of 1024 up to 16384, of 4096 beyond; every size above
    ``max_num_tokens`` is dropped and ``max_num_tokens`` itself is the last bucket.
    For 8192 tokens that is 48 buckets; for 32768, 60.
    """
    max_num_tokens = check_int("max_num_tokens", max_num_tokens, lo=1)
    sizes, lo = [], 0
    for hi, step in _BANDS:
        if step is None:  # powers of two up to hi
            sizes.extend(1 << i for i in range(hi.bit_length()))
        else:
            top = max_num_tokens if hi is None else hi
            sizes.extend(range(lo + step, top + 1, step))
        lo = hi if hi is not None else lo
        if hi is None or hi >= max_num_tokens:
            break
    return sorted({s for s in sizes if s < max_num_tokens} | {max_num_tokens})
