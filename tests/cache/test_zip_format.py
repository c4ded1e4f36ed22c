"""Bit-exactness and byte arrangement of the ZipFusion format (kvtide.cache.zip_format / zip_blocks)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtide.cache import zip_blocks as zb
from kvtide.cache import zip_format as zf

ALL = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)  # every BF16 bit pattern


def bf(bits: list[int] | torch.Tensor) -> torch.Tensor:
    """BF16 tensor from unsigned 16-bit patterns."""
    t = torch.as_tensor(bits, dtype=torch.int32)
    return (t - ((t & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def exponent(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) >> 7) & 0xFF


# -- an independent scalar reference, written from the module docstring ------------------------------


def ref_block(vals: list[int], version: int) -> tuple[int, bytes]:
    """(descriptor, stored bytes) of one block of unsigned patterns, value by value."""
    es = [(v >> 7) & 0xFF for v in vals]
    b = min(es) & ~1
    if max(es) - b <= 15:
        desc, zero_code = b >> 1, False
    else:
        nz = [e for v, e in zip(vals, es) if v & 0x7FFF]
        bz = min(min(nz) & ~1, 252) if nz else 0
        if version == 2 and nz and max(nz) - bz <= 13:
            b, desc, zero_code = bz, 0x80 | (bz >> 1), True
        else:
            return 0xFF, b"".join(v.to_bytes(2, "little") for v in vals)
    n = len(vals)
    low = [0] * n
    for p in range(n):  # byte p holds value p with bits 0 and 1 swapped
        i = (p & ~3) | ((p & 1) << 1) | ((p >> 1) & 1)
        low[p] = vals[i] & 0xFF
    codes = bytearray()
    for g in range(0, n, 8):
        word = 0
        for j in range(8):
            v = vals[g + j]
            d = 7 if zero_code and not v & 0x7FFF else (es[g + j] - b) >> 1
            slot = j // 2 + 4 * (j % 2)
            word |= (((v >> 15) << 3) | d) << (4 * slot)
        codes += word.to_bytes(4, "little")
    return desc, bytes(low) + bytes(codes)


def ref_encode(bits: torch.Tensor, block_size: int, version: int) -> tuple[list[int], bytes]:
    u = (bits.reshape(-1).to(torch.int32) & 0xFFFF).tolist()
    descs, out = [], b""
    for k in range(0, len(u), block_size):
        d, blob = ref_block(u[k : k + block_size], version)
        descs.append(d)
        out += blob
    return descs, out


def check_roundtrip(x: torch.Tensor, block_size: int = 512, version: int = 1) -> zf.Encoded:
    e = zf.encode(x, block_size, version=version)
    assert e.version == version and e.data.dtype == torch.uint8
    assert same_bits(zf.decode(e), x)
    return e


# -- every bit pattern --------------------------------------------------------------------------------


def windows(lo_shift: int = 0) -> torch.Tensor:
    """All 65536 patterns grouped by exponent window [16m + lo, 16m + lo + 15], shuffled inside a window."""
    e = exponent(ALL)
    key = ((e - lo_shift) % 256) // 16
    g = torch.Generator().manual_seed(1234)
    noise = torch.rand(ALL.numel(), generator=g)
    order = torch.argsort(key.double() + noise.double())
    return ALL[order]


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("block_size", [32, 512])
def test_every_pattern_in_compressible_blocks(block_size: int, version: int) -> None:
    bits = windows()
    x = bits.view(torch.bfloat16)
    e = check_roundtrip(x, block_size, version)
    blocks = exponent(bits).view(-1, block_size)
    expect = (blocks.amin(1) & ~1) >> 1
    assert torch.equal(e.desc.view(-1).to(torch.int32), expect)  # all compressed, with the right base
    assert e.data.numel() == ALL.numel() * 3 // 2


@pytest.mark.parametrize("version", [1, 2])
def test_every_pattern_in_incompressible_blocks(version: int) -> None:
    bits = windows().view(16, 4096).t().contiguous().view(-1)  # each block spans all 16 windows
    e = check_roundtrip(bits.view(torch.bfloat16), 512, version)
    assert bool((e.desc == zb.RAW).all())
    assert torch.equal(e.data.view(torch.int16), bits)  # raw blocks are the values as stored


@pytest.mark.parametrize("version", [1, 2])
def test_every_pattern_in_order_and_odd_windows(version: int) -> None:
    check_roundtrip(ALL.view(torch.bfloat16), 512, version)  # 4 exponents per block, all compressed
    e = check_roundtrip(windows(lo_shift=1).view(torch.bfloat16), 512, version)  # odd minima: span 16
    assert e.compressed_fraction < 1.0


def test_scalar_reference_pins_the_bytes() -> None:
    g = torch.Generator().manual_seed(7)
    parts = [windows()[i * 4096 : i * 4096 + 256] for i in range(0, 16, 3)]
    zeros = bf([0, 0x8000] * 16).view(torch.int16)
    mixed = torch.cat([bf((torch.randint(0x3C00, 0x4100, (32,), generator=g))).view(torch.int16), zeros])
    mixed = mixed[torch.randperm(64, generator=g)]
    bits = torch.cat(parts + [mixed, ALL[::1024]])
    for version in (1, 2):
        e = zf.encode(bits.view(torch.bfloat16), 32, version=version)
        descs, blob = ref_encode(bits, 32, version)
        assert e.desc.view(-1).tolist() == descs
        assert bytes(e.data.tolist()) == blob
    assert any(d & 0x80 and d != 0xFF for d in ref_encode(bits, 32, 2)[0])  # v2 escape exercised


def test_orders_match_docstring() -> None:
    assert zb.low_plane_order(8).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert zb.nibble_order(16).tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    x = windows()[:512]
    e = zf.encode(x.view(torch.bfloat16), 512)
    u = x.to(torch.int32) & 0xFFFF
    assert torch.equal(e.data[:512].to(torch.int32), (u & 0xFF)[zb.low_plane_order(512)])
    codes = e.data[512:].to(torch.int32)
    nib = torch.stack([codes & 15, codes >> 4], 1).view(-1)
    d = ((u >> 7 & 0xFF) - 2 * int(e.desc[0, 0])) >> 1
    assert torch.equal(nib, (((u >> 15) << 3) | d)[zb.nibble_order(512)])


# -- adversarial blocks ---------------------------------------------------------------------------------


def block_of(bits: list[int], n: int = 512) -> torch.Tensor:
    """n values cycling through ``bits`` (each appears), as BF16."""
    return bf([bits[i % len(bits)] for i in range(n)])


def pat(sign: int, e: int, frac: int = 0x35) -> int:
    return (sign << 15) | (e << 7) | frac


ADVERSARIAL: list[tuple[str, list[int], int, int]] = [  # name, patterns, v1 descriptor, v2 descriptor
    ("nan payloads and inf", [0x7FC1, 0xFFC0, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, pat(0, 240), pat(1, 247)], 120, 120),
    ("top exponents 254/255", [0x7F7F, 0xFF00, 0x7F80, 0x7FFF], 127, 127),
    ("zeros and denormals", [0x0000, 0x8000, 0x0001, 0x807F, 0x0040, pat(0, 15), pat(1, 14)], 0, 0),
    ("span 15 even min", [pat(0, 10), pat(1, 25), pat(0, 17)], 5, 5),
    ("span 14 odd min", [pat(0, 11), pat(1, 25)], 5, 5),
    ("span 15 odd min", [pat(0, 11), pat(1, 26)], 0xFF, 0xFF),
    ("span 16", [pat(0, 10), pat(1, 26)], 0xFF, 0xFF),
    ("span 17", [pat(0, 10), pat(1, 27)], 0xFF, 0xFF),
    ("all equal one", [0x3F80], 0x3F80 >> 8, 0x3F80 >> 8),
    ("all +0", [0x0000], 0, 0),
    ("all -0", [0x8000], 0, 0),
    ("all nan", [0xFFFF], 127, 127),
    ("zeros with span 13", [0x0000, 0x8000, pat(0, 100), pat(1, 113)], 0xFF, 0x80 | 50),
    ("zeros with span 13 odd min", [0x8000, pat(0, 101), pat(1, 113)], 0xFF, 0x80 | 50),
    ("zeros with span 14", [0x0000, pat(0, 100), pat(1, 114)], 0xFF, 0xFF),
    ("zeros and infinities", [0x0000, 0x8000, 0x7F80, 0xFFC3, pat(0, 253)], 0xFF, 0x80 | 126),
    ("zeros with exponents 254/255 only", [0x0000, 0x8000, 0x7F80, 0xFFC3, 0x7F00], 0xFF, 0x80 | 126),
    ("zeros, denormal and large", [0x0000, 0x0001, pat(0, 100)], 0xFF, 0xFF),
    ("one zero among few exponents", [0x8000] + [pat(1, 120, f) for f in range(127)], 0xFF, 0x80 | 60),
]


@pytest.mark.parametrize("name,patterns,d1,d2", ADVERSARIAL, ids=[a[0] for a in ADVERSARIAL])
@pytest.mark.parametrize("block_size", [32, 512])
def test_adversarial_block(name: str, patterns: list[int], d1: int, d2: int, block_size: int) -> None:
    patterns = patterns[:block_size]
    x = block_of(patterns, 2 * block_size).view(2, block_size)
    x[1] = x[1].flip(0)
    for version, want in ((1, d1), (2, d2)):
        e = check_roundtrip(x, block_size, version)
        assert e.desc.view(-1).tolist() == [want, want], (version, e.desc)


def test_v2_keeps_v1_blocks_and_helps_zero_blocks() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=g).bfloat16()
    x.view(-1)[torch.randperm(x.numel(), generator=g)[: x.numel() // 50]] = 0.0
    x[:8] = torch.randn(8, 512, generator=g).bfloat16()  # zero-free blocks
    v1, v2 = zf.encode(x, version=1), zf.encode(x, version=2)
    same = v1.desc != zb.RAW
    assert torch.equal(v1.desc[same], v2.desc[same])  # v1-compressible blocks are coded as v1
    assert v2.compressed_fraction > v1.compressed_fraction and v2.nbytes < v1.nbytes
    assert same_bits(zf.decode(v2), x)


# -- the kernel's register rebuild ----------------------------------------------------------------------


def escape_blocks() -> torch.Tensor:
    """[65536, 32] patterns: block p holds pattern p, +0, -0 and 29 values over a 14-exponent window."""
    e = exponent(ALL)
    b = torch.clamp(e & ~1, max=242)[:, None]
    k = torch.arange(29)
    fill = ((k & 1) << 15) | ((b + k % 14) << 7) | (k * 5 % 128)
    zeros = torch.tensor([0x0000, 0x8000]).expand(ALL.numel(), 2)
    u = torch.cat([(ALL.to(torch.int32) & 0xFFFF)[:, None], zeros, fill], 1)
    return bf(u).view(torch.int16)


def test_every_pattern_in_escape_blocks() -> None:
    bits = escape_blocks()
    e1 = check_roundtrip(bits.view(torch.bfloat16), 32, 1)
    e2 = check_roundtrip(bits.view(torch.bfloat16), 32, 2)
    assert bool((e2.desc != zb.RAW).all())  # v2 compresses every block
    assert e1.compressed_fraction < 0.05 and float(((e2.desc & zb.ESCAPE) != 0).float().mean()) > 0.95


@pytest.mark.parametrize("version", [1, 2])
def test_rebuild_words_matches_raw_words(version: int) -> None:
    blocks = windows().view(-1, 512) if version == 1 else escape_blocks()
    desc = zb.analyze(blocks, version)
    comp = desc != zb.RAW
    assert bool(comp.all())
    if version == 2:
        assert bool(((desc & zb.ESCAPE) != 0).any())
    blob = zb._encode_compressed(zb._u32(blocks), desc)
    assert torch.equal(zb.rebuild_words(blob, desc), blocks.contiguous().view(torch.int32))


# -- groups, placement, accounting, hypothesis ----------------------------------------------------------


def test_groups_and_custom_placement() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 1024, generator=g).bfloat16()
    x[2] *= torch.logspace(-20, 20, 1024).bfloat16()  # incompressible group
    e = zf.encode_groups(x)
    assert e.shape == (6, 1024) and e.desc.shape == (6, 2)
    assert same_bits(zf.decode_groups(e), x)
    for k in range(6):  # groups are independent: packed = concatenation of single-group encodings
        one = zf.encode(x[k])
        start = int(e.starts[k])
        assert torch.equal(e.data[start : start + one.data.numel()], one.data)
    # place groups in a cache-like pool with gaps, untouched bytes stay as they were
    starts = torch.arange(6, dtype=torch.int64) * 4096 + 64
    offs = zb.offsets_from_starts(starts, e.desc, 512)
    pool = torch.full((6 * 4096 + 64,), 0xAA, dtype=torch.uint8)
    zb.pack(x.view(torch.int16).view(-1, 512), e.desc.view(-1), offs.view(-1), pool)
    back = zb.unpack(pool, e.desc.view(-1), offs.view(-1), 512)
    assert torch.equal(back.view(6, 1024), x.view(torch.int16))
    assert bool((pool[:64] == 0xAA).all()) and int(pool[4096 + 64 - 1]) == 0xAA
    moved = zf.Encoded(pool, starts, e.desc, e.shape, 512)
    assert same_bits(zf.decode(moved), x)


def test_nbytes_accounting() -> None:
    # exponents within 2 of each other: always compressible (randn could, rarely, span more than 16)
    good = (torch.rand(512, generator=torch.Generator().manual_seed(0)) * 3 + 0.5).bfloat16()
    bad = bf([pat(0, 10), pat(1, 30)] * 256)
    x = torch.stack([good, bad, good, good])
    e = zf.encode(x)
    assert e.desc.view(-1).tolist()[1] == zb.RAW and e.compressed_fraction == 0.75
    assert e.data.numel() == 3 * 768 + 1024
    assert e.nbytes == 3 * 768 + 1024 + 8 + 4 + zf.HEADER_NBYTES
    assert e.raw_nbytes == 4 * 1024
    assert e.header() == bytes([1, 0, 0, 0]) + (512).to_bytes(4, "little")
    g = zf.encode_groups(x.view(2, 1024), version=2)
    assert g.nbytes == g.data.numel() + 2 * 8 + 4 + zf.HEADER_NBYTES and g.header()[0] == 2
    empty = zf.encode(torch.empty(0, dtype=torch.bfloat16))
    assert empty.data.numel() == 0 and zf.decode(empty).shape == (0,)


@st.composite
def kv_like(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    """A tensor of 1-4 blocks, each drawn around a window of exponents with zeros/specials mixed in."""
    block_size = draw(st.sampled_from([32, 64]))
    vals: list[int] = []
    for _ in range(draw(st.integers(1, 4))):
        lo = draw(st.integers(0, 255))
        span = draw(st.integers(0, 20))
        specials = st.sampled_from([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x807F])
        one = st.one_of(
            st.builds(pat, st.integers(0, 1), st.integers(lo, min(255, lo + span)), st.integers(0, 127)),
            specials,
            st.integers(0, 0xFFFF),
        )
        weights = draw(st.sampled_from(["window", "mixed", "wild"]))
        if weights == "window":
            one = st.builds(pat, st.integers(0, 1), st.integers(lo, min(255, lo + span)), st.integers(0, 127))
        elif weights == "mixed":
            one = st.one_of(one, specials)
        vals += draw(st.lists(one, min_size=block_size, max_size=block_size))
    shape = draw(st.sampled_from([(len(vals),), (len(vals) // 8, 8), (2, len(vals) // 16, 8)]))
    return bf(vals).view(shape), block_size


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv_like(), st.sampled_from([1, 2]))
def test_hypothesis_roundtrip(case: tuple[torch.Tensor, int], version: int) -> None:
    x, block_size = case
    e = check_roundtrip(x, block_size, version)
    descs, blob = ref_encode(x.view(torch.int16), block_size, version)
    assert e.desc.view(-1).tolist() == descs
    assert bytes(e.data.tolist()) == blob
    raw = sum(d == zb.RAW for d in descs)
    assert e.data.numel() == raw * 2 * block_size + (len(descs) - raw) * block_size * 3 // 2


# -- refusals -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int16, torch.uint8])
def test_refuses_other_dtypes(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="bfloat16"):
        zf.encode(torch.zeros(512, dtype=dtype))


def test_refusals() -> None:
    x = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        zf.encode(x.t())
    with pytest.raises(ValueError, match="multiple of block_size"):
        zf.encode(torch.zeros(500, dtype=torch.bfloat16))
    for bad in (0, 48, -32, 100):
        with pytest.raises(ValueError, match="block_size"):
            zf.encode(x, bad)
    with pytest.raises(TypeError, match="block_size"):
        zf.encode(x, 512.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Tensor"):
        zf.encode([1.0] * 512)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version"):
        zf.encode(x, version=3)
    with pytest.raises(ValueError, match="2-D"):
        zf.encode_groups(x.view(-1))


def test_decode_refuses_inconsistent_metadata() -> None:
    # magnitudes in [1, 2) (one exponent) with exact zeros: every block compresses only through v2's escape (a bare
    # randn from the global generator left that to the test order)
    g = torch.Generator().manual_seed(3)
    x = ((1 + torch.rand(1024, generator=g)) * torch.randn(1024, generator=g).sign()).bfloat16()
    x[::3] = 0
    e = zf.encode(x, version=2)
    assert bool(((e.desc & zb.ESCAPE) != 0).any())
    with pytest.raises(ValueError, match="version-2"):
        zf.decode(zf.Encoded(e.data, e.starts, e.desc, e.shape, 512, version=1))
    with pytest.raises(ValueError, match="does not match"):
        zf.decode(zf.Encoded(e.data, e.starts, e.desc, (2048,), 512, version=2))
    with pytest.raises(ValueError, match="outside"):
        zf.decode(zf.Encoded(e.data[:-16], e.starts, e.desc, e.shape, 512, version=2))
    with pytest.raises(ValueError, match="version"):
        zf.decode(zf.Encoded(e.data, e.starts, e.desc, e.shape, 512, version=9))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    x = windows().view(torch.bfloat16).view(-1, 4096)
    for version in (1, 2):
        cpu, gpu = zf.encode_groups(x, version=version), zf.encode_groups(x.cuda(), version=version)
        assert torch.equal(gpu.data.cpu(), cpu.data) and torch.equal(gpu.desc.cpu(), cpu.desc)
        assert same_bits(zf.decode(gpu).cpu(), x)
