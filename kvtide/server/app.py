"""The FastAPI app of `kvtide serve`: OpenAI routes, /health, /metrics, /version, one error format.

Every error, the framework's own included (unknown route, wrong method), is answered as
``{"error": {"message", "type", "param", "code"}}``. The app's lifespan starts the engine's driver thread and the
periodic stats line, and at the end aborts what is still open and stops the engine loop.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import __version__
from ..log import get_logger
from .config import ServerConfig
from .protocol import APIError, error_body
from .serving import Serving

if TYPE_CHECKING:
    from ..engine.llm import LLM
    from ..transfer.transport.base import Transport

log = get_logger("server")

LOOP_STOP_TIMEOUT_S = 10.0


def build_app(llm: "LLM", cfg: ServerConfig, model_name: str | None = None, transport: "Transport | None" = None
              ) -> FastAPI:
    """The app serving ``llm`` as ``model_name`` (default: ``cfg.served_model_name``, else the engine's model).
    A prefill or decode ``cfg.role`` opens its KV transport (``transport``: one given, e.g. in-process in tests)."""
    name = model_name or cfg.served_model_name or llm.config.model
    serving = Serving(llm, cfg, name)
    started = int(time.time())
    if cfg.role != "both":
        from .pd import DecodeRole, PrefillRole, open_role_transport
        from .pd_metrics import TransferMetrics

        transport = transport or open_role_transport(cfg)
        role = PrefillRole if cfg.role == "prefill" else DecodeRole
        serving.pd = role(llm.engine, cfg, transport, TransferMetrics(serving.metrics.registry, name))
        log.info("%s role: KV transport %s at %s", cfg.role, type(transport).__name__, transport.session)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        llm.loop.start()
        stats = asyncio.ensure_future(_log_stats(serving, cfg.log_stats_interval_s))
        log.info("serving %s (context window %d tokens, %d requests at once, %d more queued)", name,
                 serving.max_seq_len, llm.engine.scheduler.config.max_num_seqs, cfg.max_queued_requests)
        try:
            yield
        finally:
            stats.cancel()
            serving.close_all()
            if serving.pd is not None:
                await serving.pd.aclose()
            await run_in_threadpool(llm.loop.stop, LOOP_STOP_TIMEOUT_S)
            log.info("engine loop stopped")

    app = FastAPI(title="kvtide", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        if e.status >= 500:
            log.warning("%s %s: %d %s", request.method, request.url.path, e.status, e.message)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    if cfg.role == "prefill":
        @app.post("/v1/kv/pull")
        async def kv_pull(request: Request) -> Response:
            from starlette.responses import StreamingResponse

            from .serving import read_json

            args = serving.pd.parse_pull(await read_json(request, cfg.max_request_bytes * 8))
            return StreamingResponse(serving.pd.pull(*args), media_type="application/x-ndjson")

    if cfg.role == "prefill" and cfg.kv_pacing_gbps is not None:
        @app.post("/v1/kv/link")
        async def kv_link(request: Request) -> JSONResponse:
            """The paced transport's rate, set live (benchmarks; only where pacing was asked for)."""
            from .serving import read_json

            body = await read_json(request, 4096)
            g = body.get("pacing_gbps") if isinstance(body, dict) else None
            if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g < 1e5:
                raise APIError(400, f"'pacing_gbps' must be a number in (0, 1e5), got {g!r}", "pacing_gbps")
            serving.pd.transport.set_rate(g * 1e9 / 8)
            return JSONResponse({"pacing_gbps": g})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": name, "object": "model", "created": started, "owned_by": "kvtide", "root": llm.config.model,
                "parent": None, "max_model_len": serving.max_seq_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        if not llm.loop.running:
            return JSONResponse(error_body(503, "the engine loop is not running"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(serving.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _log_stats(serving: Serving, interval: float) -> None:
    if interval <= 0:
        return
    while True:
        await asyncio.sleep(interval)
        line = serving.metrics.log_line()
        if line is not None:
            log.info("%s", line)
