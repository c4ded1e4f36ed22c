"""The profiler's ``evaluate(spec)`` on a real model: measured ratio and throughput, measured quality.

Ratio and (de)compression throughput come from ``profiler.measure`` on one request's real prefix KV; quality
is the relative accuracy of quality.py. Quality depends only on transform and quantizer (codecs are exact),
so it is computed once per ``transform|quantizer`` and shared by every codec — the expensive part of a
profiling run is paid once per lossy configuration, not once per pipeline.

The quality handed to the profiler is, by default, the *lower bound* of the relative accuracy's bootstrap
interval (``EvaluateConfig.constraint``): "meets 97%" then means the interval lies above 0.97, not only the
point estimate. ``PooledEvaluator`` scores a mixed data set (several workloads' windows together), which is
how the unified profile is searched.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from .profiler import measure
from .quality import QualityEvaluator, QualityResult, pool, quality_spec


@dataclass(frozen=True)
class EvalRecord:
    spec: str
    ratio: float
    encode_throughput: float  # bytes/s of raw BF16 KV
    decode_throughput: float
    quality: float  # relative accuracy (point estimate)
    quality_low: float  # its bootstrap interval
    quality_high: float
    agreement: float
    kl: float
    seconds: float  # wall time of this evaluation (measure + quality when not cached)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EvaluateConfig:
    repeats: int = 1  # measure(): best of this many encode/decode timings
    request: int = 0  # which sample's prefix KV stands for "one request" in measure()
    constraint: str = "lower"  # quality the profiler sees: "lower" bound of the interval, or the "point"

    def __post_init__(self) -> None:
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"EvaluateConfig.repeats must be an int >= 1, got {self.repeats!r}")
        if not isinstance(self.request, int) or self.request < 0:
            raise ValueError(f"EvaluateConfig.request must be an int >= 0, got {self.request!r}")
        if self.constraint not in ("lower", "point"):
            raise ValueError(f"EvaluateConfig.constraint must be 'lower' or 'point', got {self.constraint!r}")


def searched_quality(rec: "EvalRecord", constraint: str) -> float:
    return rec.quality_low if constraint == "lower" else rec.quality


class PipelineEvaluator:
    """Callable ``spec -> (ratio, encode_throughput, decode_throughput, quality)`` for ``Profiler``;
    ``records`` keeps every evaluation with agreement and KL as well."""

    def __init__(self, quality: QualityEvaluator, head_scores: torch.Tensor | None = None,
                 config: EvaluateConfig | None = None) -> None:
        self.quality, self.head_scores = quality, head_scores
        self.cfg = config or EvaluateConfig()
        if self.cfg.request >= quality.cfg.samples:
            raise ValueError(f"request {self.cfg.request} >= samples {quality.cfg.samples}")
        self.records: dict[str, EvalRecord] = {}
        self._q: dict[str, QualityResult] = {}
        self.quality_runs = 0

    def quality_of(self, spec: str) -> QualityResult:
        key = quality_spec(spec)
        if key not in self._q:
            self._q[key] = self.quality.evaluate(key, self.head_scores)
            self.quality_runs += 1
        return self._q[key]

    def record(self, spec: str) -> EvalRecord:
        if spec not in self.records:
            t0 = time.perf_counter()
            r, e, d = measure(spec, self.quality.request_kv(self.cfg.request), self.head_scores, self.cfg.repeats)
            q = self.quality_of(spec)
            self.records[spec] = EvalRecord(spec, r, e, d, q.relative_accuracy, q.ci_low, q.ci_high, q.agreement,
                                            q.kl, time.perf_counter() - t0)
        return self.records[spec]

    def __call__(self, spec: str) -> tuple[float, float, float, float]:
        rec = self.record(spec)
        q = searched_quality(rec, self.cfg.constraint)
        if not all(math.isfinite(x) for x in (rec.ratio, rec.quality)) or math.isnan(q):
            raise ValueError(f"{spec}: non-finite evaluation {rec}")
        return rec.ratio, rec.encode_throughput, rec.decode_throughput, q


def _harmonic(xs: list[float]) -> float:
    inv = sum(1 / x for x in xs)  # 1/inf = 0: an instant stage
    return len(xs) / inv if inv > 0 else math.inf


class PooledEvaluator:
    """``Profiler`` callback over a mixed data set: the windows of several workloads' ``PipelineEvaluator``
    scored together (``quality.pool``, strata per workload and prefix length), each workload's evaluations
    cached in its own evaluator. Ratio and throughputs are those of the mixed traffic, equal raw bytes from each
    workload: harmonic means of the workloads' figures."""

    def __init__(self, parts: dict[str, PipelineEvaluator], config: EvaluateConfig | None = None) -> None:
        if not parts:
            raise ValueError("PooledEvaluator needs at least one workload")
        self.parts, self.cfg = parts, config or EvaluateConfig()
        first = next(iter(parts.values()))
        self.bootstrap = first.quality.cfg.bootstrap
        self.records: dict[str, EvalRecord] = {}

    def pooled_quality(self, spec: str) -> QualityResult:
        return pool({name: pe.quality_of(spec) for name, pe in self.parts.items()}, self.bootstrap)

    def record(self, spec: str) -> EvalRecord:
        if spec not in self.records:
            t0 = time.perf_counter()
            recs = [pe.record(spec) for pe in self.parts.values()]
            q = self.pooled_quality(spec)
            self.records[spec] = EvalRecord(
                spec, _harmonic([r.ratio for r in recs]), _harmonic([r.encode_throughput for r in recs]),
                _harmonic([r.decode_throughput for r in recs]), q.relative_accuracy, q.ci_low, q.ci_high,
                q.agreement, q.kl, time.perf_counter() - t0)
        return self.records[spec]

    def __call__(self, spec: str) -> tuple[float, float, float, float]:
        rec = self.record(spec)
        return rec.ratio, rec.encode_throughput, rec.decode_throughput, searched_quality(rec, self.cfg.constraint)
