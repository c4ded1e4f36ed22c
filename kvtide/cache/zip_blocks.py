"""Batched block operations of the ZipFusion format: analyse, lay out, pack, unpack.

Every function works on many blocks at once with tensor ops (no Python loop over blocks), on CPU or GPU.
The byte arrangement they produce is specified in :mod:`kvtide.cache.zip_format`; this module is its
reference implementation, shared by the public API, the paged cache and the Triton kernels' tests.
Blocks arrive as ``int16`` views of BF16 (``[nblocks, block_size]``), so no float op ever touches a value.
"""

from __future__ import annotations

import sys

import torch

RAW = 0xFF  # descriptor of an uncompressed block (both versions)
ESCAPE = 0x80  # v2 descriptor flag: the block codes exact zeros apart (d = 7 means +-0)
MAX_ESCAPE_BASE = 252  # v2 escape base b <= 252, so that 0x80 | b/2 never collides with RAW
ALIGN = 16  # every block starts 16-byte aligned (128-bit loads in kernels); block_size % 32 == 0 keeps it

if sys.byteorder != "little":  # raw blocks and code words are little-endian views of memory
    raise ImportError("kvtide.cache.zip_blocks assumes a little-endian machine")


def compressed_nbytes(block_size: int) -> int:
    """Bytes of a compressed block: one low byte and one 4-bit code per value."""
    return block_size * 3 // 2


def raw_nbytes(block_size: int) -> int:
    return block_size * 2


def _u32(bits16: torch.Tensor) -> torch.Tensor:
    """int16 bit patterns -> int32 in [0, 65535]."""
    return bits16.to(torch.int32) & 0xFFFF


def analyze(bits16: torch.Tensor, version: int = 1) -> torch.Tensor:
    """One descriptor (uint8) per block of ``bits16`` [nblocks, block_size].

    v1: b = min(e) & ~1; compressed iff max(e) - b <= 15; descriptor b/2, else RAW.
    v2: as v1, and a block v1 refuses is coded with ESCAPE | b/2 when its non-zero exponents fit
    [b, b + 13] (b from the non-zeros, at most 252), leaving d = 7 free to mark +-0.
    """
    u = _u32(bits16)
    e = (u >> 7) & 0xFF
    base = e.amin(1) & ~1
    v1 = (e.amax(1) - base) <= 15
    desc = torch.where(v1, base >> 1, torch.full_like(base, RAW))
    if version == 2:
        nz = (u & 0x7FFF) != 0
        emin = torch.where(nz, e, torch.full_like(e, 255)).amin(1)
        emax = torch.where(nz, e, torch.zeros_like(e)).amax(1)
        b = (emin & ~1).clamp(max=MAX_ESCAPE_BASE)
        esc = ~v1 & ((emax - b) <= 13)
        desc = torch.where(esc, ESCAPE | (b >> 1), desc)
    return desc.to(torch.uint8)


def block_sizes(desc: torch.Tensor, block_size: int) -> torch.Tensor:
    """Stored bytes of each block (int64, same shape as ``desc``)."""
    raw = desc == RAW
    return torch.where(raw, raw_nbytes(block_size), compressed_nbytes(block_size)).to(torch.int64)


