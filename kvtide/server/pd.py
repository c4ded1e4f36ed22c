"""Prefill/decode roles of `kvtide serve`: the prefill side serves its cached KV, the decode side pulls it.

The prefill instance answers the prefill leg (``max_tokens=1``) as usual; its finished chunks land in its local KV
tier (restoration's writer), and the answer carries ``kv_transfer_params`` (its URL and its transport session).
The decode instance, given those params with the same prompt, allocates a receive buffer on its transport and
POSTs ``/v1/kv/pull`` to the prefill instance: the prefill side picks a profile (`TransferPolicy`: quality bucket,
SLO, measured goodput to that peer; under the request's ``policy_key``, if it names one, the state of that key
alone), writes the layers one by one into the buffer and streams a notice per layer
(NDJSON); the decode side checks and decodes each layer as it arrives and puts its chunks into its own KV tier.
The request then enters the engine, whose restoration loads those chunks (no recompute of the prompt) and computes
the prompt's last partial chunk. Any failure (a dead or slow prefill, a dropped stream, a corrupt layer, another
model) ends in a plain prefill on the decode side, counted by reason; a partial hand-off is never used, because
a chunk is only found once its last layer is stored and every entry is verified when it is loaded.
"""
from __future__ import annotations

import asyncio
import json
import math
import queue
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..log import get_logger
from ..store.bandwidth import gbps
from ..store.breaker import present
from ..store.keys import chunk_keys
from ..transfer.handoff import (HandoffError, LayerNotice, SendResult, capacity, check_spec, codec_device,
                                layer_capacity, receive_layers, send_layers)
from ..transfer.pipeline import Pipeline
from ..transfer.policy import (PolicyKeyError, TransferPolicy, check_policy_key, measured_lossless, packaged_table,
                               table_profiles)
from ..transfer.transport.base import LocalBuffer, RemoteBuffer, Transport, TransportError
from ..transfer.transport.pool import BufferPool
from .config import ServerConfig
from .pd_metrics import TransferMetrics
from .protocol import APIError, bad

if TYPE_CHECKING:
    from ..engine.llm_engine import LLMEngine

log = get_logger("pd")

PULL_PATH = "/v1/kv/pull"
MAX_LINE_BYTES = 64 << 10  # a control-stream line (header, notice, result) is small; longer is an error


class KVRole:
    """What both roles share: the engine's KV tier and key space, the transport, the metrics."""

    def __init__(self, engine: "LLMEngine", cfg: ServerConfig, transport: Transport, metrics: TransferMetrics):
        r = engine.restorer
        if r is None:
            raise ValueError("a prefill or decode role needs the engine's KV tier (EngineConfig.restore)")
        self.engine = engine
        self.restorer = r
        self.cfg = cfg
        self.transport = transport
        self.metrics = metrics
        a = engine.model.args
        self.num_layers = a.num_layers
        self.kv_heads, self.head_dim = a.num_kv_heads, a.head_dim
        self.chunk = r.chunk
        self.space = r.keyspace.root.hex()
        # registered staging (prefill) or receive (decode) buffers kept between hand-offs
        self.buffers = BufferPool(transport, max_buffers=4, max_bytes=cfg.kv_transfer_max_bytes)

    async def aclose(self) -> None:
        """The end of serving: the transport closes (a decode role also closes its HTTP client)."""
        self.buffers.close()
        self.transport.close()

    def cached_span(self, ids: list[int]) -> int:
        """Prompt tokens a hand-off covers: whole chunks, leaving at least one token for the decode side's logits."""
        return (len(ids) - 1) // self.chunk * self.chunk

    def restoration(self, request_ids: list[str]) -> dict[str, Any] | None:
        """Timings of the restoration that loaded a request's prompt KV (None: none on record)."""
        rec = self.restorer.record_of(request_ids)
        return rec.timings() if rec is not None else None

    def raw_layer_bytes(self, tokens: int) -> int:
        return 2 * tokens * self.kv_heads * self.head_dim * 2  # K and V in BF16


