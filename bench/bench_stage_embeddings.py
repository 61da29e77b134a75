"""stage_embeddings against the ways engines stage prefill embeddings today, same inputs, one session.

Implementations (each writes rows ``[0, n)`` of the same ``[n, width]`` bf16 slab):

- ``slabstage``: :func:`slabstage.stage_embeddings` with a device ``media_index``,
  ``pad_to = n``: one launch.
- ``slabstage_h2d_index``: the same, with ``media_index`` moved from pinned host
  memory inside the timed call (the index built on the host from spans), on the
  same footing as ``vllm_index_put``'s mask.
- ``vllm_index_put``: embedding of all ids; ``emb[mask] = media`` with the boolean
  mask moved from pinned host memory (index_put with a boolean mask finds the
  rows with a nonzero: a host sync inside the call); ``copy_`` into the slab.
- ``masked_scatter``: embedding; ``emb.masked_scatter_(mask[:, None], media)``; ``copy_``.
- ``sglang``: embedding; the row of each placeholder from a prefix sum of the mask
  (scattered into a position table: no host sync), ``index_copy_`` of the media
  rows there; ``copy_`` into the slot; zero the padded tail. ``pad_to = n`` for
  every implementation, so the tail is empty here (the zeroing is kept for its
  host cost and launches nothing).
- ``torch_compile``: ``torch.compile`` of ``where(mask, media[cumsum(mask) - 1],
  embedding(ids))`` (compiled once, outside timing, per shape), then ``copy_``.
- ``copy_ceiling``: ``slab[:n].copy_(src)``, a device-to-device copy of the slab's
  bytes: what any staging pass costs at the least.

Inputs: vocabulary 32000 (table ``[32000, width]`` bf16), half the rows media
(``[n/2, width]`` bf16) in blocks of 64 rows alternating with text blocks.
Bytes counted: each source row read once, each slab row written once, plus ids
(int64) and the media index (int32). GB/s and the fraction of the copy ceiling
use that count for every implementation, so they compare time, not traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from slabstage import new_error_word, stage_embeddings

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
SUITE = "stage_embeddings"

SHAPES = [(256, 4096), (2048, 4096), (8192, 4096), (32768, 4096), (2048, 16384), (8192, 16384)]
HOST_SHAPE = (2048, 4096) if HAS_CUDA else (256, 256)  # CPU: small, the whole pass runs in the call
CHECK_SHAPES = [(200, 96), (256, 64)]  # odd and round; every device
VOCAB = 32000
BLOCK_ROWS = 64
IMPLS = ("slabstage", "slabstage_h2d_index", "vllm_index_put", "masked_scatter", "sglang", "torch_compile",
         "copy_ceiling")
STAGING_IMPLS = IMPLS[:-1]  # all but the copy: they must produce the staged rows

try:  # one compiled function per shape: allow more recompiles than dynamo's default 8
    import torch._dynamo.config as _dynamo_config

    for _name in ("recompile_limit", "cache_size_limit"):
        if hasattr(_dynamo_config, _name):
            setattr(_dynamo_config, _name, max(64, getattr(_dynamo_config, _name)))
except ImportError:  # pragma: no cover
    pass


@dataclass
class EmbedInputs:
    """One staging problem: sources, the slab it fills and the rows it must hold afterwards."""

    n: int
    width: int
    ids: torch.Tensor  # int64 [n]
    table: torch.Tensor  # bf16 [vocab, width]
    media: torch.Tensor  # bf16 [M, width]
    mask: torch.Tensor  # bool [n], device
    mask_host: torch.Tensor  # bool [n], host (pinned with CUDA)
    media_index: torch.Tensor  # int32 [n], device; -1 at text rows
    media_index_host: torch.Tensor  # the same on the host (pinned with CUDA)
    slab: torch.Tensor  # bf16 [n, width]
    copy_src: torch.Tensor  # bf16 [n, width]
    expected: torch.Tensor  # bf16 [n, width]

    @property
    def device(self) -> torch.device:
        return self.slab.device

    @property
    def shape(self) -> str:
        return f"{self.n}x{self.width}"

    def stage_bytes(self) -> int:
        """Each source row read once, each slab row written once, ids and media index read."""
        rows = self.n * self.width * self.slab.element_size()
        return 2 * rows + self.n * (self.ids.element_size() + 4)

    def copy_bytes(self) -> int:
        return 2 * self.n * self.width * self.slab.element_size()


def make_inputs(tokens: int, width: int, device, *, vocab: int = VOCAB, block: int = BLOCK_ROWS,
                seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> EmbedInputs:
    """Text and media rows in alternating ``block``-row spans (text first), fresh random values."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    is_media = (torch.arange(tokens) // block) % 2 == 1
    num_media = int(is_media.sum())
    index = torch.where(is_media, torch.cumsum(is_media, 0) - 1, -1).to(torch.int32)
    pin = device.type == "cuda"
    ids = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    table = torch.randn(vocab, width, generator=g, device=device, dtype=dtype)
    media = torch.randn(num_media, width, generator=g, device=device, dtype=dtype)
    mask = is_media.to(device)
    media_index = index.to(device)
    expected = torch.where(mask[:, None], media[media_index.long().clamp(min=0)], table[ids])
    return EmbedInputs(
        n=tokens, width=width, ids=ids, table=table, media=media, mask=mask,
        mask_host=is_media.pin_memory() if pin else is_media,
        media_index=media_index, media_index_host=index.pin_memory() if pin else index,
        slab=torch.empty(tokens, width, device=device, dtype=dtype),
        copy_src=torch.randn(tokens, width, generator=g, device=device, dtype=dtype),
        expected=expected,
    )


