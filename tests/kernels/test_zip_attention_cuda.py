"""CUDA ZipFusion decode kernel. On the CPU: its rebuild arithmetic (constants read from the .cu source) and its
whole algorithm emulated lane by lane for loads and rebuilds, against the float64 reference. On a GPU (skipped
without one): the kernel itself against the float64 reference."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvtide.cache import zip_order
from kvtide.cache import zip_blocks as zb
from kvtide.cache import zip_format as zf
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
    for const in ("0x07070707u", "0x80808080u", "0x79797979u"):
        assert const in body
    assert "0xBA98" in SRC[SRC.index("u32 prmt_sign"):SRC.index("void rebuild8")], "prmt_sign must replicate signs"
    m = 0xFFFFFFFF

    def prmt_sign(x: int) -> int:  # prmt with selectors 8..11: each byte becomes its top bit copied 8 times
        return sum((((x >> (8 * i + 7)) & 1) * 0xFF) << (8 * i) for i in range(4))

    def rebuild8(cw, la, lb, b4, esc):
        de, dod = cw & 0x07070707, (cw >> 4) & 0x07070707
        he, ho = (de + b4) & m, (dod + b4) & m
        if esc:
            he &= ~prmt_sign((de + 0x79797979) & m) & m
            ho &= ~prmt_sign((dod + 0x79797979) & m) & m
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
                              bool(dj & 0x80))
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
    with pytest.raises(ValueError, match="stage"):
        zc.plan(one, one[:1], last, 8, 2, 128, options=zc.LaunchOptions(stage=2), device="cpu")
    with pytest.raises(ValueError, match="bad launch shape"):
        zc.plan(one, one[:1], last, 8, 2, 128, options=zc.LaunchOptions(warps=33), device="cpu")
    p = zc.plan(torch.tensor([0, 40], dtype=torch.int32), torch.arange(40, dtype=torch.int32), last, 8, 2, 128,
                options=zc.LaunchOptions(num_splits=3, cta_merge=False), device="cpu")
    assert p.num_splits == 3 and p.pages_per_split == 14 and p.opart.shape == (1, 8, 3, 128) and not p.cta_merge


def test_launch_options_are_one_frozen_value_whose_defaults_are_the_plain_plan() -> None:
    """plan()'s launch layout is one frozen LaunchOptions: no options and the default options give the same plan,
    options are hashable (a cache key) and cannot be changed in place, and the options measured no faster (tail
    merge, programmatic dependent launch, load hints, K staged) are gone from plan() and the kernel source."""
    import dataclasses

    indptr = torch.arange(68, dtype=torch.int32) * 520  # balanced runs by the rule: the default's richest path
    t = (indptr, torch.arange(67 * 520, dtype=torch.int32), torch.full((67,), 16, dtype=torch.int32), 32, 8, 128)
    a, b = zc.plan(*t, device="cpu"), zc.plan(*t, device="cpu", options=zc.LaunchOptions())
    fields = ("num_splits", "pages_per_split", "warps", "min_blocks", "stage", "cta_merge", "balanced", "grid_warps")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields] and a.balanced
    opts = zc.LaunchOptions(num_splits=3, cta_merge=False)
    assert hash(opts) == hash(zc.LaunchOptions(num_splits=3, cta_merge=False))
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.num_splits = 4  # type: ignore[misc]
    for gone in ("tail_merge", "pdl", "load_hint", "num_splits"):
        with pytest.raises(TypeError):
            zc.plan(*t, device="cpu", **{gone: 1})
    for macro in ("TAIL_MERGE", "LOAD_HINT", "K_SMEM", "griddepcontrol"):
        assert macro not in SRC, macro


def test_plan_merges_splits_in_a_cta_when_it_costs_no_wave() -> None:
    """Split partials merged on chip: one CTA of ``num_splits`` warps per (sequence, KV head), as many CTAs per SM
    as keep the requested warps per SM, no global partials; kept out where it would add a wave or overflow."""
    def mk(batch: int, pages: int, **kw) -> zc.CudaDecodePlan:
        indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
        return zc.plan(indptr, torch.arange(batch * pages, dtype=torch.int32),
                       torch.full((batch,), 16, dtype=torch.int32), 32, 8, 128, device="cpu",
                       options=zc.LaunchOptions(**kw))

    p = mk(32, 128, stage=0)  # the 2048 x 32 bench shape: 6 splits under the wave model
    assert p.num_splits == 6 and p.cta_merge and (p.warps, p.min_blocks) == (6, 2) and p.opart is None
    p = mk(64, 512, stage=0)  # 8192 x 64: 3 splits, CTAs of 3 warps, 4 per SM (12 warps per SM as requested)
    assert p.num_splits == 3 and p.cta_merge and (p.warps, p.min_blocks) == (3, 4)
    p = mk(32, 128, cta_merge=False, stage=0)
    assert not p.cta_merge and (p.warps, p.min_blocks) == (4, 3) and p.opart.shape == (32, 32, 6, 128)
    p = mk(1, 2048, stage=0)  # one long sequence: more splits than a CTA merges
    assert p.num_splits > zc.max_cta_splits(128) and not p.cta_merge and p.opart is not None
    p = mk(8, 16, num_splits=1)  # nothing to merge
    assert not p.cta_merge and p.opart is None
    p = mk(100, 64, num_splits=5, stage=0)  # 500 units: CTAs of 5 warps fit 2 per SM (264 at once), two waves
    assert not p.cta_merge


def test_plan_takes_16_warps_per_sm_where_the_wave_model_rates_them_faster() -> None:
    """Stage 1 (head_dim 128's default) fits 16 warps per SM: taken where they buy more splits in one wave (rated
    >= 15% faster), not where the gain is short splits' (2048 x 96); stage 0 never takes them (158 registers)."""
    def mk(batch: int, pages: int, **kw) -> zc.CudaDecodePlan:
        indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
        return zc.plan(indptr, torch.arange(batch * pages, dtype=torch.int32),
                       torch.full((batch,), 16, dtype=torch.int32), 32, 8, 128, device="cpu",
                       options=zc.LaunchOptions(**kw))

    assert zc.default_stage(128) == 1 and zc.default_stage(64) == 0
    for (batch, pages), want in {(64, 512): (4, 4, 4), (32, 512): (8, 8, 2), (96, 512): (8, 8, 2),
                                 (32, 128): (8, 8, 2), (64, 128): (4, 4, 4), (96, 128): (2, 2, 6)}.items():
        p = mk(batch, pages)
        assert p.stage == 1 and p.cta_merge and (p.num_splits, p.warps, p.min_blocks) == want, (batch, pages)
        assert p.warps * p.min_blocks in (12, 16)
    assert mk(64, 512, warps=4, min_blocks=3).num_splits == 3  # a shape given by the caller is kept
    launches = zc.default_launches(128)  # the balanced rule is on by default: the engine builds those kernels too
    assert {(4, 3, False, False), (4, 4, False, False), (4, 3, False, True), (4, 4, False, True)} <= set(launches)
    assert {w for w, _, c, _ in launches if c} == set(range(2, zc.max_cta_splits(128, 1) + 1))
    assert not any(c and b for _, _, c, b in launches)
    with pytest.MonkeyPatch.context() as mp:  # with the rule off, no balanced kernel is built
        mp.setattr(zc, "AUTO_BALANCED", False)
        assert not any(b for *_, b in zc.default_launches(128))


