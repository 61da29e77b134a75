"""stage_batch: a prefill batch's integer slots and embeddings in one launch (the runner's path).

The same work as :func:`stage_token_inputs` followed by :func:`stage_embeddings`,
from the same kernel with both halves on: one launch and one host check instead
of two. At small batches the host, not the GPU, bounds a prefill step.
"""

from __future__ import annotations

import bisect
from functools import partial

import torch

from .errors import check_error_word
from .launch import int_spec, launch_hooks_set
from ..checks import check_real
from .plan import (REQUEST_SLOTS, SLOT_ARGS, SLOTS, MediaPlan, check_destinations, check_embed, check_host_values,
                   check_media, check_no_overlap, check_slab, embed_args, pack_host_inputs, token_args, vocab_bounds)
from .reference import stage_embeddings_reference, stage_token_inputs_reference
from .runtime import use_triton
from .stage_kernel import MEDIA_ITEMS, MEDIA_TENSOR, STAGE
from .stage_token_inputs import check_token_batch

__all__ = ["plan_stage_batch", "BatchStager"]

# the kernel's optional integer arguments at their defaults: the cached path passes every argument
_INT_DEFAULTS = {} if STAGE is None else {k: STAGE.defaults[k] for k in STAGE.runtime
                                         if STAGE.defaults.get(k) is not None}
_PTRS = () if STAGE is None else STAGE.ptrs


def plan_stage_batch(buffers, *, input_ids, positions, table, out_cache_loc=None, mrope_positions=None,
                     seq_lens=None, extend_start_loc=None, media=None, media_index=None, expand="zeros",
                     text_scale=None, vocab_range=None, vocab_size=None, media_owner=True, pad_to: int):
    """Check a whole batch (token slots and embeddings) and return its one launch as a callable, not yet run.

    Same arguments and semantics as :func:`stage_token_inputs` plus
    :func:`stage_embeddings` into ``buffers.input_embeds`` (text ids read from
    ``input_ids``, errors into ``buffers.errors``). Integer inputs (``media_index``
    too) may be host tensors: they travel with the media item table in one packed
    non-blocking copy. Calling the result returns the compiled variant it launched
    through (for :class:`BatchStager`), or None.
    """
    dst, given, n, b, pad_to = check_token_batch(
        buffers, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
        mrope_positions=mrope_positions, seq_lens=seq_lens, extend_start_loc=extend_start_loc, pad_to=pad_to)
    slab = check_slab(buffers.input_embeds)
    _, plan, bounds, scale = check_embed(
        slab, table, n, media=media, media_index=media_index, pad_to=pad_to, expand=expand, text_scale=text_scale,
        vocab_range=vocab_range, vocab_size=vocab_size, media_owner=media_owner, index_host_ok=True)
    for name, t in given.items():
        check_no_overlap("the slab", slab, name, t)
    check_error_word(buffers.errors, buffers.device)
    if media_index is not None:
        given = {**given, "media_index": media_index}
    return partial(_launch, buffers, dst, given, plan, n, b, pad_to, dict(
        table=table, bounds=bounds, scale=scale, expand=expand, media_owner=media_owner))


def _launch(buffers, dst, given: dict, plan, n: int, b: int, pad_to: int, embed: dict):
    slab = buffers.input_embeds
    if plan is not None and plan.mode == MEDIA_ITEMS:
        given = {**given, "items_ptr": plan.table}
    given = pack_host_inputs(buffers.device, given, buffers.token_scratch)
    index = given.pop("media_index", None)
    items = given.pop("items_ptr", None)
    if not use_triton(slab):  # the references, one after the other
        reg = buffers.registry
        slots = [(reg[k], given[k], reg.slot(k).fill_value, k in REQUEST_SLOTS) for k in SLOTS if k in given]
        stage_token_inputs_reference(slots, n, pad_to, b, dst.batch_cap, buffers.num_tokens_non_padded)
        stage_embeddings_reference(slab, given["input_ids"], embed["table"], plan, index, pad_to=pad_to,
                                   expand=embed["expand"], text_scale=embed["scale"], bounds=embed["bounds"],
                                   media_owner=embed["media_owner"], errors=buffers.errors)
        return None
    args, constexprs, cols, num_warps = embed_args(
        slab, embed["table"], plan, embed["bounds"], embed["scale"], expand=embed["expand"],
        media_owner=embed["media_owner"], has_index=index is not None)
    mrope = given.get("mrope_positions")
    tok, tok_constexprs = token_args(dst, given, b, mrope.stride(0) if mrope is not None else 0)
    args.update(tok, errors_ptr=buffers.errors, ids_ptr=given["input_ids"], n=n, pad_to=pad_to)
    if index is not None:
        args["media_index_ptr"] = index
    if items is not None:
        args["items_ptr"] = items
    return STAGE(max(1, pad_to * cols), args, {**constexprs, **tok_constexprs}, num_warps)


