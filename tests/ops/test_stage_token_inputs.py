"""stage_token_inputs: every integer slot copied and padded by its slot's policy, in one launch."""

import pytest
import torch

from slabstage import BufferRegistry, StagingBuffers, new_error_word, stage_token_inputs

POISON = -7777
TOKEN_SLOTS = ("input_ids", "positions", "out_cache_loc", "mrope_positions")
REQUEST_SLOTS = ("seq_lens", "extend_start_loc")


def allocate(device, T=40, B=6, mrope=True, cache_loc_dtype=torch.int64):
    return StagingBuffers.allocate(max_num_tokens=T, max_batch_size=B, embed_width=8, embed_dtype=torch.bfloat16,
                                   device=device, cache_loc_dtype=cache_loc_dtype, mrope=mrope)


def poison(buf):
    for name in buf.registry:
        buf.registry[name].fill_(POISON)
    return {name: buf.registry[name].clone() for name in buf.registry}


def make_inputs(g, n, b, device, dtype=torch.int64, mrope=True, which=TOKEN_SLOTS + REQUEST_SLOTS):
    """Fresh random values, distinct per slot, never zeros."""
    out = {}
    for k, name in enumerate(which):
        if name == "mrope_positions" and not mrope:
            continue
        shape = (3, n) if name == "mrope_positions" else (b,) if name in REQUEST_SLOTS else (n,)
        out[name] = torch.randint(1 + 1000 * k, 1000 * (k + 1), shape, generator=g).to(dtype).to(device)
    return out


def check(buf, before, inputs, n, pad_to):
    """Given slots: source, then fill, then untouched; other slots exactly as before."""
    reg, B = buf.registry, buf.max_batch_size
    b = next((inputs[k].shape[0] for k in REQUEST_SLOTS if k in inputs), 0)
    for name in reg:
        now, was = reg[name].cpu(), before[name].cpu()
        if name == "num_tokens_non_padded":
            assert now.tolist() == [n]
            continue
        if name not in inputs:
            assert torch.equal(now, was), f"{name} was touched but not given"
            continue
        src = inputs[name].cpu().to(now.dtype)
        fill = reg.slot(name).fill_value
        if name in REQUEST_SLOTS:
            stop, limit = b, B
        else:
            stop, limit = n, pad_to
        assert torch.equal(now[..., :stop], src), name
        tail = now[..., stop:limit]
        if fill is None:
            assert torch.equal(tail, was[..., stop:limit]), f"{name}: padding is 'leave' but was written"
        else:
            assert (tail == int(fill)).all(), f"{name}: padding is not {fill}"
        assert torch.equal(now[..., limit:], was[..., limit:]), f"{name}: written past {limit}"


@pytest.mark.parametrize("n, pad", [(0, 0), (0, 5), (1, 0), (1, 3), (7, 6), (16, 16), (33, 7), (40, 0)])
@pytest.mark.parametrize("b", [0, 1, 5, 6])
def test_all_slots(n, pad, b, device):
    g = torch.Generator().manual_seed(n * 100 + pad * 10 + b)
    buf = allocate(device)
    before = poison(buf)
    inputs = make_inputs(g, n, b, device)
    stage_token_inputs(buf, pad_to=n + pad, **inputs)
    check(buf, before, inputs, n, n + pad)


@pytest.mark.parametrize("n, pad_to", [(127, 128), (128, 129), (300, 385), (385, 385)])
def test_every_token_block(n, pad_to, device):
    """A program per slot and 128-row block: every block of every slot written, the last one partly, the
    padding past the last real row in whichever block it falls."""
    g = torch.Generator().manual_seed(n + pad_to)
    buf = allocate(device, T=400)
    before = poison(buf)
    inputs = make_inputs(g, n, 5, device)
    stage_token_inputs(buf, pad_to=pad_to, **inputs)
    check(buf, before, inputs, n, pad_to)


