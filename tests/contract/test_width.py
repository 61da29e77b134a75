"""The width contract: resolve_input_embeds_width and check_source_width."""

import numpy as np
import pytest
import torch
from torch import nn

from slabstage import WidthContractError, resolve_input_embeds_width
from slabstage.staging import check_source_width

ATTR = "input_embeds_hidden_size"


def make_model(cls_name="ToyVLM", **attrs):
    """A fresh class per call, so class names show up in messages and nothing leaks."""
    model = type(cls_name, (), {})()
    for k, v in attrs.items():
        setattr(model, k, v)
    return model


def test_error_is_a_value_error():
    assert issubclass(WidthContractError, ValueError)


# -- declared or absent -------------------------------------------------------------

@pytest.mark.parametrize("config, declared", [(4096, 4096), (4096, 16384), (4096, 4 * 4096), (2560, 2561),
                                              (1000, 3000), (7, 7), (1, 1)])
def test_declared_value_wins(config, declared):
    assert resolve_input_embeds_width(make_model(**{ATTR: declared}), config) == declared


@pytest.mark.parametrize("config", [1, 7, 1000, 4096, 5120])
def test_absent_falls_back_to_config(config):
    assert resolve_input_embeds_width(make_model(), config) == config
    assert resolve_input_embeds_width(object(), config) == config


@pytest.mark.parametrize("config", [1000, 4096])
def test_unrelated_attributes_do_not_raise(config):
    model = make_model(hidden_size=config * 2, vocab_size=151936, embed_tokens=nn.Embedding(3, 2),
                       hc_mult=4, hc_hidden_size=config * 4, output_embeds_hidden_size=config * 3,
                       input_embeds=None, get_input_embeddings=lambda: None, intermediate_size=11008,
                       embed_dim=config, num_hidden_layers=2)
    assert resolve_input_embeds_width(model, config) == config


def test_property_counts_as_declared():
    class WithProperty:
        def __init__(self, h):
            self.hidden_size = h

        @property
        def input_embeds_hidden_size(self):
            return self.hidden_size * 3

    assert resolve_input_embeds_width(WithProperty(1000), 1000) == 3000


def test_class_attribute_counts_as_declared():
    class WithClassAttr:
        input_embeds_hidden_size = 8192

    assert resolve_input_embeds_width(WithClassAttr(), 4096) == 8192
    assert resolve_input_embeds_width(WithClassAttr, 4096) == 8192  # the class itself, too


def test_invalid_property_value_raises():
    class BadProperty:
        @property
        def input_embeds_hidden_size(self):
            return 4096.0

    with pytest.raises(WidthContractError, match="BadProperty"):
        resolve_input_embeds_width(BadProperty(), 4096)


@pytest.mark.parametrize("value", [np.int64(8192), np.int32(4097), np.uint16(5000)])
def test_numpy_integer_accepted(value):
    got = resolve_input_embeds_width(make_model(**{ATTR: value}), 4096)
    assert got == int(value) and type(got) is int


def test_numpy_integer_config_accepted():
    got = resolve_input_embeds_width(make_model(), np.int64(3584))
    assert got == 3584 and type(got) is int


def test_nn_module_model():
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(11, 8)
            self.input_embeds_hidden_size = 24

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(11, 8)
            self.hidden_size = 8

    class Typo(nn.Module):
        def __init__(self):
            super().__init__()
            self.inputs_embeds_hidden_size = 24

    assert resolve_input_embeds_width(Wide(), 8) == 24
    assert resolve_input_embeds_width(Plain(), 8) == 8
    with pytest.raises(WidthContractError, match="inputs_embeds_hidden_size"):
        resolve_input_embeds_width(Typo(), 8)


def test_nn_module_with_registered_submodule_under_the_name_is_invalid():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_embeds_hidden_size = nn.Linear(2, 2)

    with pytest.raises(WidthContractError, match="Odd"):
        resolve_input_embeds_width(Odd(), 8)


# -- invalid declared values ---------------------------------------------------------

@pytest.mark.parametrize("value", [None, True, False, 4096.0, 8192.0, 4096.5, float("nan"), float("inf"),
                                   "4096", "8192", b"8192", [8192], (8192,), np.float64(8192.0),
                                   np.bool_(True), torch.tensor(8192), 8192 + 0j],
                         ids=repr)