class BatchStager:
    """:func:`plan_stage_batch` for a graph runner: the same checks and launch, at a fraction of the host time.

    ``stager(batch, pad_to, signature)`` stages a :class:`PrefillBatch`. ``signature``
    is the registry signature the caller has just checked
    (:meth:`BufferRegistry.check`): the destination slots are checked and read
    once per signature. The first batch of each *configuration* (the dtype, side,
    rank and last stride of every input, the table's width, the media's form,
    ``expand``, ``media_owner``, which optional arguments are given) takes the full
    path of :func:`plan_stage_batch`, whose launch compiles; its compiled variant
    is kept. A later batch of a kept configuration is checked on what can differ
    between batches (lengths, batch size, ``pad_to``, vocabulary bounds,
    ``text_scale``, storage overlap, the media items, alignment) through the same
    helpers, then launched with integer arguments. A batch that fails any of
    these takes the full path, which raises the error. Nothing is written before
    every check has passed.
    """

    def __init__(self, buffers) -> None:
        self.buffers = buffers
        self.enabled = STAGE is not None and STAGE.enabled and buffers.device.type == "cuda"
        self.variants: dict = {}  # configuration -> compiled Variant
        self.cached_launches = 0  # batches that took the cached path (for tests and profiling)
        self._sig = self._errors = None
        self._static = None

    def __call__(self, batch, pad_to: int, signature=None) -> None:
        key = None
        if self.enabled and signature is not None and not launch_hooks_set():
            if signature is not self._sig or self.buffers.errors is not self._errors:
                self._refresh(signature)
            if self._static is not None:
                try:
                    key, grid0, args = self._match(batch, pad_to)
                except (TypeError, ValueError, AttributeError, IndexError):
                    key = None  # the full path names the problem
                else:
                    variant = self.variants.get(key)
                    if variant is not None and variant.launch(grid0, args):
                        self.cached_launches += 1
                        return
        variant = plan_stage_batch(
            self.buffers, input_ids=batch.input_ids, positions=batch.positions, table=batch.table,
            out_cache_loc=batch.out_cache_loc, mrope_positions=batch.mrope_positions, seq_lens=batch.seq_lens,
            extend_start_loc=batch.extend_start_loc, media=batch.media, media_index=batch.media_index,
            expand=batch.expand, text_scale=batch.text_scale, vocab_range=batch.vocab_range,
            vocab_size=batch.vocab_size, media_owner=batch.media_owner, pad_to=pad_to)()
        if key is not None and variant is not None:
            self.variants[key] = variant

    def _refresh(self, signature) -> None:
        """Check and read the buffers' side of the launch under ``signature``; forget every variant."""
        self._sig, self._errors, self._static, self.variants = signature, self.buffers.errors, None, {}
        try:
            dst = check_destinations(self.buffers)
            slab = check_slab(self.buffers.input_embeds)
            check_error_word(self.buffers.errors, self.buffers.device)
        except (TypeError, ValueError):
            return  # the full path raises the error
        static = dict(_INT_DEFAULTS)
        static.update((k, v.data_ptr() if isinstance(v, torch.Tensor) else v) for k, v in dst.args.items())
        static.update(errors_ptr=self.buffers.errors.data_ptr())
        spans = sorted([_span(t) for _, t in dst.spans] + [_span(slab)])
        self._static = static, dst, slab, [s for s, _ in spans], spans

    def _match(self, batch, pad_to: int):
        """``(configuration key, grid, integer arguments)`` of ``batch``; raises on anything the full path
        must look at. Checks only what can differ between batches of one configuration."""
        static, dst, slab, starts, spans = self._static
        ids, table, media = batch.input_ids, batch.table, batch.media
        n = ids.shape[0]
        if type(pad_to) is not int or not 0 < n <= pad_to <= slab.shape[0]:
            raise ValueError("pad_to")
        given = {}
        for name in SLOTS:
            t = getattr(batch, name)
            if t is not None:
                given[name] = t
        req = given.get("seq_lens", given.get("extend_start_loc"))
        b = req.shape[0] if req is not None else 0
        for name, t in given.items():
            if t.shape[-1] != (b if name in REQUEST_SLOTS else n):
                raise ValueError(name)
        if b > dst.batch_cap or batch.media_index is not None and batch.media_index.shape[0] != n:
            raise ValueError("lengths")
        side = ids.get_device()
        device = slab.device
        if media is None or isinstance(media, torch.Tensor):
            plan = None if media is None else MediaPlan(MEDIA_TENSOR, media, media.shape[0], media.shape[1],
                                                        media.dtype)
        else:
            plan = check_media(media, device, slab.shape[1], table.shape[1], batch.expand)
        if batch.vocab_range is None and batch.vocab_size is None:
            bounds = (0, table.shape[0], table.shape[0])
        else:
            bounds = vocab_bounds(batch.vocab_range, batch.vocab_size, table.shape[0])
        scale = batch.text_scale
        if scale is not None:
            scale = check_real("text_scale", scale)
        for t in (table, *(plan.sources if plan is not None else ()), *(given.values() if side >= 0 else ())):
            start, end = _span(t)
            i = bisect.bisect_right(starts, start) - 1  # the destinations, sorted and apart, around it
            if (i >= 0 and spans[i][1] > start) or (i + 1 < len(spans) and spans[i + 1][0] < end):
                raise ValueError("overlap")  # the full path names it
        key = (self._config(batch), plan.blocks if plan is not None else 0, plan.vec if plan is not None else 0)
        if batch.media_index is not None:
            given["media_index"] = batch.media_index
        if plan is not None and plan.mode == MEDIA_ITEMS:
            given["items_ptr"] = plan.table
        if side < 0:
            check_host_values(given, dst.dtypes)
            given = pack_host_inputs(device, given, self.buffers.token_scratch)
        emb, _, cols, _ = embed_args(slab, table, plan, bounds, scale, expand=batch.expand,
                                     media_owner=batch.media_owner, has_index=batch.media_index is not None)
        args = dict(static)
        for k, v in emb.items():
            args[k] = v.data_ptr() if isinstance(v, torch.Tensor) else v
        dummy = static["errors_ptr"]  # what FastLaunch passes for an omitted pointer: never dereferenced
        for name, (src, *_) in SLOT_ARGS.items():
            t = given.get(name)
            args[src] = t.data_ptr() if t is not None else dummy
        mrope = given.get("mrope_positions")
        index, items = given.get("media_index"), given.get("items_ptr")
        args.update(n=n, pad_to=pad_to, b=b, stride_mrope=mrope.stride(0) if mrope is not None else 0,
                    media_index_ptr=index.data_ptr() if index is not None else dummy,
                    items_ptr=items.data_ptr() if items is not None else dummy)
        for k in _PTRS:  # an omitted pointer, as FastLaunch completes it
            args.setdefault(k, dummy)
        args["_keep"] = given  # the packed copy lives until the launch has been queued
        return key, max(1, pad_to * cols), args

    @staticmethod
    def _config(batch):
        """What fixes the compiled variant and the static checks: per input its dtype, side, rank and last
        stride; the table's width; the media's form; the flags."""
        def form(t):
            return None if t is None else (t.dtype, t.get_device(), t.dim(), t.stride(-1))

        media = batch.media
        if media is None or isinstance(media, torch.Tensor):
            mform = (form(media), media.shape[-1], int_spec(media.stride(0))) if media is not None else None
        else:
            mform = "items"
        table = batch.table
        return (form(batch.input_ids), form(batch.positions), form(batch.out_cache_loc), form(batch.mrope_positions),
                form(batch.seq_lens), form(batch.extend_start_loc), form(batch.media_index), form(table),
                table.shape[-1], int_spec(table.stride(0)), mform, batch.expand, batch.text_scale is None,
                batch.media_owner)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes ``[start, end)`` a row-major tensor may touch (an upper bound for strided ones)."""
    start = t.data_ptr()
    return start, start + (t.shape[0] * t.stride(0) if t.dim() else 1) * t.element_size()
