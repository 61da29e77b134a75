"""PrefillGraphRunner: capture, replay == eager, registry checks, sync-free replay, fallbacks.

CPU tests cover what runs without a GPU (the eager path, argument checks, output
handling); tests marked ``cuda`` capture real graphs.
"""

import logging

import pytest
import torch

import slabstage as ss
from slabstage import CaptureError, PrefillBatch, PrefillGraphRunner, RegistryMismatchError, default_token_buckets
from slabstage.models import VARIANTS, ToyMultimodalModel, make_batch


def buffers_for(model, capacity, device):
    return ss.StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=8, embed_width=model.embed_width,
                                      embed_dtype=model.dtype, device=device)


def text_batch(n, width=32, vocab=50, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return PrefillBatch(input_ids=torch.randint(0, vocab, (n,), generator=g), positions=torch.arange(n),
                        table=torch.randn(vocab, width, generator=g).to(device))


def plain_buffers(capacity=64, width=32, device="cpu"):
    return ss.StagingBuffers.allocate(max_num_tokens=capacity, max_batch_size=4, embed_width=width,
                                      embed_dtype=torch.float32, device=device)


# ==================================================================================================
# CPU: the eager path and everything around it
# ==================================================================================================
def test_eager_without_cuda_says_so_once(caplog):
    buffers = plain_buffers()
    runner = PrefillGraphRunner(lambda v: v["input_embeds"] * 2, buffers, buckets=[8, 16])
    with caplog.at_level(logging.INFO, logger="slabstage"):
        assert runner.capture() is runner
        for n in (3, 8, 20):
            runner.run(text_batch(n))
    said = [r for r in caplog.records if "eagerly" in r.getMessage()]
    assert len(said) == 1
    # the reason: no CUDA device here; on a GPU machine, CPU buffers
    assert ("buffers on cpu" if torch.cuda.is_available() else "no CUDA device") in said[0].getMessage()
    assert runner.eager and not runner.captured and runner.last_bucket is None


def test_run_rejects_what_is_not_a_batch():
    runner = PrefillGraphRunner(lambda v: v["input_embeds"], plain_buffers(), buckets=[8])
    with pytest.raises(TypeError, match="PrefillBatch"):
        runner.run({"input_ids": torch.arange(3)})
    with pytest.raises(ValueError, match="empty"):  # an empty batch cannot even be built
        runner.run(PrefillBatch(input_ids=torch.empty(0, dtype=torch.long),
                                positions=torch.empty(0, dtype=torch.long), table=torch.randn(5, 32)))


def test_constructor_checks():
    buffers = plain_buffers(capacity=64)
    with pytest.raises(TypeError, match="callable"):
        PrefillGraphRunner(None, buffers)
    with pytest.raises(TypeError, match="StagingBuffers"):
        PrefillGraphRunner(lambda v: v, object())
    with pytest.raises(ValueError, match="capacity"):
        PrefillGraphRunner(lambda v: v, buffers, buckets=[16, 65])
    for bad in ([], [0, 4], [2.5], [True]):
        with pytest.raises(ValueError, match="buckets"):
            PrefillGraphRunner(lambda v: v, buffers, buckets=bad)
    with pytest.raises(ValueError, match="max_padding_ratio"):
        PrefillGraphRunner(lambda v: v, buffers, max_padding_ratio=0.9)
    runner = PrefillGraphRunner(lambda v: v, buffers, buckets=[16, 4, 4, 64])
    assert runner.buckets == [4, 16, 64]
    assert PrefillGraphRunner(lambda v: v, buffers).buckets == default_token_buckets(64)


def test_lazy_capture_without_cuda_runs_eagerly():
    runner = PrefillGraphRunner(lambda v: v["input_embeds"] * 1, plain_buffers(), buckets=[8, 16], progress=False)
    assert runner.capture(lazy=True) is runner and not runner.captured
    runner.run(text_batch(5))
    assert runner.last_fallback == "no_cuda"


def test_bucket_for():
    runner = PrefillGraphRunner(lambda v: v, plain_buffers(capacity=64), buckets=[1, 4, 16, 64],
                                max_padding_ratio=2.0)
    assert [runner.bucket_for(n) for n in (1, 5, 64)] == [None] * 3  # nothing captured: always eager
    runner._graphs = dict.fromkeys(runner.buckets)  # pretend a capture, to test the choice on its own
    want = {1: 1, 2: 4, 3: 4, 4: 4, 5: None, 8: 16, 9: 16, 16: 16, 17: None, 32: 64, 33: 64, 64: 64, 65: None}
    assert {n: runner.bucket_for(n) for n in want} == want
    runner.max_padding_ratio = 1.0  # only exact fits replay
    assert [runner.bucket_for(n) for n in (4, 5, 16, 63)] == [4, None, 16, None]


def test_outputs_are_cut_to_n_and_clone_copies():
    buffers = plain_buffers(capacity=64)
    static = torch.zeros(64, 32)  # like graph memory: the same tensor every run

    def forward(views):
        x = views["input_embeds"]
        static[: x.shape[0]] = x + 1
        return static

    runner = PrefillGraphRunner(forward, buffers, buckets=[16, 64])
    a, b = text_batch(10, seed=1), text_batch(10, seed=2)
    out = runner.run(a)
    assert out.shape == (10, 32) and out.data_ptr() == static.data_ptr()  # a view, no copy
    kept = runner.run(a, clone=True)
    assert kept.shape == (10, 32) and kept.data_ptr() != static.data_ptr()
    assert torch.equal(kept, buffers.input_embeds[:10] + 1)
    runner.run(b)
    assert torch.equal(out, static[:10]) and not torch.equal(kept, out)  # the view moved on, the copy did not
    assert torch.equal(kept, a.table[a.input_ids] + 1)


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "nested"])
def test_tuple_list_and_dict_outputs(kind):
    def forward(views):
        e, p = views["input_embeds"] * 3, views["positions"] + 1
        return {"tuple": (e, p), "list": [e, p], "dict": {"h": e, "pos": p}, "nested": {"h": (e, [p])}}[kind]

    runner = PrefillGraphRunner(forward, plain_buffers(), buckets=[16])
    batch = text_batch(7)
    out = runner.run(batch, clone=True)
    want_e, want_p = batch.table[batch.input_ids] * 3, torch.arange(7) + 1
    if kind in ("tuple", "list"):
        assert type(out) is {"tuple": tuple, "list": list}[kind]
        e, p = out
    elif kind == "dict":
        e, p = out["h"], out["pos"]
    else:
        e, (p,) = out["h"]
    assert torch.equal(e, want_e) and torch.equal(p, want_p)


