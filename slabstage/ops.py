"""The staging ops as PyTorch custom ops, callable inside torch.compile without a graph break.

``torch.ops.slabstage.stage_embeddings`` and ``torch.ops.slabstage.stage_token_inputs``
declare the tensors they write (``mutates_args``) and have fake implementations,
so Dynamo traces through them and Inductor keeps them as opaque, ordered calls.
``stage_token_inputs``'s schema is derived from the slot list
(:data:`slabstage.staging.slots.SLOTS`): one destination and one source per slot.
The Python wrappers :func:`stage_embeddings_op` and :func:`stage_token_inputs_op`
take the same arguments as the plain functions and give the same answers: each
op runs the one validation, and the wrappers first refuse, with the same errors,
values the op's schema cannot carry. An op call stages as the plain function does (one copy, one launch, no
host sync); inside a graph the caller captures, each call gets a device parameter record of its own, kept for
the life of the process.
"""

from __future__ import annotations

import inspect
from typing import List, Optional

import torch

from .checks import check_bool, check_choice, check_int, check_not_meta, check_real, check_tensor, vocab_bounds
from .staging.errors import check_error_word, default_error_word
from .staging.stager import Inputs
from .staging.op_stagers import slots_destinations
from .staging.stage_embeddings import stage_embeddings
from .staging.buffers import StagingBuffers
from .staging.slots import SLOTS, SOURCE_SLOTS

__all__ = ["stage_embeddings_op", "stage_token_inputs_op", "HAS_CUSTOM_OPS"]

HAS_CUSTOM_OPS = hasattr(torch.library, "custom_op")  # torch >= 2.4


def _op(qualname: str, fn, params: list, mutates: tuple):
    """A custom op whose schema is ``params`` (name, annotation), with a no-op fake implementation."""
    sig = inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=a)
                             for name, a in params], return_annotation=None)
    fn.__signature__ = sig
    names = [name for name, _ in params]
    op = torch.library.custom_op(qualname, fn, mutates_args=mutates)

    def fake(*args, **kwargs) -> None:  # (meta tensors reach this too: refused as the op refuses them)
        check_not_meta(fn, names, args + tuple(kwargs[name] for name in names[len(args):]))

    fake.__signature__ = sig
    op.register_fake(fake)
    return op


_T, _OT = torch.Tensor, Optional[torch.Tensor]
_SOURCE_NAMES = tuple(s.name for s in SOURCE_SLOTS)

if HAS_CUSTOM_OPS:
    def _embeddings(slab, input_ids, table, media, media_index, errors, pad_to, expand, text_scale, vocab_start,
                    vocab_end, vocab_size, media_owner) -> None:
        stage_embeddings(slab, input_ids, table, media=media, media_index=media_index, pad_to=pad_to, expand=expand,
                         text_scale=text_scale, vocab_range=(vocab_start, vocab_end), vocab_size=vocab_size,
                         media_owner=media_owner, errors=errors)

    _op("slabstage::stage_embeddings", _embeddings,
        [("slab", _T), ("input_ids", _T), ("table", _T), ("media", _OT), ("media_index", _OT), ("errors", _T),
         ("pad_to", int), ("expand", str), ("text_scale", Optional[float]), ("vocab_start", int), ("vocab_end", int),
         ("vocab_size", int), ("media_owner", bool)], ("slab", "errors"))

    def _token_inputs(*args) -> None:
        k = len(SLOTS)
        dsts, errors = args[:k], args[k]
        sources = args[k + 1:k + 1 + len(SOURCE_SLOTS)]
        pad_to, fills, pads = args[k + 1 + len(SOURCE_SLOTS):]
        dst, stager = slots_destinations(dsts, [f if p else None for f, p in zip(fills, pads)], errors)
        stager.stage_into(dst, Inputs(**dict(zip(_SOURCE_NAMES, sources))), pad_to)

    _op("slabstage::stage_token_inputs", _token_inputs,
        [(f"{s.name}_dst", _OT) for s in SLOTS] + [("errors", _T)] + [(s.name, _OT) for s in SOURCE_SLOTS]
        + [("pad_to", int), ("fills", List[int]), ("pads", List[bool])],
        tuple(f"{s.name}_dst" for s in SLOTS) + ("errors",))


