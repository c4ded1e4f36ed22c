"""Attention backends: the bridge between the model's per-layer attention call and the paged KV.

``base`` holds what every backend shares; one module per backend (``torch_attn``, ``flashinfer_attn``,
``zip_fused``, ``decompress_attend``); ``registry`` picks one by name and imports only that one.
"""
from .base import AttentionBackend, BatchLayout, PageArrays
from .registry import BACKENDS, backend_module, make_backend, make_pool_backend

__all__ = ["AttentionBackend", "BatchLayout", "PageArrays", "BACKENDS", "backend_module", "make_backend",
           "make_pool_backend"]