def test_forward_returning_a_non_tensor_is_refused():
    runner = PrefillGraphRunner(lambda v: 42, plain_buffers(), buckets=[16])
    with pytest.raises(TypeError, match="forward must return a tensor"):
        runner.run(text_batch(4))


def test_eager_run_stages_and_forwards_n_rows():
    seen, hooked = [], []
    buffers = plain_buffers(capacity=64)
    runner = PrefillGraphRunner(lambda v: seen.append(v["input_embeds"].shape[0]) or v["input_embeds"].clone(),
                                buffers, buckets=[16, 64], after_stage=hooked.append)
    batch = text_batch(11)
    out = runner.run(batch)
    assert seen == [11] and hooked == [11]  # eagerly: no padding, views(n)
    assert torch.equal(out, batch.table[batch.input_ids])
    assert torch.equal(buffers.input_ids[:11], batch.input_ids)
    assert torch.equal(buffers.positions[:11], batch.positions)
    assert buffers.num_tokens_non_padded.item() == 11


def test_batch_beyond_capacity_is_refused_before_any_write():
    buffers = plain_buffers(capacity=16)
    runner = PrefillGraphRunner(lambda v: v["input_embeds"], buffers, buckets=[16])
    runner.run(text_batch(16, seed=3))
    before = {name: buffers.registry[name].clone() for name in buffers.registry}
    with pytest.raises(ValueError, match="capacity"):
        runner.run(text_batch(17, seed=4))
    for name, t in before.items():
        assert torch.equal(buffers.registry[name], t), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_eager_run_matches_model_forward(variant):
    model = ToyMultimodalModel(variant, hidden_size=64, vocab_size=97)
    buffers = buffers_for(model, 48, "cpu")
    runner = PrefillGraphRunner(model, buffers, buckets=[8, 16, 32])
    runner.capture()
    g = torch.Generator().manual_seed(0)
    for n in (5, 16, 29, 48):
        out = runner.run(make_batch(model, n, media_fraction=0.4, num_seqs=min(3, n), generator=g), clone=True)
        assert runner.last_bucket is None
        assert torch.equal(out, model(buffers.registry.views(n)))