def test_declared_wrong_type_raises(value):
    model = make_model("WideVLM", **{ATTR: value})
    with pytest.raises(WidthContractError) as info:
        resolve_input_embeds_width(model, 4096)
    msg = str(info.value)
    assert "WideVLM" in msg and ATTR in msg and "4096" in msg
    assert repr(value) in msg


@pytest.mark.parametrize("value", [0, -1, -4096, -(2**40)])
def test_declared_non_positive_raises(value):
    with pytest.raises(WidthContractError) as info:
        resolve_input_embeds_width(make_model("ZeroVLM", **{ATTR: value}), 3584)
    msg = str(info.value)
    assert "ZeroVLM" in msg and ATTR in msg and str(value) in msg and "3584" in msg


@pytest.mark.parametrize("config, value", [(4096, 4095), (4096, 2048), (4097, 4096), (1000, 1), (2, 1)])
def test_declared_below_config_raises(config, value):
    with pytest.raises(WidthContractError) as info:
        resolve_input_embeds_width(make_model("NarrowVLM", **{ATTR: value}), config)
    msg = str(info.value)
    assert "NarrowVLM" in msg and ATTR in msg and str(value) in msg and str(config) in msg


@pytest.mark.parametrize("config", [0, -1, -4096, None, True, False, 4096.0, "4096", np.float32(4096)], ids=repr)
def test_invalid_config_hidden_size_raises(config):
    with pytest.raises(WidthContractError) as info:
        resolve_input_embeds_width(make_model("CfgVLM", **{ATTR: 8192}), config)
    assert "CfgVLM" in str(info.value) and repr(config) in str(info.value)
    with pytest.raises(WidthContractError):
        resolve_input_embeds_width(make_model(), config)


# -- near misses ---------------------------------------------------------------------

NEAR_MISSES = [
    "input_embed_hidden_size",
    "inputs_embeds_hidden_size",
    "input_embeds_hidden_dim",
    "input_embeds_hidden_width",
    "input_embeds_hidden_sizes",
    "input_embedding_hidden_size",
    "input_embeddings_hidden_size",
    "input_emb_hidden_size",
    "inp_embeds_hidden_size",
    "input_embeds_hid_size",
    "Input_Embeds_Hidden_Size",
    "INPUT_EMBEDS_HIDDEN_SIZE",
    "inputEmbedsHiddenSize",
    "InputEmbedsHiddenSize",
    "input_embeds_hiden_size",
    "input_embeds_hidden_szie",
    "imput_embeds_hidden_size",
    "input_embeds_hidden_siz",
    "input_embeds_hiddensize",
    "inputembedshiddensize",
    "_input_embeds_hidden_size",
    "input_embeds_hidden_size_",
]


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_near_miss_raises_naming_both(name):
    model = make_model("TypoVLM", **{name: 8192})
    with pytest.raises(WidthContractError) as info:
        resolve_input_embeds_width(model, 4096)
    msg = str(info.value)
    assert "TypoVLM" in msg and repr(name) in msg and repr(ATTR) in msg and "4096" in msg


@pytest.mark.parametrize("name", ["inputs_embeds_hidden_size", "InputEmbedsHiddenSize"])
def test_near_miss_as_class_attribute_or_property_raises(name):
    as_class = type("ClassTypo", (), {name: 8192})()
    as_prop = type("PropTypo", (), {name: property(lambda self: 8192)})()
    for model in (as_class, as_prop):
        with pytest.raises(WidthContractError, match=name):
            resolve_input_embeds_width(model, 4096)


def test_declared_attribute_beats_near_miss():
    model = make_model(**{ATTR: 8192, "inputs_embeds_hidden_size": 4096})
    assert resolve_input_embeds_width(model, 4096) == 8192


def test_near_miss_message_lists_every_found_name():
    model = make_model(inputs_embeds_hidden_size=1, input_embeds_hidden_dim=2)
    with pytest.raises(WidthContractError) as info:
        resolve_input_embeds_width(model, 16)
    assert "inputs_embeds_hidden_size" in str(info.value) and "input_embeds_hidden_dim" in str(info.value)


