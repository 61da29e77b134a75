"""A toy multimodal decoder that reads the ``input_embeds`` slab in the three ways real models do.

``ToyMultimodalModel(variant)``:

- ``"plain"``: the slab is ``hidden_size`` wide, the hidden state is the slab row;
- ``"deepstack"`` (Qwen3-VL style): the encoder emits ``hidden_size * (1 + k)`` columns per media row; the model
  declares that width, reads the first ``hidden_size`` columns as its input and adds column block ``i + 1`` to
  the hidden state after layer ``i < k`` (text rows carry zeros there);
- ``"hc"`` (hyper-connections): the residual stream is ``hc_mult`` parallel copies, so the slab is
  ``hidden_size * hc_mult`` wide and every source row is repeated across the copies (``expand="repeat"``).

The forward takes the runner's ``views`` dict and has static shapes and no host synchronisation, so
:class:`slabstage.PrefillGraphRunner` can capture it. Attention is causal within each packed sequence; a sequence
starts where its position is 0, so padding rows (zero embedding, position 0) after the batch are sequences of
their own and never reach a real row.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_choice, check_int, check_real
from ..graph_runner.batch import PrefillBatch
from ..staging.media_index import media_index_from_spans
from ..staging.width import resolve_input_embeds_width

__all__ = ["ToyMultimodalModel", "VARIANTS", "make_batch", "packed_causal_mask"]

VARIANTS = ("plain", "deepstack", "hc")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # a zero (padding) row stays zero
    return (xf * weight.float()).to(x.dtype)


def packed_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """``bool[T, T]``: query ``q`` sees key ``k`` when both are in one sequence and ``k <= q``.

    A sequence starts at every row whose position is 0 (``seq = cumsum(positions == 0)``).
    Built with fixed-shape tensor ops only: no host sync, capturable in a CUDA graph.
    """
    T = positions.shape[0]
    seq = torch.cumsum(positions == 0, 0)
    rows = torch.arange(T, device=positions.device)
    return (seq[:, None] == seq[None, :]) & (rows[None, :] <= rows[:, None])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split layout. x: [heads, T, head_dim]; cos/sin: [T, head_dim / 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _Layer(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(hidden))
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)


class ToyMultimodalModel(nn.Module):
    """A small random-weight decoder with a stub media encoder; see the module docstring.

    Args:
        variant: ``"plain"``, ``"deepstack"`` or ``"hc"``.
        hidden_size, vocab_size, num_layers, num_heads: the decoder's shape
            (``hidden_size / num_heads`` must be even, for rotary embeddings).
        deepstack_k: media column blocks past the first that feed layers ``0..k-1``
            (deepstack only; ``1 <= k <= num_layers``).
        hc_mult: copies of the residual stream (hc only).
        patch_dim: width of the patches :meth:`encode` takes.
        seed: every weight is drawn from ``torch.Generator().manual_seed(seed)``.

    Attributes: ``embed_width`` (the slab width, from
    :func:`slabstage.resolve_input_embeds_width`), ``expand`` (the staging policy
    for sources narrower than the slab), ``media_width`` (columns per media row),
    ``embed_tokens`` (the ``[vocab, hidden]`` table), ``media_token_id``.
    Deepstack and hc declare ``input_embeds_hidden_size``; plain declares nothing.
    """

    def __init__(self, variant: str = "plain", *, hidden_size: int = 256, vocab_size: int = 1000,
                 num_layers: int = 2, num_heads: int = 4, deepstack_k: int = 2, hc_mult: int = 4,
                 patch_dim: int = 48, seed: int = 0, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.variant = check_choice("variant", variant, VARIANTS)
        self.hidden_size = H = check_int("hidden_size", hidden_size, lo=1)
        self.vocab_size = check_int("vocab_size", vocab_size, lo=1)
        self.num_layers = check_int("num_layers", num_layers, lo=1)
        self.num_heads = check_int("num_heads", num_heads, lo=1)
        self.patch_dim = check_int("patch_dim", patch_dim, lo=1)
        if H % self.num_heads or (H // self.num_heads) % 2:
            raise ValueError(f"hidden_size {H} / num_heads {self.num_heads} must be an even head size")
        self.head_dim = H // self.num_heads
        self.deepstack_k = check_int("deepstack_k", deepstack_k, lo=1) if variant == "deepstack" else 0
        if self.deepstack_k > self.num_layers:
            raise ValueError(f"deepstack_k={deepstack_k} feeds more layers than num_layers={num_layers}")
        self.hc_mult = check_int("hc_mult", hc_mult, lo=1) if variant == "hc" else 1
        self.media_token_id = self.vocab_size - 1
        self.rope_theta = 10000.0

        if variant == "deepstack":
            self.input_embeds_hidden_size = H * (1 + self.deepstack_k)
        elif variant == "hc":
            self.input_embeds_hidden_size = H * self.hc_mult
        self.embed_width = resolve_input_embeds_width(self, H)
        self.media_width = H * (1 + self.deepstack_k)
        self.expand = "repeat" if variant == "hc" else "zeros"

        self.embed_tokens = nn.Embedding(self.vocab_size, H)
        self.enc_in = nn.Linear(self.patch_dim, H, bias=False)
        self.enc_out = nn.Linear(H, self.media_width, bias=False)
        self.layers = nn.ModuleList(_Layer(H, 2 * H) for _ in range(self.num_layers))
        self.final_norm = nn.Parameter(torch.ones(H))
        # hc: how much of each layer's update each stream takes
        self.hc_scale = nn.Parameter(torch.ones(self.num_layers, self.hc_mult))
        self._init_weights(seed)
        self.requires_grad_(False)
        self.to(device=device, dtype=dtype)

    def _init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name == "embed_tokens.weight":
                    p.copy_(torch.randn(p.shape, generator=g))
                elif name.endswith("norm"):
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
                elif name == "hc_scale":
                    p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
                else:  # Linear weights [out, in]
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def encode(self, patches: torch.Tensor) -> torch.Tensor:
        """Stub media encoder: ``[P, patch_dim]`` -> ``[P, media_width]`` in the model's dtype and device."""
        if not isinstance(patches, torch.Tensor) or patches.dim() != 2 or patches.shape[1] != self.patch_dim:
            raise ValueError(f"patches must be [P, {self.patch_dim}], got {getattr(patches, 'shape', patches)!r}")
        x = patches.to(device=self.device, dtype=self.dtype)
        return self.enc_out(F.gelu(self.enc_in(x)))

    # -- decoder -------------------------------------------------------------------------
    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.head_dim // 2
        exponent = torch.arange(half, device=positions.device, dtype=torch.float32) / half
        angles = positions.float()[:, None] * self.rope_theta ** (-exponent)[None, :]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def _update(self, layer: _Layer, x: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        """What one pre-norm decoder layer adds to the residual stream ``x`` ([T, H])."""
        T, nh, hd = x.shape[0], self.num_heads, self.head_dim
        q, k, v = layer.qkv(_rms_norm(x, layer.attn_norm)).view(T, 3, nh, hd).permute(1, 2, 0, 3).unbind(0)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attn = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
        a = layer.out(attn.transpose(0, 1).reshape(T, self.hidden_size))
        gate, up = layer.gate_up(_rms_norm(x + a, layer.mlp_norm)).chunk(2, dim=-1)
        return a + layer.down(F.silu(gate) * up)

    def forward(self, views: dict) -> torch.Tensor:
        """``views["input_embeds"]`` ``[T, embed_width]``, ``views["positions"]`` ``[T]`` -> ``[T, H]``.

        Returns the final RMS-normed hidden state. Shape checks only on the host;
        no data-dependent shapes and no host sync.
        """
        embeds, positions = views["input_embeds"], views["positions"]
        T, H = embeds.shape[0], self.hidden_size
        if embeds.dim() != 2 or embeds.shape[1] != self.embed_width or tuple(positions.shape) != (T,):
            raise ValueError(f"{type(self).__name__}({self.variant}) expects input_embeds [T, {self.embed_width}] "
                             f"and positions [T]; got {tuple(embeds.shape)} and {tuple(positions.shape)}")
        mask = packed_causal_mask(positions)[None, None]
        cos, sin = self._rotary(positions)
        if self.variant == "hc":
            streams = embeds.view(T, self.hc_mult, H)
            for i, layer in enumerate(self.layers):
                update = self._update(layer, streams.mean(dim=1), cos, sin, mask)
                streams = streams + update[:, None, :] * self.hc_scale[i][None, :, None]
            return _rms_norm(streams.sum(dim=1), self.final_norm)
        h = embeds[:, :H]
        for i, layer in enumerate(self.layers):
            h = h + self._update(layer, h, cos, sin, mask)
            if i < self.deepstack_k:
                h = h + embeds[:, H * (i + 1):H * (i + 2)]
        return _rms_norm(h, self.final_norm)

    def extra_repr(self) -> str:
        return (f"variant={self.variant!r}, hidden_size={self.hidden_size}, embed_width={self.embed_width}, "
                f"expand={self.expand!r}, layers={self.num_layers}, heads={self.num_heads}")


def make_batch(model: ToyMultimodalModel, num_tokens: int, *, media_fraction: float = 0.5, num_seqs: int = 1,
               generator: torch.Generator | None = None, device: torch.device | str | None = None) -> PrefillBatch:
    """A random :class:`PrefillBatch` of ``num_tokens`` tokens in ``num_seqs`` packed sequences.

    Sequence lengths are a random split of ``num_tokens`` (each >= 1); positions
    restart at 0 per sequence. Each sequence holds one contiguous media span of
    ``round(len * media_fraction)`` rows at a random offset; media rows come from
    ``model.encode`` of random patches (on the model's device) and are placed with
    :func:`slabstage.media_index_from_spans`. Text ids are uniform in ``[0, vocab)``;
    media rows carry ``model.media_token_id`` (the kernels ignore ids there).

    ``device``: where the integer inputs live; ``None`` keeps them on the host,
    as a scheduler builds them (the runner packs and copies them). Every draw
    comes from ``generator`` (a CPU ``torch.Generator``; default seed 0).
    """
    n = check_int("num_tokens", num_tokens, lo=1)
    b = check_int("num_seqs", num_seqs, lo=1)
    if b > n:
        raise ValueError(f"num_seqs={b} exceeds num_tokens={n}: every sequence needs a token")
    media_fraction = check_real("media_fraction", media_fraction, lo=0, hi=1)
    g = torch.Generator().manual_seed(0) if generator is None else generator
    int_device = torch.device("cpu") if device is None else torch.device(device)

    cuts = (torch.randperm(n - 1, generator=g)[: b - 1] + 1).sort().values.tolist()
    starts = [0, *cuts]
    lens = [end - start for start, end in zip(starts, [*cuts, n])]
    positions = torch.cat([torch.arange(length) for length in lens])
    input_ids = torch.randint(0, model.vocab_size, (n,), generator=g)
    spans, num_media = [], 0
    for start, length in zip(starts, lens):
        m = round(length * media_fraction)
        if m == 0:
            continue
        dst = start + int(torch.randint(0, length - m + 1, (1,), generator=g))
        spans.append((dst, m, num_media))
        input_ids[dst:dst + m] = model.media_token_id
        num_media += m
    patches = torch.randn(num_media, model.patch_dim, generator=g)

    media = media_index = None
    if num_media:
        with torch.no_grad():
            media = model.encode(patches)
        media_index = media_index_from_spans(spans, n, device=int_device, num_media_rows=num_media)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    extend_start_loc = torch.tensor(starts, dtype=torch.int32)
    return PrefillBatch(
        input_ids=input_ids.to(int_device), positions=positions.to(int_device), table=model.embed_tokens.weight,
        seq_lens=seq_lens.to(int_device), extend_start_loc=extend_start_loc.to(int_device),
        media=media, media_index=media_index, expand=model.expand)
