"""stage_batch: a prefill batch's integer slots and embeddings in one launch (the runner's path).

The same work as :func:`stage_token_inputs` followed by :func:`stage_embeddings`,
from the same kernel with both halves on: one launch and one host check instead
of two. At small batches the host, not the GPU, bounds a prefill step.
"""

from __future__ import annotations

import bisect
import itertools
import math
from functools import partial

import torch

from .errors import check_error_word
from .launch import int_spec, launch_hooks_set
from ..checks import INT32_MAX, byte_span, check_real
from .plan import (ELEM_BYTES, INT_BITS, REQUEST_SLOTS, SLOT_ARGS, SLOTS, check_destinations, check_embed,
                   check_host_values, check_media, check_no_overlap, check_slab, embed_args, pack_host_inputs,
                   pack_to_device, token_args, vocab_bounds, ItemTables, item_records)
from .reference import stage_embeddings_reference, stage_token_inputs_reference
from .runtime import use_triton
from .stage_kernel import MEDIA_ITEMS, STAGE
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
    non-blocking copy. Calling the result returns ``(compiled variant, programs per
    slab row)`` of the launch (for :class:`BatchStager`), or None.
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
    variant = STAGE(max(1, pad_to * cols), args, {**constexprs, **tok_constexprs}, num_warps)
    return None if variant is None else (variant, cols)


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
        # item table content -> its device copy. Keyed without the stream (asking for it costs host time):
        # the runner stages on the stream its forward runs on
        self._tables = ItemTables()

    def __call__(self, batch, pad_to: int, signature=None) -> None:
        key = None
        if self.enabled and signature is not None and not launch_hooks_set():
            if signature is not self._sig or self.buffers.errors is not self._errors:
                self._refresh(signature)
            if self._static is not None:
                try:
                    key, values, keep = self._match(batch, pad_to)
                except (TypeError, ValueError, AttributeError, IndexError, KeyError, RuntimeError):
                    key = None  # the full path names the problem
                else:
                    entry = self.variants.get(key)
                    if entry is not None:
                        # trusted: the key fixes every specialisation but the per-call pointers, checked by _match
                        entry[0].launch_trusted(pad_to * entry[1], values)
                        self.cached_launches += 1
                        return
        launched = plan_stage_batch(
            self.buffers, input_ids=batch.input_ids, positions=batch.positions, table=batch.table,
            out_cache_loc=batch.out_cache_loc, mrope_positions=batch.mrope_positions, seq_lens=batch.seq_lens,
            extend_start_loc=batch.extend_start_loc, media=batch.media, media_index=batch.media_index,
            expand=batch.expand, text_scale=batch.text_scale, vocab_range=batch.vocab_range,
            vocab_size=batch.vocab_size, media_owner=batch.media_owner, pad_to=pad_to)()
        if key is not None and launched is not None:
            self.variants[key] = launched

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
        self._static = _Static(values, dst, slab, spans)

    def _match(self, batch, pad_to: int):
        """``(configuration key, launch values, what must outlive the launch)``; raises on anything the
        full path must look at. Checks only what can differ between batches of one configuration.
        Runs on every cached launch: every read here costs host time, so each is made once."""
        st = self._static
        ids, table, media = batch.input_ids, batch.table, batch.media
        n = ids.shape[0]
        if type(pad_to) is not int or not 0 < n <= pad_to <= st.rows:
            raise ValueError("pad_to")
        side = ids.get_device()
        values = st.values.copy()
        key = [side]
        given = []  # host inputs: (position, tensor)
        narrow = None  # host sources wider than their slot (checked here; a device one is flagged by the kernel)
        b = -1
        device = side >= 0  # device inputs: read in place, apart from every destination
        align, lo, hi = 0, st.lo, st.hi  # every destination lies in [lo, hi)
        gaps = st.gaps  # per input (by its pointer's position), the gap between destinations that held it last
        per_token = (n,)
        for name, at, kind in _SOURCE_SPECS:  # the integer slots, then media_index
            t = getattr(batch, name)
            if t is None:
                key.append(None)
                continue
            shape = t.shape
            if kind == _PER_TOKEN:  # 1-D: contiguous is stride 1 (is_contiguous() is the cheapest read)
                ok = shape == per_token and t.is_contiguous()
                count = n
            elif kind == _PER_REQUEST:
                if b < 0:
                    b = shape[0] if len(shape) == 1 else -1
                ok = shape == (b,) and t.is_contiguous()
                count = b
            else:  # mrope rows may lie apart: its columns must be contiguous
                stride = t.stride()
                ok = shape == (3, n) and (n == 1 or stride[1] == 1)
                count = 2 * stride[0] + n
            if not ok or t.get_device() != side:
                raise ValueError(name)
            dtype = t.dtype
            key.append(dtype)
            if device:
                p = t.data_ptr()
                end = p + count * 8  # (int64 at most: an overestimate only costs the full path)
                if end > lo and p < hi:  # (outside them all: two compares)
                    gap = gaps[at]
                    if p < gap[0] or end > gap[1]:
                        gaps[at] = st.fit(p, end)
                values[at] = p
                align |= p
            else:
                given.append((at, t))
                if INT_BITS.get(dtype, 0) > st.bits.get(name, 64):  # as check_host_values decides
                    if narrow is None:
                        narrow = {}
                    narrow[name] = t
        b = max(b, 0)
        if b > st.batch_cap:
            raise ValueError("batch size")
        tshape, tstride = table.shape, table.stride()
        if len(tshape) != 2 or table.get_device() != st.dev or tstride[1] != 1:
            raise ValueError("table")
        table_ptr = table.data_ptr()
        tdtype = table.dtype
        end = table_ptr + tshape[0] * tstride[0] * ELEM_BYTES[tdtype]  # its rows are contiguous
        if end > lo and table_ptr < hi:
            gap = gaps[_TABLE_PTR]
            if table_ptr < gap[0] or end > gap[1]:
                gaps[_TABLE_PTR] = st.fit(table_ptr, end)
        items = None
        if media is None:
            key.append(None)
        elif isinstance(media, torch.Tensor):
            mshape, mstride = media.shape, media.stride()
            if len(mshape) != 2 or media.get_device() != st.dev or mstride[1] != 1:
                raise ValueError("media")
            p = media.data_ptr()
            mdtype = media.dtype
            end = p + ((mshape[0] - 1) * mstride[0] + mshape[1]) * ELEM_BYTES[mdtype] if mshape[0] else p
            if end > lo and p < hi:
                gap = gaps[_MEDIA_PTR]
                if p < gap[0] or end > gap[1]:
                    gaps[_MEDIA_PTR] = st.fit(p, end)
            key.append((mdtype, mshape[1], _SPECS[mstride[0]]))
            values[_MEDIA_PTR], values[_NUM_MEDIA], values[_STRIDE_MEDIA] = p, mshape[0], mstride[0]
        else:
            records = item_records(media) if type(media) in _SEQUENCES else None  # (None unless every item
            # is one tensor; another kind of sequence takes check_media's path, which refuses it)
            seen, context = st.items_seen, (tshape[1], batch.expand)  # the last batch's items, from records
            if records is None or seen is None or seen.records != records or seen.context != context:
                plan = check_media(media, st.device, st.width, tshape[1], batch.expand, records)
                st.apart_all(*plan.spans)
                seen = _ItemsSeen(context, plan)
                # equal records give an equal plan, whose spans were just checked against these destinations
                st.items_seen = seen if plan.records is not None else None
            key.append(seen.key)
            values[_MEDIA_PTR], values[_NUM_MEDIA], values[_NUM_ITEMS] = seen.media_ptr, seen.rows, len(media)
            items = seen.table
        if batch.vocab_range is None and batch.vocab_size is None and tshape[0] <= INT32_MAX:
            values[_VOCAB_START], values[_VOCAB_END], values[_VOCAB_SIZE] = 0, tshape[0], tshape[0]
        else:
            values[_VOCAB_START], values[_VOCAB_END], values[_VOCAB_SIZE] = \
                vocab_bounds(batch.vocab_range, batch.vocab_size, tshape[0])
        scale = batch.text_scale
        if scale is not None:
            if not (type(scale) is float and math.isfinite(scale)):
                scale = check_real("text_scale", scale)
            values[_TEXT_SCALE] = scale
        key += (tdtype, tshape[1], _SPECS[tstride[0]], batch.expand, scale is None, batch.media_owner)
        keep = None
        align |= table_ptr | values[_MEDIA_PTR]
        if not device:  # host inputs
            if narrow:
                check_host_values(narrow, st.dst.dtypes)
            if st.packs_host:  # in one packed copy, the item table with them
                parts = [t for _, t in given]
                if items is not None:
                    parts.append(items)
                keep, offsets = pack_to_device(st.device, parts, self.buffers.token_scratch)
                base = keep.data_ptr()
                align |= base
                for (pos, _), offset in zip(given, offsets):
                    values[pos] = base + offset
                if items is not None:
                    values[_ITEMS_PTR] = base + offsets[-1]
            else:  # a CPU slab (tests): the inputs are read where they are, the table packed as the full path does
                for pos, t in given:
                    values[pos] = p = t.data_ptr()
                    align |= p
                if items is not None:
                    keep = pack_to_device(st.device, [items], self.buffers.token_scratch)[0]
                    values[_ITEMS_PTR] = keep.data_ptr()
        elif items is not None:  # device inputs: the table's device copy, kept per content
            keep = seen.device_table
            if keep is None:
                keep = seen.device_table = self._tables.get(st.device, items)
            values[_ITEMS_PTR] = keep.data_ptr()
        mrope = batch.mrope_positions
        if mrope is not None:  # packed host rows lie back to back
            values[_STRIDE_MROPE] = n if side < 0 and st.packs_host else mrope.stride(0)
        values[_N], values[_PAD_TO], values[_B] = n, pad_to, b
        values[_TABLE_PTR], values[_STRIDE_TABLE] = table_ptr, tstride[0]
        if align & 15:
            raise ValueError("alignment")  # the full path launches through another variant
        return tuple(key), values, keep  # the packed copy must live until the launch is queued

