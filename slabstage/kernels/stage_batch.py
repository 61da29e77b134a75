"""stage_batch: a prefill batch's integer slots and embeddings in one launch (the runner's path).

The same work as :func:`stage_token_inputs` followed by :func:`stage_embeddings`,
from the same jitted row helpers, with one launch and one host check instead of
two: at small batches the host, not the GPU, bounds a prefill step.
"""

from __future__ import annotations

from functools import partial

import torch

from ..staging.buffers import StagingBuffers
from ._launch import FastLaunch, _hooks_set, int_spec
from ._triton import tl, triton, use_triton
from .stage_embeddings import embeddings_key, embeddings_launch, vocab_bounds
from .stage_token_inputs import _launch as _token_launch_alone
from .stage_token_inputs import _static, check_token_inputs, pack_host_inputs, token_launch

__all__ = ["plan_stage_batch", "BatchStager"]

_TOK_BLOCK = 128

if triton is not None:
    from .stage_embeddings import _embed_row
    from .stage_token_inputs import _token_rows

    @triton.jit(do_not_specialize=["n", "pad_to", "vocab_start", "vocab_end", "vocab_size", "num_media",
                                   "t_n", "t_pad_to", "b", "stride_mrope_src"])
    def _stage_batch_kernel(
        slab_ptr, ids_ptr, table_ptr, media_ptr, media_index_ptr, errors_ptr,
        n, pad_to, vocab_start, vocab_end, vocab_size, num_media, text_scale,
        stride_slab, stride_table, stride_media,
        ids_src, pos_src, loc_src, mrope_src, seq_src, ext_src,
        ids_dst, pos_dst, loc_dst, mrope_dst, seq_dst, ext_dst, ntok_dst,
        t_n, t_pad_to, b, batch_cap, stride_mrope_src, stride_mrope_dst,
        ids_fill, pos_fill, loc_fill, mrope_fill, seq_fill, ext_fill,
        WIDTH: tl.constexpr, TEXT_WIDTH: tl.constexpr, MEDIA_WIDTH: tl.constexpr,
        BLOCK: tl.constexpr, COL_BLOCKS: tl.constexpr,
        TEXT_TILED: tl.constexpr, MEDIA_TILED: tl.constexpr,
        HAS_MEDIA: tl.constexpr, MEDIA_OWNER: tl.constexpr, HAS_SCALE: tl.constexpr,
        SOFT: tl.constexpr, BAD_ID_CODE: tl.constexpr, BAD_MEDIA_CODE: tl.constexpr,
        PAD_IDS: tl.constexpr, PAD_POS: tl.constexpr, PAD_LOC: tl.constexpr, PAD_MROPE: tl.constexpr,
        PAD_SEQ: tl.constexpr, PAD_EXT: tl.constexpr,
        HAS_LOC: tl.constexpr, HAS_MROPE: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_EXT: tl.constexpr,
        REQ_BLOCK: tl.constexpr, TOK_BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        _embed_row(
            pid, slab_ptr, ids_ptr, table_ptr, media_ptr, media_index_ptr, errors_ptr,
            n, pad_to, vocab_start, vocab_end, vocab_size, num_media, text_scale,
            stride_slab, stride_table, stride_media,
            WIDTH, TEXT_WIDTH, MEDIA_WIDTH, BLOCK, COL_BLOCKS, TEXT_TILED, MEDIA_TILED,
            HAS_MEDIA, MEDIA_OWNER, HAS_SCALE, SOFT, BAD_ID_CODE, BAD_MEDIA_CODE)
        row = pid // COL_BLOCKS
        if (pid % COL_BLOCKS == 0) & (row % TOK_BLOCK == 0):  # one program per TOK_BLOCK rows
            _token_rows(
                row.to(tl.int64) + tl.arange(0, TOK_BLOCK), row == 0,
                ids_src, pos_src, loc_src, mrope_src, seq_src, ext_src,
                ids_dst, pos_dst, loc_dst, mrope_dst, seq_dst, ext_dst, ntok_dst,
                t_n, t_pad_to, b, batch_cap, stride_mrope_src, stride_mrope_dst,
                ids_fill, pos_fill, loc_fill, mrope_fill, seq_fill, ext_fill,
                PAD_IDS, PAD_POS, PAD_LOC, PAD_MROPE, PAD_SEQ, PAD_EXT, HAS_LOC, HAS_MROPE, HAS_SEQ, HAS_EXT,
                REQ_BLOCK)

    _launch = FastLaunch(_stage_batch_kernel, ptr_args=(0, 1, 2, 3, 4, 5, *range(16, 29)))


def plan_stage_batch(buffers: StagingBuffers, *, input_ids, positions, table, out_cache_loc=None,
                     mrope_positions=None, seq_lens=None, extend_start_loc=None, media=None, media_index=None,
                     expand="zeros", text_scale=None, vocab_range=None, vocab_size=None, media_owner=True,
                     pad_to: int):
    """Check a whole batch (token slots and embeddings) and return its one launch, not yet run.

    Same arguments and semantics as :func:`stage_token_inputs` plus
    :func:`stage_embeddings` into ``buffers.input_embeds`` (text ids read from
    ``input_ids``, errors into ``buffers.errors``). Integer inputs (``media_index``
    too) may be host tensors: they travel in one packed non-blocking copy.
    """
    given, n, b = check_token_inputs(
        buffers, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
        mrope_positions=mrope_positions, seq_lens=seq_lens, extend_start_loc=extend_start_loc, pad_to=pad_to)
    if media_index is not None and not isinstance(media_index, torch.Tensor):
        raise TypeError(f"media_index must be a torch.Tensor, got {type(media_index).__name__}")
    if media_index is not None and media_index.device != buffers.device and media_index.device.type != "cpu":
        raise ValueError(f"media_index is on {media_index.device}; expected {buffers.device} or the host")
    parts = embeddings_launch(
        buffers.input_embeds, input_ids, table, media=media, media_index=media_index, pad_to=pad_to,
        expand=expand, text_scale=text_scale, vocab_range=vocab_range, vocab_size=vocab_size,
        media_owner=media_owner, errors=buffers.errors, check_ids_device=False)
    return partial(_run, buffers, given, media_index, parts, n, pad_to, b)


def _run(buffers: StagingBuffers, given: dict, media_index, parts, n: int, pad_to: int, b: int):
    """Launch; return the fused launch's ``(key, constexprs, num_warps)``, or None when it took another path."""
    if media_index is not None:
        given = {**given, "media_index": media_index}
    given = pack_host_inputs(buffers, given)
    media_index = given.pop("media_index", None)
    if callable(parts) or not use_triton(buffers.input_embeds):  # the references, one after the other
        _token_launch_alone(buffers, given, n, pad_to, b)
        slab, _, table, media = parts.args[:4]
        parts.func(slab, given["input_ids"], table, media, media_index, **parts.keywords)
        return None
    grid0, _, emb_args, emb_cx, num_warps = parts
    if not grid0:  # pad_to == 0: no slab row to write, but the token slots and the count still are
        _token_launch_alone(buffers, given, n, pad_to, b)
        return None
    emb_args = (emb_args[0], given["input_ids"], emb_args[2], emb_args[3],
                media_index if media_index is not None else given["input_ids"], *emb_args[5:])
    tok_args, tok_cx, tok_key = token_launch(buffers, given, n, pad_to, b)
    emb_key = embeddings_key(emb_args)
    key = (emb_key, tok_key) if emb_key is not None and tok_key is not None else None
    constexprs = {**emb_cx, **tok_cx, "TOK_BLOCK": _TOK_BLOCK}
    _launch((grid0,), key, (*emb_args, *tok_args), constexprs, num_warps)
    return key, constexprs, num_warps


class _Static:
    """What a batch launch takes from the buffers, read once per registry signature."""

    __slots__ = ("slab", "errors", "dsts", "fills", "mrope_dst_stride", "width", "capacity", "batch_cap")


class BatchStager:
    """:func:`plan_stage_batch` for a graph runner: the same checks and launch, at a fraction of the host time.

    ``stager(batch, pad_to, signature)`` stages a :class:`PrefillBatch` into the
    buffers. ``signature`` is the registry signature the caller has just checked
    (:meth:`BufferRegistry.check`); the buffers' addresses are then read once per
    signature, not per call. The first batch of each *configuration* takes the
    full path of :func:`plan_stage_batch` (every check, then the launch, which
    compiles); its compiled kernel is kept under that configuration: the dtype,
    device and layout class of every input, the table's and media's widths,
    ``expand``, whether ``text_scale`` is given, ``media_owner`` and which optional
    slots are given. Later batches of a kept configuration are checked only on what
    can differ between batches of one configuration (lengths, batch size,
    ``pad_to``, vocabulary bounds, 16-byte alignment) and launched with integer
    arguments. Integer inputs are all on the device or all on the host; host ones
    travel in one pinned buffer and one copy. Everything else (mixed sides, an
    unaligned pointer, no signature, the interpreter, a launch hook) takes the full
    path, which raises the full path's errors. Nothing is written before every
    check has passed.
    """

    def __init__(self, buffers: StagingBuffers) -> None:
        self.buffers = buffers
        self.device_index = buffers.device.index
        self.enabled = triton is not None and _launch.enabled and buffers.device.type == "cuda"
        self._stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._one = torch.zeros(1, dtype=torch.int64)  # keeps packed host parts 16-byte aligned
        self._sig = self._errors = None
        self._static: _Static | None = None
        self._entries: dict = {}
        self.fast_launches = 0  # batches that took the cached path (for tests and profiling)

    def __call__(self, batch, pad_to: int, signature=None) -> None:
        key = self._fast(batch, pad_to, signature) if self.enabled and signature is not None else None
        if key is True:
            self.fast_launches += 1
            return
        info = plan_stage_batch(
            self.buffers, input_ids=batch.input_ids, positions=batch.positions, table=batch.table,
            out_cache_loc=batch.out_cache_loc, mrope_positions=batch.mrope_positions, seq_lens=batch.seq_lens,
            extend_start_loc=batch.extend_start_loc, media=batch.media, media_index=batch.media_index,
            expand=batch.expand, text_scale=batch.text_scale, vocab_range=batch.vocab_range,
            vocab_size=batch.vocab_size, media_owner=batch.media_owner, pad_to=pad_to)()
        if key is not None and info is not None:
            entry = _launch.lookup(*info)
            if entry is not None:
                kernel, tail = entry
                self._entries[key] = (kernel.run, kernel.function, kernel.packed_metadata, tail,
                                      info[1]["COL_BLOCKS"])

    def _refresh(self, signature) -> None:
        """Read the buffers' side of the launch under ``signature``; forget every kept configuration."""
        buf = self.buffers
        dsts, fills, _, _ = _static(buf)
        slab, errors = buf.input_embeds, buf.errors
        self._sig, self._errors, self._static, self._entries = signature, errors, None, {}
        st = _Static()
        st.slab, st.errors = slab.data_ptr(), errors.data_ptr()
        st.dsts = tuple(d.data_ptr() for d in dsts)  # an absent source is passed as its destination
        st.fills = fills
        st.mrope_dst_stride = dsts[3].stride(0)
        st.width, st.capacity, st.batch_cap = slab.shape[1], buf.registry.capacity, buf.max_batch_size
        ptr_or = st.slab | st.errors
        for p in st.dsts:
            ptr_or |= p
        if not ptr_or & 15:
            self._static = st

    def _fast(self, batch, pad_to: int, signature):
        """Launch ``batch`` on the cached path (True), or say why not: its configuration key (not
        kept yet) or None (not eligible). Reads every input attribute once; writes nothing else
        before the launch."""
        if _hooks_set():
            return None
        if signature is not self._sig or self.buffers.errors is not self._errors:
            self._refresh(signature)
        st = self._static
        if st is None:
            return None
        try:
            ids, pos, table = batch.input_ids, batch.positions, batch.table
            ishape = ids.shape
            if len(ishape) != 1 or pos.shape != ishape:
                return None
            n = ishape[0]
            if not 0 < n <= pad_to <= st.capacity:
                return None
            tshape, tstride = table.shape, table.stride()
            dev = self.device_index
            side = ids.get_device()  # every integer input on the device, or every one on the host
            if len(tshape) != 2 or table.get_device() != dev or pos.get_device() != side \
                    or (side != dev and side != -1):
                return None
            scale = batch.text_scale
            key = [side, ids.dtype, ids.is_contiguous(), pos.dtype, pos.is_contiguous(),
                   type(table), table.dtype, tshape[1], tstride[1], int_spec(tstride[0]),
                   batch.expand, scale is None, bool(batch.media_owner)]
            if scale is None:
                scale = 1.0
            elif type(scale) is not float:
                return None
            ints = [ids, pos]  # in the order of the kernel's sources: ids pos loc mrope seq ext, index last
            media = batch.media
            if media is None:
                p_media, num_media, media_stride = st.slab, 0, st.width
                key.append(None)
            else:
                mshape, mstride = media.shape, media.stride()
                if len(mshape) != 2 or media.get_device() != dev:
                    return None
                p_media, num_media, media_stride = media.data_ptr(), mshape[0], mstride[0]
                key.append((type(media), media.dtype, mshape[1], mstride[1], int_spec(media_stride)))
            loc = batch.out_cache_loc
            if loc is None:
                key.append(None)
            else:
                if loc.shape != ishape or loc.get_device() != side:
                    return None
                ints.append(loc)
                key.append((loc.dtype, loc.is_contiguous()))
            mrope = batch.mrope_positions
            if mrope is None:
                mrope_stride = st.mrope_dst_stride
                key.append(None)
            else:
                rshape, rstride = mrope.shape, mrope.stride()
                if len(rshape) != 2 or rshape[0] != 3 or rshape[1] != n or rstride[1] != 1 \
                        or mrope.get_device() != side:
                    return None
                mrope_stride = rstride[0] if side == dev else n  # host rows are packed back to back
                ints.append(mrope if side == dev else mrope.reshape(-1))
                key.append(mrope.dtype)  # its row stride (n when contiguous) is not specialised on
            seq, ext = batch.seq_lens, batch.extend_start_loc
            if seq is None and ext is None:
                b = 0
                key.append(None)
            elif seq is not None and ext is not None:
                sshape = seq.shape
                if len(sshape) != 1 or ext.shape != sshape or sshape[0] > st.batch_cap \
                        or seq.get_device() != side or ext.get_device() != side:
                    return None
                b = sshape[0]
                ints += (seq, ext)
                key.append((seq.dtype, seq.is_contiguous(), ext.dtype, ext.is_contiguous()))
            else:
                return None
            index = batch.media_index
            if index is None:
                key.append(None)
            else:
                if index.shape != ishape or index.get_device() != side:
                    return None
                ints.append(index)
                key.append((index.dtype, index.is_contiguous()))
            if batch.vocab_range is None and batch.vocab_size is None:
                vocab_start, vocab_end, vocab_size = 0, tshape[0], tshape[0]
            else:
                vocab_start, vocab_end, vocab_size = vocab_bounds(batch.vocab_range, batch.vocab_size, tshape[0])
        except (AttributeError, TypeError, ValueError, IndexError):
            return None  # not a well-formed batch: the full path names the problem
        key = tuple(key)
        entry = self._entries.get(key)
        if entry is None:
            return key
        p_table = table.data_ptr()
        align = p_media | p_table
        if side == dev:
            ptrs = [t.data_ptr() for t in ints]
            for p in ptrs:
                align |= p
        if align & 15:
            return None
        if side != dev:  # host inputs: one pinned buffer, one copy, every part 16-byte aligned
            for t in ints:
                if not t.is_cpu:  # get_device() is -1 off CUDA too (meta, ...)
                    return None
            ptrs, keep = self._pack(ints)  # noqa: F841 - keep the device copy alive until the launch
        dsts = st.dsts
        it = iter(ptrs)
        p_ids, p_pos = next(it), next(it)
        p_loc = next(it) if loc is not None else dsts[2]  # an absent source is passed as its destination
        p_mrope = next(it) if mrope is not None else dsts[3]
        p_seq, p_ext = (next(it), next(it)) if seq is not None else (dsts[4], dsts[5])
        p_index = next(it) if index is not None else p_ids
        run, function, metadata, tail, col_blocks = entry
        run(pad_to * col_blocks, 1, 1, self._stream(self.device_index), function, metadata, None, None, None,
            st.slab, p_ids, p_table, p_media, p_index, st.errors,
            n, pad_to, vocab_start, vocab_end, vocab_size, num_media, scale,
            st.width, tstride[0], media_stride,
            p_ids, p_pos, p_loc, p_mrope, p_seq, p_ext, *dsts,
            n, pad_to, b, st.batch_cap, mrope_stride, st.mrope_dst_stride, *st.fills, *tail)
        return True

    def _pack(self, ints: list) -> tuple[list, torch.Tensor]:
        """Host tensors -> one int64 device tensor through one pinned buffer; the parts' device addresses.

        The pinned buffer comes from PyTorch's caching host allocator, which does not
        hand it out again before the copy has read it; the device tensor is freed
        in stream order after the launch that reads it.
        """
        parts, offsets, at = [], [], 0
        for t in ints:
            k = t.shape[0]
            parts.append(t)
            offsets.append(at)
            at += k
            if k & 1:
                parts.append(self._one)
                at += 1
        pinned = torch.empty(at, dtype=torch.int64, pin_memory=self.buffers.device.type == "cuda")
        torch.cat(parts, out=pinned)
        packed = pinned.to(self.buffers.device, non_blocking=True)
        base = packed.data_ptr()
        return [base + 8 * o for o in offsets], packed
