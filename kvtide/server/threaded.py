"""An app served by uvicorn in a thread on 127.0.0.1: the demo's local instances and the tests' live servers."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def app_thread(app: Any, port: int, **config: Any) -> Iterator[None]:
    """Serve ``app`` on ``port`` until the block ends (``config``: more ``uvicorn.Config`` settings)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, name="kvtide-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the app on port {port} did not start")
        time.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(30)