class _Static:
    """What the cached path reads of the buffers under one registry signature: the launch values that do
    not change between batches, and the destinations' byte spans, sorted, for the overlap check."""

    __slots__ = ("values", "dst", "rows", "width", "device", "dev", "packs_host", "batch_cap", "starts", "ends",
                 "reach", "lo", "hi", "gaps", "bits", "items_seen")

    def __init__(self, values: list, dst, slab: torch.Tensor, spans: list) -> None:
        self.values, self.dst, self.batch_cap = values, dst, dst.batch_cap
        self.bits = {name: INT_BITS.get(dtype, 64) for name, dtype in dst.dtypes.items()}  # each slot's width
        self.rows, self.width, self.device, self.dev = slab.shape[0], slab.shape[1], slab.device, slab.get_device()
        self.packs_host = self.device.type == "cuda"  # host inputs travel in one packed copy (as pack_host_inputs)
        self.starts, self.ends = [s for s, _ in spans], [e for _, e in spans]
        self.reach = list(itertools.accumulate(self.ends, max))  # the furthest end of the spans up to each one
        self.lo, self.hi = spans[0][0], self.reach[-1]
        # per input (by its pointer's position in the launch values), the gap that held it last (none yet):
        # inputs allocated after the buffers often lie between them, and an input's next batch mostly
        # lies where its last one did, so trying that gap first saves a bisection per input on most batches
        self.gaps = [(0, 0)] * (len(values) + 1)  # (the last one: the media items')
        self.items_seen = None  # see BatchStager._match

    def gap(self, start: int) -> tuple[int, int]:
        """``[lo, hi)``, the stretch between destinations around byte ``start``: bytes in it miss them all
        (empty, ``lo > start``, when ``start`` lies inside one)."""
        i = bisect.bisect_right(self.starts, start) - 1  # the last destination starting at or before it
        return (self.reach[i] if i >= 0 else 0,  # past every destination up to it
                self.starts[i + 1] if i + 1 < len(self.starts) else 1 << 64)  # up to the next one

    def clear(self, start: int, end: int) -> bool:
        """Whether bytes ``[start, end)`` miss every destination: they lie in one gap between them. (The
        predicate :meth:`BatchStager._match` inlines at each input, with the input's kept gap first.)"""
        if end <= self.lo or start >= self.hi:  # outside them all: the usual case, two compares
            return True
        lo, hi = self.gap(start)
        return lo <= start and end <= hi

    def fit(self, start: int, end: int) -> tuple[int, int]:
        """The gap holding bytes ``[start, end)``; raises when they touch a destination (the full path then
        names it)."""
        lo, hi = self.gap(start)
        if start < lo or end > hi:
            raise ValueError("overlap")
        return lo, hi

    def apart_all(self, starts: list, ends: list) -> None:
        """Raise unless every span ``[starts[k], ends[k])`` (media items) misses every destination; the gap
        that held the span before is tried first, with two compares."""
        if not starts:
            return
        first, last = min(starts), max(ends)  # (two C-level passes; a Python loop costs ~0.1 µs a span)
        if last <= self.lo or first >= self.hi:  # all outside the destinations: the usual case
            return
        lo, hi = self.gaps[-1]
        if lo <= first and last <= hi:  # all in the gap that held them before
            return
        for start, end in zip(starts, ends):
            if start >= lo and end <= hi:
                continue
            lo, hi = self.gaps[-1] = self.fit(start, end)


