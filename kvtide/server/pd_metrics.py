"""Prometheus metrics of KV hand-offs between a prefill and a decode instance (on the server's registry)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from .metrics import PREFIX

TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        m = model_name
        self.bytes = Counter(PREFIX + "kv_transfer_bytes", "KV bytes moved by hand-offs (wire bytes), by direction.",
                             ["model_name", "direction"], registry=registry)
        self.raw_bytes = Counter(PREFIX + "kv_transfer_raw_bytes", "KV bytes of hand-offs before compression, by "
                                 "direction.", ["model_name", "direction"], registry=registry)
        self.seconds = Histogram(PREFIX + "kv_transfer_seconds", "One hand-off, first byte encoded to last "
                                 "layer decoded (decode side) or written (prefill side), by direction.",
                                 ["model_name", "direction"], buckets=TRANSFER_BUCKETS, registry=registry)
        self.profile = Counter(PREFIX + "kv_transfer_profile", "Hand-offs by the compression profile chosen.",
                               ["model_name", "profile"], registry=registry)
        self.fallbacks = Counter(PREFIX + "kv_transfer_fallbacks", "Hand-offs not used, the prompt recomputed "
                                 "instead, by reason.", ["model_name", "reason"], registry=registry)
        self.tokens = Counter(PREFIX + "kv_transfer_tokens", "Prompt tokens whose KV arrived by hand-off.",
                              ["model_name"], registry=registry).labels(m)
        self.model = m

    def moved(self, direction: str, wire: int, raw: int, seconds: float, profile: str | None = None) -> None:
        self.bytes.labels(self.model, direction).inc(wire)
        self.raw_bytes.labels(self.model, direction).inc(raw)
        self.seconds.labels(self.model, direction).observe(seconds)
        if profile is not None:
            self.profile.labels(self.model, profile).inc()

    def fallback(self, reason: str) -> None:
        self.fallbacks.labels(self.model, reason).inc()
