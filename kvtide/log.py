"""The `kvtide` logger and rate-limited warnings.

Everything logs under ``logging.getLogger("kvtide")`` (children: ``kvtide.store``, ``kvtide.engine``, ...). The
library adds no handler of its own beyond a ``NullHandler``; the CLI configures one (``--log-level``).
``warn_limited`` keeps a repeated failure (a dead tier, a stream of corrupt entries) to one line per key and
interval, with the count of what it held back.
"""
from __future__ import annotations

import logging
import threading
import time

logging.getLogger("kvtide").addHandler(logging.NullHandler())

_lock = threading.Lock()
_last: dict[str, tuple[float, int]] = {}  # key -> (time of the last line, lines held back since)
_MAX_KEYS = 4096


def get_logger(name: str = "") -> logging.Logger:
    """``kvtide`` or ``kvtide.<name>``."""
    return logging.getLogger(f"kvtide.{name}" if name else "kvtide")


def warn_limited(logger: logging.Logger, key: str, msg: str, *args: object, interval: float = 10.0,
                 level: int = logging.WARNING) -> bool:
    """Log ``msg % args`` at most once per ``interval`` seconds for ``key``; returns whether it was logged.

    A line logged after others were held back says how many (``(+N similar)``)."""
    now = time.monotonic()
    with _lock:
        last, held = _last.get(key, (-float("inf"), 0))
        if now - last < interval:
            _last[key] = (last, held + 1)
            return False
        if len(_last) >= _MAX_KEYS:
            _last.clear()
        _last[key] = (now, 0)
    if held:
        msg = f"{msg} (+{held} similar in the last {interval:g} s)"
    logger.log(level, msg, *args)
    return True


def reset_limits() -> None:
    """Forget every key's last line (tests)."""
    with _lock:
        _last.clear()