class PrefillRole(KVRole):
    """Serves ``/v1/kv/pull``: the KV of a prompt this instance prefilled, through the policy's profile."""

    def __init__(self, engine: "LLMEngine", cfg: ServerConfig, transport: Transport, metrics: TransferMetrics):
        super().__init__(engine, cfg, transport, metrics)
        table = cfg.kv_profiles or packaged_table(engine.config.model, engine.config.torch_device)
        profiles = measured_lossless((256, self.kv_heads, self.head_dim))
        if table:
            profiles = table_profiles(str(table), engine.config.torch_device) + profiles
        self.policy = TransferPolicy(profiles, gbps(cfg.kv_bandwidth_guess_gbps))

    def params(self, url: str) -> dict[str, Any]:
        """The prefill leg's ``kv_transfer_params``: where the decode side pulls from."""
        return {"remote_url": url, "remote_session": self.transport.session, "key_space": self.space}

    def parse_pull(self, body: Any) -> tuple[list[int], RemoteBuffer, float, float | None, str | None, str]:
        if not isinstance(body, dict):
            raise bad(None, "the pull body must be a JSON object")
        ids = body.get("token_ids")
        limit = self.engine.max_seq_len
        if (not isinstance(ids, list) or not 1 < len(ids) <= limit
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t for t in ids)):
            raise bad("token_ids", f"'token_ids' must be a list of 2 to {limit} token ids")
        if body.get("key_space") != self.space:
            raise APIError(409, "the decode instance's model, KV dtype, chunk size or namespace differs from this "
                           "instance's (key spaces differ); its KV cannot be used there", "key_space")
        try:
            dst = RemoteBuffer.from_dict(body.get("dst"))
        except (ValueError, TypeError) as e:
            raise bad("dst", str(e)) from None
        q = body.get("min_quality", 1.0)
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= q <= 1.0:
            raise bad("min_quality", f"'min_quality' must be a number in [0, 1], got {q!r}")
        slo = body.get("slo_s")
        if slo is not None and (isinstance(slo, bool) or not isinstance(slo, (int, float)) or not slo > 0
                                or not math.isfinite(slo)):
            raise bad("slo_s", f"'slo_s' must be a positive number of seconds or null, got {slo!r}")
        spec = body.get("profile")
        if spec is not None:
            if not isinstance(spec, str) or not spec or len(spec) > 256:
                raise bad("profile", f"'profile' must be a pipeline spec string, got {spec!r:.80}")
            try:
                Pipeline(spec)
            except (ValueError, TypeError) as e:
                raise bad("profile", f"'profile' {spec!r:.80} is not a pipeline: {e}") from None
        key = body.get("policy_key")
        try:
            key = "" if key is None else check_policy_key(key)
        except PolicyKeyError as e:
            raise bad("policy_key", str(e)) from None
        try:
            self.policy.admit(key)  # before the stream starts: a key past the bound is a 409, not a failed stream
        except PolicyKeyError as e:
            raise APIError(409, str(e), "policy_key") from None
        return ids, dst, float(q), slo, spec, key

    def _ready(self, ids: list[int], deadline: float) -> int:
        """Tokens of the prompt's whole chunks this instance holds, waiting for the writer until ``deadline``."""
        n = self.cached_span(ids)
        keys = chunk_keys(ids[:n], self.restorer.keyspace)
        writer = self.restorer.writer
        if writer is not None and keys:
            writer.wait_for(keys, timeout=max(0.0, deadline - time.monotonic()))
        got = 0
        for k in keys:
            if not present(self.restorer.store, k, self.num_layers - 1):
                break
            got += 1
        return got * self.chunk

    def pull(self, ids: list[int], dst: RemoteBuffer, min_quality: float, slo: float | None,
             spec: str | None = None, key: str = "") -> Iterator[bytes]:
        """The control stream of one hand-off: a header line, a notice per layer, a result line (or an error
        line). Runs in a worker thread (a sync generator under Starlette)."""
        deadline = time.monotonic() + self.cfg.kv_transfer_timeout_s
        try:
            n = self._ready(ids, deadline)
            if n == 0:
                raise HandoffError("missing", "this instance holds none of the prompt's chunks")
            raw_layer = self.raw_layer_bytes(n)
            if dst.nbytes < capacity(raw_layer, self.num_layers):
                raise HandoffError("refused", f"the receive buffer has {dst.nbytes} bytes; {n} tokens need "
                                              f"{capacity(raw_layer, self.num_layers)}")
            if spec is not None:
                choice = self.policy.named(dst.session, spec, key)
            else:
                choice = self.policy.decide(dst.session, raw_layer * self.num_layers, min_quality, slo, key)
            pipe = Pipeline(choice.spec)
            yield _line({"tokens": n, "layers": self.num_layers, "spec": pipe.to_spec(), "profile": choice.name,
                         "quality": choice.quality, "bandwidth": choice.bandwidth,
                         "bandwidth_measured": choice.measured, "decided": choice.decision is not None})
            keys = chunk_keys(ids[:n], self.restorer.keyspace)
            store, C = self.restorer.store, self.chunk

            import torch
            # one layer buffer per hand-off, on the GPU where the pipeline computes there (codec_device)
            where = codec_device(pipe, self.engine.config.torch_device) or torch.device("cpu")
            layer = torch.empty(2, n, self.kv_heads, self.head_dim, dtype=torch.bfloat16, device=where)

            def read_layer(i: int) -> torch.Tensor:  # the encoder is done with the last layer when it asks
                for k in keys:
                    lo = k.index * C
                    layer[:, lo:lo + C].copy_(store.get(k, i, ids[lo:lo + C]))  # synchronous: the entry may go
                return layer

            # two buffers: layer i+1 is encoded into one while layer i is written from the other
            staging = [self.buffers.take(layer_capacity(raw_layer)) for _ in range(2)]
            sent = False
            try:
                timeout = max(0.1, deadline - time.monotonic())
                for item in send_layers(read_layer, self.num_layers, pipe, choice.name,
                                        self.transport, staging, dst, timeout_s=timeout):
                    if isinstance(item, LayerNotice):
                        yield _line(item.to_dict())
                    else:
                        self.policy.observe(dst.session, choice, item, key)
                        self.metrics.moved("sent", item.wire_bytes, item.raw_bytes, item.total_s, item.profile)
                        sent = True
                        yield _line({"done": True, **item.to_dict()})
            finally:
                for b in staging:  # after a failed write the transport may still read one: not reused
                    self.buffers.give(b, settled=sent)
        except HandoffError as e:
            self.metrics.fallback(f"send_{e.reason}")
            log.warning("hand-off to %s not sent (%s): %s", dst.session, e.reason, e)
            yield _line({"error": e.reason, "message": str(e)})
        except Exception as e:  # noqa: BLE001 - a store or codec failure ends this hand-off only
            self.metrics.fallback("send_error")
            log.warning("hand-off to %s failed: %s: %s", dst.session, type(e).__name__, e)
            yield _line({"error": "error", "message": f"{type(e).__name__}: {e}"})


