"""GPU entropy codecs on nvCOMP (PyPI ``nvidia-nvcomp-cu13``, module ``nvidia.nvcomp``), with CPU paths where the
format is shared.

Each stage codes the same bytes as the CPU byte codecs (packed codes, or byte planes: ``codecs.wire_bytes``). A
stream is cut into fixed-size chunks that nvCOMP codes as one batch (one call, chunks in parallel on the GPU);
each chunk is stored as a 16-byte head (a u32 length, 12 zero bytes), its coded bytes and zeros up to a multiple
of 16 bytes, so every chunk starts 16-byte aligned in the stream (nvCOMP's decoders require it):

- ``nvzstd``: chunks of ``ZSTD_CHUNK`` bytes, each one standard zstd frame that declares its content size (nvCOMP's
  ``RAW`` bitstream), so the CPU ``zstandard`` package decodes it (through ``bounded.zstd``) and encodes it where
  there is no GPU.
- ``nvlz4``: nvCOMP LZ4, ``RAW`` bitstream: one raw LZ4 block (no frame, no chunks), decoded on the CPU by
  ``lz4.block`` with the expected size as its cap.
- ``nvans``: chunks of ``ANS_CHUNK`` bytes, each a ``WITH_UNCOMPRESSED_SIZE`` bitstream (a u64 size, then nvCOMP's
  own ANS format). No CPU implementation exists: encoding or decoding it without CUDA and nvCOMP raises
  ``MissingExtra`` naming the package. (The CPU rANS codec is the ``ans`` stage, another format.)

On the GPU, ``encode_device`` leaves the coded stream on the device (the container copies all of a blob's device
streams to the host together), and decoding uploads a stream once and decodes its chunks from device slices.

An empty stream is coded as no bytes. Decoding is bounded before nvCOMP allocates: the size each chunk declares
(its zstd frame content size, its nvans u64) must equal the size the stream's recorded dtype and shape imply, and
the decoded chunks must come out at exactly that size; nvCOMP failures become ContainerError. nvCOMP's decoders
are not hardened against crafted payloads (a damaged nvans payload was seen to stall the GPU decoder): the
container's checksum catches accidental damage before any stream is decoded, but a blob from an untrusted sender
with a valid checksum should be decoded with the CPU formats (nvzstd, nvlz4) or not with nvCOMP.
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np
import torch

from ..extras import MissingExtra, require
from ..log import get_logger
from . import bounded
from .codecs import Codec, _expect, _upload, expected_nbytes, unwire, wire_bytes
from .errors import ContainerError
from .stage import Stream, register

NVCOMP_PACKAGE = "nvidia-nvcomp-cu13"
log = get_logger("transfer")
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
    """nvCOMP on the stream's device; ``_cpu_encode`` / ``_cpu_decode`` are the same format on the host."""

    device_encode: ClassVar[bool] = True
    algorithm: ClassVar[str]
    kind: ClassVar[str] = "RAW"

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
            return self._gpu_encode(raw).cpu().numpy().tobytes()
        return self._cpu_encode(raw.cpu().numpy().tobytes())

    def encode_device(self, s: Stream) -> torch.Tensor | None:
        """The coded stream as a uint8 tensor on the stream's GPU (None: not a CUDA stream, or no nvCOMP)."""
        if not (isinstance(s.data, torch.Tensor) and s.data.is_cuda and nvcomp_module() is not None):
            return None
        raw = wire_bytes(s)
        return raw[:0] if raw.numel() == 0 else self._gpu_encode(raw)

    def _gpu_encode(self, raw: torch.Tensor) -> torch.Tensor:
        with torch.cuda.device(raw.device):
            enc = _codec(self.algorithm, self.kind, raw.device).encode(nvcomp_module().as_array(raw))
            return torch.as_tensor(enc, device=raw.device).view(torch.uint8).view(-1).clone()

    def _cpu_encode(self, raw: bytes) -> bytes:
        raise self._missing("encoder without a GPU")

    # --- decode -------------------------------------------------------------------------------------------
    def _check_declared(self, data: bytes, size: int) -> Any:
        """Refuse a stream whose declared size is not ``size`` (before anything is allocated); what the check
        parsed (the chunk spans of a chunked codec) goes on to the decoder, so a stream is parsed once."""

    def decode(self, data, dtype, shape, bits, bf16):
        size = expected_nbytes(dtype, shape, bits)
        if size == 0:
            _expect(data, 0, self.name)
            return np.zeros(shape, dtype)
        if not self.cpu_format and gpu_ready("cuda"):  # decode_tensor checks the declared sizes
            t = self.decode_tensor(data, dtype, shape, bits, bf16, "cuda").cpu()
            return t.numpy().view(dtype).reshape(shape)
        raw = self._cpu_decode(data, size, self._check_declared(data, size))
        return unwire(torch.frombuffer(bytearray(raw), dtype=torch.uint8), dtype, shape, bits).numpy().view(
            dtype).reshape(shape)

    def _cpu_decode(self, data: bytes, size: int, checked: Any) -> bytes:
        raise self._missing("decoder without a GPU")

    def decode_tensor(self, data, dtype, shape, bits, bf16, device):
        device = torch.device(device)
        if not gpu_ready(device):
            return super().decode_tensor(data, dtype, shape, bits, bf16, device)
        size = expected_nbytes(dtype, shape, bits)
        if size == 0:
            _expect(data, 0, self.name)
            return unwire(torch.zeros(0, dtype=torch.uint8, device=device), dtype, shape, bits)
        return unwire(self._gpu_raw(data, size, device, self._check_declared(data, size)), dtype, shape, bits)

    def _gpu_raw(self, data: Any, size: int, device: torch.device, checked: Any) -> torch.Tensor:
        """The stream's ``size`` wire bytes, decoded on ``device`` (``checked``: what ``_check_declared`` found)."""
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
        return got


