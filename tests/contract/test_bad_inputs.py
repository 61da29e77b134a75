"""The bad-input matrix: every public entry point against every kind of bad input.

Read the tables below as the spec. Two kinds of problem:

- Host-side (``HOST_CASES``): visible from shapes, dtypes, devices, strides and
  Python values. The call raises before any launch: the exception type and a
  fragment of its message are checked, and every registry slot, the buffers'
  error word and the device's default error word must be byte-identical
  afterwards (all poisoned with random values, NaN included, beforehand).
- Device-side (``DEVICE_CASES``): token ids, media indices and the placeholder
  count live on the device, so the host cannot see them without a sync. The
  error word must record them (codes, rows, first row, count), bad rows are
  zero-filled, and nothing is read or written out of bounds: the table and the
  media rows sit inside larger allocations whose other rows hold a sentinel
  (``SENTINEL``, which must never reach the slab), and slab rows at or past
  ``pad_to`` keep their poison.

Devices: on CPU the Triton kernels run under the interpreter and a tensor on
``torch.device("meta")`` plays the foreign device; on CUDA a CPU tensor does,
except where host tensors are legitimate inputs (the integer inputs of
stage_token_inputs, stage_batch and the runner), where ``meta`` does.
CUDA-only rows (a slot reallocated after capture, forward raising inside
capture) follow the tables.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace
from typing import Callable, NamedTuple

import pytest
import torch

import slabstage as ss
from slabstage import (BAD_MEDIA_INDEX, BAD_TOKEN_ID, MEDIA_COUNT_MISMATCH, BufferRegistry, CaptureError,
                       PrefillBatch, PrefillGraphRunner, RegistryMismatchError, StagingBuffers, WidthContractError)
from slabstage.staging import default_error_word, reset_errors
from slabstage.staging.stager import stage_batch
from slabstage.models import ToyMultimodalModel

from expected import expected_slab  # noqa: I001 - tests/expected.py

HAS_CUDA = torch.cuda.is_available()
NO_ROW = 2**31 - 1

T, B, W = 24, 4, 32  # buffer capacity (tokens), max requests, slab width
V, M = 40, 6  # vocabulary (table rows), media rows
N, PAD = 10, 16  # tokens in the good batch, pad_to
GUARD = 3  # sentinel rows before and after the table and the media rows
SENTINEL = 1e4
SPANS = [(2, 3, 0), (6, 2, 3)]  # media rows 2, 3, 4, 6, 7 take media rows 0..4; rows 0, 1, 5, 8, 9 are text
TEXT_ROWS = [0, 1, 5, 8, 9]
SEQ_LENS = [4, 6]
BUCKETS = [8, 16]  # the runner's; N replays in 16 on CUDA, 17..24 tokens run eagerly


# ==================================================================================================
# The context every case runs against
# ==================================================================================================
def _guarded(g, rows, width, device):
    """``rows`` random rows inside an allocation whose GUARD rows either side hold SENTINEL."""
    big = torch.full((rows + 2 * GUARD, width), SENTINEL)
    big[GUARD:GUARD + rows] = torch.randn(rows, width, generator=g)
    big = big.to(device)
    return big, big[GUARD:GUARD + rows]


def _allocate(device, **kw):
    args = dict(max_num_tokens=T, max_batch_size=B, embed_width=W, embed_dtype=torch.float32, device=device)
    return StagingBuffers.allocate(**{**args, **kw})


_RUNNERS: dict = {}


def _runner(device: torch.device) -> PrefillGraphRunner:
    """One toy runner per device, captured on CUDA (BUCKETS), eager on CPU; its buffers are poisoned per case."""
    if device not in _RUNNERS:
        model = ToyMultimodalModel("plain", hidden_size=W, vocab_size=V, num_layers=1, num_heads=4, device=device)
        runner = PrefillGraphRunner(model, _allocate(device), buckets=BUCKETS, progress=False)
        _RUNNERS[device] = runner.capture()
    return _RUNNERS[device]


class Ctx(SimpleNamespace):
    """Good inputs for every entry point; each case overrides one argument with a bad one."""

    def rand(self, *shape, dtype=torch.float32, device=None):
        return torch.randn(*shape, generator=self.g).to(dtype).to(device or self.device)

    def ints(self, high, *shape, dtype=torch.int64, device=None):
        return torch.randint(0, high, shape, generator=self.g).to(dtype).to(device or self.device)

    # -- one call per entry point, good arguments unless overridden --------------------------------
    def se(self, **kw):
        a = dict(slab=self.buffers.input_embeds, input_ids=self.ids, table=self.table, media=self.media,
                 media_index=self.media_index, pad_to=PAD, errors=self.buffers.errors)
        a.update(kw)
        return ss.stage_embeddings(a.pop("slab"), a.pop("input_ids"), a.pop("table"), **a)

    def token_inputs(self, **kw):
        return dict(input_ids=self.ids, positions=self.positions, out_cache_loc=self.cache_loc,
                    seq_lens=self.seq_lens, extend_start_loc=self.extend_start_loc, **kw)

    def sti(self, buffers=None, **kw):
        a = {**self.token_inputs(mrope_positions=self.mrope, pad_to=PAD), **kw}
        return ss.stage_token_inputs(buffers or self.buffers, **a)

    def psb(self, **kw):
        a = {**self.token_inputs(table=self.table, media=self.media, media_index=self.media_index, pad_to=PAD),
             **kw}
        return stage_batch(self.buffers, **a)

    def mis(self, spans=SPANS, num_tokens=N, **kw):
        return ss.media_index_from_spans(spans, num_tokens, device=self.device, **{"num_media_rows": M, **kw})

    def mim(self, **kw):
        a = dict(is_media=self.media_index >= 0, num_media_rows=5, errors=self.buffers.errors)
        a.update(kw)
        return ss.media_index_from_mask(a.pop("is_media"), a.pop("num_media_rows"), **a)

    def alloc(self, **kw):
        return _allocate(**{"device": self.device, **kw})

    def batch(self, **kw):
        a = self.token_inputs(table=self.table, media=self.media, media_index=self.media_index)
        return PrefillBatch(**{**a, **kw})

    def run(self, **kw):
        return self.runner.run(self.batch(**kw))

    def width(self, hidden=128, attr="input_embeds_hidden_size", **declared):
        return ss.resolve_input_embeds_width(type("ToyVLM", (), declared)(), hidden, attr=attr)

    def frozen(self, action: Callable):
        reg = self.buffers.registry
        reg.freeze()
        try:
            return action(reg)
        finally:
            reg.unfreeze()


def _foreign(device: torch.device) -> torch.device:
    """A device whose tensors the entry points must refuse next to ``device``'s."""
    if device.type == "cuda":
        return torch.device("cpu")
    return torch.device("cuda") if HAS_CUDA else torch.device("meta")


def _poison(buffers: StagingBuffers, g: torch.Generator) -> None:
    for name in buffers.registry:
        t = buffers.registry[name]
        if t.is_floating_point():
            vals = torch.randn(t.shape, generator=g) * 100
            vals.view(-1)[::7] = float("nan")
        else:
            vals = torch.randint(-1000, 1000, t.shape, generator=g)
        t.copy_(vals)
    _poison_word(buffers.errors, g)


