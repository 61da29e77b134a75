"""stage_batch: a prefill batch's integer slots and embeddings in one launch (the runner's path).

The same work as :func:`stage_token_inputs` followed by :func:`stage_embeddings`,
from the same kernel with both halves on: one launch and one host check instead
of two. At small batches the host, not the GPU, bounds a prefill step.
"""

from __future__ import annotations

import bisect
import math
from functools import partial

import torch

from .errors import check_error_word
from .launch import int_spec, launch_hooks_set
from ..checks import INT32_MAX, byte_span, check_real
from .plan import (REQUEST_SLOTS, SLOT_ARGS, SLOTS, MediaPlan, check_destinations, check_embed, check_host_values,
                   check_media, check_no_overlap, check_slab, embed_args, launch_columns, pack_host_inputs,
                   token_args, vocab_bounds)
from .reference import stage_embeddings_reference, stage_token_inputs_reference
from .runtime import use_triton
from .stage_kernel import MEDIA_ITEMS, MEDIA_TENSOR, STAGE
from .stage_token_inputs import check_token_batch

__all__ = ["plan_stage_batch", "BatchStager"]



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
        stage_token_inputs_reference(buffers, given, n, pad_to, b)
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
    once per signature. The first batch of each *configuration* (the dtype and
    side of every input, the table's width and row-stride class, the media's form
    and dtype, ``expand``, ``media_owner``, which optional arguments are given)
    takes the full path of :func:`plan_stage_batch`, whose launch compiles; its
    compiled variant is kept. A later batch of a kept configuration is checked on
    what can differ between batches of one configuration (ranks and lengths,
    batch size, ``pad_to``, vocabulary bounds, ``text_scale``, storage overlap,
    the media items, alignment) and launched with integer arguments. A batch
    that fails any of these takes the full path, which raises the error. Nothing
    is written before every check has passed.
    """

    def __init__(self, buffers) -> None:
        self.buffers = buffers
        self.enabled = STAGE is not None and STAGE.enabled and buffers.device.type == "cuda"
        self.variants: dict = {}  # configuration -> (compiled Variant, column blocks per row)
        self.cached_launches = 0  # batches that took the cached path (for tests and profiling)
        self._sig = self._errors = None
        self._static = None
        self._tables: dict = {}  # item table content -> its device copy

    def __call__(self, batch, pad_to: int, signature=None) -> None:
        key = None
        if self.enabled and signature is not None and not launch_hooks_set():
            if signature is not self._sig or self.buffers.errors is not self._errors:
                self._refresh(signature)
            if self._static is not None:
                try:
                    key, values, keep = self._match(batch, pad_to)
                except (TypeError, ValueError, AttributeError, IndexError):
                    key = None  # the full path names the problem
                else:
                    entry = self.variants.get(key)
                    # trusted: the key fixes every specialisation but the per-call pointers, checked by _match
                    if entry is not None and entry[0].launch(max(1, pad_to * entry[1]), values, trusted=True):
                        self.cached_launches += 1
                        return
        variant = plan_stage_batch(
            self.buffers, input_ids=batch.input_ids, positions=batch.positions, table=batch.table,
            out_cache_loc=batch.out_cache_loc, mrope_positions=batch.mrope_positions, seq_lens=batch.seq_lens,
            extend_start_loc=batch.extend_start_loc, media=batch.media, media_index=batch.media_index,
            expand=batch.expand, text_scale=batch.text_scale, vocab_range=batch.vocab_range,
            vocab_size=batch.vocab_size, media_owner=batch.media_owner, pad_to=pad_to)()
        if key is not None and variant is not None:
            self.variants[key] = variant, self._cols(batch)

    def _refresh(self, signature) -> None:
        """Check and read the buffers' side of the launch under ``signature``; forget every variant."""
        self._sig, self._errors, self._static, self.variants = signature, self.buffers.errors, None, {}
        try:
            dst = check_destinations(self.buffers)
            slab = check_slab(self.buffers.input_embeds)
            check_error_word(self.buffers.errors, self.buffers.device)
        except (TypeError, ValueError):
            return  # the full path raises the error
        errors = self.buffers.errors.data_ptr()
        base = {k: _DEFAULTS.get(k) for k in _RUNTIME}
        base.update((k, v.data_ptr() if isinstance(v, torch.Tensor) else v) for k, v in dst.args.items())
        base.update(errors_ptr=errors, slab_ptr=slab.data_ptr(), stride_slab=slab.shape[1])
        values = [errors if v is None else v for v in base.values()]  # an omitted pointer, as FastLaunch fills it
        spans = sorted([byte_span(t) for _, t in dst.spans] + [byte_span(slab)])
        self._static = values, dst, slab, [s for s, _ in spans], spans, slab.get_device()

    def _match(self, batch, pad_to: int):
        """``(configuration key, launch values, what must outlive the launch)``; raises on anything the
        full path must look at. Checks only what can differ between batches of one configuration."""
        base, dst, slab, _, _, dev = self._static
        ids, table, media = batch.input_ids, batch.table, batch.media
        n = ids.shape[0]
        if type(pad_to) is not int or not 0 < n <= pad_to <= slab.shape[0]:
            raise ValueError("pad_to")
        side = ids.get_device()
        given, form = {}, []
        b = None
        for name in _SOURCES:  # the integer slots, then media_index
            t = batch.media_index if name == "media_index" else getattr(batch, name)
            if t is None:
                form.append(None)
                continue
            if name in REQUEST_SLOTS:
                b = t.shape[0] if b is None else b
                want = (b,)
            else:
                want = (3, n) if name == "mrope_positions" else (n,)
            if t.shape != want or t.get_device() != side or (want[-1] > 1 and t.stride(-1) != 1):
                raise ValueError(name)
            given[name] = t
            form.append(t.dtype)
        b = b or 0
        if b > dst.batch_cap:
            raise ValueError("batch size")
        tshape, tstride = table.shape, table.stride()
        if len(tshape) != 2 or table.get_device() != dev or tstride[1] != 1:
            raise ValueError("table")
        if media is None:
            plan = mform = None
        elif isinstance(media, torch.Tensor):
            mshape, mstride = media.shape, media.stride()
            if len(mshape) != 2 or media.get_device() != dev or mstride[1] != 1:
                raise ValueError("media")
            plan = MediaPlan(MEDIA_TENSOR, media, mshape[0], mshape[1], media.dtype)
            mform = media.dtype, mshape[1], int_spec(mstride[0])
        else:
            plan = check_media(media, slab.device, slab.shape[1], tshape[1], batch.expand)
            mform = plan.dtype, plan.width, plan.blocks, plan.vec
        if batch.vocab_range is None and batch.vocab_size is None and tshape[0] <= INT32_MAX:
            bounds = 0, tshape[0], tshape[0]
        else:
            bounds = vocab_bounds(batch.vocab_range, batch.vocab_size, tshape[0])
        scale = batch.text_scale
        if scale is not None and not (type(scale) is float and math.isfinite(scale)):
            scale = check_real("text_scale", scale)
        table_ptr = table.data_ptr()
        self._apart(table_ptr, table_ptr + tshape[0] * tstride[0] * table.element_size())  # rows are contiguous
        if plan is not None:
            for start, end in plan.spans if plan.spans is not None else (byte_span(plan.tensor),):
                self._apart(start, end)
        key = (side, *form, table.dtype, tshape[1], int_spec(tstride[0]), mform, batch.expand, scale is None,
               batch.media_owner)
        host = dict(given) if side < 0 else {}  # what travels in the one packed host copy
        items = None
        if plan is not None and plan.mode == MEDIA_ITEMS:
            if side < 0:
                host["items_ptr"] = plan.table
            else:
                items = self._item_table(plan.table)
        if side < 0:
            check_host_values(given, dst.dtypes)
        ptrs = pack_host_inputs(slab.device, host, self.buffers.token_scratch, addresses=True) if host else {}
        if items is not None:
            ptrs["items_ptr"], ptrs[None] = items.data_ptr(), items
        values = base.copy()
        align = 0
        _, _, _, starts, spans, _ = self._static
        last = len(starts) - 1
        for name, t in given.items():
            if side >= 0:  # apart from every destination; int64 at most: an overestimate only costs the full path
                p = t.data_ptr()
                i = bisect.bisect_right(starts, p) - 1
                if (i >= 0 and spans[i][1] > p) or (i < last and starts[i + 1] < p + t.numel() * 8):
                    raise ValueError("overlap")
            else:
                p = ptrs[name]
            values[_SOURCE_AT[name]] = p
            align |= p
        if "items_ptr" in ptrs:
            values[_SOURCE_AT["items_ptr"]] = ptrs["items_ptr"]
        at = _AT
        mrope = given.get("mrope_positions")  # host rows are packed back to back
        values[at["n"]], values[at["pad_to"]], values[at["b"]] = n, pad_to, b
        values[at["stride_mrope"]] = 0 if mrope is None else (n if side < 0 and None in ptrs else mrope.stride(0))
        values[at["table_ptr"]] = table_ptr
        align |= table_ptr
        values[at["stride_table"]] = tstride[0]
        values[at["vocab_start"]], values[at["vocab_end"]], values[at["vocab_size"]] = bounds
        values[at["text_scale"]] = 1.0 if scale is None else scale
        if plan is not None:
            values[at["media_ptr"]] = p = plan.tensor.data_ptr()
            align |= p
            values[at["num_media"]], values[at["num_items"]] = plan.rows, plan.num_items
            values[at["stride_media"]] = plan.tensor.stride(0) if plan.mode == MEDIA_TENSOR else 0
        if align & 15:
            raise ValueError("alignment")  # the full path launches through another variant
        return key, values, ptrs  # the packed copy must live until the launch is queued

    def _item_table(self, table: list) -> torch.Tensor:
        """The item table on the device, kept per content: a batch whose items have not moved (a chunked
        image, an encoder cache, a benchmark) reuses it and skips the host-to-device copy."""
        key = tuple(table)
        dev = self._tables.get(key)
        if dev is None:
            if len(self._tables) >= _TABLES_KEPT:
                self._tables.clear()
            dev = self._tables[key] = pack_host_inputs(self.buffers.device, {"t": table})["t"]
        return dev

    def _apart(self, start: int, end: int) -> None:
        """Raise unless bytes ``[start, end)`` miss every destination (sorted and apart)."""
        _, _, _, starts, spans, _ = self._static
        i = bisect.bisect_right(starts, start) - 1
        if (i >= 0 and spans[i][1] > start) or (i + 1 < len(spans) and spans[i + 1][0] < end):
            raise ValueError("overlap")  # the full path names it

    def _cols(self, batch) -> int:
        """Programs per slab row for ``batch``'s configuration, as the full path chose them."""
        slab, table = self.buffers.input_embeds, batch.table
        media = batch.media
        media_width = None if media is None else (media.shape[1] if isinstance(media, torch.Tensor) else sum(
            t.shape[1] for t in (media[0] if isinstance(media[0], tuple) else (media[0],))))
        return launch_columns(slab, table.shape[1], media_width, batch.expand)


_TABLES_KEPT = 64  # item tables kept on the device, each a few hundred bytes

if STAGE is not None:
    # the kernel's runtime arguments, each one's position and the defaults of the optional ones
    _RUNTIME, _AT, _DEFAULTS = STAGE.runtime, STAGE.at, STAGE.defaults
    _SOURCES = (*SLOTS, "media_index")
    _SOURCE_AT = {**{name: _AT[SLOT_ARGS[name][0]] for name in SLOTS}, "media_index": _AT["media_index_ptr"],
                  "items_ptr": _AT["items_ptr"]}
