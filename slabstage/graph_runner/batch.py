"""PrefillBatch: what one prefill step hands the runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from ..checks import FLOAT_DTYPES, check_choice, check_tensor
from ..kernels.plan import check_token_sources

__all__ = ["PrefillBatch", "Media"]

# one 2-D tensor, or items laid end to end: each a 2-D tensor or a tuple of column blocks
Media = Union[torch.Tensor, Sequence[Union[torch.Tensor, tuple]]]


@dataclass
class PrefillBatch:
    """One prefill batch of ``n`` tokens.

    Integer inputs may live on the host (as a scheduler builds them) or on the
    device; ``table`` lives on the buffers' device. ``media`` is one 2-D tensor or
    a list of items (see :func:`slabstage.stage_embeddings`); ``media_index[r] >= 0``
    makes row ``r`` a media row. ``mrope_positions`` is ``[3, n]``.
    ``vocab_range``, ``vocab_size`` and ``media_owner`` are for vocab-parallel
    (tensor-parallel) staging.

    Construction checks what needs no buffers (kinds, ranks, lengths); the runner
    checks the rest, against its buffers, before it writes anything.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    table: torch.Tensor
    out_cache_loc: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None
    media: Media | None = None
    media_index: torch.Tensor | None = None
    expand: str = "zeros"
    text_scale: float | None = None
    vocab_range: tuple[int, int] | None = None
    vocab_size: int | None = None
    media_owner: bool = True

    def __post_init__(self) -> None:
        _, n, _ = check_token_sources(
            None, input_ids=self.input_ids, positions=self.positions, out_cache_loc=self.out_cache_loc,
            mrope_positions=self.mrope_positions, seq_lens=self.seq_lens, extend_start_loc=self.extend_start_loc)
        if n == 0:
            raise ValueError("PrefillBatch is empty: input_ids has 0 tokens")
        check_tensor("table", self.table, dtypes=FLOAT_DTYPES, dims=2)
        if self.media_index is not None:
            check_tensor("media_index", self.media_index, shape=(n,))
        if (self.seq_lens is None) != (self.extend_start_loc is None):
            raise ValueError("PrefillBatch: give seq_lens and extend_start_loc together, or neither")
        if isinstance(self.media, torch.Tensor):
            check_tensor("media", self.media, dtypes=FLOAT_DTYPES, dims=2)
        if self.media is not None and self.media_index is None:
            raise ValueError("PrefillBatch.media was given without media_index")
        check_choice("expand", self.expand, ("zeros", "repeat"))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
