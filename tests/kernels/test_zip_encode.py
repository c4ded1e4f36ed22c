"""Triton ZipFusion encode == torch reference, byte for byte (Triton interpreter on CPU, small shapes)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first kernel launch (kernels are built lazily)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kvtide.cache import zip_blocks as zb  # noqa: E402
from kvtide.cache import zip_format as zf  # noqa: E402
from kvtide.kernels import zip_encode as ze  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ALL = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)


def assert_same(a: zf.Encoded, b: zf.Encoded) -> None:
    assert torch.equal(a.desc.cpu(), b.desc.cpu())
    assert torch.equal(a.starts.cpu(), b.starts.cpu())
    assert torch.equal(a.data.cpu(), b.data.cpu())
    assert (a.shape, a.block_size, a.version, a.nbytes) == (b.shape, b.block_size, b.version, b.nbytes)


def kv_groups(g: int, n: int, seed: int) -> torch.Tensor:
    """Groups with compressible, zero-holding, wide-range and special-valued blocks."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(g, n, generator=gen).bfloat16()
    x.view(-1)[torch.randperm(g * n, generator=gen)[: g * n // 20]] = 0.0
    x.view(-1)[torch.randperm(g * n, generator=gen)[: g * n // 40]] = -0.0
    x[0, : n // 2] = torch.randn(n // 2, generator=gen).bfloat16()  # zero-free
    x[-1] *= torch.logspace(-30, 30, n).bfloat16()  # wide range: raw
    x[g // 2, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40]).bfloat16()
    return x.to(DEV)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("g,n,block_size", [(3, 128, 32), (2, 256, 64), (2, 1024, 512)])
def test_triton_encode_matches_reference(g: int, n: int, block_size: int, version: int) -> None:
    x = kv_groups(g, n, seed=g * n + version)
    got = ze.encode_groups(x, block_size, version)
    ref = ze.reference(x, block_size, version)
    assert bool((ref.desc == zb.RAW).any()) and bool((ref.desc != zb.RAW).any())
    assert_same(got, ref)
    assert torch.equal(zf.decode(got).view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("version", [1, 2])
def test_triton_every_pattern(version: int) -> None:
    x = ALL.view(torch.bfloat16).view(32, 2048).to(DEV)  # 4 exponents per block: all compressed
    shuffled = ALL[torch.randperm(ALL.numel(), generator=torch.Generator().manual_seed(1))]
    for t in (x, shuffled.view(torch.bfloat16).view(32, 2048).to(DEV)):  # and all raw
        assert_same(ze.encode_groups(t, 512, version), ze.reference(t, 512, version))


SPECIAL_BLOCKS = [  # unsigned patterns cycled over a block; each hits one edge of analyze/pack
    [0x0000, 0x8000, 0x7F80, 0xFFC3, 0x7F00],  # zeros + exponents 254/255 only: v2 base clamps to 252
    [0x0000, 0x8000, 0x3200, 0xB8FF],  # zeros + span 13 (v2 escape)
    [0x0000, 0x3200, 0x3900],  # zeros + span 14 (raw)
    [0x0500, 0x8C80],  # span 15 from even minimum (compressed)
    [0x0580, 0x8D00],  # span 15 from odd minimum (raw)
    [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x7800],  # NaN payloads, infinities
    [0x0001, 0x807F, 0x0000, 0x8000, 0x0780],  # denormals and zeros
    [0x3F80],  # all equal
]


@pytest.mark.parametrize("version", [1, 2])
def test_triton_special_blocks(version: int) -> None:
    rows = [[p[i % len(p)] for i in range(32)] for p in SPECIAL_BLOCKS]
    u = torch.tensor(rows, dtype=torch.int32)
    x = (u - ((u & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16).view(4, 64).to(DEV)
    ref = ze.reference(x, 32, version)
    assert_same(ze.encode_groups(x, 32, version), ref)
    want = [0x80 | 126, 0x80 | 50, 0xFF, 5, 0xFF, 120, 0, 63] if version == 2 else [0xFF, 0xFF, 0xFF, 5, 0xFF, 120, 0, 63]
    assert ref.desc.view(-1).tolist() == want


def test_triton_pack_at_given_offsets() -> None:
    x = kv_groups(2, 128, seed=11)
    desc = ze.analyze(x, 32, version=2)
    assert torch.equal(desc, zb.analyze(x.view(torch.int16).view(-1, 32), 2).view(2, 4))
    starts = torch.tensor([32, 512], device=DEV)
    offs = zb.offsets_from_starts(starts, desc, 32)
    pool = torch.full((1024,), 0xAA, dtype=torch.uint8, device=DEV)
    ref = pool.clone()
    ze.pack(x, desc, offs, pool, 32)
    zb.pack(x.view(torch.int16).view(-1, 32), desc.view(-1), offs.view(-1), ref)
    assert torch.equal(pool, ref) and int(pool[0]) == 0xAA
    unchecked = torch.full_like(pool, 0xAA)  # check=False (offsets checked by the caller): the same bytes
    ze.pack(x, desc, offs, unchecked, 32, check=False)
    assert torch.equal(unchecked, ref)
    with pytest.raises(ValueError, match="outside"):
        ze.pack(x, desc, offs + 512, pool, 32)
    with pytest.raises(TypeError, match="uint8"):
        ze.pack(x, desc, offs, pool.view(torch.int16), 32, check=False)


def test_triton_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2, 192, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="power-of-two"):
        ze.encode_groups(x, 96)
    with pytest.raises(TypeError, match="bfloat16"):
        ze.encode_groups(x.float(), 64)
    with pytest.raises(ValueError, match="2-D"):
        ze.encode_groups(x.view(-1), 64)
    with pytest.raises(ValueError, match="offset"):
        ze.pack(x, torch.zeros(6, dtype=torch.uint8), torch.zeros(5, dtype=torch.int64), torch.zeros(4096, dtype=torch.uint8), 64)
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            ze.analyze(x, 64)
