"""Config sources: defaults, KVTIDE_* environment, explicit overrides; model loading from a plain HF directory."""
from __future__ import annotations

import pytest

from kvtide.config import EngineConfig


def test_env_overrides_and_explicit_wins(monkeypatch):
    monkeypatch.setenv("KVTIDE_CACHE_PAGE_SIZE", "32")
    monkeypatch.setenv("KVTIDE_SCHEDULER_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("KVTIDE_CACHE_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("KVTIDE_DEVICE", "cpu")
    cfg = EngineConfig.from_env(model="smollm2-135m")
    assert cfg.cache.page_size == 32 and cfg.scheduler.max_num_seqs == 5
    assert cfg.cache.enable_prefix_caching is False and cfg.device == "cpu"
    monkeypatch.setenv("KVTIDE_CACHE_PAGE_SIZE", "12")
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig.from_env()


def test_load_from_hf_directory_equals_bundled(tmp_path):
    """A plain HF safetensors directory (here: a copy of the converted cache) loads through the same path."""
    import shutil

    import torch

    from kvtide.models.loader import load_model, resolve_model_dir

    src = resolve_model_dir("smollm2-135m", progress=False)
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    model, tok, d = load_model(str(tmp_path))
    ref, _, _ = load_model("smollm2-135m")
    assert d == str(tmp_path)
    assert tok.encode("hello world") == [28120, 905]
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n
