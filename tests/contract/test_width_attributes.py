"""Width attributes and media widths: a width property that raises is an error (not an absent attribute), an
absent one still falls back, and a media width that is neither the slab's nor the text's is refused.
"""

import pytest
from torch import nn
from slabstage import WidthContractError, resolve_input_embeds_width


class _Config:
    hidden_size = 32


class _PropertyReadsMissingField:
    config = _Config()

    @property
    def input_embeds_hidden_size(self):
        return self.config.deepstack_levels * self.config.hidden_size  # no such field: AttributeError


class _PropertyRaisesKeyError:
    @property
    def input_embeds_hidden_size(self):
        return {}["width"]


class _InheritsRaisingProperty(_PropertyReadsMissingField):
    pass


class _ModuleWithRaisingProperty(nn.Module):
    @property
    def input_embeds_hidden_size(self):
        return self.missing_width  # nn.Module.__getattr__ raises AttributeError


@pytest.mark.parametrize("cls, cause", [(_PropertyReadsMissingField, "deepstack_levels"),
                                        (_PropertyRaisesKeyError, "KeyError"),
                                        (_InheritsRaisingProperty, "deepstack_levels"),
                                        (_ModuleWithRaisingProperty, "missing_width")])
def test_width_property_raising_is_not_absent(cls, cause):
    with pytest.raises(WidthContractError, match=f"{cls.__name__}.input_embeds_hidden_size") as info:
        resolve_input_embeds_width(cls(), 32)
    assert cause in str(info.value)  # says what went wrong inside the declaration
    assert info.value.__cause__ is not None  # and keeps the original error


def test_absent_attribute_still_falls_back():
    class Plain:
        pass

    class Module(nn.Module):
        pass

    class Dynamic:
        def __getattr__(self, name):
            if name == "input_embeds_hidden_size":
                return 96
            raise AttributeError(name)

    assert resolve_input_embeds_width(Plain(), 32) == 32
    assert resolve_input_embeds_width(Module(), 32) == 32
    assert resolve_input_embeds_width(Dynamic(), 32) == 96  # served by __getattr__: declared


@pytest.mark.parametrize("media, slab, text, expand", [
    (50, 96, 32, "zeros"),
    (50, 96, 32, "repeat"),
    (48, 96, 32, "repeat"),  # divides the slab, but is not the text width
    (64, 96, 32, "zeros"),
    (128, 96, 32, "zeros"),
    (32, 96, 32, "tile"),
    (32, 96, 32, None),
    (32, 100, 32, "repeat"),  # the text width, but does not divide the slab
])
def test_media_width_neither_slab_nor_text(media, slab, text, expand):
    from slabstage.staging.validate import check_media_width
    with pytest.raises(WidthContractError) as info:
        check_media_width("media", media, slab, text, expand)
    msg = str(info.value)
    assert "media" in msg and str(media) in msg and str(slab) in msg


@pytest.mark.parametrize("media, slab, text, expand", [
    (96, 96, 32, "zeros"), (96, 96, 32, "repeat"), (96, 96, 96, "zeros"), (96, 96, 32, "anything"),
    (32, 96, 32, "zeros"), (32, 96, 32, "repeat"), (96, 96, 96, None),
])
def test_media_width_accepted(media, slab, text, expand):
    from slabstage.staging import check_media_width
    assert check_media_width("media", media, slab, text, expand) is None
