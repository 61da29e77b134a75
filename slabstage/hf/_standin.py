"""Stand-in for prefill_forward(model, cache=) until the paged forward lands: eager, CPU, a [T, S] mask."""

from __future__ import annotations

import torch

from ._family import family_of


class _Writer:
    def __init__(self, cache, loc, mask):
        self.cache, self.loc, self.mask = cache, loc, mask

    def update(self, key, value, layer_idx, *args, **kwargs):
        k, v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k.index_copy_(0, self.loc, key[0].transpose(0, 1).to(k.dtype))
        v.index_copy_(0, self.loc, value[0].transpose(0, 1).to(v.dtype))
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]


def standin_forward(model, cache):
    fam = family_of(model, "prefill_forward")
    lm = fam.language_model
    hidden, levels, mrope = fam.hidden_size, fam.deepstack_levels, fam.is_vlm
    dtype = next(lm.parameters()).dtype

    def forward(views):
        embeds = views["input_embeds"]
        T = embeds.shape[0]
        h = embeds[:, :hidden].to(dtype)[None]
        position_ids = views["mrope_positions"][:, None, :] if mrope else views["positions"][None]
        cos_sin = lm.rotary_emb(h, position_ids)
        rows = torch.arange(T)
        lens, starts = views["seq_lens"].long(), views["extend_start_loc"].long()
        inside = (rows[None] >= starts[:, None]) & (rows[None] < (starts + lens)[:, None])  # [B, T]
        b = inside.long().argmax(0)
        real = inside.any(0) & (rows < views["num_tokens_non_padded"].long())
        p = views["prefix_lens"].long()[b] + rows - starts[b]  # the row's token index
        table = cache.req_to_token[views["req_indices"].long()[b]].long()  # [T, C]
        valid = (torch.arange(table.shape[1])[None] <= p[:, None]) & real[:, None]
        S = cache.k[0].shape[0]
        mask = torch.zeros(T, S, dtype=torch.bool).scatter_(1, table, valid)
        mask[:, 0] |= ~real
        loc = views["out_cache_loc"].long()
        writer = _Writer(cache, loc, mask[None, None])
        for i, layer in enumerate(lm.layers):
            h = layer(h, attention_mask=mask[None, None], position_embeddings=cos_sin, past_key_values=writer)
            if isinstance(h, tuple):
                h = h[0]
            if i < levels:
                h = h + embeds[:, hidden * (i + 1):hidden * (i + 2)].to(dtype)[None]
        return lm.norm(h)[0]

    return forward
