"""A real redis-server for the Redis tier tests: started per session on a free port, in a temp dir."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.store.redis_procs import REDIS_BIN, Server, free_port, need_redis  # noqa: F401 - re-exported

# one implementation of a test's own redis-server (extra arguments, pause/resume), named here as the fixtures' type
RedisServer = Server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    need_redis()
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    yield srv
    srv.stop()


@pytest.fixture
def fresh_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server a test may kill."""
    need_redis()
    srv = RedisServer(tmp_path)
    yield srv
    srv.stop()
