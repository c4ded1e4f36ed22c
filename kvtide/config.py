"""Engine configuration: dataclasses that fail fast, with KVTIDE_* environment overrides.

One source of truth: every knob has a field here; `EngineConfig.from_env()` applies KVTIDE_<SECTION>_<FIELD>
variables (e.g. KVTIDE_CACHE_PAGE_SIZE=32, KVTIDE_SCHEDULER_MAX_NUM_SEQS=8, KVTIDE_DEVICE=cuda).
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

URL_PASSWORD = re.compile(r"(://[^/@:]*:)[^/@]*@")  # the password of a user:password@ URL


def redact_url(value: str) -> str:
    """``value`` with the password of any ``scheme://user:password@`` in it replaced by ``***``."""
    return URL_PASSWORD.sub(r"\1***@", value)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype '{name}' (choose from {', '.join(_DTYPES)})") from None


@dataclass
class CacheConfig:
    """Paged KV cache. Budget by bytes (`kv_cache_bytes`) or by page count (`num_pages`), not both."""

    page_size: int = 16
    num_pages: int | None = None
    kv_cache_bytes: int | None = None  # default: 256 MiB on CPU, 90% of free memory after weights on CUDA
    kv_dtype: str = "bfloat16"  # DESIGN.md: KV is stored as BF16 even where compute is fp32
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    # ZipFusion resident compression (kvtide/cache/zip_pages.py): completed pages stay losslessly compressed
    # in one chunked pool; the same budget then holds more pages. BF16 KV only.
    compress: bool = False
    block_size: int = 512  # values per compression block; must divide page_size * head_dim
    # 2: v1 plus exact-zero escapes (zip_format.py): more key blocks of real KV compress; the CUDA kernel is as fast
    format_version: int = 2
    # value order inside a page group (kvtide/cache/zip_order.py): "mma" feeds the CUDA decode kernel, "token" the
    # Triton one and every torch path; "auto" = "mma" where the CUDA kernel can serve the model on this device
    value_order: str = "auto"
    chunk_bytes: int | None = None  # pool chunk size; default: sized from the budget (zip_pages.auto_chunk_bytes)
    private_chunks: int = 1  # chunks each slab owner keeps for itself; the rest are shared across owners
    # pool chunks owned by a size class for all layers instead of by a (layer, size class) slab (kvtide/cache/pool.py):
    # one layer's free slots serve every layer, one partly used chunk per class instead of one per layer and class,
    # so the same budget holds more pages at no extra host bookkeeping
    shared_slabs: bool = True
    # decode steps place the pages one step filled over this many steps (1: all in the next step): a batch in
    # lockstep fills a page per sequence in the same step, and placing them all at once made that step host-bound
    compress_spread_steps: int = 4

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"CacheConfig.page_size must be a positive power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"CacheConfig.num_pages must be >= 1, got {self.num_pages}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"CacheConfig.kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.num_pages is not None and self.kv_cache_bytes is not None:
            raise ValueError("set CacheConfig.num_pages or CacheConfig.kv_cache_bytes, not both")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"CacheConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        parse_dtype(self.kv_dtype)
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(f"CacheConfig.block_size must be a positive multiple of 32, got {self.block_size}")
        if self.format_version not in (1, 2):
            raise ValueError(f"CacheConfig.format_version must be 1 or 2, got {self.format_version}")
        if self.value_order not in ("auto", "token", "mma"):
            raise ValueError(f"CacheConfig.value_order must be auto, token or mma, got '{self.value_order}'")
        if self.chunk_bytes is not None and (self.chunk_bytes <= 0 or self.chunk_bytes % 16):
            raise ValueError(f"CacheConfig.chunk_bytes must be a positive multiple of 16, got {self.chunk_bytes}")
        if isinstance(self.compress_spread_steps, bool) or not isinstance(self.compress_spread_steps, int) \
                or self.compress_spread_steps < 1:
            raise ValueError(f"CacheConfig.compress_spread_steps must be an int >= 1, got {self.compress_spread_steps!r}")
        if self.private_chunks < 0:
            raise ValueError(f"CacheConfig.private_chunks must be >= 0, got {self.private_chunks}")
        if self.compress and parse_dtype(self.kv_dtype) != torch.bfloat16:
            raise ValueError(f"CacheConfig.compress needs kv_dtype bfloat16 (the format is lossless BF16), "
                             f"got kv_dtype '{self.kv_dtype}'")

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return parse_dtype(self.kv_dtype)


