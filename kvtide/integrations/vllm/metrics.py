"""The connector's stats in vLLM's terms: a ``KVConnectorStats`` per interval and Prometheus counters.

vLLM asks the worker for ``get_kv_connector_stats`` after every step, sums them over its workers and its logging
interval (``aggregate``), logs ``reduce()`` as "KV Transfer metrics: ..." and feeds the same dict to
``build_prom_metrics``'s ``observe``, one counter per entry of ``stats.COUNTERS``
(``vllm:kvtide_<name>_total`` on vLLM's ``/metrics``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvtide.integrations.vllm.stats import COUNTERS, aggregate, summary


@dataclass
class KvtideConnectorStats(KVConnectorStats):
    """``data``: counter name -> value of the interval (``stats.COUNTERS``)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvtideConnectorStats":
        return KvtideConnectorStats(data=aggregate([self.data, other.data or {}]))

    def reduce(self) -> dict[str, int | float]:
        return summary(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvtidePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per connector counter, labelled per engine like vLLM's own metrics."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:kvtide_{name}", documentation=f"kvtide connector: {doc}",
                                       labelnames=labelnames)
            self.counters[name] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
