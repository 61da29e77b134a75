"""The width contract: how wide the ``input_embeds`` slab is for a given model.

A model may declare ``input_embeds_hidden_size`` (or any other optional width,
named by ``attr``). Declared, it wins; absent, the config width is used. Anything
in between (a wrong type, a value below the config width, a near-miss spelling of
the attribute) raises :class:`WidthContractError` rather than falling back.
"""

from __future__ import annotations

import inspect
import re

from ..checks import is_int

__all__ = ["WidthContractError", "resolve_input_embeds_width"]

_MISSING = object()

# Words that mean the same thing in attribute names; a near miss is a name whose
# words map onto the expected name's words (plural, abbreviation, synonym, case).
_SYNONYMS = {
    "inputs": "input",
    "inp": "input",
    "embeds": "embed",
    "embedding": "embed",
    "embeddings": "embed",
    "emb": "embed",
    "embd": "embed",
    "dim": "size",
    "dims": "size",
    "sizes": "size",
    "width": "size",
    "hid": "hidden",
}


class WidthContractError(ValueError):
    """A model's declared embedding width, or a write against it, breaks the contract."""


def _words(name: str) -> list[str]:
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return [w.lower() for w in re.split(r"[_\W]+", spaced) if w]


def _canonical(name: str) -> list[str]:
    return [_SYNONYMS.get(w, w) for w in _words(name)]


def _within_one_edit(a: str, b: str) -> bool:
    if a == b:
        return True
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (
            len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]
        )
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    i = 0
    while i < len(short) and short[i] == long_[i]:
        i += 1
    return short[i:] == long_[i + 1 :]


def _is_near_miss(candidate: str, attr: str) -> bool:
    if candidate == attr or candidate.startswith("__"):
        return False
    want, got = _canonical(attr), _canonical(candidate)
    if "".join(got) == "".join(want):
        return True  # case, separators, plurals, synonyms
    if len(got) == len(want) and all(
        g == w or (min(len(g), len(w)) >= 4 and _within_one_edit(g, w)) for g, w in zip(got, want)
    ):
        return True  # one typo inside a word
    flat_got, flat_want = "".join(_words(candidate)), "".join(_words(attr))
    return len(flat_want) >= 8 and _within_one_edit(flat_got, flat_want)


def _near_misses(model: object, attr: str) -> list[str]:
    try:
        names = dir(model)
    except Exception:  # exotic objects: fall back to instance attributes only
        names = list(getattr(model, "__dict__", {}))
    return sorted(n for n in names if _is_near_miss(n, attr))


def _declared(model: object, attr: str, where: str) -> object:
    """``model.<attr>``, or ``_MISSING`` when it is absent: not found statically (no property run) and not served
    by ``__getattr__``. A present attribute that raises while computing raises :class:`WidthContractError`."""
    try:
        static = inspect.getattr_static(model, attr)
    except AttributeError:
        static = _MISSING
    try:
        return getattr(model, attr)
    except Exception as e:
        if static is _MISSING and isinstance(e, AttributeError):
            return _MISSING  # absent, and no __getattr__ serves it
        cause = e
        if isinstance(e, AttributeError) and hasattr(static, "__get__") and not isinstance(model, type):
            # a class __getattr__ (nn.Module's) may have replaced the property's own error: get it back
            try:
                static.__get__(model, type(model))
            except Exception as inner:
                cause = inner
        raise WidthContractError(f"{where}.{attr} is declared but computing it raised {type(cause).__name__}: {cause}; "
                                 f"only an absent attribute falls back to the config width") from cause


def _as_width(value: object) -> int | None:
    return int(value) if is_int(value) else None


def resolve_input_embeds_width(
    model: object, config_hidden_size: int, *, attr: str = "input_embeds_hidden_size"
) -> int:
    """Return the width of the ``input_embeds`` slab for ``model``.

    ``model.<attr>`` (an instance attribute, class attribute or property) wins when
    declared; otherwise ``config_hidden_size`` is returned.

    Raises :class:`WidthContractError` (a ``ValueError``) when ``config_hidden_size``
    is not a positive int; when the declared value is not an int (``None``, bools
    and floats included), is <= 0, or is below ``config_hidden_size``; when the
    attribute is present but raises while computing (a property reading a missing
    config field: only an absent attribute falls back); and when the attribute is
    absent but a near-miss spelling of it is present (so a typo never falls back
    silently).
    """
    where = type(model).__name__
    base = _as_width(config_hidden_size)
    if base is None or base <= 0:
        raise WidthContractError(f"{where}: config hidden size must be a positive int, got {config_hidden_size!r}")
    declared = _declared(model, attr, where)
    if declared is _MISSING:
        misses = _near_misses(model, attr)
        if misses:
            raise WidthContractError(f"{where} has attribute {misses[0]!r} but not {attr!r}: a misspelt width "
                                     f"declaration would silently fall back to config hidden size {base}; "
                                     f"rename it to {attr!r} (found: {', '.join(misses)})")
        return base
    width = _as_width(declared)
    if width is None:
        raise WidthContractError(f"{where}.{attr} must be a positive int, got {declared!r} "
                                 f"({type(declared).__name__}); config hidden size is {base}")
    if width <= 0:
        raise WidthContractError(f"{where}.{attr} must be positive, got {width} (config hidden size {base})")
    if width < base:
        raise WidthContractError(f"{where}.{attr} = {width} is below the config hidden size {base}: "
                                 f"the slab must hold at least the hidden size")
    return width
