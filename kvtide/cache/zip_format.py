"""ZipFusion lossless 12-bit BF16 format (ZipFusion paper, section III-B), versions 1 and 2.

Values are cut into blocks of ``block_size`` (default 512, a multiple of 32) in the tensor's flat order.
For a BF16 pattern x: sign s = bit 15, exponent e = bits 14..7, low byte l = bits 7..0 (7 fraction bits and
the exponent's lowest bit r). A block's base b = min(e) rounded down to even; the block is *compressed* iff
every e lies in [b, b + 15]; each value then keeps l and a 4-bit code n = s << 3 | d, d = (e - b) >> 1.
Rebuild: e = b + 2d + r, i.e. ``x = s << 15 | (b/2 + d) << 8 | l`` (b/2 + d <= 127, so no carry).

Block bytes (little-endian; value i = i-th value of the block; a block starts 16-byte aligned)
----------------------------------------------------------------------------------------------
* raw block, 2B bytes: the BF16 values as stored, value i at bytes 2i, 2i+1.
* compressed block, 1.5B bytes = low plane (B bytes) then code plane (B/2 bytes):
  - low plane: byte p holds l of value p with bits 0 and 1 of p swapped, i.e. each 4 values are stored
    as l0 l2 l1 l3. Read as an int32 word la, ``la & 0x00FF00FF`` is the low bytes of the pair (v0, v1)
    already in their BF16-pair positions, and ``(la >> 8) & 0x00FF00FF`` those of (v2, v3).
  - code plane: one little-endian int32 word per 8 values v0..v7, nibble slot k = bits 4k..4k+3 holding
    slots 0-3 = n(v0) n(v2) n(v4) n(v6) and slots 4-7 = n(v1) n(v3) n(v5) n(v7) (byte 0 = n(v0) | n(v2) << 4).
    Pair k = (v2k, v2k+1) has its codes 16 bits apart, so ``(cw << (8 - 4k)) & 0x0F000F00`` puts both
    under their high bytes at once.

Why this arrangement: a Triton decode kernel loads a [tokens x head_dim] tile of a page with coalesced
int32 loads of the two planes (a block of 512 is 4 tokens x 128 or 8 x 64, in row order) and rebuilds two
BF16 values per 32-bit lane, with no byte shuffles, in about 3 integer ops per value:
``W = T + 15 * (T & 0x08000800) + (b/2) * 0x01000100 + L`` (the multiply moves the sign from bit 11 to 15).
W is exactly the int32 a raw block gives at that place, so raw and compressed blocks feed the same
``tl.join``/``reshape``/bitcast into a bf16 [tokens, head_dim] tile (reference: ``zip_blocks.rebuild_words``).

Metadata and versions
---------------------
Per group: ``start`` (int64 byte offset of its first block in ``data``) and one uint8 descriptor per
block: ``0xFF`` raw, ``0x00..0x7F`` compressed with b = 2 * desc. A block's offset is the start plus the
sizes of the blocks before it (1.5B compressed, 2B raw). ``Encoded.version`` is the format version,
carried with ``block_size`` in an 8-byte header (``Encoded.header``) counted in ``nbytes``.

* version 1 (default): as above.
* version 2 adds exact-zero escape blocks, descriptor ``0x80 | b/2`` (b <= 252): a block v1 refuses is
  still compressed when its *non-zero* exponents lie in [b, b + 13], b from the non-zeros; code d = 7
  then means +-0 (sign in n's bit 3, low byte 0). v1 blocks keep their v1 bytes, so a v1 stream decodes
  under v2 rules; v1-only readers refuse v2 descriptors. Kernel cost: only escape blocks pay, a
  block-uniform branch on the descriptor's top bit plus about 2 integer ops per value.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from kvtide.cache import zip_blocks as zb

FORMAT_VERSION = 1
VERSIONS = (1, 2)
HEADER_NBYTES = 8  # struct "<HHI": version, reserved, block_size


@dataclass(frozen=True)
class Encoded:
    """G groups of equal length, each a sequence of blocks, packed back to back in ``data``."""

    data: torch.Tensor  # uint8 [total bytes]
    starts: torch.Tensor  # int64 [G]: byte offset of each group's first block
    desc: torch.Tensor  # uint8 [G, blocks per group]
    shape: tuple[int, ...]  # shape decode() returns
    block_size: int
    version: int = FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        """Bytes of data plus metadata (header, starts, descriptors)."""
        meta = self.starts.numel() * self.starts.element_size() + self.desc.numel() * self.desc.element_size()
        return self.data.numel() + meta + HEADER_NBYTES

    @property
    def raw_nbytes(self) -> int:
        return self.desc.numel() * zb.raw_nbytes(self.block_size)

    @property
    def compressed_fraction(self) -> float:
        """Fraction of blocks stored compressed."""
        n = self.desc.numel()
        return float((self.desc != zb.RAW).sum()) / n if n else 0.0

    def header(self) -> bytes:
        return struct.pack("<HHI", self.version, 0, self.block_size)


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size <= 0 or block_size % 32:
        raise ValueError(f"block_size must be a positive multiple of 32, got {block_size}")


def _check_version(version: int) -> None:
    if version not in VERSIONS:
        raise ValueError(f"unknown ZipFusion format version {version!r}; known: {VERSIONS}")


def check_input(x: torch.Tensor, block_size: int) -> None:
    """Refuse, with the reason, anything the format cannot hold bit-exactly."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"ZipFusion encodes bfloat16 tensors only, got {x.dtype}")
    _check_block_size(block_size)
    if not x.is_contiguous():
        raise ValueError("tensor must be contiguous (call .contiguous() first)")
    if x.numel() % block_size:
        raise ValueError(f"element count {x.numel()} is not a multiple of block_size {block_size}")


