"""What the caller's process state must not change: its default device, inference mode, threads; and the few
values whose sign or NaN-ness a path once lost."""

import threading

import pytest
import torch

import slabstage as ss
from slabstage.staging.errors import default_error_word
from slabstage.staging.reference import stage_embeddings_reference
from slabstage.ops import HAS_CUSTOM_OPS, stage_token_inputs_op

W, T, V = 16, 24, 30


def buffers(device="cpu", **kw):
    return ss.StagingBuffers.allocate(max_num_tokens=T, max_batch_size=4, embed_width=W, embed_dtype=torch.float32,
                                      device=device, **kw)


def items_batch(device):
    g = torch.Generator().manual_seed(3)
    items = [torch.randn(3, W, generator=g).to(device), torch.randn(2, W, generator=g).to(device)]
    return dict(input_ids=torch.randint(0, V, (8,), generator=g).to(device), table=torch.randn(V, W, generator=g)
                .to(device), media=items, media_index=ss.media_index_from_spans([(1, 5, 0)], 8, device=device))


def test_the_callers_default_device_has_no_say():
    """Staging allocates nothing on the default device: under torch.device('meta') everything still works."""
    buf = buffers()
    b = items_batch("cpu")
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"] * 2, buf, progress=False)
    want = torch.zeros(T, W)
    stage_embeddings_reference(want, b["input_ids"], b["table"], media=b["media"], media_index=b["media_index"],
                               errors=ss.new_error_word("cpu"))
    with torch.device("meta"):
        slab = torch.zeros(T, W, device="cpu")
        ss.stage_embeddings(slab, b["input_ids"], b["table"], media=b["media"], media_index=b["media_index"])
        ss.stage_token_inputs(buf, input_ids=b["input_ids"], positions=torch.arange(8, device="cpu"), pad_to=8)
        out = runner.run(ss.PrefillBatch(positions=torch.arange(8, device="cpu"), **b), clone=True)
    assert torch.equal(slab[:8], want[:8]) and torch.equal(out, 2 * want[:8])


@pytest.mark.parametrize("what", ["slab", "slot"])
def test_destinations_made_in_inference_mode_are_written_outside_it_on_every_path(what):
    with torch.inference_mode():
        buf = buffers()
        slab = torch.full((T, W), float("nan"))
    b = items_batch("cpu")
    if what == "slab":
        want = torch.zeros(T, W)
        stage_embeddings_reference(want, b["input_ids"], b["table"], pad_to=10, errors=ss.new_error_word("cpu"))
        for stage in (ss.stage_embeddings, stage_embeddings_reference):  # the kernel path and the reference
            stage(slab, b["input_ids"], b["table"], pad_to=10, errors=ss.new_error_word("cpu"))
            assert torch.equal(slab[:10], want[:10])
    else:
        ss.stage_token_inputs(buf, input_ids=b["input_ids"], positions=torch.arange(8), pad_to=10)
        assert buf.input_ids[:8].tolist() == b["input_ids"].tolist() and buf.num_tokens_non_padded.item() == 8


def test_an_empty_item_anywhere_gets_one_answer():
    """An empty item is never read, wherever it lies: the kernel and the reference both accept it."""
    b = items_batch("cpu")
    media = [b["media"][0], torch.empty(0, W, device="meta"), b["media"][1]]
    a, r = torch.zeros(T, W), torch.zeros(T, W)
    ss.stage_embeddings(a, b["input_ids"], b["table"], media=media, media_index=b["media_index"])
    stage_embeddings_reference(r, b["input_ids"], b["table"], media=media, media_index=b["media_index"],
                               errors=ss.new_error_word("cpu"))
    assert torch.equal(a, r)


