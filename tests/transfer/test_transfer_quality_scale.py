"""Quality at scale: windows of several prefix lengths, the prefix-KV file cache, reference hidden states in
place of logits, the interval in every result, pooling (the unified profile's mixed data set), the docs class."""
import math

import pytest
import torch

from kvtide.transfer import quality as qmod
from kvtide.transfer.corpus import ALL_WORKLOADS, named_documents, windows, windows_of
from kvtide.transfer.evaluate import EvaluateConfig, PipelineEvaluator, PooledEvaluator
from kvtide.transfer.prefix_cache import PrefixCache
from kvtide.transfer.quality import QualityConfig, QualityEvaluator, bundled_model, pool
from tests.conftest import require_model

MODEL = "smollm2-135m"
CFG = QualityConfig(prefix=48, continuation=16, samples=4, prefixes=(48, 96))
LOSSY = "none|uniform:k=2,v=2,g=32|none"


class Numbers:
    """A tokenizer whose tokens are the integers written in the text: spans are traceable."""

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]


def doc(a: int, b: int) -> str:
    return " ".join(str(i) for i in range(a, b))


def test_windows_of_lengths_order_middle_and_disjoint():
    docs = [doc(0, 100), doc(1000, 1300), doc(5000, 5060)]
    got = windows_of(Numbers(), "prose", [40, 200, 40], docs)
    assert [len(w) for w in got] == [40, 200, 40]
    assert got[1] == list(range(1050, 1250))  # longest first: the middle of the first document that holds it
    assert got[0] == list(range(30, 70)) and got[2] == list(range(5010, 5050))
    more = windows_of(Numbers(), "prose", [40] * 6, docs)  # more windows than documents: free spans
    flat = [t for w in more for t in w]
    assert len(flat) == len(set(flat)) == 240 and all(len(w) == 40 for w in more)
    with pytest.raises(ValueError, match="disjoint windows"):
        windows_of(Numbers(), "prose", [150] * 3, docs)
    assert windows(Numbers(), "prose", 2, 40, docs) == [list(range(30, 70)), list(range(1130, 1170))]


def test_config_lengths_and_fail_fast():
    assert CFG.prefix_lengths == (48, 48, 96, 96) and CFG.window_lengths == (65, 65, 113, 113)
    assert CFG.window == 113 and CFG.scored_positions == 64
    with pytest.raises(ValueError, match="samples"):
        QualityConfig(samples=3, prefixes=(8, 16))
    with pytest.raises(ValueError, match="prefixes"):
        QualityConfig(prefixes=[8])
    with pytest.raises(ValueError, match="resamples"):
        QualityConfig(resamples=10)


def test_docs_class_is_distinct_and_every_class_windows():
    require_model(MODEL)
    _, tok = bundled_model(MODEL)
    names = [n for n, _ in named_documents("docs")]
    assert names[:2] == ["idlelib/help.html", "idlelib/NEWS.txt"] and len(names) >= 8
    texts = {wl: {t for _, t in named_documents(wl)} for wl in ALL_WORKLOADS}
    assert not texts["docs"] & (texts["prose"] | texts["code"])
    for wl in ALL_WORKLOADS:
        ws = windows_of(tok, wl, CFG.window_lengths)
        assert [len(w) for w in ws] == list(CFG.window_lengths) and ws == windows_of(tok, wl, CFG.window_lengths)


def _evaluator(cache=None) -> QualityEvaluator:
    model, tok = bundled_model(MODEL)
    return QualityEvaluator(model, windows_of(tok, "code", CFG.window_lengths), CFG, cache)


def test_positions_counted_and_interval_in_the_result():
    require_model(MODEL)
    ev = _evaluator()
    r = ev.evaluate(LOSSY)
    assert r.tokens == 64 and r.window_tokens == (16,) * 4 and r.strata == ("p48", "p48", "p96", "p96")
    assert sum(r.window_reference_correct) == round(r.reference_accuracy * 64)
    assert r.relative_accuracy == sum(r.window_correct) / sum(r.window_reference_correct)
    assert r.ci_low <= r.relative_accuracy <= r.ci_high and r.ci_high - r.ci_low > 0
    assert [tuple(k.shape) for k in ev.kv] == [(30, 2, 48, 3, 64)] * 2 + [(30, 2, 96, 3, 64)] * 2
    same = ev.evaluate("none|none|none")
    assert (same.relative_accuracy, same.ci_low, same.ci_high, same.kl) == (1.0, 1.0, 1.0, 0.0)