@pytest.mark.parametrize("src_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("cache_loc_dtype", [torch.int32, torch.int64])
def test_int_dtypes(src_dtype, cache_loc_dtype, device):
    g = torch.Generator().manual_seed(3)
    buf = allocate(device, cache_loc_dtype=cache_loc_dtype)
    before = poison(buf)
    inputs = make_inputs(g, 19, 4, device, dtype=src_dtype)
    inputs["input_ids"][0] = 2**31 - 1  # the extremes of int32 survive the trip
    inputs["positions"][1] = -(2**31)
    stage_token_inputs(buf, pad_to=27, **inputs)
    check(buf, before, inputs, 19, 27)


def test_int64_values_past_int32_kept_in_int64_slots(device):
    buf = allocate(device)
    before = poison(buf)
    ids = torch.tensor([2**40, -(2**40), 2**62, 5], device=device)
    pos = torch.tensor([3, 2**33, 1, 0], device=device)
    stage_token_inputs(buf, input_ids=ids, positions=pos, pad_to=6)
    check(buf, before, dict(input_ids=ids, positions=pos), 4, 6)


@pytest.mark.parametrize("given", [("input_ids", "positions"), ("input_ids", "positions", "out_cache_loc"),
                                   ("input_ids", "positions", "mrope_positions"),
                                   ("input_ids", "positions", "seq_lens"),
                                   ("input_ids", "positions", "extend_start_loc"),
                                   ("input_ids", "positions", "out_cache_loc", "seq_lens", "extend_start_loc")])
def test_slots_not_given_are_untouched(given, device):
    g = torch.Generator().manual_seed(len(given))
    buf = allocate(device)
    before = poison(buf)
    inputs = make_inputs(g, 13, 3, device, which=given)
    stage_token_inputs(buf, pad_to=20, **inputs)
    check(buf, before, inputs, 13, 20)
    assert torch.equal(buf.input_embeds.cpu(), before["input_embeds"].cpu())  # not this op's slot


def test_buffers_without_mrope(device):
    g = torch.Generator().manual_seed(4)
    buf = allocate(device, mrope=False)
    before = poison(buf)
    inputs = make_inputs(g, 11, 2, device, mrope=False)
    stage_token_inputs(buf, pad_to=11, **inputs)
    check(buf, before, inputs, 11, 11)


def custom_buffers(device, T=30, B=5):
    """Buffers whose slots pad with other values than zeros: fixed when each slot is registered."""
    reg = BufferRegistry()
    reg.register("input_ids", torch.zeros(T, dtype=torch.int64, device=device))  # zeros
    reg.register("positions", torch.zeros(T, dtype=torch.int64, device=device), pad=-1)
    reg.register("out_cache_loc", torch.zeros(T, dtype=torch.int32, device=device), pad=7)
    reg.register("input_embeds", torch.zeros(T, 8, dtype=torch.bfloat16, device=device))
    reg.register("mrope_positions", torch.zeros(3, T, dtype=torch.int64, device=device), token_axis=1, pad=None)
    reg.register("seq_lens", torch.zeros(B, dtype=torch.int32, device=device), token_axis=None, pad=1)
    reg.register("extend_start_loc", torch.zeros(B, dtype=torch.int32, device=device), token_axis=None, pad=None)
    reg.register("num_tokens_non_padded", torch.zeros(1, dtype=torch.int32, device=device), token_axis=None,
                 pad=None)
    return StagingBuffers(reg, max_num_tokens=T, max_batch_size=B, errors=new_error_word(device))


@pytest.mark.parametrize("n, pad_to, b", [(9, 17, 2), (0, 4, 0), (30, 30, 5), (1, 2, 1)])
def test_numeric_fill_and_leave(n, pad_to, b, device):
    g = torch.Generator().manual_seed(n + pad_to)
    buf = custom_buffers(device)
    assert buf.registry.slot("positions").fill_value == -1
    assert buf.registry.slot("out_cache_loc").fill_value == 7
    assert buf.registry.slot("mrope_positions").fill_value is None
    before = poison(buf)
    inputs = make_inputs(g, n, b, device)
    stage_token_inputs(buf, pad_to=pad_to, **inputs)
    check(buf, before, inputs, n, pad_to)
    reg = buf.registry
    assert (reg["positions"][n:pad_to] == -1).all() and (reg["out_cache_loc"][n:pad_to] == 7).all()
    assert (reg["mrope_positions"][:, n:] == POISON).all()
    assert (reg["seq_lens"][b:] == 1).all() and (reg["extend_start_loc"][b:] == POISON).all()


def test_float_fill_value(device):
    reg = BufferRegistry()
    reg.register("input_ids", torch.zeros(12, dtype=torch.int64, device=device), pad=3.0)
    reg.register("positions", torch.zeros(12, dtype=torch.int64, device=device), pad=-2.0)
    reg.register("input_embeds", torch.zeros(12, 4, device=device))
    reg.register("num_tokens_non_padded", torch.zeros(1, dtype=torch.int32, device=device), token_axis=None,
                 pad=None)
    buf = StagingBuffers(reg, max_num_tokens=12, max_batch_size=1, errors=new_error_word(device))
    before = poison(buf)
    g = torch.Generator().manual_seed(5)
    inputs = make_inputs(g, 5, 0, device, which=("input_ids", "positions"))
    stage_token_inputs(buf, pad_to=9, **inputs)
    check(buf, before, inputs, 5, 9)


def test_replaced_slot_is_written(device):
    """A slot swapped in the registry is the one staged into (reads go through the registry)."""
    g = torch.Generator().manual_seed(6)
    buf = allocate(device)
    old = buf.positions
    new = torch.full_like(old, POISON)
    buf.registry.replace("positions", new)
    before = poison(buf)
    old.fill_(POISON)
    inputs = make_inputs(g, 10, 2, device)
    stage_token_inputs(buf, pad_to=12, **inputs)
    check(buf, before, inputs, 10, 12)
    assert (old == POISON).all()


def test_slot_replaced_between_batches(device):
    """A slot swapped after a first batch is the one the next batch writes (nothing stale is reused)."""
    g = torch.Generator().manual_seed(13)
    buf = allocate(device)
    inputs = make_inputs(g, 10, 2, device)
    stage_token_inputs(buf, pad_to=12, **inputs)
    old_pos, old_seq = buf.positions, buf.seq_lens
    buf.registry.replace("positions", torch.zeros_like(old_pos))
    buf.registry.replace("seq_lens", torch.zeros_like(old_seq))
    before = poison(buf)
    old_pos.fill_(POISON)
    old_seq.fill_(POISON)
    inputs = make_inputs(g, 14, 3, device)
    stage_token_inputs(buf, pad_to=15, **inputs)
    check(buf, before, inputs, 14, 15)
    assert (old_pos == POISON).all() and (old_seq == POISON).all()


def test_slot_moved_in_place_between_batches(device):
    """set_() moves a slot to other (here misaligned) memory without a registry change: still right."""
    g = torch.Generator().manual_seed(19)
    buf = allocate(device)
    stage_token_inputs(buf, pad_to=12, **make_inputs(g, 10, 2, device))
    for name in ("positions", "seq_lens"):
        t = buf.registry[name]
        flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
        t.set_(flat.untyped_storage(), 1, t.shape, t.stride())
    before = poison(buf)
    inputs = make_inputs(g, 13, 3, device)
    stage_token_inputs(buf, pad_to=17, **inputs)
    check(buf, before, inputs, 13, 17)


def test_slot_shrunk_in_place_lowers_capacity(device):
    """pad_to is checked against the slots as they are now, so nothing is written past a shrunk slot."""
    g = torch.Generator().manual_seed(14)
    buf = allocate(device)
    stage_token_inputs(buf, pad_to=30, **make_inputs(g, 20, 2, device))
    buf.out_cache_loc.set_(torch.full((24,), POISON, dtype=torch.int64, device=device))
    before = poison(buf)
    with pytest.raises(ValueError, match="pad_to"):
        stage_token_inputs(buf, pad_to=30, **make_inputs(g, 20, 2, device))
    for slot in buf.registry:
        assert torch.equal(buf.registry[slot].cpu(), before[slot].cpu()), slot


@pytest.mark.parametrize("name", REQUEST_SLOTS)
def test_per_request_slot_smaller_than_max_batch_size(name, device):
    """A per-request slot swapped for one shorter than max_batch_size cannot be padded to it: refused."""
    g = torch.Generator().manual_seed(15)
    buf = allocate(device, B=6)
    base = torch.full((8,), POISON, dtype=torch.int32, device=device)
    buf.registry.replace(name, base[:3])  # the rest of base stands for memory past the slot
    before = poison(buf)
    with pytest.raises(ValueError, match=name):
        stage_token_inputs(buf, pad_to=12, **make_inputs(g, 10, 2, device))
    assert (base == POISON).all(), "written past the slot"
    for slot in buf.registry:
        assert torch.equal(buf.registry[slot].cpu(), before[slot].cpu()), slot


@pytest.mark.parametrize("name", ["out_cache_loc", "seq_lens", "mrope_positions"])
def test_slot_missing_from_registry(name, device):
    """An input whose slot is not registered is refused; no other slot is written in its place."""
    reg = BufferRegistry()
    reg.register("input_ids", torch.zeros(20, dtype=torch.int64, device=device))
    reg.register("positions", torch.zeros(20, dtype=torch.int64, device=device))
    reg.register("input_embeds", torch.zeros(20, 4, device=device))
    reg.register("num_tokens_non_padded", torch.zeros(1, dtype=torch.int32, device=device), token_axis=None,
                 pad=None)
    buf = StagingBuffers(reg, max_num_tokens=20, max_batch_size=4, errors=new_error_word(device))
    before = poison(buf)
    g = torch.Generator().manual_seed(16)
    inputs = make_inputs(g, 9, 2, device, which=("input_ids", "positions", name))
    with pytest.raises(ValueError, match=name):
        stage_token_inputs(buf, pad_to=12, **inputs)
    for slot in buf.registry:
        assert torch.equal(buf.registry[slot].cpu(), before[slot].cpu()), slot


@pytest.mark.parametrize("name, bad", [
    ("positions", lambda d: torch.full((80,), POISON, dtype=torch.int64, device=d)[::2]),
    ("out_cache_loc", lambda d: torch.full((40, 1), POISON, dtype=torch.int64, device=d)),
    ("mrope_positions", lambda d: torch.full((2, 40), POISON, dtype=torch.int64, device=d)),
    ("mrope_positions", lambda d: torch.full((40, 3), POISON, dtype=torch.int64, device=d).t()),
    ("seq_lens", lambda d: torch.full((12,), POISON, dtype=torch.int32, device=d)[::2]),
])
def test_slot_of_the_wrong_layout(name, bad, device):
    """A slot swapped for a strided or reshaped tensor is refused before the kernel writes it."""
    g = torch.Generator().manual_seed(17)
    buf = allocate(device)
    buf.registry.replace(name, bad(device))
    before = poison(buf)
    with pytest.raises(ValueError, match=name):
        stage_token_inputs(buf, pad_to=12, **make_inputs(g, 10, 2, device))
    for slot in buf.registry:
        assert torch.equal(buf.registry[slot].cpu(), before[slot].cpu()), slot


# -- mrope sources ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "column-slice", "row-step", "expanded-rows"])
def test_mrope_layouts(layout, device):
    g = torch.Generator().manual_seed(7)
    n, pad_to = 21, 26
    big = torch.randint(1, 10_000, (6, 50), generator=g).to(device)
    mrope = {
        "contiguous": big[:3, :n].contiguous(),
        "column-slice": big[:3, 4:4 + n],  # row stride 50
        "row-step": big[::2, 7:7 + n],  # row stride 100
        "expanded-rows": big[0, :n].expand(3, n),  # row stride 0: text-only positions
    }[layout]
    assert mrope.stride(1) == 1 and (layout == "contiguous") == mrope.is_contiguous()
    buf = allocate(device)
    before = poison(buf)
    inputs = make_inputs(g, n, 3, device)
    inputs["mrope_positions"] = mrope
    stage_token_inputs(buf, pad_to=pad_to, **inputs)
    check(buf, before, inputs, n, pad_to)


def test_layouts_back_to_back(device):
    """One launch after another with the alignments and strides a compiled-kernel cache keys on."""
    g = torch.Generator().manual_seed(18)
    buf = allocate(device, T=64, B=6)
    for step, n in enumerate([9, 1, 16, 9, 20, 1, 32]):
        inputs = make_inputs(g, n, 1 + step % 6, device, dtype=torch.int32 if step % 2 else torch.int64)
        big = torch.randint(1, 10_000, (3, 80), generator=g).to(device)
        if step == 2:
            inputs["mrope_positions"] = big[:, 3:3 + n]  # row stride 80
        elif step == 3:
            inputs["mrope_positions"] = big[0, :n].expand(3, n)  # row stride 0
        elif step == 4:
            for k in ("input_ids", "positions", "seq_lens"):  # 4 or 8 bytes into their storage
                t = inputs[k]
                flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
                inputs[k] = flat[1:]
                inputs[k].copy_(t)
        before = poison(buf)
        stage_token_inputs(buf, pad_to=min(n + 5, 64), **inputs)
        check(buf, before, inputs, n, min(n + 5, 64))


def test_many_tokens(device):
    """More tokens than one program covers."""
    g = torch.Generator().manual_seed(8)
    T, n, pad_to = 2600, 2100, 2500
    buf = allocate(device, T=T, B=7)
    before = poison(buf)
    inputs = make_inputs(g, n, 7, device, dtype=torch.int32)
    inputs["mrope_positions"] = torch.randint(1, 10_000, (3, T), generator=g).to(device)[:, 100:100 + n]
    stage_token_inputs(buf, pad_to=pad_to, **inputs)
    check(buf, before, inputs, n, pad_to)


# -- host inputs -------------------------------------------------------------------------------

@pytest.mark.parametrize("on_host", [TOKEN_SLOTS + REQUEST_SLOTS, ("positions", "mrope_positions", "seq_lens")])
def test_host_inputs(on_host, device):
    """CPU inputs into device buffers: on CUDA they travel in one packed copy."""
    g = torch.Generator().manual_seed(9)
    buf = allocate(device)
    n, b = 17, 4
    for round_ in range(3):  # the packed scratch is reused across calls
        before = poison(buf)
        inputs = make_inputs(g, n + round_, b - round_, device, dtype=torch.int32 if round_ else torch.int64)
        for k in on_host:
            inputs[k] = inputs[k].cpu()
        big = torch.randint(1, 10_000, (3, 60), generator=g)
        inputs["mrope_positions"] = big[:, 5:5 + n + round_].to(
            "cpu" if "mrope_positions" in on_host else device)
        stage_token_inputs(buf, pad_to=n + 9, **inputs)
        check(buf, before, inputs, n + round_, n + 9)


@pytest.mark.cuda
def test_host_inputs_back_to_back_without_sync():
    """Several batches staged from host memory with no sync between: each sees its own values."""
    device = torch.device("cuda")
    buf = allocate(device, T=64, B=6)
    g = torch.Generator().manual_seed(10)
    seen, expect = [], []
    for k in range(6):
        n = 20 + 7 * k
        inputs = make_inputs(g, n, 1 + k % 6, "cpu")
        stage_token_inputs(buf, pad_to=n + 3, **inputs)
        seen.append({name: buf.registry[name].clone() for name in buf.registry})  # ordered on the stream
        expect.append((inputs, n))
    torch.cuda.synchronize()
    for snap, (inputs, n) in zip(seen, expect):
        assert torch.equal(snap["input_ids"][:n].cpu(), inputs["input_ids"])
        assert torch.equal(snap["mrope_positions"][:, :n].cpu(), inputs["mrope_positions"])
        assert torch.equal(snap["seq_lens"][:inputs["seq_lens"].shape[0]].cpu(), inputs["seq_lens"].int())
        assert snap["num_tokens_non_padded"].item() == n


# -- invalid inputs -----------------------------------------------------------------------------

def _valid(device):
    g = torch.Generator().manual_seed(11)
    return make_inputs(g, 9, 3, device)


INVALID = [  # (name, change, exception)
    ("ids float", lambda a, d: a.update(input_ids=a["input_ids"].float()), TypeError),
    ("ids int16", lambda a, d: a.update(input_ids=a["input_ids"].to(torch.int16)), TypeError),
    ("ids list", lambda a, d: a.update(input_ids=[1, 2, 3]), TypeError),
    ("ids 2-D", lambda a, d: a.update(input_ids=a["input_ids"][None]), ValueError),
    ("ids strided", lambda a, d: a.update(input_ids=a["input_ids"].repeat(2)[::2]), ValueError),
    ("ids meta", lambda a, d: a.update(input_ids=torch.zeros(9, dtype=torch.int64, device="meta")), ValueError),
    ("positions short", lambda a, d: a.update(positions=a["positions"][:8]), ValueError),
    ("positions bool", lambda a, d: a.update(positions=a["positions"] > 0), TypeError),
    ("positions missing", lambda a, d: a.update(positions=None), TypeError),
    ("cache loc long", lambda a, d: a.update(out_cache_loc=a["out_cache_loc"].repeat(2)), ValueError),
    ("cache loc float", lambda a, d: a.update(out_cache_loc=a["out_cache_loc"].double()), TypeError),
    ("mrope 2 rows", lambda a, d: a.update(mrope_positions=a["mrope_positions"][:2]), ValueError),
    ("mrope long", lambda a, d: a.update(mrope_positions=a["mrope_positions"].repeat(1, 2)), ValueError),
    ("mrope 1-D", lambda a, d: a.update(mrope_positions=a["mrope_positions"][0]), ValueError),
    ("mrope columns strided", lambda a, d: a.update(mrope_positions=a["mrope_positions"].repeat(1, 2)[:, ::2]),
     ValueError),
    ("mrope transposed", lambda a, d: a.update(mrope_positions=a["mrope_positions"].t().contiguous().t()),
     ValueError),
    ("seq_lens vs extend_start_loc", lambda a, d: a.update(extend_start_loc=a["extend_start_loc"][:2]),
     ValueError),
    ("seq_lens 2-D", lambda a, d: a.update(seq_lens=a["seq_lens"][None]), ValueError),
    ("seq_lens float", lambda a, d: a.update(seq_lens=a["seq_lens"].float()), TypeError),
    ("too many requests", lambda a, d: a.update(seq_lens=torch.ones(7, dtype=torch.int32, device=d),
                                                extend_start_loc=torch.ones(7, dtype=torch.int32, device=d)),
     ValueError),
    ("pad_to below n", lambda a, d: a.update(pad_to=8), ValueError),
    ("pad_to past capacity", lambda a, d: a.update(pad_to=41), ValueError),
    ("pad_to float", lambda a, d: a.update(pad_to=12.0), ValueError),
    ("pad_to bool", lambda a, d: a.update(pad_to=True), ValueError),
    ("pad_to None", lambda a, d: a.update(pad_to=None), ValueError),
    ("n past capacity", lambda a, d: a.update(**{k: torch.ones(41, dtype=torch.int64, device=d)
                                                 for k in ("input_ids", "positions", "out_cache_loc")},
                                              mrope_positions=torch.ones(3, 41, dtype=torch.int64, device=d),
                                              pad_to=41), ValueError),
]


@pytest.mark.parametrize("name, change, exc", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_inputs_raise_before_writing(name, change, exc, device):
    buf = allocate(device)
    before = poison(buf)
    args = dict(_valid(device), pad_to=12)
    change(args, device)
    with pytest.raises(exc):
        stage_token_inputs(buf, **{k: v for k, v in args.items() if v is not None or k == "pad_to"})
    for slot in buf.registry:
        assert torch.equal(buf.registry[slot].cpu(), before[slot].cpu()), f"{slot} written before the error"


def test_mrope_given_without_mrope_slot(device):
    buf = allocate(device, mrope=False)
    before = poison(buf)
    args = _valid(device)
    with pytest.raises(ValueError, match="mrope"):
        stage_token_inputs(buf, pad_to=12, **args)
    for slot in buf.registry:
        assert torch.equal(buf.registry[slot].cpu(), before[slot].cpu())


def test_triton_kernel_runs_not_the_reference(device, kernel_only):
    """Under the interpreter (CPU) and on CUDA the Triton kernel is what these tests check."""
    g = torch.Generator().manual_seed(12)
    buf = allocate(device)
    before = poison(buf)
    inputs = make_inputs(g, 5, 2, device)
    stage_token_inputs(buf, pad_to=7, **inputs)
    check(buf, before, inputs, 5, 7)
