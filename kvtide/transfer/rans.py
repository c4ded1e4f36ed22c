"""One rANS-coded symbol stream (PyPI ``constriction``) with its empirical model, and its bounded decoder.

Stream bytes (little-endian): ``alphabet`` u32, ``n`` u32 (symbols), ``counts`` u32[alphabet] (the model:
symbol frequencies, summing to n), then the coder's u32 words (absent when n = 0).

The native decoder allocates n symbols and decodes past the end of its data without complaint, so before it is
called the decoder checks, from the stream alone: the alphabet is the expected one, n is exactly the count the
caller's declared shape implies, the counts add up to n, and the words can hold the information the counts
claim (an ANS stream of n symbols with empirical counts c needs about sum c log2(n / c) bits; the coder's words
were seen up to 0.05% short of that on near-uniform real KV codes, so the check allows its 64-bit state plus
0.1%). Anything else is a ContainerError.
"""
from __future__ import annotations

import math
import struct

import numpy as np

from ..extras import require
from .errors import ContainerError

_HEAD = struct.Struct("<II")
_STATE_BITS = 64  # the coder's final state, flushed into the words
_SLACK_BITS = 64
_SLACK_FRACTION = 1e-3  # of the counts' information (the coder beat the empirical entropy by 0.045% on real KV)


def encode(sym: np.ndarray, alphabet: int) -> bytes:
    constriction = require("constriction", "transfer", "the ans codec")
    counts = np.bincount(sym, minlength=alphabet).astype(np.uint32)
    head = _HEAD.pack(alphabet, sym.size) + counts.tobytes()
    if sym.size == 0:
        return head
    model = constriction.stream.model.Categorical(counts / counts.sum(dtype=np.float64), perfect=False)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(sym.astype(np.int32), model)
    return head + coder.get_compressed().tobytes()


def information_bits(counts: np.ndarray) -> float:
    """Least bits any coder needs for a sequence with these symbol counts (n times its empirical entropy)."""
    c = counts[counts > 0].astype(np.float64)
    n = float(c.sum())
    return float((c * np.log2(n / c)).sum()) if n else 0.0


def decode(buf: memoryview, alphabet: int, n_expected: int) -> np.ndarray:
    """The ``n_expected`` symbols (uint8) of one stream whose symbols lie in [0, alphabet), alphabet <= 256."""
    if len(buf) < _HEAD.size:
        raise ContainerError(f"ans: stream of {len(buf)} bytes is shorter than its {_HEAD.size}-byte header")
    a, n = _HEAD.unpack_from(buf, 0)
    if a != alphabet:
        raise ContainerError(f"ans: alphabet {a}, expected {alphabet}")
    if n != n_expected:
        raise ContainerError(f"ans: stream claims {n} symbols, its declared shape holds {n_expected}")
    body = _HEAD.size + 4 * a
    if len(buf) < body or (len(buf) - body) % 4:
        raise ContainerError(f"ans: stream of {len(buf)} bytes: expected {body} + a multiple of 4")
    counts = np.frombuffer(buf, np.uint32, a, _HEAD.size)
    total = int(counts.sum(dtype=np.int64))
    if total != n:
        raise ContainerError(f"ans: symbol counts add up to {total}, the stream claims {n}")
    nwords = (len(buf) - body) // 4
    if n == 0:
        if nwords:
            raise ContainerError(f"ans: {nwords} coded words for 0 symbols")
        return np.zeros(0, np.uint8)
    need = information_bits(counts)
    if need > 32 * nwords + _STATE_BITS + _SLACK_BITS + _SLACK_FRACTION * need:
        raise ContainerError(f"ans: {nwords} words ({32 * nwords} bits) cannot hold {n} symbols of these counts "
                             f"(at least {math.ceil(need)} bits)")
    words = np.frombuffer(buf, np.uint32, nwords, body).copy()
    constriction = require("constriction", "transfer", "the ans codec")  # outside the try: not a stream error
    try:
        model = constriction.stream.model.Categorical(counts / float(total), perfect=False)
        out = constriction.stream.stack.AnsCoder(words).decode(model, n)
    except Exception as e:
        raise ContainerError(f"ans: cannot decode stream: {e}") from e
    except BaseException as e:  # a Rust panic surfaces as pyo3's PanicException, a BaseException
        if type(e).__name__ != "PanicException":
            raise
        raise ContainerError(f"ans: decoder panicked: {e}") from e
    return out.astype(np.uint8)