def test_cached_prefix_kv_gives_the_same_result(tmp_path):
    require_model(MODEL)
    plain = _evaluator()
    cache = PrefixCache(tmp_path)
    first = _evaluator(cache)
    assert (cache.hits, cache.misses) == (0, 4)
    again = _evaluator(cache)
    assert (cache.hits, cache.misses) == (4, 4)
    for a, b in zip(plain.kv, again.kv):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert plain.evaluate(LOSSY) == first.evaluate(LOSSY) == again.evaluate(LOSSY)


def test_damaged_or_oversized_cache_files_are_recomputed(tmp_path):
    require_model(MODEL)
    cache = PrefixCache(tmp_path)
    ref = _evaluator(cache)
    files = sorted(tmp_path.glob("*.pt"))
    assert len(files) == 4
    files[0].write_bytes(files[0].read_bytes()[:1000])  # truncated
    torch.save(torch.zeros(3, dtype=torch.bfloat16), files[1])  # wrong shape
    files[2].write_bytes(b"\0" * (files[2].stat().st_size + (1 << 17)))  # larger than the tensor needs
    again = _evaluator(cache)
    assert cache.misses == 4 + 3 and cache.hits == 1
    assert all(torch.equal(a, b) for a, b in zip(ref.kv, again.kv))


def test_reference_from_hidden_states_equals_kept_logits(monkeypatch):
    require_model(MODEL)
    kept = _evaluator()
    monkeypatch.setattr(qmod, "REFERENCE_LOGITS_BUDGET", 0)
    recomputed = _evaluator()
    assert not recomputed._keep_logits and kept._keep_logits
    assert kept.evaluate(LOSSY) == recomputed.evaluate(LOSSY)


def test_context_limit_is_checked():
    require_model(MODEL)
    model, _ = bundled_model(MODEL)
    cfg = QualityConfig(prefix=model.args.max_position_embeddings, continuation=4, samples=1)
    with pytest.raises(ValueError, match="positions"):
        QualityEvaluator(model, [[0] * cfg.window], cfg)


def test_pooled_evaluator_and_the_lower_bound_constraint():
    require_model(MODEL)
    model, tok = bundled_model(MODEL)
    evs = {wl: QualityEvaluator(model, windows_of(tok, wl, CFG.window_lengths), CFG) for wl in ("prose", "code")}
    parts = {wl: PipelineEvaluator(ev) for wl, ev in evs.items()}
    pooled = PooledEvaluator(parts)
    ratio, _, _, q = pooled(LOSSY)
    recs = [pe.records[LOSSY] for pe in parts.values()]
    assert ratio == pytest.approx(2 / sum(1 / r.ratio for r in recs))
    p = pooled.pooled_quality(LOSSY)
    assert q == p.ci_low and p.tokens == 128 and len(set(p.strata)) == 4
    assert p.relative_accuracy == sum(p.window_correct) / sum(p.window_reference_correct)
    assert all(pe.quality_runs == 1 for pe in parts.values())  # the workloads' evaluations are shared
    assert pool({"x": parts["code"].quality_of(LOSSY)}, CFG.bootstrap).relative_accuracy == recs[1].quality
    point = PipelineEvaluator(evs["code"], config=EvaluateConfig(constraint="point"))
    assert point(LOSSY)[3] == recs[1].quality and parts["code"](LOSSY)[3] == recs[1].quality_low
    assert math.isfinite(recs[1].quality_high)
    with pytest.raises(ValueError, match="constraint"):
        EvaluateConfig(constraint="upper")


def test_table_keeps_the_interval_beside_the_quality(tmp_path):
    import json

    from kvtide.transfer.controller import Profile
    from kvtide.transfer.table import load_profiles, save_profiles
    profs = [Profile("a|b|c", 4.0, 1e8, math.inf, 0.975)]
    save_profiles(tmp_path / "t.json", profs, extra={"a|b|c": {"quality_point": 0.99, "quality_high": 1.005}}, model="m")
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["profiles"][0]["quality_point"] == 0.99 and doc["info"] == {"model": "m"}
    assert load_profiles(tmp_path / "t.json") == profs
