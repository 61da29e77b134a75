"""Media as items: lists, DeepStack column blocks and pinned host items, against the one-tensor
path and the ways engines stage such media today; same inputs, one session.

Each case is one parametrized benchmark; ``extra_info["case"]`` names it and the
shape column reads ``"<case>: <tokens>x<width>"``. Implementations (names kept
across cases, so the report's columns line up):

- ``slabstage``: :func:`slabstage.stage_embeddings` with ``media`` one device
  tensor, the items' rows laid end to end (pre-concatenated, outside timing);
- ``slabstage_items``: the same call with ``media`` the list of items (16 item
  tensors; DeepStack: tuples of 4 column blocks; pinned case: pinned host items
  the kernel reads through their device-mapped address). The same items each
  call, so their item list, kept on the device, is not copied again;
- ``slabstage_items_new_table``: the same, with the kept tables forgotten before
  each call, so each call copies its table to the device first, as the first
  staging of new items does (a copy of 640 bytes for 16 items, 2 KiB for DeepStack);
- ``torch_cat_then_stage``: ``torch.cat`` of the items (DeepStack: each block
  across items, then the blocks side by side), then ``slabstage``;
- ``h2d_then_stage``: each pinned item copied (non-blocking) into a
  preallocated device buffer, then ``slabstage``: no cat, the best an engine
  does today with a host encoder cache;
- ``copy_h2d``: one non-blocking ``copy_`` of the same media bytes from one
  pinned buffer to the device: the link's ceiling;
- ``lightllm_style``: the one-warp-per-row peer of ``bench/peer_lightllm.py``
  (grid ``(tokens, images + 1)``, images found by fake token-id ranges);
- ``copy_same_bytes``: ``slab.copy_(src)``, a device-to-device copy of the slab's bytes.

Cases (bf16, vocabulary 32000, half the rows media in 16 images, text spans between them):

1. ``items``: 16 GPU items, 8192x4096 and 32768x4096.
2. ``deepstack``: slab ``4H`` wide (H = 2048, 4096; 8192 tokens); items are
   tuples ``(main, ds0, ds1, ds2)`` of separate ``[rows, H]`` tensors; the table is
   ``H`` wide (text rows carry zeros in blocks 1..3).
3. ``pinned``: items in pinned host memory, 2048x4096 and 8192x4096.
4. ``plain``: the one-tensor path at 32768x4096 and 8192x16384, with the held-out
   style floor (source rows read once + slab rows written once, no ids) against a
   1 GiB bf16 device-to-device copy timed in this run: ``heldout_fraction``.
5. ``lightllm``: the LightLLM-style peer at 32768x4096 and 8192x16384.
6. ``host``: host time of :meth:`PrefillGraphRunner.run` (toy model, captured) with
   16 items against one tensor, device integer inputs; the batch reused, or a new
   ``PrefillBatch`` (and a new item list) per call as an engine builds each step.
7. ``graph``: 256x4096 and 2048x4096 inside a CUDA graph: N staging calls back to
   back over rotating input sets (more bytes than L2 holds), device time per call.

Bytes: each source row read once (text rows at the table's width), each slab row
written once, ids and media index read (``copy_*``: bytes read + written). The
pinned case adds ``h2d_gbps``: media bytes over the host link per second. The media-items
targets are checked as soon as both sides of one are timed: ``extra_info["targets"]``
on the later row, and a summary at the end of the module.

Without CUDA the device-time benchmarks skip; ``test_*_check`` run every
implementation at tiny sizes (through the Triton interpreter) against the expected
slab.

GPU: ``python bench/run.py --suite media_items`` (JSON to bench/results/media_items.json).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from bench_stage_embeddings import build as build_checked
from peer_lightllm import image_ranges, lightllm_style_reference, lightllm_style_stage
from pytest_benchmark.fixture import BenchmarkFixture

from slabstage import PrefillBatch, PrefillGraphRunner, StagingBuffers, new_error_word, stage_embeddings
from harness import TIMER_PRECISION_S
from slabstage.models import ToyMultimodalModel

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # conftest sets it without CUDA
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
SUITE = "media_items"
DTYPE = torch.bfloat16
VOCAB = 32000
NUM_ITEMS = 16
DEEPSTACK_K = 3

ITEMS_SHAPES = [(8192, 4096), (32768, 4096)]
DEEPSTACK_SHAPES = [(8192, 2048), (8192, 4096)]  # (tokens, H): the slab is 4H wide
PINNED_SHAPES = [(2048, 4096), (8192, 4096)]
LARGE_SHAPES = [(32768, 4096), (8192, 16384)]
GRAPH_SHAPES = [(256, 4096), (2048, 4096)]
HOST_TOKENS = [256, 2048]
HOST_HIDDEN = 1024
GRAPH_MIN_CALLS = 64  # staging calls per graph replay

CASE_IMPLS = {
    "items": ("slabstage", "slabstage_items", "slabstage_items_new_table", "torch_cat_then_stage"),
    "deepstack": ("slabstage", "slabstage_items", "slabstage_items_new_table", "torch_cat_then_stage"),
    "pinned": ("copy_h2d", "slabstage", "slabstage_items", "h2d_then_stage"),
    "plain": ("slabstage", "copy_same_bytes"),
    "lightllm": ("slabstage", "slabstage_items", "lightllm_style"),
    "graph": ("slabstage", "slabstage_items", "copy_same_bytes"),
    "host": ("slabstage", "slabstage_items"),
}
COPY_IMPLS = {"copy_h2d", "copy_same_bytes"}


# -- inputs ---------------------------------------------------------------------------
def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


@dataclass
class MediaInputs:
    """One staging problem: the media as items and as one tensor, the slab, the rows it must hold."""

    n: int
    width: int
    ids: torch.Tensor  # int64 [n]: vocabulary ids at text rows, LightLLM fake ids at media rows
    table: torch.Tensor  # [vocab, text_width]
    media: torch.Tensor  # [M, width] on the device, the items' rows end to end (storage of its own)
    items: list  # per item a [len_i, width] tensor or a tuple of column blocks; device, or host (pinned)
    media_index: torch.Tensor  # int32 [n], device; -1 at text rows
    lens: list[int]  # rows per item
    image_ranges: tuple  # (img_start_ids, img_lens, img_start_locs) for the LightLLM-style peer
    slab: torch.Tensor  # [n, width]
    expected: torch.Tensor  # [n, width]
    positions: torch.Tensor  # int64 [n], device: one sequence (the runner's batches)
    host_media: torch.Tensor | None = None  # pinned case: the media bytes in one pinned buffer
    media_buffer: torch.Tensor | None = None  # pinned case: the device buffer h2d copies write
    copy_src: torch.Tensor | None = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        return self.slab.device

    @property
    def shape(self) -> str:
        return f"{self.n}x{self.width}"

    @property
    def num_media(self) -> int:
        return sum(self.lens)

    @property
    def text_width(self) -> int:
        return self.table.shape[1]

    def media_bytes(self) -> int:
        return self.num_media * self.width * self.slab.element_size()

    def row_bytes(self) -> int:
        """Held-out style: each source row read once, each slab row written once (no ids)."""
        es = self.slab.element_size()
        return ((self.n - self.num_media) * self.text_width + self.num_media * self.width + self.n * self.width) * es

    def stage_bytes(self) -> int:
        return self.row_bytes() + self.n * (self.ids.element_size() + self.media_index.element_size())

    def copy_bytes(self) -> int:
        return 2 * self.n * self.width * self.slab.element_size()


def make_inputs(tokens: int, width: int, device, *, num_items: int = NUM_ITEMS, blocks: int = 1,
                text_width: int | None = None, pinned: bool = False, table: torch.Tensor | None = None,
                vocab: int = VOCAB, seed: int = 0, copy_src: bool = False) -> MediaInputs:
    """``num_items`` images of about ``tokens / 2 / num_items`` rows, each after a text span; fresh random values.

    ``blocks > 1``: every item is a tuple of ``blocks`` column blocks of ``width / blocks``
    columns. ``pinned``: items (and one buffer of the same bytes) in pinned host
    memory with CUDA, plain host memory without.
    """
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    lens = _split(tokens // 2, num_items)
    texts = _split(tokens - tokens // 2, num_items)
    is_media, index, at = [], [], 0
    for text, length in zip(texts, lens):
        is_media += [False] * text + [True] * length
        index += [-1] * text + list(range(at, at + length))
        at += length
    is_media = torch.tensor(is_media, device=device)
    media_index = torch.tensor(index, dtype=torch.int32, device=device)
    if table is None:
        table = torch.randn(vocab, text_width or width, generator=g, device=device, dtype=DTYPE)
    vocab = table.shape[0]
    ranges = image_ranges(lens, vocab, device)
    fake = (media_index.long() + vocab).clamp(min=0)  # image i's rows: img_start_ids[i] + k
    text_ids = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    ids = torch.where(is_media, fake, text_ids)
    media = torch.randn(at, width, generator=g, device=device, dtype=DTYPE)

    items, starts = [], [sum(lens[:i]) for i in range(num_items)]
    cols = _split(width, blocks)
    edges = [sum(cols[:j]) for j in range(blocks + 1)]
    host = pinned and device.type == "cuda"
    for start, length in zip(starts, lens):
        rows = media[start:start + length]
        parts = [rows[:, edges[j]:edges[j + 1]] for j in range(blocks)]
        parts = [p.contiguous().cpu().pin_memory() if host else p.clone().contiguous() for p in parts]
        items.append(tuple(parts) if blocks > 1 else parts[0])

    safe = torch.where(is_media, torch.zeros_like(ids), ids)
    text = F.pad(table[safe], (0, width - table.shape[1]))
    expected = torch.where(is_media[:, None], media[media_index.long().clamp(min=0)], text)
    return MediaInputs(
        n=tokens, width=width, ids=ids, table=table, media=media, items=items, media_index=media_index,
        lens=lens, image_ranges=ranges, slab=torch.empty(tokens, width, device=device, dtype=DTYPE),
        expected=expected, positions=torch.arange(tokens, device=device),
        host_media=(media.cpu().pin_memory() if host else media.clone()) if pinned else None,
        media_buffer=torch.empty_like(media) if pinned else None,
        copy_src=torch.randn(tokens, width, generator=g, device=device, dtype=DTYPE) if copy_src else None,
    )


# -- the implementations: build(impl, inp) -> a zero-argument call that stages inp into inp.slab --
def _stager(inp: MediaInputs, media_of):
    errors = new_error_word(inp.device)

    def run():
        stage_embeddings(inp.slab, inp.ids, inp.table, media=media_of(), media_index=inp.media_index,
                         pad_to=inp.n, errors=errors)
    return run


def _items_new_table(inp: MediaInputs):
    """The items (every call writes their table into the parameter record: nothing is kept between calls)."""
    def media():
        return inp.items
    return media


def _cat(items: list) -> torch.Tensor:
    if not isinstance(items[0], tuple):
        return torch.cat(items)
    per_block = [torch.cat([item[j] for item in items]) for j in range(len(items[0]))]
    return torch.cat(per_block, dim=1)


def _h2d_then_stage(inp: MediaInputs):
    buffer, starts = inp.media_buffer, [sum(inp.lens[:i]) for i in range(len(inp.lens))]
    views = [buffer[start:start + length] for start, length in zip(starts, inp.lens)]
    stage = _stager(inp, lambda: buffer)

    def run():
        for view, item in zip(views, inp.items):
            view.copy_(item, non_blocking=True)
        stage()
    return run


def _copy_h2d(inp: MediaInputs):
    def run():
        inp.media_buffer.copy_(inp.host_media, non_blocking=True)
    return run


def _lightllm_style(inp: MediaInputs):
    peer = lightllm_style_stage if inp.device.type == "cuda" or INTERPRET else lightllm_style_reference

    def run():
        peer(inp.slab, inp.ids, inp.table, inp.media, *inp.image_ranges)
    return run


def _copy_same_bytes(inp: MediaInputs):
    def run():
        inp.slab.copy_(inp.copy_src)
    return run


BUILDERS = {
    "slabstage": lambda inp: _stager(inp, lambda: inp.media),
    "slabstage_items": lambda inp: _stager(inp, lambda: inp.items),
    "slabstage_items_new_table": lambda inp: _stager(inp, _items_new_table(inp)),
    "torch_cat_then_stage": lambda inp: _stager(inp, lambda: _cat(inp.items)),
    "h2d_then_stage": _h2d_then_stage,
    "copy_h2d": _copy_h2d,
    "lightllm_style": _lightllm_style,
    "copy_same_bytes": _copy_same_bytes,
}


def build(impl: str, inp: MediaInputs):
    """The call for ``impl``, run once (compiled, warmed) and checked against the expected rows."""
    return build_checked(impl, inp, BUILDERS, COPY_IMPLS)


def _bytes(impl: str, inp: MediaInputs) -> int:
    if impl == "copy_same_bytes":
        return inp.copy_bytes()
    if impl == "copy_h2d":
        return 2 * inp.media_bytes()
    return inp.stage_bytes()


# -- targets: checked once both sides are timed --------------------------
@dataclass(frozen=True)
class Target:
    case: str
    impl: str
    versus: str
    kind: str  # "max_ratio": impl / versus <= bound; "min_ratio": >= bound; "max_extra_us": impl - versus <= bound
    bound: float
    what: str


TARGETS = (
    Target("items", "slabstage_items", "slabstage", "max_ratio", 1.05, "16 GPU items within 1.05x of one tensor"),
    Target("items", "slabstage_items_new_table", "slabstage", "max_ratio", 1.05,
           "16 GPU items, table copied, within 1.05x of one tensor"),
    Target("items", "torch_cat_then_stage", "slabstage_items", "min_ratio", 1.5, "items >= 1.5x faster than cat+stage"),
    Target("items", "torch_cat_then_stage", "slabstage_items_new_table", "min_ratio", 1.5,
           "items, table copied, >= 1.5x faster than cat+stage"),
    Target("deepstack", "slabstage_items", "slabstage", "max_ratio", 1.05,
           "DeepStack k=3 blocks within 1.05x of the wide tensor"),
    Target("deepstack", "slabstage_items_new_table", "slabstage", "max_ratio", 1.05,
           "DeepStack, table copied, within 1.05x of the wide tensor"),
    Target("pinned", "slabstage_items", "copy_h2d", "max_ratio", 1.15, "pinned items within 1.15x of the H2D copy"),
    Target("pinned", "h2d_then_stage", "slabstage_items", "min_ratio", 1.0, "pinned items faster than copy+stage"),
    Target("lightllm", "lightllm_style", "slabstage", "min_ratio", 1.1, "slabstage >= 1.1x faster than LightLLM-style"),
    Target("host", "slabstage_items", "slabstage", "max_extra_us", 15.0, "run() with 16 items <= 15 us more"),
)
_MEDIAN_US: dict = {}  # (case, shape label, impl) -> median µs, this session
_VERDICTS: list = []


def _verdict(benchmark, what: str, shape: str, value: float, bound: float, met: bool) -> None:
    v = dict(target=what, shape=shape, value=round(value, 4), bound=bound, met=bool(met))
    benchmark.extra_info.setdefault("targets", []).append(v)
    _VERDICTS.append(v)


def _check_targets(benchmark, case: str, shape: str, impl: str) -> None:
    info = benchmark.extra_info
    median = info.get("median_us", info.get("host_us"))
    if median is None:  # benchmarks disabled: nothing timed
        return
    _MEDIAN_US[(case, shape, impl)] = median
    for t in TARGETS:
        if t.case != case or impl not in (t.impl, t.versus):
            continue
        a, b = _MEDIAN_US.get((case, shape, t.impl)), _MEDIAN_US.get((case, shape, t.versus))
        if a is None or b is None:
            continue
        if t.kind == "max_extra_us":
            value, met = a - b, a - b <= t.bound
        else:
            value = a / b
            met = value <= t.bound if t.kind == "max_ratio" else value >= t.bound
        _verdict(benchmark, t.what, shape, value, t.bound, met)


@pytest.fixture(scope="module", autouse=True)
def _targets_summary(request):
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if not _VERDICTS or reporter is None:
        return
    reporter.write_sep("-", "media-items targets (this run)")
    for v in _VERDICTS:
        reporter.write_line(f"{'met   ' if v['met'] else 'MISSED'} {v['target']:<55} {v['shape']:<32} "
                            f"{v['value']:.3f} (bound {v['bound']})")


def _record(bench, case: str, inp: MediaInputs, impl: str, nbytes: int, **info) -> str:
    shape = f"{case}: {inp.shape}"
    bench.benchmark.group = f"{SUITE} {shape}"
    bench.record_bandwidth(nbytes, suite=SUITE, case=case, impl=impl, shape=shape, tokens=inp.n, width=inp.width,
                           text_width=inp.text_width, items=len(inp.items), media_rows=inp.num_media,
                           dtype="bfloat16", **info)
    _check_targets(bench.benchmark, case, shape, impl)
    return shape


def _shape_id(shape) -> str:
    return f"{shape[0]}x{shape[1]}"


def _gpu(make):
    """A module fixture's body: the inputs on the GPU, freed after the module's last use."""
    if not HAS_CUDA:
        pytest.skip("device-time benchmark: needs a CUDA device")
    inp = make()
    yield inp
    del inp
    torch.cuda.empty_cache()


# -- checks: every implementation of every case writes the expected slab (tiny, any device) --
CHECK_DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
CHECK_SHAPES = [(200, 96, 5), (256, 64, 16)]  # tokens, width, items: odd and round


@pytest.mark.parametrize("device", CHECK_DEVICES)
@pytest.mark.parametrize("shape", CHECK_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}/{s[2]}")
@pytest.mark.parametrize("impl", list(CASE_IMPLS["items"]))
def test_items_check(impl, shape, device):
    n, width, items = shape
    build(impl, make_inputs(n, width, device, num_items=items, vocab=1000, seed=n))


@pytest.mark.parametrize("device", CHECK_DEVICES)
@pytest.mark.parametrize("hidden", [24, 16])
@pytest.mark.parametrize("impl", list(CASE_IMPLS["deepstack"]))
def test_deepstack_check(impl, hidden, device):
    build(impl, make_inputs(120, hidden * (1 + DEEPSTACK_K), device, num_items=5, blocks=1 + DEEPSTACK_K,
                            text_width=hidden, vocab=1000, seed=hidden))


@pytest.mark.parametrize("device", CHECK_DEVICES)
@pytest.mark.parametrize("impl", list(CASE_IMPLS["pinned"]))
def test_pinned_check(impl, device):
    """Without CUDA the "host" items are plain CPU tensors (CPU torch cannot pin)."""
    inp = make_inputs(200, 96, device, num_items=5, pinned=True, vocab=1000, seed=3)
    build(impl, inp)
    if impl == "copy_h2d":
        assert torch.equal(inp.media_buffer, inp.media)


@pytest.mark.parametrize("device", CHECK_DEVICES)
@pytest.mark.parametrize("impl", list(CASE_IMPLS["lightllm"]) + ["copy_same_bytes"])
def test_large_paths_check(impl, device):
    """Cases plain and lightllm at a tiny size; the row width is not a power of two (masked columns)."""
    build(impl, make_inputs(160, 80, device, num_items=16, vocab=1000, seed=7, copy_src=True))


@pytest.mark.skipif(not HAS_CUDA and not INTERPRET, reason="the peer kernel needs CUDA or the interpreter")
@pytest.mark.parametrize("width", [96, 64])
def test_lightllm_style_peer_matches_reference(width):
    """The peer kernel (interpreter on CPU) against its PyTorch reference, rows it must not touch included."""
    inp = make_inputs(90, width, DEVICE, num_items=3, vocab=500, seed=width)
    start_ids, lens, locs = inp.image_ranges
    ids, lens = inp.ids.clone(), lens.clone()
    image1_last = int((inp.media_index == sum(inp.lens[:2]) - 1).nonzero())
    lens[1] -= 1  # image 1's last placeholder falls out of its range
    text_rows = (inp.media_index < 0).nonzero().flatten().tolist()
    first, last = text_rows[0], text_rows[-1]
    ids[first], ids[last] = 0, 499  # the vocabulary's edges (vocab 500)
    ids[5] = 10**6  # in no range
    ids[inp.n // 2] = -3
    untouched = torch.tensor([5, inp.n // 2, image1_last])
    out = torch.full_like(inp.slab, 7.0)
    ref = out.clone()
    lightllm_style_stage(out, ids, inp.table, inp.media, start_ids, lens, locs)
    lightllm_style_reference(ref, ids, inp.table, inp.media, start_ids, lens, locs)
    assert torch.equal(out, ref)
    assert (out[untouched] == 7.0).all(), "rows in no range must be left as they were"
    assert torch.equal(out[first], inp.table[0]) and torch.equal(out[last], inp.table[499])
    same = torch.ones(inp.n, dtype=torch.bool, device=DEVICE)
    same[untouched] = False
    same[[first, last]] = False
    assert torch.equal(out[same], inp.expected[same])


@pytest.mark.parametrize("device", CHECK_DEVICES)
@pytest.mark.parametrize("impl", list(CASE_IMPLS["graph"]))
def test_graph_check(impl, device):
    """Case graph's rotating calls: each set's slab right after one pass (eagerly here; the benchmark replays)."""
    table = torch.randn(1000, 64, device=device, dtype=DTYPE)
    sets = _rotating_sets(96, 64, device, 3, table)
    calls = [BUILDERS[impl](inp) for inp in sets]
    for inp in sets:
        inp.slab.fill_(float("nan"))
    for call in calls:
        call()
    if impl not in COPY_IMPLS:
        for inp in sets:
            assert torch.equal(inp.slab, inp.expected)


@pytest.mark.parametrize("impl", list(CASE_IMPLS["host"]))
def test_host_check(impl):
    """Case host on CPU: the runner (eager here) gives the one-tensor output with the items."""
    model = ToyMultimodalModel("plain", hidden_size=64, vocab_size=1000, num_layers=1, num_heads=4, seed=0,
                               dtype=DTYPE)
    runner = _runner(model, [48], "cpu", capture=False)
    inp = make_inputs(48, 64, "cpu", num_items=4, table=model.embed_tokens.weight, seed=1)
    ref = runner.run(_batch(inp, "slabstage"), clone=True)
    assert torch.equal(runner.registry.views(48)["input_embeds"], inp.expected)
    assert torch.equal(runner.run(_batch(inp, impl), clone=True), ref)
    assert torch.equal(runner.registry.views(48)["input_embeds"], inp.expected)


# -- 1. items, 2. deepstack, 3. pinned: device time ----------------------------------------------
def _time_case(device_bench, case: str, inp: MediaInputs, impl: str, **info) -> str:
    """Device time of ``impl`` on ``inp`` (built and checked first), recorded as ``case``; the shape label."""
    device_bench(build(impl, inp))
    return _record(device_bench, case, inp, impl, _bytes(impl, inp), **info)


@pytest.fixture(scope="module", params=ITEMS_SHAPES, ids=_shape_id)
def items_inputs(request):
    yield from _gpu(lambda: make_inputs(*request.param, "cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("impl", list(CASE_IMPLS["items"]))
def test_items(items_inputs, impl, device_bench):
    _time_case(device_bench, "items", items_inputs, impl)


@pytest.fixture(scope="module", params=DEEPSTACK_SHAPES, ids=lambda s: f"{s[0]}x4x{s[1]}")
def deepstack_inputs(request):
    tokens, hidden = request.param
    yield from _gpu(lambda: make_inputs(tokens, hidden * (1 + DEEPSTACK_K), "cuda", blocks=1 + DEEPSTACK_K,
                                        text_width=hidden))


@pytest.mark.cuda
@pytest.mark.parametrize("impl", list(CASE_IMPLS["deepstack"]))
def test_deepstack(deepstack_inputs, impl, device_bench):
    _time_case(device_bench, "deepstack", deepstack_inputs, impl, blocks=1 + DEEPSTACK_K)


@pytest.fixture(scope="module", params=PINNED_SHAPES, ids=_shape_id)
def pinned_inputs(request):
    yield from _gpu(lambda: make_inputs(*request.param, "cuda", pinned=True))


@pytest.mark.cuda
@pytest.mark.parametrize("impl", list(CASE_IMPLS["pinned"]))
def test_pinned(pinned_inputs, impl, device_bench):
    inp = pinned_inputs
    over_link = impl != "slabstage"  # every other row moves the media bytes from the host
    _time_case(device_bench, "pinned", inp, impl, h2d_bytes=inp.media_bytes() * over_link)
    median = device_bench.extra_info.get("median_us")
    if median and over_link:
        device_bench.extra_info["h2d_gbps"] = inp.media_bytes() / median / 1e3


# -- 4. plain path, 5. LightLLM-style peer: large sizes ------------------------------------------
@pytest.fixture(scope="module")
def gib_copy():
    """Device-to-device copy of 1 GiB of bf16 in this run: (bytes per second counting read + write, median µs)."""
    if not HAS_CUDA:
        pytest.skip("device-time benchmark: needs a CUDA device")
    src = torch.ones(2**29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(5):
        dst.copy_(src)
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    median_us = sorted(times)[len(times) // 2]
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2**30 / (median_us * 1e-6), median_us


@pytest.fixture(scope="module", params=LARGE_SHAPES, ids=_shape_id)
def large_inputs(request):
    yield from _gpu(lambda: make_inputs(*request.param, "cuda", copy_src=True))


def _record_heldout(bench, inp: MediaInputs, gib_copy) -> None:
    """The held-out harness's measure: source rows read once + slab rows written once, over the 1 GiB copy."""
    bytes_per_s, copy_us = gib_copy
    floor_us = inp.row_bytes() / bytes_per_s * 1e6
    extra = bench.extra_info
    extra.update(heldout_bytes=inp.row_bytes(), heldout_ceiling_gbps=bytes_per_s / 1e9, gib_copy_us=copy_us,
                 heldout_floor_us=floor_us)
    if extra.get("median_us"):
        extra["heldout_fraction"] = floor_us / extra["median_us"]


