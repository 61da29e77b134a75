"""The packed prefill attention kernel (Triton; the interpreter on CPU) against its PyTorch reference and against
plain SDPA over each request's whole prompt: random odd shapes, GQA ratios, head dims, cached prefixes."""

import os
import random

import pytest
import torch

from slabstage.kernels.packed_attention import packed_attention, packed_attention_reference, request_offsets


@pytest.fixture
def device(device):
    """The kernel itself on every device it runs on: CUDA, and the CPU under the Triton interpreter."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("CPU tensors run the Triton kernel only under the interpreter")
    return device


def _case(seed, heads, kv_heads, head_dim, dtype, device, lens, prefixes, pad=5, context=40):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    T = sum(lens) + pad
    q, k, v = (torch.randn(T, h, head_dim, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads))
    slots = 1 + 4 * context
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(device, dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(device, dtype)
    table = torch.randperm(slots - 1, generator=g)[:4 * context].add(1).view(4, context).to(device, torch.int32)
    starts = [sum(lens[:i]) for i in range(B)]
    reqs = random.Random(seed).sample(range(4), B)
    cap = B + 2  # staged slots at a fixed capacity: zero entries past the batch
    as_slot = lambda xs: torch.tensor(xs + [0] * (cap - B), dtype=torch.int32, device=device)  # noqa: E731
    slots_ = dict(seq_lens=as_slot(lens), starts=as_slot(starts), prefix_lens=as_slot(prefixes),
                  req_indices=as_slot(reqs), count=torch.tensor([sum(lens)], dtype=torch.int32, device=device))
    return q, k, v, k_cache, v_cache, table, slots_, reqs


def _sdpa_whole(q, k, v, k_cache, v_cache, table, row, start, length, prefix, scale):
    """Request attention as HF computes it: the whole prompt's K/V (cached prefix, then the chunk), causal."""
    group = q.shape[1] // k.shape[1]
    ks = torch.cat([k_cache[table[row, :prefix].long()], k[start:start + length]]).float()
    vs = torch.cat([v_cache[table[row, :prefix].long()], v[start:start + length]]).float()
    qs = q[start:start + length].float().transpose(0, 1)
    mask = torch.arange(prefix + length)[None] <= torch.arange(length)[:, None] + prefix
    o = torch.nn.functional.scaled_dot_product_attention(
        qs, ks.transpose(0, 1).repeat_interleave(group, 0), vs.transpose(0, 1).repeat_interleave(group, 0),
        attn_mask=mask.to(qs.device), scale=scale)
    return o.transpose(0, 1)


CASES = [  # heads, kv_heads, head_dim, lens, prefixes
    (4, 2, 16, [7, 1, 19], [0, 5, 12]),
    (6, 1, 24, [33, 2], [3, 0]),
    (2, 2, 8, [1], [0]),
    (8, 2, 64, [17, 9, 4], [31, 0, 1]),
    (3, 3, 40, [20, 20], [20, 7]),
]


