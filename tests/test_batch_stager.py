"""BatchStager: the runner's cached staging path launches exactly what plan_stage_batch launches.

On CPU (the interpreter) the compiled-kernel launcher is replaced by a recorder,
so these tests compare the integer argument lists of the two paths call by call;
on a GPU the cached path runs for real and its slots are compared with
plan_stage_batch's on poisoned buffers.
"""

import ctypes
import importlib

import pytest
import torch

import slabstage as ss
from slabstage.kernels._triton import INTERPRET

SB = importlib.import_module("slabstage.kernels.stage_batch")
L = importlib.import_module("slabstage.kernels._launch")

TAIL = ("constexpr tail",)


class Recorder:
    """Stands in for a compiled kernel: records what its launcher is called with."""

    function = "fn"
    packed_metadata = "meta"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class EveryKey(dict):
    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel

    def get(self, key, default=None):
        return (self.kernel, TAIL)

    def __contains__(self, key):
        return True


@pytest.fixture
def recorder(monkeypatch):
    if not INTERPRET:
        pytest.skip("the recorder stands in for compiled kernels under the interpreter only")
    kernel = Recorder()
    monkeypatch.setattr(SB._launch, "enabled", True)
    monkeypatch.setattr(SB._launch, "cache", EveryKey(kernel))
    monkeypatch.setattr(SB, "_hooks_set", lambda: False)
    monkeypatch.setattr(L, "_hooks_set", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    return kernel


def _buffers(width=96, mrope=True):
    return ss.StagingBuffers.allocate(max_num_tokens=160, max_batch_size=5, embed_width=width,
                                      embed_dtype=torch.bfloat16, device="cpu", mrope=mrope)


def _stager(buf):
    st = SB.BatchStager(buf)
    st.enabled = True
    st.device_index = -1  # CPU tensors stand for device-resident ones
    return st


def _batch(n, seed, *, ids_dtype=torch.int64, media=True, slots=True, expand="zeros", text_scale=None,
           vocab=None, media_owner=True, strided=False, width=96):
    g = torch.Generator().manual_seed(seed)
    tw = width if expand == "zeros" else width // 3
    table = torch.randn(57, tw + 8 * strided, generator=g).to(torch.bfloat16)[:, :tw]  # rows 8 apart when strided
    kw = dict(input_ids=torch.randint(0, 57, (n,), generator=g).to(ids_dtype),
              positions=torch.randint(0, 999, (n,), generator=g), table=table,
              expand=expand, text_scale=text_scale, media_owner=media_owner)
    if vocab is not None:
        kw["vocab_range"], kw["vocab_size"] = vocab
    if media:
        kw["media"] = torch.randn(11, width if expand == "zeros" else width // 2, generator=g)
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
}


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
        want = recorder.calls[0]
        recorder.calls.clear()
        fast_before = st.fast_launches
        st(batch, pad_to, sig)
        assert len(recorder.calls) == 1
        # the first batch of the configuration takes the full path; every later one the cached path
        assert st.fast_launches == fast_before + (step > 0)
        assert recorder.calls[0] == want


def test_each_configuration_is_kept_apart(recorder):
    buf = _buffers()
    st = _stager(buf)
    sig = buf.registry.signature()
    for config in CONFIGS:
        st(_batch(20, 1, **CONFIGS[config]), 32, sig)
    assert st.fast_launches == 0 and len(st._entries) == len(CONFIGS)
    for config in CONFIGS:
        batch = _batch(21, 2, **CONFIGS[config])
        recorder.calls.clear()
        _full_path(buf, batch, 32)
        want = recorder.calls[-1]
        st(batch, 32, sig)
        assert recorder.calls[-1] == want
    assert st.fast_launches == len(CONFIGS)


def test_what_the_cached_path_leaves_to_the_full_path(recorder):
    buf = _buffers()
    st = _stager(buf)
    sig = buf.registry.signature()
    st(_batch(20, 1), 32, sig)  # the configuration is now kept
    assert len(st._entries) == 1

    st(_batch(20, 1), 32, None)  # no signature checked by the caller
    base = torch.zeros(41, dtype=torch.int64)  # unaligned: offset by 8 bytes
    b = _batch(20, 1)
    unaligned = ss.PrefillBatch(**{**b.__dict__, "input_ids": base[1:21].copy_(b.input_ids)})
    st(unaligned, 32, sig)
    mixed = ss.PrefillBatch(**{**b.__dict__, "positions": b.positions.to("meta")})  # neither device nor host
    st.device_index = 0  # the buffers' device: the CPU inputs are host inputs, the meta one neither
    with pytest.raises(ValueError, match="positions is on meta"):
        st(mixed, 32, sig)
    st.device_index = -1
    assert st.fast_launches == 0 and len(st._entries) == 1

    st(_batch(20, 1), 32, buf.registry.signature())  # another signature: the buffers are read again
    assert st.fast_launches == 0
    st(_batch(20, 1), 32, st._sig)
    assert st.fast_launches == 1
    buf.errors = ss.new_error_word("cpu")  # another error word: read again
    st(_batch(20, 1), 32, st._sig)
    assert st.fast_launches == 1
    assert recorder.calls[-1][14] == buf.errors.data_ptr()


def _read(ptr, count):
    """``count`` int64 values at host address ``ptr``."""
    return torch.frombuffer((ctypes.c_int64 * count).from_address(ptr), dtype=torch.int64).clone()


class OnDevice0(torch.Tensor):
    """A CPU tensor that says it is on device 0: the table and media, next to host integer inputs."""

    def get_device(self):
        return 0


@pytest.mark.parametrize("config", ["text", "media+slots"])
def test_host_inputs_are_packed_aligned_in_one_buffer(recorder, config):
    """Inputs on the host (here: the buffers claim device 0, the inputs are on the CPU) travel packed."""
    buf = _buffers()
    st = _stager(buf)
    st.device_index = 0
    sig = buf.registry.signature()
    seen = []

    def run(*args):  # read the packed parts while they are alive
        a = args[9:]
        n, b = a[6], a[31]
        p_ids, p_pos, p_loc, p_mrope, p_seq, p_ext, p_index = a[16], a[17], a[18], a[19], a[20], a[21], a[4]
        got = {"input_ids": _read(p_ids, n), "positions": _read(p_pos, n)}
        if config != "text":
            got.update(out_cache_loc=_read(p_loc, n), mrope_positions=_read(p_mrope, 3 * n).view(3, n),
                       seq_lens=_read(p_seq, b), extend_start_loc=_read(p_ext, b), media_index=_read(p_index, n))
            assert a[33] == n  # the packed mrope rows are n apart
        seen.append((got, [p & 15 for p in (p_ids, p_pos, p_loc, p_mrope, p_seq, p_ext, p_index)]))

    for step, n in enumerate([21, 21, 36, 7]):
        batch = _batch(n, seed=step, ids_dtype=torch.int32, **CONFIGS[config])
        batch.table = batch.table.as_subclass(OnDevice0)
        if batch.media is not None:
            batch.media = batch.media.as_subclass(OnDevice0)
        recorder.run = run  # the first batch: the full path, from the inputs themselves; then packed copies
        st(batch, 40, sig)
        assert st.fast_launches == step and len(seen) == step + 1
        if not step:
            continue  # the full path read the int32 inputs where they are
        got, misalign = seen[-1]
        assert misalign == [0] * 7
        for name, values in got.items():
            assert torch.equal(values, getattr(batch, name).to(torch.int64)), name


@pytest.mark.parametrize("bad, match", [
    (dict(positions=torch.arange(19)), "positions"),
    (dict(positions=torch.arange(20.0)), "int32 or int64"),
    (dict(table=torch.randn(57, 200, dtype=torch.bfloat16)), "too narrow"),
    (dict(media_index=torch.full((19,), -1)), "media_index"),
    (dict(vocab_range=(0, 99)), "vocab_range"),
    (dict(text_scale="2"), "text_scale"),
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
        batch = ss.PrefillBatch(**{k: v.to(dev) if isinstance(v, torch.Tensor) and k in on_device else v
                                   for k, v in cpu.__dict__.items()})
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
    assert st.fast_launches == 4