class DecodeRole(KVRole):
    """Pulls a prompt's KV from the prefill instance named in ``kv_transfer_params`` into the local KV tier."""

    def __init__(self, engine: "LLMEngine", cfg: ServerConfig, transport: Transport, metrics: TransferMetrics):
        super().__init__(engine, cfg, transport, metrics)
        import httpx
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(cfg.kv_transfer_timeout_s, connect=2.0))

    async def aclose(self) -> None:
        await self._http.aclose()
        await super().aclose()

    async def receive(self, ids: list[int], params: dict[str, Any], min_quality: float,
                      slo: float | None, profile: str | None = None, policy_key: str | None = None
                      ) -> dict[str, Any]:
        """Pull and store the prompt's KV; returns what happened (``used`` False: the engine recomputes)."""
        n = self.cached_span(ids)
        if n == 0:
            return {"used": False, "reason": "short"}
        note = None
        if min_quality < 1.0 and not self.cfg.kv_accept_lossy:
            # lossy KV would be cached and reused by requests that asked for none of it: lossless instead
            min_quality, note = 1.0, "this instance takes lossless hand-offs only (kv_accept_lossy is off)"
        t0 = time.perf_counter()
        try:
            url = params["remote_url"].rstrip("/") + PULL_PATH
            out = await asyncio.wait_for(self._pull(url, ids, n, min_quality, slo, profile, policy_key, t0),
                                         timeout=self.cfg.kv_transfer_timeout_s)
            return {**out, "note": note} if note else out
        except HandoffError as e:
            reason = e.reason
            msg = str(e)
        except asyncio.TimeoutError:
            reason, msg = "timeout", f"no complete hand-off within {self.cfg.kv_transfer_timeout_s} s"
        except Exception as e:  # noqa: BLE001 - connection refused, reset, a bad line: recompute
            reason, msg = "transport", f"{type(e).__name__}: {e}"
        self.metrics.fallback(reason)
        log.warning("KV hand-off from %s not used (%s): %s; the prompt is recomputed", params.get("remote_url"),
                    reason, msg)
        return {"used": False, "reason": reason, "message": msg}

    async def _pull(self, url: str, ids: list[int], n: int, min_quality: float, slo: float | None,
                    profile: str | None, policy_key: str | None, t0: float) -> dict[str, Any]:
        cap = capacity(self.raw_layer_bytes(n), self.num_layers)
        if cap > self.cfg.kv_transfer_max_bytes:
            raise HandoffError("too_large", f"{n} tokens need a {cap}-byte receive buffer; "
                                            f"kv_transfer_max_bytes is {self.cfg.kv_transfer_max_bytes}")
        buf = await asyncio.to_thread(self.buffers.take, cap)
        lines: queue.Queue = queue.Queue()
        result: dict[str, Any] = {}
        try:
            body = {"token_ids": ids, "key_space": self.space, "dst": buf.remote().to_dict(),
                    "min_quality": min_quality, "slo_s": slo, "profile": profile, "policy_key": policy_key}
            async with self._http.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread())[:300].decode("utf-8", "replace")
                    raise HandoffError("refused", f"{url} answered {resp.status_code}: {text}")
                stream = _ndjson(resp)
                header = await anext(stream, None)
                if header is None or "error" in header:
                    why = str((header or {}).get("message", "the stream ended"))[:300]
                    reason = "missing" if (header or {}).get("error") == "missing" else "refused"
                    raise HandoffError(reason, f"the prefill side sent no hand-off: {why}")
                got = header.get("tokens")
                if isinstance(got, bool) or not isinstance(got, int) or got <= 0 or got > n or got % self.chunk:
                    raise HandoffError("corrupt", f"the hand-off header's tokens {got!r} are not whole chunks "
                                                  f"of at most {n}")
                if header.get("layers") != self.num_layers:
                    raise HandoffError("corrupt", f"the hand-off has {header.get('layers')!r} layers, the model "
                                                  f"{self.num_layers}")
                pipe = check_spec(str(header.get("spec")), lossless_only=min_quality >= 1.0)
                worker = asyncio.ensure_future(asyncio.to_thread(
                    self._decode, lines, buf, pipe, ids, got))
                try:
                    async for item in stream:
                        if "error" in item:
                            raise HandoffError("transport", f"the prefill side failed: {item.get('message')}")
                        if item.get("done"):
                            result = item
                            break
                        lines.put(item)
                    else:
                        raise HandoffError("transport", "the control stream ended before the last layer")
                finally:
                    lines.put(None)
                    decoded = await worker
        finally:
            # after the sender's "done" every write has returned: the buffer can go at once; otherwise a write may
            # still be landing, and the transport holds the memory a while before reusing it
            await asyncio.to_thread(self.buffers.give, buf, settled=bool(result))
        seconds = time.perf_counter() - t0
        wire = decoded.wire_bytes
        raw = self.raw_layer_bytes(got) * self.num_layers
        profile = str(header.get("profile"))
        self.metrics.moved("received", wire, raw, seconds, profile)
        self.metrics.tokens.inc(got)
        return {"used": True, "tokens": got, "profile": profile, "spec": pipe.to_spec(),
                "quality": header.get("quality"), "bandwidth": header.get("bandwidth"),
                "bandwidth_measured": header.get("bandwidth_measured"), "wire_bytes": wire, "raw_bytes": raw,
                "seconds": seconds,
                "decode_seconds": decoded.decode_s,
                "sender": {k: result.get(k) for k in ("encode_s", "write_s", "total_s", "wire_span_s")}}

    def _decode(self, lines: "queue.Queue", buf: LocalBuffer, pipe: Pipeline, ids: list[int], n: int):
        keys = chunk_keys(ids[:n], self.restorer.keyspace)
        store, C = self.restorer.store, self.chunk

        def notices():
            while True:
                item = lines.get(timeout=self.cfg.kv_transfer_timeout_s)
                if item is None:
                    return
                yield item

        def sink(layer: int, kv) -> None:
            for k in keys:
                lo = k.index * C
                store.put(k, layer, ids[lo:lo + C], kv[:, lo:lo + C])  # the record copies the strided view

        try:
            # a GPU engine decodes on its GPU what computes there; raw BF16 goes straight to the host tier
            return receive_layers(notices(), buf, pipe, self.num_layers, (2, n, self.kv_heads, self.head_dim), sink,
                                  device=codec_device(pipe, self.engine.config.torch_device))
        except queue.Empty:
            raise HandoffError("timeout", "no layer notice within the transfer timeout") from None


