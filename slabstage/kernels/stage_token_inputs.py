"""stage_token_inputs: every integer slot of a batch copied and padded in one launch."""

from __future__ import annotations

from functools import partial

import torch

from ..staging.buffers import StagingBuffers
from ._launch import FastLaunch, int_spec
from ._triton import next_pow2, tl, triton, use_triton
from .reference import stage_token_inputs_reference

__all__ = ["stage_token_inputs", "plan_stage_token_inputs"]

_TOKEN_SLOTS = ("input_ids", "positions", "out_cache_loc")
_REQUEST_SLOTS = ("seq_lens", "extend_start_loc")
_SLOTS = (*_TOKEN_SLOTS, "mrope_positions", *_REQUEST_SLOTS)

if triton is not None:

    @triton.jit
    def _copy_pad(src_ptr, dst_ptr, offs, count, limit, fill, PAD: tl.constexpr):
        """dst[offs] = src[offs] below count; = fill in [count, limit) when PAD."""
        keep = offs < count
        val = tl.load(src_ptr + offs, mask=keep, other=0)
        if PAD:
            val = tl.where(keep, val, fill)
            tl.store(dst_ptr + offs, val.to(dst_ptr.dtype.element_ty), mask=offs < limit)
        else:
            tl.store(dst_ptr + offs, val.to(dst_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _token_rows(
        offs, first, ids_src, pos_src, loc_src, mrope_src, seq_src, ext_src,
        ids_dst, pos_dst, loc_dst, mrope_dst, seq_dst, ext_dst, ntok_dst,
        n, pad_to, b, batch_cap, stride_mrope_src, stride_mrope_dst,
        ids_fill, pos_fill, loc_fill, mrope_fill, seq_fill, ext_fill,
        PAD_IDS: tl.constexpr, PAD_POS: tl.constexpr, PAD_LOC: tl.constexpr, PAD_MROPE: tl.constexpr,
        PAD_SEQ: tl.constexpr, PAD_EXT: tl.constexpr,
        HAS_LOC: tl.constexpr, HAS_MROPE: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_EXT: tl.constexpr,
        REQ_BLOCK: tl.constexpr,
    ):
        """Token slots at rows ``offs``; the ``first`` program also writes the per-request slots."""
        _copy_pad(ids_src, ids_dst, offs, n, pad_to, ids_fill, PAD_IDS)
        _copy_pad(pos_src, pos_dst, offs, n, pad_to, pos_fill, PAD_POS)
        if HAS_LOC:
            _copy_pad(loc_src, loc_dst, offs, n, pad_to, loc_fill, PAD_LOC)
        if HAS_MROPE:
            for k in tl.static_range(3):
                _copy_pad(mrope_src + k * stride_mrope_src, mrope_dst + k * stride_mrope_dst,
                          offs, n, pad_to, mrope_fill, PAD_MROPE)
        if first:  # per-request slots and the token count: small, one program
            req = tl.arange(0, REQ_BLOCK)
            if HAS_SEQ:
                _copy_pad(seq_src, seq_dst, req, b, batch_cap, seq_fill, PAD_SEQ)
            if HAS_EXT:
                _copy_pad(ext_src, ext_dst, req, b, batch_cap, ext_fill, PAD_EXT)
            tl.store(ntok_dst, n.to(ntok_dst.dtype.element_ty))

    @triton.jit(do_not_specialize=["n", "pad_to", "b"])
    def _stage_token_inputs_kernel(
        ids_src, pos_src, loc_src, mrope_src, seq_src, ext_src,
        ids_dst, pos_dst, loc_dst, mrope_dst, seq_dst, ext_dst, ntok_dst,
        n, pad_to, b, batch_cap, stride_mrope_src, stride_mrope_dst,
        ids_fill, pos_fill, loc_fill, mrope_fill, seq_fill, ext_fill,
        PAD_IDS: tl.constexpr, PAD_POS: tl.constexpr, PAD_LOC: tl.constexpr, PAD_MROPE: tl.constexpr,
        PAD_SEQ: tl.constexpr, PAD_EXT: tl.constexpr,
        HAS_LOC: tl.constexpr, HAS_MROPE: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_EXT: tl.constexpr,
        REQ_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        _token_rows(
            pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK), pid == 0,
            ids_src, pos_src, loc_src, mrope_src, seq_src, ext_src,
            ids_dst, pos_dst, loc_dst, mrope_dst, seq_dst, ext_dst, ntok_dst,
            n, pad_to, b, batch_cap, stride_mrope_src, stride_mrope_dst,
            ids_fill, pos_fill, loc_fill, mrope_fill, seq_fill, ext_fill,
            PAD_IDS, PAD_POS, PAD_LOC, PAD_MROPE, PAD_SEQ, PAD_EXT, HAS_LOC, HAS_MROPE, HAS_SEQ, HAS_EXT,
            REQ_BLOCK)


def _check_int_input(name: str, t: object, length: int | None, device: torch.device, rows: int = 0) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64 and t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device and t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; expected {device} or a host (CPU) tensor")
    shape = t.shape
    if rows:
        if len(shape) != 2 or shape[0] != rows or shape[1] != length:
            raise ValueError(f"{name} must have shape ({rows}, {length}), got {tuple(shape)}")
    elif len(shape) != 1 or (length is not None and shape[0] != length):
        want = "1-D" if length is None else f"shape ({length},)"
        raise ValueError(f"{name} must be {want}, got shape {tuple(shape)}")
    if shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last axis, got stride {t.stride()}")


def stage_token_inputs(
    buffers: StagingBuffers,
    *,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor | None = None,
    mrope_positions: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    extend_start_loc: torch.Tensor | None = None,
    pad_to: int,
) -> None:
    """Copy a batch's integer inputs into ``buffers`` and pad each tail, in one launch.

    Token slots (``input_ids``, ``positions``, ``out_cache_loc``: ``[n]``;
    ``mrope_positions``: ``[3, n]``) fill ``[0, n)`` and get their slot's pad value
    in ``[n, pad_to)``; per-request slots (``seq_lens``, ``extend_start_loc``:
    ``[b]``) fill ``[0, b)`` and are padded to the buffer's ``max_batch_size``;
    ``num_tokens_non_padded`` becomes ``n``. Slots not given are left as they are.

    Inputs are int32/int64 tensors on the buffers' device or on the host; host
    inputs are packed into one pinned tensor and moved in one non-blocking copy.
    Raises ``TypeError``/``ValueError`` before anything is written.
    """
    plan_stage_token_inputs(buffers, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                            mrope_positions=mrope_positions, seq_lens=seq_lens,
                            extend_start_loc=extend_start_loc, pad_to=pad_to)()


def plan_stage_token_inputs(buffers, *, input_ids, positions, out_cache_loc=None, mrope_positions=None,
                            seq_lens=None, extend_start_loc=None, pad_to):
    """Check every argument of :func:`stage_token_inputs`; return the launch, not yet run."""
    given, n, b = check_token_inputs(
        buffers, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
        mrope_positions=mrope_positions, seq_lens=seq_lens, extend_start_loc=extend_start_loc, pad_to=pad_to)
    return partial(_launch, buffers, given, n, pad_to, b)


def check_token_inputs(buffers, *, input_ids, positions, out_cache_loc=None, mrope_positions=None,
                       seq_lens=None, extend_start_loc=None, pad_to) -> tuple[dict, int, int]:
    """Raise on any bad argument; return ``(given slots, n, b)``."""
    reg = buffers.registry
    device = buffers.device
    _check_int_input("input_ids", input_ids, None, device)
    n = input_ids.shape[0]
    _check_int_input("positions", positions, n, device)
    given = {"input_ids": input_ids, "positions": positions}
    if out_cache_loc is not None:
        _check_int_input("out_cache_loc", out_cache_loc, n, device)
        given["out_cache_loc"] = out_cache_loc
    if mrope_positions is not None:
        if "mrope_positions" not in reg:
            raise ValueError("mrope_positions given but the buffers were allocated without mrope=True")
        _check_int_input("mrope_positions", mrope_positions, n, device, rows=3)
        given["mrope_positions"] = mrope_positions
    b = 0
    if seq_lens is not None:
        _check_int_input("seq_lens", seq_lens, None, device)
        b = seq_lens.shape[0]
        given["seq_lens"] = seq_lens
    if extend_start_loc is not None:
        _check_int_input("extend_start_loc", extend_start_loc, b if seq_lens is not None else None, device)
        b = extend_start_loc.shape[0]
        given["extend_start_loc"] = extend_start_loc
    capacity = reg.capacity
    if isinstance(pad_to, bool) or not isinstance(pad_to, int) or not n <= pad_to <= capacity:
        raise ValueError(f"pad_to must be an int in [n={n}, capacity={capacity}], got {pad_to!r}")
    if b > buffers.max_batch_size:
        raise ValueError(f"{b} requests exceed max_batch_size={buffers.max_batch_size}")
    for name in given:
        _check_slot(reg, name, buffers.max_batch_size)
    return given, n, b


def _check_slot(reg, name: str, batch_cap: int) -> None:
    """The kernel writes slot ``name`` as a row-contiguous vector (three for mrope) up to its
    capacity: a missing, reshaped, strided or (per-request) too short slot would be written
    out of bounds, or another slot written instead."""
    if name not in reg:
        raise ValueError(f"{name} given but the buffers have no {name!r} slot")
    t = reg[name]
    rows = 3 if name == "mrope_positions" else 0
    if t.dim() != (2 if rows else 1) or (rows and t.shape[0] != rows) or (t.shape[-1] > 1 and t.stride(-1) != 1):
        want = "[3, tokens] with contiguous rows" if rows else "1-D and contiguous"
        raise ValueError(f"slot {name!r} must be {want}, got shape {tuple(t.shape)} stride {t.stride()}")
    if name in _REQUEST_SLOTS and t.shape[0] < batch_cap:
        raise ValueError(f"slot {name!r} holds {t.shape[0]} requests but is padded to "
                         f"max_batch_size={batch_cap}")


def pack_host_inputs(buffers: StagingBuffers, given: dict) -> dict:
    """Move every host tensor of ``given`` to the device in one non-blocking copy from pinned memory.

    Each part is int64 and starts 16-byte aligned in the buffers' device scratch.
    """
    device = buffers.device
    host = [k for k, v in given.items() if v.device != device]
    if not host:
        return given
    sizes = [given[k].numel() for k in host]
    spans = [s + (s & 1) for s in sizes]  # keep every part 16-byte aligned
    pinned = torch.empty(sum(spans), dtype=torch.int64, pin_memory=device.type == "cuda")
    for part, k in zip(torch.split(pinned, spans), host):
        part[:given[k].numel()].copy_(given[k].reshape(-1))
    scratch = buffers.token_scratch(sum(spans))
    scratch.copy_(pinned, non_blocking=True)
    out = dict(given)
    for k, part, size in zip(host, torch.split(scratch, spans), sizes):
        out[k] = part[:size].view(given[k].shape)
    return out


def _launch(buffers: StagingBuffers, given: dict, n: int, pad_to: int, b: int) -> None:
    given = pack_host_inputs(buffers, given)
    if not use_triton(buffers.input_ids):
        reg = buffers.registry
        slots = [(reg[k], given.get(k), reg.slot(k).fill_value, k in _REQUEST_SLOTS)
                 for k in _SLOTS if k in given]
        stage_token_inputs_reference(slots, n, pad_to, b, buffers.max_batch_size, buffers.num_tokens_non_padded)
        return
    args, constexprs, key = token_launch(buffers, given, n, pad_to, b)
    constexprs["BLOCK"] = _BLOCK
    _fast_launch((max(1, triton.cdiv(pad_to, _BLOCK)),), key, args, constexprs, 4)


def token_launch(buffers: StagingBuffers, given: dict, n: int, pad_to: int, b: int) -> tuple:
    """``(args, constexprs, key)`` of the token rows for device-resident ``given`` (key None: unaligned).

    The key covers the runtime arguments only; :class:`FastLaunch` adds the constexprs.
    """
    dsts, fills, pads, static_key = _static(buffers)
    srcs = tuple(given.get(k, d) for k, d in zip(_SLOTS, dsts))
    ptr_or = 0
    for t in (*srcs, *dsts):  # read each call: a slot moved in place keeps the registry version
        ptr_or |= t.data_ptr()
    has = tuple(k in given for k in _SLOTS)
    args = (*srcs, *dsts, n, pad_to, b, buffers.max_batch_size, srcs[3].stride(0), dsts[3].stride(0), *fills)
    constexprs = dict(
        PAD_IDS=pads[0], PAD_POS=pads[1], PAD_LOC=pads[2] and has[2], PAD_MROPE=pads[3] and has[3],
        PAD_SEQ=pads[4] and has[4], PAD_EXT=pads[5] and has[5], HAS_LOC=has[2], HAS_MROPE=has[3],
        HAS_SEQ=has[4], HAS_EXT=has[5], REQ_BLOCK=next_pow2(buffers.max_batch_size))
    key = (static_key, tuple(t.dtype for t in srcs), int_spec(args[17]), int_spec(args[18]), has) \
        if not ptr_or & 15 else None
    return args, constexprs, key


_BLOCK = 1024


def _static(buffers: StagingBuffers) -> tuple:
    """Destinations, fills, pad switches and the dtype part of the key; cached per registry version.

    Addresses and strides are not cached: ``set_``/``resize_`` change them without a new version.
    """
    reg = buffers.registry
    cached = buffers.__dict__.get("_token_launch_static")
    if cached is not None and cached[0] == reg._version:
        return cached[1]
    dsts, fills, pads = [], [], []
    for name in _SLOTS:
        present = name in reg
        fill = reg.slot(name).fill_value if present else None
        dsts.append(reg[name] if present else buffers.input_ids)
        fills.append(int(fill or 0))
        pads.append(fill is not None)
    dsts.append(buffers.num_tokens_non_padded)
    static_key = (tuple(t.dtype for t in dsts), tuple(fills), tuple(pads), int_spec(buffers.max_batch_size))
    value = (tuple(dsts), tuple(fills), tuple(pads), static_key)
    buffers._token_launch_static = (reg._version, value)
    return value


_fast_launch = FastLaunch(_stage_token_inputs_kernel, ptr_args=tuple(range(13))) if triton is not None else None
