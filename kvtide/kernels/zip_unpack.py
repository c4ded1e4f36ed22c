"""Triton decode of ZipFusion blocks into plain BF16 (format: :mod:`kvtide.cache.zip_format`).

The attention kernels never decode to memory; this one does, on purpose: a restoration loads store entries kept in
the format (fewer bytes over the link, :mod:`kvtide.store.zip_entry`) and must write plain KV into the pages of
a backend that reads raw pages (FlashInfer). One program per block, one launch for every block of a fetch, no host
sync (the torch reference ``zip_blocks.unpack`` syncs on its masks). Byte-identical to that reference. Built on first
use, so ``TRITON_INTERPRET=1`` set before the first call runs it in the interpreter (CPU tensors).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvtide.cache import zip_blocks as zb

from .interpret import triton_interpret

reference = zb.unpack  # the torch reference this kernel must match bit for bit


def _unpack_kernel(data8_ptr, data16_ptr, desc_ptr, off_ptr, out_ptr, BLOCK: tl.constexpr):
    """out[pid] = the BLOCK int16 values of the block at byte off[pid] of data, raw or compressed (desc[pid])."""
    pid = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    desc = tl.load(desc_ptr + pid).to(tl.int32)
    off = tl.load(off_ptr + pid)  # int64 byte offset, a multiple of 16
    raw_v = (tl.zeros([BLOCK], tl.int32) + desc) == 0xFF  # masks must be full tensors
    raw = tl.load(data16_ptr + off // 2 + i, mask=raw_v, other=0).to(tl.int32) & 0xFFFF
    # low plane: value i's low byte sits at i with bits 0 and 1 swapped; code plane: per 8 values, even values in
    # nibble slots 0-3, odd in 4-7, two slots per byte (low nibble first)
    lpos = (i & ~3) | ((i & 1) << 1) | ((i >> 1) & 1)
    lo = tl.load(data8_ptr + off + lpos, mask=~raw_v, other=0).to(tl.int32) & 0xFF
    q = (i & ~7) | (((i & 7) >> 1) + 4 * (i & 1))
    cb = tl.load(data8_ptr + off + BLOCK + (q >> 1), mask=~raw_v, other=0).to(tl.int32) & 0xFF
    nib = (cb >> (4 * (q & 1))) & 0xF
    sign = (nib & 8) << 12
    d = nib & 7
    x = sign | (((desc & 0x7F) + d) << 8) | lo
    x = tl.where(((desc & 0x80) != 0) & (d == 7), sign, x)  # v2 escape: d = 7 codes +-0
    x = tl.where(raw_v, raw, x)
    tl.store(out_ptr + pid.to(tl.int64) * BLOCK + i, (x - ((x & 0x8000) << 1)).to(tl.int16))


@functools.cache
def _kernel(interpret: bool):
    """JIT the kernel now that the TRITON_INTERPRET setting is final."""
    return triton.jit(_unpack_kernel)


def triton_usable(device: torch.device) -> bool:
    """Whether the kernel can run on ``device`` here (CUDA, or any device under the Triton interpreter)."""
    return device.type == "cuda" or triton_interpret()


def unpack(data: torch.Tensor, desc: torch.Tensor, offsets: torch.Tensor, block_size: int = 512,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """int16 values [n, block_size] of the blocks of ``data`` (uint8) at byte ``offsets`` [n] with ``desc`` [n].

    The caller vouches for the offsets (aligned, inside ``data``: the store checked the descriptors and lengths of
    what it hands over); reading them back here would cost a host sync per call. Elsewhere than CUDA without the
    interpreter this is the torch reference (which does check them)."""
    desc = desc.reshape(-1).contiguous()
    offsets = offsets.reshape(-1).to(torch.int64).contiguous()
    if desc.numel() != offsets.numel():
        raise ValueError(f"need one offset per descriptor, got {offsets.numel()} and {desc.numel()}")
    if block_size <= 0 or block_size % 32 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two and a multiple of 32, got {block_size}")
    zb._check_buffer_layout(data)
    if out is None:
        out = torch.empty(desc.numel(), block_size, dtype=torch.int16, device=data.device)
    elif out.dtype != torch.int16 or out.numel() != desc.numel() * block_size or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int16 tensor of {desc.numel() * block_size} values")
    if not triton_usable(data.device):
        out.view(-1, block_size).copy_(reference(data, desc, offsets, block_size))
        return out.view(-1, block_size)
    if desc.numel():
        _kernel(data.device.type != "cuda")[(desc.numel(),)](
            data, data.view(torch.int16), desc, offsets, out, BLOCK=block_size)
    return out.view(-1, block_size)
