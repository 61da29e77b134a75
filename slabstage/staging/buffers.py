"""The preallocated token-axis buffers of one prefill engine instance."""

from __future__ import annotations

import torch

from ..checks import FLOAT_DTYPES, INT32_MAX, INT_DTYPES, check_int
from ..kernels.layout import ERROR_FIRST_ROW, ERROR_WORD_SIZE, NO_ROW
from .registry import BufferRegistry
from .slots import REQUESTS, ROWS, SLOTS, TOKENS, SlotSpec

__all__ = ["StagingBuffers", "ERROR_WORD_SIZE", "new_error_word"]


def new_error_word(device: torch.device | str) -> torch.Tensor:
    """A fresh device error word (:mod:`slabstage.staging.errors`): a normal tensor even when made under
    ``torch.inference_mode``, so it is written, read and reset in and outside it."""
    with torch.inference_mode(False):
        word = torch.zeros(ERROR_WORD_SIZE, dtype=torch.int32, device=device)
        word[ERROR_FIRST_ROW] = NO_ROW  # a device fill, no host copy: safe under sync debug mode
    return word


def _size(name: str, value: object) -> int:
    """A positive size of at most ``INT32_MAX`` (ValueError otherwise, as allocate documents)."""
    try:
        return check_int(name, value, lo=1, hi=INT32_MAX)
    except (TypeError, ValueError):
        too_big = f" (at most {INT32_MAX})" if isinstance(value, int) and value > INT32_MAX else ""
        raise ValueError(f"{name} must be a positive int, got {value!r}{too_big}") from None


class StagingBuffers:
    """Every token-axis tensor of the prefill path, allocated once at capacity.

    Slots (all in :attr:`registry`):

    ================== ========================== ======================= ==========
    name               shape                      dtype                   token axis
    ================== ========================== ======================= ==========
    input_ids          [max_num_tokens]           int64                   0
    positions          [max_num_tokens]           int64                   0
    out_cache_loc      [max_num_tokens]           cache_loc_dtype         0
    input_embeds       [max_num_tokens, width]    embed_dtype, stride     0
                                                  (width, 1)
    mrope_positions    [3, max_num_tokens]        int64 (mrope=True)      1
    seq_lens           [max_batch_size]           int32                   none
    extend_start_loc   [max_batch_size]           int32                   none
    prefix_lens        [max_batch_size]           int32                   none
    req_indices        [max_batch_size]           int32                   none
    num_tokens_non_padded [1]                     int32                   none
    ================== ========================== ======================= ==========

    One attribute per slot of :data:`~slabstage.staging.slots.SLOTS` (``buffers.seq_lens``), plus
    ``input_embeds``. Padded rows get each slot's pad value: zeros, except ``num_tokens_non_padded``
    (written, never padded).
    :attr:`errors` is the device error word the staging kernels report into.
    Attribute access (``buffers.input_embeds``) reads the registry, so a slot
    replaced there is what every reader sees.
    """

    def __init__(self, registry: BufferRegistry, *, max_num_tokens: int, max_batch_size: int,
                 errors: torch.Tensor) -> None:
        self.registry = registry
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.errors = errors
        self._stagers: dict = {}  # slabstage.staging.stager.Stager.for_buffers keeps its stagers here

    @classmethod
    def allocate(cls, *, max_num_tokens: int, max_batch_size: int, embed_width: int, embed_dtype: torch.dtype,
                 device: torch.device | str, cache_loc_dtype: torch.dtype = torch.int64,
                 mrope: bool = False) -> "StagingBuffers":
        """Allocate every slot once; raise ``ValueError`` on an invalid argument.

        Sizes are positive ints of at most ``2**31 - 1``; ``embed_dtype`` is one that the
        staging kernels write (float16, bfloat16 or float32). Every tensor is a normal
        tensor even when this runs under ``torch.inference_mode``, so the buffers work the
        same in and outside inference mode, on the Triton and the reference path.
        """
        T = _size("max_num_tokens", max_num_tokens)
        B = _size("max_batch_size", max_batch_size)
        W = _size("embed_width", embed_width)
        if not isinstance(embed_dtype, torch.dtype) or embed_dtype not in FLOAT_DTYPES:
            raise ValueError(f"embed_dtype must be a floating torch.dtype that staging writes "
                             f"(float16, bfloat16 or float32), got {embed_dtype!r}")
        if not isinstance(cache_loc_dtype, torch.dtype) or cache_loc_dtype not in INT_DTYPES:
            raise ValueError(f"cache_loc_dtype must be torch.int32 or torch.int64, got {cache_loc_dtype!r}")
        if not isinstance(mrope, bool):
            raise ValueError(f"mrope must be a bool, got {mrope!r}")
        try:
            device = torch.device(device)
            torch.empty(0, device=device)
        except (RuntimeError, TypeError, AssertionError) as e:  # Assertion: torch without CUDA
            raise ValueError(f"device {device!r} is not usable: {e}") from None

        dtypes = {"out_cache_loc": cache_loc_dtype}
        switches = {"mrope": mrope}
        with torch.inference_mode(False):  # normal tensors, even when called under inference mode
            reg = BufferRegistry()
            for spec in SLOTS:
                if spec.switch is not None and not switches[spec.switch]:
                    continue
                if spec.kind != TOKENS and "input_embeds" not in reg:  # the slab after the token slots
                    reg.register("input_embeds", torch.zeros(T, W, dtype=embed_dtype, device=device))
                shape, axis = {TOKENS: ((T,), 0), ROWS: ((spec.rows, T), 1), REQUESTS: ((B,), None)}.get(
                    spec.kind, ((1,), None))
                reg.register(spec.name, torch.zeros(shape, dtype=dtypes.get(spec.name, spec.dtype), device=device),
                             token_axis=axis, pad=spec.pad)
        return cls(reg, max_num_tokens=T, max_batch_size=B, errors=new_error_word(device))

    input_embeds = property(lambda self: self.registry["input_embeds"])

    def slots_and_fills(self) -> tuple[list, list]:
        """Per row of :data:`~slabstage.staging.slots.SLOTS`: the slot's tensor, and the value its padded rows get
        (None: the buffers have no such slot, or its rows are not padded)."""
        reg = self.registry
        return ([reg[s.name] if s.name in reg else None for s in SLOTS],
                [reg.slot(s.name).fill_value if s.name in reg else None for s in SLOTS])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def embed_width(self) -> int:
        return self.input_embeds.shape[1]

    def __getstate__(self) -> dict:
        """Pickling and ``copy.deepcopy`` carry the slots and the error word; a stager (pinned ring, device
        block) is made afresh for the copy when it first stages."""
        state = self.__dict__.copy()
        state["_stagers"] = {}
        return state

    def __repr__(self) -> str:
        e = self.input_embeds
        return (f"StagingBuffers(max_num_tokens={self.max_num_tokens}, max_batch_size={self.max_batch_size}, "
                f"embed_width={e.shape[1]}, embed_dtype={e.dtype}, device={e.device}, "
                f"slots={list(self.registry)})")


def _slot_property(spec: SlotSpec) -> property:
    """``buffers.<slot>``: the slot's tensor, read through the registry (None for a switched-off slot)."""
    name = spec.name
    if spec.switch is None:
        return property(lambda self: self.registry[name], doc=f"The {name!r} slot.")
    return property(lambda self: self.registry[name] if name in self.registry else None,
                    doc=f"The {name!r} slot (None unless allocated with {spec.switch}=True).")


for _spec in SLOTS:  # one property per slot of slabstage.staging.slots.SLOTS
    setattr(StagingBuffers, _spec.name, _slot_property(_spec))