@pytest.mark.parametrize("fails, eager_after", [(4, {3}), (8, {1, 3, 6}), (2, {1})])
def test_a_lazy_capture_that_fails_runs_its_buckets_eagerly_from_then_on(monkeypatch, caplog, fails, eager_after):
    """capture(lazy=True) with a forward that cannot be captured at one bucket (graphs faked on the CPU): the
    batch that needed it returns its eager output and the failure is logged once; from then on that bucket's
    batches run eagerly ("not_captured"), every bucket's when it was the largest (the others write into its
    outputs), and the others replay. Under verify="strict" the failure raises once."""
    from fake_cuda import forward_that_fails_capturing, install

    install(monkeypatch)
    runner = PrefillGraphRunner(forward_that_fails_capturing({fails}), plain_buffers(width=8), buckets=[2, 4, 8],
                                after_stage=lambda pad_to: None, progress=False)
    runner.eager = False  # (as on a CUDA device)
    runner.capture(lazy=True)
    first = fails  # (a batch of the failing bucket's size)
    with caplog.at_level(logging.WARNING, logger="slabstage"):
        out = runner.run(text_batch(first, width=8), clone=True)
    assert runner.last_fallback == "capturing" and torch.equal(out, runner.buffers.input_embeds[:first] * 2 + 1)
    assert sum("capture(lazy=True)" in r.getMessage() for r in caplog.records) == 1
    for n in (1, 3, 6, 1, 3, 6):
        batch = text_batch(n, width=8, seed=n)
        out = runner.run(batch, clone=True)
        assert (runner.last_fallback == "not_captured") == (n in eager_after), (n, runner.last_fallback)
        assert torch.equal(out, runner.buffers.input_embeds[:n] * 2 + 1)
    strict = PrefillGraphRunner(forward_that_fails_capturing({fails}), plain_buffers(width=8), buckets=[2, 4, 8],
                                after_stage=lambda pad_to: None, progress=False, verify="strict")
    strict.eager = False
    strict.capture(lazy=True)
    with pytest.raises(CaptureError):
        strict.run(text_batch(first, width=8))
    strict.run(text_batch(first, width=8))
    assert strict.last_fallback == "not_captured"


# ==================================================================================================
# CUDA: real capture and replay (run on a GPU machine)
# ==================================================================================================
SMALL_BUCKETS = [1, 3, 8, 16, 40, 64]


def captured(variant, buckets, *, capacity=None, dtype=torch.bfloat16, ratio=2.0, hidden=256, **model_kw):
    model = ToyMultimodalModel(variant, hidden_size=hidden, device="cuda", dtype=dtype, **model_kw)
    buffers = buffers_for(model, capacity or max(buckets), "cuda")
    runner = PrefillGraphRunner(model, buffers, buckets=buckets, max_padding_ratio=ratio, progress=False)
    runner.capture()
    return model, buffers, runner


def run_and_check(model, buffers, runner, n, g, *, expect_bucket="any", num_seqs=3, device=None):
    batch = make_batch(model, n, media_fraction=0.4, num_seqs=min(num_seqs, n), generator=g, device=device)
    out = runner.run(batch, clone=True)
    bucket = runner.last_bucket
    if expect_bucket != "any":
        assert bucket == expect_bucket, (n, bucket)
    ref = model(buffers.registry.views(bucket or n))[:n]  # eager, same staged buffers, same shape
    assert torch.equal(out, ref), f"{n} tokens (bucket {bucket}): max |diff| {(out - ref).abs().max().item()}"
    return bucket


