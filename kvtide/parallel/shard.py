"""One shard's KV cache and attention, and the restoration executor's model interface over them.

KV layout: per local layer one contiguous tensor ``[slots, 2 (K, V), max_len, kv_heads, head_dim]``; a request
of a batch owns slot = its index. A row segment (slot, start, end) writes its K/V at [start, end) and attends
over [0, end) causally.

``ShardPort`` is the ``kvtide.restore.executor.ModelPort`` of one shard for one restoration batch. The executor
sees local layers 0..L_s-1 and does what it does on one device (staircase, then suffix, then its own fallback
for entries that fail to load); the port supplies what the first layer reads and what the last one hands on:

* first layer input, prefix rows: token embeddings (shard 0), the boundary activation (loaded before the run,
  extended chunk by chunk if the executor's own fallback needs later rows), or rows received from upstream;
* first layer input, suffix rows: received from upstream once, after upstream's restoration;
* last layer output: replay rows a downstream shard takes instead of a boundary activation are sent as soon
  as the staircase reaches this layer; suffix rows are sent after the run (``finish``).

A row nobody can supply (a double failure: no boundary activation *and* a lost KV entry past what upstream
replayed) is fed zeros and the request is marked *poisoned*: the engine recomputes it from scratch through the
whole pipeline, so such rows never reach an output.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kvtide.models.llama import CausalLM
from kvtide.restore.devicewise import Route, Source
from kvtide.restore.executor import RestoreJob, Segment
from kvtide.store.base import Entry
from kvtide.store.keys import ChunkKey

from .comm import TAG_PREFIX, TAG_SUFFIX, Link


class SlotKV:
    """Contiguous per-layer KV of one shard: ``layers[i]`` is [slots, 2, max_len, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.layers = [torch.zeros(slots, 2, max_len, kv_heads, head_dim, dtype=dtype, device=device)
                       for _ in range(num_layers)]
        self.max_len = max_len

    def write(self, local: int, slot: int, start: int, kv: torch.Tensor) -> None:
        """``kv`` [2, T, kv_heads, head_dim] at positions [start, start + T)."""
        self.layers[local][slot, :, start:start + kv.shape[1]] = kv.to(self.layers[local].dtype)

    def read(self, local: int, slot: int, start: int, end: int) -> torch.Tensor:
        """[2, end - start, kv_heads, head_dim], a CPU copy (what a store record holds)."""
        return self.layers[local][slot, :, start:end].to("cpu", copy=True)


class SlotAttention:
    """The model's ``attention(layer, q, k, v)`` over ``SlotKV``; ``plan`` sets the rows of the next call."""

    def __init__(self, kv: SlotKV, first_layer: int, head_dim: int) -> None:
        self.kv = kv
        self.lo = first_layer
        self.scale = head_dim ** -0.5
        self.segs: list[tuple[int, int, int]] = []
        self.lower_right = True  # CUDA: rows after a prefix through FlashAttention (see _lower_right)

    def _masked(self, qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, a: int, e: int) -> torch.Tensor:
        mask = torch.arange(e, device=qq.device)[None, :] <= torch.arange(a, e, device=qq.device)[:, None]
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask[None, None], scale=self.scale,
                                              enable_gqa=True)

    def _lower_right(self, qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, n: int, e: int) -> torch.Tensor:
        """Rows [e - n, e) attending over [0, e): causal aligned bottom-right, which FlashAttention runs without a
        mask. The boolean-mask call above leaves SDPA only its math kernel on CUDA (a [heads, n, e] float32 score
        matrix per layer: 32 GB for a 15k-token suffix over 16k positions of Llama-3.1-8B). K/V heads are
        expanded here rather than by ``enable_gqa``, which older ``CausalBias`` dispatchers do not take. Falls
        back to the mask for good if this torch refuses."""
        from torch.nn.attention.bias import causal_lower_right

        rep = qq.shape[1] // kk.shape[1]
        if rep > 1:
            kk, vv = kk.repeat_interleave(rep, dim=1), vv.repeat_interleave(rep, dim=1)
        try:
            return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=causal_lower_right(n, e), scale=self.scale)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            self.lower_right = False
            return self._masked(qq, kk[:, ::rep], vv[:, ::rep], e - n, e)

    def plan(self, segs: Iterable[tuple[int, int, int]]) -> None:
        self.segs = [(int(r), int(a), int(e)) for r, a, e in segs]
        for _, a, e in self.segs:
            if not 0 <= a < e <= self.kv.max_len:
                raise ValueError(f"row segment [{a}, {e}) outside the cache's {self.kv.max_len} positions")

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.kv.layers[layer - self.lo]
        out = torch.empty_like(q)
        o = 0
        for slot, a, e in self.segs:
            n = e - a
            cache[slot, 0, a:e] = k[o:o + n].to(cache.dtype)
            cache[slot, 1, a:e] = v[o:o + n].to(cache.dtype)
            kk = cache[slot, 0, :e].to(q.dtype).transpose(0, 1)[None]
            vv = cache[slot, 1, :e].to(q.dtype).transpose(0, 1)[None]
            qq = q[o:o + n].transpose(0, 1)[None]
            if n == 1:
                y = F.scaled_dot_product_attention(qq, kk, vv, scale=self.scale, enable_gqa=True)
            elif a == 0:
                y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=self.scale, enable_gqa=True)
            elif self.lower_right and q.is_cuda:
                y = self._lower_right(qq, kk, vv, n, e)
            else:
                y = self._masked(qq, kk, vv, a, e)
            out[o:o + n] = y[0].transpose(0, 1)
            o += n
        return out