@pytest.mark.cuda
@pytest.mark.parametrize("impl", list(CASE_IMPLS["plain"]))
def test_plain(large_inputs, impl, device_bench, copy_ceiling, gib_copy):
    inp = large_inputs
    shape = _time_case(device_bench, "plain", inp, impl, session_ceiling_gbps=copy_ceiling.gbps)
    _record_heldout(device_bench, inp, gib_copy)
    extra = device_bench.extra_info
    if impl == "slabstage" and "heldout_fraction" in extra:
        _verdict(device_bench.benchmark, "plain path, held-out style >= 93% of the 1 GiB copy", shape,
                 extra["heldout_fraction"], 0.93, extra["heldout_fraction"] >= 0.93)
        _verdict(device_bench.benchmark, "plain path >= 95% of the session ceiling (bench/results)", shape,
                 extra["fraction_of_ceiling"], 0.95, extra["fraction_of_ceiling"] >= 0.95)


@pytest.mark.cuda
@pytest.mark.parametrize("impl", list(CASE_IMPLS["lightllm"]))
def test_lightllm(large_inputs, impl, device_bench, gib_copy):
    inp = large_inputs
    _time_case(device_bench, "lightllm", inp, impl, images=len(inp.lens))
    _record_heldout(device_bench, inp, gib_copy)


