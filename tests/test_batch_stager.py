"""BatchStager: the runner's cached staging path launches exactly what plan_stage_batch launches.

On CPU the kernel launch is replaced by a recorder: the integer arguments the
cached path builds (``BatchStager._match``) are compared with those the full path
passes to the kernel, call by call, and bad batches are shown to reach the full
path's errors with nothing launched. On a GPU the cached path runs for real and
its slots are compared with plan_stage_batch's on poisoned buffers.
"""

import pytest
import torch

import slabstage as ss
from slabstage.kernels import stage_batch as SB
from slabstage.kernels.runtime import INTERPRET
from slabstage.kernels.stage_kernel import STAGE


def _buffers(width=96, mrope=True):
    return ss.StagingBuffers.allocate(max_num_tokens=160, max_batch_size=5, embed_width=width,
                                      embed_dtype=torch.bfloat16, device="cpu", mrope=mrope)


def _batch(n, seed, *, ids_dtype=torch.int64, media=True, slots=True, expand="zeros", text_scale=None,
           vocab=None, media_owner=True, strided=False, width=96, items=False):
    g = torch.Generator().manual_seed(seed)
    tw = width if expand == "zeros" else width // 3
    table = torch.randn(57, tw + 8 * strided, generator=g).to(torch.bfloat16)[:, :tw]  # rows 8 apart when strided
    kw = dict(input_ids=torch.randint(0, 57, (n,), generator=g).to(ids_dtype),
              positions=torch.randint(0, 999, (n,), generator=g), table=table,
              expand=expand, text_scale=text_scale, media_owner=media_owner)
    if vocab is not None:
        kw["vocab_range"], kw["vocab_size"] = vocab
    if media:
        kw["media"] = torch.randn(11, tw, generator=g)  # the slab width, or the text width with expand
        m = kw["media"]
        if items == "tensors":  # the same rows as three item tensors (read from their records)
            kw["media"] = [m[:4].clone(), m[4:9].clone(), m[9:].clone()]
        elif items:  # the same rows as items: a tensor, a tuple of column blocks, an empty item, a tensor
            kw["media"] = [m[:4], (m[4:9, :tw // 3].clone(), m[4:9, tw // 3:].clone()), m[9:9], m[9:].clone()]
        spans = [(s, min(3, n - s), (s // 5) % 9) for s in range(0, n, 11) if s + 1 < n]
        kw["media_index"] = ss.media_index_from_spans(spans, n, device="cpu")
    if slots:
        kw["out_cache_loc"] = torch.randint(0, 10**6, (n,), generator=g)
        mrope = torch.randint(0, 999, (3, n + (24 if strided else 0)), generator=g)
        kw["mrope_positions"] = mrope[:, :n] if strided else mrope
        kw["seq_lens"] = torch.tensor([n - n // 2, n // 2], dtype=torch.int32)
        kw["extend_start_loc"] = torch.tensor([0, n - n // 2], dtype=torch.int32)
    return ss.PrefillBatch(**kw)


def _full_path(buf, batch, pad_to):
    SB.plan_stage_batch(
        buf, input_ids=batch.input_ids, positions=batch.positions, table=batch.table,
        out_cache_loc=batch.out_cache_loc, mrope_positions=batch.mrope_positions, seq_lens=batch.seq_lens,
        extend_start_loc=batch.extend_start_loc, media=batch.media, media_index=batch.media_index,
        expand=batch.expand, text_scale=batch.text_scale, vocab_range=batch.vocab_range,
        vocab_size=batch.vocab_size, media_owner=batch.media_owner, pad_to=pad_to)()


CONFIGS = {
    "text": dict(media=False, slots=False),
    "media+slots": dict(),
    "repeat+scale": dict(expand="repeat", text_scale=0.5),
    "int32+vocab+not-owner": dict(ids_dtype=torch.int32, vocab=((10, 57), 80), media_owner=False),
    "strided": dict(strided=True),
    "items": dict(items=True),
    "items+strided": dict(items=True, strided=True),
    "item-tensors": dict(items="tensors"),
}


class Recorder:
    """Stands in for the kernel launcher: records every launch's arguments, pointers as integers."""

    enabled = True

    def __init__(self):
        self.calls = []

    def __call__(self, grid0, args, constexprs, num_warps):
        args = STAGE.complete(args)
        self.calls.append((grid0, {k: v.data_ptr() if isinstance(v, torch.Tensor) else v
                                   for k, v in args.items()}, dict(constexprs), num_warps))
        return FakeVariant(self)


class FakeVariant:
    def __init__(self, recorder):
        self.recorder = recorder

    def launch_trusted(self, grid0, values):
        self.recorder.calls.append((grid0, dict(zip(STAGE.runtime, values)), None, None))


@pytest.fixture
def recorder(monkeypatch):
    if not INTERPRET:
        pytest.skip("the recorder stands in for the kernel on CPU tensors, which only the interpreter launches")
    rec = Recorder()
    monkeypatch.setattr(SB, "STAGE", rec)
    return rec


def _stager(buf):
    st = SB.BatchStager(buf)
    st.enabled = True  # CPU tensors stand for device-resident ones
    return st


@pytest.mark.parametrize("config", list(CONFIGS))
def test_cached_path_launches_what_the_full_path_launches(recorder, config):
    buf = _buffers()
    st = _stager(buf)
    sig = buf.registry.signature()
    for step, (n, pad_to) in enumerate([(37, 48), (37, 48), (1, 1), (150, 160), (64, 64)]):
        batch = _batch(n, seed=step, **CONFIGS[config])
        recorder.calls.clear()
        _full_path(buf, batch, pad_to)
        assert len(recorder.calls) == 1
        grid0, want, _, _ = recorder.calls[0]
        recorder.calls.clear()
        before = st.cached_launches
        st(batch, pad_to, sig)
        assert len(recorder.calls) == 1
        # the first batch of the configuration takes the full path; every later one the cached path
        assert st.cached_launches == before + (step > 0)
        got_grid, got, _, _ = recorder.calls[0]
        assert got_grid == grid0
        assert {k: got[k] for k in STAGE.runtime} == {k: want[k] for k in STAGE.runtime}


def test_items_plan_is_reused_only_for_equal_records(recorder):
    """Item tensors staged again (the same tensors, in a new list or not) reuse the last plan; any change
    to what the plan depends on (an address, a shape, the dtype, the table's width) makes a new one. Each
    launch equals the full path's."""
    buf = _buffers()
    st = _stager(buf)
    sig = buf.registry.signature()
    batch = _batch(40, 3, items="tensors")
    items = batch.media

    def stage(batch, hit):
        step = stage.calls
        recorder.calls.clear()
        _full_path(buf, batch, 48)
        want = recorder.calls[-1][1]
        before = st._static.items_seen if st._static is not None else None
        st(batch, 48, sig)
        got = recorder.calls[-1][1]
        assert {k: got[k] for k in STAGE.runtime if k != "items_ptr"} == \
            {k: want[k] for k in STAGE.runtime if k != "items_ptr"}
        if hit is not None:
            assert (st._static.items_seen is before) == hit, step
        stage.calls += 1

    def with_media(media, **kw):
        return ss.PrefillBatch(**{**batch.__dict__, "media": media, **kw})

    stage.calls = 0
    stage(batch, None)  # the full path (after _match has read the items): the configuration is kept
    stage(batch, True)  # the cached path, the same records
    stage(with_media(list(items)), True)  # a new list of the same tensors
    stage(with_media([t.clone() for t in items]), False)  # new addresses
    stage(batch, False)
    items[1].set_(items[1].clone())  # the same tensor object, new storage
    stage(batch, False)
    stage(batch, True)
    items[2].resize_(1, items[2].shape[1])  # fewer rows, same address
    stage(batch, False)
    wide = [t.to(torch.float32) for t in items]
    stage(with_media(wide), None)  # another dtype: another configuration (full path)
    stage(with_media(wide), True)
    stage(with_media([torch.cat([items[0], items[0]])[::2]] + list(items[1:])), None)  # rows apart: the loop
    stage(batch, False)
    stage(batch, True)
    odd = ss.PrefillBatch.__new__(ss.PrefillBatch)  # past __post_init__: the stager checks on its own
    odd.__dict__.update({**batch.__dict__, "media": dict.fromkeys(items)})  # the same tensors, not a sequence
    with pytest.raises(TypeError, match="list of items"):
        st(odd, 48, sig)
    on_slab = buf.input_embeds.view(torch.float32).flatten()[:4 * 96].view(4, 96)  # over a destination
    with pytest.raises(ValueError, match="overlap"):
        st(with_media([on_slab] + list(items[1:])), 48, sig)


def test_each_configuration_is_kept_apart(recorder):
    buf = _buffers()
    st = _stager(buf)
    sig = buf.registry.signature()
    for config in CONFIGS:
        st(_batch(20, 1, **CONFIGS[config]), 32, sig)
    assert st.cached_launches == 0 and len(st.variants) == len(CONFIGS)
    for config in CONFIGS:
        batch = _batch(21, 2, **CONFIGS[config])
        recorder.calls.clear()
        _full_path(buf, batch, 32)
        want = recorder.calls[-1][1]
        st(batch, 32, sig)
        assert {k: recorder.calls[-1][1][k] for k in STAGE.runtime} == {k: want[k] for k in STAGE.runtime}
    assert st.cached_launches == len(CONFIGS)


def test_what_the_cached_path_leaves_to_the_full_path(recorder):
    buf = _buffers()
    st = _stager(buf)
    sig = buf.registry.signature()
    st(_batch(20, 1), 32, sig)  # the configuration is now kept
    assert len(st.variants) == 1
    st(_batch(20, 1), 32, None)  # no signature checked by the caller
    assert st.cached_launches == 0
    st(_batch(20, 1), 32, buf.registry.signature())  # another signature: the buffers are read again
    assert st.cached_launches == 0
    st(_batch(20, 1), 32, st._sig)
    assert st.cached_launches == 1
    buf.errors = ss.new_error_word("cpu")  # another error word: read again
    st(_batch(20, 1), 32, st._sig)
    assert st.cached_launches == 1
    assert recorder.calls[-1][1]["errors_ptr"] == buf.errors.data_ptr()


@pytest.mark.parametrize("bad, match", [
    (dict(positions=torch.arange(19)), "positions"),
    (dict(positions=torch.arange(20.0)), "positions dtype"),
    (dict(table=torch.randn(57, 200, dtype=torch.bfloat16)), "too narrow"),
    (dict(media_index=torch.full((19,), -1)), "media_index"),
    (dict(vocab_range=(0, 99)), "vocab_range"),
    (dict(text_scale="2"), "text_scale"),
    (dict(text_scale=float("nan")), "text_scale"),
    (dict(seq_lens=torch.ones(9, dtype=torch.int32), extend_start_loc=torch.zeros(9, dtype=torch.int32)),
     "max_batch_size"),
])
def test_bad_batches_get_the_full_paths_errors_and_write_nothing(recorder, bad, match):
    buf = _buffers()
    st = _stager(buf)
    sig = buf.registry.signature()
    st(_batch(20, 1), 32, sig)  # keep the good configuration
    recorder.calls.clear()
    good = _batch(20, 1)
    batch = ss.PrefillBatch.__new__(ss.PrefillBatch)  # past __post_init__: the stager checks on its own
    batch.__dict__.update({**good.__dict__, **bad})
    with pytest.raises((TypeError, ValueError), match=match):
        st(batch, 32, sig)
    assert recorder.calls == []


@pytest.mark.cuda
@pytest.mark.parametrize("side", ["device", "host"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_cached_path_on_the_gpu_equals_the_full_path(config, side):
    dev = torch.device("cuda")
    fast, full = (ss.StagingBuffers.allocate(max_num_tokens=160, max_batch_size=5, embed_width=96,
                                             embed_dtype=torch.bfloat16, device=dev, mrope=True) for _ in range(2))
    st = SB.BatchStager(fast)
    sig = fast.registry.signature()
    for step, (n, pad_to) in enumerate([(37, 48), (37, 48), (1, 1), (150, 160), (64, 64)]):
        cpu = _batch(n, seed=step, **CONFIGS[config])
        on_device = ("table", "media") if side == "host" else tuple(cpu.__dict__)
        def move(k, v, on_device=on_device):
            if k not in on_device:
                return v
            if isinstance(v, torch.Tensor):
                return v.to(dev)
            if k == "media" and isinstance(v, list):  # items: each tensor, or each column block, to the device
                return [tuple(t.to(dev) for t in x) if isinstance(x, tuple) else x.to(dev) for x in v]
            return v
        batch = ss.PrefillBatch(**{k: move(k, v) for k, v in cpu.__dict__.items()})
        for buf in (fast, full):
            for name in buf.registry:
                t = buf.registry[name]
                t.fill_(float("nan") if t.dtype.is_floating_point else -7)
        st(batch, pad_to, sig)
        _full_path(full, batch, pad_to)
        for name in fast.registry:
            a, b = fast.registry[name], full.registry[name]
            assert torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0)), (config, step, name)
        assert torch.equal(fast.errors, full.errors)
    assert st.cached_launches == 4


def test_overlap_check_agrees_with_brute_force():
    """The cached path's byte-span check (one span, or many, a gap reused) against a pairwise check, on random
    destination layouts: apart, touching, and sharing bytes (views of one storage)."""
    import random

    class Dst:
        batch_cap, dtypes = 1, {}

    slab = torch.empty(2, 2)
    for trial in range(2000):
        rnd = random.Random(trial)
        spans, x = [], 0
        for _ in range(rnd.randint(1, 6)):
            x += rnd.randint(0, 5)
            w = rnd.randint(1, 6)
            spans.append((x, x + w))
            x += w
        if rnd.random() < 0.3:
            a = rnd.randint(0, x)
            spans = sorted(spans + [(a, a + rnd.randint(1, 5))])
        st = SB._Static([0], Dst(), slab, spans)
        queries = [(a, a + rnd.randint(1, 6)) for a in (rnd.randint(0, x + 3) for _ in range(rnd.randint(1, 5)))]
        apart = [all(e <= s0 or s >= e0 for s0, e0 in spans) for s, e in queries]
        for (s, e), want in zip(queries, apart):
            assert st.clear(s, e) == want, (spans, s, e)
        for (s, e), want in zip(queries, apart):  # one span at a time, the last gap kept between them
            try:
                st.fit(s, e)
                got = True
            except ValueError:
                got = False
            assert got == want, (spans, s, e)
        for _ in range(2):  # many spans, starting from the gap the last check kept
            try:
                st.apart_all([s for s, _ in queries], [e for _, e in queries])
                got = True
            except ValueError:
                got = False
            assert got == all(apart), (spans, queries)
            queries = [(a, a + rnd.randint(1, 6)) for a in (rnd.randint(0, x + 3) for _ in range(rnd.randint(1, 5)))]
            apart = [all(e <= s0 or s >= e0 for s0, e0 in spans) for s, e in queries]


def test_pack_to_device_keeps_dtypes_and_alignment():
    """Host parts in one byte buffer (one memmove each): every part at a 16-byte boundary, its dtype and
    values kept, strided parts laid out contiguously, int sequences as int64, empty parts allowed."""
    from slabstage.kernels.plan import pack_host_inputs, pack_to_device
    g = torch.Generator().manual_seed(7)
    mrope = torch.randint(-9, 2**40, (3, 13), generator=g)
    parts = {"a": torch.randint(-2**31, 2**31 - 1, (5,), generator=g, dtype=torch.int32),
             "b": torch.randint(-2**62, 2**62, (3,), generator=g),
             "mrope": torch.cat([mrope, mrope], 1)[:, ::2],  # rows apart, columns strided: packed contiguous
             "empty": torch.empty(0, dtype=torch.int32),
             "table": [2**40 + 3, -1, 0, 7, 9]}
    dev, offsets = pack_to_device(torch.device("cpu"), list(parts.values()))
    assert dev.dtype == torch.uint8 and all(o % 16 == 0 for o in offsets)
    assert offsets == sorted(offsets) and len(set(offsets[:3])) == 3
    out = pack_host_inputs(torch.device("cpu"), {"table": parts["table"]})
    assert out["table"].dtype == torch.int64 and out["table"].tolist() == parts["table"]
    for (name, v), o in zip(parts.items(), offsets):
        if isinstance(v, torch.Tensor):
            got = dev[o:o + v.numel() * v.element_size()].view(v.dtype).view(v.shape)
            assert torch.equal(got, v), name
    with pytest.raises(ValueError, match="not on the host"):
        pack_to_device(torch.device("cpu"), [torch.zeros(2, device="meta", dtype=torch.int64)])