def test_balanced_walk_covers_every_page_once() -> None:
    """The BALANCED kernel's walk (host mirror, :func:`zc.balanced_pieces`): every page of every (sequence, KV head)
    in exactly one piece, a unit's pieces numbered 0..k-1 in page order with k what the merge reads, and k within the
    plan's partial slots; runs shorter and longer than the units, uneven lengths, a grid larger than the work."""
    gen = np.random.default_rng(5)
    for trial in range(60):
        lens = gen.integers(1, 90, gen.integers(1, 9)).tolist()
        hkv = int(gen.choice([1, 2, 8]))
        indptr = [0, *np.cumsum(lens).tolist()]
        total = hkv * indptr[-1]
        warps = int(gen.integers(1, total + 5))
        per = -(-total // warps)
        pieces = zc.balanced_pieces(indptr, hkv, per, warps)
        seen: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for w, b, h, k, p0, n in pieces:
            assert n >= 1 and w * per <= (hkv * indptr[b] + h * lens[b] + p0) < (w + 1) * per
            seen.setdefault((b, h), []).append((k, p0, n))
        slots = -(-max(lens) // per) + 1
        for b, length in enumerate(lens):
            for h in range(hkv):
                got = sorted(seen[(b, h)])
                assert [k for k, _, _ in got] == list(range(len(got))) == list(range(
                    zc.balanced_piece_count(indptr, hkv, per, b, h))), (trial, b, h)
                assert [p0 for _, p0, _ in got] == list(np.cumsum([0] + [n for _, _, n in got])[:-1])
                assert sum(n for _, _, n in got) == length and len(got) <= slots


def test_plan_takes_balanced_runs_just_past_a_wave_boundary(monkeypatch) -> None:
    """With AUTO_BALANCED (the default): 67 x 8 units of 520 pages leave 16-warps-per-SM even splits a nearly empty
    last wave and a global merge (measured on the H200): balanced runs there, one wave of 2112 warps; none where even
    splits fill the waves or merge in a CTA (64, 66, 90, 96) or runs would be short (2048-token contexts), none when
    the split count is given; balanced never merges in a CTA."""
    def mk(batch: int, pages: int, **kw) -> zc.CudaDecodePlan:
        indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
        return zc.plan(indptr, torch.arange(batch * pages, dtype=torch.int32),
                       torch.full((batch,), 16, dtype=torch.int32), 32, 8, 128, device="cpu",
                       options=zc.LaunchOptions(**kw))

    assert zc.AUTO_BALANCED
    monkeypatch.setattr(zc, "AUTO_BALANCED", False)
    assert not mk(67, 520).balanced
    monkeypatch.setattr(zc, "AUTO_BALANCED", True)
    assert [b for b in (52, 53, 64, 66, 67, 68, 69, 72, 90, 96) if mk(b, 520).balanced] == [53, 67, 68, 69]
    p = mk(67, 520)
    assert p.balanced and not p.cta_merge and (p.warps, p.min_blocks) == (4, 4) and p.grid_warps == 132 * 16
    assert p.pages_per_split == -(-67 * 8 * 520 // 2112) and p.num_splits == -(-520 // p.pages_per_split) + 1
    assert p.opart.shape == (67, 32, p.num_splits, 128) and p.split_pages.item() == p.pages_per_split
    for batch, pages in ((66, 520), (64, 512), (32, 512), (96, 512), (96, 128), (32, 128), (67, 128)):
        assert not mk(batch, pages).balanced, (batch, pages)
    assert not mk(67, 520, num_splits=4).balanced and not mk(67, 520, balanced=False).balanced
    q = mk(3, 40, balanced=True, balanced_warps=7, cta_merge=True)
    assert q.balanced and not q.cta_merge and q.grid_warps == 7 and q.pages_per_split == -(-3 * 8 * 40 // 7)
    assert (mk(66, 520, balanced=True).warps, mk(66, 520, balanced=True).min_blocks) == (4, 4)  # not the CTA's
    assert zc.graph_key(q) is None and q.opart.shape[2] == q.num_splits
    with pytest.raises(ValueError, match="indptr starts at 0"):
        zc.plan(torch.tensor([5, 45], dtype=torch.int32), torch.arange(50, dtype=torch.int32),
                torch.tensor([16], dtype=torch.int32), 32, 8, 128, device="cpu",
                options=zc.LaunchOptions(balanced=True))
    with pytest.raises(ValueError, match="merged in a CTA"):
        zc.defines(128, 2, 4, 4, cta_merge=True, balanced=True)
    bufs = zc.PlanBuffers(67, "cpu")
    keys = {zc.graph_key(zc.plan(torch.arange(68, dtype=torch.int32) * n, torch.arange(67 * n, dtype=torch.int32),
                                 torch.full((67,), 16, dtype=torch.int32), 32, 8, 128, device="cpu", buffers=bufs,
                                 options=zc.LaunchOptions(balanced=True))) for n in range(513, 521)}
    assert len(keys) == 1, "runs grow on the device: one graph for the whole stretch"


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


def _lane_tile(pool: np.ndarray, start: int, dword: int, d: int, kv: int, rebuild8) -> np.ndarray:
    """One group as the kernel's 32 lanes load and rebuild it (zip_decode.cu: load_group, block_frags), placed by the
    m16n8k16 A-fragment table: bf16 bits [16 tokens, d]."""
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    tile = np.zeros((16, d), dtype=np.int64)
    off = start
    for j in range(d // 32):
        dj = (dword >> (8 * j)) & 0xFF
        if dj == 0xFF:  # two 16-byte loads at lane * 32
            words = pool[off + lane[:, None] * 32 + np.arange(32)].copy().view(np.uint32).astype(np.int64)
            off += 1024
        else:  # 16 low bytes at lane * 16, 8 code bytes at 512 + lane * 8
            low = pool[off + lane[:, None] * 16 + np.arange(16)].copy().view(np.uint32).astype(np.int64)
            code = pool[off + 512 + lane[:, None] * 8 + np.arange(8)].copy().view(np.uint32).astype(np.int64)
            args = ((dj & 0x7F) * 0x01010101, bool(dj & 0x80))
            words = np.stack(rebuild8(code[:, 0], low[:, 0], low[:, 1], *args)
                             + rebuild8(code[:, 1], low[:, 2], low[:, 3], *args), 1)
            off += 768
        for h in range(2):
            ks = 2 * j + h
            for r in range(4):
                for half in range(2):
                    val = (words[:, 4 * h + r] >> (16 * half)) & 0xFFFF
                    row, col = g + 8 * (r & 1), 2 * t + half + 8 * (r >> 1)
                    if kv == 0:
                        tile[row, 16 * ks + col] = val  # K: tile rows are tokens
                    else:
                        tile[col, 16 * ks + row] = val  # V^T: tile rows are dims
    return tile


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.int32)).to(torch.int16).view(torch.bfloat16).float()


def _emulate(q, pool, starts, desc, indptr, indices, last, num_splits, pieces=None):
    """The CUDA kernel's algorithm on the CPU: lane loads and rebuilds as the .cu does them, fp32 scores, base-2
    online softmax with the lazy rescale (max moves only past +8), bf16 P, fp32 accumulation, split outputs merged
    by log-sum-exp. ``pieces``: balanced runs' (warp, sequence, head, piece, first page, pages) instead of even
    splits. A check of the design and the byte layout the kernel relies on, not of the CUDA code itself."""
    rebuild8 = _rebuild8_from_source()
    pool_np = pool.numpy()
    b_, hq, d = q.shape
    hkv = starts.shape[1]
    grp = hq // hkv
    nb = d // 32
    dword = (desc.to(torch.int64) << (8 * torch.arange(nb))).sum(-1)  # [P, H, 2]
    npg = (indptr[1:] - indptr[:-1]).tolist()
    pps = -(-max(npg) // num_splits)
    scale = d ** -0.5 * 1.4426950408889634
    out = torch.empty(b_, hq, d)
    for b in range(b_):
        kv_len = (npg[b] - 1) * 16 + int(last[b])
        qg = q[b].float().view(hkv, grp, d)
        for h in range(hkv):
            parts = []
            if pieces is None:
                ranges = [range(split * pps, min(npg[b], (split + 1) * pps)) for split in range(num_splits)]
            else:
                ranges = [range(p0, p0 + n) for _, _, _, _, p0, n in sorted(x for x in pieces if x[1:3] == (b, h))]
            for pages in ranges:
                pages = list(pages)
                if not pages:
                    continue
                m, l, o = torch.full((grp,), float("-inf")), torch.zeros(grp), torch.zeros(grp, d)
                for pi in pages:
                    pid = int(indices[indptr[b] + pi])
                    k = _bf16(_lane_tile(pool_np, int(starts[pid, h, 0]), int(dword[pid, h, 0]), d, 0, rebuild8))
                    v = _bf16(_lane_tile(pool_np, int(starts[pid, h, 1]), int(dword[pid, h, 1]), d, 1, rebuild8))
                    s = (k @ qg[h].T) * scale  # [16 tokens, grp]
                    s[torch.arange(16) + pi * 16 >= kv_len] = float("-inf")
                    x = s.max(0).values
                    if bool((x > m + 8).any()):
                        new = torch.maximum(m, x)
                        c = torch.exp2(m - new)
                        o, l, m = o * c[:, None], l * c, new
                    p = torch.exp2(s - m)
                    l = l + p.sum(0)
                    o = o + p.bfloat16().float().T @ v
                parts.append((o / l[:, None], m + torch.log2(l)))
            ws = torch.stack([lse for _, lse in parts])  # [splits, grp]
            w = torch.exp2(ws - ws.max(0).values)
            out[b, h * grp:(h + 1) * grp] = (torch.stack([o for o, _ in parts]) * w[..., None]).sum(0) / w.sum(0)[:, None]
    return out


@pytest.mark.parametrize("head_dim,group,version,splits", [(64, 4, 2, 3), (128, 8, 1, 1), (128, 1, 2, 2)])
def test_kernel_algorithm_emulated_on_cpu_matches_float64(head_dim: int, group: int, version: int, splits: int) -> None:
    """CI's check of the CUDA kernel without a GPU: its loads, rebuild and softmax/merge steps, emulated, against
    the float64 reference over the same pages (mixed raw/compressed blocks, partial last pages, splits)."""
    gen = torch.Generator().manual_seed(11 + head_dim + group)
    hkv, lens = 2, [1, 17, 90, 160]
    npg = [(x + 15) // 16 for x in lens]
    kv = _pages(sum(npg) + 3, hkv, head_dim, gen)
    pool, starts, desc, _ = _mma_pool(kv, version)
    assert (desc == zb.RAW).any() and (desc != zb.RAW).any()
    if version == 2:
        assert ((desc & zb.ESCAPE != 0) & (desc != zb.RAW)).any(), "the case should hold zero-escape blocks"
    perm = torch.randperm(kv.shape[0], generator=gen)[: sum(npg)].to(torch.int32)
    indptr = torch.tensor([0, *np.cumsum(npg)], dtype=torch.int32)
    last = torch.tensor([x - (n - 1) * 16 for x, n in zip(lens, npg)], dtype=torch.int32)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=gen).bfloat16()
    ref = zr.decode_attention_f64(q, kv, indptr, perm, last)
    got = _emulate(q, pool, starts, desc, indptr, perm, last, splits)
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("head_dim,group,version,warps", [(64, 4, 2, 5), (128, 8, 1, 3), (128, 1, 2, 40)])
def test_balanced_runs_emulated_on_cpu_match_float64(head_dim: int, group: int, version: int, warps: int) -> None:
    """The balanced walk's pieces (runs crossing sequence and head boundaries, several units in one run when runs
    are long) through the emulated kernel and merge, against the float64 reference."""
    gen = torch.Generator().manual_seed(23 + head_dim + group)
    hkv, lens = 2, [1, 17, 90, 160]
    npg = [(x + 15) // 16 for x in lens]
    kv = _pages(sum(npg) + 3, hkv, head_dim, gen)
    pool, starts, desc, _ = _mma_pool(kv, version)
    perm = torch.randperm(kv.shape[0], generator=gen)[: sum(npg)].to(torch.int32)
    indptr = torch.tensor([0, *np.cumsum(npg)], dtype=torch.int32)
    last = torch.tensor([x - (n - 1) * 16 for x, n in zip(lens, npg)], dtype=torch.int32)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=gen).bfloat16()
    per = -(-hkv * sum(npg) // warps)
    pieces = zc.balanced_pieces(indptr.tolist(), hkv, per, warps)
    assert any(n < npg[b] for _, b, _, _, _, n in pieces) or warps <= 3
    ref = zr.decode_attention_f64(q, kv, indptr, perm, last)
    got = _emulate(q, pool, starts, desc, indptr, perm, last, 1, pieces=pieces)
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-2


def _gpu_case(head_dim: int, group: int, version: int, hkv: int, gen: torch.Generator):
    """The GPU tests' batch: sequences of 1, 15, 16, 17, 200 and 777 tokens over shuffled pages of a v1/v2 pool.
    Returns (kv, pool, starts, desc, groups, page ids, indptr, last page lengths, q); page data on the GPU."""
    lens = [1, 15, 16, 17, 200, 777]
    npg = [(x + 15) // 16 for x in lens]
    kv = _pages(sum(npg) + 5, hkv, head_dim, gen).cuda()
    pool, starts, desc, groups = _mma_pool(kv, version)
    perm = torch.randperm(kv.shape[0], generator=gen)[: sum(npg)].to(torch.int32).cuda()
    indptr = torch.tensor([0, *np.cumsum(npg)], dtype=torch.int32)
    last = torch.tensor([x - (n - 1) * 16 for x, n in zip(lens, npg)], dtype=torch.int32)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=gen).bfloat16().cuda()
    return kv, pool, starts, desc, groups, perm, indptr, last, q


needs_cuda = pytest.mark.skipif(zc.unsupported() is not None, reason=str(zc.unsupported()))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("splits,cta_merge", [(1, True), (3, False), (3, True), (None, True)])
@pytest.mark.parametrize("stage", sorted(zc.STAGES))
def test_kernel_matches_float64_reference(head_dim: int, group: int, version: int, splits: int | None,
                                          cta_merge: bool, stage: int) -> None:
    gen = torch.Generator().manual_seed(head_dim + group + version)
    hkv = 2
    kv, pool, starts, desc, groups, perm, indptr, last, q = _gpu_case(head_dim, group, version, hkv, gen)
    assert (desc == zb.RAW).any() and (desc != zb.RAW).any()
    ref = zr.decode_attention_f64(q, kv, indptr, perm, last)
    p = zc.plan(indptr, perm, last, hkv * group, hkv, head_dim, version=version, device="cuda",
                options=zc.LaunchOptions(num_splits=splits, cta_merge=cta_merge, stage=stage))
    assert p.cta_merge == (cta_merge and p.num_splits > 1)
    out = torch.full_like(q, float("nan"))
    zc.run(p, q, pool, starts, desc, out=out, check=True)
    assert not out.isnan().any()
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-2, err
    raw = zc.run(p, q, *zc.raw_pool(groups.contiguous()))  # the format-free control: same kernel, same answer
    assert float((raw.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("warps", [1, 7, 64, 1000])
@pytest.mark.parametrize("stage", sorted(zc.STAGES))
def test_balanced_runs_match_float64_reference(head_dim: int, group: int, version: int, warps: int,
                                               stage: int) -> None:
    """Balanced runs (one warp for everything, runs spanning several units, runs cut inside units, more warps than
    pages) against the float64 reference, every output written."""
    gen = torch.Generator().manual_seed(head_dim + group + version + warps)
    hkv = 2
    kv, pool, starts, desc, _, perm, indptr, last, q = _gpu_case(head_dim, group, version, hkv, gen)
    ref = zr.decode_attention_f64(q, kv, indptr, perm, last)
    p = zc.plan(indptr, perm, last, hkv * group, hkv, head_dim, version=version, device="cuda",
                options=zc.LaunchOptions(stage=stage, balanced=True, balanced_warps=warps))
    assert p.balanced and p.grid_warps == warps
    out = torch.full_like(q, float("nan"))
    zc.run(p, q, pool, starts, desc, out=out, check=True)
    assert not out.isnan().any()
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-2, err


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("stage", sorted(set(zc.STAGES) - {0}))
def test_staged_groups_change_no_output_bit(head_dim: int, stage: int) -> None:
    """Staging the next page's groups in shared memory moves bytes, not arithmetic: the same bits as registers,
    with the splits merged in a CTA (partials in the V slots) and through zip_merge, empty splits included."""
    gen = torch.Generator().manual_seed(stage + head_dim)
    hkv, group, lens = 2, 4, [5, 300, 777, 2000]
    npg = [(x + 15) // 16 for x in lens]
    kv = _pages(sum(npg), hkv, head_dim, gen).cuda()
    pool, starts, desc, _ = _mma_pool(kv, 1)
    indptr = torch.tensor([0, *np.cumsum(npg)], dtype=torch.int32)
    last = torch.tensor([x - (n - 1) * 16 for x, n in zip(lens, npg)], dtype=torch.int32)
    idx = torch.randperm(sum(npg), generator=gen).to(torch.int32).cuda()
    q = torch.randn(len(lens), hkv * group, head_dim, generator=gen).bfloat16().cuda()
    for splits, cta in [(1, True), (6, True), (6, False), (None, True)]:
        outs = [zc.run(zc.plan(indptr, idx, last, hkv * group, hkv, head_dim, device="cuda",
                               options=zc.LaunchOptions(num_splits=splits, cta_merge=cta, stage=st)), q, pool, starts,
                       desc) for st in (0, stage)]
        assert torch.equal(outs[0], outs[1]), (splits, cta)


def test_stage_shared_memory_and_cta_limits() -> None:
    """What a staged launch asks of shared memory (the .cu's WARP_SMEM), and the CTA merge's limit under it."""
    assert zc.smem_bytes(128, 4, 0) == 0
    assert zc.smem_bytes(128, 4, 1) == 4 * (4096 + 2048)  # V slot + Q fragments per warp
    assert zc.smem_bytes(64, 3, 1) == 3 * (2048 + 1024)
    assert sorted(zc.STAGES) == [0, 1]
    for d in (64, 128):
        assert zc.smem_bytes(d, zc.max_cta_splits(d, 1), 1) <= 227 << 10
    m = re.search(r"#define WARP_SMEM \((.*?)\)\s", SRC)
    assert m and m.group(1).replace(" ", "") == "SLOT_BYTES+16*D", "smem_bytes must mirror the .cu's WARP_SMEM"
    one = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="stage"):
        zc.plan(one, one[:1], torch.tensor([16], dtype=torch.int32), 8, 2, 128, device="cpu",
                options=zc.LaunchOptions(stage=3))


def test_run_refuses_a_pool_beyond_the_kernels_reach(monkeypatch) -> None:
    """Starts travel as 32-bit counts of 16-byte units: a larger pool must be refused, never wrapped."""
    monkeypatch.setattr(zc, "MAX_POOL_BYTES", 1 << 10)
    one = torch.tensor([0, 1], dtype=torch.int32)
    p = zc.plan(one, one[:1], torch.tensor([16], dtype=torch.int32), 8, 2, 128, device="cpu",
                options=zc.LaunchOptions(num_splits=1))
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="addresses pools up to"):
        zc.run(p, q, torch.zeros(2048, dtype=torch.uint8), torch.zeros(1, 2, 2, dtype=torch.int64),
               torch.zeros(1, 2, 2, 4, dtype=torch.uint8))


def test_launch_config_structs_match_the_driver_abi() -> None:
    """cuLaunchKernelEx reads CUlaunchConfig and CUlaunchAttribute by layout (cuda.h, 64-bit): field offsets and
    sizes as the driver expects, and the PDL attribute as id 6 with value 1."""
    import ctypes

    from kvtide.kernels import cuda_jit as cj

    cfg, attr = cj._LaunchConfig, cj._LaunchAttr
    assert [getattr(cfg, f).offset for f in ("grid", "block", "smem", "stream", "attrs", "num_attrs")] == \
        [0, 12, 24, 32, 40, 48] and ctypes.sizeof(cfg) == 56
    assert (attr.id.offset, attr.value.offset, ctypes.sizeof(attr)) == (0, 8, 72)
    raw = bytes(cj._PDL_ATTR)
    assert int.from_bytes(raw[:4], "little") == 6 and int.from_bytes(raw[8:12], "little") == 1


def test_plan_into_fixed_buffers_matches_a_fresh_plan_and_keeps_its_graph_key() -> None:
    """``plan(buffers=...)`` (whole-step CUDA graphs): the same arrays as a fresh plan, written into fixed tensors;
    pages per split travels on the device, so the key a captured graph bakes in stays while contexts grow and the
    split count holds; outgrowing the page-id buffer replaces it and changes the key; a wrong batch is refused."""
    def tables(batch: int, pages: list[int], last: int = 16):
        indptr = torch.tensor([0] + list(np.cumsum(pages)), dtype=torch.int32)
        return indptr, torch.randperm(int(indptr[-1]), dtype=torch.int32), torch.full((batch,), last, dtype=torch.int32)

    for batch, others in ((3, [400, 7]), (66, [513] * 65)):
        bufs = zc.PlanBuffers(batch, "cpu")
        keys, split_pages, fresh_splits, hint = set(), set(), set(), None
        for grow in range(0, 48, 3):  # one sequence grows by pages, the others stay
            t = tables(batch, [513 + grow] + others)
            fresh = zc.plan(*t, 32, 8, 128, device="cpu")
            fixed = zc.plan(*t, 32, 8, 128, device="cpu", buffers=bufs, splits_hint=hint)
            nnz = int(t[0][-1])
            assert torch.equal(fixed.indptr, fresh.indptr) and torch.equal(fixed.kv_lens, fresh.kv_lens)
            assert torch.equal(fixed.indices[:nnz], fresh.indices)
            assert fixed.indices.data_ptr() == bufs.indices.data_ptr()
            assert fixed.indptr.data_ptr() == bufs.indptr.data_ptr()
            assert fixed.kv_lens.data_ptr() == bufs.meta.data_ptr()
            assert fixed.split_pages.item() == fixed.pages_per_split
            assert fixed.pages_per_split == -(-(513 + grow) // fixed.num_splits)  # every page in a split
            assert zc.graph_key(fresh) is None
            keys.add(zc.graph_key(fixed))
            split_pages.add(fixed.pages_per_split)
            fresh_splits.add(fresh.num_splits)
            hint = fixed.num_splits
        assert len(keys) == 1 and len(split_pages) > 1, (batch, "pages per split changed, the key did not")
        assert batch != 3 or len(fresh_splits) > 1, "the hint is what holds a small batch's split count"
    bufs = zc.PlanBuffers(3, "cpu")
    before = zc.graph_key(zc.plan(*tables(3, [513, 400, 7]), 32, 8, 128, device="cpu", buffers=bufs))
    big = tables(3, [4000, 4000, 4000])
    grown = zc.plan(*big, 32, 8, 128, device="cpu", buffers=bufs)
    assert bufs.indices.numel() >= 12000 and zc.graph_key(grown) != before
    split = zc.plan(*tables(3, [40, 40, 40]), 32, 8, 128, device="cpu", buffers=bufs,
                    options=zc.LaunchOptions(num_splits=3, cta_merge=False))
    assert split.opart.shape == (3, 32, 3, 128) and split.opart is bufs.parts(32, 3, 128)[0]
    with pytest.raises(ValueError, match="plan buffers for batch 3"):
        zc.plan(*tables(2, [5, 5]), 32, 8, 128, device="cpu", buffers=bufs)
