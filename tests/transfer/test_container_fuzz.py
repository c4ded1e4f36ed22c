"""Bounded fuzzing of valid containers for every codec: byte flips and truncations (with the checksum left
alone, and recomputed so the damage reaches the parsers), and random edits of header values. The only
outcomes allowed: ContainerError, or (checksum recomputed) a well-formed decode of the declared shape."""
from __future__ import annotations

import json
import time
import zlib

import numpy as np
import pytest
import torch

from kvtide.transfer import ContainerError, Pipeline, decode
from transfer_blobs import join, kv, reseal, split

SPECS = ["none|none|none", "none|none|pack", "none|none|zstd", "none|none|lz4", "none|none|ans", "none|none|zipf",
         "affine|uniform:k=3,v=5,g=16|ans", "hadamard|kivi:k=2,v=4,r=8|zstd", "delta|layer:b=8/2,g=16|lz4",
         "none|mixhq:hi=6,lo=0,sink=2,win=8|pack", "none|uniform:k=4,v=4|zipf",
         "kscale|uniform:k=3,v=3,g=16,o=2|ans", "hadamard:on=k|kivi:k=2,v=4,r=8,o=3|zstd"]
SCORES = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
N_FLIPS, N_CUTS, N_EDITS = 100, 20, 100
TIME_LIMIT_S = 20.0


def _outcome(blob: bytes, shape: tuple[int, ...]) -> str:
    """'error' or 'ok'; anything other than a ContainerError or a well-formed result fails the test."""
    try:
        y = decode(blob)
    except ContainerError:
        return "error"
    ts = y.values() if isinstance(y, dict) else [y]
    for t in ts:
        assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.dim() == 5
        assert t.numel() <= 5 * int(np.prod(shape))
    return "ok"


def _mutate_value(rng: np.random.Generator) -> object:
    pool = [-1, 0, 1, 2, 3, 17, 2**31, 2**64, 10**30, 1.5, float("inf"), float("nan"), True, None, "x", "<u2",
            "|u1", [], {}, [1] * 9, [[[[0]]]], [0, 2, 1, 1, 1], {"x": True}]
    return pool[int(rng.integers(len(pool)))]


def _edit_random_value(h: object, rng: np.random.Generator) -> None:
    """Replace one randomly chosen value somewhere in the header tree."""
    slots = []

    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                slots.append((o, k))
                walk(v)
        elif isinstance(o, list):
            for i, v in enumerate(o):
                slots.append((o, i))
                walk(v)
    walk(h)
    obj, k = slots[int(rng.integers(len(slots)))]
    obj[k] = _mutate_value(rng)


@pytest.mark.parametrize("spec", SPECS)
def test_fuzzed_containers_fail_cleanly(spec):
    if "zipf" in spec:
        pytest.importorskip("kvtide.cache.zip_format")
    rng = np.random.default_rng(zlib.crc32(spec.encode()))
    x = kv(3, t=20)
    p = Pipeline(spec, head_scores=SCORES)
    blob = p.encode(x)
    assert torch.equal(decode(blob).view(torch.int16), p.decode(blob).view(torch.int16))
    t0 = time.monotonic()
    seen = {"error": 0, "ok": 0}
    for _ in range(N_FLIPS):
        b = bytearray(blob)
        pos = int(rng.integers(len(b)))
        b[pos] ^= 1 << int(rng.integers(8))
        with pytest.raises(ContainerError):  # the checksum catches every single flip
            decode(bytes(b))
        seen[_outcome(reseal(b), x.shape)] += 1
    for _ in range(N_CUTS):
        cut = int(rng.integers(1, len(blob)))
        with pytest.raises(ContainerError):
            decode(blob[:cut])
        if cut > 4:
            seen[_outcome(reseal(blob[:cut]), x.shape)] += 1
    header, payload = split(blob)
    for _ in range(N_EDITS):
        h = json.loads(json.dumps(header))
        _edit_random_value(h, rng)
        seen[_outcome(join(json.dumps(h).encode(), payload), x.shape)] += 1
    assert seen["error"] > 0
    assert time.monotonic() - t0 < TIME_LIMIT_S