_BELOW = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)
_BUMP = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def _call(op, mutated, *args) -> None:
    """``op(*args)``. Outside torch.compile, where no argument requires grad, the call starts below the
    Autograd and ADInplaceOrView keys, and ``mutated``'s version counters are bumped here, as the latter's
    kernel would bump them (its only work for these ops): the same effect, without torch's per-argument
    Python wrappers (tens of µs a call). Dispatch modes, tensor subclasses and the op's kernels see the call
    as before."""
    if (_BELOW is None or _BUMP is None or _COMPILING()
            or (torch.is_grad_enabled() and any(type(a) is not torch.Tensor or a.requires_grad
                                                for a in args if isinstance(a, torch.Tensor)))):
        op(*args)
        return
    with _BELOW():
        op(*args)
    for t in mutated:  # (after the call, as torch bumps them: a call the op refuses writes nothing)
        if not t.is_inference():
            _BUMP(t)


def _need_ops() -> None:
    if not HAS_CUSTOM_OPS:
        raise RuntimeError("slabstage custom ops need torch >= 2.4 (torch.library.custom_op)")


def stage_embeddings_op(slab, input_ids, table, *, media=None, media_index=None, pad_to=None, expand="zeros",
                        text_scale=None, vocab_range=None, vocab_size=None, media_owner=True, errors=None):
    """:func:`slabstage.stage_embeddings` through ``torch.ops.slabstage.stage_embeddings`` (media as one
    2-D tensor: the op's schema holds no list of items)."""
    _need_ops()
    check_tensor("slab", slab)
    check_tensor("input_ids", input_ids, dims=1)
    check_tensor("table", table, dims=2)
    if media is not None and not isinstance(media, torch.Tensor):
        raise TypeError("stage_embeddings_op takes media as one 2-D tensor (the custom op's schema); "
                        "stage media items with slabstage.stage_embeddings")
    errors = default_error_word(slab.device) if errors is None else errors
    check_error_word(errors, slab.device)
    pad_to = input_ids.shape[0] if pad_to is None else check_int("pad_to", pad_to)
    check_choice("expand", expand, ("zeros", "repeat"))
    if text_scale is not None and not _COMPILING():  # (traced, a scale is a symbol: the op checks its value)
        check_real("text_scale", text_scale)
    check_bool("media_owner", media_owner)
    start, end, size = vocab_bounds(vocab_range, vocab_size, table.shape[0])
    _call(torch.ops.slabstage.stage_embeddings, (slab, errors), slab, input_ids, table, media, media_index, errors,
          pad_to, expand, text_scale, start, end, size, media_owner)
    return slab


def stage_token_inputs_op(buffers: StagingBuffers, *, pad_to: int, **sources) -> None:
    """:func:`slabstage.stage_token_inputs` through ``torch.ops.slabstage.stage_token_inputs``; errors go
    to ``buffers.errors`` as there."""
    _need_ops()
    if not isinstance(buffers, StagingBuffers):
        raise TypeError(f"buffers must be StagingBuffers, got {type(buffers).__name__}")
    unknown = set(sources) - {s.name for s in SOURCE_SLOTS}
    if unknown:
        raise TypeError(f"stage_token_inputs_op got unexpected arguments {sorted(unknown)}")
    dsts, fills = buffers.slots_and_fills()
    check_int("pad_to", pad_to)
    for name, t in sources.items():
        if t is not None:
            check_tensor(name, t)
    _call(torch.ops.slabstage.stage_token_inputs, [t for t in dsts if t is not None] + [buffers.errors],
          *dsts, buffers.errors, *(sources.get(s.name) for s in SOURCE_SLOTS), pad_to,
          [int(f or 0) for f in fills], [f is not None for f in fills])