@pytest.mark.parametrize("heads, kv_heads, head_dim, lens, prefixes", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cached", [True, False])
def test_kernel_matches_reference_and_sdpa(heads, kv_heads, head_dim, lens, prefixes, dtype, cached, device):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the Triton interpreter's bf16 tl.dot is wrong (triton 3.6): bf16 runs on CUDA only")
    q, k, v, kc, vc, table, s, reqs = _case(len(lens) * head_dim, heads, kv_heads, head_dim, dtype, device, lens,
                                            prefixes)
    scale = head_dim ** -0.5
    offsets = request_offsets(s["seq_lens"], s["starts"], s["prefix_lens"], s["req_indices"], s["count"], 16,
                              has_prefix=cached)
    cache = (kc, vc, table) if cached else (None, None, None)
    out = packed_attention(q, k, v, offsets, scale, *cache, config=(16, 16, 4, 1))
    ref = packed_attention_reference(q, k, v, s["seq_lens"], s["starts"], s["prefix_lens"], s["req_indices"],
                                     s["count"], scale, *cache)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    n = sum(lens)
    assert out[n:].eq(0).all()  # rows in no request: zeros
    start = 0
    for length, prefix, row in zip(lens, prefixes, reqs):
        whole = _sdpa_whole(q, k, v, kc, vc, table, row, start, length, prefix if cached else 0, scale)
        torch.testing.assert_close(out[start:start + length].float(), whole.to(dtype).float(), **tol)
        start += length


def test_unstaged_lengths_are_one_request(device):
    q, k, v, kc, vc, table, s, _ = _case(1, 4, 2, 16, torch.float32, device, [9, 8], [0, 0])
    zeros = torch.zeros_like(s["seq_lens"])
    offsets = request_offsets(zeros, zeros, zeros, zeros, s["count"], 16)
    out = packed_attention(q, k, v, offsets, 0.25, config=(16, 16, 4, 1))
    ref = packed_attention_reference(q, k, v, zeros, zeros, zeros, zeros, s["count"], 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    whole = _sdpa_whole(q, k, v, kc, vc, table, 0, 0, 17, 0, 0.25)
    torch.testing.assert_close(out[:17], whole, rtol=1e-5, atol=1e-5)
    assert out[17:].eq(0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_default_tiles_on_cuda(dtype, head_dim):
    lens, prefixes = [300, 1, 129, 64], [0, 77, 5, 250]
    q, k, v, kc, vc, table, s, _ = _case(head_dim, 28, 4, head_dim, dtype, "cuda", lens, prefixes, context=300)
    scale = head_dim ** -0.5
    from slabstage.kernels.packed_attention import block_m_for

    offsets = request_offsets(s["seq_lens"], s["starts"], s["prefix_lens"], s["req_indices"], s["count"],
                              block_m_for(head_dim, dtype))
    out = packed_attention(q, k, v, offsets, scale, kc, vc, table)
    ref = packed_attention_reference(q.float(), k.float(), v.float(), s["seq_lens"], s["starts"], s["prefix_lens"],
                                     s["req_indices"], s["count"], scale, kc.float(), vc.float(), table)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    again = packed_attention(q, k, v, offsets, scale, kc, vc, table)
    assert torch.equal(out, again)  # deterministic


def test_a_config_the_gpu_cannot_load_steps_down(device, monkeypatch):
    """Where the GPU lacks the shared memory a config needs (Triton raises ``OutOfResources`` as the kernel loads,
    before it launches), the launcher tries fewer pipeline stages, then shorter key tiles at the same ``BLOCK_M``,
    remembers what loaded for that head dim, dtype and device, and gives Triton's error when nothing fits."""
    import triton

    from slabstage.kernels import packed_attention as pa

    real, tried, limit = pa._packed_attention_kernel, [], [16]

    class Small:  # a GPU that loads nothing with more than one stage or 16-row key tiles
        def __getitem__(self, grid):
            def launch(*args, **kw):
                tried.append((kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]))
                if kw["num_stages"] > 1 or kw["BLOCK_N"] > limit[0]:
                    raise triton.OutOfResources(10 ** 6, 10 ** 5, "shared memory")
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(pa, "_packed_attention_kernel", Small())
    monkeypatch.setattr(pa, "_FITS", {})
    lens, prefixes = [21, 3, 40], [4, 0, 17]
    q, k, v, kc, vc, table, s, _ = _case(3, 4, 2, 16, torch.float32, device, lens, prefixes)
    block_m, block_n, warps, stages = pa._config(16, torch.float32)
    offsets = lambda m: request_offsets(s["seq_lens"], s["starts"], s["prefix_lens"], s["req_indices"],  # noqa: E731
                                        s["count"], m)
    out = packed_attention(q, k, v, offsets, 0.25, kc, vc, table)
    assert tried[0] == (block_m, block_n, warps, stages) and tried[-1] == (block_m, 16, warps, 1)
    assert [t[0] for t in tried] == [block_m] * len(tried)  # the tile offsets stay valid
    ref = packed_attention_reference(q, k, v, s["seq_lens"], s["starts"], s["prefix_lens"], s["req_indices"],
                                     s["count"], 0.25, kc, vc, table)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    tried.clear()
    assert torch.equal(packed_attention(q, k, v, offsets, 0.25, kc, vc, table), out)
    assert tried == [(block_m, 16, warps, 1)]  # straight to the config that loaded
    limit[0], tried[:] = 0, []  # nothing loads: Triton's own error
    with pytest.raises(triton.OutOfResources):
        packed_attention(q, k, v, offsets, 0.25, kc, vc, table, config=(16, 32, 4, 2))
    assert tried == [(16, 32, 4, 2), (16, 32, 4, 1), (16, 16, 4, 1)]
