"""PrefillBatch: what one prefill step hands the runner."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Sequence, Union

import torch

from ..staging.validate import DEFAULTS, check_sources
from ..staging.slots import SOURCE_SLOTS

__all__ = ["PrefillBatch", "Media"]

# one 2-D tensor, or items laid end to end: each a 2-D tensor or a tuple of column blocks
Media = Union[torch.Tensor, Sequence[Union[torch.Tensor, tuple]]]


def _slot_fields(cls):
    """Give ``cls`` one field per integer slot of :data:`~slabstage.staging.slots.SLOTS` (before ``@dataclass``
    reads its annotations): the required slots first, then its own fields without a default, then the other
    slots (default None), then its own fields with a default."""
    own = dict(cls.__dict__.get("__annotations__", {}))
    required = [name for name in own if not hasattr(cls, name)]
    cls.__annotations__ = (
        {s.name: "torch.Tensor" for s in SOURCE_SLOTS if s.required} | {name: own[name] for name in required}
        | {s.name: "torch.Tensor | None" for s in SOURCE_SLOTS if not s.required}
        | {name: a for name, a in own.items() if name not in required})
    for spec in SOURCE_SLOTS:
        if not spec.required:
            setattr(cls, spec.name, None)
    return cls


@dataclass
@_slot_fields
class PrefillBatch:
    """One prefill batch of ``n`` tokens.

    Integer inputs (one field per integer slot of :data:`slabstage.staging.slots.SLOTS`)
    may live on the host (as a scheduler builds them) or on the device; ``table`` lives
    on the buffers' device. ``media`` is one 2-D tensor or a list of items (see
    :func:`slabstage.stage_embeddings`); ``media_index[r] >= 0`` makes row ``r`` a
    media row. ``mrope_positions`` is ``[3, n]``. ``vocab_range``, ``vocab_size`` and
    ``media_owner`` are for vocab-parallel (tensor-parallel) staging.

    Construction checks what needs no buffers (kinds, ranks, lengths); the runner
    checks everything again, against its buffers, before it writes anything.
    """

    # (one field per integer slot comes from SLOTS: input_ids, positions, then after table out_cache_loc,
    # mrope_positions, seq_lens, extend_start_loc, prefix_lens, req_indices, each None when not given)
    table: torch.Tensor
    media: Media | None = None
    media_index: torch.Tensor | None = None
    expand: str = "zeros"
    text_scale: float | None = None
    vocab_range: tuple[int, int] | None = None
    vocab_size: int | None = None
    media_owner: bool = True

    def __post_init__(self) -> None:
        check_sources(self)
        if self.input_ids.shape[0] == 0:
            raise ValueError("PrefillBatch is empty: input_ids has 0 tokens")
        if (self.seq_lens is None) != (self.extend_start_loc is None):
            raise ValueError("PrefillBatch: give seq_lens and extend_start_loc together, or neither")

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


# the defaults the staging path gives a field a caller leaves out are PrefillBatch's own
assert all(DEFAULTS[f.name] == f.default for f in fields(PrefillBatch) if f.default is not MISSING), \
    "PrefillBatch's defaults differ from slabstage.staging.validate.DEFAULTS"