_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
ZSTD_CHUNK = 1 << 16  # bytes per nvzstd chunk (frame): enough chunks to fill the GPU from one layer's stream
ANS_CHUNK = 1 << 20  # bytes per nvans chunk: one WITH_UNCOMPRESSED_SIZE ANS stream of a whole large array failed


_HEAD_BYTES = 16  # a chunk's head: u32 length, 12 zero bytes
_ZEROS = bytes(_HEAD_BYTES)


def _pad(k: int) -> int:
    return -k % _HEAD_BYTES


def chunk_spans(data: Any, size: int, chunk: int, declared: Callable[[memoryview], int], name: str
                ) -> list[tuple[int, int]]:
    """(offset, length) of each coded chunk of a stream of ``size`` bytes cut in ``chunk``-byte chunks, after
    checking the framing in full (ceil(size / chunk) chunks, each a 16-byte head holding its u32 length, its bytes,
    zeros to a multiple of 16) and that each chunk declares (``declared``) the size it must decode to."""
    buf = memoryview(data).cast("B")
    want = [min(chunk, size - i) for i in range(0, size, chunk)]
    out, off = [], 0
    for i, w in enumerate(want):
        if off + _HEAD_BYTES > len(buf):
            raise ContainerError(f"{name}: stream truncated at chunk {i} of {len(want)}")
        (k,) = _U32.unpack_from(buf, off)
        at = off + _HEAD_BYTES
        if k > len(buf) - at:
            raise ContainerError(f"{name}: chunk {i} claims {k} bytes, {len(buf) - at} left")
        end = at + k + _pad(k)
        if end > len(buf) or buf[off + 4: at] != _ZEROS[4:] or buf[at + k: end] != _ZEROS[:_pad(k)]:
            raise ContainerError(f"{name}: chunk {i}: its head or padding is not zeros, or the padding is cut")
        d = declared(buf[at: at + k])
        if d != w:
            raise ContainerError(f"{name}: chunk {i} declares {d} bytes, the stream's shape implies {w}")
        out.append((at, k))
        off = end
    if off != len(buf):
        raise ContainerError(f"{name}: {len(buf) - off} bytes after the last chunk")
    return out


