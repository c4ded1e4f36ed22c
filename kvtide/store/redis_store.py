"""Redis tier: the shared store several engines can reach. Values are the same records as other tiers.

Spec (``RestoreConfig.store``)::

    redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?ttl=SECONDS&prefix=PREFIX&OPTION=VALUE...]
    rediss://...                                  the same over TLS

The URL is parsed by redis-py (``ConnectionPool.from_url``): user and password percent-decoded, the database from
the path or ``?db=``, any of redis-py's connection options as query parameters (e.g. ``ssl_cert_reqs=none``,
``ssl_ca_certs=PATH`` for TLS). kvtide's own parameters, taken out before: ``ttl`` (seconds > 0: every entry
expires, so Redis ages out cold prefixes; default: never) and ``prefix`` (of every key, default ``kvtide:``;
engines sharing one database with different prefixes never see each other's entries). A parameter that is neither
is an error naming it.

Timeouts: connect, read and write each bounded by ``timeout_s`` (``RestoreConfig.store_timeout_s``). A dropped
connection is retried once (a reconnect is quick); a timeout never is (a stalled server would cost twice).
Every Redis or socket error becomes ``StoreUnavailable`` (counted), so a dead server means "recompute", never a
stuck or crashed request; the tier's circuit breaker (``kvtide.store.breaker``, set up by ``open_tier``) then skips
it for a while. ``check()`` pings the server; ``open_tier`` logs one warning when it does not answer at start.

Bounded reads: with ``max_bytes`` (the expected record size) each entry is read as ``EXISTS``, ``STRLEN`` and
``GETRANGE 0 max_bytes`` in one pipelined round trip for any number of names, so at most ``max_bytes + 1`` bytes of
an entry ever cross the link and an oversized entry fails alone (``ChunkOversize``). An entry holding another Redis
type (WRONGTYPE) fails alone (``EntryUnreadable``); any other error fails the whole read (a tier failure).
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from kvtide.extras import require

redis = require("redis", "redis", "the Redis tier")
from redis.backoff import NoBackoff
from redis.connection import URL_QUERY_ARGUMENT_PARSERS, Connection, ConnectionPool, SSLConnection
from redis.retry import Retry

from kvtide.store.base import ChunkMissing, ChunkOversize, EntryUnreadable, KVStore, StoreError, StoreUnavailable

_ERRORS = (redis.exceptions.RedisError, OSError)
SCHEMES = ("redis", "rediss")
OWN_PARAMS = ("ttl", "prefix")
DEFAULT_PREFIX = "kvtide:"


def _connection_options(cls: type) -> set[str]:
    """Keyword arguments a redis-py connection class (and the classes it extends) takes."""
    names: set[str] = set()
    for c in cls.__mro__:
        init = c.__dict__.get("__init__")
        if init is not None:
            names |= {p.name for p in inspect.signature(init).parameters.values()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
    return names


_OPTIONS = {scheme: _connection_options(cls) | set(URL_QUERY_ARGUMENT_PARSERS)
            for scheme, cls in (("redis", Connection), ("rediss", SSLConnection))}


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs)."""
    try:
        u = urlsplit(url)
        if u.password is None:
            return url
        user = quote(u.username or "", safe="")
        host = u.hostname or ""
        host = f"[{host}]" if ":" in host else host
        netloc = f"{user}:***@{host}" + (f":{u.port}" if u.port else "")
        return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))
    except ValueError:
        return url.split("://", 1)[0] + "://...@" + url.rsplit("@", 1)[1] if "@" in url else url


def parse_spec(url: str) -> tuple[str, int | None, str]:
    """(URL for redis-py, ttl seconds or None, key prefix) of a store spec; ValueError naming what is wrong.
    No connection is made."""
    shown = redact(url)
    try:
        u = urlsplit(url)
        _ = u.port  # a bad port raises here
    except ValueError as e:
        raise ValueError(f"store {shown!r}: bad redis URL ({e})") from None
    if u.scheme not in SCHEMES:
        raise ValueError(f"store {shown!r}: scheme must be redis:// or rediss://, got {u.scheme!r}")
    if not u.hostname:
        raise ValueError(f"store {shown!r}: redis URL needs a host")
    db = u.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"store {shown!r}: redis database (the URL path) must be a number >= 0, got {db!r}")
    ttl: int | None = None
    prefix = DEFAULT_PREFIX
    rest: list[tuple[str, str]] = []
    for name, value in parse_qsl(u.query, keep_blank_values=True):
        if name == "ttl":
            if not value.isdigit() or int(value) <= 0:
                raise ValueError(f"store {shown!r}: ttl must be a whole number of seconds > 0, got {value!r}")
            ttl = int(value)
        elif name == "prefix":
            prefix = value
        elif name not in _OPTIONS[u.scheme]:
            raise ValueError(f"store {shown!r}: unknown query parameter {name!r}: kvtide takes {OWN_PARAMS}, "
                             f"anything else must be a redis-py connection option")
        else:
            rest.append((name, value))
    clean = urlunsplit((u.scheme, u.netloc, u.path, urlencode(rest), ""))
    try:
        ConnectionPool.from_url(clean)  # redis-py's own checks of the URL (values of its options); no connection
    except (ValueError, TypeError) as e:
        raise ValueError(f"store {shown!r}: {e}") from None
    return clean, ttl, prefix


def _retry(retries: int) -> Retry:
    # Retry a dropped connection (refused or reset: quick), never a timeout: a stalled server would cost
    # timeout x (retries + 1) per operation, and recompute could serve the request now.
    return Retry(NoBackoff(), retries, supported_errors=(redis.exceptions.ConnectionError,))