# -- the implementations: build(inp) -> a zero-argument call that stages inp into inp.slab --
def _slabstage(inp: EmbedInputs):
    errors = new_error_word(inp.device)

    def run():
        stage_embeddings(inp.slab, inp.ids, inp.table, media=inp.media, media_index=inp.media_index,
                         pad_to=inp.n, errors=errors)
    return run


def _slabstage_h2d_index(inp: EmbedInputs):
    errors = new_error_word(inp.device)

    def run():
        index = inp.media_index_host.to(inp.device, non_blocking=True)
        stage_embeddings(inp.slab, inp.ids, inp.table, media=inp.media, media_index=index,
                         pad_to=inp.n, errors=errors)
    return run


def _vllm_index_put(inp: EmbedInputs):
    def run():
        emb = F.embedding(inp.ids, inp.table)
        emb[inp.mask_host.to(inp.device, non_blocking=True)] = inp.media
        inp.slab[:inp.n].copy_(emb)
    return run


def _masked_scatter(inp: EmbedInputs):
    def run():
        emb = F.embedding(inp.ids, inp.table)
        emb.masked_scatter_(inp.mask[:, None], inp.media)
        inp.slab[:inp.n].copy_(emb)
    return run


def _sglang(inp: EmbedInputs):
    num_media, pad_to = inp.media.shape[0], inp.n

    def run():
        n = inp.ids.shape[0]
        emb = F.embedding(inp.ids, inp.table)
        # k-th placeholder row, found without a host sync: each token scatters its row
        # number to its media slot (text rows to a spare slot past the end)
        slot = torch.where(inp.mask, torch.cumsum(inp.mask, 0) - 1, num_media)
        rows = torch.empty(num_media + 1, dtype=torch.long, device=emb.device)
        rows.scatter_(0, slot, torch.arange(n, device=emb.device))
        emb.index_copy_(0, rows[:num_media], inp.media)
        inp.slab[:n].copy_(emb)
        inp.slab[n:pad_to].zero_()
    return run


def _merged(ids, table, media, mask):
    src = (torch.cumsum(mask, 0) - 1).clamp(min=0)
    return torch.where(mask[:, None], media[src], F.embedding(ids, table))


