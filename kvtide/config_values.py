"""Config values by type annotation: a string (environment, file) or a typed file value checked and converted.

Supported annotations: ``int``, ``float`` (finite only), ``bool``, ``str``, ``Literal[...]``, unions of these and
``X | None``, and tuples of them (``tuple[X, ...]``, ``tuple[X, Y]``) given as lists or, in a string, as JSON. A bad value raises ``ValueError`` naming where it came from and what was expected, e.g.
``KVTIDE_CACHE_PAGE_SIZE='abc': expected an int``.
"""
from __future__ import annotations

import json
import math
import types
import typing
from typing import Any, Literal, Union

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})
NONE_WORDS = frozenset({"", "none", "null"})
MAX_STRING_CHARS = 4096  # no config value is longer; a longer one is a mistake or an attack


class _Bad(Exception):
    """The value does not fit the annotation (the caller words the error for the whole annotation)."""


def _members(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)


def describe(tp: Any) -> str:
    """What a value of annotation ``tp`` looks like, for error messages."""
    parts = []
    for m in _members(tp):
        if m is type(None):
            continue
        if typing.get_origin(m) is Literal:
            parts.append("one of " + ", ".join(repr(v) for v in typing.get_args(m)))
        elif m is bool:
            parts.append("a bool (true/false, 1/0, yes/no, on/off)")
        elif m is int:
            parts.append("an int")
        elif m is float:
            parts.append("a finite float")
        elif m is str:
            parts.append("a string")
        elif typing.get_origin(m) is tuple:
            parts.append("a list (JSON in a string)")
        else:
            parts.append(f"a {getattr(m, '__name__', m)}")
    if type(None) in _members(tp):
        parts.append("none")
    return " or ".join(parts)


def parse_value(raw: Any, tp: Any, where: str) -> Any:
    """``raw`` as a value of annotation ``tp``. Strings are parsed (``'32'`` -> 32, ``'off'`` -> False,
    ``'none'`` -> None for optional fields, and ``'auto'`` too where the field holds no string); other values must
    already have the type (an int is accepted for a float). Raises ValueError naming ``where`` and the expected type."""
    if isinstance(raw, str) and len(raw) > MAX_STRING_CHARS:
        raise ValueError(f"{where}: value of {len(raw)} characters, expected at most {MAX_STRING_CHARS}")
    members = _members(tp)
    if type(None) in members:
        if raw is None:
            return None
        words = NONE_WORDS if str in members or any(typing.get_origin(m) is Literal for m in members) \
            else NONE_WORDS | {"auto"}
        if isinstance(raw, str) and raw.strip().lower() in words:
            return None
    for m in members:
        if m is type(None):
            continue
        try:
            return _parse_one(raw, m)
        except _Bad:
            continue
    raise ValueError(f"{where}={raw!r}: expected {describe(tp)}")


def _parse_one(raw: Any, tp: Any) -> Any:
    if typing.get_origin(tp) is Literal:
        for option in typing.get_args(tp):
            if raw == option or (isinstance(raw, str) and not isinstance(option, str) and raw.strip() == str(option)):
                return option
        raise _Bad
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in TRUE_WORDS | FALSE_WORDS:
            return raw.strip().lower() in TRUE_WORDS
        raise _Bad
    if tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            try:
                return int(raw.strip())
            except ValueError:
                raise _Bad from None
        raise _Bad
    if tp is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            value = float(raw)
        elif isinstance(raw, str):
            try:
                value = float(raw.strip())
            except ValueError:
                raise _Bad from None
        else:
            raise _Bad
        if not math.isfinite(value):
            raise _Bad
        return value
    if tp is str:
        if isinstance(raw, str):
            return raw
        raise _Bad
    if typing.get_origin(tp) is tuple:
        return _parse_tuple(raw, typing.get_args(tp))
    if tp is Any:
        return raw
    if isinstance(tp, type) and isinstance(raw, tp):
        return raw
    raise _Bad


_MAX_ITEMS = 256


def _parse_tuple(raw: Any, args: tuple[Any, ...]) -> tuple:
    """A list (or a JSON list in a string) as the tuple annotation ``args`` describes: ``(X, ...)`` any length,
    else exactly one item per type."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raise _Bad from None
    if not isinstance(raw, (list, tuple)) or len(raw) > _MAX_ITEMS:
        raise _Bad
    types_ = [args[0]] * len(raw) if len(args) == 2 and args[1] is Ellipsis else list(args)
    if len(types_) != len(raw):
        raise _Bad
    out = []
    for item, t in zip(raw, types_):
        try:
            out.append(parse_value(item, t, "item"))
        except ValueError:
            raise _Bad from None
    return tuple(out)