# -- 6. run() host time, 16 items against one tensor ---------------------------------------------
def _runner(model, buckets, device, *, capture: bool):
    buffers = StagingBuffers.allocate(max_num_tokens=max(buckets), max_batch_size=16, embed_width=model.embed_width,
                                      embed_dtype=DTYPE, device=device)
    runner = PrefillGraphRunner(model, buffers, buckets=buckets, progress=False)
    return runner.capture() if capture else runner


def _batch(inp: MediaInputs, impl: str) -> PrefillBatch:
    """A new batch of ``inp``: a new item list for the item form, device integer inputs."""
    media = list(inp.items) if impl == "slabstage_items" else inp.media
    return PrefillBatch(input_ids=inp.ids, positions=inp.positions, table=inp.table, media=media,
                        media_index=inp.media_index)


@pytest.fixture(scope="module")
def host_setup():
    if not HAS_CUDA:
        pytest.skip("runner host time is measured with a captured graph: needs a CUDA device")
    model = ToyMultimodalModel("plain", hidden_size=HOST_HIDDEN, vocab_size=VOCAB, num_layers=2, num_heads=16,
                               device="cuda", dtype=DTYPE, seed=0)
    runner = _runner(model, HOST_TOKENS, "cuda", capture=True)
    inputs = {n: make_inputs(n, HOST_HIDDEN, "cuda", table=model.embed_tokens.weight, seed=n) for n in HOST_TOKENS}
    yield runner, inputs
    runner.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", HOST_TOKENS)
