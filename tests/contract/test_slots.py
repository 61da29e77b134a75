"""Every slot of SLOTS reaches every place that names slots: stage_token_inputs' keywords, the custom op's
schema, StagingBuffers' properties, PrefillBatch's fields and the batch the runner captures with."""

import dataclasses
import inspect

import pytest
import torch

import slabstage.ops  # noqa: F401 - registers torch.ops.slabstage
from slabstage import PrefillBatch, StagingBuffers, stage_token_inputs
from slabstage.graph_runner.capture import _probe
from slabstage.ops import HAS_CUSTOM_OPS
from slabstage.staging.slots import COUNT, NEEDED_SLOTS, REQUESTS, ROWS, SLOTS, SOURCE_SLOTS, TOKENS

N = 7


def allocate(device, **kw):
    return StagingBuffers.allocate(max_num_tokens=11, max_batch_size=3, embed_width=5, embed_dtype=torch.float32,
                                   device=device, **kw)


def test_every_source_slot_is_a_keyword_of_stage_token_inputs():
    params = inspect.signature(stage_token_inputs).parameters
    assert [p for p in params if p not in ("buffers", "pad_to")] == \
        [s.name for s in SOURCE_SLOTS if s.required] + [s.name for s in SOURCE_SLOTS if not s.required]
    for spec in SOURCE_SLOTS:
        p = params[spec.name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY
        assert (p.default is inspect.Parameter.empty) == spec.required


@pytest.mark.skipif(not HAS_CUSTOM_OPS, reason="torch.library.custom_op needs torch >= 2.4")
def test_every_slot_is_in_the_custom_op_schema():
    names = [a.name for a in torch.ops.slabstage.stage_token_inputs.default._schema.arguments]
    for spec in SLOTS:
        assert f"{spec.name}_dst" in names
    for spec in SOURCE_SLOTS:
        assert spec.name in names


def test_every_source_slot_is_a_prefill_batch_field():
    fields = {f.name: f for f in dataclasses.fields(PrefillBatch)}
    for spec in SOURCE_SLOTS:
        assert spec.name in fields
        assert (fields[spec.name].default is dataclasses.MISSING) == spec.required


def test_every_slot_is_a_buffers_property(device):
    for mrope in (False, True):
        buf = allocate(device, mrope=mrope)
        for spec in SLOTS:
            assert isinstance(getattr(StagingBuffers, spec.name), property), spec.name
            if spec.switch is not None and not mrope:
                assert spec.name not in buf.registry and getattr(buf, spec.name) is None
                continue
            t = getattr(buf, spec.name)
            assert t is buf.registry[spec.name]
            slot = buf.registry.slot(spec.name)
            assert slot.pad == spec.pad
            assert t.shape == {TOKENS: (11,), ROWS: (spec.rows, 11), REQUESTS: (3,), COUNT: (1,)}[spec.kind]
            assert slot.token_axis == {TOKENS: 0, ROWS: 1}.get(spec.kind)


def test_buffers_without_a_needed_slot_cannot_stage(device):
    for name in NEEDED_SLOTS:
        buf = allocate(device)
        del buf.registry._slots[name]
        with pytest.raises(ValueError, match=repr(name)):
            stage_token_inputs(buf, input_ids=torch.arange(3), positions=torch.arange(3), pad_to=4)


def test_stage_token_inputs_refuses_unknown_and_missing_keywords(device):
    buf = allocate(device)
    before = {name: buf.registry[name].clone() for name in buf.registry}
    ids = torch.arange(3)
    with pytest.raises(TypeError, match="'seq_len'"):
        stage_token_inputs(buf, input_ids=ids, positions=ids, seq_len=ids, pad_to=4)
    for spec in SOURCE_SLOTS:
        if spec.required:
            given = {s.name: ids for s in SOURCE_SLOTS if s.required and s is not spec}
            with pytest.raises(TypeError, match=repr(spec.name)):
                stage_token_inputs(buf, pad_to=4, **given)
    assert all(torch.equal(buf.registry[name], t) for name, t in before.items())


@pytest.mark.parametrize("mrope", [False, True])
def test_every_slot_is_in_the_capture_probe(mrope, device):
    buf = allocate(device, mrope=mrope)
    probe = _probe(buf, N)
    assert probe.num_tokens == N
    for spec in SOURCE_SLOTS:
        t = getattr(probe, spec.name)
        if spec.probe is None or spec.name not in buf.registry:
            assert t is None, spec.name
            continue
        assert t.shape == {TOKENS: (N,), ROWS: (spec.rows, N), REQUESTS: (1,)}[spec.kind], spec.name
        if spec.probe == "positions":
            assert torch.equal(t.long(), torch.arange(N).expand(t.shape)), spec.name
        elif spec.probe == "count":
            assert torch.equal(t.long(), torch.full(t.shape, N)), spec.name
        elif spec.probe == "ids":
            assert 0 <= int(t.min()) and int(t.max()) < probe.table.shape[0]
        else:
            assert bool((t == spec.probe).all()), spec.name
    # the probe stages as the runner stages it: every slot it gives lands in the buffers
    from slabstage.staging.stager import stage_batch
    stage_batch(buf, pad_to=N, **{f.name: getattr(probe, f.name) for f in dataclasses.fields(probe)})
    for spec in SOURCE_SLOTS:
        t = getattr(probe, spec.name)
        if t is not None:
            got = buf.registry[spec.name]
            got = got[:, :N] if spec.kind == ROWS else got[:N] if spec.kind == TOKENS else got[:1]
            assert torch.equal(got.cpu().long(), t.long()), spec.name
    assert int(buf.num_tokens_non_padded[0]) == N


def test_the_capture_probe_writes_only_the_kv_caches_sink(device):
    """Warm-up, capture and the check after it run the forward on the probe: a forward that writes a KV cache
    at out_cache_loc must write slot 0 (the sink), not the slots the last real batch left in the buffers."""
    buf = allocate(device)
    buf.out_cache_loc.fill_(7)
    probe = _probe(buf, N)
    assert probe.out_cache_loc is not None and bool(probe.out_cache_loc.eq(0).all())