class RedisStore(KVStore):
    """Entries as Redis strings under ``prefix``; optional TTL lets Redis age out cold prefixes."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        prefix: str = DEFAULT_PREFIX,
        ttl_seconds: int | None = None,
        socket_timeout: float = 0.5,
        retries: int = 1,
        client: "redis.Redis | None" = None,
        drop_bad: bool = True,
        url: str | None = None,
        **records: Any,
    ) -> None:
        """``url``: a redis-py URL (credentials, TLS, db, options) used instead of ``host``/``port``/``db``;
        ``open_tier`` passes the one ``parse_spec`` made of the store spec. ``records``: ``secret``,
        ``store_token_ids`` (``KVStore.configure_records``)."""
        if ttl_seconds is not None and (not isinstance(ttl_seconds, int) or ttl_seconds <= 0):
            raise ValueError(f"ttl_seconds must be an int > 0 or None, got {ttl_seconds!r}")
        if not socket_timeout > 0:
            raise ValueError(f"socket_timeout must be > 0 seconds, got {socket_timeout!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        self.where = redact(url) if url is not None else f"redis://{host}:{port}/{db}"
        self.prefix = prefix
        self.ttl_seconds = ttl_seconds
        super().__init__(drop_bad, **records)
        opts: dict[str, Any] = dict(socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
                                    retry=_retry(retries))
        if client is not None:
            self.client = client
        elif url is not None:
            self.client = redis.Redis.from_url(url, **opts)
        else:
            self.client = redis.Redis(host=host, port=port, db=db, **opts)

    @classmethod
    def from_spec(cls, spec: str, timeout_s: float = 0.5, drop_bad: bool = True, **kwargs: Any) -> "RedisStore":
        """The tier a ``redis://`` / ``rediss://`` store spec names (see the module docstring)."""
        url, ttl, prefix = parse_spec(spec)
        return cls(prefix=prefix, ttl_seconds=ttl, socket_timeout=timeout_s, drop_bad=drop_bad, url=url, **kwargs)

    def _k(self, name: str) -> str:
        return self.prefix + name

    def describe(self) -> str:
        return f"redis tier {self.where} (prefix {self.prefix!r})"

    def check(self) -> str | None:
        """None when the server answers a PING, else why not."""
        try:
            self.client.ping()
            return None
        except _ERRORS as e:
            return f"{type(e).__name__}: {e}"

    def ping(self) -> bool:
        return self.check() is None

    def _write(self, name: str, blob: bytes) -> None:
        try:
            self.client.set(self._k(name), blob, ex=self.ttl_seconds)
        except _ERRORS as e:
            raise StoreUnavailable(f"{name}: redis write failed: {type(e).__name__}: {e}", name) from e

    def _read(self, name: str, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            got = self._read_bounded([name], max_bytes)[0]
            if isinstance(got, StoreError):
                raise got
            if got is None:
                raise ChunkMissing(f"{name}: not in redis", name)
            return got
        try:
            blob = self.client.get(self._k(name))
        except _ERRORS as e:
            raise StoreUnavailable(f"{name}: redis read failed: {type(e).__name__}: {e}", name) from e
        if blob is None:
            raise ChunkMissing(f"{name}: not in redis", name)
        return bytes(blob)

    def _read_many(self, names: Sequence[str], max_bytes: int | None = None) -> list[bytes | None | StoreError]:
        if not names:
            return []
        if max_bytes is not None:
            return self._read_bounded(names, max_bytes)
        try:
            vals = self.client.mget([self._k(n) for n in names])
        except _ERRORS as e:
            raise StoreUnavailable(f"redis mget failed: {type(e).__name__}: {e}") from e
        return [None if v is None else bytes(v) for v in vals]

    def _read_bounded(self, names: Sequence[str], max_bytes: int) -> list[bytes | None | StoreError]:
        """Each entry, at most ``max_bytes`` of it, in one round trip; per-entry problems as that entry's error."""
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0 or None, got {max_bytes!r}")
        try:
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                k = self._k(n)
                pipe.exists(k)
                pipe.strlen(k)
                pipe.getrange(k, 0, max_bytes)  # inclusive end: max_bytes + 1 bytes of an oversized entry at most
            replies = pipe.execute(raise_on_error=False)
        except _ERRORS as e:
            raise StoreUnavailable(f"redis read of {len(names)} entries failed: {type(e).__name__}: {e}") from e
        out: list[bytes | None | StoreError] = []
        for i, n in enumerate(names):
            exists, size, blob = replies[3 * i: 3 * i + 3]
            err = next((r for r in (exists, size, blob) if isinstance(r, Exception)), None)
            if err is not None:
                if type(err) is redis.exceptions.ResponseError and str(err).startswith("WRONGTYPE"):
                    out.append(EntryUnreadable(f"{n}: redis key holds another type ({err})", n))
                    continue
                raise StoreUnavailable(f"{n}: redis read failed: {type(err).__name__}: {err}", n) from err
            if not exists:
                out.append(None)
            elif size > max_bytes or len(blob) > max_bytes:
                out.append(ChunkOversize(f"{n}: entry is {max(size, len(blob))} bytes, expected at most "
                                         f"{max_bytes}; not read", n))
            else:
                out.append(bytes(blob))
        return out

    def _delete(self, name: str) -> None:
        try:
            self.client.delete(self._k(name))
        except _ERRORS as e:
            raise StoreUnavailable(f"{name}: redis delete failed: {type(e).__name__}: {e}", name) from e

    def _exists(self, name: str) -> bool:
        try:
            return bool(self.client.exists(self._k(name)))
        except _ERRORS as e:
            raise StoreUnavailable(f"{name}: redis exists failed: {type(e).__name__}: {e}", name) from e

    def close(self) -> None:
        try:
            self.client.close()
        except _ERRORS:
            pass
