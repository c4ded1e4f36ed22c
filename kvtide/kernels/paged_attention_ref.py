"""Torch reference paged attention over the FlashInfer NHD layout: kv_cache[num_pages, 2, page_size, kv_heads, head_dim].

Runs on CPU and GPU; it is the engine's CPU backend and the oracle for the Triton kernels. It gathers each
sequence's pages into a contiguous (padded) tensor and calls SDPA, so it is simple rather than fast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def kv_slots(page_ids: torch.Tensor, offsets: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of K and V in the flat view kv_cache.view(-1, kv_heads, head_dim) for (page, offset) pairs."""
    base = page_ids * (2 * page_size) + offsets
    return base, base + page_size


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new tokens' K/V. slot_mapping[t] = page * page_size + offset of token t."""
    page_size = kv_cache.shape[2]
    flat = kv_cache.view(-1, kv_cache.shape[3], kv_cache.shape[4])
    ks, vs = kv_slots(slot_mapping // page_size, slot_mapping % page_size, page_size)
    flat.index_copy_(0, ks, k.to(kv_cache.dtype))
    flat.index_copy_(0, vs, v.to(kv_cache.dtype))


def gather_pages(kv_cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole pages, one index per page (far cheaper than per-token indexing): [B, P] tables -> [B, P*page, Hk, D]."""
    b, n = block_tables.shape
    flat = block_tables.reshape(-1)
    shape = (b, n * kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4])
    k = kv_cache[:, 0].index_select(0, flat).view(shape).to(dtype)
    v = kv_cache[:, 1].index_select(0, flat).view(shape).to(dtype)
    return k, v


def decode_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         kv_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence. q: [B, Hq, D]; block_tables: [B, max_pages] (padding pages ignored past kv_lens)."""
    k, v = gather_pages(kv_cache, block_tables, q.dtype)  # [B, S, Hk, D]
    mask = torch.arange(k.shape[1], device=q.device)[None, :] < kv_lens[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
        scale=scale, enable_gqa=True,
    )
    return out[:, :, 0, :]


def prefill_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, pages: torch.Tensor, kv_len: int,
                          scale: float) -> torch.Tensor:
    """One sequence's chunk of queries: the last q.shape[0] of its kv_len tokens, causal. q: [Tq, Hq, D]."""
    page_size = kv_cache.shape[2]
    pos = torch.arange(kv_len, device=q.device)
    k, v = gather_pages(kv_cache, pages[None, : -(-kv_len // page_size)], q.dtype)
    k, v = k[0, :kv_len], v[0, :kv_len]  # [S, Hk, D]
    tq = q.shape[0]
    qpos = torch.arange(kv_len - tq, kv_len, device=q.device)
    mask = pos[None, :] <= qpos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask[None, None], scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)