class _ItemsSeen:
    """What the cached path keeps of one batch's media items: its records and the launch values of its plan
    (:meth:`BatchStager._match` reuses them for a batch whose records are equal)."""

    __slots__ = ("context", "records", "key", "media_ptr", "rows", "table", "device_table")

    def __init__(self, context: tuple, plan) -> None:
        self.context, self.records = context, plan.records  # (table width, expand), the items' records
        self.key = (plan.dtype, plan.width, plan.blocks, plan.vec, plan.unit)  # the variant key's media part
        self.media_ptr, self.rows, self.table = plan.tensor.data_ptr(), plan.rows, plan.table
        self.device_table = None  # the table's device copy, once a batch with device inputs asked for it


class _Specs(dict):
    """:func:`int_spec` by row stride, kept (a lookup costs less host time than the call)."""

    def __missing__(self, stride: int) -> int:
        spec = int_spec(stride)
        if len(self) < 1024:
            self[stride] = spec
        return spec


_SPECS = _Specs()
_SEQUENCES = (list, tuple)  # media items' containers (check_media accepts these)

if STAGE is not None:
    # the kernel's runtime arguments, each one's position and the defaults of the optional ones
    _RUNTIME, _AT, _DEFAULTS = STAGE.runtime, STAGE.at, STAGE.defaults
    # the positions _match writes on every batch, as constants (a dict lookup each costs host time)
    (_N, _PAD_TO, _B, _MEDIA_PTR, _NUM_MEDIA, _STRIDE_MEDIA, _NUM_ITEMS, _ITEMS_PTR, _VOCAB_START, _VOCAB_END,
     _VOCAB_SIZE, _TEXT_SCALE, _STRIDE_MROPE, _TABLE_PTR, _STRIDE_TABLE) = (_AT[k] for k in (
        "n", "pad_to", "b", "media_ptr", "num_media", "stride_media", "num_items", "items_ptr", "vocab_start",
        "vocab_end", "vocab_size", "text_scale", "stride_mrope", "table_ptr", "stride_table"))
    _PER_TOKEN, _PER_REQUEST, _MROPE = 0, 1, 2
    # each integer source: its name, its pointer's position and its shape kind, then media_index
    _SOURCE_SPECS = tuple((name, _AT[SLOT_ARGS[name][0]], _PER_REQUEST if name in REQUEST_SLOTS else
                           _MROPE if name == "mrope_positions" else _PER_TOKEN) for name in SLOTS) + \
        (("media_index", _AT["media_index_ptr"], _PER_TOKEN),)