def encode(x: torch.Tensor, block_size: int = 512, version: int = FORMAT_VERSION) -> Encoded:
    """Encode a contiguous BF16 tensor (numel a multiple of ``block_size``) as one group."""
    check_input(x, block_size)
    e = encode_groups(x.view(1, -1), block_size, version)
    return Encoded(e.data, e.starts, e.desc, tuple(x.shape), block_size, e.version)


def encode_groups(x: torch.Tensor, block_size: int = 512, version: int = FORMAT_VERSION) -> Encoded:
    """Encode G equal groups ``x`` [G, n] (n a multiple of ``block_size``) into one packed buffer."""
    check_input(x, block_size)
    _check_version(version)
    if x.dim() != 2:
        raise ValueError(f"groups must be a 2-D [G, n] tensor, got shape {tuple(x.shape)}")
    g, n = x.shape
    bits = x.view(torch.int16).reshape(-1, block_size)
    desc = zb.analyze(bits, version).view(g, n // block_size)
    starts, offsets, total = zb.layout(desc, block_size)
    data = torch.zeros(total, dtype=torch.uint8, device=x.device)
    zb.pack(bits, desc, offsets, data)
    return Encoded(data, starts, desc, (g, n), block_size, version)


def check_encoded(e: Encoded) -> None:
    """Refuse metadata that cannot have come from this format (corrupt or another version)."""
    _check_version(e.version)
    _check_block_size(e.block_size)
    g = e.starts.numel()
    nb = e.desc.shape[-1] if e.desc.dim() else 0
    numel = 1
    for s in e.shape:
        numel *= s
    if e.desc.dtype != torch.uint8 or e.desc.dim() != 2 or e.desc.shape[0] != g:
        raise ValueError("descriptors must be uint8 [G, blocks per group] matching starts")
    if numel != g * nb * e.block_size:
        raise ValueError(f"shape {e.shape} does not match {g} groups x {nb} blocks of {e.block_size}")
    if e.version == 1 and bool(((e.desc & zb.ESCAPE != 0) & (e.desc != zb.RAW)).any()):
        raise ValueError("version-1 data holds version-2 (zero-escape) descriptors")


def decode(e: Encoded) -> torch.Tensor:
    """Bit-identical BF16 tensor of shape ``e.shape``."""
    check_encoded(e)
    offsets = zb.offsets_from_starts(e.starts, e.desc, e.block_size)
    bits = zb.unpack(e.data, e.desc, offsets, e.block_size)
    return bits.view(torch.bfloat16).reshape(e.shape)


decode_groups = decode  # an Encoded from encode_groups decodes to [G, n]
