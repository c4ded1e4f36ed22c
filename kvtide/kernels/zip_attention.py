"""Triton paged DECODE attention over ZipFusion pages (and over raw NHD pages, same kernel skeleton).

The raw kernel is the control: its time against FlashInfer rates the kernel, the zip kernel's time against it
rates the 12-bit format. One program per (sequence, KV head, split) walks its pages, rebuilds compressed rows in
registers exactly as ``zip_blocks.rebuild_words`` (no decompressed copy is ever written) and feeds them to
``tl.dot``, with a lazy base-2 online softmax; split-KV partials are combined by a merge kernel. The design, the
load ``mode``s and the other launch options: docs/design/kernel.md.

The kernels know pages, groups and blocks only (no engine). ``plan`` once per batch, ``run_zip`` /
``run_raw`` per layer. Torch reference: :mod:`kvtide.kernels.zip_attention_ref`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from .h2d import to_device
from .interpret import triton_interpret
from .page_table import sequence_lengths

LOG2E = 1.4426950408889634


def _zip_meta(gstart_ptr, gdesc_ptr, page, h, KV: tl.constexpr, H_KV: tl.constexpr, NB: tl.constexpr):
    """Scalars of one group (page, h, K|V): its start in int32 words and its NB descriptors as one word."""
    gi = (page.to(tl.int64) * H_KV + h) * 2 + KV
    start_w = tl.load(gstart_ptr + gi) // 4  # int64: pools may pass 4 GiB
    if NB == 1:
        dw = tl.load(gdesc_ptr + gi).to(tl.int32)
    elif NB == 2:
        dw = tl.load(gdesc_ptr.to(tl.pointer_type(tl.int16)) + gi).to(tl.int32) & 0xFFFF
    elif NB == 4:
        dw = tl.load(gdesc_ptr.to(tl.pointer_type(tl.int32)) + gi)
    else:
        dw = tl.load(gdesc_ptr.to(tl.pointer_type(tl.int64)) + gi)
    return start_w, dw


def _row_desc(dw, r, D: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr):
    """Per row of a page: its block's descriptor and the block's start in int32 words from the group start."""
    RB: tl.constexpr = BLOCK // D  # rows (tokens) per block
    blk = r // RB
    nraw = tl.zeros_like(r)
    for j in tl.static_range(NB - 1):
        nraw += (((dw >> (8 * j)) & 0xFF) == 0xFF).to(tl.int32) * (j < blk).to(tl.int32)
    desc = ((dw >> (8 * blk).to(dw.dtype)) & 0xFF).to(tl.int32)
    return desc, blk * (BLOCK * 3 // 8) + nraw * (BLOCK // 8)


def _zip_load(pool32, start_w, dw, valid, r, D: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
              MODE: tl.constexpr):
    """Issue the loads of one page's K or V group (rows ``r``); :func:`_zip_build` turns them into a tile.
    Split from the math so that the caller can issue the next page's loads before this page's math.

    MODE 0: two int64 loads per 8 values whose addresses depend on the row's block kind (raw: the row's
    16 bytes; compressed: 8 bytes of the low plane and the 8 code-plane bytes that hold this code word).
    MODE 1, 2: the raw rows as a BF16 tile, the low plane as int64 and the code plane as int32 per 8 values,
    each masked to the rows of its kind."""
    RB: tl.constexpr = BLOCK // D
    desc, boff = _row_desc(dw, r, D, BLOCK, NB)
    boff32 = start_w + boff
    rin = r % RB
    israw = desc == 0xFF
    g = tl.arange(0, D // 8)[None, :]
    if MODE == 0:
        raw64 = boff32 // 2 + rin * (D // 4)  # int64 units
        low64 = boff32 // 2 + rin * (D // 8)
        code64 = boff32 // 2 + BLOCK // 8 + rin * (D // 16)
        israw2 = israw[:, None]
        xoff = tl.where(israw2, raw64[:, None] + 2 * g, low64[:, None] + g)
        yoff = tl.where(israw2, raw64[:, None] + 2 * g + 1, code64[:, None] + g // 2)
        pool64 = pool32.to(tl.pointer_type(tl.int64))
        a = tl.load(pool64 + xoff, mask=valid[:, None], other=0)
        b = tl.load(pool64 + yoff, mask=valid[:, None], other=0)
        c = a  # unused
    else:
        raw_m = valid & israw
        comp_m = valid & (desc != 0xFF)
        d = tl.arange(0, D)
        # int64 row offsets (pools may pass 4 GiB), int32 column offsets from the row pointer
        raw_row = tl.multiple_of(boff32 * 2 + rin * D, 8)  # in BF16 elements
        raw_p = pool32.to(tl.pointer_type(tl.bfloat16)) + raw_row
        a = tl.load(raw_p[:, None] + d[None, :], mask=raw_m[:, None], other=0.0)
        low_row = tl.multiple_of(boff32 // 2 + rin * (D // 8), 2)  # in int64 units
        code_row = tl.multiple_of(boff32 + BLOCK // 4 + rin * (D // 8), 4)
        low_p = pool32.to(tl.pointer_type(tl.int64)) + low_row
        code_p = pool32 + code_row
        b = tl.load(low_p[:, None] + g, mask=comp_m[:, None], other=0)
        c = tl.load(code_p[:, None] + g, mask=comp_m[:, None], other=0)
    return a, b, c


def _zip_build(a, b, c, dw, r, D: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
               VERSION: tl.constexpr, MODE: tl.constexpr):
    """BF16 [ROWS, D] tile(s) from :func:`_zip_load`'s loads, rebuilt in registers (no copy in memory).

    Returns (tile, second): MODE 0 and 2 give one tile (second is unused); MODE 1 gives the raw rows and the
    rebuilt compressed rows as two tiles, each +0 where the other holds the row (two tensor-core dots)."""
    desc, boff = _row_desc(dw, r, D, BLOCK, NB)
    israw = desc == 0xFF
    g = tl.arange(0, D // 8)[None, :]
    if MODE == 0:
        x0 = a.to(tl.uint32)  # low half (truncation)
        x1 = (a >> 32).to(tl.uint32)
        y0 = b.to(tl.uint32)
        y1 = (b >> 32).to(tl.uint32)
        cw = tl.where((g % 2) == 1, y1, y0)  # compressed rows: this column's code word
        hb = ((desc & 0x7F) * 0x01000100).to(tl.uint32)[:, None]
    else:
        x0 = b.to(tl.uint32)
        x1 = (b >> 32).to(tl.uint32)
        cw = c.to(tl.uint32, bitcast=True)
        hb = tl.where(israw, 0, (desc & 0x7F) * 0x01000100).to(tl.uint32)[:, None]  # raw rows rebuild to +0
    M: tl.constexpr = 0x0F000F00
    S: tl.constexpr = 0x08000800
    t0 = (cw << 8) & M
    t1 = (cw << 4) & M
    t2 = cw & M
    t3 = (cw >> 4) & M
    t0 = t0 + 15 * (t0 & S)
    t1 = t1 + 15 * (t1 & S)
    t2 = t2 + 15 * (t2 & S)
    t3 = t3 + 15 * (t3 & S)
    w0 = t0 + hb + (x0 & 0x00FF00FF)
    w1 = t1 + hb + ((x0 >> 8) & 0x00FF00FF)
    w2 = t2 + hb + (x1 & 0x00FF00FF)
    w3 = t3 + hb + ((x1 >> 8) & 0x00FF00FF)
    if VERSION == 2:
        esc = (desc != 0xFF) & ((desc & 0x80) != 0)
        if tl.max(esc.to(tl.int32), axis=0) != 0:  # tile-uniform: only tiles with escape blocks pay
            zk = tl.where(esc, ((desc & 0x7F) + 7) << 8, 0).to(tl.uint32)[:, None]
            w0 -= (((t0 + 0x01000100) & S) >> 11) * zk
            w1 -= (((t1 + 0x01000100) & S) >> 11) * zk
            w2 -= (((t2 + 0x01000100) & S) >> 11) * zk
            w3 -= (((t3 + 0x01000100) & S) >> 11) * zk
    if MODE == 0:
        israw2 = israw[:, None]
        w0 = tl.where(israw2, x0, w0)
        w1 = tl.where(israw2, x1, w1)
        w2 = tl.where(israw2, y0, w2)
        w3 = tl.where(israw2, y1, w3)
    # word k of each 8 holds dims 8g + 2k (low half) and 8g + 2k + 1 (high half): join to [PS, D]
    wq = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [PS, D/8, 2, 2]: word k at [.., k // 2, k % 2]
    lo16 = wq.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi16 = (wq >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    kz = tl.reshape(tl.join(lo16, hi16), (ROWS, D))
    if MODE == 2:
        kz = (kz.to(tl.int16, bitcast=True) | a.to(tl.int16, bitcast=True)).to(tl.bfloat16, bitcast=True)
    if MODE == 1:
        return a, kz
    return kz, kz


def _raw_tile(kv_ptr, page, valid, tok, h, KV: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, PS: tl.constexpr):
    """[TILE, D] BF16 tile of K or V from FlashInfer NHD pages [num_pages, 2, PS, H_KV, D]."""
    row = ((page.to(tl.int64) * 2 + KV) * PS + tok) * (H_KV * D) + h * D
    row = tl.multiple_of(row, 8)
    d = tl.arange(0, D)
    return tl.load(kv_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)


def _decode_kernel(q_ptr, out_ptr, opart_ptr, lse_ptr, indptr_ptr, indices_ptr, kvlen_ptr,
                   kv_ptr, pool32, gstart_ptr, gdesc_ptr, qk_scale, pages_per_split, num_splits,
                   H_KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
                   TILE: tl.constexpr, BLOCK: tl.constexpr, ZIP: tl.constexpr, VERSION: tl.constexpr,
                   SPLIT: tl.constexpr, F32_DOT: tl.constexpr, MODE: tl.constexpr, PREFETCH: tl.constexpr,
                   TRANS: tl.constexpr, LATE_V: tl.constexpr, PIPE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    kv_len = tl.load(kvlen_ptr + b)
    first = tl.load(indptr_ptr + b)
    tok_lo = sp * pages_per_split * PS
    tok_hi = tl.minimum(kv_len, tok_lo + pages_per_split * PS)
    if tok_lo >= tok_hi:  # this split holds no tokens of this sequence: the merge skips it
        return
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    qrow = (b * (H_KV * G) + h * G + g).to(tl.int64)
    q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    if TRANS:
        qt = tl.trans(q)
        if F32_DOT:
            qt = qt.to(tl.float32)
        acc = tl.zeros([D, GP], tl.float32)
    else:
        acc = tl.zeros([GP, D], tl.float32)
    if ZIP and PIPE:  # TILE // PS pages per step, metadata per row; Triton's pipeliner stages the loads
        r = tl.arange(0, TILE)
        step: tl.constexpr = TILE
        NB: tl.constexpr = PS * D // BLOCK
    elif ZIP:  # one page per step; metadata two pages ahead, data one page ahead (PREFETCH), scalars per page
        r = tl.arange(0, PS)
        NB: tl.constexpr = PS * D // BLOCK
        last_pg = (tok_hi - 1) // PS
        pg0 = tok_lo // PS
        page = tl.load(indices_ptr + first + pg0)
        sk, dk = _zip_meta(gstart_ptr, gdesc_ptr, page, h, 0, H_KV, NB)
        sv, dv = _zip_meta(gstart_ptr, gdesc_ptr, page, h, 1, H_KV, NB)
        page_n = tl.load(indices_ptr + first + tl.minimum(pg0 + 1, last_pg))
        sk_n, dk_n = _zip_meta(gstart_ptr, gdesc_ptr, page_n, h, 0, H_KV, NB)
        sv_n, dv_n = _zip_meta(gstart_ptr, gdesc_ptr, page_n, h, 1, H_KV, NB)
        if PREFETCH:
            valid0 = tok_lo + r < tok_hi
            ka, kb, kc = _zip_load(pool32, sk, dk, valid0, r, D, BLOCK, NB, MODE)
            va, vb, vc = _zip_load(pool32, sv, dv, valid0, r, D, BLOCK, NB, MODE)
        step: tl.constexpr = PS
    else:
        r = tl.arange(0, TILE)
        step: tl.constexpr = TILE
    for t0 in range(tok_lo, tok_hi, step):
        pos = t0 + r
        valid = pos < tok_hi
        if ZIP and PIPE:  # loads issued num_stages - 1 steps ahead by the compiler (asynchronous copies)
            if TILE == PS:  # one page: scalar metadata (far less address math than per row)
                pg = tl.load(indices_ptr + first + t0 // PS)
                rp = r
            else:
                pg = tl.load(indices_ptr + first + pos // PS, mask=valid, other=0)
                rp = pos % PS
            sk, dk = _zip_meta(gstart_ptr, gdesc_ptr, pg, h, 0, H_KV, NB)
            sv_c, dv_c = _zip_meta(gstart_ptr, gdesc_ptr, pg, h, 1, H_KV, NB)
            ka, kb, kc = _zip_load(pool32, sk, dk, valid, rp, D, BLOCK, NB, MODE)
            k, kz = _zip_build(ka, kb, kc, dk, rp, D, TILE, BLOCK, NB, VERSION, MODE)
            if not LATE_V:
                va, vb, vc = _zip_load(pool32, sv_c, dv_c, valid, rp, D, BLOCK, NB, MODE)
                v, vz = _zip_build(va, vb, vc, dv_c, rp, D, TILE, BLOCK, NB, VERSION, MODE)
        elif ZIP:
            if PREFETCH:  # issue the next page's loads, then rebuild this page from the loads issued last step
                valid_n = pos + PS < tok_hi
                ka_n, kb_n, kc_n = _zip_load(pool32, sk_n, dk_n, valid_n, r, D, BLOCK, NB, MODE)
                va_n, vb_n, vc_n = _zip_load(pool32, sv_n, dv_n, valid_n, r, D, BLOCK, NB, MODE)
            else:
                ka, kb, kc = _zip_load(pool32, sk, dk, valid, r, D, BLOCK, NB, MODE)
                if not LATE_V:
                    va, vb, vc = _zip_load(pool32, sv, dv, valid, r, D, BLOCK, NB, MODE)
            k, kz = _zip_build(ka, kb, kc, dk, r, D, PS, BLOCK, NB, VERSION, MODE)
            if not LATE_V:
                v, vz = _zip_build(va, vb, vc, dv, r, D, PS, BLOCK, NB, VERSION, MODE)
            sv_c, dv_c = sv, dv  # this page's V group (LATE_V loads it after the scores)
            dk, dv, sk, sv = dk_n, dv_n, sk_n, sv_n
            page_n = tl.load(indices_ptr + first + tl.minimum(t0 // PS + 2, last_pg))
            sk_n, dk_n = _zip_meta(gstart_ptr, gdesc_ptr, page_n, h, 0, H_KV, NB)
            sv_n, dv_n = _zip_meta(gstart_ptr, gdesc_ptr, page_n, h, 1, H_KV, NB)
            if PREFETCH:
                ka, kb, kc, va, vb, vc = ka_n, kb_n, kc_n, va_n, vb_n, vc_n
        else:
            page = tl.load(indices_ptr + first + pos // PS, mask=valid, other=0)
            tok = pos % PS
            k = _raw_tile(kv_ptr, page, valid, tok, h, 0, H_KV, D, PS)
            v = _raw_tile(kv_ptr, page, valid, tok, h, 1, H_KV, D, PS)
            sv_c, dv_c = 0, 0  # (zip only)
        if F32_DOT:  # the Triton interpreter multiplies bf16 dot operands as their raw uint16 bits
            k = k.to(tl.float32)
            q = q.to(tl.float32)
            if ZIP:
                kz = kz.to(tl.float32)
            if not LATE_V:
                v = v.to(tl.float32)
                if ZIP:
                    vz = vz.to(tl.float32)
        if TRANS:  # tokens on the MMA's M side: S^T = K Q^T, O^T += V^T P^T (small [D, GP] accumulator)
            st = tl.dot(k, qt)
            if ZIP:
                if MODE == 1:
                    st = tl.dot(kz, qt, st)
            st = st * qk_scale  # [TILE, GP], log2 units
            st = tl.where(valid[:, None], st, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(st, axis=0))
            if tl.max(m_new - m_i, axis=0) > 8.0:
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha
                acc = acc * alpha[None, :]
                m_i = m_new
            pb = tl.exp2(st - m_i[None, :])  # P^T [TILE, GP]
            l_i = l_i + tl.sum(pb, axis=0)
        else:
            s = tl.dot(q, tl.trans(k))
            if ZIP:
                if MODE == 1:
                    s = tl.dot(q, tl.trans(kz), s)
            s = s * qk_scale  # [GP, TILE], log2 units
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # lazy rescale: keep a stale max until some row's grows by more than 2^8 (p <= 256 is safe in fp32
            # sums and bf16 operands), so most steps skip the acc * alpha pass; the first always rescales
            if tl.max(m_new - m_i, axis=0) > 8.0:
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_new
            pb = tl.exp2(s - m_i[:, None])  # P [GP, TILE]
            l_i = l_i + tl.sum(pb, axis=1)
        if ZIP:
            if LATE_V:  # V's loads after K's scores: fewer live registers, more warps per SM
                rv = pos % PS if PIPE and TILE != PS else r
                va, vb, vc = _zip_load(pool32, sv_c, dv_c, valid, rv, D, BLOCK, NB, MODE)
                v, vz = _zip_build(va, vb, vc, dv_c, rv, D, TILE if PIPE else PS, BLOCK, NB, VERSION, MODE)
                if F32_DOT:
                    v = v.to(tl.float32)
                    vz = vz.to(tl.float32)
        pb = pb.to(tl.bfloat16)
        if F32_DOT:
            pb = pb.to(tl.float32)
        if TRANS:
            acc = tl.dot(tl.trans(v), pb, acc)
            if ZIP:
                if MODE == 1:
                    acc = tl.dot(tl.trans(vz), pb, acc)
        else:
            acc = tl.dot(pb, v, acc)
            if ZIP:
                if MODE == 1:
                    acc = tl.dot(pb, vz, acc)
    if TRANS:
        acc = tl.trans(acc)
    o = acc / l_i[:, None]
    gm = (g < G)[:, None]
    if SPLIT:
        prow = qrow * num_splits + sp
        tl.store(opart_ptr + prow[:, None] * D + d[None, :], o, mask=gm)
        tl.store(lse_ptr + prow, m_i + tl.log2(l_i), mask=g < G)
    else:
        tl.store(out_ptr + qrow[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=gm)


def _merge_kernel(opart_ptr, lse_ptr, out_ptr, kvlen_ptr, split_tokens, num_splits, HQ: tl.constexpr,
                  D: tl.constexpr, SP: tl.constexpr):
    """out[b, hq] = sum_s 2^(lse_s - lse) o_s over the splits that hold tokens (log-sum-exp merge)."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    n = tl.cdiv(tl.load(kvlen_ptr + b), split_tokens)
    s = tl.arange(0, SP)
    row = (b * HQ + hq).to(tl.int64) * num_splits
    lse = tl.load(lse_ptr + row + s, mask=s < n, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    w = tl.exp2(lse - mx)
    w = w / tl.sum(w, axis=0)
    d = tl.arange(0, D)
    o = tl.load(opart_ptr + (row + s)[:, None] * D + d[None, :], mask=(s < n)[:, None], other=0.0)
    tl.store(out_ptr + (b * HQ + hq).to(tl.int64) * D + d, tl.sum(o * w[:, None], axis=0).to(out_ptr.dtype.element_ty))


def _decompress_kernel(pool32, gstart_ptr, gdesc_ptr, out_ptr, page_ids, H_KV: tl.constexpr,
                       D: tl.constexpr, PS: tl.constexpr, BLOCK: tl.constexpr, VERSION: tl.constexpr):
    """Baseline only: rebuild group (page, h, K|V) into NHD pages (the separate pass the paper avoids)."""
    page = tl.load(page_ids + tl.program_id(0))
    h = tl.program_id(1)
    kv = tl.program_id(2)
    tok = tl.arange(0, PS)
    valid = tok < PS
    NB: tl.constexpr = PS * D // BLOCK
    if kv == 0:
        st, dw = _zip_meta(gstart_ptr, gdesc_ptr, page, h, 0, H_KV, NB)
    else:
        st, dw = _zip_meta(gstart_ptr, gdesc_ptr, page, h, 1, H_KV, NB)
    a, b, c = _zip_load(pool32, st, dw, valid, tok, D, BLOCK, NB, 0)
    x, _unused = _zip_build(a, b, c, dw, tok, D, PS, BLOCK, NB, VERSION, 0)
    row = ((page.to(tl.int64) * 2 + kv) * PS + tok) * (H_KV * D) + h * D
    tl.store(out_ptr + row[:, None] + tl.arange(0, D)[None, :], x)


@dataclass
class DecodePlan:
    """Everything about one batch that all layers share: page tables, lengths, split sizes, launch config."""

    indptr: torch.Tensor  # int32 [B + 1]
    indices: torch.Tensor  # int32 [nnz pages]
    kv_lens: torch.Tensor  # int32 [B]
    batch: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    block_size: int
    version: int
    num_splits: int
    pages_per_split: int
    tile: int
    num_warps: int
    num_stages: int
    sm_scale: float
    mode: int = 1  # zip kernel load/rebuild variant (see the module doc)
    prefetch: bool = False  # issue the next page's loads before this page's rebuild (zip kernel)
    trans: bool = True  # tokens as the MMA's M dimension (S^T = K Q^T), a small accumulator
    late_v: bool = False  # without prefetch: load V after K's scores (fewer live registers)
    pipe: bool = False  # zip kernel: metadata read in the step that uses it, TILE // page_size pages per step, loads
    # staged by the compiler's software pipeliner (num_stages >= 2: asynchronous copies into shared memory)
    maxnreg: int | None = None  # register cap per thread (more warps per SM, maybe spills)
    opart: torch.Tensor | None = field(default=None, repr=False)  # fp32 [B, Hq, S, D] split outputs
    lse: torch.Tensor | None = field(default=None, repr=False)  # fp32 [B, Hq, S] (base 2)

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


_HELPERS = ("_zip_meta", "_row_desc", "_zip_load", "_zip_build", "_raw_tile")  # called from kernels: the module globals must be jitted first
_PY = {name: globals()[name] for name in (*_HELPERS, "_decode_kernel", "_merge_kernel", "_decompress_kernel")}


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """JIT on first use, once the TRITON_INTERPRET setting is final (triton reads it at decoration)."""
    for name in _HELPERS:
        globals()[name] = triton.jit(_PY[name])
    return SimpleNamespace(decode=triton.jit(_PY["_decode_kernel"]), merge=triton.jit(_PY["_merge_kernel"]),
                           decompress=triton.jit(_PY["_decompress_kernel"]))


def _k() -> SimpleNamespace:
    return _kernels(triton_interpret())


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# launch defaults per kernel: the best of a sweep by bench/zip_attention.py (tile 16 = one page for zip)
_DEFAULTS = {
    "zip": dict(num_warps=1, num_stages=1, waves=8.0, tile=16, mode=1, prefetch=False, trans=True, late_v=False,
                maxnreg=128, pipe=False),
    "raw": dict(num_warps=4, num_stages=1, waves=4.0, tile=64, mode=1, prefetch=False, trans=False, late_v=False,
                maxnreg=None, pipe=False),
}


def set_defaults(kernel: str, **options) -> None:
    """Change the launch defaults ``plan`` uses for ``kernel`` (benchmarks replay a tuned configuration
    through code that plans with defaults, such as the engine's backend)."""
    if kernel not in _DEFAULTS:
        raise ValueError(f"kernel must be one of {sorted(_DEFAULTS)}, got {kernel!r}")
    unknown = set(options) - set(_DEFAULTS[kernel])
    if unknown:
        raise ValueError(f"unknown launch options {sorted(unknown)}; known: {sorted(_DEFAULTS[kernel])}")
    _DEFAULTS[kernel].update(options)


def plan(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, num_qo_heads: int,
         num_kv_heads: int, head_dim: int, page_size: int = 16, *, block_size: int = 512, version: int = 1,
         sm_scale: float | None = None, num_splits: int | None = None, tile: int | None = None,
         num_warps: int | None = None, num_stages: int | None = None, device: torch.device | str | None = None,
         waves: float | None = None, mode: int | None = None, prefetch: bool | None = None,
         trans: bool | None = None, late_v: bool | None = None, maxnreg: int | None = None,
         pipe: bool | None = None, kernel: str = "zip") -> DecodePlan:
    """Plan one decode batch (FlashInfer-style page table); host work happens here, not per layer.

    ``kernel`` ("zip" or "raw") picks that kernel's launch defaults (``_DEFAULTS``); every option left ``None``
    takes its default, ``maxnreg=0`` means no register cap. ``mode`` (0, 1, 2) is how the zip kernel loads a
    page's bytes; ``late_v``, ``prefetch`` and ``pipe`` move loads relative to the math (docs/design/kernel.md).

    ``num_splits=None`` splits long contexts so that B * Hkv * splits fills ``waves`` waves of the SMs.
    """
    if num_qo_heads % num_kv_heads or not 1 <= num_qo_heads // num_kv_heads <= 16:
        raise ValueError(f"GQA group {num_qo_heads}/{num_kv_heads} unsupported (need an integer 1..16)")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if (page_size * head_dim) % block_size or block_size % head_dim or page_size % (block_size // head_dim):
        raise ValueError(f"block_size {block_size} must hold whole rows of head_dim {head_dim} and divide a page")
    if (page_size * head_dim) // block_size not in (1, 2, 4, 8):
        raise ValueError("a group must hold 1, 2, 4 or 8 blocks")
    if version not in (1, 2):
        raise ValueError(f"unknown ZipFusion format version {version}")
    if kernel not in _DEFAULTS:
        raise ValueError(f"kernel must be one of {sorted(_DEFAULTS)}, got {kernel!r}")
    dflt = _DEFAULTS[kernel]

    def pick(value, name):
        return dflt[name] if value is None else value

    num_warps, num_stages, waves = pick(num_warps, "num_warps"), pick(num_stages, "num_stages"), pick(waves, "waves")
    mode, prefetch, trans = pick(mode, "mode"), pick(prefetch, "prefetch"), pick(trans, "trans")
    late_v, maxnreg, pipe = pick(late_v, "late_v"), pick(maxnreg, "maxnreg") or None, pick(pipe, "pipe")
    if mode not in (0, 1, 2):
        raise ValueError(f"zip kernel mode must be 0, 1 or 2, got {mode}")
    if pipe and prefetch:
        raise ValueError("pipe and prefetch are two ways of issuing loads early: pick one")
    if num_warps < 1 or num_stages < 1:
        raise ValueError(f"num_warps and num_stages must be >= 1, got {num_warps}, {num_stages}")
    dev = torch.device(device) if device is not None else kv_indices.device
    seqs = sequence_lengths(kv_indptr, kv_last_page_len, page_size)
    batch, max_pages = seqs.batch, seqs.max_pages
    if tile is None:
        tile = dflt["tile"] if head_dim <= 128 else min(dflt["tile"], 32)
    tile = max(tile, page_size)
    if tile & (tile - 1) or tile % page_size:
        raise ValueError(f"tile must be a power of two and a multiple of page_size {page_size}, got {tile}")
    ppt = tile // page_size  # pages per tile
    if num_splits is None:
        sms = _num_sms(dev.index or 0) if dev.type == "cuda" else 8
        want = math.ceil(sms * waves / max(1, batch * num_kv_heads))
        num_splits = max(1, min(want, math.ceil(max_pages / (4 * ppt))))  # a split walks >= 4 tiles
    num_splits = max(1, min(num_splits, max_pages))
    pages_per_split = math.ceil(max_pages / num_splits / ppt) * ppt
    num_splits = math.ceil(max_pages / pages_per_split)
    p = DecodePlan(
        indptr=to_device(seqs.indptr, dev, torch.int32), indices=to_device(kv_indices, dev, torch.int32),
        kv_lens=to_device(seqs.kv_lens, dev, torch.int32), batch=batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, block_size=block_size, version=version, num_splits=num_splits,
        pages_per_split=pages_per_split, tile=tile, num_warps=num_warps, num_stages=num_stages,
        sm_scale=head_dim ** -0.5 if sm_scale is None else sm_scale, mode=mode, prefetch=prefetch, trans=trans,
        late_v=late_v, maxnreg=maxnreg, pipe=pipe,
    )
    if num_splits > 1:
        p.opart = torch.empty(batch, num_qo_heads, num_splits, head_dim, dtype=torch.float32, device=dev)
        p.lse = torch.empty(batch, num_qo_heads, num_splits, dtype=torch.float32, device=dev)
    return p


def _check_q(p: DecodePlan, q: torch.Tensor) -> None:
    if q.shape != (p.batch, p.num_qo_heads, p.head_dim) or q.dtype != torch.bfloat16 or not q.is_contiguous():
        raise ValueError(f"q must be contiguous bf16 [{p.batch}, {p.num_qo_heads}, {p.head_dim}], got "
                         f"{q.dtype} {tuple(q.shape)}")
    if q.device.type != "cuda" and not triton_interpret():
        raise RuntimeError("Triton attention needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")


def _launch(p: DecodePlan, q: torch.Tensor, out: torch.Tensor | None, zip_: bool, kv: torch.Tensor,
            pool32: torch.Tensor, gstart: torch.Tensor, gdesc: torch.Tensor) -> torch.Tensor:
    _check_q(p, q)
    out = torch.empty_like(q) if out is None else out
    split = p.num_splits > 1
    g = p.group
    dummy = p.lse if split else out
    _k().decode[(p.batch, p.num_kv_heads, p.num_splits)](
        q, out, p.opart if split else dummy, p.lse if split else dummy, p.indptr, p.indices, p.kv_lens,
        kv, pool32, gstart, gdesc, p.sm_scale * LOG2E, p.pages_per_split, p.num_splits,
        H_KV=p.num_kv_heads, G=g, GP=max(8 if p.trans else 16, triton.next_power_of_2(g)), D=p.head_dim,
        PS=p.page_size,
        TILE=p.tile, BLOCK=p.block_size, ZIP=zip_, VERSION=p.version, SPLIT=split,
        F32_DOT=triton_interpret(), MODE=p.mode, PREFETCH=p.prefetch, TRANS=p.trans,
        LATE_V=zip_ and p.late_v and not p.prefetch, PIPE=zip_ and p.pipe, num_warps=p.num_warps, num_stages=p.num_stages,
        **({"maxnreg": p.maxnreg} if p.maxnreg and not triton_interpret() else {}),
    )
    if split:
        _k().merge[(p.batch, p.num_qo_heads)](
            p.opart, p.lse, out, p.kv_lens, p.pages_per_split * p.page_size, p.num_splits, HQ=p.num_qo_heads,
            D=p.head_dim, SP=triton.next_power_of_2(p.num_splits), num_warps=4,
        )
    return out


def check_tables(p: DecodePlan, pool: torch.Tensor, group_start: torch.Tensor, group_desc: torch.Tensor) -> None:
    """Refuse storage tables that do not match the plan (shapes, dtypes, alignment)."""
    nb = p.page_size * p.head_dim // p.block_size
    if pool.dtype != torch.uint8 or pool.dim() != 1 or pool.numel() % 16 or not pool.is_contiguous():
        raise ValueError("pool must be a contiguous 1-D uint8 tensor, its length a multiple of 16")
    if group_start.dtype != torch.int64 or group_start.shape[1:] != (p.num_kv_heads, 2):
        raise ValueError(f"group_start must be int64 [num_pages, {p.num_kv_heads}, 2]")
    if group_desc.dtype != torch.uint8 or group_desc.shape != (*group_start.shape, nb):
        raise ValueError(f"group_desc must be uint8 [num_pages, {p.num_kv_heads}, 2, {nb}]")
    if not (group_start.is_contiguous() and group_desc.is_contiguous()):
        raise ValueError("group tables must be contiguous")


def run_zip(p: DecodePlan, q: torch.Tensor, pool: torch.Tensor, group_start: torch.Tensor,
            group_desc: torch.Tensor, out: torch.Tensor | None = None, check: bool = False) -> torch.Tensor:
    """Decode attention of one layer over compressed pages; q [B, Hq, D] bf16 -> [B, Hq, D] bf16."""
    if check:
        check_tables(p, pool, group_start, group_desc)
    return _launch(p, q, out, True, pool.view(torch.bfloat16), pool.view(torch.int32), group_start, group_desc)


def run_raw(p: DecodePlan, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same kernel over raw FlashInfer NHD pages kv_cache [num_pages, 2, page_size, Hkv, D] bf16."""
    if kv_cache.shape[1:] != (2, p.page_size, p.num_kv_heads, p.head_dim) or kv_cache.dtype != torch.bfloat16:
        raise ValueError(f"kv_cache must be bf16 [num_pages, 2, {p.page_size}, {p.num_kv_heads}, {p.head_dim}]")
    return _launch(p, q, out, False, kv_cache, p.kv_lens, p.kv_lens, p.kv_lens)


def decompress_pages(pool: torch.Tensor, group_start: torch.Tensor, group_desc: torch.Tensor, page_size: int,
                     head_dim: int, block_size: int = 512, version: int = 1, out: torch.Tensor | None = None,
                     page_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Baseline: pages (all, or ``page_ids``) rebuilt into an NHD buffer [num_pages, 2, page_size, Hkv, D]."""
    num_pages, hkv = group_start.shape[:2]
    if out is None:
        out = torch.empty(num_pages, 2, page_size, hkv, head_dim, dtype=torch.bfloat16, device=pool.device)
    if page_ids is None:
        page_ids = torch.arange(num_pages, dtype=torch.int32, device=pool.device)
    _k().decompress[(page_ids.numel(), hkv, 2)](
        pool.view(torch.int32), group_start, group_desc, out, page_ids.to(torch.int32),
        H_KV=hkv, D=head_dim,
        PS=page_size, BLOCK=block_size, VERSION=version, num_warps=4,
    )
    return out


__all__ = ["DecodePlan", "plan", "set_defaults", "run_zip", "run_raw", "decompress_pages", "check_tables"]
