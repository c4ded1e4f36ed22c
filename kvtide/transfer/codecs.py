"""Codecs: lossless byte-level coding of each stream (codes, scales, BF16 residuals).

Code streams (``bits`` set) are bit-packed before general-purpose compressors and modelled with a
``2**bits``-symbol alphabet by the entropy coder; multi-byte arrays are split into byte planes first
(exponent bytes compress apart from mantissa bytes). Every codec is exact.
"""
from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .errors import ContainerError, SpecError
from .stage import Stage, Stream, check_int, register


# --- helpers -----------------------------------------------------------------------------------------------
def pack_bits(codes: np.ndarray, bits: int) -> bytes:
    """Pack uint8 codes < 2**bits densely (little-endian within a byte)."""
    c = np.ascontiguousarray(codes, dtype=np.uint8).ravel()
    if bits == 8:
        return c.tobytes()
    if 8 % bits == 0:
        per = 8 // bits
        c = np.concatenate([c, np.zeros((-c.size) % per, np.uint8)]).reshape(-1, per)
        out = np.zeros(c.shape[0], np.uint8)
        for i in range(per):
            out |= c[:, i] << np.uint8(bits * i)
        return out.tobytes()
    planes = np.unpackbits(c[:, None], axis=1)[:, 8 - bits:]
    return np.packbits(planes.ravel()).tobytes()


def unpack_bits(data: bytes, n: int, bits: int) -> np.ndarray:
    raw = np.frombuffer(data, np.uint8)
    if bits == 8:
        out = raw
    elif 8 % bits == 0:
        per = 8 // bits
        mask = np.uint8((1 << bits) - 1)
        out = np.stack([(raw >> np.uint8(bits * i)) & mask for i in range(per)], 1).ravel()
    else:
        b = np.unpackbits(raw)[: n * bits].reshape(-1, bits)
        out = np.packbits(np.concatenate([np.zeros((b.shape[0], 8 - bits), np.uint8), b], 1), axis=1).ravel()
    if out.size < n:
        raise ContainerError(f"packed code stream too short: {out.size} < {n}")
    return out[:n].copy()


def planes(a: np.ndarray) -> np.ndarray:
    """Byte-plane split: [itemsize, n] uint8 (plane 0 = least significant byte)."""
    return np.ascontiguousarray(a).ravel().view(np.uint8).reshape(-1, a.dtype.itemsize).T.copy()