async def _ndjson(resp: Any):
    """Parsed lines of an NDJSON response; a line past MAX_LINE_BYTES or not a JSON object is an error."""
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield _parse_line(line)
        if len(buf) > MAX_LINE_BYTES:
            raise HandoffError("corrupt", f"a control-stream line is longer than {MAX_LINE_BYTES} bytes")
    if buf.strip():
        yield _parse_line(buf)


def _parse_line(line: bytes) -> dict[str, Any]:
    try:
        item = json.loads(line)
    except (ValueError, RecursionError):
        raise HandoffError("corrupt", "a control-stream line is not JSON") from None
    if not isinstance(item, dict):
        raise HandoffError("corrupt", "a control-stream line is not a JSON object")
    return item


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def open_role_transport(cfg: ServerConfig) -> Transport:
    from ..transfer.transport import open_transport
    from ..transfer.transport.pacing import PacedTransport

    t = open_transport(cfg.kv_transport, host=cfg.kv_transfer_host, protocol=cfg.kv_transfer_protocol)
    if cfg.kv_pacing_gbps is not None:
        t = PacedTransport(t, gbps(cfg.kv_pacing_gbps))
    return t


__all__ = ["DecodeRole", "PrefillRole", "PULL_PATH", "open_role_transport", "SendResult", "TransportError"]
