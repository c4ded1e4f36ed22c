"""What a pipeline's decoder may be handed: one container entry checked against the pipeline's stages.

Runs after container.unpack (types, bounds, lengths) and before any stream is decoded, so that no stage
meets a shape it did not write: the entry is one KV tensor [layers, 2, tokens, kv_heads, head_dim] of
BF16; the streams are exactly those the transform and quantizer write (names, dtypes, code bits), side
streams and scale/minimum streams have shapes that broadcast to no more than what they scale, the bit
map has one allowed entry per (layer, K|V, head), and the Hadamard matrix a decode would build is small.
A transform that writes side streams must be listed in ``SIDE_STREAMS``.
"""
from __future__ import annotations

import math
from typing import Any, Protocol

from .container import Entry, StreamRecord
from .errors import ContainerError
from .quantizers import OUTLIER_STREAMS, Grouped, Quantizer
from .transforms import Transform


class Stages(Protocol):
    """What ``check_entry`` reads of a pipeline (``pipeline.Pipeline`` is one): its transform and quantizer."""

    transform: Transform
    quantizer: Quantizer

# transform -> {side stream: (dtype, which of K|V it covers)}; each is [layers, kv, 1, kv_heads, head_dim]
SIDE_STREAMS: dict[str, dict[str, tuple[str, int]]] = {
    "affine": {"mu": ("<f4", 2), "sd": ("<f4", 2)},
    "kscale": {"e": ("|u1", 1)},
}
MAX_HADAMARD_DIM = 1024
MAX_STREAM_VALUES = 5  # x the entry's values: codes + BF16 rest + scales and minima at g=1 + side streams at T=1
BITS = frozenset(range(0, 9)) | {16}


def check_entry(p: Stages, e: Entry) -> None:
    where = f"entry {e.key!r}" if e.key is not None else "entry"
    if e.dtype != "bfloat16":
        raise ContainerError(f"{where}: dtype {e.dtype[:40]!r}, expected 'bfloat16'")
    if len(e.shape) != 5 or e.shape[1] != 2 or min(e.shape) < 1:
        raise ContainerError(f"{where}: shape {list(e.shape)}, expected [layers, 2, tokens, kv_heads, head_dim] > 0")
    L, _, T, H, D = e.shape
    total = sum(math.prod(s.shape) for s in e.streams)
    if total > MAX_STREAM_VALUES * math.prod(e.shape):
        raise ContainerError(f"{where}: streams hold {total} values, more than {MAX_STREAM_VALUES}x its shape")
    if set(e.meta) != {"q"} or not isinstance(e.meta["q"], dict):
        raise ContainerError(f"{where}: meta keys {sorted(e.meta)[:8]}, expected {{'q': {{...}}}}")
    side = {s.name[2:]: s for s in e.streams if s.name.startswith("t.")}
    q = {s.name[2:]: s for s in e.streams if s.name.startswith("q.")}
    if len(side) + len(q) != len(e.streams):
        got = [s.name for s in e.streams][:8]
        raise ContainerError(f"{where}: stream names must start with 't.' or 'q.', got {got}")
    names = SIDE_STREAMS.get(p.transform.name, {})
    _same_names(where, "side streams", side, set(names))
    for n, (dt, kv) in names.items():
        _stream(where, side[n], dtypes=(dt,), shape=(L, kv, 1, H, D))
    if p.transform.name == "hadamard" and (D & (D - 1) or D > MAX_HADAMARD_DIM):
        raise ContainerError(f"{where}: hadamard needs a power-of-two head_dim <= {MAX_HADAMARD_DIM}, got {D}")
    qmeta = e.meta["q"]
    if not isinstance(qmeta.get("x"), bool):
        raise ContainerError(f"{where}: meta.q.x must be a bool, got {type(qmeta.get('x')).__name__}")
    if isinstance(p.quantizer, Grouped):
        _check_grouped(where, qmeta, q, L, H)
        _check_outliers(where, p.quantizer, q, L, T, H, D)
    elif p.quantizer.name == "none":  # lossless, or the BF16 bypass quantizer: the tensor as BF16 bit patterns
        if set(qmeta) != {"x"}:
            raise ContainerError(f"{where}: meta.q keys {sorted(qmeta)[:8]}, expected ['x']")
        _same_names(where, "quantizer streams", q, {"v"})
        _stream(where, q["v"], bf16=True, shape=e.shape)
    else:
        raise ContainerError(f"{where}: no layout check for quantizer {p.quantizer.name!r} (add one in layout.py)")


