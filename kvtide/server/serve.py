"""Run `kvtide serve`: build the engine, then serve the app with uvicorn until SIGTERM or SIGINT.

The first SIGTERM / SIGINT stops accepting connections and lets the requests in flight finish for at most
``ServerConfig.shutdown_timeout_s``; what is still running then is cut (its engine requests aborted), the engine loop
stops and the process exits 0. A second signal cuts the drain short.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from ..config_load import Settings
from ..log import get_logger
from .app import build_app
from .config import ServerConfig

log = get_logger("server")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with kvtide's signal handling: drain on the first signal, stop draining on the second,
    and exit normally afterwards (uvicorn re-raises a caught signal once it has stopped)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            log.warning("%s again: in-flight requests are cut now", name)
            self.force_exit = True
            return
        log.warning("%s: no new connections; in-flight requests may finish for %.0f s", name,
                    self.config.timeout_graceful_shutdown or 0.0)
        self.should_exit = True


def serve(settings: Settings, log_level: str = "info") -> int:
    """Load the engine of ``settings.engine`` and serve it as configured by ``settings.server`` (a
    `ServerConfig`) until a signal ends it; returns the exit status."""
    from ..engine.llm import LLM

    cfg = settings.server
    if not isinstance(cfg, ServerConfig):
        raise TypeError(f"settings.server must be a ServerConfig, got {type(cfg).__name__}")
    llm = LLM(config=settings.engine, progress=False)
    app = build_app(llm, cfg)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=cfg.shutdown_timeout_s, access_log=log_level == "debug")
    server = DrainingServer(config)
    server.run()
    return 0 if server.started else 1
