"""Torch references for :mod:`kvtide.kernels.zip_attention`: page decoding and float64 decode attention.

Why separate from the kernel: these are the oracle (bit-exact page decode through the format's own torch
decoder, attention in float64), simple rather than fast, and run on CPU or GPU.
"""

from __future__ import annotations

import torch

from kvtide.cache import zip_blocks as zb
from kvtide.cache import zip_format as zf


def encode_pages(kv_cache: torch.Tensor, block_size: int = 512, version: int = 1,
                 slack: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NHD pages [P, 2, PS, Hkv, D] -> (pool uint8, group_start int64 [P, Hkv, 2], group_desc uint8 [P, Hkv, 2, nb]).

    Groups are packed in (page, head, K|V) order; ``slack`` extra 16-byte rows are put before each group so
    that tests see starts that are not the packed ones.
    """
    p, _, ps, hkv, d = kv_cache.shape
    groups = kv_cache.permute(0, 3, 1, 2, 4).reshape(p * hkv * 2, ps * d).contiguous()
    e = zf.encode_groups(groups, block_size, version)
    nb = ps * d // block_size
    starts = e.starts
    pool = e.data
    if slack:
        sizes = zb.block_sizes(e.desc, block_size).sum(1)
        new_starts = torch.cumsum(sizes + 16 * slack, 0) - sizes
        pool = torch.zeros(int(new_starts[-1] + sizes[-1]) if len(sizes) else 0, dtype=torch.uint8,
                           device=kv_cache.device)
        for i in range(len(sizes)):  # small test shapes only
            pool[new_starts[i]:new_starts[i] + sizes[i]] = e.data[starts[i]:starts[i] + sizes[i]]
        starts = new_starts
    return pool, starts.view(p, hkv, 2), e.desc.view(p, hkv, 2, nb)


def decode_pages(pool: torch.Tensor, group_start: torch.Tensor, group_desc: torch.Tensor, page_size: int,
                 head_dim: int, block_size: int = 512) -> torch.Tensor:
    """Inverse of :func:`encode_pages` with the format's torch decoder: NHD bf16 [P, 2, PS, Hkv, D]."""
    p, hkv = group_start.shape[:2]
    desc = group_desc.reshape(-1, group_desc.shape[-1])
    offsets = zb.offsets_from_starts(group_start.reshape(-1), desc, block_size)
    bits = zb.unpack(pool, desc, offsets, block_size)  # [G * nb, block]
    x = bits.view(torch.bfloat16).view(p, hkv, 2, page_size, head_dim)
    return x.permute(0, 2, 3, 1, 4).contiguous()


def decode_attention_f64(q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                         kv_last_page_len: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
    """float64 decode attention of q [B, Hq, D] over NHD pages through a FlashInfer-style page table."""
    b, hq, d = q.shape
    hkv = kv_cache.shape[3]
    ps = kv_cache.shape[2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    out = torch.empty(b, hq, d, dtype=torch.float64, device=q.device)
    indptr = kv_indptr.tolist()
    last = kv_last_page_len.tolist()
    for i in range(b):
        pages = kv_indices[indptr[i]:indptr[i + 1]].long()
        n = (len(pages) - 1) * ps + last[i]
        kv = kv_cache[pages].double()  # [np, 2, PS, Hkv, D]
        k = kv[:, 0].reshape(-1, hkv, d)[:n]
        v = kv[:, 1].reshape(-1, hkv, d)[:n]
        qi = q[i].double().view(hkv, hq // hkv, d)
        s = torch.einsum("hgd,thd->hgt", qi, k) * scale
        out[i] = torch.einsum("hgt,thd->hgd", torch.softmax(s, -1), v).reshape(hq, d)
    return out
