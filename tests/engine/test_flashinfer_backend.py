"""The FlashInfer backend's construction, checked on the CPU with a stand-in for the flashinfer package (the real
one needs CUDA; tests/restore/test_cuda_paths.py and the H200 benches run it)."""
from __future__ import annotations

import sys
import types

import torch

from kvtide.engine.attention import BatchLayout


class _Wrapper:
    def __init__(self, workspace, layout, **kw):
        self.plans = []

    def plan(self, *args, **kw):
        self.plans.append(args)


def test_kernels_are_built_when_the_backend_is_made_not_in_the_first_step(monkeypatch):
    """FlashInfer compiles a module on the first plan of a shape (~19 s for the decode one on a fresh H200 host):
    the backend plans a decode and a prefill at construction, so no request's step pays for it."""
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_Wrapper,
                                 BatchPrefillWithPagedKVCacheWrapper=_Wrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    from kvtide.engine.attention.flashinfer_attn import FlashInferAttention

    caches = [torch.zeros(4, 2, 16, 2, 64, dtype=torch.bfloat16) for _ in range(3)]
    fi = FlashInferAttention(caches, num_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    assert len(fi.decode.plans) == 1 and len(fi.prefill.plans) == 1
    assert fi.decode.plans[0][1].tolist() == [0] and fi.wrapper is None  # one page named, nothing left planned
    fi.plan(BatchLayout([1, 1], [17, 3], [[1, 2], [3]], torch.tensor([32, 50]), 16))
    assert len(fi.decode.plans) == 2 and fi.wrapper is fi.decode


def test_models_whose_head_dim_flashinfer_lacks_get_torch_attention(monkeypatch):
    """FlashInfer 0.6.12 has no working prefill at head_dim 32 on the H200 (FA3 fails to build, FA2 refuses the
    tile configuration): such models get torch attention under 'auto', and a clear error when 'flashinfer' is asked."""
    from kvtide.engine.attention.flashinfer_attn import flashinfer_unsupported

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace())
    assert flashinfer_unsupported(64) is None and flashinfer_unsupported(128) is None
    assert "head_dim 64/128/256" in flashinfer_unsupported(32)
    assert flashinfer_unsupported(128, torch.float16) is None
    assert "float16/bfloat16 KV, this engine's is float32" in flashinfer_unsupported(128, torch.float32)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails
    assert "not installed" in flashinfer_unsupported(128)