class ShardStoreView:
    """A store seen with this shard's local layer numbers (entries are keyed by global layer).

    Besides ``get_entry``, a batched read path (``fetch(items)`` + ``open(blob, key, layer, tokens, ...)``) is
    forwarded when the store has one, so the executor uses whichever the store offers."""

    def __init__(self, inner: Any, first_layer: int) -> None:
        self.inner = inner
        self.lo = first_layer

    def get_entry(self, key: ChunkKey, layer: int, tokens: Sequence[int] | np.ndarray) -> Entry:
        return self.inner.get_entry(key, layer + self.lo, tokens)

    def __getattr__(self, name: str) -> Any:
        if name == "fetch" and hasattr(self.inner, "fetch"):
            return lambda items, *a, **kw: self.inner.fetch([(k, i + self.lo) for k, i in items], *a, **kw)
        if name == "open" and hasattr(self.inner, "open"):
            return lambda blob, key, layer, *a, **kw: self.inner.open(blob, key, layer + self.lo, *a, **kw)
        raise AttributeError(name)


class ProfileTap:
    """The latency profile as the executor sees it. Replay times of a run whose first layer waited for upstream
    rows are left out (part of that layer's time is the wait, not replay work); load rates always count."""

    def __init__(self, profile: Any, waits_for_upstream: bool) -> None:
        self.profile, self.skip = profile, waits_for_upstream

    def observe(self, tokens: int, seconds: float, blocks: int = 1) -> None:
        if not self.skip:
            self.profile.observe(tokens, seconds, blocks)

    def observe_load(self, nbytes: float, seconds: float, overlapped: bool = False) -> None:
        self.profile.observe_load(nbytes, seconds, overlapped=overlapped)