def layout(desc: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Packed placement of groups ``desc`` [G, nb]: (group starts [G], block offsets [G, nb], total bytes).

    Groups follow each other with no gap; a block's offset is its group's start plus the sizes of the
    blocks before it, which is how a kernel finds it from (start, descriptors) alone.
    """
    sizes = block_sizes(desc, block_size)
    group = sizes.sum(1)
    starts = group.cumsum(0) - group
    offsets = starts[:, None] + sizes.cumsum(1) - sizes
    return starts, offsets, int(group.sum())


def offsets_from_starts(starts: torch.Tensor, desc: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block offsets [G, nb] of groups placed at ``starts`` [G] (any placement, e.g. a cache's slots)."""
    sizes = block_sizes(desc, block_size)
    return starts.to(torch.int64)[:, None] + sizes.cumsum(1) - sizes


def _rows(offsets: torch.Tensor, nbytes: int) -> torch.Tensor:
    """(Used with index_select/index_copy_, several times faster than 2-D advanced indexing on CPU.)
    Indices of the ALIGN-byte rows that blocks at ``offsets`` occupy: [n, nbytes // ALIGN]."""
    ar = torch.arange(nbytes // ALIGN, device=offsets.device)
    return (offsets // ALIGN)[:, None] + ar


def _check_buffer_layout(buf: torch.Tensor) -> None:
    """The buffer itself (no offsets): host-side only, no device sync."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise TypeError("data buffer must be a contiguous 1-D uint8 tensor")
    if buf.numel() % ALIGN:
        raise ValueError(f"data buffer length must be a multiple of {ALIGN} bytes, got {buf.numel()}")


def _check_buffer(buf: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor) -> None:
    _check_buffer_layout(buf)
    if offsets.numel() == 0:
        return
    if bool((offsets % ALIGN != 0).any()):
        raise ValueError(f"block offsets must be multiples of {ALIGN} bytes")
    if bool((offsets < 0).any()) or int((offsets + sizes).max()) > buf.numel():
        raise ValueError("block offsets fall outside the data buffer")


def low_plane_order(block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Value index stored at each low-plane byte: bits 0 and 1 of the index swapped (an involution)."""
    i = torch.arange(block_size, device=device)
    return (i & ~3) | ((i & 1) << 1) | ((i >> 1) & 1)


def nibble_order(block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Value index stored at each code-plane nibble: per 8 values, slots 0-3 = even, 4-7 = odd values."""
    q = torch.arange(block_size, device=device)
    s = q & 7
    return (q & ~7) | ((s & 3) << 1) | (s >> 2)


def _encode_compressed(u: torch.Tensor, desc: torch.Tensor) -> torch.Tensor:
    """Compressed bytes [n, 1.5 B] of blocks ``u`` (int32 patterns) with descriptors ``desc``."""
    n, bsz = u.shape
    d8 = desc.to(torch.int32)[:, None]
    base = (d8 & 0x7F) << 1
    e = (u >> 7) & 0xFF
    d = (e - base) >> 1
    zero = ((d8 & ESCAPE) != 0) & ((u & 0x7FFF) == 0)
    nib = ((u >> 12) & 8) | torch.where(zero, 7, d)
    lo = (u & 0xFF).view(n, bsz // 4, 2, 2).transpose(2, 3).reshape(n, bsz)
    slots = nib.view(n, bsz // 8, 4, 2).transpose(2, 3).reshape(n, bsz // 2, 2)
    codes = slots[..., 0] | (slots[..., 1] << 4)
    return torch.cat([lo, codes], 1).to(torch.uint8)


def pack(bits16: torch.Tensor, desc: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor) -> None:
    """Write blocks ``bits16`` [n, B] into ``out`` (uint8) at byte ``offsets`` [n], as ``desc`` [n] says.

    ``out`` may be any buffer (a packed Encoded, or a cache's pool); bytes between blocks are untouched.
    Reads all of ``bits16`` before writing, so it is not safe when ``out`` aliases ``bits16``.
    """
    n, bsz = bits16.shape
    desc, offsets = desc.reshape(-1), offsets.reshape(-1).to(torch.int64)
    _check_buffer(out, offsets, block_sizes(desc, bsz))
    rows = out.view(-1, ALIGN)
    raw = desc == RAW
    if bool(raw.any()):
        rb = bits16[raw].contiguous().view(torch.uint8).view(-1, raw_nbytes(bsz) // ALIGN, ALIGN)
        rows.index_copy_(0, _rows(offsets[raw], raw_nbytes(bsz)).reshape(-1), rb.reshape(-1, ALIGN))
    comp = ~raw
    if bool(comp.any()):
        cb = _encode_compressed(_u32(bits16[comp]), desc[comp])
        rows.index_copy_(0, _rows(offsets[comp], compressed_nbytes(bsz)).reshape(-1), cb.reshape(-1, ALIGN))


def _decode_compressed(blob: torch.Tensor, desc: torch.Tensor) -> torch.Tensor:
    """int16 values [n, B] of compressed blocks ``blob`` [n, 1.5 B] (uint8)."""
    n = blob.shape[0]
    bsz = blob.shape[1] * 2 // 3
    b = blob.to(torch.int32)
    lo = b[:, :bsz].view(n, bsz // 4, 2, 2).transpose(2, 3).reshape(n, bsz)
    codes = b[:, bsz:]
    slots = torch.stack([codes & 0xF, codes >> 4], -1).view(n, bsz // 8, 2, 4)
    nib = slots.transpose(2, 3).reshape(n, bsz)
    d8 = desc.to(torch.int32)[:, None]
    sign = (nib & 8) << 12
    d = nib & 7
    x = sign | (((d8 & 0x7F) + d) << 8) | lo
    x = torch.where(((d8 & ESCAPE) != 0) & (d == 7), sign, x)
    return (x - ((x & 0x8000) << 1)).to(torch.int16)


def unpack(data: torch.Tensor, desc: torch.Tensor, offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """int16 values [n, block_size] of the blocks stored in ``data`` at ``offsets`` [n] with ``desc`` [n]."""
    desc, offsets = desc.reshape(-1), offsets.reshape(-1).to(torch.int64)
    _check_buffer(data, offsets, block_sizes(desc, block_size))
    out = torch.empty(desc.numel(), block_size, dtype=torch.int16, device=data.device)
    rows = data.view(-1, ALIGN)
    raw = desc == RAW
    if bool(raw.any()):
        rb = rows.index_select(0, _rows(offsets[raw], raw_nbytes(block_size)).reshape(-1))
        out[raw] = rb.reshape(-1, raw_nbytes(block_size)).view(torch.int16)
    comp = ~raw
    if bool(comp.any()):
        cb = rows.index_select(0, _rows(offsets[comp], compressed_nbytes(block_size)).reshape(-1))
        cb = cb.reshape(-1, compressed_nbytes(block_size))
        out[comp] = _decode_compressed(cb, desc[comp])
    return out


def rebuild_words(blob: torch.Tensor, desc: torch.Tensor) -> torch.Tensor:
    """The kernel's register rebuild, in torch: compressed blocks [n, 1.5 B] -> int32 words [n, B/2].

    Each output word is two adjacent BF16 values (low half = even index), exactly as a raw block's
    bytes read as int32. Per code word cw (8 values) and low-plane words la (values 0-3), lb (4-7):
    ``T_k = (cw << (8 - 4k)) & 0x0F000F00`` (k = 0..3; a negative shift is a right shift),
    ``W_k = T_k + 15 * (T_k & 0x08000800) + (b/2) * 0x01000100 + L_k`` with
    ``L_0 = la & 0x00FF00FF``, ``L_1 = (la >> 8) & 0x00FF00FF``, ``L_2``, ``L_3`` likewise from lb.
    v2 escape blocks add ``W_k -= ((T'_k + 0x01000100) & 0x08000800) >> 11) * ((b/2 + 7) << 8)``
    where T'_k = T_k + 15 * (T_k & 0x08000800) (d = 7 carries into bit 11; the zero's high byte is cleared).
    """
    n = blob.shape[0]
    bsz = blob.shape[1] * 2 // 3
    m32 = 0xFFFFFFFF
    words = blob.contiguous().view(torch.int32).to(torch.int64) & m32
    low = words[:, : bsz // 4].view(n, bsz // 8, 2)  # (la, lb) per 8 values
    cw = words[:, bsz // 4 :]  # [n, B/8]
    d8 = desc.to(torch.int64)[:, None]
    half_base = (d8 & 0x7F) * 0x01000100
    esc = (d8 & ESCAPE) != 0
    zero_k = ((d8 & 0x7F) + 7) << 8
    out = []
    for k in range(4):  # the four pairs of one 8-value group; vectorised over all blocks and groups
        sh = 8 - 4 * k
        t = ((cw << sh) if sh >= 0 else (cw >> -sh)) & 0x0F000F00
        t = (t + 15 * (t & 0x08000800)) & m32
        lw = low[..., k // 2]
        lk = ((lw >> 8) if k % 2 else lw) & 0x00FF00FF
        w = t + half_base + lk
        z = ((t + 0x01000100) & 0x08000800) >> 11
        w = torch.where(esc, w - z * zero_k, w)
        out.append(w & m32)
    w = torch.stack(out, -1).reshape(n, bsz // 2)
    return (w - ((w & 0x80000000) << 1)).to(torch.int32)
