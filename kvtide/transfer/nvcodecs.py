"""GPU entropy codecs on nvCOMP (PyPI ``nvidia-nvcomp-cu13``, module ``nvidia.nvcomp``), with CPU paths where the
format is shared.

Each stage codes the same bytes as the CPU byte codecs (packed codes, or byte planes: ``codecs.wire_bytes``) with
one nvCOMP call per stream on the stream's device:

- ``nvzstd``: nvCOMP zstd, ``RAW`` bitstream: one standard zstd frame that declares its content size, so the CPU
  ``zstandard`` package decodes it (through ``bounded.zstd``) and encodes it where there is no GPU.
- ``nvlz4``: nvCOMP LZ4, ``RAW`` bitstream: one raw LZ4 block (no frame), decoded on the CPU by ``lz4.block`` with
  the expected size as its cap.
- ``nvans``: nvCOMP's ANS in chunks of ``ANS_CHUNK`` bytes, each a u32 length and a ``WITH_UNCOMPRESSED_SIZE``
  bitstream (a u64 size, then nvCOMP's own ANS format). No CPU implementation exists: encoding or decoding it without CUDA and nvCOMP raises ``MissingExtra`` naming the
  package. (The CPU rANS codec is the ``ans`` stage, another format.)

An empty stream is coded as no bytes. Decoding is bounded before nvCOMP allocates: the size a stream declares
(zstd's frame content size, every nvans chunk's u64) must equal the size the stream's recorded dtype and shape imply, and the
GPU decoders write into buffers of exactly that size; nvCOMP failures become ContainerError. nvCOMP's decoders
are not hardened against crafted payloads (a damaged nvans payload was seen to stall the GPU decoder): the
container's CRC-32 catches accidental damage before any stream is decoded, but a blob from an untrusted sender with
a valid CRC should be decoded with the CPU formats (nvzstd, nvlz4) or not with nvCOMP.
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ..extras import MissingExtra, require
from . import bounded
from .codecs import Codec, _expect, _upload, expected_nbytes, unwire, wire_bytes
from .errors import ContainerError
from .stage import Stream, register

NVCOMP_PACKAGE = "nvidia-nvcomp-cu13"
_local = threading.local()  # nvCOMP Codec objects are not thread-safe: one per thread, algorithm and device


class NvcompMissing(MissingExtra):
    """A stage with no CPU implementation met a machine without CUDA or nvCOMP (an ImportError, so decoders let it
    through instead of calling the blob damaged)."""

    def __init__(self, purpose: str):
        ModuleNotFoundError.__init__(self, f"{purpose} needs a CUDA device and nvCOMP: pip install {NVCOMP_PACKAGE} "
                                     "(module nvidia.nvcomp)", name="nvidia.nvcomp")
        self.extra = "transfer"


def nvcomp_module() -> Any | None:
    """``nvidia.nvcomp`` if it imports, else None."""
    try:
        from nvidia import nvcomp
    except (ImportError, OSError):  # OSError: the wheel is there but its shared library is not loadable
        return None
    return nvcomp


def gpu_ready(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available() and nvcomp_module() is not None


def _codec(algorithm: str, kind: str, device: torch.device) -> Any:
    nvcomp = nvcomp_module()
    cache = _local.__dict__.setdefault("codecs", {})
    key = (algorithm, kind, device.index)
    if key not in cache:
        with torch.cuda.device(device):
            cache[key] = nvcomp.Codec(algorithm=algorithm, bitstream_kind=getattr(nvcomp.BitstreamKind, kind))
    return cache[key]


class _NvCodec(Codec):
    """One nvCOMP call per stream on its device; ``_cpu_encode`` / ``_cpu_decode`` are the same format on the host."""

    device_encode: ClassVar[bool] = True
    algorithm: ClassVar[str]
    kind: ClassVar[str] = "RAW"
    cpu_format: ClassVar[bool] = True  # False: no CPU implementation; host streams go through the GPU if there is one

    def _missing(self, what: str) -> "NvcompMissing":
        return NvcompMissing(f"the {self.name} codec's {what}")

    # --- encode -------------------------------------------------------------------------------------------
    def encode(self, s: Stream) -> bytes:
        raw = wire_bytes(s)
        if raw.numel() == 0:
            return b""
        if not raw.is_cuda and not self.cpu_format and gpu_ready("cuda"):
            raw = raw.cuda()
        if raw.is_cuda and nvcomp_module() is not None:
            nvcomp = nvcomp_module()
            with torch.cuda.device(raw.device):
                enc = _codec(self.algorithm, self.kind, raw.device).encode(nvcomp.as_array(raw))
                return torch.as_tensor(enc, device=raw.device).view(torch.uint8).cpu().numpy().tobytes()
        return self._cpu_encode(raw.cpu().numpy().tobytes())

    def _cpu_encode(self, raw: bytes) -> bytes:
        raise self._missing("encoder without a GPU")

    # --- decode -------------------------------------------------------------------------------------------
    def _check_declared(self, data: bytes, size: int) -> None:
        """Refuse a stream whose declared size is not ``size`` (before anything is allocated)."""

    def decode(self, data, dtype, shape, bits, bf16):
        size = expected_nbytes(dtype, shape, bits)
        if size == 0:
            _expect(data, 0, self.name)
            return np.zeros(shape, dtype)
        self._check_declared(data, size)
        if not self.cpu_format and gpu_ready("cuda"):
            t = self.decode_tensor(data, dtype, shape, bits, bf16, "cuda").cpu()
            return t.numpy().view(dtype).reshape(shape)
        raw = self._cpu_decode(data, size)
        return unwire(torch.frombuffer(bytearray(raw), dtype=torch.uint8), dtype, shape, bits).numpy().view(
            dtype).reshape(shape)

    def _cpu_decode(self, data: bytes, size: int) -> bytes:
        raise self._missing("decoder without a GPU")

    def decode_tensor(self, data, dtype, shape, bits, bf16, device):
        device = torch.device(device)
        if not gpu_ready(device):
            return super().decode_tensor(data, dtype, shape, bits, bf16, device)
        size = expected_nbytes(dtype, shape, bits)
        if size == 0:
            _expect(data, 0, self.name)
            return unwire(torch.zeros(0, dtype=torch.uint8, device=device), dtype, shape, bits)
        self._check_declared(data, size)
        nvcomp = nvcomp_module()
        src = _upload(data, device)
        out = torch.empty(size, dtype=torch.uint8, device=device)
        try:
            with torch.cuda.device(device):
                codec = _codec(self.algorithm, self.kind, device)
                try:
                    dec = codec.decode(nvcomp.as_array(src), out=out)
                except TypeError:  # a build that takes no torch buffer as ``out``: the size was checked above
                    dec = codec.decode(nvcomp.as_array(src))
                got = torch.as_tensor(dec, device=device).view(torch.uint8).view(-1)
        except ContainerError:
            raise
        except Exception as e:  # nvCOMP raises its own types (and ValueError when ``out`` is too small)
            raise ContainerError(f"{self.name}: cannot decode stream (expected {size} bytes): {e}") from e
        if got.numel() != size:
            raise ContainerError(f"{self.name}: stream decodes to {got.numel()} bytes, expected {size}")
        return unwire(got, dtype, shape, bits)


@register(Codec)
@dataclass(frozen=True)
class NvZstd(_NvCodec):
    name: ClassVar[str] = "nvzstd"
    algorithm: ClassVar[str] = "zstd"

    def _cpu_encode(self, raw):
        zstandard = require("zstandard", "transfer", "the nvzstd codec on the CPU")
        return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)

    def _check_declared(self, data, size):
        zstandard = require("zstandard", "transfer", "the nvzstd codec's size check")
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as e:
            raise ContainerError(f"nvzstd: bad frame header: {e}") from e
        if declared != size:  # nvCOMP and this module's CPU encoder always declare it
            raise ContainerError(f"nvzstd: frame declares {declared} bytes, the stream's shape implies {size}")

    def _cpu_decode(self, data, size):
        return bounded.zstd(data, size)


@register(Codec)
@dataclass(frozen=True)
class NvLz4(_NvCodec):
    name: ClassVar[str] = "nvlz4"
    algorithm: ClassVar[str] = "lz4"

    def _cpu_encode(self, raw):
        lz4_block = require("lz4.block", "transfer", "the nvlz4 codec on the CPU")
        return lz4_block.compress(raw, store_size=False)

    def _check_declared(self, data, size):
        if len(data) > 1 + size + size // 255 + 16:  # more than an LZ4 block of ``size`` bytes can take
            raise ContainerError(f"nvlz4: {len(data)} coded bytes for {size} bytes")

    def _cpu_decode(self, data, size):
        lz4_block = require("lz4.block", "transfer", "the nvlz4 codec on the CPU")
        try:
            out = lz4_block.decompress(data, uncompressed_size=size)
        except Exception as e:  # lz4.block.LZ4BlockError and the like
            raise ContainerError(f"nvlz4: cannot decompress stream (expected {size} bytes): {e}") from e
        if len(out) != size:
            raise ContainerError(f"nvlz4: stream holds {len(out)} bytes, expected {size}")
        return out


_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
ANS_CHUNK = 1 << 20  # bytes per nvCOMP call: one WITH_UNCOMPRESSED_SIZE ANS stream of a whole large array failed


def ans_chunks(data: bytes, size: int) -> list[tuple[int, int]]:
    """(offset, length) of each coded chunk of an nvans stream of ``size`` bytes, after checking every declared
    size: ceil(size / ANS_CHUNK) chunks, each a u32 length then nvCOMP bytes that start with their u64 size."""
    want = [min(ANS_CHUNK, size - i) for i in range(0, size, ANS_CHUNK)]
    out, off = [], 0
    for i, w in enumerate(want):
        if off + _U32.size + _U64.size > len(data):
            raise ContainerError(f"nvans: stream truncated at chunk {i} of {len(want)}")
        (k,) = _U32.unpack_from(data, off)
        (declared,) = _U64.unpack_from(data, off + _U32.size)
        if declared != w:
            raise ContainerError(f"nvans: chunk {i} declares {declared} bytes, the stream's shape implies {w}")
        if k < _U64.size or k > len(data) - off - _U32.size:
            raise ContainerError(f"nvans: chunk {i} claims {k} bytes, {len(data) - off - _U32.size} left")
        out.append((off + _U32.size, k))
        off += _U32.size + k
    if off != len(data):
        raise ContainerError(f"nvans: {len(data) - off} bytes after the last chunk")
    return out


@register(Codec)
@dataclass(frozen=True)
class NvAns(_NvCodec):
    """nvCOMP ANS in chunks of ``ANS_CHUNK`` bytes: per chunk a u32 length and nvCOMP's WITH_UNCOMPRESSED_SIZE
    stream (a u64 size, then its ANS format)."""

    name: ClassVar[str] = "nvans"
    algorithm: ClassVar[str] = "ans"
    kind: ClassVar[str] = "WITH_UNCOMPRESSED_SIZE"
    cpu_format: ClassVar[bool] = False

    def _check_declared(self, data, size):
        ans_chunks(data, size)

    def encode(self, s: Stream) -> bytes:
        raw = wire_bytes(s)
        if raw.numel() == 0:
            return b""
        if not raw.is_cuda and gpu_ready("cuda"):
            raw = raw.cuda()
        if not raw.is_cuda or nvcomp_module() is None:
            raise self._missing("encoder without a GPU")
        nvcomp = nvcomp_module()
        parts = []
        with torch.cuda.device(raw.device):
            for i in range(0, raw.numel(), ANS_CHUNK):
                enc = _codec(self.algorithm, self.kind, raw.device).encode(nvcomp.as_array(raw[i: i + ANS_CHUNK]))
                b = torch.as_tensor(enc, device=raw.device).view(torch.uint8).cpu().numpy().tobytes()
                parts += [_U32.pack(len(b)), b]
        return b"".join(parts)

    def _gpu_raw(self, data: bytes, size: int, device: torch.device) -> torch.Tensor:
        nvcomp = nvcomp_module()
        out = torch.empty(size, dtype=torch.uint8, device=device)
        with torch.cuda.device(device):
            for i, (off, k) in enumerate(ans_chunks(data, size)):
                dst = out[i * ANS_CHUNK: (i + 1) * ANS_CHUNK]
                try:
                    dec = _codec(self.algorithm, self.kind, device).decode(
                        nvcomp.as_array(_upload(data[off: off + k], device)))
                    got = torch.as_tensor(dec, device=device).view(torch.uint8).view(-1)
                except Exception as e:  # nvCOMP raises its own types
                    raise ContainerError(f"nvans: cannot decode chunk {i}: {e}") from e
                if got.numel() != dst.numel():
                    raise ContainerError(f"nvans: chunk {i} decodes to {got.numel()} bytes, expected {dst.numel()}")
                dst.copy_(got)
        return out

    def decode_tensor(self, data, dtype, shape, bits, bf16, device):
        device = torch.device(device)
        size = expected_nbytes(dtype, shape, bits)
        if size == 0:
            _expect(data, 0, self.name)
            return unwire(torch.zeros(0, dtype=torch.uint8, device=device), dtype, shape, bits)
        self._check_declared(data, size)
        if not gpu_ready(device):
            if not gpu_ready("cuda"):
                raise self._missing("decoder without a GPU")
            return unwire(self._gpu_raw(data, size, torch.device("cuda")), dtype, shape, bits).to(device)
        return unwire(self._gpu_raw(data, size, device), dtype, shape, bits)
