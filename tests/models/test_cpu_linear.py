"""oneDNN packed linears on the CPU: the same products as nn.Linear (to float32 rounding), weights left as they were."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvtide.models.cpu_linear import PackedLinear, onednn_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN packed linear ops")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_nn_linear(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 160, bias=bias)
    x = torch.randn(2, rows, 96)
    ref = lin(x)
    got = PackedLinear(lin)(x)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_pack_linears_keeps_tied_weights_and_skips_other_dtypes():
    emb = nn.Embedding(50, 32)
    net = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 50, bias=False), nn.Linear(8, 8).to(torch.bfloat16))
    net[1].weight = emb.weight
    assert pack_linears(net) == 2
    assert isinstance(net[0], PackedLinear) and isinstance(net[2], nn.Linear)
    assert emb.weight.shape == (50, 32) and "1.packed" in net.state_dict()  # the tied weight stays the embedding's


def test_engine_with_packed_linears_gives_the_same_greedy_tokens():
    from kvtide import SamplingParams
    from kvtide.engine.llm import LLM

    # greedy tokens with clear logit margins (tests/engine/test_loop.py): float32 summation order cannot flip them
    prompts = ["Once upon a time", "The capital of France is", "def f(x):", "import numpy as np"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for on in (False, True):
        llm = LLM("smollm2-135m", device="cpu", cpu_onednn=on, cache={"num_pages": 64}, progress=False)
        assert any(isinstance(m, PackedLinear) for m in llm.engine.model.modules()) == on
        outs[on] = [o.token_ids for o in llm.generate(prompts, greedy)]
        del llm
    assert outs[True] == outs[False]
