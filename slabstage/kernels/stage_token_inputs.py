"""stage_token_inputs: every integer slot of a batch copied and padded in one launch."""

from __future__ import annotations

from functools import partial

import torch

from ..staging.buffers import StagingBuffers
from ._triton import next_pow2, tl, triton, use_triton
from .reference import stage_token_inputs_reference

__all__ = ["stage_token_inputs", "plan_stage_token_inputs"]

_TOKEN_SLOTS = ("input_ids", "positions", "out_cache_loc")
_REQUEST_SLOTS = ("seq_lens", "extend_start_loc")

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

    @triton.jit(do_not_specialize=["n", "pad_to", "b"])
    def _stage_token_inputs_kernel(
        ids_src, ids_dst, pos_src, pos_dst, loc_src, loc_dst, mrope_src, mrope_dst,
        seq_src, seq_dst, ext_src, ext_dst, ntok_dst,
        n, pad_to, b, batch_cap, stride_mrope_src, stride_mrope_dst,
        ids_fill, pos_fill, loc_fill, mrope_fill, seq_fill, ext_fill,
        PAD_IDS: tl.constexpr, PAD_POS: tl.constexpr, PAD_LOC: tl.constexpr, PAD_MROPE: tl.constexpr,
        PAD_SEQ: tl.constexpr, PAD_EXT: tl.constexpr,
        HAS_LOC: tl.constexpr, HAS_MROPE: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_EXT: tl.constexpr,
        BLOCK: tl.constexpr, REQ_BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        _copy_pad(ids_src, ids_dst, offs, n, pad_to, ids_fill, PAD_IDS)
        _copy_pad(pos_src, pos_dst, offs, n, pad_to, pos_fill, PAD_POS)
        if HAS_LOC:
            _copy_pad(loc_src, loc_dst, offs, n, pad_to, loc_fill, PAD_LOC)
        if HAS_MROPE:
            for k in tl.static_range(3):
                _copy_pad(mrope_src + k * stride_mrope_src, mrope_dst + k * stride_mrope_dst,
                          offs, n, pad_to, mrope_fill, PAD_MROPE)
        if pid == 0:  # per-request slots and the token count: small, one program
            req = tl.arange(0, REQ_BLOCK)
            if HAS_SEQ:
                _copy_pad(seq_src, seq_dst, req, b, batch_cap, seq_fill, PAD_SEQ)
            if HAS_EXT:
                _copy_pad(ext_src, ext_dst, req, b, batch_cap, ext_fill, PAD_EXT)
            tl.store(ntok_dst, n.to(ntok_dst.dtype.element_ty))


def _check_int_input(name: str, t: torch.Tensor, length: int, device: torch.device, rows: int = 0) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device and t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; expected {device} or a host (CPU) tensor")
    want = (rows, length) if rows else (length,)
    if tuple(t.shape) != want:
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if length > 1 and t.stride(-1) != 1:
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
    reg = buffers.registry
    device = buffers.device
    n = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1 else -1
    _check_int_input("input_ids", input_ids, n, device)
    _check_int_input("positions", positions, n, device)
    if out_cache_loc is not None:
        _check_int_input("out_cache_loc", out_cache_loc, n, device)
    if mrope_positions is not None:
        if "mrope_positions" not in reg:
            raise ValueError("mrope_positions given but the buffers were allocated without mrope=True")
        _check_int_input("mrope_positions", mrope_positions, n, device, rows=3)
    per_request = {k: v for k, v in (("seq_lens", seq_lens), ("extend_start_loc", extend_start_loc))
                   if v is not None}
    first = next(iter(per_request.values()), None)
    b = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() == 1 else 0
    for name, t in per_request.items():
        _check_int_input(name, t, b, device)
    capacity = reg.capacity
    if isinstance(pad_to, bool) or not isinstance(pad_to, int) or not n <= pad_to <= capacity:
        raise ValueError(f"pad_to must be an int in [n={n}, capacity={capacity}], got {pad_to!r}")
    if b > buffers.max_batch_size:
        raise ValueError(f"{b} requests exceed max_batch_size={buffers.max_batch_size}")

    given = {"input_ids": input_ids, "positions": positions, "out_cache_loc": out_cache_loc,
             "mrope_positions": mrope_positions, **per_request}
    given = {k: v for k, v in given.items() if v is not None}
    return partial(_launch, buffers, given, n, pad_to, b)


def _launch(buffers: StagingBuffers, given: dict, n: int, pad_to: int, b: int) -> None:
    reg, device = buffers.registry, buffers.device
    host = [k for k, v in given.items() if v.device != device]
    if host:  # one packed non-blocking copy instead of one per slot
        sizes = [given[k].numel() for k in host]
        pinned = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
        torch.cat([given[k].reshape(-1).to(torch.int64) for k in host], out=pinned)
        scratch = buffers.token_scratch(sum(sizes))
        scratch.copy_(pinned, non_blocking=True)
        given = dict(given)
        for k, part in zip(host, torch.split(scratch, sizes)):
            given[k] = part.view(given[k].shape)

    if not use_triton(buffers.input_ids):
        slots = [(reg[k], given.get(k), reg.slot(k).fill_value, k in _REQUEST_SLOTS)
                 for k in (*_TOKEN_SLOTS, "mrope_positions", *_REQUEST_SLOTS) if k in given]
        stage_token_inputs_reference(slots, n, pad_to, b, buffers.max_batch_size, buffers.num_tokens_non_padded)
        return

    def arg(name):  # source, destination, fill, pad?
        dst = reg[name] if name in reg else buffers.input_ids
        fill = reg.slot(name).fill_value if name in reg else None
        return given.get(name, dst), dst, int(fill or 0), fill is not None and name in given

    ids, pos, loc, mrope = (arg(k) for k in (*_TOKEN_SLOTS, "mrope_positions"))
    seq, ext = (arg(k) for k in _REQUEST_SLOTS)
    block = 1024
    _stage_token_inputs_kernel[(max(1, triton.cdiv(pad_to, block)),)](
        ids[0], ids[1], pos[0], pos[1], loc[0], loc[1], mrope[0], mrope[1],
        seq[0], seq[1], ext[0], ext[1], buffers.num_tokens_non_padded,
        n, pad_to, b, buffers.max_batch_size, mrope[0].stride(0), mrope[1].stride(0),
        ids[2], pos[2], loc[2], mrope[2], seq[2], ext[2],
        PAD_IDS=ids[3], PAD_POS=pos[3], PAD_LOC=loc[3], PAD_MROPE=mrope[3], PAD_SEQ=seq[3], PAD_EXT=ext[3],
        HAS_LOC="out_cache_loc" in given, HAS_MROPE="mrope_positions" in given,
        HAS_SEQ="seq_lens" in given, HAS_EXT="extend_start_loc" in given,
        BLOCK=block, REQ_BLOCK=next_pow2(buffers.max_batch_size), num_warps=4,
    )
