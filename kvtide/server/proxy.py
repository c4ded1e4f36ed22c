"""`kvtide proxy`: one OpenAI endpoint in front of prefill and decode instances (prefill/decode disaggregation).

A request goes first to a prefill instance as a prefill leg (``max_tokens=1``, not streamed, ``kv_transfer_params:
{"do_remote_decode": true}``); the params its answer carries go with the original request to a decode instance,
whose answer (streamed or whole) is passed back as it comes. Instances are taken in turn; one that refuses a
connection, times out or answers 5xx is marked down for ``down_s`` and the next is tried. With no prefill instance
answering, the request goes to a decode instance without params (it prefills the prompt itself, counted); with no
decode instance, 503. A client's 4xx from the prefill leg is its answer (the decode leg would refuse it too).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..log import get_logger
from .metrics import PREFIX
from .protocol import APIError, error_body
from .serving import read_json

log = get_logger("proxy")

FORWARDED_HEADERS = ("authorization", "x-request-id")


@dataclass
class Pool:
    """Instances of one role, taken round-robin, skipping those marked down."""

    urls: list[str]
    down_s: float = 5.0
    _down: dict[str, float] = field(default_factory=dict)
    _turn: Any = None

    def __post_init__(self) -> None:
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"instance URL {u!r} must start with http:// or https://")
        self.urls = [u.rstrip("/") for u in self.urls]
        self._turn = itertools.cycle(range(len(self.urls))) if self.urls else None

    def order(self) -> list[str]:
        """Every instance once, the next in turn first, those marked down last."""
        if not self.urls:
            return []
        start = next(self._turn)
        ring = self.urls[start:] + self.urls[:start]
        now = time.monotonic()
        return [u for u in ring if self._down.get(u, 0) <= now] + [u for u in ring if self._down.get(u, 0) > now]

    def mark_down(self, url: str) -> None:
        self._down[url] = time.monotonic() + self.down_s

    def mark_up(self, url: str) -> None:
        self._down.pop(url, None)


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float = 600.0, down_s: float = 5.0,
                 max_request_bytes: int = 1 << 20):
        if not decode:
            raise ValueError("kvtide proxy needs at least one --decode instance")
        self.prefill = Pool(list(prefill), down_s)
        self.decode = Pool(list(decode), down_s)
        self.max_request_bytes = max_request_bytes
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=2.0))
        self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "proxy_requests", "Requests through the proxy, by how they were served "
                                "(disaggregated, decode_only: no prefill instance answered, failed).", ["route"],
                                registry=self.registry)
        self.instance_errors = Counter(PREFIX + "proxy_instance_errors", "Instances that failed a leg, by role.",
                                       ["role"], registry=self.registry)

    async def handle(self, request: Request, path: str) -> Response:
        body = await read_json(request, self.max_request_bytes)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        params, early = await self._prefill(path, body, headers)
        if early is not None:
            self.requests.labels("failed").inc()
            return early
        leg = dict(body)
        if params is not None:
            leg["kv_transfer_params"] = params
        for url in self.decode.order():
            try:
                req = self.client.build_request("POST", url + path, json=leg, headers=headers)
                resp = await self.client.send(req, stream=True)
            except httpx.HTTPError as e:
                log.warning("decode instance %s failed: %s", url, e)
                self.decode.mark_down(url)
                self.instance_errors.labels("decode").inc()
                continue
            if resp.status_code >= 500 and resp.status_code != 503:
                await resp.aclose()
                self.decode.mark_down(url)
                self.instance_errors.labels("decode").inc()
                continue
            self.decode.mark_up(url)
            self.requests.labels("disaggregated" if params is not None else "decode_only").inc()
            kept = {k: v for k, v in resp.headers.items() if k.lower() in ("content-type", "retry-after")}
            return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, headers=kept,
                                     background=BackgroundTask(resp.aclose))
        self.requests.labels("failed").inc()
        raise APIError(503, "no decode instance answered; retry later", None, {"Retry-After": "1"})

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]
                       ) -> tuple[dict[str, Any] | None, Response | None]:
        """(params for the decode leg, None) or (None, the client's error answer)."""
        leg = dict(body)
        leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        leg.pop("stream_options", None)
        for url in self.prefill.order():
            try:
                resp = await self.client.post(url + path, json=leg, headers=headers)
            except httpx.HTTPError as e:
                log.warning("prefill instance %s failed: %s", url, e)
                self.prefill.mark_down(url)
                self.instance_errors.labels("prefill").inc()
                continue
            if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                return None, Response(resp.content, status_code=resp.status_code,
                                      media_type=resp.headers.get("content-type"))
            if resp.status_code != 200:
                self.prefill.mark_down(url)
                self.instance_errors.labels("prefill").inc()
                continue
            self.prefill.mark_up(url)
            try:
                params = resp.json().get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
            return (params if isinstance(params, dict) else None), None
        return None, None

    async def models(self) -> Response:
        for url in self.decode.order():
            try:
                resp = await self.client.get(url + "/v1/models")
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                return Response(resp.content, media_type="application/json")
        raise APIError(503, "no decode instance answered; retry later", None, {"Retry-After": "1"})

    async def health(self) -> Response:
        for url in self.decode.order():
            try:
                if (await self.client.get(url + "/health")).status_code == 200:
                    return Response(status_code=200)
            except httpx.HTTPError:
                continue
        return JSONResponse(error_body(503, "no decode instance is healthy"), status_code=503)


def build_proxy_app(proxy: Proxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await proxy.client.aclose()

    app = FastAPI(title="kvtide proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        return await proxy.models()

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_proxy(prefill: list[str], decode: list[str], host: str, port: int, log_level: str = "info") -> int:
    import uvicorn

    app = build_proxy_app(Proxy(prefill, decode))
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug")
    return 0
