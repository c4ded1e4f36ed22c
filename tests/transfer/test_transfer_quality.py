"""Quality on a real model and real text, head scores, and the profiler's evaluate callback (smollm2, short texts)."""
import json
import math

import pytest
import torch

from kvtide.transfer.baselines import BF16, ZIPFUSION
from kvtide.transfer.corpus import WORKLOADS, documents, windows
from kvtide.transfer.evaluate import EvaluateConfig, PipelineEvaluator
from kvtide.transfer.head_scores import (
    HeadScoreConfig,
    far_mass,
    load_head_scores,
    measure_head_scores,
    path_for,
)
from kvtide.transfer.profiler import Profiler, ProfilerConfig, pipeline_space
from kvtide.transfer.quality import (
    QualityConfig,
    bundled_model,
    evaluator,
    quality_spec,
)
from tests.conftest import require_model

MODEL = "smollm2-135m"
CFG = QualityConfig(prefix=96, continuation=16, samples=2)


@pytest.fixture(scope="module")
def prose():
    require_model(MODEL)
    return evaluator(MODEL, "prose", CFG)


@pytest.mark.parametrize("spec", [BF16, ZIPFUSION])
def test_lossless_is_exactly_reference(prose, spec):
    r = prose.evaluate(spec, keep_codec=True)
    assert r.relative_accuracy == 1.0 and r.agreement == 1.0 and r.kl == 0.0
    assert r.tokens == CFG.samples * CFG.continuation and 0 < r.reference_accuracy <= 1


def test_lossy_profile_moves_the_distribution(prose):
    r = prose.evaluate("none|uniform:k=2,v=2,g=32|pack")
    assert r.kl > 0 and math.isfinite(r.kl)
    assert r.relative_accuracy < 1.0 or r.agreement < 1.0 or r.kl > 1e-3
    fine = prose.evaluate("none|uniform:k=8,v=8,g=32|pack")
    assert 0 < fine.kl < r.kl  # more bits, closer to the reference


def test_pruning_press_masks_positions(prose):
    scores = torch.arange(30 * 3, dtype=torch.float64).reshape(30, 3)
    r = prose.evaluate("none|mixhq:hi=16,lo=0,frac=0.5,sink=4,win=16|none", scores)
    assert r.kl > 0 and all(math.isfinite(x) for x in (r.relative_accuracy, r.agreement, r.kl))


def test_quality_spec_drops_only_the_codec():
    assert quality_spec("hadamard|kivi:k=2,v=2,g=32,r=32|ans") == "hadamard|kivi|none"  # canonical: defaults dropped
    assert quality_spec("none|uniform:k=3,v=3|zstd:l=3") == "none|uniform:k=3,v=3|none"
    with pytest.raises(ValueError):
        QualityConfig(prefix=0)


def test_corpus_windows_are_deterministic_and_distinct():
    require_model(MODEL)
    _, tok = bundled_model(MODEL)
    for wl in WORKLOADS:
        a = windows(tok, wl, 3, 64)
        assert a == windows(tok, wl, 3, 64)
        assert all(len(w) == 64 for w in a) and len({tuple(w) for w in a}) == 3
    assert len(documents("code")) >= 8
    with pytest.raises(ValueError):
        documents("poetry")


def test_far_mass_on_uniform_attention():
    T, D = 10, 4
    q = torch.zeros(1, 1, T, D)  # equal scores: attention spreads evenly over the causal prefix
    k = torch.randn(1, 1, T, D)
    got = far_mass(q, k, queries=2, sink=1, win=3)
    # query 8 sees 9 keys, far ones are 1..5 (5); query 9 sees 10, far ones 1..6 (6)
    assert float(got[0]) == pytest.approx((5 / 9 + 6 / 10) / 2)


def test_head_scores_shape_range_and_determinism():
    require_model(MODEL)
    model, tok = bundled_model(MODEL)
    cfg = HeadScoreConfig(tokens=96, samples=1, queries=16, sink=4, win=16)
    a = measure_head_scores(model, tok, cfg)
    b = measure_head_scores(model, tok, cfg)
    assert a.shape == (30, 3) and torch.equal(a, b)
    assert float(a.min()) >= 0 and float(a.max()) <= 1 and float(a.std()) > 0


@pytest.mark.parametrize("name,shape", [("smollm2-135m", (30, 3)), ("qwen2.5-coder-0.5b", (24, 2))])
def test_stored_head_scores(name, shape):
    s = load_head_scores(name, measure_if_missing=False)
    assert tuple(s.shape) == shape and torch.isfinite(s).all() and float(s.std()) > 0
    doc = json.loads(path_for(name).read_text())
    assert doc["model"] == name and doc["config"]["sink"] == 4


def test_evaluate_callback_and_progress(prose):
    head = load_head_scores(MODEL, measure_if_missing=False)
    pe = PipelineEvaluator(prose, head, EvaluateConfig(constraint="point"))  # 2 windows: a wide interval
    ratio, enc, dec, q = pe("hadamard|uniform:k=4,v=4,g=32|zstd")
    assert 2.0 < ratio < 8.0 and 0 < enc < math.inf and 0 < dec < math.inf and 0.5 < q < 1.5
    pe("hadamard|uniform:k=4,v=4,g=32|pack")
    assert pe.quality_runs == 1  # codecs are exact: one quality run per transform|quantizer
    r1, r2 = (pe.records[s] for s in ("hadamard|uniform:k=4,v=4,g=32|zstd", "hadamard|uniform:k=4,v=4,g=32|pack"))
    assert r1.quality == r2.quality and r1.kl == r2.kl and r1.ratio != r2.ratio
    space = pipeline_space(transforms=("none",), quants=("uniform", "mixhq"), bits=(4,), groups=(32,), codecs=("pack",))
    res = Profiler(space, pe, ProfilerConfig(0.9, mode="exhaustive"), progress=True).run()
    assert res.evaluations == 2 and all(p.ratio > 1 for p in res.points)
