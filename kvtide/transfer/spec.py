"""Spec strings for compression pipelines.

Grammar (whitespace around tokens is ignored)::

    spec   := stage "|" stage "|" stage        # transform | quantizer | codec
    stage  := name [ ":" param { "," param } ]
    param  := key "=" value
    value  := atom { "/" atom }                 # a "/"-list, e.g. b=8/4/2
    atom   := int | float | word                # word: [A-Za-z_][A-Za-z0-9_.-]*
    name, key := [a-z][a-z0-9_]*
    (an atom is at most 64 characters)

Example: ``hadamard|kivi:k=2,v=2,g=32,r=32|zstd:l=3``. The canonical form (``format_spec``) lists
parameters in the stage's declared order and omits defaults, so equal pipelines have equal specs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import SpecError

Atom = int | float | str
Value = Atom | tuple[Atom, ...]

_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
_INT = re.compile(r"[+-]?\d+\Z")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?\Z")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")


@dataclass(frozen=True)
class StageSpec:
    """One parsed stage: a registry name and its parameters in written order."""

    name: str
    params: tuple[tuple[str, Value], ...] = ()

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise SpecError(f"bad stage name {self.name!r}")
        keys = [k for k, _ in self.params]
        if len(set(keys)) != len(keys):
            raise SpecError(f"stage {self.name!r}: repeated parameter in {keys}")

    def as_dict(self) -> dict[str, Value]:
        return dict(self.params)


_MAX_ATOM = 64  # characters; also keeps int() far from its digit limit


def _parse_atom(text: str) -> Atom:
    t = text.strip()
    if len(t) > _MAX_ATOM:
        raise SpecError(f"value {t[:20]!r}... is longer than {_MAX_ATOM} characters")
    if _INT.match(t):
        return int(t)
    if _FLOAT.match(t):
        return float(t)
    if _WORD.match(t):
        return t
    raise SpecError(f"bad value {text!r}")


def _format_atom(a: Atom) -> str:
    if isinstance(a, bool):
        return str(int(a))
    if isinstance(a, float):
        r = repr(a)
        return r if not r.endswith(".0") else r[:-2] + ".0"
    if isinstance(a, int):
        return str(a)
    if not _WORD.match(a):
        raise SpecError(f"value {a!r} cannot be written in a spec")
    return a


def parse_stage(text: str) -> StageSpec:
    name, _, rest = text.strip().partition(":")
    name = name.strip()
    params: list[tuple[str, Value]] = []
    if rest.strip():
        for part in rest.split(","):
            key, eq, val = part.partition("=")
            key = key.strip()
            if not eq or not _NAME.match(key):
                raise SpecError(f"stage {name!r}: bad parameter {part.strip()!r} (want key=value)")
            atoms = tuple(_parse_atom(v) for v in val.split("/"))
            params.append((key, atoms if len(atoms) > 1 else atoms[0]))
    elif _ != "" and not rest.strip():
        raise SpecError(f"stage {name!r}: ':' with no parameters")
    return StageSpec(name, tuple(params))


def format_stage(stage: StageSpec) -> str:
    if not stage.params:
        return stage.name
    parts = []
    for k, v in stage.params:
        vs = "/".join(_format_atom(a) for a in v) if isinstance(v, tuple) else _format_atom(v)
        parts.append(f"{k}={vs}")
    return f"{stage.name}:{','.join(parts)}"


def parse_spec(text: str) -> tuple[StageSpec, StageSpec, StageSpec]:
    """Split a spec into its three stages; structure only, parameters are checked by the stages."""
    if not isinstance(text, str):
        raise SpecError(f"spec must be a str, got {type(text).__name__}")
    parts = text.split("|")
    if len(parts) != 3:
        raise SpecError(f"spec {text!r} must have 3 stages 'transform|quantizer|codec', got {len(parts)}")
    t, q, c = (parse_stage(p) for p in parts)
    return t, q, c


def format_spec(stages: tuple[StageSpec, StageSpec, StageSpec]) -> str:
    return "|".join(format_stage(s) for s in stages)
