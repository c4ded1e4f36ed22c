"""The connector in vLLM's scheduler: store lookups, the planned split, and each step's loads and saves.

Lookups walk a request's prefix chunks from the first one vLLM's own prefix cache does not cover and stop at the
first chunk whose last layer entry is absent (writers store layers in order, so the last one means the chunk is
whole); a tier that does not answer counts as a miss. The match never covers the prompt's last token (vLLM must
compute at least one). With ``planned_split`` and once the worker has measured both a load and a prefill step,
``split.plan_split`` picks how much of the match to load; the rest is left to vLLM to compute.

Saves: every step, each scheduled request's chunks completed by this step's tokens are saved unless the store is
known to hold them (found at lookup, or saved before by this process); a chunk whose load or write failed is
forgotten, so it is saved again once vLLM has recomputed it. Nothing here touches KV: the worker does, from the
``StepPlan`` this side builds. Duck-typed on vLLM's request and scheduler-output objects (tests use stand-ins).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvtide.log import get_logger, warn_limited
from kvtide.store.breaker import present
from kvtide.store.errors import StoreUnavailable
from kvtide.store.keys import ChunkKey, KeySpace, chunk_keys
from kvtide.integrations.vllm.config import ConnectorConfig
from kvtide.integrations.vllm.plan import ChunkRef, LoadSpec, SaveSpec, StepPlan, WorkerReport
from kvtide.integrations.vllm.split import LoadRate, PrefillModel, SplitPlan, plan_split

log = get_logger("integrations.vllm")


@dataclass
class _Match:
    """A lookup's outcome: tokens [start, match_end) are in the store; load [start, load_end)."""

    start: int
    num_tokens: int
    match_end: int
    load_end: int
    plan: SplitPlan | None = None


