"""A capturable prefill forward over the slab for a Hugging Face model's language model (docs/hf.md says what
it replaces in HF's forward, and why)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from ._family import family_of
from .attention import NAME, Batch, active, register
from .kv_cache import KVCache, cache_shape

__all__ = ["prefill_forward"]

_ATTENTION = ("sdpa", "eager", NAME)


_SWAP = threading.RLock()  # held while a forward has swapped the models' attention implementation


def prefill_forward(model, *, cache: KVCache | None = None):
    """``forward(views) -> [T, H]``: the language model of ``model`` over the slab, capturable.

    ``views`` is ``buffers.registry.views(bucket)``. It reads ``input_embeds [T, W]`` (column block 0,
    ``[:, :H]``, enters layer 0; for Qwen3-VL, block ``i + 1`` is added after decoder layer ``i < k``),
    ``mrope_positions [3, T]`` for the VLMs (``positions [T]`` for decoder LMs), ``seq_lens``,
    ``extend_start_loc``, ``prefix_lens``, ``req_indices`` and ``num_tokens_non_padded``. Returns the hidden
    states after the final norm, ``[T, H]``, in the model's dtype. Attention is packed (no ``[T, T]`` mask):
    each request's rows attend causally to each other; rows in no request attend to nothing and never reach a
    real row; when every ``seq_lens`` is 0 the real rows are one request. With ``cache`` (a
    :class:`~slabstage.hf.KVCache` of this model), every layer also writes the chunk's K and V at
    ``out_cache_loc`` and request ``r`` first attends to its ``prefix_lens[r]`` cached tokens; without it
    nothing is written. A replay runs the eager forward's kernels (docs/graphs.md). It runs without autograd.

    Raises ``TypeError``/:class:`WidthContractError` as :func:`input_embeds_width` does, and ``ValueError`` for
    an attention implementation other than sdpa or eager, sliding-window layers or layers of different head
    shapes, and a ``cache`` made for another model's shapes.
    """
    fam = family_of(model, "prefill_forward")
    lm, config = fam.language_model, fam.text_config
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in _ATTENTION:
        raise ValueError(f"slabstage.hf.prefill_forward: attention implementation {impl!r} is not supported; "
                         f"load the model with attn_implementation='sdpa' (or 'eager')")
    _check_cache(cache, len(lm.layers), cache_shape(fam, "prefill_forward"))
    register()
    configs = list({id(layer.self_attn.config): layer.self_attn.config for layer in lm.layers}.values())
    hidden, levels, mrope = fam.hidden_size, fam.deepstack_levels, fam.is_vlm
    layers, norm, rotary = lm.layers, lm.norm, lm.rotary_emb
    dtype = next(lm.parameters()).dtype

    @torch.no_grad()  # (inference: no autograd history on the KV cache or the outputs, whatever the model's
    def forward(views: dict) -> torch.Tensor:  # parameters say)
        embeds = views["input_embeds"]
        h = embeds[:, :hidden].to(dtype)[None]  # a no-op view when the slab has the model's dtype
        position_ids = views["mrope_positions"][:, None, :] if mrope else views["positions"][None]  # [3|1, 1, T]
        cos_sin = rotary(h, position_ids)
        batch = Batch(views, embeds.shape[0], cache)
        with _slabstage_attention(configs), active(batch):
            for i, layer in enumerate(layers):
                h = layer(h, attention_mask=None, position_embeddings=cos_sin)
                if isinstance(h, tuple):  # older layer APIs return (hidden, ...)
                    h = h[0]
                if i < levels:  # DeepStack level i: zeros on text rows, so a whole-block add is exact
                    h = h + embeds[:, hidden * (i + 1):hidden * (i + 2)].to(dtype)[None]
            return norm(h)[0]

    if cache is not None:  # (the runner refuses a batch that does not give them)
        forward.needs = ("out_cache_loc", "prefix_lens", "req_indices")
    return forward


def _check_cache(cache, layers: int, shape: tuple) -> None:
    """``cache`` is None or a :class:`KVCache` of ``layers`` layers of ``shape`` (kv_heads, head_dim)."""
    if cache is None:
        return
    if not isinstance(cache, KVCache):
        raise TypeError(f"slabstage.hf.prefill_forward: cache must be a slabstage.hf.KVCache, got "
                        f"{type(cache).__name__}")
    if len(cache.k) != layers or tuple(cache.k[0].shape[1:]) != shape:
        raise ValueError(f"slabstage.hf.prefill_forward: cache holds {len(cache.k)} layers of "
                         f"{tuple(cache.k[0].shape[1:])} (kv_heads, head_dim); the model has {layers} of {shape}")


@contextmanager
def _slabstage_attention(configs: list):
    """The configs' attention implementation is slabstage's packed attention while inside; one forward at a
    time swaps it (the implementation is the configs' attribute, shared by every forward of the model)."""
    with _SWAP:
        saved = [c._attn_implementation for c in configs]
        try:
            for c in configs:
                c._attn_implementation = NAME
            yield
        finally:
            for c, name in zip(configs, saved):
                c._attn_implementation = name