@pytest.mark.parametrize("name", ["hidden_size", "vocab_size", "embed_tokens", "embed_dim", "hc_hidden_size",
                                  "output_embeds_hidden_size", "input_ids", "input_embeds", "inputs_embeds",
                                  "embeds_hidden_size", "input_hidden_size", "text_hidden_size",
                                  "vision_hidden_size", "input_embeds_hidden_size_multiplier",
                                  "__input_embeds_hidden_size__"])
def test_not_a_near_miss(name):
    assert resolve_input_embeds_width(make_model(**{name: 99999}), 4096) == 4096


# -- a custom attribute --------------------------------------------------------------

def test_custom_attr_declared_and_absent():
    assert resolve_input_embeds_width(make_model(hc_hidden_size=16384), 4096, attr="hc_hidden_size") == 16384
    assert resolve_input_embeds_width(make_model(), 4096, attr="hc_hidden_size") == 4096
    # the default attribute is not looked at when another is asked for
    model = make_model(**{ATTR: 8192})
    assert resolve_input_embeds_width(model, 4096, attr="hc_hidden_size") == 4096


def test_custom_attr_plain_hidden_size_is_not_a_near_miss():
    model = make_model(hidden_size=4096, vocab_size=32000)
    assert resolve_input_embeds_width(model, 4096, attr="hc_hidden_size") == 4096


@pytest.mark.parametrize("name", ["hc_hidden_dim", "hc_hiden_size", "HcHiddenSize", "HC_HIDDEN_SIZE",
                                  "hc_hidden_sizes"])
def test_custom_attr_near_miss(name):
    with pytest.raises(WidthContractError) as info:
        resolve_input_embeds_width(make_model("HcModel", **{name: 16384}), 4096, attr="hc_hidden_size")
    msg = str(info.value)
    assert "HcModel" in msg and repr(name) in msg and "'hc_hidden_size'" in msg


@pytest.mark.parametrize("value", [None, 4096.0, 0, 2048])
def test_custom_attr_invalid_value_names_it(value):
    with pytest.raises(WidthContractError) as info:
        resolve_input_embeds_width(make_model("HcModel", hc_hidden_size=value), 4096, attr="hc_hidden_size")
    msg = str(info.value)
    assert "HcModel" in msg and "hc_hidden_size" in msg and "4096" in msg


# -- check_source_width --------------------------------------------------------------

@pytest.mark.parametrize("src, slab, expand", [
    (4096, 4096, "zeros"), (4096, 4096, "repeat"), (4097, 4097, "zeros"),
    (1000, 3000, "zeros"), (1000, 3000, "repeat"), (1000, 3001, "zeros"),
    (48, 192, "repeat"), (5, 15, "repeat"), (1, 7, "repeat"), (37, 100, "zeros"),
])
def test_check_source_width_accepts(src, slab, expand):
    assert check_source_width("media", src, slab, expand) is None


@pytest.mark.parametrize("src, slab", [(4097, 4096), (8192, 4096), (2, 1)])
@pytest.mark.parametrize("expand", ["zeros", "repeat"])
def test_check_source_width_too_wide(src, slab, expand):
    with pytest.raises(WidthContractError) as info:
        check_source_width("media", src, slab, expand)
    msg = str(info.value)
    assert "media" in msg and str(src) in msg and str(slab) in msg


@pytest.mark.parametrize("src, slab", [(1000, 3001), (48, 200), (4096, 6144), (3, 7)])
def test_check_source_width_repeat_must_divide(src, slab):
    with pytest.raises(WidthContractError) as info:
        check_source_width("table", src, slab, "repeat")
    msg = str(info.value)
    assert "table" in msg and str(src) in msg and str(slab) in msg and "repeat" in msg


def test_check_source_width_zero_wide_source_cannot_repeat():
    with pytest.raises(WidthContractError, match="repeat"):
        check_source_width("table", 0, 64, "repeat")


@pytest.mark.parametrize("expand", ["tile", "pad", None, ""])
def test_check_source_width_unknown_policy(expand):
    with pytest.raises(WidthContractError) as info:
        check_source_width("table", 1000, 3000, expand)
    assert repr(expand) in str(info.value)
