"""Codecs: lossless byte-level coding of each stream (codes, scales, BF16 residuals).

Code streams (``bits`` set) are bit-packed before general-purpose compressors and modelled with a
``2**bits``-symbol alphabet by the entropy coder; multi-byte arrays are split into byte planes first
(exponent bytes compress apart from mantissa bytes). Every codec is exact.

Decoders are bounded by the stream's declared dtype and shape: the coded bytes must expand to exactly
``expected_nbytes`` (zstd/lz4 capped at it, see bounded.py; rANS symbol counts checked first, see rans.py),
and any damage is a ContainerError.
"""
from __future__ import annotations

import dataclasses
import math
import struct
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ..extras import require
from . import bounded, rans
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


def pack_bits_t(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack_bits`` on a uint8 tensor, on its device: the same bytes, as a uint8 tensor."""
    c = codes.contiguous().view(-1).to(torch.uint8)
    if bits == 8:
        return c
    if 8 % bits == 0:
        per = 8 // bits
        c = torch.cat([c, c.new_zeros((-c.numel()) % per)]).view(-1, per).to(torch.int32)
        shifts = torch.arange(0, 8, bits, device=c.device, dtype=torch.int32)
        return (c << shifts).sum(1).to(torch.uint8)
    # codes' low ``bits`` bits, most significant first, packed big-endian into bytes (numpy's packbits order)
    sh = torch.arange(bits - 1, -1, -1, device=c.device, dtype=torch.int32)
    b = ((c.to(torch.int32)[:, None] >> sh) & 1).view(-1)
    b = torch.cat([b, b.new_zeros((-b.numel()) % 8)]).view(-1, 8)
    return (b << torch.arange(7, -1, -1, device=c.device, dtype=torch.int32)).sum(1).to(torch.uint8)


def unpack_bits_t(raw: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """``unpack_bits`` of a uint8 tensor holding exactly ``packed_nbytes(n, bits)`` bytes, on its device."""
    if raw.numel() != packed_nbytes(n, bits):
        raise ContainerError(f"packed {bits}-bit code stream of {n} codes: expected {packed_nbytes(n, bits)} bytes, "
                             f"got {raw.numel()}")
    r = raw.view(-1).to(torch.int32)
    if bits == 8:
        return raw.view(-1)[:n].clone()
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, device=r.device, dtype=torch.int32)
        return ((r[:, None] >> shifts) & ((1 << bits) - 1)).view(-1)[:n].to(torch.uint8)
    b = ((r[:, None] >> torch.arange(7, -1, -1, device=r.device, dtype=torch.int32)) & 1).view(-1)[: n * bits]
    w = torch.arange(bits - 1, -1, -1, device=r.device, dtype=torch.int32)
    return (b.view(n, bits) << w).sum(1).to(torch.uint8)


def planes_t(t: torch.Tensor) -> torch.Tensor:
    """``planes`` of a tensor on its device: [itemsize, n] uint8 (plane 0 = least significant byte)."""
    size = t.element_size()
    return t.contiguous().view(-1).view(torch.uint8).view(-1, size).t().contiguous()


def wire_bytes(s: Stream) -> torch.Tensor:
    """The bytes a stream's byte-level coding starts from (packed codes, or byte planes) as a uint8 tensor on the
    stream's device; equal to ``pack_bits`` / ``planes`` of the host array."""
    t = s.data if isinstance(s.data, torch.Tensor) else to_tensor(s.data, "cpu")
    if s.bits:
        return pack_bits_t(t, s.bits)
    return planes_t(t).view(-1)


def unwire(raw: torch.Tensor, dtype: np.dtype, shape: tuple[int, ...], bits: int | None) -> torch.Tensor:
    """Inverse of ``wire_bytes``: the stream as a tensor (uint16 BF16 bits as int16) on ``raw``'s device."""
    n = _n(shape)
    if bits:
        return unpack_bits_t(raw, n, bits).view(shape)
    if raw.numel() != n * dtype.itemsize:
        raise ContainerError(f"stream of {n} x {dtype.itemsize}-byte values: got {raw.numel()} bytes")
    tdt = {1: torch.uint8, 2: torch.float16 if dtype.kind == "f" else torch.int16, 4: torch.float32}[dtype.itemsize]
    out = torch.empty(n, dtype.itemsize, dtype=torch.uint8, device=raw.device)  # strides fit a view at any n
    out.copy_(raw.view(dtype.itemsize, n).t())
    return out.view(tdt).view(shape)


def to_tensor(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A decoded host array as a tensor on ``device`` (uint16 BF16 bits as int16)."""
    a = a.view(np.int16) if a.dtype == np.uint16 else a
    return torch.from_numpy(np.ascontiguousarray(a).copy()).to(device)


def packed_nbytes(n: int, bits: int) -> int:
    return -(-n * bits // 8)


def unpack_bits(data: bytes, n: int, bits: int) -> np.ndarray:
    if len(data) != packed_nbytes(n, bits):
        raise ContainerError(f"packed {bits}-bit code stream of {n} codes: expected {packed_nbytes(n, bits)} bytes, "
                             f"got {len(data)}")
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
    return math.prod(shape)


def expected_nbytes(dtype: np.dtype, shape: tuple[int, ...], bits: int | None) -> int:
    """Bytes a stream expands to before its byte-level coding: packed codes, or the array's bytes."""
    return packed_nbytes(_n(shape), bits) if bits else _n(shape) * dtype.itemsize


def _expect(data: bytes, n: int, what: str) -> bytes:
    if len(data) != n:
        raise ContainerError(f"{what}: expected {n} bytes, got {len(data)}")
    return data


class Codec(Stage):
    """``encode`` takes host (numpy) streams unless ``device_encode``, when it also takes device tensors and codes
    them where they are; ``decode_tensor`` decodes onto a device (the default: decode on the host, then copy)."""

    registry: ClassVar[dict[str, type]] = {}
    device_encode: ClassVar[bool] = False
    cpu_format: ClassVar[bool] = True  # False: no host coder; its profiles run only where a GPU is

    def encode(self, s: Stream) -> bytes | memoryview:
        """The coded stream as bytes, or a byte view the container reads while packing this entry."""
        raise NotImplementedError

    def encode_device(self, s: Stream) -> torch.Tensor | None:
        """The coded stream as a uint8 tensor left on the stream's GPU, for the container to copy out with the
        blob's other streams; None where this codec codes on the host (then ``encode`` runs)."""
        return None

    def decode(self, data: bytes, dtype: np.dtype, shape: tuple[int, ...], bits: int | None, bf16: bool) -> np.ndarray:
        """The stream as an array that owns its memory (never a view of ``data``, which the caller may reuse)."""
        raise NotImplementedError

    def decode_tensor(self, data: bytes, dtype: np.dtype, shape: tuple[int, ...], bits: int | None, bf16: bool,
                      device: torch.device | str) -> torch.Tensor:
        return to_tensor(self.decode(data, dtype, shape, bits, bf16), device)


def _upload(data: Any, device: torch.device | str) -> torch.Tensor:
    """Coded bytes (any buffer) as a uint8 tensor on ``device``: one host-to-device copy for a GPU, a private copy
    on the CPU (the tensor must not alias the blob)."""
    if len(data) == 0:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    if torch.device(device).type == "cpu":
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    with warnings.catch_warnings():  # a read-only buffer: torch warns, but the copy to the device never writes it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8).to(device)


@register(Codec)
@dataclass(frozen=True)
class Raw(Codec):
    """No coding: one byte per code, arrays as little-endian bytes."""

    name: ClassVar[str] = "none"
    device_encode: ClassVar[bool] = True

    def encode(self, s):
        # a byte view, not a copy: the container copies it once, into the blob (the stream outlives that call)
        return memoryview(np.ascontiguousarray(s.host().data).reshape(-1).view(np.uint8))

    def encode_device(self, s):
        if not (isinstance(s.data, torch.Tensor) and s.data.is_cuda):
            return None
        return s.data.detach().contiguous().view(-1).view(torch.uint8)

    def decode(self, data, dtype, shape, bits, bf16):
        return np.frombuffer(_expect(data, _n(shape) * dtype.itemsize, self.name), dtype).reshape(shape).copy()

    def decode_tensor(self, data, dtype, shape, bits, bf16, device):
        _expect(data, _n(shape) * dtype.itemsize, self.name)
        return to_tensor(np.frombuffer(data, dtype).reshape(shape), device)


@register(Codec)
@dataclass(frozen=True)
class Pack(Raw):
    """Bit-packing of codes (KIVI's storage); other arrays raw."""

    name: ClassVar[str] = "pack"

    def encode(self, s):
        if s.bits and isinstance(s.data, torch.Tensor):
            return pack_bits_t(s.data, s.bits).cpu().numpy().tobytes()
        return pack_bits(s.data, s.bits) if s.bits else super().encode(s)

    def encode_device(self, s):
        if not (isinstance(s.data, torch.Tensor) and s.data.is_cuda):
            return None
        return pack_bits_t(s.data, s.bits) if s.bits else super().encode_device(s)

    def decode(self, data, dtype, shape, bits, bf16):
        if bits:
            return unpack_bits(data, _n(shape), bits).reshape(shape)
        return super().decode(data, dtype, shape, bits, bf16)

    def decode_tensor(self, data, dtype, shape, bits, bf16, device):
        if bits:
            return unpack_bits_t(_upload(data, device), _n(shape), bits).view(shape)
        return super().decode_tensor(data, dtype, shape, bits, bf16, device)


class _Bytes(Codec):
    """Pack codes, split byte planes, then a general-purpose compressor on the concatenation."""

    def _c(self, b: bytes) -> bytes:
        raise NotImplementedError

    def _d(self, b: bytes, size: int) -> bytes:
        """Decompress ``b`` to exactly ``size`` bytes, allocating no more than that."""
        raise NotImplementedError

    def encode(self, s):
        raw = pack_bits(s.data, s.bits) if s.bits else planes(s.data).tobytes()
        return self._c(raw)

    def decode(self, data, dtype, shape, bits, bf16):
        try:
            raw = self._d(data, expected_nbytes(dtype, shape, bits))
        except ContainerError:
            raise
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
        zstandard = require("zstandard", "transfer", "the zstd codec")
        return zstandard.ZstdCompressor(level=self.l).compress(b)

    def _d(self, b, size):
        return bounded.zstd(b, size)


@register(Codec)
@dataclass(frozen=True)
class Lz4(_Bytes):
    name: ClassVar[str] = "lz4"
    l: int = 0  # noqa: E741 - spec key

    def __post_init__(self) -> None:
        check_int("lz4 level l", self.l, 0, 16)

    def _c(self, b):
        lz4_frame = require("lz4.frame", "transfer", "the lz4 codec")
        return lz4_frame.compress(b, compression_level=self.l)

    def _d(self, b, size):
        return bounded.lz4(b, size)


@register(Codec)
@dataclass(frozen=True)
class Ans(Codec):
    """Entropy coding with rANS (PyPI ``constriction``), an empirical model per stream / byte plane."""

    name: ClassVar[str] = "ans"

    def encode(self, s):
        if s.bits:
            return rans.encode(s.data.ravel(), 1 << s.bits)
        parts = [rans.encode(p, 256) for p in planes(s.data)]
        return b"".join(struct.pack("<I", len(p)) + p for p in parts)

    def decode(self, data, dtype, shape, bits, bf16):
        buf, n = memoryview(data), _n(shape)
        if bits:
            return rans.decode(buf, 1 << bits, n).reshape(shape)
        ps, off = [], 0
        for i in range(dtype.itemsize):
            if off + 4 > len(buf):
                raise ContainerError(f"ans: byte plane {i} of {dtype.itemsize}: stream truncated at {len(buf)} bytes")
            (k,) = struct.unpack_from("<I", buf, off)
            if k > len(buf) - off - 4:
                raise ContainerError(f"ans: byte plane {i} claims {k} bytes, {len(buf) - off - 4} left")
            ps.append(rans.decode(buf[off + 4: off + 4 + k], 256, n))
            off += 4 + k
        if off != len(buf):
            raise ContainerError(f"ans: {len(buf) - off} bytes after the last byte plane")
        return unplanes(np.stack(ps), dtype).reshape(shape)


@register(Codec)
@dataclass(frozen=True)
class ZipFusion(Pack):
    """Lossless ZipFusion BF16 format (kvtide.cache.zip_format) for BF16 streams; codes bit-packed."""

    name: ClassVar[str] = "zipf"
    device_encode: ClassVar[bool] = False
    bs: int = 512
    v: int = 1  # format version; 2 adds the exact-zero escape

    def __post_init__(self) -> None:
        check_int("zipf block size bs", self.bs, 32, 1 << 20)
        if self.bs % 32:
            raise SpecError(f"zipf block size must be a multiple of 32, got {self.bs}")
        check_int("zipf version v", self.v, 1, 2)

    def encode_device(self, s):
        return None  # the ZipFusion coder here runs on the host

    def encode(self, s):
        if not s.bf16:
            return super().encode(s)
        from kvtide.cache import zip_format
        flat = s.data.ravel().view(np.int16)
        flat = np.concatenate([flat, np.zeros((-flat.size) % self.bs, np.int16)])  # the format wants whole blocks
        x = torch.from_numpy(flat).view(torch.bfloat16)
        kw = {"version": self.v} if self.v != 1 else {}  # the base API is encode(x, block_size)
        return _serialise(zip_format.encode(x, block_size=self.bs, **kw))

    def decode_tensor(self, data, dtype, shape, bits, bf16, device):
        return to_tensor(self.decode(data, dtype, shape, bits, bf16), device)

    def decode(self, data, dtype, shape, bits, bf16):
        if not bf16:
            return super().decode(data, dtype, shape, bits, bf16)
        from kvtide.cache import zip_format
        n = _n(shape)
        padded = n + (-n) % self.bs
        fields = _deserialise(data)
        for k, want in (("block_size", self.bs), ("version", self.v)):
            if k in fields and fields[k] != want:
                raise ContainerError(f"zipf: stream {k} {fields[k]}, expected {want} (the spec's)")
        if "shape" in fields and (not isinstance(fields["shape"], tuple) or math.prod(fields["shape"]) != padded):
            raise ContainerError(f"zipf: stream shape {fields['shape']}, expected {padded} values")
        try:
            x = zip_format.decode(zip_format.Encoded(**fields))
        except ContainerError:
            raise
        except Exception as e:
            raise ContainerError(f"zipf: cannot decode stream: {e}") from e
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.numel() != padded:
            got = f"{x.numel()} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ContainerError(f"zipf: stream decodes to {got} values, expected {padded} bfloat16")
        out = x.contiguous().view(torch.int16).numpy().view(np.uint16).ravel()
        return out[:n].reshape(shape).copy()


# ZipFusion streams: b"S" + a safetensors file of the Encoded dataclass's fields (tensors as they are, ints and
# int tuples as int64 tensors), so decoding is bounded by the stream's bytes and runs no pickle.
_ZIPF_TAG = b"S"
_ZIPF_TENSOR_DTYPES = ("uint8", "int16", "int32", "int64")


def _serialise(e: Any) -> bytes:
    import safetensors.torch
    import torch
    tensors: dict[str, torch.Tensor] = {}
    for f in dataclasses.fields(e):
        v = getattr(e, f.name)
        if isinstance(v, torch.Tensor):
            tensors["tensor." + f.name] = v.detach().cpu().contiguous()
        elif isinstance(v, int) and not isinstance(v, bool):
            tensors["int." + f.name] = torch.tensor(v, dtype=torch.int64)
        elif isinstance(v, tuple) and all(isinstance(x, int) for x in v):
            tensors["tuple." + f.name] = torch.tensor(list(v), dtype=torch.int64)
        else:
            raise TypeError(f"zipf: cannot serialise field {f.name} of type {type(v).__name__}")
    return _ZIPF_TAG + safetensors.torch.save(tensors)


def _deserialise(data: bytes) -> dict[str, Any]:
    """The Encoded fields of a ZipFusion stream; ContainerError on anything else."""
    tag, body = bytes(data[:1]), data[1:]
    if tag != _ZIPF_TAG:
        raise ContainerError(f"zipf: stream encoding {tag!r}, expected {_ZIPF_TAG!r}")
    import safetensors.torch
    import torch
    try:
        tensors = safetensors.torch.load(bytes(body))
    except Exception as e:
        raise ContainerError(f"zipf: bad stream: {e}") from e
    except BaseException as e:  # a Rust panic surfaces as pyo3's PanicException
        if type(e).__name__ != "PanicException":
            raise
        raise ContainerError(f"zipf: bad stream: {e}") from e
    fields: dict[str, Any] = {}
    for key, t in tensors.items():
        kind, _, name = key.partition(".")
        if str(t.dtype).removeprefix("torch.") not in _ZIPF_TENSOR_DTYPES:
            raise ContainerError(f"zipf: field {key!r} has dtype {t.dtype}, expected one of {_ZIPF_TENSOR_DTYPES}")
        if kind == "tensor":
            fields[name] = t
        elif kind == "int" and t.dtype == torch.int64 and t.dim() == 0:
            fields[name] = int(t.item())
        elif kind == "tuple" and t.dtype == torch.int64 and t.dim() == 1 and t.numel() <= 8:
            fields[name] = tuple(int(x) for x in t.tolist())
        else:
            raise ContainerError(f"zipf: field {key!r} ({t.dtype}, shape {list(t.shape)}) is not a stream field")
    return fields
