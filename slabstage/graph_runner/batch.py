"""PrefillBatch: what one prefill step hands the runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PrefillBatch"]


def _need_tensor(name: str, t: object, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"PrefillBatch.{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"PrefillBatch.{name} must be {dims}-D, got shape {tuple(t.shape)}")


@dataclass
class PrefillBatch:
    """One prefill batch of ``n`` tokens.

    Integer inputs may live on the host (as a scheduler builds them) or on the
    device; ``table`` and ``media`` live on the buffers' device. ``media_index[r]
    >= 0`` makes row ``r`` a media row (see :func:`slabstage.stage_embeddings`).
    ``vocab_range``, ``vocab_size`` and ``media_owner`` are for vocab-parallel
    (tensor-parallel) staging.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    table: torch.Tensor
    out_cache_loc: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None
    media: torch.Tensor | None = None
    media_index: torch.Tensor | None = None
    expand: str = "zeros"
    text_scale: float | None = None
    vocab_range: tuple[int, int] | None = None
    vocab_size: int | None = None
    media_owner: bool = True

    def __post_init__(self) -> None:
        _need_tensor("input_ids", self.input_ids, 1)
        n = self.input_ids.shape[0]
        if n == 0:
            raise ValueError("PrefillBatch is empty: input_ids has 0 tokens")
        _need_tensor("positions", self.positions, 1)
        _need_tensor("table", self.table, 2)
        for name in ("out_cache_loc", "media_index"):
            t = getattr(self, name)
            if t is not None:
                _need_tensor(name, t, 1)
        for name in ("positions", "out_cache_loc", "media_index"):
            t = getattr(self, name)
            if t is not None and t.shape[0] != n:
                raise ValueError(f"PrefillBatch.{name} has {t.shape[0]} entries for {n} tokens")
        if self.mrope_positions is not None:
            _need_tensor("mrope_positions", self.mrope_positions, 2)
        if (self.seq_lens is None) != (self.extend_start_loc is None):
            raise ValueError("PrefillBatch: give seq_lens and extend_start_loc together, or neither")
        if self.media is not None:
            _need_tensor("media", self.media, 2)
            if self.media_index is None:
                raise ValueError("PrefillBatch.media was given without media_index")
        if self.expand not in ("zeros", "repeat"):
            raise ValueError(f'PrefillBatch.expand must be "zeros" or "repeat", got {self.expand!r}')

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
