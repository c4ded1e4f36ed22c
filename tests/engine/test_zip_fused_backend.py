"""attention_backend='zip' (fused Triton kernel over the compressed pool) gives the same greedy tokens as the torch
backend with and without compression: batched decodes, chunked prefill mixed with decodes, pages compressed while
sequences decode, prefix-cache hits on compressed pages. On CPU the kernel runs under the Triton interpreter
(slow: a tiny random-weight model, few short prompts). Plus the errors that name their fix."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # must precede the first kernel launch (kernels are built lazily)
    os.environ["TRITON_INTERPRET"] = "1"

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from kvtide import LLM, CacheConfig, SamplingParams, SchedulerConfig  # noqa: E402
from kvtide.config import EngineConfig  # noqa: E402
from kvtide.engine.attention.zip_fused import fused_unsupported  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MODEL = "random:tiny"  # 2 layers, 4 heads / 2 KV heads, head_dim 32: one 512-value block per group
# Prompt seed picked so that no greedy decision of the reference is a near-tie (smallest top-2 logit gap 0.0065;
# the kernel's bf16 q, P and output move gaps by up to ~0.003 on this random model, whose logits are flat).
_gen = torch.Generator().manual_seed(179)
PROMPTS = [torch.randint(0, 1000, (n,), generator=_gen).tolist() for n in (9, 23, 40)]
# Second round: 32 cached tokens + a 5-token prefill chunk; 32 cached + 1 token (a prefix hit the kernel decodes).
HITS = [PROMPTS[2][:32] + [7, 8, 9, 10, 11], PROMPTS[2][:33]]
TIE = 0.01  # a top-2 logit gap below this is a near-tie: runs with different rounding may part there


def make(backend: str, compress: bool) -> LLM:
    """A 16-token step budget: prompts are prefilled in chunks while earlier ones decode (mixed steps)."""
    return LLM(MODEL, progress=False, device=DEV, attention_backend=backend, seed=0,
               cache=CacheConfig(compress=compress, num_pages=48),
               scheduler=SchedulerConfig(max_num_batched_tokens=16))


def generate_with_gaps(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and, for each, the top-2 logit gap of its decision (sampling and _append_token see the
    sampled sequences in the same order, so the gaps pair up with requests through it)."""
    from kvtide.engine import model_runner

    pending: list[float] = []
    gaps: dict[str, list[float]] = {}
    eng = llm.engine

    def greedy(logits):
        top = logits.float().topk(2, dim=-1).values
        pending.extend((top[:, 0] - top[:, 1]).tolist())
        return real_greedy(logits)

    def append_token(seq, slot, token, now):
        gaps.setdefault(seq.request_id, []).append(pending.pop(0))
        return real_append(seq, slot, token, now)

    real_greedy, real_append = model_runner.greedy_tokens, eng._append_token
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_runner, "greedy_tokens", greedy)
        mp.setattr(eng, "_append_token", append_token)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [(o.token_ids, gaps[o.request_id]) for o in outs]


@pytest.fixture(scope="module")
def runs():
    out = {}
    for name, backend, compress in (("dense", "torch", False), ("decompress", "torch", True), ("zip", "zip", True)):
        llm = make(backend, compress)
        first = generate_with_gaps(llm, PROMPTS, 12)  # every prompt fills a page while decoding
        second = generate_with_gaps(llm, HITS, 6)
        out[name] = (llm, first + second)
    return out


def matched(ref: list[tuple[list[int], list[float]]], got: list[tuple[list[int], list[float]]]) -> int:
    """Greedy tokens equal up to where the runs part, which may only be at a near-tie in both; returns how
    many decisions agreed."""
    n = 0
    for (rt, rg), (gt, gg) in zip(ref, got):
        assert len(rt) == len(gt)
        for j, (a, b) in enumerate(zip(rt, gt)):
            if a != b:
                assert rg[j] < TIE and gg[j] < TIE, f"tokens part at {j} ({a} vs {b}) without a near-tie: {rg[j]:.4f}"
                break
            n += 1
    return n


def test_zip_backend_greedy_tokens_equal_torch_with_and_without_compression(runs):
    dense, decompress, zipped = runs["dense"][1], runs["decompress"][1], runs["zip"][1]
    total = sum(len(t) for t, _ in dense)
    assert [t for t, _ in decompress] == [t for t, _ in dense]  # same numerics: always equal
    assert matched(dense, zipped) >= 0.75 * total  # all of them with these prompts; a near-tie may cut a run short
    assert matched(decompress, zipped) >= 0.75 * total


