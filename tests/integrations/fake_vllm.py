"""Stand-ins for the vLLM objects the connector's two sides read, and a tiny engine that drives them in vLLM's
order (lookup, allocation, plan, bind, loads, per-layer wait / "attention" / save, wait for save), with KV that
is a known function of (layer, position, token) so every placed value can be checked."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvtide.integrations.vllm.config import from_extra_config
from kvtide.integrations.vllm.layout import get_layout, slots
from kvtide.integrations.vllm.scheduler_side import SchedulerSide
from kvtide.integrations.vllm.stats import Counters
from kvtide.integrations.vllm.stores import open_connector_store
from kvtide.integrations.vllm.worker_side import WorkerSide
from kvtide.store.keys import KeySpace

L, H, D, BS = 4, 2, 8, 16  # layers, KV heads, head dim, vLLM block size
NUM_BLOCKS = 64


@dataclass
class Request:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class NewReq:
    req_id: str
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[Any] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class Output:
    scheduled_new_reqs: list[NewReq]
    num_scheduled_tokens: dict[str, int]
    scheduled_cached_reqs: Cached = field(default_factory=Cached)


def true_kv(layer: int, tokens: list[int], start: int, end: int) -> torch.Tensor:
    """The KV a model would compute for positions [start, end): [2, T, H, D], a function of layer, position and
    token id (exactly representable in bfloat16)."""
    pos = torch.arange(start, end, dtype=torch.float32)
    tok = torch.tensor(tokens[start:end], dtype=torch.float32)
    base = (layer * 7 + (pos % 13) * 3 + tok % 17)[None, :, None, None]
    grid = torch.arange(2 * H * D, dtype=torch.float32).view(2, 1, H, D) % 11
    return (base + grid).to(torch.bfloat16)


class Engine:
    """One process's connector pair over ``store`` (a spec), with its own paged KV (CPU layout)."""

    def __init__(self, store: str, chunk: int = 32, layout: str = "cpu", **extra: Any) -> None:
        self.cfg = from_extra_config({"store": store, "chunk_tokens": chunk, **extra})
        self.space = KeySpace("fake|4x16x2x8", chunk, "bfloat16", weights="w", model_config="c")
        self.counters = Counters()
        self.sched = SchedulerSide(self.cfg, open_connector_store(self.cfg.restore, L, loads=False), self.space, L,
                                   BS)
        self.worker = WorkerSide(self.cfg, open_connector_store(self.cfg.restore, L, loads=True), self.counters,
                                 num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, kv_dtype=torch.bfloat16)
        self.layout = get_layout(layout)
        self.caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(NUM_BLOCKS, H, BS, 2 * D,
                                                                       dtype=torch.bfloat16) for i in range(L)}
        self.worker.register(self.caches, layout)
        self.names = list(self.caches)
        self.next_block = 0
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.last_plan = None

    def blocks_for(self, rid: str, n_tokens: int) -> list[int]:
        table = self.tables.setdefault(rid, [])
        while len(table) * BS < n_tokens:
            table.append(self.next_block)
            self.next_block += 1
        return table

    def admit(self, req: Request) -> int:
        """vLLM's admission of a new request with no local prefix hit: lookup, allocation; returns external tokens."""
        ext = self.sched.lookup(req, 0)
        self.blocks_for(req.request_id, req.num_tokens)
        self.sched.after_alloc(req, ext)
        self.computed[req.request_id] = ext
        return ext

    def step(self, reqs: list[Request], new: bool = True, fail_step: bool = False) -> set[int]:
        """One forward step computing every remaining prompt token of ``reqs`` (new requests) or one more token
        (running ones); returns the invalid blocks the worker reported."""
        sched: dict[str, int] = {}
        news, cached = [], Cached()
        for r in reqs:
            before = self.computed[r.request_id]
            n = r.num_tokens - before if new else 1
            sched[r.request_id] = n
            had = len(self.tables.get(r.request_id, []))
            table = self.blocks_for(r.request_id, before + n)
            if new:
                news.append(NewReq(r.request_id, before, (list(table),)))
            else:
                cached.req_ids.append(r.request_id)
                cached.new_block_ids.append((table[had:],) if len(table) > had else None)
                cached.num_computed_tokens.append(before)
        plan = self.sched.build(Output(news, sched, cached))
        self.last_plan = plan
        self.worker.begin(plan)
        self.worker.start_loads()
        for i, name in enumerate(self.names):
            self.worker.wait_layer(name)
            for r in reqs:  # the kernel writes this step's new tokens' KV
                before, n = self.computed[r.request_id], sched[r.request_id]
                b, o = slots(before, before + n, self.tables[r.request_id], BS)
                self.layout.scatter(self.caches[name], b, o, true_kv(i, r.all_token_ids, before, before + n))
            self.worker.save_layer(name, self.caches[name])
        self.worker.end()
        invalid = self.worker.take_invalid()
        self.sched.on_report(self.worker.take_report())
        for r in reqs:
            self.computed[r.request_id] += sched[r.request_id]
        return invalid

    def placed(self, rid: str, layer: int, start: int, end: int) -> torch.Tensor:
        b, o = slots(start, end, self.tables[rid], BS)
        return self.layout.gather(self.caches[self.names[layer]], b, o, D)

    def close(self) -> None:
        self.worker.close()