class SchedulerSide:
    """Scheduler half of ``KvtideConnector``. ``block_ids(req_id)``: the request's current block table (vLLM's
    KV cache manager), None to take it from the scheduler output."""

    def __init__(self, cfg: ConnectorConfig, store: Any, keyspace: KeySpace, num_layers: int, block_size: int,
                 block_ids: Callable[[str], Sequence[int]] | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.keyspace = keyspace
        self.chunk = cfg.restore.chunk_tokens
        self.num_layers = num_layers
        self.block_size = block_size
        self.block_ids = block_ids
        self.prefill = PrefillModel()
        self.load_rate = LoadRate()
        self._requests: dict[str, Any] = {}  # req_id -> vLLM's Request (live token ids)
        self._keys: dict[str, list[ChunkKey]] = {}  # req_id -> keys of its full chunks computed so far
        self._lookup: dict[str, tuple[int, int, _Match | None]] = {}  # req_id -> (start, tokens, outcome)
        self._loads: dict[str, _Match] = {}  # allocated, waiting for their step
        self._tables: dict[str, list[int]] = {}  # req_id -> block table, followed from the scheduler outputs
        self._known: OrderedDict[str, None] = OrderedDict()  # chunk keys the store holds (as far as we know)
        self._counts: dict[str, float] = {}

    # ---- lookups ------------------------------------------------------------------------------------------
    def keys_for(self, req_id: str, tokens: Sequence[int], upto: int) -> list[ChunkKey]:
        """Keys of the full chunks of ``tokens[:upto]`` (a request's tokens only grow, so earlier keys stay)."""
        keys = self._keys.get(req_id, [])
        want = upto // self.chunk
        if len(keys) < want:
            keys = chunk_keys(list(tokens[:want * self.chunk]), self.keyspace)  # chained from the root
            self._keys[req_id] = keys
        return keys[:want]

    def _count(self, **kw: float) -> None:
        for k, v in kw.items():
            self._counts[k] = self._counts.get(k, 0) + v

    def _present(self, key: ChunkKey) -> bool:
        return present(self.store, key, self.num_layers - 1)

    def lookup(self, request: Any, num_computed: int) -> int:
        """Tokens after ``num_computed`` to load for ``request`` (0: none). Repeated calls for a request that is
        still waiting give the same answer without asking the store again."""
        rid = request.request_id
        self._requests[rid] = request
        if getattr(request, "skip_reading_prefix_cache", False):  # the request asked to be computed
            self._lookup[rid] = (num_computed, request.num_tokens, None)
            return 0
        n = request.num_tokens
        cached = self._lookup.get(rid)
        if cached is not None and cached[:2] == (num_computed, n):
            m = cached[2]
            return 0 if m is None else m.load_end - m.start
        keys = self.keys_for(rid, request.all_token_ids, n)
        hits = first = num_computed // self.chunk
        try:
            while hits < len(keys) and self._present(keys[hits]):
                hits += 1
        except StoreUnavailable as e:
            self._count(lookup_unavailable=1)
            warn_limited(log, "lookup-unavailable", "kvtide connector: store lookup got no answer (%s); the request "
                         "is computed", e)
            hits = first
        match_end = min(hits * self.chunk, n - 1)
        m: _Match | None = None
        if match_end > num_computed:
            for k in keys[first:hits]:
                self._remember(k.hex)
            m = _Match(num_computed, n, match_end, match_end)
            tau = self.load_rate.seconds_per_token_layer
            if self.cfg.planned_split and self.prefill.ready and tau is not None:
                m.plan = plan_split(num_computed, match_end, n, self.chunk, self.num_layers, tau,
                                    self.prefill.compute_seconds, self.cfg.split_margin)
                m.load_end = m.plan.load_end
        self._lookup[rid] = (num_computed, n, m)
        return 0 if m is None else m.load_end - m.start

    def after_alloc(self, request: Any, num_external: int) -> None:
        """vLLM allocated blocks for ``num_external`` external tokens (0: it loads nothing)."""
        rid = request.request_id
        entry = self._lookup.pop(rid, None)
        m = entry[2] if entry is not None else None
        self._count(lookups=1)
        if m is None:
            return
        self._count(hit_tokens=m.match_end - m.start)
        if num_external <= 0:
            self._count(planned_recompute_tokens=m.match_end - m.start, split_requests=int(m.match_end > m.start))
            return
        load_end = m.start + num_external
        self._count(planned_load_tokens=num_external, planned_recompute_tokens=m.match_end - load_end,
                    split_requests=int(load_end < m.match_end))
        self._loads[rid] = _Match(m.start, m.num_tokens, m.match_end, load_end, m.plan)

    # ---- steps --------------------------------------------------------------------------------------------
    def build(self, out: Any) -> StepPlan:
        """The plan of the step vLLM just scheduled (``out``: its ``SchedulerOutput``)."""
        plan = StepPlan(counts=self._counts)
        self._counts = {}
        scheduled = out.num_scheduled_tokens
        rows: list[tuple[str, int]] = []  # (req_id, tokens computed before this step)
        for new in out.scheduled_new_reqs:
            self._tables[new.req_id] = list(new.block_ids[0]) if new.block_ids else []
            rows.append((new.req_id, new.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            nb = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if rid in cached.resumed_req_ids:  # a resumed request's new blocks are its whole table
                self._tables[rid] = list(nb[0]) if nb else []
            elif nb:
                self._tables.setdefault(rid, []).extend(nb[0])
            rows.append((rid, cached.num_computed_tokens[i]))
        for rid, before in rows:
            n = scheduled.get(rid, 0)
            plan.parts.append((before, n))
            req = self._requests.get(rid)
            blocks = self._table(rid)
            m = self._loads.pop(rid, None)
            if m is not None and req is not None and blocks is not None:
                plan.loads.append(self._load_spec(rid, req, m, blocks))
            if req is not None and blocks is not None and self.cfg.save and n > 0:
                spec = self._save_spec(rid, req, before, before + n, blocks)
                if spec is not None:
                    plan.saves.append(spec)
        return plan

    def _table(self, rid: str) -> tuple[int, ...] | None:
        """The request's block table: vLLM's KV cache manager's when bound, else the one followed here."""
        if self.block_ids is not None:
            try:
                got = self.block_ids(rid)
            except (KeyError, IndexError, ValueError):
                got = None
            if got is not None:
                return tuple(got)
        table = self._tables.get(rid)
        return tuple(table) if table is not None else None

    def _refs(self, req: Any, keys: list[ChunkKey], first: int, last: int) -> tuple[ChunkRef, ...]:
        C, toks = self.chunk, req.all_token_ids
        return tuple(ChunkRef(keys[c].hex, c, tuple(toks[c * C:(c + 1) * C])) for c in range(first, last))

    def _load_spec(self, rid: str, req: Any, m: _Match, blocks: tuple[int, ...]) -> LoadSpec:
        first, last = m.start // self.chunk, -(-m.load_end // self.chunk)  # every one a full chunk in the store
        keys = self.keys_for(rid, req.all_token_ids, last * self.chunk)
        return LoadSpec(rid, m.start, m.load_end, self._refs(req, keys, first, last), blocks)

    def _save_spec(self, rid: str, req: Any, before: int, after: int, blocks: tuple[int, ...]) -> SaveSpec | None:
        C = self.chunk
        toks = req.all_token_ids
        if len(toks) < after:  # token ids not known yet (asynchronous scheduling): later
            return None
        limit = after if self.cfg.save_decode else min(after, getattr(req, "num_prompt_tokens", after))
        first, last = before // C, limit // C
        if last <= first:
            return None
        keys = self.keys_for(rid, toks, last * C)
        todo = [c for c in range(first, last) if keys[c].hex not in self._known]
        if not todo:
            return None
        for c in todo:
            self._remember(keys[c].hex)
        return SaveSpec(rid, tuple(ChunkRef(keys[c].hex, c, tuple(toks[c * C:(c + 1) * C])) for c in todo), blocks)

    # ---- feedback -----------------------------------------------------------------------------------------
    def on_report(self, report: WorkerReport | None) -> None:
        """Measurements and failures from the worker (vLLM's ``update_connector_output``)."""
        if report is None:
            return
        for parts, seconds in report.steps:
            self.prefill.observe(parts, seconds)
        for token_layers, nbytes, seconds in report.loads:
            self.load_rate.observe(token_layers, nbytes, seconds)
        for key in (*report.failed, *report.unsaved):
            self._known.pop(key, None)

    def finished(self, request: Any) -> None:
        rid = request.request_id
        for d in (self._requests, self._keys, self._lookup, self._loads, self._tables):
            d.pop(rid, None)

    def _remember(self, key: str) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > self.cfg.max_known_chunks:
            self._known.popitem(last=False)