def _poison_word(word: torch.Tensor, g: torch.Generator) -> None:
    word.copy_(torch.randint(-2**31, 2**31 - 1, word.shape, generator=g, dtype=torch.int32))


def make_ctx(device: torch.device, seed: int, *, with_runner: bool = False) -> Ctx:
    g = torch.Generator().manual_seed(seed)
    big_table, table = _guarded(g, V, W, device)
    big_media, media = _guarded(g, M, W, device)
    ids = torch.randint(0, V, (N,), generator=g)
    index = torch.full((N,), -1, dtype=torch.int64)
    for dst, length, src in SPANS:
        index[dst:dst + length] = torch.arange(src, src + length)
    starts = [0, *torch.tensor(SEQ_LENS).cumsum(0)[:-1].tolist()]
    c = Ctx(device=device, g=g, foreign=_foreign(device), table=table, media=media, big_table=big_table,
            big_media=big_media, ids=ids.to(device), media_index=index.to(device),
            positions=torch.cat([torch.arange(n) for n in SEQ_LENS]).to(device),
            cache_loc=torch.arange(100, 100 + N).to(device),
            mrope=torch.randint(0, 50, (3, N), generator=g).to(device),
            seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32).to(device),
            extend_start_loc=torch.tensor(starts, dtype=torch.int32).to(device),
            buffers=_allocate(device, mrope=True), plain=_allocate(device, cache_loc_dtype=torch.int32))
    # where host integer inputs are legitimate (CPU next to CUDA), a meta tensor is the foreign one
    c.alien = torch.device("meta") if c.foreign.type == "cpu" else c.foreign
    c.runner = _runner(device) if with_runner else None
    c.all_buffers = [c.buffers, c.plain] + ([c.runner.buffers] if with_runner else [])
    for buffers in c.all_buffers:
        _poison(buffers, g)
    return c


def snapshot(c: Ctx) -> dict:
    """Every slot, every error word and the default word of the device: address, layout and a copy."""
    tensors = {}
    for k, buffers in enumerate(c.all_buffers):
        tensors.update({(k, name): buffers.registry[name] for name in buffers.registry})
        tensors[(k, "errors")] = buffers.errors
    tensors["default error word"] = default_error_word(c.device)
    return {key: (t, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.clone()) for key, t in tensors.items()}


def assert_unchanged(before: dict, c: Ctx) -> None:
    """Byte-identical (NaN poison compares too), same address and layout, same slot names."""
    after = snapshot(c)
    assert after.keys() == before.keys(), "slots added or removed"
    for key, (t, ptr, shape, stride, dtype, copy) in before.items():
        now = after[key][0]
        layout = (now.data_ptr(), tuple(now.shape), now.stride(), now.dtype)
        assert now is t and layout == (ptr, shape, stride, dtype), f"{key} was reallocated or reshaped"
        assert torch.equal(now.view(torch.uint8), copy.view(torch.uint8)), f"{key} was written"


# ==================================================================================================
# Host-side cases
# ==================================================================================================
class Case(NamedTuple):
    entry: str
    what: str
    call: Callable[[Ctx], object]
    exc: type
    match: str


C = Case
SE, STI, PSB = "stage_embeddings", "stage_token_inputs", "stage_batch"
MIS, MIM, ALLOC = "media_index_from_spans", "media_index_from_mask", "StagingBuffers.allocate"
REG, WIDTH, BATCH = "BufferRegistry", "resolve_input_embeds_width", "PrefillBatch"
RUN, RUNNER = "PrefillGraphRunner.run", "PrefillGraphRunner()"
SLAB_OF = r"but the slab is on"
ON_OTHER = r"\S+; expected (cpu|cuda)\S*$"  # the slab's device, host not allowed

