"""Value order inside a ZipFusion group: which of a page's [page_size, head_dim] values each stored slot holds.

The format (:mod:`kvtide.cache.zip_format`) cuts a group's values into blocks in *stored* order; this module says
what that order is. Two orders exist:

* ``token`` (the default): row-major [token, dim], value index = token * head_dim + dim. A 512-value block of a
  head_dim-128 group is 4 tokens x 128 dims. The Triton kernel and every torch path read this order.
* ``mma``: the CUDA decode kernel's order (:mod:`kvtide.kernels.zip_attention_cuda`). Page size 16, head_dim a
  multiple of 32, blocks of 512: block j holds dims [32j, 32j + 32) of all 16 tokens, and inside a block the 32
  lanes of a warp each own 16 consecutive values, exactly the bf16 fragments that lane feeds to two
  ``mma.m16n8k16`` instructions. Stored value ``v = j * 512 + lane * 16 + s`` (lane = 4 g + t, s = 8 h + e,
  k-step ``ks = 2 j + h``, fragment register r = e >> 1):
    - K (A operand of S^T = K Q^T, rows = tokens): token = g + 8 (r & 1), dim = 16 ks + 2 t + (e & 1) + 8 (r >> 1)
    - V (A operand of O^T = V^T P^T, rows = dims): dim = 16 ks + g + 8 (r & 1), token = 2 t + (e & 1) + 8 (r >> 1)
  So a lane reads its 16 values with one 16-byte load of the low plane and one 8-byte load of the code plane
  (two 16-byte loads for a raw block) and rebuilds them straight into MMA registers: no shuffle, no shared memory.
  Blocks of 16 tokens x 32 dims compress at least as often as 4 x 128 on the bundled models' real KV, since a key's
  outlier channels spoil fewer blocks (docs/design/pool.md).

The order is a property of a pool (``ZipGeometry.value_order``): it changes where ``write`` puts a token's values
and how ``read_pages`` gathers them back, nothing else (analysis, packing and compression see only stored order).
"""

from __future__ import annotations

import functools

import torch

ORDERS = ("token", "mma")


def check(order: str, page_size: int, head_dim: int, block_size: int) -> None:
    """Refuse, with the reason, an order the shape cannot take."""
    if order not in ORDERS:
        raise ValueError(f"unknown value order {order!r}; known: {ORDERS}")
    if order == "mma" and (page_size != 16 or head_dim % 32 or block_size != 512):
        raise ValueError(f"value order 'mma' needs page_size 16, head_dim a multiple of 32 and block_size 512, "
                         f"got page_size {page_size}, head_dim {head_dim}, block_size {block_size}")


@functools.cache
def _stored_to_natural(order: str, page_size: int, head_dim: int) -> torch.Tensor:
    n = page_size * head_dim
    if order == "token":
        return torch.arange(n).expand(2, n).contiguous()
    v = torch.arange(n)
    j, lane, s = v // 512, (v % 512) // 16, v % 16
    g, t, h, e = lane // 4, lane % 4, s // 8, s % 8
    r = e // 2
    ks = 2 * j + h
    rows = g + 8 * (r & 1)  # the A fragment's row inside the 16 x 16 tile
    cols = 2 * t + (e & 1) + 8 * (r >> 1)  # and its column
    k_nat = rows * head_dim + 16 * ks + cols  # K: rows are tokens
    v_nat = cols * head_dim + 16 * ks + rows  # V: rows are dims
    return torch.stack([k_nat, v_nat])


def stored_to_natural(order: str, page_size: int, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [2 (K, V), page_size * head_dim]: natural index (token * head_dim + dim) of each stored value."""
    check(order, page_size, head_dim, 512 if order == "mma" else 32)
    return _stored_to_natural(order, page_size, head_dim).to(device)


def natural_to_stored(order: str, page_size: int, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [2, page_size * head_dim]: stored position of each natural value (the inverse permutation)."""
    s2n = stored_to_natural(order, page_size, head_dim)
    inv = torch.empty_like(s2n)
    inv.scatter_(1, s2n, torch.arange(s2n.shape[1]).expand_as(s2n).contiguous())
    return inv.to(device)


def to_stored(groups: torch.Tensor, order: str, page_size: int, head_dim: int) -> torch.Tensor:
    """Groups in natural order [..., 2, page_size * head_dim] (K, V on the second-last axis) -> stored order."""
    idx = stored_to_natural(order, page_size, head_dim, groups.device)
    return torch.stack([groups[..., 0, :][..., idx[0]], groups[..., 1, :][..., idx[1]]], -2)


def to_natural(groups: torch.Tensor, order: str, page_size: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`to_stored`."""
    idx = natural_to_stored(order, page_size, head_dim, groups.device)
    return torch.stack([groups[..., 0, :][..., idx[0]], groups[..., 1, :][..., idx[1]]], -2)
