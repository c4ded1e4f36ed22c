"""Triton decode attention over ZipFusion and raw pages == float64 reference (interpreter on CPU, small shapes)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first kernel launch (kernels are built lazily)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kvtide.cache import zip_blocks as zb  # noqa: E402
from kvtide.kernels import zip_attention as za  # noqa: E402
from kvtide.kernels import zip_attention_ref as zr  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PS = 16


def real_like_kv(pages: int, hkv: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """NHD pages with KV-like statistics: outlier key channels, exact zeros, a few wide-range blocks."""
    chan = torch.exp(torch.randn(hkv, d, generator=gen) * 0.8)
    chan[:, :: max(1, d // 8)] *= 8.0  # a few large key channels, as RoPE'd keys have
    kv = torch.randn(pages, 2, PS, hkv, d, generator=gen)
    kv[:, 0] *= chan
    kv[:, 1] *= 0.3
    flat = kv.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[: flat.numel() // 200]] = 0.0  # v1 refuses, v2 escapes
    kv[0, 0, :4] *= 1e-6  # wide exponent range in one block: raw under both versions
    return kv.bfloat16()


def make_batch(lens: list[int], hkv: int, group: int, d: int, seed: int, realistic: bool):
    gen = torch.Generator().manual_seed(seed)
    npg = [-(-n // PS) for n in lens]
    total = sum(npg) + 2  # two pages no sequence uses
    if realistic:
        kv = real_like_kv(total, hkv, d, gen)
    else:
        kv = torch.randn(total, 2, PS, hkv, d, generator=gen).bfloat16()
    indices = torch.randperm(total, generator=gen)[: sum(npg)].to(torch.int32)  # scattered pages
    indptr = torch.tensor([0, *torch.tensor(npg).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * PS for n, p in zip(lens, npg)], dtype=torch.int32)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).bfloat16()
    return kv.to(DEV), q.to(DEV), indptr, indices.to(DEV), last


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


CASES = [  # (lens, hkv, group, head_dim, version, num_splits, tile, realistic)
    ([37, 16, 70], 1, 1, 64, 1, 1, 32, True),
    ([50, 9], 2, 2, 64, 2, 2, 32, True),
    ([33, 75], 1, 3, 128, 1, 3, 16, True),
    ([64, 17], 2, 4, 128, 2, 1, 64, True),
    ([90], 1, 8, 64, 1, 2, 16, False),
    ([23, 41], 1, 8, 128, 2, None, 32, False),
]


@pytest.mark.parametrize("lens,hkv,group,d,version,splits,tile,realistic", CASES)
def test_zip_and_raw_match_float64(lens, hkv, group, d, version, splits, tile, realistic) -> None:
    kv, q, indptr, indices, last = make_batch(lens, hkv, group, d, seed=sum(lens) + d + group, realistic=realistic)
    pool, gstart, gdesc = zr.encode_pages(kv, 512, version, slack=1 if realistic else 0)
    comp = (gdesc != zb.RAW).float().mean()
    assert 0.0 < comp < 1.0 or not realistic  # mixed raw / compressed blocks
    if version == 2 and realistic:
        assert bool(((gdesc & zb.ESCAPE) != 0).logical_and(gdesc != zb.RAW).any())  # escape blocks present
    ref = zr.decode_attention_f64(q, kv, indptr, indices, last)
    p = za.plan(indptr, indices, last, hkv * group, hkv, d, PS, version=version, num_splits=splits, tile=tile)
    if splits is not None:
        assert p.num_splits == min(splits, max(-(-n // PS) for n in lens))
    for run in ("zip", "raw"):
        out = torch.full_like(q, float("nan"))  # poison: every element must be written
        if run == "zip":
            za.run_zip(p, q, pool, gstart, gdesc, out=out, check=True)
        else:
            za.run_raw(p, q, kv, out=out)
        assert not bool(out.isnan().any()), f"{run}: unwritten or NaN output"
        err = rel_err(out, ref)
        assert err < 1e-2, f"{run}: relative error {err:.2e}"
        if run == "zip":
            zip_out = out
    # same values, same tiles; only the fp32 summation grouping may differ
    assert rel_err(zip_out, out.double()) < 5e-3


@pytest.mark.parametrize("mode,prefetch,trans,late_v,pipe,tile", [
    (0, False, False, False, False, 64), (1, True, False, False, False, 64), (1, False, False, True, False, 64),
    (2, True, False, False, False, 64), (0, True, True, False, False, 64), (1, False, True, True, False, 64),
    (2, False, True, True, False, 64), (1, False, True, False, False, 64),
    # pipe: metadata per row, tile // 16 pages per step (a step may straddle the end of a split)
    (1, False, True, False, True, 16), (1, False, True, True, True, 32), (0, False, True, False, True, 32),
    (2, False, False, False, True, 64)])
def test_kernel_variants_match_float64(mode: int, prefetch: bool, trans: bool, late_v: bool, pipe: bool,
                                       tile: int) -> None:
    """Every load/rebuild variant of the zip kernel (the benchmark tunes over them) is correct, v1 and v2."""
    for version in (1, 2):
        kv, q, indptr, indices, last = make_batch([45, 70], 2, 4, 128, seed=11 + mode, realistic=True)
        pool, gstart, gdesc = zr.encode_pages(kv, 512, version, slack=1)
        ref = zr.decode_attention_f64(q, kv, indptr, indices, last)
        p = za.plan(indptr, indices, last, 8, 2, 128, PS, version=version, num_splits=2, mode=mode, prefetch=prefetch,
                    trans=trans, late_v=late_v, pipe=pipe, tile=tile)
        out = za.run_zip(p, q, pool, gstart, gdesc, out=torch.full_like(q, float("nan")))
        assert not bool(out.isnan().any())
        assert rel_err(out, ref) < 1e-2


def test_lazy_rescale_when_scores_grow() -> None:
    """Scores that climb by far more than 2^8 along the sequence take the rescale branch again and again."""
    kv, q, indptr, indices, last = make_batch([150], 1, 4, 64, seed=5, realistic=False)
    pages = indices.long()
    ramp = torch.linspace(0.1, 40.0, pages.numel(), device=kv.device).view(-1, 1, 1, 1)
    kv[pages, 0] = (kv[pages, 0].float() * 0.05 + ramp * q[0, 0].float().sign().view(1, 1, 1, -1)).bfloat16()
    pool, gstart, gdesc = zr.encode_pages(kv)
    ref = zr.decode_attention_f64(q, kv, indptr, indices, last)
    for run in ("zip", "zip-pipe", "raw"):
        p = za.plan(indptr, indices, last, 4, 1, 64, PS, num_splits=1, tile=32 if run == "zip-pipe" else 16,
                    pipe=run == "zip-pipe")
        out = za.run_raw(p, q, kv) if run == "raw" else za.run_zip(p, q, pool, gstart, gdesc)
        assert rel_err(out, ref) < 1e-2, run


def test_split_matches_unsplit() -> None:
    kv, q, indptr, indices, last = make_batch([100, 40], 1, 4, 64, seed=7, realistic=True)
    pool, gstart, gdesc = zr.encode_pages(kv)
    ref = zr.decode_attention_f64(q, kv, indptr, indices, last)
    outs = [za.run_zip(za.plan(indptr, indices, last, 4, 1, 64, PS, num_splits=s, tile=16), q, pool, gstart, gdesc)
            for s in (1, 4)]
    for o in outs:
        assert rel_err(o, ref) < 1e-2
    assert rel_err(outs[0], outs[1].double()) < 1e-2


@pytest.mark.parametrize("version", [1, 2])
def test_decompress_pages_bit_exact(version: int) -> None:
    kv, *_ = make_batch([40], 2, 1, 64, seed=3, realistic=True)
    pool, gstart, gdesc = zr.encode_pages(kv, 512, version)
    out = za.decompress_pages(pool, gstart, gdesc, PS, 64, version=version)
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
    assert torch.equal(zr.decode_pages(pool, gstart, gdesc, PS, 64).view(torch.int16), kv.view(torch.int16))


def test_plan_refuses_bad_shapes() -> None:
    ip, ix, last = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), torch.tensor([16])
    with pytest.raises(ValueError):
        za.plan(ip, ix, last, 6, 4, 64)  # not a GQA group
    with pytest.raises(ValueError):
        za.plan(ip, ix, torch.tensor([0]), 4, 1, 64)  # empty last page
    with pytest.raises(ValueError):
        za.plan(ip, ix, last, 4, 1, 96)  # head_dim not a power of two
    with pytest.raises(ValueError, match="pick one"):
        za.plan(ip, ix, last, 4, 1, 64, pipe=True, prefetch=True)
    with pytest.raises(ValueError, match="tile"):
        za.plan(ip, ix, last, 4, 1, 64, tile=48)
    p = za.plan(ip, ix, last, 4, 1, 64)
    kv = torch.zeros(1, 2, 16, 1, 64, dtype=torch.bfloat16)
    pool, gstart, gdesc = zr.encode_pages(kv)
    with pytest.raises(ValueError):
        za.check_tables(p, pool, gstart.int(), gdesc)


def test_set_defaults_changes_what_plan_picks_and_refuses_unknown_options() -> None:
    ip, ix, last = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), torch.tensor([16])
    saved = dict(za._DEFAULTS["zip"])
    try:
        za.set_defaults("zip", pipe=True, num_stages=3, tile=32)
        p = za.plan(ip, ix, last, 4, 1, 64)
        assert (p.pipe, p.num_stages, p.tile) == (True, 3, 32)
        assert za.plan(ip, ix, last, 4, 1, 64, pipe=False).pipe is False  # an explicit argument still wins
        with pytest.raises(ValueError, match="unknown launch options"):
            za.set_defaults("zip", stages=3)
        with pytest.raises(ValueError, match="kernel"):
            za.set_defaults("fast", pipe=True)
    finally:
        za._DEFAULTS["zip"] = saved
