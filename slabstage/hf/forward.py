"""A capturable prefill forward over the slab for a Hugging Face model's language model.

The model's own decoder layers, rotary embedding and final norm do the math. What
the adapter replaces is what a CUDA graph cannot hold in HF's own forward:
``create_causal_mask`` (host-side checks on the mask and positions), the DeepStack
step (``hidden[visual_pos_masks] += ...``: boolean indexing, a data-dependent shape
and a host sync), and rope-index computation (Python loops over ``.tolist()``).
"""

from __future__ import annotations

import torch

from ._family import family_of

__all__ = ["prefill_forward", "packed_attention_mask"]

_ATTENTION = ("sdpa", "eager")


def packed_attention_mask(seq_lens: torch.Tensor, extend_start_loc: torch.Tensor,
                          num_tokens_non_padded: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``bool[1, 1, T, T]``: query ``q`` sees key ``k`` when both lie in one packed sequence and ``k <= q``.

    Sequence ``i`` is rows ``[extend_start_loc[i], extend_start_loc[i] + seq_lens[i])``; entries with
    ``seq_lens[i] == 0`` (the zero padding past the batch) hold no rows. Rows in no sequence, or at or
    past ``num_tokens_non_padded[0]`` (padding up to the bucket), see only themselves, so they never
    reach a real row and never produce an all-masked (NaN) softmax row. When every ``seq_lens`` is 0
    (a batch staged without them) the real rows form one causal sequence.
    Fixed shapes, device ops only: no host sync, capturable.
    """
    device = seq_lens.device
    rows = torch.arange(num_tokens, device=device)
    lens = seq_lens.to(torch.int64)[:, None]
    starts = extend_start_loc.to(torch.int64)[:, None]
    inside = (rows[None, :] >= starts) & (rows[None, :] < starts + lens)  # [B, T]
    seq_ids = torch.arange(1, lens.shape[0] + 1, device=device)[:, None]
    seq = (inside * seq_ids).sum(0) - 1  # [T]: the row's sequence, -1 for none
    real = rows < num_tokens_non_padded.to(torch.int64)
    seq = torch.where((lens > 0).any(), seq, torch.zeros_like(seq))  # no seq_lens staged: one sequence
    seq = torch.where(real, seq, -1)
    causal = rows[None, :] <= rows[:, None]
    same = (seq[:, None] == seq[None, :]) & (seq[:, None] >= 0)
    return ((same & causal) | (rows[:, None] == rows[None, :]))[None, None]


def prefill_forward(model):
    """``forward(views) -> [T, H]``: the language model of ``model`` over the slab, capturable.

    ``views`` is ``buffers.registry.views(bucket)``. It reads ``input_embeds [T, W]`` (column
    block 0, ``[:, :H]``, enters layer 0; for Qwen3-VL, block ``i + 1`` is added to the
    hidden states after decoder layer ``i < k``, whole blocks, text rows carrying zeros),
    ``mrope_positions [3, T]`` for the VLMs (``positions [T]`` for decoder LMs), and
    ``seq_lens``, ``extend_start_loc``, ``num_tokens_non_padded`` for the packed mask
    (:func:`packed_attention_mask`). Buffers of one request a batch (``max_batch_size=1``) with
    sdpa attention need no mask: SDPA runs causal. Returns the last hidden states after the final
    norm, ``[T, H]``, in the model's dtype. No KV cache is read or written. Nothing in it changes
    while a stream is capturing, so a replay runs the eager forward's kernels (docs/graphs.md).

    Raises ``TypeError``/:class:`WidthContractError` as :func:`input_embeds_width` does, and
    ``ValueError`` for an attention implementation other than sdpa or eager (flash attention
    would take packing from ``position_ids`` and ignore the mask) or for sliding-window layers.
    """
    fam = family_of(model, "prefill_forward")
    lm, config = fam.language_model, fam.text_config
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in _ATTENTION:
        raise ValueError(f"slabstage.hf.prefill_forward: attention implementation {impl!r} is not supported; "
                         f"load the model with attn_implementation='sdpa' (or 'eager')")
    kinds = set(getattr(config, "layer_types", None) or ("full_attention",))
    if kinds != {"full_attention"}:
        raise ValueError(f"slabstage.hf.prefill_forward: {type(model).__name__} has layer types {sorted(kinds)}; "
                         f"only full-attention layers are supported (no sliding window)")
    hidden, levels, mrope = fam.hidden_size, fam.deepstack_levels, fam.is_vlm
    layers, norm, rotary = lm.layers, lm.norm, lm.rotary_emb
    dtype = next(lm.parameters()).dtype
    additive = impl == "eager"  # eager attention adds its mask; sdpa takes a bool one as HF's own masks are

    def forward(views: dict) -> torch.Tensor:
        embeds = views["input_embeds"]
        T = embeds.shape[0]
        h = embeds[:, :hidden].to(dtype)[None]  # a no-op view when the slab has the model's dtype
        if mrope:
            position_ids = views["mrope_positions"][:, None, :]  # [3, 1, T]
        else:
            position_ids = views["positions"][None]  # [1, T]
        cos_sin = rotary(h, position_ids)
        if views["seq_lens"].shape[0] == 1 and not additive:
            # buffers of one request a batch: one sequence from row 0, so SDPA's own causal mask is exact for
            # every real row (padding rows come last and only see rows before them), with no mask to build
            # and the fastest kernel. Decided from a shape: the same in eager runs and in the graph.
            mask = None
        else:
            mask = packed_attention_mask(views["seq_lens"], views["extend_start_loc"],
                                         views["num_tokens_non_padded"], T)
            if additive:
                mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                    ~mask, torch.finfo(dtype).min)
        for i, layer in enumerate(layers):
            h = layer(h, attention_mask=mask, position_embeddings=cos_sin)
            if isinstance(h, tuple):  # older layer APIs return (hidden, ...)
                h = h[0]
            if i < levels:  # DeepStack level i: zeros on text rows, so a whole-block add is exact
                h = h + embeds[:, hidden * (i + 1):hidden * (i + 2)].to(dtype)[None]
        return norm(h)[0]

    return forward
