"""RoPE tables: our inverse frequencies and attention scaling equal transformers' for each scaling variant."""
from __future__ import annotations

import logging

import pytest
import torch

from kvtide.models.rope import inv_freq_and_scale, rope_tables

SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
def test_inverse_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity(logging.ERROR)
    cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, max_position_embeddings=32768,
                      rope_parameters={"rope_theta": 500000.0, **scaling})
    ref, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    ours, scale = inv_freq_and_scale(128, 500000.0, scaling)
    assert torch.equal(ours, ref.float())
    assert scale == pytest.approx(ref_scale)


def test_default_is_the_plain_formula():
    inv, scale = inv_freq_and_scale(64, 10000.0, None)
    assert scale == 1.0
    assert torch.allclose(inv, 1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64), rtol=0, atol=0)


def test_unknown_scaling_is_refused():
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        rope_tables(64, 10000.0, {"rope_type": "dynamic-ntk-magic"}, 16)