@pytest.mark.parametrize("batch", ["reused", "new_per_call"])
@pytest.mark.parametrize("impl", list(CASE_IMPLS["host"]))
def test_host(host_setup, impl, batch, tokens, host_bench):
    """Host µs per ``run`` (no sync inside; the device drains between calls); the toy forward is captured."""
    runner, inputs = host_setup
    inp = inputs[tokens]
    ref = runner.run(_batch(inp, "slabstage"), clone=True)
    assert torch.equal(runner.run(_batch(inp, impl), clone=True), ref), f"{impl} changed the runner's output"
    if batch == "reused":
        one = _batch(inp, impl)
        call = lambda: runner.run(one)
    else:
        call = lambda: runner.run(_batch(inp, impl))
    host_bench(call)
    shape = f"host, batch {batch}: {tokens} tokens"
    host_bench.benchmark.group = f"{SUITE} {shape}"
    host_bench.record_host_time(suite=SUITE, case="host", impl=impl, shape=shape, tokens=tokens, width=HOST_HIDDEN,
                                items=len(inp.items), batch=batch, bucket=runner.last_bucket, inputs="device")
    _check_targets(host_bench.benchmark, "host", shape, impl)


# -- 7. small sizes inside a CUDA graph ---------------------------------------------------------
def _rotating_sets(tokens: int, width: int, device, count: int, table: torch.Tensor) -> list[MediaInputs]:
    return [make_inputs(tokens, width, device, table=table, seed=100 + k, copy_src=True) for k in range(count)]


