"""Piecewise CUDA graphs for decode: the same greedy tokens as eager steps (GPU), a clear refusal on the CPU."""
from __future__ import annotations

import pytest
import torch

from kvtide import LLM, CacheConfig, SamplingParams
from kvtide.config import EngineConfig


def test_cuda_graphs_refused_without_cuda() -> None:
    cfg = EngineConfig(model="random:tiny", device="cpu", cuda_graphs=True)
    from kvtide.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        LLMEngine(cfg, progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compress", [False, True])
def test_cuda_graph_decode_gives_the_eager_tokens(compress: bool) -> None:
    """Random tiny model at the CUDA zip kernel's shape (head_dim 128, group 4): prompts of different lengths,
    decode across page boundaries (pages compress between replays when compress=True), batch sizes that change."""
    prompts = [[(7 * i + 3 * j) % 997 + 1 for j in range(5 + 13 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=24 + 6 * i, ignore_eos=True) for i in range(5)]
    out = {}
    for graphs in (False, True):
        llm = LLM("random:tiny-d128", progress=False, device="cuda", dtype="float32", seed=0, cuda_graphs=graphs,
                  cache=CacheConfig(compress=compress, num_pages=64))
        out[graphs] = [r.token_ids for r in llm.generate(prompts, params)]
        if graphs:
            assert llm.engine.runner.graphs.captures >= 2, "batch sizes 5 and fewer each need their capture"
            if compress:
                assert llm.engine.store.geo.value_order == "mma"
                assert llm.engine.runner.attention.kernel.__name__.endswith("zip_attention_cuda")
    assert out[True] == out[False]