@dataclass
class SchedulerConfig:
    """Continuous batching limits: running sequences per step and tokens per step (prefill chunks + decodes)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's context window
    # compressed pool: a decoding sequence may take its next page up to this many steps before it needs it, at most
    # ceil(running / page_lookahead) sequences a step and only from free room (never evicting a cached page): a
    # batch in lockstep then spreads the page allocations it would otherwise all make in one step. 0: off
    page_lookahead: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.page_lookahead, bool) or not isinstance(self.page_lookahead, int) or self.page_lookahead < 0:
            raise ValueError(f"SchedulerConfig.page_lookahead must be an int >= 0, got {self.page_lookahead!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"SchedulerConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"SchedulerConfig.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"SchedulerConfig.max_model_len must be >= 2, got {self.max_model_len}")


@dataclass
class RestoreConfig:
    """CacheFlow restoration (kvtide/engine/restoration.py): finished requests' full prefix chunks go to a KV
    store; a new request whose prefix is in the store but not on the device is restored by plan."""

    # memory | pinned (page-locked memory, DMA loads) | disk:PATH | redis[s]://[user:password@]host[:port][/db]
    # [?ttl=SECONDS&prefix=PREFIX] (kvtide/store/redis_store.py)
    store: str = "memory"
    memory_bytes: int = 1 << 30  # bound of the in-process tier (memory, pinned)
    chunk_tokens: int = 256  # store/plan granularity; a multiple of the page size
    method: str = "cacheflow"  # cacheflow | recompute | load | cake | layerwise (all on the same executor)
    bandwidth_gbps: float | None = None  # emulated link on the load path (None: the tier's own speed)
    max_batch: int = 8  # waiting requests restored (and planned) together
    write_on_finish: bool = True  # store each finished request's full chunks (prompt + output)
    steal: bool = True  # an idle link takes recompute chunks of unstarted layers (hybrid plans; see executor)
    spill: bool = True  # evicted device-cache pages of chunks the store lacks are written first (prefix caching)
    hedge: float = 0.0  # >0: CacheFlow plans this much compute-heavy when stealing is on (see Restorer.plan_for)
    merge_load_layers: int = 1  # most consecutive layers whose loads share a fetch (1: one per layer; executor)
    load_workers: int | None = None  # threads verifying and staging loads (None: the executor's LoadConfig default)
    load_read_ahead: int | None = None  # fetches booked beyond the one being placed (None: LoadConfig's default)
    # None: entries hold the KV as is; "zip": in the ZipFusion format (lossless, fewer bytes over the link),
    # encoded and decoded on the GPU (kvtide/store/zip_entry.py); needs bfloat16 KV
    store_codec: str | None = None
    # host bytes of finished chunks waiting for the store writer; past it new chunks are not queued (counted in
    # RestoreStats.writes_dropped): a tier that cannot keep up costs later recomputes, not host memory
    write_queue_bytes: int = 8 << 30
    # slow and dead tiers (kvtide/store/breaker.py, kvtide/store/redis_store.py): a Redis operation times out after
    # store_timeout_s; breaker_failures consecutive tier failures (0: no breaker) skip a remote tier (disk, Redis)
    # for breaker_backoff_s, then one operation probes it. Store lookups in a step stop after lookup_budget_s of
    # store time (None: no bound): the requests not looked up are prefilled as usual, the store_profiles not looked
    # up are not used for that restoration. Closing the engine waits at most flush_timeout_s (None: no bound) for
    # queued writes; the rest is dropped and counted.
    store_timeout_s: float = 0.5
    breaker_failures: int = 3
    breaker_backoff_s: float = 5.0
    lookup_budget_s: float | None = 0.05
    flush_timeout_s: float | None = 10.0
    # trust and isolation (kvtide/store/auth.py, kvtide/store/keys.py): secret (None: $KVTIDE_STORE_SECRET if set)
    # signs every record written and rejects every record without its MAC (counted as forged, deleted); namespace
    # (e.g. a tenant) keys entries apart from every other namespace's; store_token_ids=False keeps token ids out of
    # records (a hash of them is checked instead)
    secret: str | None = field(default=None, repr=False)
    namespace: str | None = None
    store_token_ids: bool = True
    # a restoration beside running requests takes at most this fraction of the median recent engine step per step
    # (its compute in quanta: layer calls, sliced when one would overrun), its loads in the background, while the
    # others keep decoding; alone it runs to the end at once. None (the default until its restorers' TTFT is
    # measured on a GPU): every restoration runs to the end in the step it starts (the decode batch waits for it)
    step_fraction: float | None = None
    # KVServe profiles finished chunks are also stored under, beside the lossless entry: (pipeline spec, relative
    # quality from the profile table) pairs. A request whose SamplingParams.kv_min_quality is below 1 may be restored
    # from a profile of at least that quality, the one whose plan predicts the least time (Restorer.plan_for); a
    # lossless request (the default) never gets a profile's entry (kvtide/store/profile_entry.py)
    store_profiles: tuple[tuple[str, float], ...] = ()

    def __repr__(self) -> str:  # logs and errors print configs: a store URL's password stays out of them
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}
        shown["store"] = redact_url(self.store)
        return "RestoreConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def __post_init__(self) -> None:
        from .store.factory import check_spec

        check_spec(self.store)
        if self.memory_bytes <= 0:
            raise ValueError(f"RestoreConfig.memory_bytes must be positive, got {self.memory_bytes}")
        if self.chunk_tokens <= 0:
            raise ValueError(f"RestoreConfig.chunk_tokens must be positive, got {self.chunk_tokens}")
        if self.method not in ("cacheflow", "recompute", "load", "cake", "layerwise"):
            raise ValueError(f"RestoreConfig.method must be cacheflow, recompute, load, cake or layerwise, got '{self.method}'")
        if self.bandwidth_gbps is not None and not self.bandwidth_gbps > 0:
            raise ValueError(f"RestoreConfig.bandwidth_gbps must be positive or None, got {self.bandwidth_gbps}")
        if self.max_batch < 1:
            raise ValueError(f"RestoreConfig.max_batch must be >= 1, got {self.max_batch}")
        if not 0.0 <= self.hedge < 1.0:
            raise ValueError(f"RestoreConfig.hedge must be in [0, 1), got {self.hedge}")
        if self.write_queue_bytes <= 0:
            raise ValueError(f"RestoreConfig.write_queue_bytes must be positive, got {self.write_queue_bytes}")
        if not isinstance(self.merge_load_layers, int) or isinstance(self.merge_load_layers, bool) \
                or self.merge_load_layers < 1:
            raise ValueError(f"RestoreConfig.merge_load_layers must be an int >= 1, got {self.merge_load_layers!r}")
        if self.load_workers is not None and (not isinstance(self.load_workers, int)
                                              or isinstance(self.load_workers, bool) or self.load_workers < 0):
            raise ValueError(f"RestoreConfig.load_workers must be None or an int >= 0, got {self.load_workers!r}")
        if self.load_read_ahead is not None and (not isinstance(self.load_read_ahead, int)
                                                 or isinstance(self.load_read_ahead, bool) or self.load_read_ahead < 0):
            raise ValueError(f"RestoreConfig.load_read_ahead must be None or an int >= 0, got {self.load_read_ahead!r}")
        if self.store_codec not in (None, "zip"):
            raise ValueError(f"RestoreConfig.store_codec must be None or 'zip', got {self.store_codec!r}")
        for name, allow_none in (("store_timeout_s", False), ("breaker_backoff_s", False),
                                 ("lookup_budget_s", True), ("flush_timeout_s", True)):
            v = getattr(self, name)
            if not (v is None and allow_none) and (isinstance(v, bool) or not isinstance(v, (int, float))
                                                  or not 0 < v < float("inf")):
                raise ValueError(f"RestoreConfig.{name} must be a number of seconds > 0{' or None' * allow_none}, "
                                 f"got {v!r}")
        if not isinstance(self.breaker_failures, int) or isinstance(self.breaker_failures, bool) \
                or self.breaker_failures < 0:
            raise ValueError(f"RestoreConfig.breaker_failures must be an int >= 0 (0: no breaker), "
                             f"got {self.breaker_failures!r}")
        if self.secret is not None and (not isinstance(self.secret, str) or not self.secret):
            raise ValueError("RestoreConfig.secret must be None or a non-empty string")  # never echo it
        if self.namespace is not None and (not isinstance(self.namespace, str) or not self.namespace):
            raise ValueError(f"RestoreConfig.namespace must be None or a non-empty string, got {self.namespace!r}")
        if self.step_fraction is not None and (isinstance(self.step_fraction, bool)
                                               or not isinstance(self.step_fraction, (int, float))
                                               or not 0 < self.step_fraction <= 100):
            raise ValueError(f"RestoreConfig.step_fraction must be None or a number in (0, 100], "
                             f"got {self.step_fraction!r}")
        self._check_profiles()
        if not isinstance(self.store_token_ids, bool):
            raise ValueError(f"RestoreConfig.store_token_ids must be a bool, got {self.store_token_ids!r}")


    def _check_profiles(self) -> None:
        """``store_profiles`` as a tuple of (spec, quality) pairs; fails naming the entry otherwise. Each spec is
        checked as a pipeline (and made canonical) when the restorer is built (``kvtide.engine.restore_profiles``)."""
        v = self.store_profiles
        if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
            raise ValueError(f"RestoreConfig.store_profiles must be a list of (spec, quality) pairs, got {v!r}")
        out = []
        for item in v:
            if isinstance(item, (str, bytes)) or not isinstance(item, (list, tuple)) or len(item) != 2:
                raise ValueError(f"RestoreConfig.store_profiles entry {item!r} is not a (spec, quality) pair")
            spec, q = item
            if not isinstance(spec, str) or not spec or len(spec) > 512:
                raise ValueError(f"RestoreConfig.store_profiles entry {item!r}: the spec must be a non-empty string "
                                 "of at most 512 characters")
            if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= q < float("inf"):
                raise ValueError(f"RestoreConfig.store_profiles entry {spec!r}: quality must be a finite number >= 0, "
                                 f"got {q!r}")
            out.append((spec, float(q)))
        self.store_profiles = tuple(out)


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # compute dtype; auto: float32 on CPU, bfloat16 on CUDA
    # auto: on CUDA zip (compress=True, fused Triton kernel) or flashinfer when importable, else torch;
    # zip needs CacheConfig(compress=True) and CUDA (or TRITON_INTERPRET=1 on CPU, for tests)
    attention_backend: str = "auto"
    # decode steps replay the model between attention calls as CUDA graphs (kvtide/engine/cuda_graphs.py): the
    # host work of a step drops to L + 1 graph launches and L attention calls. CUDA only.
    cuda_graphs: bool = False
    # with cuda_graphs, capture each decode step whole, attention included (zip over the CUDA kernel; FlashInfer
    # through its CUDA-graph wrapper): one graph launch per step instead of L + 1 graph launches, 2L eager kernels
    # and the Python between them. The attention plan goes into fixed buffers; a step replays the graph of its batch
    # size and launch shape. None: whole steps for zip, where that is faster; piecewise for FlashInfer, whose
    # CUDA-graph plan always splits the KV (a merge per layer) and so costs more device time whole. True / False:
    # every backend that can.
    full_cuda_graphs: bool | None = None
    # schedule and launch step N+1 before step N's tokens reach the host (they reach step N+1 on the device), so the
    # host's per-step work (scheduling, page tables, attention plans, compression bookkeeping, outputs) runs while
    # the device computes. None: on for CUDA engines without restoration; the CPU gains nothing from it.
    async_scheduling: bool | None = None
    # float32 on the CPU: linear layers through oneDNN with weights packed once at load (kvtide.models.cpu_linear),
    # faster than torch's default GEMM for the engine's shapes, at more memory per engine (docs/config.md): on in
    # `kvtide serve`, off for in-process engines
    cpu_onednn: bool = False
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    restore: RestoreConfig | None = None  # None: no KV store, no restoration

    def __post_init__(self) -> None:
        if self.restore is not None and self.restore.chunk_tokens % self.cache.page_size:
            raise ValueError(f"RestoreConfig.chunk_tokens ({self.restore.chunk_tokens}) must be a multiple of "
                             f"CacheConfig.page_size ({self.cache.page_size})")
        if self.restore is not None and self.restore.store_codec is not None \
                and self.cache.torch_kv_dtype != torch.bfloat16:
            raise ValueError(f"RestoreConfig.store_codec={self.restore.store_codec!r} stores bfloat16 KV losslessly; "
                             f"CacheConfig.kv_dtype is {self.cache.torch_kv_dtype}")
        if not self.model:
            raise ValueError("EngineConfig.model must name a bundled model or a path")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"EngineConfig.device must be auto, cpu or cuda[:N], got '{self.device}'")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.attention_backend not in ("auto", "torch", "flashinfer", "zip"):
            raise ValueError(f"EngineConfig.attention_backend must be auto, torch, flashinfer or zip, "
                             f"got '{self.attention_backend}'")
        if self.async_scheduling and self.restore is not None:
            raise ValueError("EngineConfig.async_scheduling cannot be combined with restore (restoration runs its "
                             "prefills between steps and times each step): leave async_scheduling unset or False")
        if self.attention_backend == "zip" and not self.cache.compress:
            raise ValueError("EngineConfig.attention_backend 'zip' attends over the compressed pool: set "
                             "CacheConfig(compress=True), or choose auto, torch or flashinfer")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("EngineConfig.device asks for CUDA but torch sees no CUDA device")
        return dev

    @property
    def async_scheduling_on(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.restore is None and self.torch_device.type == "cuda"

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.torch_device.type == "cpu" else torch.bfloat16
        return parse_dtype(self.dtype)

    @classmethod
    def from_env(cls, **overrides: Any) -> "EngineConfig":
        """Defaults, then KVTIDE_* variables, then explicit keyword overrides (never overridden by the environment;
        a section given as an instance, e.g. ``cache=CacheConfig(...)``, is taken whole). See `config_load`."""
        from .config_load import load_config

        return load_config(overrides)