class ShardPort:
    """``ModelPort`` of one shard for one restoration batch (see the module docstring)."""

    def __init__(self, *, model: CausalLM, kv: SlotKV, attention: SlotAttention, layers: range, link: Link,
                 jobs: Sequence[RestoreJob], slots: Sequence[int], routes: Sequence[Route],
                 send_rows: Sequence[int] | Callable[[], Sequence[int]],
                 boundary: Sequence[torch.Tensor | None], extend_boundary: Callable[[int, int], torch.Tensor | None],
                 record_input: Callable[[int, int, torch.Tensor], None]) -> None:
        self.model, self.kv, self.attn, self.link = model, kv, attention, link
        self.layers = layers
        self.num_layers = len(layers)
        self.device = kv.layers[0].device
        self.jobs, self.routes = list(jobs), list(routes)
        self.slots = list(slots)  # KV slot of each request
        self._send_rows = send_rows  # rows each request hands downstream, or a callable that knows them later
        self.boundary = list(boundary)  # per request: rows [0, n) of the boundary activation, or None
        self.extend_boundary = extend_boundary  # (request, rows wanted) -> longer tensor or None (failed)
        self.record_input = record_input  # (slot, start, rows): first-layer inputs kept for later saves
        self.hidden = model.args.hidden_size
        self.dtype = next(model.parameters()).dtype  # of the activations exchanged
        self._ids = [torch.tensor(j.token_ids[:j.total], dtype=torch.long, device=self.device) for j in self.jobs]
        self._up: list[torch.Tensor | None] | None = None  # replay rows received from upstream
        self._suffix_in: list[torch.Tensor] | None = None
        self._suffix_out: dict[int, torch.Tensor] = {}
        self._sent_prefix = False
        self.poisoned: set[int] = set()
        self._host_wait = 0.0  # the host blocked in a receive (gloo)
        self._device_waits: list[tuple[Any, Any]] = []  # CUDA: events around each receive on the compute stream
        self.upstream_rows = 0

    @property
    def send_rows(self) -> list[int]:
        """Replay rows per request the downstream shard takes from this one (resolved on first use: shard 0 of a
        device-wise restoration learns it while it replays, from the other shards' boundary reads)."""
        if callable(self._send_rows):
            self._send_rows = list(self._send_rows())
        return list(self._send_rows)

    # ---- executor interface ----------------------------------------------------------------------------
    def run_layer(self, layer: int, h: torch.Tensor | None, segments: Sequence[Segment]) -> torch.Tensor:
        segs = list(segments)
        if h is None:
            if layer != 0:
                raise ValueError("only the first layer of a shard starts without hidden states")
            h = self._inputs(segs)
        self.attn.plan((self.slots[s.request], s.start, s.end) for s in segs)
        positions = torch.cat([torch.arange(s.start, s.end, device=self.device) for s in segs])
        g = self.layers[layer]
        out = self.model.hidden_states(None, positions, self.attn, layers=range(g, g + 1), h=h)  # type: ignore[arg-type]
        if layer == self.num_layers - 1 and not self.link.last:
            self._capture(out, segs)
        return out

    def write_kv(self, layer: int, request: int, start: int, kv: torch.Tensor) -> None:
        self.kv.write(layer, self.slots[request], start, kv)

    def kv_entry_shape(self) -> tuple[int, int]:
        a = self.model.args
        return a.num_kv_heads, a.head_dim

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.link.last:
            return self.model.logits(h)
        return torch.zeros(h.shape[0], 1, device=h.device)  # only the last shard samples

    # ---- what the engine calls --------------------------------------------------------------------------
    def finish(self) -> None:
        """After the run: hand every request's suffix rows (last layer) downstream, in request order."""
        if self.link.last:
            return
        rows = []
        for r, j in enumerate(self.jobs):
            t = self._suffix_out.get(r)
            if t is None:  # cannot happen with the executor as written; never send a short message
                self.poisoned.add(r)
                t = torch.zeros(j.total - j.cached, self.hidden, dtype=self.dtype, device=self.device)
            rows.append(t)
        self.link.send_next(torch.cat(rows), TAG_SUFFIX)

    # ---- first layer inputs ---------------------------------------------------------------------------------
    def _inputs(self, segs: list[Segment]) -> torch.Tensor:
        if self.link.first:
            return self.model.model.embed_tokens(torch.cat([self._ids[s.request][s.start:s.end] for s in segs]))
        parts = []
        for s in segs:
            job = self.jobs[s.request]
            a, b = s.start, min(s.end, job.cached)
            if a < b:
                parts.append(self._prefix_rows(s.request, a, b))
            if s.end > job.cached:
                lo = max(s.start, job.cached)
                t = self._suffix_rows()[s.request][lo - job.cached:s.end - job.cached]
                self.record_input(self.slots[s.request], lo, t)
                parts.append(t)
        return torch.cat(parts)

    def _prefix_rows(self, r: int, a: int, b: int) -> torch.Tensor:
        rt = self.routes[r]
        src: torch.Tensor | None
        if rt.source is Source.UPSTREAM:
            src = self._upstream()[r]
        else:
            src = self.boundary[r]
            if src is None or src.shape[0] < b:
                src = self.boundary[r] = self.extend_boundary(r, b)
        if src is None or src.shape[0] < b:
            self.poisoned.add(r)
            return torch.zeros(b - a, self.hidden, dtype=self.dtype, device=self.device)
        t = src[a:b]
        if rt.source is Source.UPSTREAM:
            self.record_input(self.slots[r], a, t)
        return t

    @property
    def wait_seconds(self) -> float:
        """Time this shard's compute waited for upstream rows. A NCCL receive does not block the host: the compute
        stream waits, so on CUDA the wait is read from events around each receive (read after the run's final
        synchronisation)."""
        return self._host_wait + sum(a.elapsed_time(b) / 1e3 for a, b in self._device_waits)

    def _timed_recv(self, rows: int, tag: int) -> torch.Tensor:
        ev = None
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        t0 = time.perf_counter()
        x = self.link.recv_prev(rows, self.hidden, self.dtype, tag)
        self._host_wait += time.perf_counter() - t0
        if ev is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._device_waits.append((ev, end))
        return x

    def _upstream(self) -> list[torch.Tensor | None]:
        if self._up is None:
            want = [rt.first if rt.source is Source.UPSTREAM else 0 for rt in self.routes]
            x = self._timed_recv(sum(want), TAG_PREFIX)
            self.upstream_rows = sum(want)
            self._up, o = [], 0
            for n in want:
                self._up.append(x[o:o + n] if n else None)
                o += n
        return self._up

    def _suffix_rows(self) -> list[torch.Tensor]:
        if self._suffix_in is None:
            lens = [j.total - j.cached for j in self.jobs]
            x = self._timed_recv(sum(lens), TAG_SUFFIX)
            self._suffix_in, o = [], 0
            for n in lens:
                self._suffix_in.append(x[o:o + n])
                o += n
        return self._suffix_in

    # ---- last layer outputs -----------------------------------------------------------------------------------
    def _capture(self, out: torch.Tensor, segs: list[Segment]) -> None:
        o = 0
        prefix: dict[int, torch.Tensor] = {}
        for s in segs:
            job = self.jobs[s.request]
            rows = out[o:o + s.length]
            o += s.length
            if s.end <= job.cached and s.start == job.start:  # the staircase's replay of this layer
                prefix[s.request] = rows
            if s.end == job.total:  # suffix (or the executor's fallback, which ends at total too)
                self._suffix_out[s.request] = rows[job.cached - s.end:]
        if prefix and not self._sent_prefix and sum(send := self.send_rows):
            self._sent_prefix = True
            parts = []
            for r, n in enumerate(send):
                if not n:
                    continue
                t = prefix.get(r)
                if t is None or t.shape[0] < n:  # the executor replayed less than planned: never a short message
                    self.poisoned.add(r)
                    t = torch.zeros(n, self.hidden, dtype=self.dtype, device=self.device)
                parts.append(t[:n])
            self.link.send_next(torch.cat(parts), TAG_PREFIX)
