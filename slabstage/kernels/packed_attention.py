"""Packed prefill attention over requests laid end to end, with each request's cached prefix read from a paged
KV cache. No ``[T, T]`` tensor anywhere.

Request ``r`` holds rows ``[starts[r], starts[r] + lens[r])`` of ``q``/``k``/``v`` (``[T, heads, head_dim]``);
query row ``i`` of it (its token ``prefix[r] + i``) attends to the request's ``prefix[r]`` cached tokens (slots
``req_to_token[req[r], :prefix[r]]`` of ``k_cache``/``v_cache``, ``[slots, kv_heads, head_dim]``) and to its own
chunk's rows ``0..i``. Query head ``h`` reads kv head ``h // (heads // kv_heads)`` (GQA). Rows in no request get
zeros. When every ``lens`` is 0 (a batch staged without ``seq_lens``) the first ``count`` rows are one request.

:func:`packed_attention` is the Triton kernel (one program per ``BLOCK_M`` query rows of one request and one
head, fp32 accumulation, online softmax); its grid and loop bounds depend only on the bucket's shapes and on
values read on the device, so a CUDA graph replays it for any batch. :func:`packed_attention_reference` is the
PyTorch path (a loop over requests, SDPA each; reads the lengths on the host) for CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import INTERPRET

__all__ = ["packed_attention", "packed_attention_reference", "request_offsets"]


def request_offsets(seq_lens, starts, prefix_lens, req_indices, count, block_m: int, *, has_prefix: bool = True):
    """``(lens, starts, prefix, req, tile_end)`` int32 ``[B]`` on the device: the staged per-request slots as
    the kernel reads them (one request of ``count`` rows when no lengths were staged; prefix 0 when there is no
    cache) and each request's end in the list of ``block_m``-row query tiles. Device ops only (capturable)."""
    lens = seq_lens.to(torch.int32)
    first = torch.arange(lens.shape[0], device=lens.device) == 0
    none = lens.sum() == 0
    lens = torch.where(none & first, count.to(torch.int32), lens)
    starts = torch.where(none, torch.zeros_like(starts, dtype=torch.int32), starts.to(torch.int32))
    prefix = prefix_lens.to(torch.int32) if has_prefix else torch.zeros_like(lens)
    req = req_indices.to(torch.int32)
    tile_end = torch.cumsum((lens + block_m - 1) // block_m, 0).to(torch.int32)
    return lens, starts, prefix, req, tile_end


@triton.jit
def _softmax_step(q, k, v, valid, acc, m_i, l_i, scale_log2, PRECISION: tl.constexpr):
    """One key tile of the online softmax: ``(acc, m_i, l_i)`` after keys ``k``/values ``v`` (``valid``: which
    (query, key) pairs count), fp32."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to scale
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _prefix_tile(q, acc, m_i, l_i, n0, prefix, table, KC, VC, skc_s, skc_h, svc_s, svc_h, kvh, offs_d, d_ok,
                 scale_log2, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < prefix
    slot = tl.load(table + offs_n, mask=n_ok, other=0).to(tl.int64)
    kv_ok = n_ok[:, None] & d_ok[None, :]
    k = tl.load(KC + slot[:, None] * skc_s + kvh * skc_h + offs_d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(VC + slot[:, None] * svc_s + kvh * svc_h + offs_d[None, :], mask=kv_ok, other=0.0)
    return _softmax_step(q, k, v, n_ok[None, :], acc, m_i, l_i, scale_log2, PRECISION)


@triton.jit
def _chunk_tile(q, acc, m_i, l_i, n0, length, start, offs_m, K, V, sk_t, sk_h, sv_t, sv_h, kvh, offs_d, d_ok,
                scale_log2, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < length
    keys = (start + offs_n).to(tl.int64)
    kv_ok = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + keys[:, None] * sk_t + kvh * sk_h + offs_d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(V + keys[:, None] * sv_t + kvh * sv_h + offs_d[None, :], mask=kv_ok, other=0.0)
    valid = n_ok[None, :] & (offs_n[None, :] <= offs_m[:, None])
    return _softmax_step(q, k, v, valid, acc, m_i, l_i, scale_log2, PRECISION)


@triton.jit
def _packed_attention_kernel(Q, K, V, KC, VC, TABLE, OUT, LENS, STARTS, PREFIX, REQ, TILE_END,
                             sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, skc_s, skc_h, svc_s, svc_h, s_table,
                             num_requests, group, scale_log2,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, HAS_CACHE: tl.constexpr,
                             PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    rr = tl.arange(0, BLOCK_B)
    ends = tl.load(TILE_END + rr, mask=rr < num_requests, other=2147483647)
    r = tl.sum((ends <= pid).to(tl.int32), 0)  # the request whose tiles hold tile pid
    if r < num_requests:
        first_tile = tl.load(TILE_END + r - 1, mask=r > 0, other=0)
        m0 = (pid - first_tile) * BLOCK_M
        length = tl.load(LENS + r)
        start = tl.load(STARTS + r)
        kvh = h // group
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < length
        d_ok = offs_d < HEAD_DIM
        rows = (start + offs_m).to(tl.int64)
        q = tl.load(Q + rows[:, None] * sq_t + h * sq_h + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if HAS_CACHE:  # the cached prefix: every row sees all of it
            prefix = tl.load(PREFIX + r)
            table = TABLE + tl.load(REQ + r).to(tl.int64) * s_table
            if INTERPRET:  # (the interpreter takes no loaded loop bound in range())
                n0 = 0
                while n0 < prefix:
                    acc, m_i, l_i = _prefix_tile(q, acc, m_i, l_i, n0, prefix, table, KC, VC, skc_s, skc_h, svc_s,
                                                 svc_h, kvh, offs_d, d_ok, scale_log2, BLOCK_N, PRECISION)
                    n0 += BLOCK_N
            else:
                for n0 in range(0, prefix, BLOCK_N):
                    acc, m_i, l_i = _prefix_tile(q, acc, m_i, l_i, n0, prefix, table, KC, VC, skc_s, skc_h, svc_s,
                                                 svc_h, kvh, offs_d, d_ok, scale_log2, BLOCK_N, PRECISION)
        stop = tl.minimum(length, m0 + BLOCK_M)  # the chunk itself, causal
        if INTERPRET:
            n0 = 0
            while n0 < stop:
                acc, m_i, l_i = _chunk_tile(q, acc, m_i, l_i, n0, length, start, offs_m, K, V, sk_t, sk_h, sv_t, sv_h,
                                            kvh, offs_d, d_ok, scale_log2, BLOCK_N, PRECISION)
                n0 += BLOCK_N
        else:
            for n0 in range(0, stop, BLOCK_N):
                acc, m_i, l_i = _chunk_tile(q, acc, m_i, l_i, n0, length, start, offs_m, K, V, sk_t, sk_h, sv_t, sv_h,
                                            kvh, offs_d, d_ok, scale_log2, BLOCK_N, PRECISION)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + rows[:, None] * so_t + h * so_h + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


def _config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a head dim and dtype."""
    if dtype == torch.float32:
        return 64, 32, 4, 2
    if head_dim <= 64:
        return 128, 64, 4, 3
    return 64, 64, 4, 3  # (H200, head dim 128, bf16: 0.51 ms a layer at 16 x 1024 against 0.67 for 128 x 64 tiles)


def block_m_for(head_dim: int, dtype: torch.dtype) -> int:
    return _config(head_dim, dtype)[0]


def _smaller(config: tuple) -> tuple | None:
    """The next config to try where ``config`` needs more shared memory than the GPU has (a head dim past 128,
    a GPU with less than an H200's 227 KiB a block): one pipeline stage fewer, then key tiles half as long;
    None past ``BLOCK_N`` 16, one stage. ``BLOCK_M`` stays: the caller's tile offsets were made for it."""
    block_m, block_n, warps, stages = config
    if stages > 1:
        return block_m, block_n, warps, stages - 1
    return (block_m, block_n // 2, warps, 1) if block_n > 16 else None


_FITS: dict = {}  # (head_dim, dtype, device) -> the config that loaded there, when _config's did not


def packed_attention(q, k, v, offsets, scale: float, k_cache=None, v_cache=None, table=None, *,
                     config: tuple | None = None) -> torch.Tensor:
    """``[T, H, D]``: the attention above through the Triton kernel. ``offsets``: :func:`request_offsets`'s tuple,
    or a callable ``offsets(block_m)`` returning it. ``k_cache``/``v_cache``/``table`` None: no prefix is read."""
    T, H, D = q.shape
    fits = (D, q.dtype, q.device)
    chosen = config = config or _FITS.get(fits) or _config(D, q.dtype)
    lens, starts, prefix, req, tile_end = offsets(config[0]) if callable(offsets) else offsets
    B = lens.shape[0]
    out = torch.zeros(T, H, D, dtype=q.dtype, device=q.device)  # contiguous: HF's reshape after needs no copy
    has_cache = k_cache is not None
    if not has_cache:
        k_cache, v_cache, table = k, v, lens  # (unread)
    grid = (triton.cdiv(T, config[0]) + B, H)
    args = (q, k, v, k_cache, v_cache, table, out, lens, starts, prefix, req, tile_end,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            table.stride(0) if has_cache else 0, B, H // k.shape[1], scale * 1.4426950408889634)
    while True:
        block_m, block_n, warps, stages = config
        try:  # (a config that does not fit raises when its kernel loads, before anything is launched)
            _packed_attention_kernel[grid](
                *args, HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)),  # (tl.dot takes K >= 16)
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_B=triton.next_power_of_2(B), HAS_CACHE=has_cache,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", INTERPRET=INTERPRET,
                num_warps=warps, num_stages=stages)
        except triton.OutOfResources:
            config = _smaller(config)
            if config is None:
                raise
            continue
        if config is not chosen:
            _FITS[fits] = config
        return out


def packed_attention_reference(q, k, v, seq_lens, starts, prefix_lens, req_indices, count, scale: float,
                               k_cache=None, v_cache=None, table=None) -> torch.Tensor:
    """The same values as :func:`packed_attention`, in PyTorch: SDPA request by request (reads the lengths on
    the host; no tensor larger than one request's ``[rows, prefix + rows]``)."""
    T, H, D = q.shape
    group = H // k.shape[1]
    out = torch.zeros_like(q)
    lens = seq_lens.tolist()
    firsts = starts.tolist()
    prefixes = prefix_lens.tolist() if k_cache is not None else [0] * len(lens)
    reqs = req_indices.tolist()
    if not any(lens):
        lens, firsts = [int(count.reshape(-1)[0])] + lens[1:], [0] + firsts[1:]
    for length, s, p, r in zip(lens, firsts, prefixes, reqs):
        if length <= 0:
            continue
        kr, vr = k[s:s + length], v[s:s + length]
        if p:
            slots = table[r, :p].long()
            kr = torch.cat([k_cache[slots].to(kr.dtype), kr])
            vr = torch.cat([v_cache[slots].to(vr.dtype), vr])
        qr = q[s:s + length].transpose(0, 1)
        kr = kr.transpose(0, 1).repeat_interleave(group, 0)
        vr = vr.transpose(0, 1).repeat_interleave(group, 0)
        if p:
            mask = torch.arange(p + length, device=q.device)[None] <= torch.arange(length, device=q.device)[:, None] + p
            o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale)
        out[s:s + length] = o.transpose(0, 1)
    return out
