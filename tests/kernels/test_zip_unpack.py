"""Triton ZipFusion unpack == torch reference, bit for bit (Triton interpreter on CPU, small shapes)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first kernel launch (kernels are built lazily)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kvtide.cache import zip_blocks as zb  # noqa: E402
from kvtide.cache import zip_format as zf  # noqa: E402
from kvtide.kernels import zip_unpack as zu  # noqa: E402
from tests.kernels.test_zip_encode import ALL, SPECIAL_BLOCKS, kv_groups  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def offsets(e: zf.Encoded) -> torch.Tensor:
    return zb.offsets_from_starts(e.starts, e.desc, e.block_size)


@pytest.mark.parametrize("version", [1, 2])
def test_every_bf16_pattern(version: int) -> None:
    """All 65,536 patterns, in order (compressed blocks) and shuffled (raw blocks): NaN, Inf, zeros, denormals."""
    shuffled = ALL[torch.randperm(ALL.numel(), generator=torch.Generator().manual_seed(2))]
    for bits in (ALL, shuffled):
        x = bits.view(torch.bfloat16).view(32, 2048).to(DEV)
        e = zf.encode_groups(x, 512, version)
        got = zu.unpack(e.data, e.desc, offsets(e), 512)
        assert torch.equal(got.view(-1).cpu(), bits)
        assert torch.equal(got, zu.reference(e.data, e.desc, offsets(e), 512))


@pytest.mark.parametrize("version", [1, 2])
def test_mixed_blocks_and_special_values(version: int) -> None:
    x = kv_groups(3, 256, seed=5 + version)
    e = zf.encode_groups(x, 64, version)
    assert bool((e.desc == zb.RAW).any()) and bool((e.desc != zb.RAW).any())
    assert torch.equal(zu.unpack(e.data, e.desc, offsets(e), 64).view(3, 256), x.view(torch.int16))
    rows = [[p[i % len(p)] for i in range(32)] for p in SPECIAL_BLOCKS]
    u = torch.tensor(rows, dtype=torch.int32)
    s = (u - ((u & 0x8000) << 1)).to(torch.int16).to(DEV)
    e = zf.encode_groups(s.view(torch.bfloat16).view(1, -1), 32, version)
    assert torch.equal(zu.unpack(e.data, e.desc, offsets(e), 32).view(-1), s.view(-1))


def test_blocks_at_any_placement_into_a_given_buffer() -> None:
    """Offsets the caller computed (a fetch's staging buffer), output written into the caller's buffer."""
    x = kv_groups(2, 256, seed=9)
    desc = zb.analyze(x.view(torch.int16).view(-1, 64), 1).view(2, 4)
    offs = zb.offsets_from_starts(torch.tensor([48, 2048], device=DEV), desc, 64)
    buf = torch.full((4096,), 0x5A, dtype=torch.uint8, device=DEV)
    zb.pack(x.view(torch.int16).view(-1, 64), desc.view(-1), offs.view(-1), buf)
    out = torch.zeros(512, dtype=torch.int16, device=DEV)
    got = zu.unpack(buf, desc, offs, 64, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out.view(2, 256), x.view(torch.int16))


def test_refusals() -> None:
    d = torch.zeros(4, dtype=torch.uint8, device=DEV)
    data = torch.zeros(4096, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="one offset per descriptor"):
        zu.unpack(data, d, torch.zeros(3, dtype=torch.int64), 64)
    with pytest.raises(ValueError, match="power of two"):
        zu.unpack(data, d, torch.zeros(4, dtype=torch.int64), 96)
    with pytest.raises(ValueError, match="out must be"):
        zu.unpack(data, d, torch.zeros(4, dtype=torch.int64), 64, out=torch.zeros(10, dtype=torch.int16))
    with pytest.raises(ValueError, match="multiple of 16"):
        zu.unpack(data[:100], d, torch.zeros(4, dtype=torch.int64), 64)
