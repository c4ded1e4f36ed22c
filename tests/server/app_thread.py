"""A kvtide serve app run by uvicorn in a thread on 127.0.0.1, for tests that drive it with real clients."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def app_thread(app: Any, port: int, **config: Any) -> Iterator[None]:
    """Serve ``app`` on ``port`` until the block ends (``config``: more ``uvicorn.Config`` settings)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(30)
