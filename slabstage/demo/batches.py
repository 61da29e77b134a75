"""The demo's batches, built as an engine builds them, and the plain-torch merge each is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..graph_runner import PrefillBatch
from ..staging import media_index_from_spans
from ..models import ToyMultimodalModel

__all__ = ["build_batch", "widen", "reference_merge"]


def build_batch(model: ToyMultimodalModel, n: int, *, num_seqs: int, media_fraction: float,
                g: torch.Generator) -> PrefillBatch:
    """``n`` tokens in ``num_seqs`` packed sequences; each sequence holds at most one image.

    An image is ``round(len * media_fraction)`` placeholder tokens
    (``model.media_token_id``) at a random offset; text ids never equal the
    placeholder. ``media`` is a list of items, one per image in token order: the
    ``[rows, model.media_width]`` tensor ``model.encode`` makes of that image's
    patches, as an engine passes its encoder's outputs (``None`` when no
    sequence holds an image). ``media_index`` comes from the spans, rows of the
    items counted end to end, as an engine that knows where its images sit
    builds it.
    """
    cuts = (torch.randperm(n - 1, generator=g)[: num_seqs - 1] + 1).sort().values.tolist()
    starts = [0, *cuts]
    lens = [end - start for start, end in zip(starts, [*cuts, n])]
    input_ids = torch.randint(0, model.media_token_id, (n,), generator=g)  # media_token_id is the last id
    spans, images, num_media = [], [], 0
    for start, length in zip(starts, lens):
        m = round(length * media_fraction)
        if m:
            dst = start + int(torch.randint(0, length - m + 1, (1,), generator=g))
            input_ids[dst:dst + m] = model.media_token_id
            spans.append((dst, m, num_media))
            images.append(model.encode(torch.randn(m, model.patch_dim, generator=g)))
            num_media += m
    media = images or None
    media_index = media_index_from_spans(spans, n, device="cpu", num_media_rows=num_media) if images else None
    return PrefillBatch(
        input_ids=input_ids, positions=torch.cat([torch.arange(length) for length in lens]),
        table=model.embed_tokens.weight, seq_lens=torch.tensor(lens, dtype=torch.int32),
        extend_start_loc=torch.tensor(starts, dtype=torch.int32), media=media, media_index=media_index,
        expand=model.expand)


def widen(rows: torch.Tensor, width: int, expand: str) -> torch.Tensor:
    """``rows`` at ``width`` columns by the width contract's ``expand`` policy (plain torch, no slabstage code):
    zeros past their own width, or repeated across it."""
    if rows.shape[1] == width:
        return rows
    if expand == "repeat":
        return rows.repeat(1, width // rows.shape[1])
    return F.pad(rows, (0, width - rows.shape[1]))


def reference_merge(model: ToyMultimodalModel, batch: PrefillBatch, pad_to: int) -> dict:
    """The forward's inputs for ``batch`` padded to ``pad_to`` rows, merged in plain torch.

    ``input_embeds``: text rows are table rows gathered by id, media rows are the
    rows of ``batch.media``'s items, laid end to end, scattered to the placeholder
    rows in order; both are widened to the slab by ``model.expand``; rows
    ``[n, pad_to)`` are zero. ``positions``: the batch's, then zeros. Uses neither
    ``media_index`` nor any slabstage code.
    """
    n = batch.num_tokens
    device, dtype, width = model.device, model.dtype, model.embed_width
    ids = batch.input_ids.to(device)
    is_media = ids == model.media_token_id
    rows = None if batch.media is None else torch.cat(list(batch.media))
    num_media = 0 if rows is None else rows.shape[0]
    if int(is_media.sum()) != num_media:
        raise AssertionError(f"{int(is_media.sum())} placeholder tokens for {num_media} media rows")
    embeds = torch.zeros(pad_to, width, dtype=dtype, device=device)
    merged = widen(batch.table[ids].to(dtype), width, model.expand)
    if num_media:
        merged[is_media] = widen(rows.to(dtype), width, model.expand)
    embeds[:n] = merged
    positions = torch.zeros(pad_to, dtype=torch.int64, device=device)
    positions[:n] = batch.positions.to(device)
    return {"input_embeds": embeds, "positions": positions}
