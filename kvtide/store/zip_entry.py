"""Store entries kept in the ZipFusion format (lossless, 12 bits per BF16 value where a block allows).

Why: a restoration's loads are bound by the link (on a GPU, moving a long prefix's KV over a 10 Gbps link takes
several times as long as recomputing it), so every byte an entry does not carry moves the CacheFlow balance point
toward loading. The format is the resident one
(:mod:`kvtide.cache.zip_format`, v1, 512-value blocks): encoded on the GPU where the finished request's KV already is
(``encode_entries``: the Triton analyse and pack kernels into fixed-size slots, no host sync), decoded on the GPU by
one launch per fetch (:mod:`kvtide.kernels.zip_unpack`), so no host core touches a value either way.

Payload of a ``codec: "zip1"`` record (``kvtide.store.base``): the ``nb`` block descriptors, zero-padded to 16
bytes, then the packed blocks (compressed 768 B, raw 1024 B per 512 values, back to back). The record's dtype and
shape are those of the decoded KV; its checksum covers the payload like any other.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvtide.cache import zip_blocks as zb
from kvtide.cache import zip_format as zf

CODEC = "zip1"
BLOCK_SIZE = 512


def _pad16(n: int) -> int:
    return -(-n // zb.ALIGN) * zb.ALIGN


class ZipEntry:
    """One entry's KV as descriptors ``desc`` (uint8 [nb]) and blocks ``data`` (uint8; packed from byte 0, possibly
    followed by unused bytes of a fixed-size slot). ``span``: desc, padding and data as one contiguous byte view
    (entries read from a record: one copy moves the whole payload; desc and data are then sliced from it when first
    asked for, since the executor's device path never needs them on the host)."""

    __slots__ = ("shape", "block_size", "span", "num_blocks", "_desc", "_data")
    dtype = torch.bfloat16

    def __init__(self, desc: torch.Tensor | None, data: torch.Tensor | None, shape: tuple[int, ...],
                 block_size: int = BLOCK_SIZE, span: torch.Tensor | None = None) -> None:
        if (desc is None or data is None) and span is None:
            raise ValueError("a ZipEntry needs desc and data, or the span holding both")
        self.shape = tuple(shape)
        self.block_size = block_size
        self.span = span
        self.num_blocks = desc.numel() if desc is not None else math.prod(self.shape) // block_size
        self._desc, self._data = desc, data

    @property
    def desc(self) -> torch.Tensor:
        if self._desc is None:
            self._desc = self.span[:self.num_blocks]
        return self._desc

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            self._data = self.span[_pad16(self.num_blocks):]
        return self._data

    def packed_nbytes(self) -> int:
        """Bytes of the packed blocks (host read of the descriptors)."""
        d = self.desc.cpu().numpy() if self.desc.device.type != "cpu" else self.desc.numpy()
        raw = int(np.count_nonzero(d == zb.RAW))
        return raw * zb.raw_nbytes(self.block_size) + (d.size - raw) * zb.compressed_nbytes(self.block_size)

    def payload_nbytes(self) -> int:
        """Bytes this entry takes in a record."""
        return _pad16(self.num_blocks) + self.packed_nbytes()

    @property
    def held_nbytes(self) -> int:
        """Memory this object keeps alive (a writer's queue bound counts it)."""
        if self.span is not None:
            return self.span.numel()
        return self.desc.numel() + self.data.numel()

    def decode(self) -> torch.Tensor:
        """The bit-exact BF16 tensor, on the entry's device (torch reference; the executor decodes many at once on
        the GPU instead)."""
        nb, bsz = self.num_blocks, self.block_size
        if not nb:
            return torch.empty(self.shape, dtype=torch.bfloat16)
        sizes = zb.block_sizes(self.desc, bsz)
        offsets = sizes.cumsum(0) - sizes
        bits = zb.unpack(self.data[:self.packed_nbytes()], self.desc, offsets, bsz)  # sizes are multiples of 16
        return bits.view(torch.bfloat16).reshape(self.shape)


def max_payload_nbytes(numel: int, block_size: int = BLOCK_SIZE) -> int:
    """The largest payload ``numel`` values can take in this format (every block raw): a reader's size bound."""
    nb = -(-numel // block_size)
    return _pad16(nb) + nb * zb.raw_nbytes(block_size)


def check_payload(desc: np.ndarray, payload_len: int, numel: int, block_size: int) -> str | None:
    """Why a stored payload cannot be this format's (None when it can): descriptor count, values, total length."""
    if block_size <= 0 or block_size % 32:
        return f"block size {block_size} is not a positive multiple of 32"
    if numel % block_size:
        return f"{numel} values are not whole blocks of {block_size}"
    nb = numel // block_size
    if desc.size != nb:
        return f"{desc.size} descriptors for {nb} blocks"
    raw = int(np.count_nonzero(desc == zb.RAW))
    if int(np.count_nonzero(desc > 0x7F)) != raw:
        return "descriptor outside format v1"
    want = _pad16(nb) + raw * zb.raw_nbytes(block_size) + (nb - raw) * zb.compressed_nbytes(block_size)
    if payload_len != want:
        return f"payload {payload_len} bytes, its descriptors say {want}"
    return None


def encode_entries(x: torch.Tensor, shape: tuple[int, ...], block_size: int = BLOCK_SIZE
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode G entries ``x`` [G, n] (BF16, each entry's values in C order) into fixed slots: returns descriptors
    [G, n / block_size] and a uint8 buffer [G, 2n] whose row g holds entry g's packed blocks from its start.

    Fixed slots need no total size, so on the GPU nothing is read back (the Triton encoder: analyse, a cumsum of
    block sizes, pack); elsewhere the torch reference does the same placement."""
    if x.dim() != 2:
        raise ValueError(f"entries must be [G, n], got {tuple(x.shape)}")
    g, n = x.shape
    if x.dtype != torch.bfloat16:
        raise TypeError(f"zip entries hold bfloat16 KV, got {x.dtype}")
    if int(np.prod(shape)) != n:
        raise ValueError(f"shape {shape} does not hold {n} values")
    x = x.contiguous()
    slot = 2 * n
    out = torch.empty(g, slot, dtype=torch.uint8, device=x.device)
    if x.device.type == "cuda":
        from kvtide.kernels import zip_encode as ze

        desc = ze.analyze(x, block_size)
        sizes = zb.block_sizes(desc, block_size)
        base = torch.arange(g, device=x.device, dtype=torch.int64)[:, None] * slot
        ze.pack(x, desc, base + sizes.cumsum(1) - sizes, out.view(-1), block_size, check=False)
        return desc, out
    bits = x.view(torch.int16).reshape(-1, block_size)
    desc = zb.analyze(bits, zf.FORMAT_VERSION).view(g, n // block_size)
    sizes = zb.block_sizes(desc, block_size)
    base = torch.arange(g, dtype=torch.int64)[:, None] * slot
    zb.pack(bits, desc, base + sizes.cumsum(1) - sizes, out.view(-1))
    return desc, out


def from_tensor(kv: torch.Tensor, block_size: int = BLOCK_SIZE) -> ZipEntry:
    """One entry of KV ``kv`` (BF16, any device) as a ``ZipEntry`` on that device."""
    desc, out = encode_entries(kv.reshape(1, -1), tuple(kv.shape), block_size)
    return ZipEntry(desc[0], out[0], tuple(kv.shape), block_size)
