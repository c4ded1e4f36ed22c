"""Which attention backend serves an engine, by the name users pass (``EngineConfig.attention_backend``).

Names map to modules, imported only when a backend is chosen (FlashInfer and Triton are optional). Over the fixed
cache: auto, torch, flashinfer. Over the compressed pool (``CacheConfig.compress``): auto, zip (the fused kernel),
torch and flashinfer (each decompress-then-attend around that dense backend).
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ...cache.zip_pages import ZipPagedKV
from .base import AttentionBackend

BACKENDS = {  # backend name -> its module
    "torch": "kvtide.engine.attention.torch_attn",
    "flashinfer": "kvtide.engine.attention.flashinfer_attn",
    "zip": "kvtide.engine.attention.zip_fused",
}
DECOMPRESS_ATTEND = "kvtide.engine.attention.decompress_attend"  # wraps torch/flashinfer over the pool


def backend_module(name: str) -> ModuleType:
    """The module of backend ``name`` (imported now)."""
    return importlib.import_module(BACKENDS[name])


def make_backend(name: str, kv_caches: list[torch.Tensor], num_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int) -> AttentionBackend:
    """A backend over the fixed per-layer caches ``kv_caches``. auto: flashinfer on CUDA where it serves this
    model, else torch."""
    device = kv_caches[0].device
    if name in ("auto", "torch") and device.type != "cuda":  # no FlashInfer/Triton import: the core install lacks them
        return backend_module("torch").TorchAttention(kv_caches, num_heads, head_dim)
    fi = backend_module("flashinfer")
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" and fi.flashinfer_unsupported(head_dim, kv_caches[0].dtype) is None \
            else "torch"
    if name == "torch":
        return backend_module("torch").TorchAttention(kv_caches, num_heads, head_dim)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        why = fi.flashinfer_unsupported(head_dim, kv_caches[0].dtype)
        if why is not None:
            raise ValueError(f"attention backend 'flashinfer': {why}; choose auto or torch")
        return fi.FlashInferAttention(kv_caches, num_heads, num_kv_heads, head_dim, page_size)
    if name == "zip":
        raise ValueError("attention backend 'zip' attends over the compressed pool: set CacheConfig(compress=True), "
                         "or choose auto, torch or flashinfer")
    raise ValueError(f"unknown attention backend '{name}' (choose auto, torch or flashinfer)")


def _flashinfer_serves(pool: ZipPagedKV, head_dim: int) -> bool:
    return pool.device.type == "cuda" and backend_module("flashinfer").flashinfer_unsupported(head_dim) is None


def make_pool_backend(name: str, pool: ZipPagedKV, num_heads: int, num_kv_heads: int, head_dim: int,
                      page_size: int) -> AttentionBackend:
    """A backend over the compressed pool: zip (fused kernel for decodes), torch and flashinfer
    (decompress-then-attend).

    auto on CUDA picks zip when the kernel can serve this pool (``zip_fused.fused_unsupported``), else flashinfer
    when importable; on CPU torch (the Triton interpreter is for tests only)."""
    if name in ("auto", "zip"):
        fused = backend_module("zip")
        why = fused.fused_unsupported(pool, num_heads, num_kv_heads, head_dim, page_size)
        if name == "zip" and why is not None:
            raise ValueError(why)
        if name == "zip" or (pool.device.type == "cuda" and why is None):
            fallback = make_pool_backend("flashinfer" if _flashinfer_serves(pool, head_dim) else "torch",
                                         pool, num_heads, num_kv_heads, head_dim, page_size)
            return fused.ZipFusedAttention(pool, num_heads, num_kv_heads, head_dim, fallback)
        name = "flashinfer" if _flashinfer_serves(pool, head_dim) else "torch"
    wrap = importlib.import_module(DECOMPRESS_ATTEND).DecompressThenAttend
    scratch = [torch.zeros(1, 2, page_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device=pool.device)]
    if name == "torch":
        return wrap(pool, backend_module("torch").TorchAttention(scratch, num_heads, head_dim))
    if name == "flashinfer":
        fi = backend_module("flashinfer")
        if pool.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        why = fi.flashinfer_unsupported(head_dim)
        if why is not None:
            raise ValueError(f"attention backend 'flashinfer': {why}; choose auto, zip or torch")
        return wrap(pool, fi.FlashInferAttention(scratch, num_heads, num_kv_heads, head_dim, page_size))
    raise ValueError(f"unknown attention backend '{name}' for the compressed cache (choose auto, zip, torch or flashinfer)")
