"""A paged KV cache for :func:`slabstage.hf.prefill_forward`: per layer K and V at token slots.

Slot 0 is the sink: padding rows write their K and V there (the buffers pad
``out_cache_loc`` with 0), so no real token may live in slot 0. Each request's
tokens are found through ``req_to_token[req_index, j]``: the slot of the request's
token ``j``. The engine owns that table (it lives at a fixed address, so a graph
reads whatever the engine last wrote there); the default layout, filled at
allocation, gives request row ``r`` the slots ``1 + r * max_context + j``.
"""

from __future__ import annotations

import torch

from ..checks import check_int
from ._family import family_of

__all__ = ["KVCache"]


class KVCache:
    """Per layer ``k[i]``, ``v[i]``: ``[num_slots, kv_heads, head_dim]`` in the model's dtype; ``req_to_token``:
    ``int32[max_requests, max_context]``. Make one with :meth:`allocate`."""

    def __init__(self, k: list, v: list, req_to_token: torch.Tensor, max_context: int) -> None:
        self.k, self.v, self.req_to_token, self.max_context = k, v, req_to_token, max_context

    @classmethod
    def allocate(cls, model, max_requests: int, max_context: int, *, device=None, dtype=None) -> "KVCache":
        """A zeroed cache for ``model``'s language model: ``1 + max_requests * max_context`` slots (slot 0 the
        sink), ``req_to_token`` filled with the default layout. ``device``/``dtype``: default the model's.

        Raises ``ValueError`` for sizes that are not positive ints and for a model the cache does not hold:
        sliding-window (or other non-full-attention) layers, layers with different head counts or head dims.
        """
        fam = family_of(model, "KVCache.allocate")
        for name, value in (("max_requests", max_requests), ("max_context", max_context)):
            check_int(f"slabstage.hf.KVCache.allocate: {name}", value, lo=1)
        shape = cache_shape(fam, "KVCache.allocate")
        param = next(fam.language_model.parameters())
        device = param.device if device is None else torch.device(device)
        dtype = param.dtype if dtype is None else dtype
        slots = 1 + max_requests * max_context
        with torch.inference_mode(False):
            k = [torch.zeros(slots, *shape, dtype=dtype, device=device) for _ in fam.language_model.layers]
            v = [torch.zeros_like(t) for t in k]
            table = torch.arange(1, slots, dtype=torch.int32, device=device).view(max_requests, max_context)
        return cls(k, v, table, max_context)

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_requests(self) -> int:
        return self.req_to_token.shape[0]

    def slots(self, req_index: int, start: int, length: int) -> torch.Tensor:
        """The default layout's slots of request row ``req_index``'s tokens ``[start, start + length)``: int64
        on the host (what ``out_cache_loc`` takes)."""
        if not 0 <= req_index < self.max_requests:
            raise ValueError(f"req_index {req_index} is outside the cache's {self.max_requests} request rows")
        if start < 0 or length < 0 or start + length > self.max_context:
            raise ValueError(f"tokens [{start}, {start + length}) do not fit the cache's max_context "
                             f"{self.max_context}")
        first = 1 + req_index * self.max_context + start
        return torch.arange(first, first + length, dtype=torch.int64)

    def batch_slots(self, rows: list, starts: list, counts: list) -> dict:
        """What a batch gives the cache in the default layout (which :meth:`allocate` wrote into
        ``req_to_token``): ``prefix_lens`` (each request's tokens already cached: its chunk's start),
        ``req_indices`` (``rows``) and ``out_cache_loc`` (the slots of tokens ``[start, start + count)`` of each
        row), host tensors for a ``PrefillBatch``. Nothing is written: no host-to-device copy."""
        loc = torch.cat([self.slots(r, a, n) for r, a, n in zip(rows, starts, counts)])
        return dict(out_cache_loc=loc, prefix_lens=torch.tensor(starts, dtype=torch.int32),
                    req_indices=torch.tensor(rows, dtype=torch.int32))

    def __repr__(self) -> str:
        k = self.k[0]
        return (f"KVCache(layers={len(self.k)}, slots={k.shape[0]}, kv_heads={k.shape[1]}, head_dim={k.shape[2]}, "
                f"max_requests={self.max_requests}, max_context={self.max_context}, dtype={k.dtype}, "
                f"device={k.device})")


def cache_shape(fam, what: str) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` shared by every layer of ``fam``'s language model; ``ValueError`` for a model whose
    layers the cache (and the paged attention) cannot hold."""
    config = fam.text_config
    name = type(fam.model).__name__
    kinds = set(getattr(config, "layer_types", None) or ("full_attention",))
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise ValueError(f"slabstage.hf.{what}: {name} has layer types {sorted(kinds)} (or a sliding window); only "
                         f"full-attention layers are supported")
    shapes = set()
    for layer in fam.language_model.layers:
        attn = getattr(layer, "self_attn", None)
        k_proj = getattr(attn, "k_proj", None)
        head_dim = getattr(attn, "head_dim", None)
        if k_proj is None or not isinstance(head_dim, int) or k_proj.out_features % head_dim:
            raise ValueError(f"slabstage.hf.{what}: {name}'s layer {len(shapes)} has no k_proj/head_dim attention "
                             f"the cache understands")
        shapes.add((k_proj.out_features // head_dim, head_dim))
    if len(shapes) != 1:
        raise ValueError(f"slabstage.hf.{what}: {name}'s layers differ in (kv_heads, head_dim): {sorted(shapes)}; "
                         f"the cache holds one shape for every layer")
    return shapes.pop()
