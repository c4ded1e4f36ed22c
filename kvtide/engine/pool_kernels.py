"""Binds the Triton kernels of ``kvtide.kernels`` to the compressed page pool (``kvtide.cache.zip_pages``).

The pool defines what it needs (``PoolKernels``) and imports no kernel; the engine hands these in for a pool on a
GPU. Each kernel module is imported at its first call, as the pool did before, so an engine that never writes a
compressed page never needs triton.
"""
from __future__ import annotations

from typing import Any

from ..cache.zip_pages import PoolKernels


def _write_pool(*args: Any, **kw: Any) -> None:
    from ..kernels import kv_write

    kv_write.write_pool(*args, **kw)


def _analyze(*args: Any, **kw: Any) -> Any:
    from ..kernels import zip_encode

    return zip_encode.analyze(*args, **kw)


def _pack(*args: Any, **kw: Any) -> None:
    from ..kernels import zip_encode

    zip_encode.pack(*args, **kw)


def triton_pool_kernels() -> PoolKernels:
    """The pool's device kernels: ``kv_write.write_pool``, ``zip_encode.analyze`` and ``zip_encode.pack``."""
    return PoolKernels(write_pool=_write_pool, analyze=_analyze, pack=_pack)