def _frame_host(parts: list[bytes]) -> bytes:
    return b"".join(_U32.pack(len(p)) + _ZEROS[4:] + p + _ZEROS[:_pad(len(p))] for p in parts)


def _framed(parts: list[torch.Tensor]) -> torch.Tensor:
    """Every part behind its 16-byte head and padded to a multiple of 16, concatenated on the parts' device."""
    dev = parts[0].device
    heads = np.zeros((len(parts), _HEAD_BYTES), np.uint8)
    heads[:, :4] = np.array([p.numel() for p in parts], dtype="<u4").view(np.uint8).reshape(-1, 4)
    heads_t = torch.from_numpy(heads).to(dev)
    zeros = torch.zeros(_HEAD_BYTES, dtype=torch.uint8, device=dev)
    out = []
    for i, p in enumerate(parts):
        out += [heads_t[i], p]
        if _pad(p.numel()):
            out.append(zeros[:_pad(p.numel())])
    return torch.cat(out)


def _batch(algorithm: str, kind: str, device: torch.device, srcs: list[torch.Tensor], decode: bool
           ) -> list[torch.Tensor]:
    """nvCOMP over every tensor of ``srcs`` (uint8, on ``device``): one batched call where this nvCOMP has the
    batch API, else a call each. The results are copies the caller owns."""
    nvcomp = nvcomp_module()
    codec = _codec(algorithm, kind, device)
    run = codec.decode if decode else codec.encode
    with torch.cuda.device(device):
        if len(srcs) > 1 and not _local.__dict__.get("no_batch"):
            try:
                batch = run(nvcomp.as_arrays([nvcomp.as_array(t) for t in srcs]))
                return [torch.as_tensor(batch[i], device=device).view(torch.uint8).view(-1).clone()
                        for i in range(len(srcs))]
            except Exception as e:  # noqa: BLE001 - an nvCOMP build without the batch API: one call a chunk
                _local.no_batch = True
                log.warning("nvCOMP batch %s failed (%s: %s); coding one chunk a call", "decode" if decode
                            else "encode", type(e).__name__, e)
        return [torch.as_tensor(run(nvcomp.as_array(t)), device=device).view(torch.uint8).view(-1).clone()
                for t in srcs]


class _ChunkedNvCodec(_NvCodec):
    """A stream in chunks of ``chunk`` bytes, coded as one nvCOMP batch; each chunk behind its 16-byte head and
    padded to a multiple of 16 (``chunk_spans``)."""

    chunk: ClassVar[int]

    def _declared(self, frame: memoryview) -> int:
        raise NotImplementedError

    def _check_declared(self, data, size):
        return self._spans(data, size)

    def _spans(self, data: Any, size: int) -> list[tuple[int, int]]:
        return chunk_spans(data, size, self.chunk, self._declared, self.name)

    def _gpu_encode(self, raw: torch.Tensor) -> torch.Tensor:
        parts = [raw[i: i + self.chunk] for i in range(0, raw.numel(), self.chunk)]
        return _framed(_batch(self.algorithm, self.kind, raw.device, parts, decode=False))

    def _gpu_raw(self, data: Any, size: int, device: torch.device, spans: Any) -> torch.Tensor:
        src = _upload(data, device)
        try:
            outs = _batch(self.algorithm, self.kind, device, [src[o: o + k] for o, k in spans], decode=True)
        except ContainerError:
            raise
        except Exception as e:  # nvCOMP raises its own types
            raise ContainerError(f"{self.name}: cannot decode stream (expected {size} bytes): {e}") from e
        for i, got in enumerate(outs):
            w = min(self.chunk, size - i * self.chunk)
            if got.numel() != w:
                raise ContainerError(f"{self.name}: chunk {i} decodes to {got.numel()} bytes, expected {w}")
        return outs[0] if len(outs) == 1 else torch.cat(outs)