def test_media_index_from_mask_and_staging_in_threads():
    errors = []

    def work(seed):
        try:
            g = torch.Generator().manual_seed(seed)
            for _ in range(3):
                mask = torch.rand(40, generator=g) < 0.3
                index = ss.media_index_from_mask(mask, int(mask.sum()), errors=ss.new_error_word("cpu"))
                assert (index[mask] == torch.arange(int(mask.sum()), dtype=torch.int32)).all()
                slab = torch.zeros(40, W)
                ss.stage_embeddings(slab, torch.randint(0, V, (40,), generator=g), torch.randn(V, W, generator=g),
                                    media=torch.randn(int(mask.sum()), W, generator=g), media_index=index,
                                    errors=ss.new_error_word("cpu"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_a_negative_zero_scale_keeps_its_sign():
    table = torch.randn(V, W)
    ids = torch.randint(0, V, (6,))
    slab = torch.zeros(T, W)
    ss.stage_embeddings(slab, ids, table, text_scale=-0.0)
    want = (table[ids].float() * -0.0)
    assert torch.equal(slab[:6].view(torch.int32), want.view(torch.int32))  # -0.0 where the row is positive


@pytest.mark.parametrize("ratio", [float("nan"), float("inf"), 0.5, True])
def test_max_padding_ratio_must_be_a_number_of_at_least_one(ratio):
    with pytest.raises(ValueError, match="max_padding_ratio must be a (real|finite) number >= 1, got "):
        ss.PrefillGraphRunner(lambda v: v, buffers(), max_padding_ratio=ratio)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUSTOM_OPS, reason="needs torch.library.custom_op")
def test_the_token_op_reports_into_the_buffers_error_word():
    buf = buffers("cuda", cache_loc_dtype=torch.int32)
    default = default_error_word(torch.device("cuda"))
    ss.reset_errors(default)
    stage_token_inputs_op(buf, input_ids=torch.zeros(4, dtype=torch.int64, device="cuda"),
                          positions=torch.arange(4, device="cuda"),
                          out_cache_loc=torch.full((4,), 2**33, dtype=torch.int64, device="cuda"), pad_to=4)
    assert buf.errors[0].item() == ss.VALUE_OUT_OF_RANGE and default[0].item() == 0


@pytest.mark.cuda
def test_a_failed_capture_leaves_the_random_generators_usable():
    def forward(views):
        x = views["input_embeds"] * 1
        if torch.cuda.is_current_stream_capturing():
            x.sum().item()  # not permitted while capturing
        return x

    buf = buffers("cuda")
    runner = ss.PrefillGraphRunner(forward, buf, buckets=[8], progress=False)
    with pytest.raises(ss.CaptureError, match="forward raised while capturing"):
        runner.capture()
    torch.nn.Linear(8, 8, device="cuda")  # kaiming_uniform_: the CUDA generator is out of capture mode
    torch.randn(4, device="cuda")
    assert not torch.cuda.is_current_stream_capturing()
    batch = ss.PrefillBatch(input_ids=torch.arange(5, device="cuda"), positions=torch.arange(5, device="cuda"),
                            table=torch.randn(16, buf.input_embeds.shape[1], device="cuda"))
    runner.run(batch)  # the runner still runs (eagerly: no graph was kept)
    assert runner.last_bucket is None and torch.equal(buf.input_embeds[:5], batch.table[:5])


def test_a_slab_changed_in_place_is_checked_again():
    """stage_embeddings keeps the last slab's checked destinations: a slab whose storage, shape or strides
    changed since (set_, resize_, as_strided_) is checked again, so an alias or a lost row is still refused."""
    g = torch.Generator().manual_seed(5)
    table = torch.randn(V, W, generator=g)
    ids = torch.randint(0, V, (8,), generator=g)
    slab = torch.zeros(T, W)
    ss.stage_embeddings(slab, ids, table)
    assert torch.equal(slab[:8], table[ids])
    slab.set_(table.untyped_storage(), 0, (V, W), (W, 1))  # now the table's own storage
    before = table.clone()
    with pytest.raises(ValueError, match="overlaps"):
        ss.stage_embeddings(slab, ids, table)
    assert torch.equal(table, before)
    slab = torch.zeros(T, W)
    ss.stage_embeddings(slab, ids, table)
    slab.resize_(4, W)  # fewer rows than the batch
    with pytest.raises(ValueError, match="exceed the slab"):
        ss.stage_embeddings(slab, ids, table)
    slab = torch.zeros(T, W)
    ss.stage_embeddings(slab, ids, table)
    slab.as_strided_((T // 2, W), (2 * W, 1))  # rows no longer contiguous
    with pytest.raises(ValueError, match="stride"):
        ss.stage_embeddings(slab, ids, table)
