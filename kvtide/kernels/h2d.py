"""Host-to-device copies that never wait for the device.

A copy from pageable host memory to the GPU may wait until the stream has run everything enqueued before it
(the compressed pool's placement would wait for the whole forward). With the engine's async scheduling the host
prepares step N+1 while the device still runs step N, so every copy on that path goes through pinned memory
instead: torch's caching host allocator keeps the pinned block until the copy has run, so the caller may drop or
reuse its source at once.
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on ``device`` (and ``dtype``), contiguous; a CPU tensor bound for CUDA goes through pinned memory,
    non-blocking."""
    device = torch.device(device)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device).contiguous()
    return t.contiguous().pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into the existing ``dst`` (same numel; a fixed buffer a captured CUDA graph reads), through pinned
    memory and non-blocking when a CPU source goes to CUDA. Returns ``dst``."""
    src = src.reshape(dst.shape).to(dst.dtype)
    if dst.device.type == "cuda" and src.device.type == "cpu":
        src = src.contiguous().pin_memory()
        return dst.copy_(src, non_blocking=True)
    return dst.copy_(src)