@register(Codec)
@dataclass(frozen=True)
class NvZstd(_ChunkedNvCodec):
    name: ClassVar[str] = "nvzstd"
    algorithm: ClassVar[str] = "zstd"
    chunk: ClassVar[int] = ZSTD_CHUNK

    def _cpu_encode(self, raw):
        zstandard = require("zstandard", "transfer", "the nvzstd codec on the CPU")
        z = zstandard.ZstdCompressor(level=3, write_content_size=True)
        return _frame_host([z.compress(raw[i: i + self.chunk]) for i in range(0, len(raw), self.chunk)])

    def _declared(self, frame):
        zstandard = require("zstandard", "transfer", "the nvzstd codec's size check")
        try:
            return zstandard.frame_content_size(frame)
        except zstandard.ZstdError as e:
            raise ContainerError(f"nvzstd: bad frame header: {e}") from e

    def _cpu_decode(self, data, size, spans):
        buf = memoryview(data).cast("B")
        return b"".join(bounded.zstd(buf[o: o + k], min(self.chunk, size - i * self.chunk))
                        for i, (o, k) in enumerate(spans))


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

    def _cpu_decode(self, data, size, checked):
        lz4_block = require("lz4.block", "transfer", "the nvlz4 codec on the CPU")
        try:
            out = lz4_block.decompress(data, uncompressed_size=size)
        except Exception as e:  # lz4.block.LZ4BlockError and the like
            raise ContainerError(f"nvlz4: cannot decompress stream (expected {size} bytes): {e}") from e
        if len(out) != size:
            raise ContainerError(f"nvlz4: stream holds {len(out)} bytes, expected {size}")
        return out


def ans_chunks(data: Any, size: int) -> list[tuple[int, int]]:
    """(offset, length) of each coded chunk of an nvans stream of ``size`` bytes, after checking every declared
    size: ceil(size / ANS_CHUNK) chunks in ``chunk_spans``' framing, whose nvCOMP bytes start with their u64 size."""
    def declared(b: memoryview) -> int:
        if len(b) < _U64.size:
            raise ContainerError(f"nvans: chunk of {len(b)} bytes has no size header")
        return _U64.unpack_from(b, 0)[0]

    return chunk_spans(data, size, ANS_CHUNK, declared, "nvans")


@register(Codec)
@dataclass(frozen=True)
class NvAns(_ChunkedNvCodec):
    """nvCOMP ANS in chunks of ``ANS_CHUNK`` bytes: per chunk a u32 length and nvCOMP's WITH_UNCOMPRESSED_SIZE
    stream (a u64 size, then its ANS format)."""

    name: ClassVar[str] = "nvans"
    algorithm: ClassVar[str] = "ans"
    kind: ClassVar[str] = "WITH_UNCOMPRESSED_SIZE"
    cpu_format: ClassVar[bool] = False
    chunk: ClassVar[int] = ANS_CHUNK

    def _spans(self, data, size):
        return ans_chunks(data, size)

    def decode_tensor(self, data, dtype, shape, bits, bf16, device):
        device = torch.device(device)
        size = expected_nbytes(dtype, shape, bits)
        if size == 0:
            _expect(data, 0, self.name)
            return unwire(torch.zeros(0, dtype=torch.uint8, device=device), dtype, shape, bits)
        spans = self._check_declared(data, size)
        if not gpu_ready(device):
            if not gpu_ready("cuda"):
                raise self._missing("decoder without a GPU")
            return unwire(self._gpu_raw(data, size, torch.device("cuda"), spans), dtype, shape, bits).to(device)
        return unwire(self._gpu_raw(data, size, device, spans), dtype, shape, bits)
