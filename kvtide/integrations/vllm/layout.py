"""vLLM's paged KV of one layer to and from the store's entries ([2, tokens, kv_heads, head_dim], K then V).

vLLM 0.32 hands the connector each layer's cache as a ``[num_blocks, num_kv_heads, block_size, C]`` tensor (its
standardised per-layer view), but the backends fill C differently, so one indexing rule cannot serve both:

* ``cpu`` (vLLM's CPU backend, ``CPU_ATTN``): C = 2 * head_size, and the memory of one (block, head) holds K as
  ``[head_size, block_size]`` (transposed: dimension-major, for the kernel's dot products) and then V as
  ``[block_size, head_size]``. Row n of the tensor is therefore not token n's K and V. Read off the kernel's own
  writes (``ops.cpu_attn_reshape_and_cache``, ISAs ``vec`` and ``vec16``); the connector repeats that check when
  vLLM registers its caches (``check_cpu_kernel``), so an ISA that packs K otherwise (AMX) fails at start-up
  instead of loading misplaced values.
* ``gpu`` (``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``, ``FLEX_ATTENTION``): row n holds token n's K in
  ``C[:head_size]`` and its V in ``C[C/2:C/2 + head_size]`` (C/2 may be a padded head size); the physical strides
  may put tokens outside heads, which indexing does not care about.

Entries are kept in the layout-free form, so a store written by one backend is read by the other, and the
ZipFusion codec sees K and V planes as kvtide's own engine does. Token positions become (block, offset) pairs
through the request's block table (``slots``); any token range works, not only whole blocks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch

CPU_BACKENDS = frozenset({"CPU_ATTN"})
GPU_BACKENDS = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"})


def slots(start: int, end: int, block_ids: Sequence[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset in block) of token positions [start, end) of a request whose block table is
    ``block_ids``; raises ValueError when the table does not reach ``end``."""
    if not 0 <= start <= end:
        raise ValueError(f"token range [{start}, {end}) is not a range")
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if end > len(block_ids) * block_size:
        raise ValueError(f"tokens up to {end} need {-(-end // block_size)} blocks, the request has {len(block_ids)}")
    pos = torch.arange(start, end, dtype=torch.int64)
    table = torch.as_tensor(list(block_ids), dtype=torch.int64)
    return table[pos // block_size], pos % block_size


class Placement:
    """Where tokens [start, end) of a request lie in its blocks: the whole blocks between (moved one block at a
    time) and the partial blocks at either end (moved token by token)."""

    def __init__(self, start: int, end: int, block_ids: Sequence[int], block_size: int,
                 device: torch.device | str = "cpu") -> None:
        self.start, self.end = start, end
        bs = block_size
        lo, hi = -(-start // bs) * bs, (end // bs) * bs
        self.parts: list[tuple[slice, torch.Tensor, torch.Tensor | None]] = []  # (tokens of the entry, where)
        if lo >= hi:
            b, o = slots(start, end, block_ids, bs)
            self.parts.append((slice(0, end - start), b.to(device), o.to(device)))
            return
        for a, z in ((start, lo), (hi, end)):
            if z > a:
                b, o = slots(a, z, block_ids, bs)
                self.parts.append((slice(a - start, z - start), b.to(device), o.to(device)))
        if end > len(block_ids) * bs:
            raise ValueError(f"tokens up to {end} need {-(-end // bs)} blocks, the request has {len(block_ids)}")
        ids = torch.as_tensor(list(block_ids[lo // bs:hi // bs]), dtype=torch.int64, device=device)
        self.parts.append((slice(lo - start, hi - start), ids, None))

    def scatter(self, layout: "PagedLayout", cache: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` ([2, end - start, heads, head_dim]) to the tokens' places."""
        for span, where, offsets in self.parts:
            if offsets is None:
                layout.scatter_blocks(cache, where, kv[:, span])
            else:
                layout.scatter(cache, where, offsets, kv[:, span])

    def gather(self, layout: "PagedLayout", cache: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The tokens' KV as a new [2, end - start, heads, head_dim] tensor."""
        out = torch.empty(2, self.end - self.start, cache.shape[1], head_dim, dtype=cache.dtype, device=cache.device)
        for span, where, offsets in self.parts:
            out[:, span] = (layout.gather_blocks(cache, where, head_dim) if offsets is None
                            else layout.gather(cache, where, offsets, head_dim))
        return out


class PagedLayout(ABC):
    """How one backend keeps a layer's KV; ``gather`` and ``scatter`` move tokens between it and entries."""

    name: str = ""

    def check(self, cache: torch.Tensor, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        """Raise ValueError unless ``cache`` is a layer of this layout for these shapes."""
        if cache.dim() != 4:
            raise ValueError(f"{self.name} layout: a layer's KV is [blocks, kv_heads, block_size, C], got "
                             f"{tuple(cache.shape)}")
        _, h, n, c = cache.shape
        if h != num_kv_heads or n != block_size or c < 2 * head_dim or c % 2:
            raise ValueError(f"{self.name} layout: KV {tuple(cache.shape)} does not hold {num_kv_heads} heads of "
                             f"{head_dim} values in blocks of {block_size} tokens")

    @abstractmethod
    def gather(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
               head_dim: int) -> torch.Tensor:
        """The KV of the tokens at (``blocks``, ``offsets``) as a new [2, T, kv_heads, head_dim] tensor."""

    @abstractmethod
    def scatter(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` ([2, T, kv_heads, head_dim]) to the tokens at (``blocks``, ``offsets``)."""

    @abstractmethod
    def gather_blocks(self, cache: torch.Tensor, ids: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The KV of whole blocks ``ids`` (in order) as a new [2, len(ids) * block_size, kv_heads, head_dim]."""

    @abstractmethod
    def scatter_blocks(self, cache: torch.Tensor, ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` ([2, len(ids) * block_size, kv_heads, head_dim]) to whole blocks ``ids``: one strided copy
        per plane, several times faster than addressing every token (the CPU layout's K plane is transposed)."""


class CpuLayout(PagedLayout):
    """vLLM's CPU backend: per (block, head), K as [head_dim, block_size], then V as [block_size, head_dim]."""

    name = "cpu"

    def check(self, cache: torch.Tensor, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().check(cache, num_kv_heads, head_dim, block_size)
        if cache.shape[3] != 2 * head_dim:
            raise ValueError(f"cpu layout: C is {cache.shape[3]}, expected 2 * head_dim = {2 * head_dim}")
        if not cache.is_contiguous():
            raise ValueError("cpu layout: the CPU backend's KV is contiguous; this tensor is not")

    @staticmethod
    def planes(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views K [blocks, heads, head_dim, block_size] and V [blocks, heads, block_size, head_dim]."""
        b, h, n, c = cache.shape
        d = c // 2
        flat = cache.view(b, h, n * c)
        return flat[..., :n * d].view(b, h, d, n), flat[..., n * d:].view(b, h, n, d)

    def gather(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
               head_dim: int) -> torch.Tensor:
        k, v = self.planes(cache)
        return torch.stack((k[blocks, :, :, offsets], v[blocks, :, offsets]))  # each [T, heads, head_dim]

    def scatter(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, kv: torch.Tensor) -> None:
        k, v = self.planes(cache)
        kv = kv.to(device=cache.device, dtype=cache.dtype)
        k[blocks, :, :, offsets] = kv[0]
        v[blocks, :, offsets] = kv[1]

    def gather_blocks(self, cache: torch.Tensor, ids: torch.Tensor, head_dim: int) -> torch.Tensor:
        k, v = self.planes(cache)
        nb, n, h = ids.numel(), cache.shape[2], cache.shape[1]
        return torch.stack((k[ids].permute(0, 3, 1, 2).reshape(nb * n, h, head_dim),
                            v[ids].permute(0, 2, 1, 3).reshape(nb * n, h, head_dim)))

    def scatter_blocks(self, cache: torch.Tensor, ids: torch.Tensor, kv: torch.Tensor) -> None:
        k, v = self.planes(cache)
        nb, n = ids.numel(), cache.shape[2]
        x = kv.to(device=cache.device, dtype=cache.dtype).view(2, nb, n, kv.shape[2], kv.shape[3])
        k[ids] = x[0].permute(0, 2, 3, 1)  # [blocks, heads, head_dim, block_size]
        v[ids] = x[1].permute(0, 2, 1, 3)  # [blocks, heads, block_size, head_dim]


class GpuLayout(PagedLayout):
    """vLLM's CUDA backends: row n of a block is token n, K in C[:head_dim], V in C[C/2:C/2 + head_dim]."""

    name = "gpu"

    def gather(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
               head_dim: int) -> torch.Tensor:
        x = cache[blocks, :, offsets]  # [T, heads, C]
        half = cache.shape[3] // 2
        return torch.stack((x[..., :head_dim], x[..., half:half + head_dim]))

    def scatter(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, kv: torch.Tensor) -> None:
        half, d = cache.shape[3] // 2, kv.shape[3]
        kv = kv.to(device=cache.device, dtype=cache.dtype)
        if half == d:
            t, h = kv.shape[1], kv.shape[2]
            cache[blocks, :, offsets] = kv.permute(1, 2, 0, 3).reshape(t, h, 2 * d)
            return
        cache[..., :d][blocks, :, offsets] = kv[0]  # padded head size: write K and V, leave the padding
        cache[..., half:half + d][blocks, :, offsets] = kv[1]

    def gather_blocks(self, cache: torch.Tensor, ids: torch.Tensor, head_dim: int) -> torch.Tensor:
        x = cache[ids]  # [blocks, heads, block_size, C]
        nb, h, n, c = x.shape
        half = c // 2
        return torch.stack((x[..., :head_dim].transpose(1, 2).reshape(nb * n, h, head_dim),
                            x[..., half:half + head_dim].transpose(1, 2).reshape(nb * n, h, head_dim)))

    def scatter_blocks(self, cache: torch.Tensor, ids: torch.Tensor, kv: torch.Tensor) -> None:
        nb, n, half, d = ids.numel(), cache.shape[2], cache.shape[3] // 2, kv.shape[3]
        x = kv.to(device=cache.device, dtype=cache.dtype).view(2, nb, n, kv.shape[2], d).transpose(2, 3)
        if half == d:
            cache[ids] = torch.cat((x[0], x[1]), dim=-1)  # [blocks, heads, block_size, 2 * head_dim]
            return
        cache[..., :d][ids] = x[0]
        cache[..., half:half + d][ids] = x[1]


LAYOUTS: dict[str, type[PagedLayout]] = {"cpu": CpuLayout, "gpu": GpuLayout}


def layout_for_backend(backend: str) -> str:
    """The layout name of a vLLM attention backend (its ``get_name()``); ValueError for one not handled."""
    if backend in CPU_BACKENDS:
        return "cpu"
    if backend in GPU_BACKENDS:
        return "gpu"
    raise ValueError(f"kvtide's connector does not know the KV layout of vLLM's {backend!r} attention backend "
                     f"(known: {', '.join(sorted(CPU_BACKENDS | GPU_BACKENDS))}); set kv_layout to 'cpu' or "
                     f"'gpu' in kv_connector_extra_config if it keeps KV as one of those")


def get_layout(name: str) -> PagedLayout:
    try:
        return LAYOUTS[name]()
    except KeyError:
        raise ValueError(f"unknown KV layout {name!r}; one of {', '.join(LAYOUTS)}") from None
