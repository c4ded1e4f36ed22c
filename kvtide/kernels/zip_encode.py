"""Triton encode kernels for ZipFusion pages (format: :mod:`kvtide.cache.zip_format`).

Two launches, one program per block: ``analyze`` writes each block's descriptor; the block offsets then
come from a torch cumsum (``zip_blocks.layout``, or a caller's own placement); ``pack`` writes each block's
bytes. The output is byte-identical to the torch reference ``zip_format.encode_groups``. The kernels know
groups, blocks and offsets only. Kernels are built on first use, so setting ``TRITON_INTERPRET=1`` any time
before the first call runs them in the interpreter (CPU tensors).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from kvtide.cache import zip_blocks as zb
from kvtide.cache import zip_format as zf

from .interpret import triton_interpret

reference = zf.encode_groups  # the torch reference these kernels must match byte for byte


def _analyze_kernel(x_ptr, desc_ptr, BLOCK: tl.constexpr, VERSION: tl.constexpr):
    """desc[pid] for block pid of x (int16 view of BF16); same rules as zip_blocks.analyze."""
    pid = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    u = tl.load(x_ptr + pid.to(tl.int64) * BLOCK + i).to(tl.int32) & 0xFFFF
    e = (u >> 7) & 0xFF
    base = tl.min(e, axis=0) & 0xFE
    v1 = (tl.max(e, axis=0) - base) <= 15
    desc = tl.where(v1, base >> 1, 0xFF)
    if VERSION == 2:
        nz = (u & 0x7FFF) != 0
        emin = tl.min(tl.where(nz, e, 255), axis=0)
        emax = tl.max(tl.where(nz, e, 0), axis=0)
        b = tl.minimum(emin & 0xFE, 252)
        esc = (emax - b) <= 13
        desc = tl.where(v1, desc, tl.where(esc, 0x80 | (b >> 1), 0xFF))
    tl.store(desc_ptr + pid, desc.to(tl.uint8))


def _pack_kernel(x_ptr, desc_ptr, off_ptr, out16_ptr, out32_ptr, BLOCK: tl.constexpr):
    """Write block pid at byte off[pid] of out (viewed as int16/int32), raw or compressed."""
    pid = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    desc = tl.load(desc_ptr + pid).to(tl.int32)
    off = tl.load(off_ptr + pid)  # int64, a multiple of 16
    xs = tl.load(x_ptr + pid.to(tl.int64) * BLOCK + i)
    desc_v = tl.zeros([BLOCK], tl.int32) + desc  # per-lane copy: masks must be full tensors
    tl.store(out16_ptr + off // 2 + i, xs, mask=desc_v == 0xFF)

    u = xs.to(tl.int32) & 0xFFFF
    e = (u >> 7) & 0xFF
    d = (e - (desc & 0x7F) * 2) >> 1
    zero = ((desc & 0x80) != 0) & ((u & 0x7FFF) == 0)
    nib = ((u >> 12) & 8) | tl.where(zero, 7, d)
    q = tl.arange(0, 4)
    lpos = ((q & 1) << 1) | (q >> 1)  # low plane: l0 l2 l1 l3 per 4 values, one int32 word
    lo4 = tl.reshape((u & 0xFF).to(tl.uint32), (BLOCK // 4, 4))
    low = tl.sum(lo4 << (8 * lpos).to(tl.uint32)[None, :], axis=1)
    v = tl.arange(0, BLOCK // 4)
    comp_v = (tl.zeros([BLOCK // 4], tl.int32) + desc) != 0xFF
    tl.store(out32_ptr + off // 4 + v, low.to(tl.int32, bitcast=True), mask=comp_v)

    j = tl.arange(0, 8)
    slot = (j >> 1) + 4 * (j & 1)  # even values in slots 0-3, odd in 4-7
    nib8 = tl.reshape(nib.to(tl.uint32), (BLOCK // 8, 8))
    word = tl.sum(nib8 << (4 * slot).to(tl.uint32)[None, :], axis=1)  # disjoint fields: sum == or
    w = tl.arange(0, BLOCK // 8)
    comp_w = (tl.zeros([BLOCK // 8], tl.int32) + desc) != 0xFF
    tl.store(out32_ptr + (off + BLOCK) // 4 + w, word.to(tl.int32, bitcast=True), mask=comp_w)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """JIT the kernels now that the TRITON_INTERPRET setting is final."""
    return SimpleNamespace(analyze=triton.jit(_analyze_kernel), pack=triton.jit(_pack_kernel))


def _get_kernels(device: torch.device) -> SimpleNamespace:
    interpret = triton_interpret()
    if device.type != "cuda" and not interpret:
        raise RuntimeError("Triton zip kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    return _kernels(interpret)


def _check_groups(x: torch.Tensor, block_size: int, version: int) -> None:
    zf.check_input(x, block_size)
    if x.dim() != 2:
        raise ValueError(f"groups must be a 2-D [G, n] tensor, got shape {tuple(x.shape)}")
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton kernels need a power-of-two block_size, got {block_size}")
    if version not in zf.VERSIONS:
        raise ValueError(f"unknown ZipFusion format version {version!r}")


def analyze(x: torch.Tensor, block_size: int = 512, version: int = zf.FORMAT_VERSION) -> torch.Tensor:
    """Descriptors [G, n / block_size] (uint8) of groups ``x`` [G, n] BF16."""
    _check_groups(x, block_size, version)
    g, n = x.shape
    desc = torch.empty(g * n // block_size, dtype=torch.uint8, device=x.device)
    if desc.numel():
        k = _get_kernels(x.device)
        k.analyze[(desc.numel(),)](x.view(torch.int16), desc, BLOCK=block_size, VERSION=version)
    return desc.view(g, n // block_size)


def pack(x: torch.Tensor, desc: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, block_size: int = 512,
         check: bool = True) -> None:
    """Write the blocks of groups ``x`` [G, n] into ``out`` (uint8) at byte ``offsets`` [G, n / block_size].

    ``check``: verify the offsets (aligned, inside ``out``) first; on a GPU that reads them back, three host syncs.
    A caller that placed the blocks itself and checked them on the host (the paged store) passes False."""
    _check_groups(x, block_size, zf.FORMAT_VERSION)
    offsets = offsets.reshape(-1).to(torch.int64).contiguous()
    desc = desc.reshape(-1).contiguous()
    if desc.numel() != x.numel() // block_size or offsets.numel() != desc.numel():
        raise ValueError("need one descriptor and one offset per block")
    if check:
        zb._check_buffer(out, offsets, zb.block_sizes(desc, block_size))
    else:
        zb._check_buffer_layout(out)
    if desc.numel():
        k = _get_kernels(x.device)
        k.pack[(desc.numel(),)](
            x.view(torch.int16), desc, offsets, out.view(torch.int16), out.view(torch.int32), BLOCK=block_size
        )


def encode_groups(x: torch.Tensor, block_size: int = 512, version: int = zf.FORMAT_VERSION) -> zf.Encoded:
    """GPU page compression: same result as ``zip_format.encode_groups`` (the reference)."""
    desc = analyze(x, block_size, version)
    starts, offsets, total = zb.layout(desc, block_size)
    data = torch.zeros(total, dtype=torch.uint8, device=x.device)
    pack(x, desc, offsets, data, block_size)
    return zf.Encoded(data, starts, desc, tuple(x.shape), block_size, version)