def _check_grouped(where: str, qmeta: dict[str, Any], q: dict[str, StreamRecord], L: int, H: int) -> None:
    if set(qmeta) != {"bm", "x"}:
        raise ContainerError(f"{where}: meta.q keys {sorted(qmeta)[:8]}, expected ['bm', 'x']")
    bm = qmeta["bm"]
    ok = isinstance(bm, list) and len(bm) == L and all(
        isinstance(r, list) and len(r) == 2 and all(
            isinstance(h, list) and len(h) == H and all(type(b) is int and b in BITS for b in h) for h in r)
        for r in bm)
    if not ok:
        raise ContainerError(f"{where}: meta.q.bm must be [{L}][2][{H}] ints in 0..8 or 16")
    want: set[str] = set()
    for kv in (0, 1):
        for b in {bm[li][kv][h] for li in range(L) for h in range(H)}:
            p = f"{kv}.{b}."
            if b in (0, 16):
                want.add(p + "k")
                continue
            want.add(p + "r")
            if p + "c" in q:
                want |= {p + "c", p + "s", p + "m"}
    want |= {n for n in OUTLIER_STREAMS if n in q}  # their presence and shapes: _check_outliers
    _same_names(where, "quantizer streams", q, want)
    for name, s in q.items():
        if name in OUTLIER_STREAMS:
            continue
        kind = name[-1]
        if kind in "kr":
            _stream(where, s, bf16=True)
        elif kind == "c":
            b = int(name.split(".")[1])
            _stream(where, s, dtypes=("|u1",), bits=b)
            sc, mn = q[name[:-1] + "s"], q[name[:-1] + "m"]
            _stream(where, sc, dtypes=("<f2", "<f4"))
            _stream(where, mn, dtypes=(sc.dtype,), shape=sc.shape)
            if len(sc.shape) != len(s.shape) or any(a not in (1, c) for a, c in zip(sc.shape, s.shape)):
                raise ContainerError(f"{where}: stream {name[:-1]}s shape {list(sc.shape)} does not broadcast to "
                                     f"its codes {list(s.shape)} without growing them")


def _check_outliers(where: str, qz: Grouped, q: dict[str, StreamRecord], L: int, T: int, H: int, D: int) -> None:
    """Residual outlier key channels: both streams present exactly when the spec asks for ``o`` > 0 of them,
    ``o`` below head_dim, indices uint8 [layers, kv_heads, o], values BF16 [layers, kv_heads, tokens, o]."""
    o = qz.o
    have = {n for n in OUTLIER_STREAMS if n in q}
    if have != (set(OUTLIER_STREAMS) if o else set()):
        raise ContainerError(f"{where}: outlier streams {sorted(have)}, expected {sorted(OUTLIER_STREAMS) if o else []}")
    if not o:
        return
    if o >= D or D > 256:
        raise ContainerError(f"{where}: {o} outlier channels need head_dim in ({o}, 256], got {D}")
    _stream(where, q[OUTLIER_STREAMS[0]], dtypes=("|u1",), shape=(L, H, o))
    _stream(where, q[OUTLIER_STREAMS[1]], bf16=True, shape=(L, H, T, o))


def _same_names(where: str, what: str, got: dict[str, StreamRecord], want: set[str]) -> None:
    if set(got) != want:
        raise ContainerError(f"{where}: {what} {sorted(got)[:12]}, expected {sorted(want)[:12]}")


def _stream(where: str, s: StreamRecord, dtypes: tuple[str, ...] = ("<u2",), shape: tuple[int, ...] | None = None,
            bits: int | None = None, bf16: bool = False) -> None:
    if bf16:
        dtypes = ("<u2",)
    if s.dtype not in dtypes or s.bits != bits or s.bf16 != bf16 or (shape is not None and s.shape != shape):
        raise ContainerError(
            f"{where}: stream {s.name!r} is {s.dtype} bits={s.bits} bf16={s.bf16} shape {list(s.shape)}, expected "
            f"{'/'.join(dtypes)} bits={bits} bf16={bf16}" + (f" shape {list(shape)}" if shape is not None else ""))