def test_zip_backend_routes_decodes_to_the_kernel_over_compressed_pages(runs):
    llm = runs["zip"][0]
    eng = llm.engine
    att = eng.runner.attention
    assert att.name == "zip" and att.fallback.name == "decompress+torch"
    c = att.counts
    assert c["kernel_seqs"] >= 3 * 11 and c["fallback_seqs"] > 0 and c["mixed_steps"] > 0, c
    s = eng.kv_stats()
    assert s["pages_compressed_total"] >= 6 and s["k_ratio"] < 1.0 and s["v_ratio"] < 1.0, s
    hits = eng.block_manager.stats["prefix_hit_tokens"]
    assert hits >= 64, "the second round must start from cached (compressed) pages"


def test_auto_on_cpu_keeps_decompress_then_attend():
    if DEV == "cuda":
        pytest.skip("auto picks zip on CUDA")
    llm = LLM(MODEL, progress=False, device="cpu", cache=CacheConfig(compress=True, num_pages=8))
    assert llm.engine.runner.attention.name == "decompress+torch"


def test_zip_without_compression_is_refused_with_the_fix(monkeypatch):
    with pytest.raises(ValueError, match=r"compress=True"):
        EngineConfig(model=MODEL, attention_backend="zip")
    monkeypatch.setenv("KVTIDE_ATTENTION_BACKEND", "zip")
    monkeypatch.setenv("KVTIDE_CACHE_COMPRESS", "1")
    cfg = EngineConfig.from_env(model=MODEL)  # both from the environment: checked together
    assert cfg.attention_backend == "zip" and cfg.cache.compress


def test_zip_on_cpu_without_interpreter_is_refused_with_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1"):
        LLM(MODEL, progress=False, device="cpu", attention_backend="zip", cache=CacheConfig(compress=True, num_pages=8))


def test_shape_limits_name_the_fix():
    store = SimpleNamespace(device=torch.device(DEV), block_size=512, format_version=1,
                            pool=torch.zeros(1 << 10, dtype=torch.uint8), geo=SimpleNamespace(value_order="token"))
    assert fused_unsupported(store, 4, 2, 32, 16) is None
    assert "head_dim" in fused_unsupported(store, 4, 2, 96, 16)


def test_cuda_kernel_is_built_when_the_backend_is_made(monkeypatch):
    """Over a CUDA store in the 'mma' order the backend compiles the kernel plan() launches by default at
    construction (NVRTC), not in the first decode step; over a CPU store it builds nothing."""
    from kvtide.engine.attention.zip_fused import ZipFusedAttention
    from kvtide.kernels import zip_attention_cuda as zc

    built = []
    monkeypatch.setattr(zc, "kernels", lambda *a: built.append(a))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    geo = SimpleNamespace(value_order="mma")
    for device in ("cpu", "cuda"):
        store = SimpleNamespace(geo=geo, device=torch.device(device), format_version=2)
        ZipFusedAttention(store, 32, 8, 128, fallback=None)
    stage = zc.default_stage(128)
    want = [(0, 128, 2, w, mb, cm, stage, bal) for w, mb, cm, bal in zc.default_launches(128)]
    assert sorted(built) == sorted(want)


def test_whole_step_graph_defaults_and_the_cpu_fallback():
    """full_cuda_graphs=None takes the backend's default (zip: whole steps; torch: piecewise) and True / False
    override it. Off CUDA, or over the Triton kernel, zip's plan_graph plans as usual and returns no graph key, so
    the runner would run the step piecewise rather than capture what cannot be captured."""
    from kvtide.engine.attention import BatchLayout

    assert make("zip", True).engine.runner.full_graphs is True
    assert make("torch", True).engine.runner.full_graphs is False
    forced = LLM(MODEL, progress=False, device=DEV, attention_backend="torch", cache=CacheConfig(num_pages=8),
                 full_cuda_graphs=True)
    assert forced.engine.runner.full_graphs is True
    if DEV == "cuda":
        return  # the CUDA path is the GPU tests' (tests/engine/test_cuda_graphs.py)
    att = make("zip", True).engine.runner.attention
    layout = BatchLayout([1, 1], [5, 20], [[0], [1, 2]], torch.tensor([4, 35]), 16)
    assert att.plan_graph(layout) is None
    assert att.kplan is not None and att.counts["kernel_seqs"] == 2
