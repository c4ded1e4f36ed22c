"""zstd and lz4 frame decompression capped at the exact size the caller expects.

A frame's own content size is checked before anything is allocated (python-zstandard allocates a declared
content size whatever ``max_output_size`` says); frames without one are decoded into a buffer of the expected
size and refused when they would exceed it. One frame per stream: trailing bytes are refused. Every failure
is a ContainerError naming the codec, what the frame declared and what was expected.
"""
from __future__ import annotations

from ..extras import require
from .errors import ContainerError

_ZSTD_MIN_WINDOW = 1 << 10
_ZSTD_MAX_WINDOW = 1 << 27  # zstd's default limit; an encoder knowing its input size never needs more than it


def zstd(data: bytes, size: int) -> bytes:
    zstandard = require("zstandard", "transfer", "the zstd codec")
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise ContainerError(f"zstd: bad frame header: {e}") from e
    if declared not in (-1, size):  # -1: the frame does not say
        raise ContainerError(f"zstd: frame declares {declared} bytes, the stream's shape implies {size}")
    window = min(_ZSTD_MAX_WINDOW, max(_ZSTD_MIN_WINDOW, 1 << max(0, size - 1).bit_length()))
    try:
        out = zstandard.ZstdDecompressor(max_window_size=window).decompress(
            data, max_output_size=max(size, 1), allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise ContainerError(f"zstd: cannot decompress stream (expected {size} bytes): {e}") from e
    if len(out) != size:
        raise ContainerError(f"zstd: stream holds {len(out)} bytes, expected {size}")
    return out


def lz4(data: bytes, size: int) -> bytes:
    require("lz4", "transfer", "the lz4 codec")
    import lz4.frame
    try:
        declared = lz4.frame.get_frame_info(data)["content_size"]
    except (RuntimeError, ValueError) as e:  # what python-lz4 raises on damage
        raise ContainerError(f"lz4: bad frame header: {e}") from e
    if declared not in (0, size):  # 0: the frame does not say
        raise ContainerError(f"lz4: frame declares {declared} bytes, the stream's shape implies {size}")
    d = lz4.frame.LZ4FrameDecompressor()
    try:
        out = d.decompress(data, max_length=size + 1)
    except (RuntimeError, ValueError) as e:
        raise ContainerError(f"lz4: cannot decompress stream (expected {size} bytes): {e}") from e
    if len(out) != size or not d.eof or d.unused_data:
        extra = len(d.unused_data or b"")
        raise ContainerError(f"lz4: stream holds {len(out)}{'' if d.eof else '+'} bytes (+{extra} trailing), "
                             f"expected {size} in one frame")
    return out
