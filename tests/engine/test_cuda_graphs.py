"""CUDA graphs for decode, piecewise and whole-step: the same greedy tokens as eager steps (GPU), a clear refusal on
the CPU."""
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
    for mode in ("eager", "piecewise", "full"):
        llm = LLM("random:tiny-d128", progress=False, device="cuda", dtype="float32", seed=0,
                  cuda_graphs=mode != "eager", full_cuda_graphs=mode == "full",
                  cache=CacheConfig(compress=compress, num_pages=64))
        out[mode] = [r.token_ids for r in llm.generate(prompts, params)]
        graphs, attention = llm.engine.runner.graphs, llm.engine.runner.attention
        whole = mode == "full" and attention.name in ("zip", "flashinfer")  # torch attention is never captured
        if mode != "eager" and not whole:
            assert graphs.captures >= 2 and graphs.full_captures == 0, "batch sizes 5 and fewer each need a capture"
        if whole:
            assert graphs.full_captures >= 2 and graphs.captures == 0
        if compress:
            assert attention.name == "zip" and llm.engine.pool.geo.value_order == "mma"
            assert attention.kernel.__name__.endswith("zip_attention_cuda")
    assert out["piecewise"] == out["eager"]
    assert out["full"] == out["eager"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_whole_step_graphs_with_flashinfer_give_the_piecewise_tokens() -> None:
    """FlashInfer captured whole (its CUDA-graph wrapper per batch size, bf16): the piecewise graphs' tokens, with
    batch sizes that change as requests finish and contexts that cross pages; one capture per batch size."""
    pytest.importorskip("flashinfer")
    prompts = [[(7 * i + 3 * j) % 997 + 1 for j in range(5 + 13 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=24 + 6 * i, ignore_eos=True) for i in range(5)]
    out = {}
    for full in (False, True):
        llm = LLM("random:tiny-d128", progress=False, device="cuda", dtype="bfloat16", seed=0, cuda_graphs=True,
                  full_cuda_graphs=full, attention_backend="flashinfer", cache=CacheConfig(num_pages=64))
        out[full] = [r.token_ids for r in llm.generate(prompts, params)]
        graphs = llm.engine.runner.graphs
        if full:
            assert graphs.captures == 0 and 2 <= graphs.full_captures <= 5
    default = LLM("random:tiny-d128", progress=False, device="cuda", dtype="bfloat16", cuda_graphs=True,
                  attention_backend="flashinfer", cache=CacheConfig(num_pages=64))
    assert not default.engine.runner.full_graphs, "FlashInfer stays piecewise unless asked (EngineConfig)"
    assert out[True] == out[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_nudge_before_whole_step_replays_changes_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda_graphs.PDL_NUDGE (a trivial eager programmatic-dependent launch before each whole-step replay): it runs
    (its counter moves once per replay) and the zip engine's tokens stay the eager ones."""
    from kvtide.engine import cuda_graphs
    from kvtide.kernels import cuda_jit

    eager, _ = _zip_decode(20, graphs=False)
    monkeypatch.setattr(cuda_graphs, "PDL_NUDGE", True)
    dev = torch.cuda.current_device()
    before = int(cuda_jit._nudge(dev)[1].item())
    tokens, llm = _zip_decode(20, graphs=True)
    torch.cuda.synchronize()
    assert llm.engine.runner.graphs.full_captures >= 1
    assert int(cuda_jit._nudge(dev)[1].item()) - before >= 10, "one nudge per whole-step replay"
    assert tokens == eager


def _zip_decode(max_tokens: int, graphs: bool) -> tuple[list[list[int]], LLM]:
    """Greedy tokens of four prompts of different lengths over compressed pages (random tiny model, float32, the
    CUDA zip kernel's shape), eager or with CUDA graphs (whole steps, zip's default), and the engine."""
    prompts = [[(11 * i + 5 * j) % 991 + 1 for j in range(40 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM("random:tiny-d128", progress=False, device="cuda", dtype="float32", seed=0, cuda_graphs=graphs,
              cache=CacheConfig(compress=True, num_pages=64))
    return [r.token_ids for r in llm.generate(prompts, params)], llm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_whole_step_zip_graph_replays_as_contexts_grow() -> None:
    """One batch decoding 80 steps across five page boundaries (pages compress between replays, pages per split
    changes): whole-step graphs by default for zip, few captures (the tiny contexts move the split count while
    they are a few pages long), many replays, the eager engine's tokens."""
    eager, _ = _zip_decode(max_tokens=80, graphs=False)
    full, llm = _zip_decode(max_tokens=80, graphs=True)
    assert llm.engine.runner.full_graphs and 1 <= llm.engine.runner.graphs.full_captures <= 3
    assert llm.engine.runner.graphs.captures == 0
    assert llm.engine.pool.counters["pages_compressed"] > 0
    assert full == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_whole_step_zip_graph_with_balanced_runs_gives_the_eager_tokens(monkeypatch) -> None:
    """Balanced runs of the CUDA kernel (forced, 7 warps: runs cross sequences and KV heads) captured in whole-step
    graphs: pages per run and the partial slots come from the plan's fixed buffers as contexts grow and pages
    compress, and the tokens are the eager engine's with the same runs."""
    from kvtide.kernels import zip_attention_cuda as zc

    plan, seen = zc.plan, []

    def balanced_plan(*args, **kwargs):
        p = plan(*args, **{**kwargs, "options": zc.LaunchOptions(balanced=True, balanced_warps=7)})
        seen.append(p.balanced)
        return p

    monkeypatch.setattr(zc, "plan", balanced_plan)
    eager, _ = _zip_decode(max_tokens=48, graphs=False)
    full, llm = _zip_decode(max_tokens=48, graphs=True)
    assert llm.engine.runner.full_graphs and llm.engine.runner.graphs.full_captures >= 1
    assert seen and all(seen)
    assert full == eager
