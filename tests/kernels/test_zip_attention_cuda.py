"""CUDA ZipFusion decode kernel: its rebuild arithmetic on the CPU (constants read from the .cu source), the
kernel itself against the float64 reference on a GPU (skipped without one)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvtide.cache import zip_order
from kvtide.cache import zipblocks as zb
from kvtide.cache import zipformat as zf
from kvtide.kernels import zip_attention_cuda as zc
from kvtide.kernels import zip_attention_ref as zr

SRC = zc.SOURCE.read_text()


def _byte_perm(x: int, y: int, sel: int) -> int:
    src = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _rebuild8_from_source():
    """rebuild8 of zip_decode.cu, executed in Python: the masks and byte-permute selectors are parsed from the
    source, so an edit there that breaks the arithmetic fails here, on the CPU."""
    body = SRC[SRC.index("void rebuild8"):SRC.index("// Fragments of the two k-steps")]
    perms = re.findall(r"w\[(\d)\] = __byte_perm\((la|lb), (he|ho), (0x[0-9a-fA-F]+)\)", body)
    assert len(perms) == 4, "rebuild8 must end in four byte permutes"
    for const in ("0x07070707u", "0x80808080u", "0x01010101u", "0x08080808u"):
        assert const in body
    m = 0xFFFFFFFF

    def rebuild8(cw, la, lb, b4, z4, esc):
        de, dod = cw & 0x07070707, (cw >> 4) & 0x07070707
        he, ho = (de + b4) & m, (dod + b4) & m
        if esc:
            he = (he - (((de + 0x01010101) & 0x08080808) >> 3) * z4) & m
            ho = (ho - (((dod + 0x01010101) & 0x08080808) >> 3) * z4) & m
        he |= (cw << 4) & 0x80808080
        ho |= cw & 0x80808080
        regs = {"la": la, "lb": lb, "he": he, "ho": ho}
        return [_byte_perm(regs[a], regs[b], int(s, 16)) for _, a, b, s in sorted(perms)]

    return rebuild8


@pytest.mark.parametrize("version", [1, 2])
def test_rebuild_arithmetic_is_bit_exact(version: int) -> None:
    """Every block the format compresses, including v2 zero escapes and bases up to the top exponent."""
    rebuild8 = _rebuild8_from_source()
    gen = torch.Generator().manual_seed(version)
    seen = set()
    for trial in range(160):
        base = int(torch.randint(0, 241, (1,), generator=gen)) if trial else 240
        e = (torch.randint(0, 14 if version == 2 else 16, (512,), generator=gen) + base).clamp(max=255)
        u = (torch.randint(0, 2, (512,), generator=gen) << 15) | (e << 7) | torch.randint(0, 128, (512,), generator=gen)
        if version == 2 and trial % 2:
            u[torch.rand(512, generator=gen) < 0.2] = 0x8000 if trial % 4 == 1 else 0  # exact +-0
        bits = (u - ((u & 0x8000) << 1)).to(torch.int16)[None]
        desc = zb.analyze(bits, version)
        if int(desc[0]) == zb.RAW:
            continue
        seen.add(int(desc[0]) >> 7)
        data = torch.zeros(768, dtype=torch.uint8)
        zb.pack(bits, desc, torch.zeros(1, dtype=torch.long), data)
        w = data.view(torch.int32).numpy().view(np.uint32).astype(np.int64)
        dj = int(desc[0])
        words = []
        for grp in range(64):  # a lane's 8-value group: code word grp, low words 2 grp and 2 grp + 1
            words += rebuild8(int(w[128 + grp]), int(w[2 * grp]), int(w[2 * grp + 1]), (dj & 0x7F) * 0x01010101,
                              (dj & 0x7F) + 7, bool(dj & 0x80))
        got = np.array(words, dtype=np.uint32).view(np.uint16)
        assert np.array_equal(got, bits[0].numpy().view(np.uint16)), f"trial {trial}, descriptor {dj:#x}"
    assert seen == ({0, 1} if version == 2 else {0}), "expected plain (and, in v2, escape) blocks"


def test_plan_refuses_what_the_kernel_cannot_do() -> None:
    one = torch.tensor([0, 1], dtype=torch.int32)
    last = torch.tensor([16], dtype=torch.int32)
    with pytest.raises(ValueError, match="GQA group"):
        zc.plan(one, one[:1], last, 32, 2, 128, device="cpu")
    with pytest.raises(ValueError, match="head_dim"):
        zc.plan(one, one[:1], last, 8, 2, 96, device="cpu")
    with pytest.raises(ValueError, match="page_size 16"):
        zc.plan(one, one[:1], last, 8, 2, 128, 8, device="cpu")
    p = zc.plan(torch.tensor([0, 40], dtype=torch.int32), torch.arange(40, dtype=torch.int32), last, 8, 2, 128,
                num_splits=3, device="cpu")
    assert p.num_splits == 3 and p.pages_per_split == 14 and p.opart.shape == (1, 8, 3, 128)


def _pages(n: int, hkv: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """NHD pages whose blocks mix compressible, incompressible (outlier channel) and zero-laden ones."""
    kv = torch.randn(n, 2, 16, hkv, d, generator=gen)
    kv[:, 0] *= torch.exp(torch.randn(1, 1, hkv, d, generator=gen))  # key channel scales
    kv[::3, 0, :, :, 5] *= 3e4  # outlier channel: raw blocks
    kv[1::4, :, :, :, 9] = 0.0  # zero channel: v1 raw, v2 escape
    return kv.bfloat16()


def _mma_pool(kv: torch.Tensor, version: int):
    n, _, _, hkv, d = kv.shape
    groups = zip_order.to_stored(kv.permute(0, 3, 1, 2, 4).reshape(n, hkv, 2, 16 * d), "mma", 16, d)
    e = zf.encode_groups(groups.reshape(-1, 16 * d).contiguous(), 512, version)
    return e.data, e.starts.view(n, hkv, 2), e.desc.view(n, hkv, 2, 16 * d // 512), groups


needs_cuda = pytest.mark.skipif(zc.unsupported() is not None, reason=str(zc.unsupported()))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_kernel_matches_float64_reference(head_dim: int, group: int, version: int, splits: int | None) -> None:
    gen = torch.Generator().manual_seed(head_dim + group + version)
    hkv, lens = 2, [1, 15, 16, 17, 200, 777]
    npg = [(x + 15) // 16 for x in lens]
    kv = _pages(sum(npg) + 5, hkv, head_dim, gen).cuda()
    pool, starts, desc, groups = _mma_pool(kv, version)
    assert (desc == zb.RAW).any() and (desc != zb.RAW).any()
    perm = torch.randperm(kv.shape[0], generator=gen)[: sum(npg)].to(torch.int32).cuda()
    indptr = torch.tensor([0, *np.cumsum(npg)], dtype=torch.int32)
    last = torch.tensor([x - (n - 1) * 16 for x, n in zip(lens, npg)], dtype=torch.int32)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=gen).bfloat16().cuda()
    ref = zr.decode_attention_f64(q, kv, indptr, perm, last)
    p = zc.plan(indptr, perm, last, hkv * group, hkv, head_dim, version=version, num_splits=splits, device="cuda")
    out = torch.full_like(q, float("nan"))
    zc.run(p, q, pool, starts, desc, out=out, check=True)
    assert not out.isnan().any()
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-2, err
    raw = zc.run(p, q, *zc.raw_pool(groups.contiguous()))  # the format-free control: same kernel, same answer
    assert float((raw.double() - ref).norm() / ref.norm()) < 1e-2


def test_run_refuses_a_pool_beyond_the_kernels_reach(monkeypatch) -> None:
    """Starts travel as 32-bit counts of 16-byte units: a larger pool must be refused, never wrapped."""
    monkeypatch.setattr(zc, "MAX_POOL_BYTES", 1 << 10)
    one = torch.tensor([0, 1], dtype=torch.int32)
    p = zc.plan(one, one[:1], torch.tensor([16], dtype=torch.int32), 8, 2, 128, num_splits=1, device="cpu")
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="addresses pools up to"):
        zc.run(p, q, torch.zeros(2048, dtype=torch.uint8), torch.zeros(1, 2, 2, dtype=torch.int64),
               torch.zeros(1, 2, 2, 4, dtype=torch.uint8))