class PerCall:
    """A timer reading another one divided by ``calls``: one graph replay runs ``calls`` staging calls."""

    __name__ = "cuda_event_timer_per_call"

    def __init__(self, timer, calls: int) -> None:
        self.timer, self.calls = timer, calls

    def __call__(self) -> float:
        return self.timer() / self.calls


def _time_per_call(bench, calls: int) -> None:
    """Make ``device_bench`` report device time per call; pin the new timer's precision as conftest does."""
    fixture = bench.benchmark
    timer = PerCall(fixture._timer, calls)
    fixture._timer = timer
    cache = getattr(BenchmarkFixture, "_precisions", None)
    if isinstance(cache, dict):
        cache[timer] = TIMER_PRECISION_S / calls
    elif hasattr(fixture, "_get_precision"):
        fixture._get_precision = lambda _timer: TIMER_PRECISION_S / calls


@pytest.fixture(scope="module", params=GRAPH_SHAPES, ids=_shape_id)
def graph_inputs(request):
    """Enough input sets that one pass over them moves four times the L2, sharing one table."""
    if not HAS_CUDA:
        pytest.skip("device-time benchmark: needs a CUDA device")
    tokens, width = request.param
    table = torch.randn(VOCAB, width, device="cuda", dtype=DTYPE)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20) or 50 * 2**20
    per_set = 3 * tokens * width * DTYPE.itemsize  # slab + media + copy source (text rows come from the table)
    count = min(32, max(2, math.ceil(4 * l2 / per_set)))
    sets = _rotating_sets(tokens, width, "cuda", count, table)
    yield sets
    del sets, table
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.parametrize("impl", list(CASE_IMPLS["graph"]))
def test_graph(graph_inputs, impl, device_bench):
    sets = graph_inputs
    calls = [build(impl, inp) for inp in sets]  # compiled, warmed and checked, outside the capture
    repeats = math.ceil(GRAPH_MIN_CALLS / len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for call in calls:
                call()
    for inp in sets:
        inp.slab.fill_(float("nan"))
    graph.replay()
    if impl not in COPY_IMPLS:
        for inp in sets:
            assert torch.equal(inp.slab, inp.expected), f"{impl}: graph replay staged wrong rows at {inp.shape}"
    _time_per_call(device_bench, repeats * len(calls))
    device_bench(graph.replay)
    torch.cuda.synchronize()
    if impl not in COPY_IMPLS:  # still right after every replay: whatever the capture read is still alive
        for inp in sets:
            assert torch.equal(inp.slab, inp.expected), f"{impl}: a later replay staged wrong rows at {inp.shape}"
    _record(device_bench, "graph", sets[0], impl, _bytes(impl, sets[0]), calls_per_replay=repeats * len(calls),
            input_sets=len(sets))