def _torch_compile(inp: EmbedInputs):
    # CPU: aot_eager checks that dynamo takes the whole expression (inductor's C++
    # build takes tens of seconds there and says nothing about the GPU path)
    backend = "inductor" if inp.device.type == "cuda" else "aot_eager"
    compiled = torch.compile(_merged, dynamic=False, fullgraph=True, backend=backend)
    compiled(inp.ids, inp.table, inp.media, inp.mask)  # compile now, outside any timing

    def run():
        inp.slab[:inp.n].copy_(compiled(inp.ids, inp.table, inp.media, inp.mask))
    return run


def _copy_ceiling(inp: EmbedInputs):
    def run():
        inp.slab[:inp.n].copy_(inp.copy_src)
    return run


BUILDERS = {
    "slabstage": _slabstage,
    "slabstage_h2d_index": _slabstage_h2d_index,
    "vllm_index_put": _vllm_index_put,
    "masked_scatter": _masked_scatter,
    "sglang": _sglang,
    "torch_compile": _torch_compile,
    "copy_ceiling": _copy_ceiling,
}


def build(impl: str, inp, builders: dict = BUILDERS, unchecked=("copy_ceiling",)):
    """The call ``builders[impl](inp)``, run once (compiled, warmed) on a poisoned ``inp.slab`` and checked
    against ``inp.expected`` (unless ``impl`` is ``unchecked``: a copy that stages nothing)."""
    run = builders[impl](inp)
    inp.slab.fill_(float("nan"))
    run()
    if impl not in unchecked:
        assert torch.equal(inp.slab, inp.expected), f"{impl} staged wrong rows at {inp.shape}"
    return run


def _shape_id(shape) -> str:
    return f"{shape[0]}x{shape[1]}"


# -- checks: every implementation stages the same rows (every device, small shapes) --
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_CUDA else []))
@pytest.mark.parametrize("shape", CHECK_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("impl", STAGING_IMPLS)
def test_impls_agree(impl, shape, device):
    inp = make_inputs(*shape, device, vocab=1000, block=16, seed=sum(shape))
    build(impl, inp)


# -- device time ---------------------------------------------------------------------
@pytest.fixture(scope="module", params=SHAPES, ids=_shape_id)
def gpu_inputs(request):
    """One shape's inputs on the GPU, shared by every implementation (pytest groups by it)."""
    if not HAS_CUDA:
        pytest.skip("device-time benchmark: needs a CUDA device")
    inp = make_inputs(*request.param, "cuda")
    yield inp
    del inp
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.parametrize("impl", IMPLS)
def test_stage_embeddings(gpu_inputs, impl, device_bench):
    inp = gpu_inputs
    run = build(impl, inp)
    device_bench.benchmark.group = f"{SUITE} {inp.shape}"
    device_bench(run)
    nbytes = inp.copy_bytes() if impl == "copy_ceiling" else inp.stage_bytes()
    device_bench.record_bandwidth(nbytes, suite=SUITE, impl=impl, shape=inp.shape, tokens=inp.n,
                                  width=inp.width, dtype="bfloat16")


# -- host time -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def host_inputs():
    return make_inputs(*HOST_SHAPE, DEVICE)


@pytest.mark.parametrize("impl", IMPLS)
def test_stage_embeddings_host_time(host_inputs, impl, host_bench):
    """CPU time of one call (host clock around it, no sync), median over many calls."""
    if impl == "torch_compile" and not HAS_CUDA:
        pytest.skip("torch.compile host time is measured on CUDA only (the CPU build is a different program)")
    inp = host_inputs
    run = build(impl, inp)
    host_bench.benchmark.group = f"{SUITE} host time {inp.shape}"
    host_bench(run)
    host_bench.record_host_time(suite=SUITE, impl=impl, shape=inp.shape, tokens=inp.n, width=inp.width,
                                device=inp.device.type, dtype="bfloat16")
