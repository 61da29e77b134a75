"""The attention :func:`slabstage.hf.prefill_forward` swaps into the model: packed requests, no ``[T, T]`` mask.

Registered with transformers' ``AttentionInterface`` as ``"slabstage_paged"`` and set on the language model's
config only while the forward runs. Each layer's attention (HF's projections, rope and any k-norm run first)
calls it with ``query [1, H, T, D]``, ``key``/``value [1, KVH, T, D]``; it writes the chunk's K and V into the
KV cache at ``out_cache_loc`` (padding rows: slot 0, the sink) and attends every query row to its request's
cached prefix (``prefix_lens`` tokens, found through ``req_to_token``) and to its own chunk causally.
"""

from __future__ import annotations

import threading

from ..kernels.packed_attention import packed_attention, packed_attention_reference, request_offsets

__all__ = ["NAME", "Batch", "register", "active"]

NAME = "slabstage_paged"
_state = threading.local()


class Batch:
    """What every layer's attention reads in one forward: the staged per-request slots, the token count, and the
    cache (None: attend the same way, write nothing)."""

    def __init__(self, views: dict, num_tokens: int, cache) -> None:
        self.seq_lens, self.starts = views["seq_lens"], views["extend_start_loc"]
        self.prefix_lens, self.req_indices = views["prefix_lens"], views["req_indices"]
        self.count = views["num_tokens_non_padded"]
        self.num_tokens, self.cache = num_tokens, cache
        self.cache_loc = views["out_cache_loc"][:num_tokens].long() if cache is not None else None
        self._offsets = None

    def offsets(self, block_m: int):
        """:func:`request_offsets` for this batch, made once a forward (every layer shares them)."""
        if self._offsets is None or self._offsets[0] != block_m:
            self._offsets = (block_m, request_offsets(self.seq_lens, self.starts, self.prefix_lens, self.req_indices,
                                                      self.count, block_m, has_prefix=self.cache is not None))
        return self._offsets[1]


class active:
    """``with active(batch):`` the batch the registered attention reads (per thread)."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch

    def __enter__(self):
        self.prev = getattr(_state, "batch", None)
        _state.batch = self.batch
        return self.batch

    def __exit__(self, *exc) -> None:
        _state.batch = self.prev


def _attention(module, query, key, value, attention_mask=None, dropout: float = 0.0, scaling=None, **kwargs):
    batch = getattr(_state, "batch", None)
    if batch is None:
        raise RuntimeError(f"attention {NAME!r} runs only inside slabstage.hf.prefill_forward")
    q = query[0].transpose(0, 1)  # [T, H, D] views: no copies
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    cache = batch.cache
    k_cache = v_cache = table = None
    if cache is not None:
        layer = module.layer_idx
        k_cache, v_cache, table = cache.k[layer], cache.v[layer], cache.req_to_token
        k_cache.index_copy_(0, batch.cache_loc, k.to(k_cache.dtype))  # padding rows: slot 0, the sink
        v_cache.index_copy_(0, batch.cache_loc, v.to(v_cache.dtype))
    if q.is_cuda:
        out = packed_attention(q, k, v, batch.offsets, scale, k_cache, v_cache, table)
    else:
        out = packed_attention_reference(q, k, v, batch.seq_lens, batch.starts, batch.prefix_lens,
                                         batch.req_indices, batch.count, scale, k_cache, v_cache, table)
    return out[None], None


def register() -> None:
    """Register the attention with transformers (idempotent)."""
    if getattr(register, "done", False):
        return
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)
    register.done = True