HOST_CASES = [
    # -- stage_embeddings ---------------------------------------------------------------------------
    C(SE, "dtype: input_ids float", lambda c: c.se(input_ids=c.ids.float()), TypeError, "input_ids dtype must be"),
    C(SE, "dtype: media_index bool", lambda c: c.se(media_index=c.media_index >= 0), TypeError,
      "media_index dtype must be"),
    C(SE, "dtype: table int", lambda c: c.se(table=c.ints(9, V, W)), TypeError, "table dtype must be"),
    C(SE, "dtype: media float64", lambda c: c.se(media=c.media.double()), TypeError, "media dtype must be"),
    C(SE, "dtype: slab int (the input_ids slot)", lambda c: c.se(slab=c.buffers.input_ids), TypeError,
      "slab dtype must be one of float16, bfloat16, float32, got torch.int64"),
    C(SE, "dtype: errors int64", lambda c: c.se(errors=c.buffers.errors.long()), ValueError,
      "errors must be a contiguous 1-D int32"),
    C(SE, "non-tensor input_ids", lambda c: c.se(input_ids=c.ids.tolist()), TypeError,
      "input_ids must be a torch.Tensor"),
    C(SE, "device: input_ids", lambda c: c.se(input_ids=c.ids.to(c.foreign)), ValueError,
      f"input_ids is on {ON_OTHER}"),
    C(SE, "device: table", lambda c: c.se(table=c.table.to(c.foreign)), ValueError, f"table is on {ON_OTHER}"),
    C(SE, "device: media", lambda c: c.se(media=c.media.to(c.foreign)), ValueError, f"media is on {ON_OTHER}"),
    C(SE, "device: media_index", lambda c: c.se(media_index=c.media_index.to(c.foreign)), ValueError,
      f"media_index is on {ON_OTHER}"),
    C(SE, "device: errors", lambda c: c.se(errors=c.buffers.errors.to(c.foreign)), ValueError,
      f"errors is on .* {SLAB_OF}"),
    C(SE, "rank: input_ids 2-D", lambda c: c.se(input_ids=c.ids[None]), ValueError, "input_ids must be 1-D"),
    C(SE, "rank: table 1-D", lambda c: c.se(table=c.table[0]), ValueError, r"table must be 2-D, got shape \(32,\)"),
    C(SE, "rank: media 3-D", lambda c: c.se(media=c.media[None]), ValueError, "media must be 2-D"),
    C(SE, "rank: slab 3-D view", lambda c: c.se(slab=c.buffers.input_embeds.view(T, 2, W // 2)), ValueError,
      rf"slab must be 2-D, got shape \({T}, 2, {W // 2}\)"),
    C(SE, "shape: media_index one short", lambda c: c.se(media_index=c.media_index[:-1]), ValueError,
      rf"media_index must have shape \({N}\), got \({N - 1},\)"),
    C(SE, "shape: errors of 3 words", lambda c: c.se(errors=c.buffers.errors[:3]), ValueError, "at least 4 elements"),
    C(SE, "strided: input_ids", lambda c: c.se(input_ids=c.ints(V, 2 * N)[::2]), ValueError,
      "input_ids must be contiguous along its last axis"),
    C(SE, "strided: table columns (transposed)", lambda c: c.se(table=c.rand(W, V).t()), ValueError,
      "table must be contiguous along its last axis"),
    C(SE, "strided: media columns", lambda c: c.se(media=c.rand(M, 2 * W)[:, ::2]), ValueError,
      "media must be contiguous along its last axis"),
    C(SE, "strided: media_index", lambda c: c.se(media_index=c.media_index.repeat_interleave(2)[::2]), ValueError,
      "media_index must be contiguous"),
    C(SE, "strided: slab columns", lambda c: c.se(slab=c.buffers.input_embeds[:, ::2], table=c.table[:, :W // 2],
                                                  media=c.media[:, :W // 2]),
      ValueError, r"slab must be contiguous along its last axis, got stride \(32, 2\)"),
    C(SE, "strided: slab column slice", lambda c: c.se(slab=c.buffers.input_embeds[:, :W // 2],
                                                       table=c.table[:, :W // 2], media=c.media[:, :W // 2]),
      ValueError, r"slab rows must be contiguous with stride \(16, 1\), got \(32, 1\)"),
    C(SE, "strided: errors", lambda c: c.se(errors=ss.new_error_word(c.device).repeat(2)[::2]), ValueError,
      "errors must be a contiguous"),
    C(SE, "capacity: n above the slab rows",
      lambda c: c.se(input_ids=c.ints(V, T + 1), media=None, media_index=None, pad_to=None),
      ValueError, f"{T + 1} tokens exceed the slab's {T} rows"),
    C(SE, "pad_to below n", lambda c: c.se(pad_to=N - 1), ValueError,
      rf"pad_to must be an int in \[{N}, {T}\], got {N - 1}"),
    C(SE, "pad_to above capacity", lambda c: c.se(pad_to=T + 1), ValueError, rf"pad_to must be an int in \[{N}, {T}\], got {T + 1}"),
    C(SE, "pad_to not an int", lambda c: c.se(pad_to=float(PAD)), TypeError, rf"pad_to must be an int, got {float(PAD)} \(float\)"),
    C(SE, "width: media wider than the slab", lambda c: c.se(media=c.rand(M, W + 1)), WidthContractError,
      rf"media rows are {W + 1} wide, but media must be as wide as the input_embeds slab \({W}\)"),
    C(SE, "width: table wider than the slab", lambda c: c.se(table=c.rand(V, W + 8)), WidthContractError,
      f"table rows are {W + 8} wide"),
    C(SE, "width: repeat, media width not dividing", lambda c: c.se(media=c.rand(M, 12), expand="repeat"),
      WidthContractError, rf"media rows are 12 wide, but media must be as wide as the input_embeds slab \({W}\).*got expand='repeat'"),
    C(SE, "width: repeat, table width not dividing", lambda c: c.se(table=c.rand(V, 7), expand="repeat"),
      WidthContractError, f"table width 7 does not divide the slab width {W}"),
    C(SE, "expand unknown", lambda c: c.se(expand="tile"), ValueError, "expand must be one of 'zeros', 'repeat', got 'tile'"),
    C(SE, "media without media_index", lambda c: c.se(media_index=None), ValueError,
      "media was given without media_index"),
    C(SE, "vocab_range reversed", lambda c: c.se(vocab_range=(5, 2)), ValueError, r"vocab_range end must be an int in \[5, 2147483647\], got 2"),
    C(SE, "vocab_range wider than the table", lambda c: c.se(vocab_range=(0, V + 1)), ValueError,
      rf"vocab_range \(0, {V + 1}\) spans {V + 1} ids but the table has {V} rows"),
    C(SE, "vocab_size below the table", lambda c: c.se(vocab_size=V - 1), ValueError,
      rf"vocab_size must be an int in \[{V}, 2147483647\], got {V - 1}"),
    C(SE, "text_scale not a number", lambda c: c.se(text_scale="2"), TypeError, r"text_scale must be a real number, got '2' \(str\)"),
    # -- stage_token_inputs -------------------------------------------------------------------------
    C(STI, "dtype: input_ids float", lambda c: c.sti(input_ids=c.ids.float()), TypeError,
      "input_ids dtype must be one of int32, int64, got torch.float32"),
    C(STI, "dtype: positions int16", lambda c: c.sti(positions=c.positions.short()), TypeError,
      "positions dtype must be one of int32, int64, got torch.int16"),
    C(STI, "dtype: seq_lens float", lambda c: c.sti(seq_lens=c.seq_lens.float()), TypeError,
      "seq_lens dtype must be one of int32, int64, got torch.float32"),
    C(STI, "non-tensor positions", lambda c: c.sti(positions=list(range(N))), TypeError,
      "positions must be a torch.Tensor"),
    C(STI, "device: input_ids", lambda c: c.sti(input_ids=c.ids.to(c.alien)), ValueError,
      r"input_ids is on \S+; expected \S+ or the host \(CPU\)"),
    C(STI, "device: positions", lambda c: c.sti(positions=c.positions.to(c.alien)), ValueError, "positions is on"),
    C(STI, "device: out_cache_loc", lambda c: c.sti(out_cache_loc=c.cache_loc.to(c.alien)), ValueError,
      "out_cache_loc is on"),
    C(STI, "device: mrope_positions", lambda c: c.sti(mrope_positions=c.mrope.to(c.alien)), ValueError,
      "mrope_positions is on"),
    C(STI, "device: extend_start_loc", lambda c: c.sti(extend_start_loc=c.extend_start_loc.to(c.alien)), ValueError,
      "extend_start_loc is on"),
    C(STI, "rank: input_ids 2-D", lambda c: c.sti(input_ids=c.ids[None]), ValueError, "input_ids must be 1-D"),
    C(STI, "rank: seq_lens 2-D", lambda c: c.sti(seq_lens=c.seq_lens[None]), ValueError, "seq_lens must be 1-D"),
    C(STI, "shape: positions one short", lambda c: c.sti(positions=c.positions[:-1]), ValueError,
      rf"positions must have shape \({N}\), got \({N - 1},\)"),
    C(STI, "shape: out_cache_loc one long", lambda c: c.sti(out_cache_loc=c.ints(9, N + 1)), ValueError,
      rf"out_cache_loc must have shape \({N}\), got \({N + 1},\)"),
    C(STI, "shape: mrope_positions 1-D", lambda c: c.sti(mrope_positions=c.mrope[0]), ValueError,
      rf"mrope_positions must have shape \(3, {N}\)"),
    C(STI, "shape: mrope_positions 2 rows", lambda c: c.sti(mrope_positions=c.mrope[:2]), ValueError,
      rf"mrope_positions must have shape \(3, {N}\), got \(2, {N}\)"),
    C(STI, "shape: extend_start_loc vs seq_lens", lambda c: c.sti(extend_start_loc=c.ints(9, 3, dtype=torch.int32)),
      ValueError, "extend_start_loc has 3 entries but seq_lens has 2: one per request"),
    C(STI, "strided: positions", lambda c: c.sti(positions=c.ints(9, 2 * N)[::2]), ValueError,
      "positions must be contiguous along its last axis"),
    C(STI, "strided: mrope_positions columns", lambda c: c.sti(mrope_positions=c.ints(9, N, 3).t()), ValueError,
      "mrope_positions must be contiguous along its last axis"),
    C(STI, "capacity: n above the buffers", lambda c: c.sti(**{k: c.ints(9, T + 1) for k in
                                                               ("input_ids", "positions", "out_cache_loc")},
                                                            mrope_positions=c.ints(9, 3, T + 1), pad_to=T + 1),
      ValueError, f"{T + 1} tokens exceed the buffers. capacity of {T} tokens"),
    C(STI, "pad_to below n", lambda c: c.sti(pad_to=N - 1), ValueError, rf"pad_to must be an int in \[{N}, {T}\], got {N - 1}"),
    C(STI, "pad_to above capacity", lambda c: c.sti(pad_to=T + 1), ValueError, rf"pad_to must be an int in \[{N}, {T}\], got {T + 1}"),
    C(STI, "pad_to missing (None)", lambda c: c.sti(pad_to=None), TypeError, r"pad_to must be an int, got None \(NoneType\)"),
    C(STI, "requests above max_batch_size", lambda c: c.sti(seq_lens=c.ints(9, B + 1, dtype=torch.int32),
                                                            extend_start_loc=c.ints(9, B + 1, dtype=torch.int32)),
      ValueError, f"{B + 1} requests exceed max_batch_size={B}"),
    C(STI, "mrope_positions without an mrope slot", lambda c: c.sti(buffers=c.plain), ValueError,
      "allocated without mrope=True"),
    # -- stage_batch (the runner's one launch, outside the runner) ---------------------------------------
    C(PSB, "dtype: input_ids float", lambda c: c.psb(input_ids=c.ids.float()), TypeError,
      "input_ids dtype must be one of int32, int64, got torch.float32"),
    C(PSB, "dtype: table int", lambda c: c.psb(table=c.ints(9, V, W)), TypeError, "table dtype must be"),
    C(PSB, "dtype: media float64", lambda c: c.psb(media=c.media.double()), TypeError, "media dtype must be"),
    C(PSB, "dtype: media_index float", lambda c: c.psb(media_index=c.media_index.float()), TypeError,
      "media_index dtype must be"),
    C(PSB, "non-tensor media_index", lambda c: c.psb(media_index=c.media_index.tolist()), TypeError,
      "media_index must be a torch.Tensor"),
    C(PSB, "device: table", lambda c: c.psb(table=c.table.to(c.foreign)), ValueError, f"table is on {ON_OTHER}"),
    C(PSB, "device: media", lambda c: c.psb(media=c.media.to(c.foreign)), ValueError, f"media is on {ON_OTHER}"),
    C(PSB, "device: media_index", lambda c: c.psb(media_index=c.media_index.to(c.alien)), ValueError,
      "media_index is on .*; expected .* or the host"),
    C(PSB, "device: positions", lambda c: c.psb(positions=c.positions.to(c.alien)), ValueError, "positions is on"),
    C(PSB, "rank: table 1-D", lambda c: c.psb(table=c.table[0]), ValueError, "table must be 2-D"),
    C(PSB, "shape: media_index one short", lambda c: c.psb(media_index=c.media_index[:-1]), ValueError,
      rf"media_index must have shape \({N}\), got \({N - 1},\)"),
    C(PSB, "shape: seq_lens vs extend_start_loc", lambda c: c.psb(seq_lens=c.seq_lens[:1]), ValueError,
      "extend_start_loc has 2 entries but seq_lens has 1: one per request"),
    C(PSB, "strided: input_ids", lambda c: c.psb(input_ids=c.ints(V, 2 * N)[::2]), ValueError,
      "input_ids must be contiguous"),
    C(PSB, "strided: media_index", lambda c: c.psb(media_index=c.media_index.repeat_interleave(2)[::2]), ValueError,
      "media_index must be contiguous"),
    C(PSB, "capacity: n above the buffers", lambda c: c.psb(input_ids=c.ints(V, T + 1), positions=c.ints(9, T + 1),
                                                            out_cache_loc=None, media=None, media_index=None,
                                                            pad_to=T + 1),
      ValueError, f"{T + 1} tokens exceed the buffers. capacity of {T} tokens"),
    C(PSB, "pad_to below n", lambda c: c.psb(pad_to=N - 1), ValueError, rf"pad_to must be an int in \[{N}, {T}\], got {N - 1}"),
    C(PSB, "width: media wider than the slab", lambda c: c.psb(media=c.rand(M, W + 1)), WidthContractError,
      f"media rows are {W + 1} wide"),
    C(PSB, "width: repeat not dividing", lambda c: c.psb(table=c.rand(V, 12), expand="repeat"), WidthContractError,
      "table width 12 does not divide"),
    C(PSB, "media without media_index", lambda c: c.psb(media_index=None), ValueError,
      "media was given without media_index"),
    C(PSB, "requests above max_batch_size", lambda c: c.psb(seq_lens=c.ints(9, B + 1, dtype=torch.int32),
                                                            extend_start_loc=c.ints(9, B + 1, dtype=torch.int32)),
      ValueError, f"{B + 1} requests exceed max_batch_size={B}"),
    # -- media_index_from_spans ---------------------------------------------------------------------
    C(MIS, "spans overlap", lambda c: c.mis([(0, 4, 0), (2, 2, 4)]), ValueError, "spans 0 and 1 overlap at row 2"),
    C(MIS, "span runs past n", lambda c: c.mis([(8, 3, 0)]), ValueError,
      rf"span 0 \(8, 3, 0\) runs past num_tokens={N}"),
    C(MIS, "span reads past the media rows", lambda c: c.mis([(0, 4, 3)]), ValueError,
      f"reads past the {M} media rows"),
    C(MIS, "span with a negative start", lambda c: c.mis([(-1, 2, 0)]), ValueError, "has a negative value"),
    C(MIS, "span with a negative length", lambda c: c.mis([(3, -2, 0)]), ValueError, "has a negative value"),
    C(MIS, "span of two fields", lambda c: c.mis([(0, 1)]), ValueError, r"must be \(dst_start, length, src_start\)"),
    C(MIS, "span field a float", lambda c: c.mis([(0, 1.0, 0)]), TypeError, "span 0 field must be an int"),
    C(MIS, "num_tokens negative", lambda c: c.mis([], num_tokens=-1), ValueError, "num_tokens must be >= 0"),
    C(MIS, "num_tokens a float", lambda c: c.mis([], num_tokens=10.0), TypeError, "num_tokens must be an int"),
    C(MIS, "num_media_rows a float", lambda c: c.mis(num_media_rows=6.5), TypeError,
      "num_media_rows must be an int"),
    C(MIS, "num_media_rows negative", lambda c: c.mis([], num_media_rows=-1), ValueError,
      "num_media_rows must be >= 0"),
    # -- media_index_from_mask ----------------------------------------------------------------------
    C(MIM, "dtype: int mask", lambda c: c.mim(is_media=(c.media_index >= 0).long()), TypeError,
      "is_media must be a bool tensor"),
    C(MIM, "rank: 2-D mask", lambda c: c.mim(is_media=(c.media_index >= 0)[None]), ValueError,
      "is_media must be a 1-D tensor"),
    C(MIM, "device: mask", lambda c: c.mim(is_media=(c.media_index >= 0).to(c.foreign)), ValueError,
      "errors is on .* but is_media is on"),
    C(MIM, "device: errors", lambda c: c.mim(errors=c.buffers.errors.to(c.foreign)), ValueError,
      "errors is on .* but is_media is on"),
    C(MIM, "dtype: errors int64", lambda c: c.mim(errors=c.buffers.errors.long()), ValueError,
      "errors must be a contiguous 1-D int32"),
    C(MIM, "num_media_rows negative", lambda c: c.mim(num_media_rows=-1), ValueError, "num_media_rows must be >= 0"),
    C(MIM, "num_media_rows a float", lambda c: c.mim(num_media_rows=5.0), TypeError, "num_media_rows must be an int"),
    # -- StagingBuffers.allocate --------------------------------------------------------------------
    C(ALLOC, "dtype: embed_dtype int", lambda c: c.alloc(embed_dtype=torch.int32), ValueError,
      "embed_dtype must be a floating torch.dtype"),
    C(ALLOC, "dtype: embed_dtype not a dtype", lambda c: c.alloc(embed_dtype="bf16"), ValueError,
      "embed_dtype must be a floating"),
    C(ALLOC, "dtype: cache_loc float", lambda c: c.alloc(cache_loc_dtype=torch.float32), ValueError,
      "cache_loc_dtype must be torch.int32 or torch.int64"),
    C(ALLOC, "capacity zero", lambda c: c.alloc(max_num_tokens=0), ValueError,
      "max_num_tokens must be a positive int, got 0"),
    C(ALLOC, "max_batch_size negative", lambda c: c.alloc(max_batch_size=-1), ValueError,
      "max_batch_size must be a positive int"),
    C(ALLOC, "embed_width a float", lambda c: c.alloc(embed_width=2.5), ValueError,
      "embed_width must be a positive int"),
    C(ALLOC, "embed_width a bool", lambda c: c.alloc(embed_width=True), ValueError,
      "embed_width must be a positive int"),
    C(ALLOC, "mrope not a bool", lambda c: c.alloc(mrope="yes"), ValueError, "mrope must be a bool"),
    C(ALLOC, "device: no such device", lambda c: c.alloc(device="cuda:99"), ValueError, "is not usable"),
    C(ALLOC, "device: not a device", lambda c: c.alloc(device="gpu-please"), ValueError, "is not usable"),
    # -- BufferRegistry (the buffers' own registry) -------------------------------------------------
    C(REG, "register a non-tensor", lambda c: c.buffers.registry.register("extra", [0] * T), TypeError,
      "slot 'extra': expected a torch.Tensor"),
    C(REG, "register a taken name", lambda c: c.buffers.registry.register("positions", c.ints(9, T)), ValueError,
      "slot 'positions' is already registered"),
    C(REG, "register: token_axis out of range", lambda c: c.buffers.registry.register("extra", c.ints(9, T),
                                                                                      token_axis=1),
      ValueError, "token_axis 1 is out of range for a 1-d tensor"),
    C(REG, "register: pad policy unknown", lambda c: c.buffers.registry.register("extra", c.ints(9, T), pad="ones"),
      ValueError, "pad must be 'zeros', a number or None"),
    C(REG, "register: pad a bool", lambda c: c.buffers.registry.register("extra", c.ints(9, T), pad=True),
      ValueError, "pad must be 'zeros'"),
    C(REG, "replace an unknown slot", lambda c: c.buffers.registry.replace("nope", c.ints(9, T)), KeyError,
      "no slot 'nope'; registered: input_ids"),
    C(REG, "views(n) negative", lambda c: c.buffers.registry.views(-1), ValueError,
      r"views\(n\): n must be an int >= 0, got -1"),
    C(REG, "views(n) not an int", lambda c: c.buffers.registry.views(2.0), ValueError, r"views\(n\): n must be an int, got 2.0 \(float\)"),
    C(REG, "views(n) above capacity", lambda c: c.buffers.registry.views(T + 1), ValueError,
      f"views\\({T + 1}\\): slot 'input_ids' holds only {T} tokens"),
    C(REG, "register while frozen", lambda c: c.frozen(lambda r: r.register("extra", c.ints(9, T))),
      RegistryMismatchError, "cannot register slot 'extra': the registry is frozen"),
    C(REG, "replace while frozen", lambda c: c.frozen(lambda r: r.replace("positions", c.ints(9, T))),
      RegistryMismatchError, "cannot replace slot 'positions': the registry is frozen"),
    C(REG, "check: a slot replaced since the signature", lambda c: _replaced_since_signature(c), RegistryMismatchError,
      "slot 'x' data_ptr changed"),
    C(REG, "check: a slot resized in place since the signature", lambda c: _resized_since_signature(c),
      RegistryMismatchError, r"slot 'x' shape changed from \(24,\) to \(12,\)"),
    # -- resolve_input_embeds_width -----------------------------------------------------------------
    C(WIDTH, "declared below the config width", lambda c: c.width(input_embeds_hidden_size=100), WidthContractError,
      "ToyVLM.input_embeds_hidden_size = 100 is below the config hidden size 128"),
    C(WIDTH, "declared a float", lambda c: c.width(input_embeds_hidden_size=256.0), WidthContractError,
      "must be a positive int, got 256.0"),
    C(WIDTH, "declared None", lambda c: c.width(input_embeds_hidden_size=None), WidthContractError,
      "must be a positive int, got None"),
    C(WIDTH, "declared a bool", lambda c: c.width(input_embeds_hidden_size=True), WidthContractError,
      "must be a positive int, got True"),
    C(WIDTH, "declared zero", lambda c: c.width(input_embeds_hidden_size=0), WidthContractError,
      "must be positive, got 0"),
    C(WIDTH, "declared negative", lambda c: c.width(input_embeds_hidden_size=-512), WidthContractError,
      "must be positive, got -512"),
    C(WIDTH, "near miss: plural", lambda c: c.width(inputs_embeds_hidden_size=512), WidthContractError,
      "has attribute 'inputs_embeds_hidden_size' but not 'input_embeds_hidden_size'"),
    C(WIDTH, "near miss: typo", lambda c: c.width(input_embeds_hiden_size=512), WidthContractError, "misspelt"),
    C(WIDTH, "near miss: case", lambda c: c.width(Input_Embeds_Hidden_Size=512), WidthContractError, "misspelt"),
    C(WIDTH, "near miss of another width (hc_hidden_size)", lambda c: c.width(attr="hc_hidden_size", hc_hiden_size=512),
      WidthContractError, "but not 'hc_hidden_size'"),
    C(WIDTH, "config width zero", lambda c: c.width(hidden=0), WidthContractError,
      "config hidden size must be a positive int, got 0"),
    # -- PrefillBatch -------------------------------------------------------------------------------
    C(BATCH, "empty batch", lambda c: c.batch(input_ids=c.ids[:0], positions=c.positions[:0], out_cache_loc=None,
                                              media=None, media_index=None), ValueError, "PrefillBatch is empty"),
    C(BATCH, "non-tensor input_ids", lambda c: c.batch(input_ids=c.ids.tolist()), TypeError,
      "input_ids must be a torch.Tensor, got list"),
    C(BATCH, "rank: input_ids 2-D", lambda c: c.batch(input_ids=c.ids[None]), ValueError,
      rf"input_ids must be 1-D, got shape \(1, {N}\)"),
    C(BATCH, "rank: table 1-D", lambda c: c.batch(table=c.table[0]), ValueError, r"table must be 2-D, got shape \(32,\)"),
    C(BATCH, "rank: media 3-D", lambda c: c.batch(media=c.media[None]), ValueError, "media must be 2-D"),
    C(BATCH, "rank: mrope_positions 1-D", lambda c: c.batch(mrope_positions=c.mrope[0]), ValueError,
      rf"mrope_positions must have shape \(3, {N}\), got \({N},\)"),
    C(BATCH, "shape: positions one short", lambda c: c.batch(positions=c.positions[:-1]), ValueError,
      rf"positions must have shape \({N}\), got \({N - 1},\)"),
    C(BATCH, "shape: media_index one long", lambda c: c.batch(media_index=c.ints(M, N + 1)), ValueError,
      rf"media_index must have shape \({N}\), got \({N + 1},\)"),
    C(BATCH, "shape: out_cache_loc one short", lambda c: c.batch(out_cache_loc=c.cache_loc[:-1]), ValueError,
      rf"out_cache_loc must have shape \({N}\), got \({N - 1},\)"),
    C(BATCH, "media without media_index", lambda c: c.batch(media_index=None), ValueError,
      "PrefillBatch.media was given without media_index"),
    C(BATCH, "seq_lens without extend_start_loc", lambda c: c.batch(extend_start_loc=None), ValueError,
      "give seq_lens and extend_start_loc together"),
    C(BATCH, "expand unknown", lambda c: c.batch(expand="tile"), ValueError, "expand must be one of 'zeros', 'repeat', got 'tile'"),
    # -- PrefillGraphRunner.run (captured on CUDA: N replays in bucket 16; eager on CPU) --------------
    C(RUN, "not a PrefillBatch", lambda c: c.runner.run(c.token_inputs()), TypeError, r"run\(\) takes a PrefillBatch"),
    C(RUN, "capacity: n above the buffers", lambda c: c.run(input_ids=c.ints(V, T + 1), positions=c.ints(9, T + 1),
                                                            out_cache_loc=None, media=None, media_index=None),
      ValueError, f"batch of {T + 1} tokens exceeds the buffers' capacity of {T} tokens"),
    C(RUN, "dtype: input_ids float", lambda c: c.run(input_ids=c.ids.float()), TypeError,
      "input_ids dtype must be one of int32, int64, got torch.float32"),
    C(RUN, "dtype: input_ids float, eager size",
      lambda c: c.run(input_ids=c.rand(T - 2), positions=c.ints(9, T - 2), out_cache_loc=None, media=None,
                      media_index=None),
      TypeError, "input_ids dtype must be one of int32, int64, got torch.float32"),
    C(RUN, "dtype: table int", lambda c: c.run(table=c.ints(9, V, W)), TypeError, "table dtype must be"),
    C(RUN, "dtype: table float64", lambda c: c.run(table=c.table.double()), TypeError, "table dtype must be"),
    C(RUN, "dtype: media_index float", lambda c: c.run(media_index=c.media_index.float()), TypeError,
      "media_index dtype must be"),
    C(RUN, "device: table", lambda c: c.run(table=c.table.to(c.foreign)), ValueError, f"table is on {ON_OTHER}"),
    C(RUN, "device: media", lambda c: c.run(media=c.media.to(c.foreign)), ValueError, f"media is on {ON_OTHER}"),
    C(RUN, "device: media_index", lambda c: c.run(media_index=c.media_index.to(c.alien)), ValueError,
      "media_index is on"),
    C(RUN, "device: positions", lambda c: c.run(positions=c.positions.to(c.alien)), ValueError, "positions is on"),
    C(RUN, "strided: positions", lambda c: c.run(positions=c.ints(9, 2 * N)[::2]), ValueError,
      "positions must be contiguous"),
    C(RUN, "strided: table columns", lambda c: c.run(table=c.rand(W, V).t()), ValueError,
      "table must be contiguous along its last axis"),
    C(RUN, "width: media wider than the slab", lambda c: c.run(media=c.rand(M, W + 1)), WidthContractError,
      rf"media rows are {W + 1} wide, but media must be as wide as the input_embeds slab \({W}\)"),
    C(RUN, "width: repeat not dividing", lambda c: c.run(media=c.rand(M, 12), expand="repeat"), WidthContractError,
      rf"media rows are 12 wide, but media must be as wide as the input_embeds slab \({W}\).*got expand='repeat'"),
    C(RUN, "requests above max_batch_size", lambda c: c.run(seq_lens=c.ints(9, B + 1, dtype=torch.int32),
                                                            extend_start_loc=c.ints(9, B + 1, dtype=torch.int32)),
      ValueError, f"{B + 1} requests exceed max_batch_size={B}"),
    C(RUN, "mrope_positions without an mrope slot", lambda c: c.run(mrope_positions=c.mrope), ValueError,
      "allocated without mrope=True"),
    # -- PrefillGraphRunner() -----------------------------------------------------------------------
    C(RUNNER, "forward not callable", lambda c: PrefillGraphRunner(None, c.buffers), TypeError,
      "forward must be callable"),
    C(RUNNER, "buffers not StagingBuffers", lambda c: PrefillGraphRunner(lambda v: v, c.buffers.registry), TypeError,
      "buffers must be StagingBuffers"),
    C(RUNNER, "bucket above capacity", lambda c: PrefillGraphRunner(lambda v: v, c.buffers, buckets=[8, T + 1]),
      ValueError, f"bucket {T + 1} exceeds the buffers' capacity of {T} tokens"),
    C(RUNNER, "bucket zero", lambda c: PrefillGraphRunner(lambda v: v, c.buffers, buckets=[0, 8]), ValueError,
      r"buckets\[0\] must be an int >= 1, got 0"),
    C(RUNNER, "max_padding_ratio below 1", lambda c: PrefillGraphRunner(lambda v: v, c.buffers, max_padding_ratio=0.5),
      ValueError, "max_padding_ratio must be a finite number >= 1, got 0.5"),
]


def _replaced_since_signature(c):
    reg = BufferRegistry()
    reg.register("x", c.ints(9, T))
    sig = reg.signature()
    reg.replace("x", c.ints(9, T))
    reg.check(sig)


def _resized_since_signature(c):
    reg = BufferRegistry()
    t = reg.register("x", c.ints(9, T))
    sig = reg.signature()
    t.resize_(T // 2)  # same storage, same address: only the shape tells
    reg.check(sig)


def _case_id(case: Case) -> str:
    return f"{case.entry}/{case.what}".replace(" ", "-")


@pytest.mark.parametrize("case", HOST_CASES, ids=_case_id)
def test_host_side_bad_input_raises_and_writes_nothing(case, device):
    c = make_ctx(device, seed=zlib.crc32(case.what.encode()), with_runner=case.entry == RUN)
    _poison_word(default_error_word(device), c.g)  # calls without errors= report there
    before = snapshot(c)
    try:
        with pytest.raises(case.exc, match=case.match):
            case.call(c)
        assert_unchanged(before, c)
    finally:
        reset_errors(default_error_word(device))


def test_every_entry_point_is_in_the_matrix():
    entries = {case.entry for case in HOST_CASES} | {case.entry for case in DEVICE_CASES}
    assert entries >= {SE, STI, PSB, MIS, MIM, ALLOC, REG, WIDTH, BATCH, RUN, RUNNER}


# ==================================================================================================
# Edges that are not errors: they must do exactly what the contract says
# ==================================================================================================
def test_narrow_media_with_expand_zeros_is_fine(device):
    """Media as narrow as the text rows is zero-padded; a width that is neither the slab's nor the text's is not."""
    c = make_ctx(device, seed=1)
    reset_errors(c.buffers.errors)
    narrow = c.rand(M, 12)
    before = snapshot(c)
    with pytest.raises(WidthContractError, match=r"media rows are 12 wide, but media must be as wide as"):
        c.se(media=narrow)  # the text rows are W wide
    assert_unchanged(before, c)
    c.se(media=narrow, table=c.table[:, :12].contiguous())
    slab = c.buffers.input_embeds.cpu()
    rows = [r for r in range(N) if r not in TEXT_ROWS]
    assert torch.equal(slab[rows, :12], narrow.cpu()[c.media_index.cpu()[rows]])
    assert (slab[rows, 12:] == 0).all()
    assert c.buffers.errors.tolist() == [0, 0, NO_ROW, 0]


@pytest.mark.parametrize("pad_to", [None, 0, 5])
def test_empty_batch_stages_only_the_padding(pad_to, device):
    """n = 0 is not an error below PrefillBatch: the padding rows are written, and the token count (0)."""
    c = make_ctx(device, seed=2)
    before = snapshot(c)
    reset_errors(c.buffers.errors)
    ss.stage_embeddings(c.buffers.input_embeds, c.ids[:0], c.table, pad_to=pad_to, errors=c.buffers.errors)
    slab, was = c.buffers.input_embeds, before[(0, "input_embeds")][-1]
    k = pad_to or 0
    assert (slab[:k] == 0).all() and torch.equal(slab[k:].nan_to_num(), was[k:].nan_to_num())
    assert c.buffers.errors.tolist() == [0, 0, NO_ROW, 0]
    ss.stage_token_inputs(c.buffers, input_ids=c.ids[:0], positions=c.positions[:0], pad_to=k)
    assert c.buffers.num_tokens_non_padded.tolist() == [0]
    ids_was = before[(0, "input_ids")][-1]
    assert (c.buffers.input_ids[:k] == 0).all() and torch.equal(c.buffers.input_ids[k:], ids_was[k:])
    c.buffers.num_tokens_non_padded.fill_(7)
    c.buffers.input_embeds.fill_(3.0)
    empty = {"input_ids": c.ids[:0], "positions": c.positions[:0], "media": None, "media_index": None,
             "out_cache_loc": None, "seq_lens": c.seq_lens[:0], "extend_start_loc": c.extend_start_loc[:0]}
    c.psb(**empty, pad_to=k)  # the fused launch: the same slots as the two calls above, even with no row
    assert c.buffers.num_tokens_non_padded.tolist() == [0] and not c.buffers.seq_lens.any()
    assert (slab[:k] == 0).all() and (slab[k:] == 3.0).all()
    assert c.mis([], num_tokens=0).shape == (0,)
    assert c.mis([], num_tokens=N).tolist() == [-1] * N
    assert c.mis([(N, 0, 0)]).tolist() == [-1] * N  # an empty span at the end covers nothing


def test_host_integer_inputs_are_accepted_next_to_device_buffers(device):
    """The one place a CPU tensor is not foreign: integer inputs, packed and copied by the launch."""
    c = make_ctx(device, seed=3)
    host = {k: v.cpu() for k, v in c.token_inputs(mrope_positions=c.mrope).items()}
    ss.stage_token_inputs(c.buffers, **host, pad_to=PAD)
    assert torch.equal(c.buffers.input_ids[:N].cpu(), host["input_ids"])
    assert torch.equal(c.buffers.mrope_positions[:, :N].cpu(), host["mrope_positions"])


# ==================================================================================================
# Device-side cases: the error word, zero-filled rows, no out-of-bounds read or write
# ==================================================================================================
class DeviceCase(NamedTuple):
    entry: str
    what: str
    corrupt: Callable  # (ids, media_index, ctx, errors) -> (ids, media_index); tensors are host copies
    word: tuple  # (codes, rows, first row, count) after staging
    with_media: bool = True  # False: no media rows are passed at all


def ids_at(**bad):
    def corrupt(ids, index, c, errors):
        for row, value in bad.items():
            ids[int(row[1:])] = value
        return ids, index
    return corrupt


def index_at(**bad):
    def corrupt(ids, index, c, errors):
        for row, value in bad.items():
            index[int(row[1:])] = value
        return ids, index
    return corrupt


def both(*fs):
    def corrupt(ids, index, c, errors):
        for f in fs:
            ids, index = f(ids, index, c, errors)
        return ids, index
    return corrupt


def from_mask(extra_rows, num_media_rows=M):
    """media_index built on the device from the placeholder mask (plus ``extra_rows`` marked as placeholders)."""
    def corrupt(ids, index, c, errors):
        mask = index >= 0
        mask[list(extra_rows)] = True
        return ids, ss.media_index_from_mask(mask.to(c.device), num_media_rows, errors=errors).cpu()
    return corrupt


_ENTRIES_ON_DEVICE = (SE, PSB, RUN)
_CORRUPTIONS = [
    # id, corruption, expected word
    ("id -1", ids_at(r1=-1), (BAD_TOKEN_ID, 1, 1, 0)),
    ("id = V", ids_at(r8=V), (BAD_TOKEN_ID, 1, 8, 0)),
    ("id 2**40", ids_at(r0=2**40), (BAD_TOKEN_ID, 1, 0, 0)),
    ("ids past V at three rows", ids_at(r9=V + 7, r5=-(2**62), r1=V), (BAD_TOKEN_ID, 3, 1, 0)),
    ("bad id on a media row is ignored", ids_at(r3=-1, r6=V), (0, 0, NO_ROW, 0)),
    ("media index = M", index_at(r6=M), (BAD_MEDIA_INDEX, 1, 6, 0)),
    ("media index 2**31-1", index_at(r2=2**31 - 1), (BAD_MEDIA_INDEX, 1, 2, 0)),
    ("media index on a text row past M", index_at(r9=M + 3), (BAD_MEDIA_INDEX, 1, 9, 0)),
    ("bad id and bad media index", both(ids_at(r9=V), index_at(r3=M + 2)), (BAD_TOKEN_ID | BAD_MEDIA_INDEX, 2, 3, 0)),
    ("mask count below media rows", from_mask([]), (MEDIA_COUNT_MISMATCH, 0, NO_ROW, 5)),
    ("mask count above media rows", from_mask([8, 9]), (MEDIA_COUNT_MISMATCH | BAD_MEDIA_INDEX, 1, 9, 7)),
    ("mask count above media rows, no media", from_mask([], num_media_rows=0),
     (MEDIA_COUNT_MISMATCH | BAD_MEDIA_INDEX, 5, 2, 5), False),
]
DEVICE_CASES = [DeviceCase(entry, *corruption) for entry in _ENTRIES_ON_DEVICE for corruption in _CORRUPTIONS]


def expected_slab_rows(ids, index, table, media):
    """What rows [0, n) must hold: the source row when it is in bounds, else zeros (tests/expected.py)."""
    return expected_slab(torch.zeros(len(ids), W), ids, table, media, index)[0]


@pytest.mark.parametrize("case", DEVICE_CASES, ids=_case_id)
def test_device_side_bad_input_sets_the_word_and_stays_in_bounds(case, device):
    c = make_ctx(device, seed=zlib.crc32(case.what.encode()), with_runner=case.entry == RUN)
    target = c.runner.buffers if case.entry == RUN else c.buffers
    errors = target.errors
    reset_errors(errors)
    media = c.media if case.with_media else None
    ids, index = case.corrupt(c.ids.cpu(), c.media_index.cpu(), c, errors)
    before = snapshot(c)
    if case.entry == SE:
        c.se(input_ids=ids.to(device), media_index=index.to(device), media=media)
        pad_to = PAD
    elif case.entry == PSB:
        c.psb(input_ids=ids.to(device), media_index=index.to(device), media=media)
        pad_to = PAD
    else:
        out = c.run(input_ids=ids, media_index=index, media=media)  # host integer inputs, as a scheduler has them
        pad_to = c.runner.last_bucket or N
        assert out.shape == (N, W) and torch.isfinite(out).all()
    assert tuple(errors.tolist()) == case.word
    slab, was = target.input_embeds.cpu(), before[(c.all_buffers.index(target), "input_embeds")][-1].cpu()
    want = expected_slab_rows(ids, index, c.table.cpu(), media.cpu() if media is not None else None)
    assert torch.equal(slab[:N], want), "rows [0, n): source rows in bounds, zeros for bad rows"
    assert (slab[N:pad_to] == 0).all(), "rows [n, pad_to) are padding"
    assert torch.equal(slab[pad_to:].view(torch.uint8), was[pad_to:].view(torch.uint8)), "rows >= pad_to untouched"
    assert not (slab.nan_to_num().abs() >= SENTINEL).any(), "a sentinel row was read"
    for big, rows in ((c.big_table, V), (c.big_media, M)):  # the sources were not written either
        guards = torch.cat([big[:GUARD], big[GUARD + rows:]])
        assert (guards == SENTINEL).all()
    if case.entry in (PSB, RUN):  # the integer slots were staged as given (bad ids are data, not a host error)
        assert torch.equal(target.input_ids[:N].cpu(), ids)
        assert torch.equal(target.positions[:N].cpu(), c.positions.cpu())
    reset_errors(errors)


# ==================================================================================================
# The runner: forward raising, slots reallocated behind a captured graph
# ==================================================================================================
class Flaky:
    """The toy forward, raising while armed at one token count (in capture, or in an eager run)."""

    def __init__(self, model, at: int, in_capture: bool):
        self.model, self.at, self.in_capture, self.armed = model, at, in_capture, True

    def __call__(self, views):
        out = self.model(views)
        capturing = views["input_embeds"].is_cuda and torch.cuda.is_current_stream_capturing()
        if self.armed and views["input_embeds"].shape[0] == self.at and capturing == self.in_capture:
            raise RuntimeError("forward exploded")
        return out


def _toy_runner(device, forward_factory=None, **kw):
    model = ToyMultimodalModel("plain", hidden_size=W, vocab_size=V, num_layers=1, num_heads=4, device=device)
    forward = forward_factory(model) if forward_factory else model
    return model, PrefillGraphRunner(forward, _allocate(device), buckets=BUCKETS, progress=False, **kw)


def _check_replay(c, model, runner, n, want_bucket):
    ids = c.ints(V, n)
    batch = c.batch(input_ids=ids, positions=torch.arange(n, device=c.device), out_cache_loc=None, media=None,
                    media_index=None, seq_lens=None, extend_start_loc=None)
    out = runner.run(batch, clone=True)
    assert runner.last_bucket == want_bucket
    assert torch.equal(out, model(runner.buffers.registry.views(want_bucket or n))[:n])


def test_forward_raising_in_eager_run_propagates_and_next_run_works(device):
    c = make_ctx(device, seed=4)
    model, runner = _toy_runner(device, lambda m: Flaky(m, 20, in_capture=False))
    runner.capture()
    with pytest.raises(RuntimeError, match="forward exploded"):
        _check_replay(c, model, runner, 20, None)  # 20 > largest bucket: eager on every device
    assert runner.last_bucket is None
    runner.forward.armed = False
    _check_replay(c, model, runner, 20, None)
    _check_replay(c, model, runner, 7, 8 if device.type == "cuda" else None)


@pytest.mark.cuda
def test_forward_raising_in_capture_names_the_bucket_and_capture_works_again():
    c = make_ctx(torch.device("cuda"), seed=5)
    model, runner = _toy_runner(c.device, lambda m: Flaky(m, 8, in_capture=True))
    before = {name: runner.buffers.registry[name].clone() for name in runner.buffers.registry}
    with pytest.raises(CaptureError, match="8-token bucket") as info:
        runner.capture()
    assert "forward exploded" in str(info.value) and isinstance(info.value.__cause__, RuntimeError)
    assert not runner.captured and not runner.buffers.registry.frozen
    for name, t in before.items():  # forward reads the buffers; a failed capture writes none of them
        assert torch.equal(runner.buffers.registry[name], t), name
    runner.forward.armed = False
    runner.capture()
    assert runner.captured and sorted(runner._graphs) == BUCKETS
    _check_replay(c, model, runner, 7, 8)
    _check_replay(c, model, runner, 13, 16)
    with pytest.raises(RuntimeError, match="already captured"):
        runner.capture()


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["set_ new storage", "resize_ in place", "replace while frozen"])
def test_slot_changed_after_capture_is_refused(how):
    c = make_ctx(torch.device("cuda"), seed=6)
    model, runner = _toy_runner(c.device)
    runner.capture()
    _check_replay(c, model, runner, 13, 16)
    buffers = runner.buffers
    if how == "set_ new storage":
        buffers.input_embeds.set_(torch.empty_like(buffers.input_embeds))
        exc, match = RegistryMismatchError, "slot 'input_embeds' data_ptr changed"
    elif how == "resize_ in place":
        buffers.positions.resize_(T // 2)  # same address: only the shape tells
        exc, match = RegistryMismatchError, r"slot 'positions' shape changed from \(24,\) to \(12,\)"
    else:
        with pytest.raises(RegistryMismatchError, match="cannot replace slot 'positions': the registry is frozen"):
            buffers.registry.replace("positions", torch.zeros_like(buffers.positions))
        return
    c.all_buffers = [buffers]
    _poison(buffers, c.g)
    before = snapshot(c)
    with pytest.raises(exc, match=match):
        _check_replay(c, model, runner, 13, 16)
    assert_unchanged(before, c)
    if how == "resize_ in place":  # back to the captured shape: replay is allowed again, no re-capture
        buffers.positions.resize_(T)
    else:  # dropping the graphs and capturing again against the new buffer works
        runner.reset()
        runner.capture()
    _check_replay(c, model, runner, 13, 16)
