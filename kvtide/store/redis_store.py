"""Redis tier: the shared store several engines can reach. Values are the same records as other tiers.

Every Redis or socket error becomes StoreUnavailable (counted), so a dead server means "recompute", never
a stuck or crashed request; short socket timeouts keep that decision fast.
"""

from __future__ import annotations

from typing import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtide.store.base import ChunkMissing, KVStore, StoreUnavailable

_ERRORS = (redis.exceptions.RedisError, OSError)


class RedisStore(KVStore):
    """Entries as Redis strings under ``prefix``; optional TTL lets Redis age out cold prefixes."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        prefix: str = "kvtide:",
        ttl_seconds: int | None = None,
        socket_timeout: float = 1.0,
        retries: int = 1,
        client: "redis.Redis | None" = None,
        drop_bad: bool = True,
    ) -> None:
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0 or None, got {ttl_seconds!r}")
        if socket_timeout <= 0:
            raise ValueError(f"socket_timeout must be > 0, got {socket_timeout!r}")
        super().__init__(drop_bad)
        self.prefix = prefix
        self.ttl_seconds = ttl_seconds
        # One quick retry rides out a dropped connection; more (redis-py's default backs off for seconds)
        # would stall the request that recompute could serve now.
        self.client = client or redis.Redis(
            host=host,
            port=port,
            db=db,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), retries),
        )

    def _k(self, name: str) -> str:
        return self.prefix + name

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except _ERRORS:
            return False

    def _write(self, name: str, blob: bytes) -> None:
        try:
            self.client.set(self._k(name), blob, ex=self.ttl_seconds)
        except _ERRORS as e:
            raise StoreUnavailable(f"{name}: redis write failed: {e}", name) from e

    def _read(self, name: str) -> bytes:
        try:
            blob = self.client.get(self._k(name))
        except _ERRORS as e:
            raise StoreUnavailable(f"{name}: redis read failed: {e}", name) from e
        if blob is None:
            raise ChunkMissing(f"{name}: not in redis", name)
        return bytes(blob)

    def _read_many(self, names: Sequence[str]) -> list[bytes | None]:
        if not names:
            return []
        try:
            vals = self.client.mget([self._k(n) for n in names])
        except _ERRORS as e:
            raise StoreUnavailable(f"redis mget failed: {e}") from e
        return [None if v is None else bytes(v) for v in vals]

    def _delete(self, name: str) -> None:
        try:
            self.client.delete(self._k(name))
        except _ERRORS as e:
            raise StoreUnavailable(f"{name}: redis delete failed: {e}", name) from e

    def _exists(self, name: str) -> bool:
        try:
            return bool(self.client.exists(self._k(name)))
        except _ERRORS as e:
            raise StoreUnavailable(f"{name}: redis exists failed: {e}", name) from e

    def close(self) -> None:
        try:
            self.client.close()
        except _ERRORS:
            pass
