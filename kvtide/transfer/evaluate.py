"""The profiler's ``evaluate(spec)`` on a real model: measured ratio and throughput, measured quality.

Ratio and (de)compression throughput come from ``profiler.measure`` on one request's real prefix KV; quality
is the relative accuracy of quality.py. Quality depends only on transform and quantizer (codecs are exact),
so it is computed once per ``transform|quantizer`` and shared by every codec — the expensive part of a
profiling run is paid once per lossy configuration, not once per pipeline.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from .profiler import measure
from .quality import QualityEvaluator, QualityResult, quality_spec


@dataclass(frozen=True)
class EvalRecord:
    spec: str
    ratio: float
    encode_throughput: float  # bytes/s of raw BF16 KV
    decode_throughput: float
    quality: float  # relative accuracy
    agreement: float
    kl: float
    seconds: float  # wall time of this evaluation (measure + quality when not cached)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EvaluateConfig:
    repeats: int = 1  # measure(): best of this many encode/decode timings
    request: int = 0  # which sample's prefix KV stands for "one request" in measure()

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.request < 0:
            raise ValueError(f"need repeats >= 1 and request >= 0, got {self}")


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
            self.records[spec] = EvalRecord(spec, r, e, d, q.relative_accuracy, q.agreement, q.kl,
                                            time.perf_counter() - t0)
        return self.records[spec]

    def __call__(self, spec: str) -> tuple[float, float, float, float]:
        rec = self.record(spec)
        if not all(math.isfinite(x) for x in (rec.ratio, rec.quality)):
            raise ValueError(f"{spec}: non-finite evaluation {rec}")
        return rec.ratio, rec.encode_throughput, rec.decode_throughput, rec.quality
