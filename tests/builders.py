"""What the tests build again and again: random inputs, poisoned slabs, byte compares, toy models and their
buffers, a rank's table shard. One place, so that a change of a builder reaches every test that uses it."""

from __future__ import annotations

import torch

from slabstage import StagingBuffers, vocab_shard
from slabstage.models import ToyMultimodalModel

F32 = torch.float32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, rows: int, width: int, dtype=F32, device="cpu") -> torch.Tensor:
    """``[rows, width]`` of N(0, 4) (values past bf16's spacing near 1, so a dropped bit shows)."""
    return (torch.randn(rows, width, generator=g) * 2).to(dtype).to(device)


def randint(g: torch.Generator, low: int, high: int, n: int, dtype=torch.int64, device="cpu") -> torch.Tensor:
    return torch.randint(low, high, (n,), generator=g).to(dtype).to(device)


def poisoned(rows: int, width: int, dtype, device, value=float("nan")) -> torch.Tensor:
    """A slab every byte of which a kernel must write (or, past ``pad_to``, leave as it is)."""
    return torch.full((rows, width), value, dtype=dtype, device=device)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaNs and signed zeros included), on any devices."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.detach().cpu().contiguous().view(torch.uint8), b.detach().cpu().contiguous().view(torch.uint8))


def toy(variant: str, dtype=F32, device="cpu", *, hidden: int = 32, vocab: int = 97, layers: int = 2, k: int = 2,
        **kw) -> ToyMultimodalModel:
    """A small :class:`ToyMultimodalModel` (2 heads, hyper-connection streams of 2, seed 0)."""
    args = dict(hidden_size=hidden, vocab_size=vocab, num_layers=layers, num_heads=2, deepstack_k=k, hc_mult=2,
                device=device, dtype=dtype, seed=0)
    return ToyMultimodalModel(variant, **{**args, **kw})


def toy_buffers(model: ToyMultimodalModel, capacity: int, device="cpu", batch: int = 8) -> StagingBuffers:
    """Buffers of ``capacity`` tokens for ``model``'s slab width and dtype."""
    return StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=batch, embed_width=model.embed_width,
                                   embed_dtype=model.dtype, device=device)


def shard_table(table: torch.Tensor, vocab_size: int, rank: int, world: int, *, padding: int) -> torch.Tensor:
    """Rank ``rank``'s table as an engine holds it: its rows, then NaN padding rows (never to be read)."""
    start, end = vocab_shard(vocab_size, rank, world, padding=padding)
    rows = vocab_shard(vocab_size, 0, world, padding=padding)[1]  # the padded shard size
    local = torch.full((rows, table.shape[1]), float("nan"), dtype=table.dtype, device=table.device)
    local[:end - start] = table[start:end]
    return local


class Later:
    """An event of queued work: done once ``done`` is set."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def staging_buffers(tokens: int, width: int, device="cpu", **kw) -> StagingBuffers:
    """Buffers of ``tokens`` rows, a float32 slab ``width`` wide, 4 requests."""
    return StagingBuffers.allocate(max_num_tokens=tokens, max_batch_size=4, embed_width=width,
                                   embed_dtype=torch.float32, device=device, **kw)


def registry_snapshot(buf: StagingBuffers) -> dict:
    return {k: buf.registry[k].clone() for k in buf.registry}


def assert_registry_unchanged(buf: StagingBuffers, snap: dict) -> None:
    """Every slot as ``snap`` holds it (NaN equal to NaN)."""
    for k, v in snap.items():
        assert torch.equal(buf.registry[k].nan_to_num(1.5), v.nan_to_num(1.5)), k


def ids_and_table(vocab: int, width: int, n: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random ids below ``vocab`` and a random ``[vocab, width]`` table."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g), torch.randn(vocab, width, generator=g)
