"""A benchmark peer in the style of LightLLM's ``multimodal_emb``: one warp per (row, image) program.

How LightLLM fills a prefill batch's embeddings (DESIGN.md, "How peers stage today"),
as this peer reproduces it:

- the images' rows are laid end to end in one media tensor; image ``i`` holds
  ``img_lens[i]`` rows from row ``img_start_locs[i]``;
- its placeholder tokens carry fake ids ``img_start_ids[i] + k`` (ids past the
  vocabulary), so a token's media row follows from its id alone;
- grid ``(tokens, images + 1)``, ``num_warps=1``, the whole row one block
  (``next_pow2(width)`` columns): program ``(r, i < images)`` copies
  ``media[img_start_locs[i] + id - img_start_ids[i]]`` when token ``r``'s id lies
  in image ``i``'s range; program ``(r, images)`` copies ``table[id - vocab_start]``
  when the id lies in ``[vocab_start, vocab_end)``; every other program returns;
- a row whose id lies in no range is left as it was; there is no padding and no
  error report. (LightLLM also divides media by the TP size; this peer has no TP.)

Written from that description for the benchmark, not copied from LightLLM.
On CPU tensors the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``
before this module is imported); :func:`lightllm_style_reference` is the same
operation in PyTorch.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None
    tl = None

__all__ = ["lightllm_style_stage", "lightllm_style_reference", "image_ranges"]

if triton is not None:

    @triton.jit
    def _lightllm_style_kernel(
        out_ptr, ids_ptr, table_ptr, media_ptr, img_start_ids_ptr, img_lens_ptr, img_start_locs_ptr,
        num_images, vocab_start, vocab_end, width,
        stride_out, stride_table, stride_media,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        which = tl.program_id(1)
        tok = tl.load(ids_ptr + row).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        col_ok = cols < width
        if which == num_images:  # the text program of this row
            if (tok >= vocab_start) & (tok < vocab_end):
                t = tl.load(table_ptr + (tok - vocab_start) * stride_table + cols, mask=col_ok, other=0.0)
                tl.store(out_ptr + row * stride_out + cols, t.to(out_ptr.dtype.element_ty), mask=col_ok)
        else:
            start_id = tl.load(img_start_ids_ptr + which).to(tl.int64)
            length = tl.load(img_lens_ptr + which).to(tl.int64)
            if (tok >= start_id) & (tok < start_id + length):
                loc = tl.load(img_start_locs_ptr + which).to(tl.int64)
                m = tl.load(media_ptr + (loc + tok - start_id) * stride_media + cols, mask=col_ok, other=0.0)
                tl.store(out_ptr + row * stride_out + cols, m.to(out_ptr.dtype.element_ty), mask=col_ok)


def image_ranges(lens: list[int], vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(img_start_ids, img_lens, img_start_locs)``, int64, for images of ``lens`` rows laid end to end.

    Image ``i``'s fake ids start at ``vocab_size`` plus the rows before it, so no
    two images share an id and none is a vocabulary id.
    """
    locs = [sum(lens[:i]) for i in range(len(lens))]
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)
    return as_tensor([vocab_size + loc for loc in locs]), as_tensor(lens), as_tensor(locs)


def lightllm_style_stage(out: torch.Tensor, input_ids: torch.Tensor, table: torch.Tensor, media: torch.Tensor,
                         img_start_ids: torch.Tensor, img_lens: torch.Tensor, img_start_locs: torch.Tensor, *,
                         vocab_start: int = 0, vocab_end: int | None = None) -> torch.Tensor:
    """Write rows ``[0, len(input_ids))`` of ``out`` the LightLLM way (see the module docstring).

    ``out`` ``[rows, W]``; ``table`` ``[V, W]`` and ``media`` ``[M, W]`` with
    contiguous rows; ``input_ids`` ``[n]``; the three image tensors ``[images]``
    int, on ``out``'s device. No check beyond shapes: a peer, not an API.
    """
    n, width = input_ids.shape[0], out.shape[1]
    if table.shape[1] != width or media.shape[1] != width:
        raise ValueError(f"table {tuple(table.shape)} and media {tuple(media.shape)} must be {width} wide")
    vocab_end = table.shape[0] + vocab_start if vocab_end is None else vocab_end
    if n == 0:
        return out
    grid = (n, img_lens.shape[0] + 1)
    _lightllm_style_kernel[grid](
        out, input_ids, table, media, img_start_ids, img_lens, img_start_locs,
        img_lens.shape[0], vocab_start, vocab_end, width,
        out.stride(0), table.stride(0), media.stride(0),
        BLOCK=triton.next_power_of_2(width), num_warps=1, num_stages=1)
    return out


def lightllm_style_reference(out: torch.Tensor, input_ids: torch.Tensor, table: torch.Tensor, media: torch.Tensor,
                             img_start_ids: torch.Tensor, img_lens: torch.Tensor, img_start_locs: torch.Tensor, *,
                             vocab_start: int = 0, vocab_end: int | None = None) -> torch.Tensor:
    """:func:`lightllm_style_stage` in PyTorch: same rows written, same rows left alone."""
    n = input_ids.shape[0]
    vocab_end = table.shape[0] + vocab_start if vocab_end is None else vocab_end
    ids = input_ids.long()
    rows = out[:n]
    text = (ids >= vocab_start) & (ids < vocab_end)
    rows[text] = table[ids[text] - vocab_start].to(out.dtype)
    for start, length, loc in zip(img_start_ids.tolist(), img_lens.tolist(), img_start_locs.tolist()):
        hit = (ids >= start) & (ids < start + length)
        rows[hit] = media[loc + ids[hit] - start].to(out.dtype)
    return out