def between(buckets):
    """Token counts strictly between neighbouring buckets: just above, just below and the middle."""
    sizes = set()
    for lo, hi in zip(buckets, buckets[1:]):
        sizes |= {n for n in (lo + 1, (lo + hi) // 2, hi - 1) if lo < n < hi}
    return sorted(sizes)


@pytest.mark.cuda
@pytest.mark.parametrize("ladder", ["small", "default512"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_replay_equals_eager_for_every_bucket_and_between(variant, ladder, dtype):
    buckets = SMALL_BUCKETS if ladder == "small" else default_token_buckets(512)
    model, buffers, runner = captured(variant, buckets, dtype=dtype, ratio=64.0)
    assert runner.captured and buffers.registry.frozen
    g = torch.Generator().manual_seed(0)
    for b in buckets:
        run_and_check(model, buffers, runner, b, g, expect_bucket=b)
    for n in between(buckets):
        want = next(b for b in buckets if b >= n)
        run_and_check(model, buffers, runner, n, g, expect_bucket=want)


@pytest.mark.cuda
def test_a_bare_replay_of_a_runner_graph_stages_nothing_and_the_next_step_is_right():
    """``runner.graphs[b][0].replay()`` with no batch prepared for it (a profiler's or a benchmark's replay), more
    times than the parameter ring has slots: every buffer keeps the last staged batch (the forward runs on it
    again), and the steps after it stage their own batches."""
    model, buffers, runner = captured("deepstack", [16, 32], capacity=32)
    g = torch.Generator().manual_seed(5)
    for n in (7, 30, 12):  # (7 tokens run eagerly: 16 rows would pad them more than max_padding_ratio allows)
        run_and_check(model, buffers, runner, n, g)
    bucket = runner.last_bucket
    assert bucket == 16
    before = {name: buffers.registry[name].clone() for name in buffers.registry}
    for _ in range(11):
        runner.graphs[bucket][0].replay()
    torch.cuda.synchronize()
    for name, t in before.items():
        assert torch.equal(buffers.registry[name].flatten().view(torch.uint8), t.flatten().view(torch.uint8)), name
    for n in (9, 25, 16, 3):
        run_and_check(model, buffers, runner, n, g)


@pytest.mark.cuda
@pytest.mark.parametrize("inputs", ["host", "device"])
def test_an_eager_run_captured_in_the_callers_graph_keeps_its_batch(inputs):
    """An eager runner's ``run()`` captured in the caller's own graph: the capture takes a parameter record of its
    own, so each replay of that graph stages the captured batch again, however many steps (more than the ring's
    slots) ran between."""
    model = ToyMultimodalModel("deepstack", hidden_size=64, device="cuda", dtype=torch.float32)
    buffers = buffers_for(model, 64, "cuda")
    runner = PrefillGraphRunner(model, buffers, buckets=[64], enforce_eager=True, progress=False)
    g = torch.Generator().manual_seed(9)
    where = "cuda" if inputs == "device" else None
    batch = make_batch(model, 20, media_fraction=0.4, num_seqs=2, generator=g, device=where)
    want = runner.run(batch, clone=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up off the default stream, as torch.cuda.graph asks)
        runner.run(batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = runner.run(batch)
    for n in (30, 7, 41, 12, 20, 33, 5, 64, 18, 27):
        other = runner.run(make_batch(model, n, media_fraction=0.4, num_seqs=2, generator=g, device=where),
                           clone=True)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and other.shape[0] == n


@pytest.mark.cuda
def test_replay_output_is_static_memory_unless_cloned():
    model, buffers, runner = captured("plain", [16, 32])
    g = torch.Generator().manual_seed(1)
    a, b = (make_batch(model, 12, num_seqs=2, generator=g) for _ in range(2))
    view = runner.run(a)
    first = view.clone()
    kept = runner.run(a, clone=True)
    assert torch.equal(kept, first)
    runner.run(b)  # same bucket: overwrites the graph's output
    assert not torch.equal(view, first)
    assert torch.equal(kept, first)


@pytest.mark.cuda
def test_reallocated_slot_is_refused():
    model, buffers, runner = captured("deepstack", [8, 32], capacity=32)
    g = torch.Generator().manual_seed(2)
    run_and_check(model, buffers, runner, 20, g, expect_bucket=32)
    ids_before = buffers.input_ids.clone()
    buffers.input_embeds.set_(torch.empty_like(buffers.input_embeds))  # reallocated behind the graph's back
    with pytest.raises(RegistryMismatchError, match="input_embeds.*data_ptr"):
        runner.run(make_batch(model, 20, generator=g))
    assert torch.equal(buffers.input_ids, ids_before)  # refused before anything was written
    with pytest.raises(RegistryMismatchError, match="frozen"):  # swapping a slot in the registry
        buffers.registry.replace("positions", torch.zeros_like(buffers.positions))
    # dropping the graphs and capturing again against the new buffer works
    runner.reset()
    assert not buffers.registry.frozen
    runner.capture()
    run_and_check(model, buffers, runner, 20, g, expect_bucket=32)


@pytest.mark.cuda
@pytest.mark.parametrize("inputs", ["device", "host"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_graph_path_has_no_host_sync(variant, inputs):
    model, buffers, runner = captured(variant, [16, 64, 128])
    g = torch.Generator().manual_seed(3)
    where = "cuda" if inputs == "device" else None
    # building batches (encoder, media index, host tensors) happens outside the checked region
    batches = [make_batch(model, n, media_fraction=0.5, num_seqs=2, generator=g, device=where) for n in (16, 50, 100)]
    for batch in batches:  # warm-up: staging kernels compiled, pinned host blocks cached
        runner.run(batch)
    torch.cuda.synchronize()
    outs, buckets = [], []
    replays = sum(runner.stats()["replays"].values())
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches:
            outs.append(runner.run(batch, clone=True))
            buckets.append(runner.last_bucket)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert buckets == [16, 64, 128]
    assert sum(runner.stats()["replays"].values()) == replays + 3  # staged inside the graphs, host inputs too
    for batch, out, bucket in zip(batches, outs, buckets):  # and the results are right
        again = runner.run(batch, clone=True)
        assert torch.equal(out, again)
        assert torch.equal(again, model(buffers.registry.views(bucket))[: batch.num_tokens])


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict"])
def test_graph_path_views_are_reused_and_containers_are_not(kind):
    model = ToyMultimodalModel("plain", hidden_size=64, num_heads=4, device="cuda", dtype=torch.bfloat16)
    buffers = buffers_for(model, 64, "cuda")
    wrap = {"tensor": lambda h: h, "tuple": lambda h: (h, h[:, :8]), "dict": lambda h: {"h": h}}[kind]
    runner = PrefillGraphRunner(lambda v: wrap(model(v)), buffers, buckets=[16, 64], progress=False).capture()
    g = torch.Generator().manual_seed(5)
    a, b = (make_batch(model, n, num_seqs=2, generator=g, device="cuda") for n in (12, 12))
    first = runner.run(a)
    want_a = runner.run(a, clone=True)
    if kind == "dict":
        first.pop("h")  # the caller's container: the next run hands out a fresh one
    second = runner.run(b)
    want_b = model(buffers.registry.views(16))[:12]
    get = {"tensor": lambda o: o, "tuple": lambda o: o[0], "dict": lambda o: o["h"]}[kind]
    assert torch.equal(get(second), want_b) and not torch.equal(get(want_a), want_b)
    if kind == "dict":
        assert second is not first
    else:
        assert second is first  # the same views, now holding b's rows


@pytest.mark.cuda
def test_thirty_plus_buckets_share_one_pool(caplog):
    buckets = default_token_buckets(1024)
    assert len(buckets) >= 30
    with caplog.at_level(logging.INFO, logger="slabstage"):
        model, buffers, runner = captured("hc", buckets, hidden=64)
    assert runner.captured and len(runner._graphs) == len(buckets)
    assert {graph.pool() for graph, _ in runner._graphs.values()} == {runner.pool}
    assert runner.capture_seconds > 0 and runner.capture_bytes >= 0
    assert any(f"captured {len(buckets)} prefill graphs" in r.getMessage() for r in caplog.records)
    g = torch.Generator().manual_seed(4)
    for n in (1, 5, 17, 100, 333, 1000, 1024):
        assert run_and_check(model, buffers, runner, n, g, num_seqs=4) is not None


class FlakyForward:
    """The model's forward, raising at one bucket (after doing real work) while armed."""

    def __init__(self, model, bad_bucket, only_while_capturing):
        self.model, self.bad_bucket, self.only_while_capturing = model, bad_bucket, only_while_capturing
        self.armed = True

    def __call__(self, views):
        out = self.model(views)
        if (self.armed and views["input_embeds"].shape[0] == self.bad_bucket
                and (torch.cuda.is_current_stream_capturing() or not self.only_while_capturing)):
            raise RuntimeError("forward exploded")
        return out


@pytest.mark.cuda
@pytest.mark.parametrize("only_while_capturing", [True, False], ids=["in-capture", "in-warm-up"])
def test_capture_failure_names_the_bucket_and_capture_works_afterwards(only_while_capturing):
    model = ToyMultimodalModel("plain", device="cuda", dtype=torch.bfloat16)
    buffers = buffers_for(model, 64, "cuda")
    flaky = FlakyForward(model, 16, only_while_capturing)
    runner = PrefillGraphRunner(flaky, buffers, buckets=[4, 16, 32, 64], progress=False)
    with pytest.raises(CaptureError, match="16-token bucket") as info:
        runner.capture()
    assert "forward exploded" in str(info.value) and isinstance(info.value.__cause__, RuntimeError)
    assert not runner.captured and not buffers.registry.frozen and runner.bucket_for(10) is None
    flaky.armed = False
    runner.capture()
    assert runner.captured
    g = torch.Generator().manual_seed(5)
    for n, bucket in ((10, 16), (16, 16), (40, 64)):
        run_and_check(model, buffers, runner, n, g, expect_bucket=bucket)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", VARIANTS)
def test_eager_fallback_gives_the_eager_result(variant):
    model, buffers, runner = captured(variant, [8, 16, 32], capacity=64, ratio=1.5)
    g = torch.Generator().manual_seed(6)
    for n in (33, 50, 64):  # beyond the largest bucket
        run_and_check(model, buffers, runner, n, g, expect_bucket=None)
    for n in (5, 9, 10, 17, 21):  # the bucket would pad more than 1.5x
        run_and_check(model, buffers, runner, n, g, expect_bucket=None)
    for n in (6, 12, 22):  # and these replay
        assert run_and_check(model, buffers, runner, n, g) is not None


@pytest.mark.cuda
def test_eager_reasons_on_cuda(caplog):
    model = ToyMultimodalModel("plain", hidden_size=64, device="cuda")
    with caplog.at_level(logging.INFO, logger="slabstage"):
        forced = PrefillGraphRunner(model, buffers_for(model, 32, "cuda"), buckets=[32], enforce_eager=True)
        forced.capture()
        uncaptured = PrefillGraphRunner(model, buffers_for(model, 32, "cuda"), buckets=[32])
        uncaptured.run(make_batch(model, 20))
    messages = [r.getMessage() for r in caplog.records if "eagerly" in r.getMessage()]
    assert len(messages) == 2
    assert "enforce_eager=True" in messages[0] and "no graphs captured" in messages[1]
    assert not forced.captured and uncaptured.last_bucket is None


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["plain", "deepstack"])
def test_lazy_capture_runs_eagerly_once_then_replays(variant):
    """capture(lazy=True) captures nothing; a bucket's first batch runs eagerly ("capturing"), equal to the eager
    forward, and leaves that bucket (and the largest) captured and checked: the next batch replays it."""
    buckets = [8, 16, 40, 64]
    model = ToyMultimodalModel(variant, hidden_size=256, device="cuda", dtype=torch.bfloat16)
    buffers = buffers_for(model, 64, "cuda")
    runner = PrefillGraphRunner(model, buffers, buckets=buckets, max_padding_ratio=64.0, progress=False)
    runner.capture(lazy=True)
    assert not runner.captured and buffers.registry.frozen and runner.bucket_for(12) is None
    g = torch.Generator().manual_seed(5)
    for n, captured_after in ((12, {16, 64}), (14, {16, 64}), (33, {16, 40, 64}), (64, {16, 40, 64})):
        first = n not in (14, 64)
        batch = make_batch(model, n, media_fraction=0.4, num_seqs=2, generator=g)
        out = runner.run(batch, clone=True)
        if first:
            assert runner.last_bucket is None and runner.last_fallback == "capturing"
            ref = model(buffers.registry.views(n))[:n]
        else:
            assert runner.last_bucket is not None and runner.last_fallback is None
            ref = model(buffers.registry.views(runner.last_bucket))[:n]
        assert set(runner.graphs) == captured_after and set(runner.checks) == captured_after
        assert torch.equal(out, ref), n
        again = runner.run(batch, clone=True)  # now replayed, the same answer
        assert runner.last_fallback is None and torch.equal(again, out)
    assert runner.stats()["eager"] == {"capturing": 2}


@pytest.mark.cuda
def test_lazy_capture_then_reset_and_full_capture():
    model = ToyMultimodalModel("plain", hidden_size=64, device="cuda")
    runner = PrefillGraphRunner(model, buffers_for(model, 32, "cuda"), buckets=[8, 32], progress=False)
    runner.capture(lazy=True)
    with pytest.raises(RuntimeError, match="already captured"):
        runner.capture()
    runner.run(make_batch(model, 5))
    assert set(runner.graphs) == {8, 32}
    runner.reset()
    assert not runner.captured and runner.checks == {} and runner.capture_seconds == 0.0
    runner.capture()
    runner.run(make_batch(model, 5))
    assert runner.last_bucket == 8
