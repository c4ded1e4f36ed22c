"""``KvtideConnector``: vLLM's ``KVConnectorBase_V1`` over kvtide's stores, records and split planner.

The glue only: vLLM's calls are passed to ``SchedulerSide`` (lookups, the split, each step's plan) or
``WorkerSide`` (loads, saves, load errors), which know nothing of vLLM's classes. Loads are synchronous in vLLM's
sense (``get_num_new_matched_tokens`` answers ``False``: the request is scheduled at once) and asynchronous inside
the step: they run layer by layer on a loader thread while the forward pass computes, and each attention layer
waits only for its own layer. Saves are copied out during the forward pass and written in the background, so
``request_finished`` never holds blocks. Handled: one worker (tensor and pipeline parallel size 1), one KV cache
group, unquantised KV, the CPU and CUDA backends' layouts.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtide.log import get_logger
from kvtide.integrations.vllm.config import describe, from_extra_config
from kvtide.integrations.vllm.identity import config_id, vllm_keyspace, weights_id
from kvtide.integrations.vllm.layout import layout_for_backend
from kvtide.integrations.vllm.metrics import KvtideConnectorStats, KvtidePromMetrics
from kvtide.integrations.vllm.plan import StepPlan, WorkerReport
from kvtide.integrations.vllm.scheduler_side import SchedulerSide
from kvtide.integrations.vllm.stats import PROCESS, Counters
from kvtide.integrations.vllm.stores import open_connector_store
from kvtide.integrations.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = get_logger("integrations.vllm")
_WORKERS: "weakref.WeakSet[WorkerSide]" = weakref.WeakSet()


@dataclass
class KvtideMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KvtideWorkerMeta(KVConnectorWorkerMetadata):
    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvtideWorkerMeta":
        return KvtideWorkerMeta(self.report.merge(getattr(other, "report", WorkerReport())))


def flush_saves(timeout: float | None = None) -> bool:
    """Wait until every connector worker of this process has written its queued saves (tests, benches)."""
    return all([w.flush(timeout) for w in list(_WORKERS)])


def _check_cpu_kernel(worker: WorkerSide, isa: str) -> None:
    """vLLM's own CPU cache writer puts known K/V into a scratch cache; the layout must read them back exactly
    (an ISA that packs K another way would otherwise load misplaced values without a sign)."""
    from vllm import _custom_ops as ops

    layout, bs, h, d = worker.layout, worker.block_size, worker.num_kv_heads, worker.head_dim
    assert layout is not None
    cache = torch.zeros(2, h, bs, 2 * d, dtype=worker.kv_dtype)
    kc, vc = cache.view(2, h, 2 * bs, d).chunk(2, dim=2)
    g = torch.Generator().manual_seed(0)
    n = bs + bs // 2  # a whole block and half of the next
    key = torch.randn(n, h, d, generator=g).to(worker.kv_dtype)
    value = torch.randn(n, h, d, generator=g).to(worker.kv_dtype)
    slot = torch.arange(n, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slot, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    back = layout.gather(cache, slot // bs, slot % bs, d)
    if not (torch.equal(back[0], key) and torch.equal(back[1], value)):
        raise NotImplementedError(f"kvtide connector: vLLM's CPU kernels with ISA {isa!r} keep K/V in a layout the "
                                  f"connector does not read (checked at start-up); known: vec, vec16")
    scratch = torch.zeros_like(cache)  # and what the connector writes, the kernel's view reads
    layout.scatter(scratch, slot // bs, slot % bs, torch.stack((key, value)))
    if not torch.equal(scratch, cache):
        raise NotImplementedError(f"kvtide connector: writing KV for vLLM's CPU kernels with ISA {isa!r} does not "
                                  f"reproduce their layout")


_HIT_SOURCES = {"memory": CacheHitSource.HOST, "pinned": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


class KvtideConnector(KVConnectorBase_V1):
    """kvtide's KV connector: ``KVTransferConfig(kv_connector="KvtideConnector",
    kv_connector_module_path="kvtide.integrations.vllm", kv_role="kv_both",
    kv_load_failure_policy="recompute", kv_connector_extra_config={"store": "disk:/path", ...})``."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tcfg = self._kv_transfer_config
        self.cfg = from_extra_config(tcfg.kv_connector_extra_config)
        if not tcfg.is_kv_producer:  # kv_consumer: loads only
            self.cfg = dataclasses.replace(self.cfg, save=False)
        self.loads = bool(tcfg.is_kv_consumer)  # kv_producer: saves only
        r = self.cfg.restore
        mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            raise NotImplementedError("kvtide's connector handles one worker (tensor and pipeline parallel size 1)")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise NotImplementedError("kvtide's connector handles models with one KV cache group")
        if cc.cache_dtype not in ("auto", None) and not str(cc.cache_dtype).startswith(("bfloat16", "float16")):
            raise NotImplementedError(f"kvtide's connector stores unquantised KV; cache_dtype is {cc.cache_dtype}")
        if getattr(tcfg, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kvtide connector: kv_load_failure_policy is %r; a failed load then fails its request "
                        "(set kv_load_failure_policy='recompute' to recompute it)", tcfg.kv_load_failure_policy)
        self.num_layers = mc.get_num_layers(pc)
        self.num_kv_heads = mc.get_num_kv_heads(pc)
        self.head_dim = mc.get_head_size()
        self.block_size = cc.block_size
        self.kv_dtype: torch.dtype = mc.dtype
        if r.store_codec == "zip" and self.kv_dtype != torch.bfloat16:
            raise ValueError(f"kv_connector_extra_config.store_codec='zip' stores bfloat16 KV losslessly; this "
                             f"model's KV is {self.kv_dtype}")
        hf = mc.hf_text_config if getattr(mc, "hf_text_config", None) is not None else mc.hf_config
        dtype = str(self.kv_dtype).replace("torch.", "")
        self.keyspace = vllm_keyspace(
            model_type=str(getattr(hf, "model_type", "model")), num_layers=self.num_layers,
            hidden_size=mc.get_hidden_size(), num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            weights=weights_id(mc.model, getattr(mc, "revision", None)), model_config=config_id(hf.to_dict()),
            dtype=dtype, kv_dtype=dtype, chunk_tokens=r.chunk_tokens, namespace=r.namespace, secret=r.secret)
        tier = r.store.split(":", 1)[0]
        self._cache_hit_source = _HIT_SOURCES.get(tier, CacheHitSource.P2P)
        self.counters = Counters(parent=PROCESS)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        store = open_connector_store(r, self.num_layers, loads=role == KVConnectorRole.WORKER)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.cfg, store, self.keyspace, self.num_layers, self.block_size)
        else:
            self.worker = WorkerSide(self.cfg, store, self.counters, num_layers=self.num_layers,
                                     num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                     block_size=self.block_size, kv_dtype=self.kv_dtype)
            _WORKERS.add(self.worker)
        log.info("kvtide connector (%s): %s", role.name.lower(), describe(self.cfg))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that never happened is a later miss, nothing more

    # ---- worker side --------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        layout = self.cfg.kv_layout
        if layout == "auto":
            layout = layout_for_backend(self._backend_name(next(iter(kv_caches))))
        self.worker.register(kv_caches, layout)
        if layout == "cpu":
            _check_cpu_kernel(self.worker, self._isa(next(iter(kv_caches))))
        log.info("kvtide connector: %d layers of KV %s, %s layout", len(kv_caches),
                 tuple(next(iter(kv_caches.values())).shape), layout)

    def _isa(self, layer_name: str) -> str:
        """The instruction set vLLM's CPU kernels use for this model (the layer's, as its metadata builder set)."""
        layer = self._vllm_config.compilation_config.static_forward_context.get(layer_name)
        isa = getattr(layer, "isa", None)
        if isa is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(self.kv_dtype, self.block_size, self.head_dim,
                                self._vllm_config.cache_config.cache_dtype)
        return str(isa)

    def _backend_name(self, layer_name: str) -> str:
        ctx = self._vllm_config.compilation_config.static_forward_context
        layer = ctx.get(layer_name)
        backend = getattr(layer, "attn_backend", None)
        if backend is None:
            raise ValueError(f"kvtide connector: cannot tell the attention backend of layer {layer_name}; set "
                             f"kv_layout in kv_connector_extra_config")
        return backend.get_name()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KvtideMetadata):
            self.worker.begin(connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.end()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_invalid() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> KvtideConnectorStats | None:
        data = self.counters.take()
        return KvtideConnectorStats(data=data) if any(data.values()) else None

    def build_connector_worker_meta(self) -> KvtideWorkerMeta | None:
        report = self.worker.take_report() if self.worker is not None else None
        return KvtideWorkerMeta(report) if report is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()

    # ---- scheduler side -----------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.block_ids = lambda rid: kv_cache_manager.get_block_ids(rid)[0]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        if not self.loads:
            return 0, False
        return self.scheduler.lookup(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvtideMetadata:
        assert self.scheduler is not None
        return KvtideMetadata(self.scheduler.build(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler is not None:
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            self.scheduler.on_report(getattr(meta, "report", None))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.finished(request)
        return False, None

    # ---- both ---------------------------------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtideConnectorStats:
        return KvtideConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtidePromMetrics:
        return KvtidePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