def unplanes(b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(b.reshape(dtype.itemsize, -1).T).view(dtype).ravel()


def _n(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _expect(data: bytes, n: int, what: str) -> bytes:
    if len(data) != n:
        raise ContainerError(f"{what}: expected {n} bytes, got {len(data)}")
    return data


class Codec(Stage):
    registry: ClassVar[dict[str, type]] = {}

    def encode(self, s: Stream) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes, dtype: np.dtype, shape: tuple[int, ...], bits: int | None, bf16: bool) -> np.ndarray:
        raise NotImplementedError


@register(Codec)
@dataclass(frozen=True)
class Raw(Codec):
    """No coding: one byte per code, arrays as little-endian bytes."""

    name: ClassVar[str] = "none"

    def encode(self, s):
        return np.ascontiguousarray(s.data).tobytes()

    def decode(self, data, dtype, shape, bits, bf16):
        return np.frombuffer(_expect(data, _n(shape) * dtype.itemsize, self.name), dtype).reshape(shape).copy()


@register(Codec)
@dataclass(frozen=True)
class Pack(Raw):
    """Bit-packing of codes (KIVI's storage); other arrays raw."""

    name: ClassVar[str] = "pack"

    def encode(self, s):
        return pack_bits(s.data, s.bits) if s.bits else super().encode(s)

    def decode(self, data, dtype, shape, bits, bf16):
        if bits:
            return unpack_bits(data, _n(shape), bits).reshape(shape)
        return super().decode(data, dtype, shape, bits, bf16)


class _Bytes(Codec):
    """Pack codes, split byte planes, then a general-purpose compressor on the concatenation."""

    def _c(self, b: bytes) -> bytes:
        raise NotImplementedError

    def _d(self, b: bytes) -> bytes:
        raise NotImplementedError

    def encode(self, s):
        raw = pack_bits(s.data, s.bits) if s.bits else planes(s.data).tobytes()
        return self._c(raw)

    def decode(self, data, dtype, shape, bits, bf16):
        try:
            raw = self._d(data)
        except Exception as e:  # the libraries raise their own types on damage
            raise ContainerError(f"{self.name}: cannot decompress stream: {e}") from e
        if bits:
            return unpack_bits(raw, _n(shape), bits).reshape(shape)
        arr = np.frombuffer(_expect(raw, _n(shape) * dtype.itemsize, self.name), np.uint8)
        return unplanes(arr, dtype).reshape(shape)


@register(Codec)
@dataclass(frozen=True)
class Zstd(_Bytes):
    name: ClassVar[str] = "zstd"
    l: int = 3  # noqa: E741 - spec key

    def __post_init__(self) -> None:
        check_int("zstd level l", self.l, 1, 22)

    def _c(self, b):
        import zstandard
        return zstandard.ZstdCompressor(level=self.l).compress(b)

    def _d(self, b):
        import zstandard
        return zstandard.ZstdDecompressor().decompress(b)


@register(Codec)
@dataclass(frozen=True)
class Lz4(_Bytes):
    name: ClassVar[str] = "lz4"
    l: int = 0  # noqa: E741 - spec key

    def __post_init__(self) -> None:
        check_int("lz4 level l", self.l, 0, 16)

    def _c(self, b):
        import lz4.frame
        return lz4.frame.compress(b, compression_level=self.l)

    def _d(self, b):
        import lz4.frame
        return lz4.frame.decompress(b)


def _ans_encode(sym: np.ndarray, alphabet: int) -> bytes:
    import constriction
    counts = np.bincount(sym, minlength=alphabet).astype(np.uint32)
    head = struct.pack("<II", alphabet, sym.size) + counts.tobytes()
    if sym.size == 0:
        return head
    model = constriction.stream.model.Categorical(counts / counts.sum(dtype=np.float64), perfect=False)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(sym.astype(np.int32), model)
    return head + coder.get_compressed().tobytes()


def _ans_decode(buf: memoryview, alphabet: int) -> np.ndarray:
    import constriction
    a, n = struct.unpack_from("<II", buf, 0)
    if a != alphabet or len(buf) < 8 + 4 * a:
        raise ContainerError("ans: bad stream header")
    counts = np.frombuffer(buf, np.uint32, a, 8)
    if n == 0:
        return np.zeros(0, np.uint8)
    if int(counts.sum(dtype=np.int64)) != n:
        raise ContainerError("ans: symbol counts do not add up")
    words = np.frombuffer(buf[8 + 4 * a:], np.uint32)
    model = constriction.stream.model.Categorical(counts / counts.sum(dtype=np.float64), perfect=False)
    try:
        out = constriction.stream.stack.AnsCoder(words.copy()).decode(model, n)
    except Exception as e:
        raise ContainerError(f"ans: cannot decode stream: {e}") from e
    return out.astype(np.uint8)


@register(Codec)
@dataclass(frozen=True)
class Ans(Codec):
    """Entropy coding with rANS (PyPI ``constriction``), an empirical model per stream / byte plane."""

    name: ClassVar[str] = "ans"

    def encode(self, s):
        if s.bits:
            return _ans_encode(s.data.ravel(), 1 << s.bits)
        parts = [_ans_encode(p, 256) for p in planes(s.data)]
        return b"".join(struct.pack("<I", len(p)) + p for p in parts)

    def decode(self, data, dtype, shape, bits, bf16):
        buf = memoryview(data)
        try:
            if bits:
                out = _ans_decode(buf, 1 << bits)
                return out.reshape(shape)
            ps, off = [], 0
            for _ in range(dtype.itemsize):
                (k,) = struct.unpack_from("<I", buf, off)
                ps.append(_ans_decode(buf[off + 4: off + 4 + k], 256))
                off += 4 + k
        except struct.error as e:
            raise ContainerError(f"ans: truncated stream: {e}") from e
        if off != len(buf) or any(p.size != _n(shape) for p in ps):
            raise ContainerError("ans: stream length mismatch")
        return unplanes(np.stack(ps), dtype).reshape(shape)


@register(Codec)
@dataclass(frozen=True)
class ZipFusion(Pack):
    """Lossless ZipFusion BF16 format (kvtide.cache.zipformat) for BF16 streams; codes bit-packed."""

    name: ClassVar[str] = "zipf"
    bs: int = 512
    v: int = 1  # format version; 2 adds the exact-zero escape

    def __post_init__(self) -> None:
        check_int("zipf block size bs", self.bs, 32, 1 << 20)
        if self.bs % 32:
            raise SpecError(f"zipf block size must be a multiple of 32, got {self.bs}")
        check_int("zipf version v", self.v, 1, 2)

    def encode(self, s):
        if not s.bf16:
            return super().encode(s)
        import torch
        from kvtide.cache import zipformat
        flat = s.data.ravel().view(np.int16)
        flat = np.concatenate([flat, np.zeros((-flat.size) % self.bs, np.int16)])  # the format wants whole blocks
        x = torch.from_numpy(flat).view(torch.bfloat16)
        kw = {"version": self.v} if self.v != 1 else {}  # the base API is encode(x, block_size)
        return _serialise(zipformat.encode(x, block_size=self.bs, **kw))

    def decode(self, data, dtype, shape, bits, bf16):
        if not bf16:
            return super().decode(data, dtype, shape, bits, bf16)
        import torch
        from kvtide.cache import zipformat
        try:
            x = zipformat.decode(_deserialise(data, zipformat))
        except ContainerError:
            raise
        except Exception as e:
            raise ContainerError(f"zipf: cannot decode stream: {e}") from e
        out = x.contiguous().view(torch.int16).numpy().view(np.uint16).ravel()
        n = _n(shape)
        if out.size != n + (-n) % self.bs:
            raise ContainerError("zipf: stream length mismatch")
        return out[:n].reshape(shape).copy()


def _serialise(e: Any) -> bytes:
    """Use the format's own bytes if it has them, else its dataclass fields through a weights-only torch file."""
    if hasattr(e, "to_bytes"):
        return b"B" + e.to_bytes()
    import dataclasses
    import torch
    buf = io.BytesIO()
    torch.save({f.name: getattr(e, f.name) for f in dataclasses.fields(e)}, buf)
    return b"F" + buf.getvalue()


def _deserialise(data: bytes, zipformat: Any) -> Any:
    tag, body = data[:1], data[1:]
    if tag == b"B" and hasattr(zipformat.Encoded, "from_bytes"):
        return zipformat.Encoded.from_bytes(body)
    if tag == b"F":
        import torch
        return zipformat.Encoded(**torch.load(io.BytesIO(body), weights_only=True))
    raise ContainerError("zipf: unknown stream encoding")
