"""`kvtide serve`: an OpenAI-compatible HTTP server over one engine loop (FastAPI + uvicorn), with Prometheus metrics.

config.py ServerConfig (the ``server:`` section) · protocol.py request checks and the error format · responses.py
response bodies and stream chunks · generation.py engine requests of one HTTP request, admission · serving.py the
completion and chat handlers · streaming.py server-sent events · metrics.py Prometheus metrics · app.py the routes ·
serve.py the uvicorn runner and its signals. Only the engine's public API is used (LLM, EngineLoop, stats).
"""
from ..extras import require_extra
from .config import ServerConfig

require_extra("serve", "kvtide serve")  # FastAPI, uvicorn, prometheus-client: a missing one names the pip command

__all__ = ["ServerConfig"]
