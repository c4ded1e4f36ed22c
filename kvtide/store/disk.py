"""Local-disk tier: one file per (chunk, layer) entry, named ``<key hex>.<layer>.kvt``; persists across runs.

Writes go to a temporary file in the same directory and are renamed over the target (os.replace is atomic on
POSIX), so a crash leaves the old entry or the new one, never half of one; the record's length and checksum still
catch a torn or edited file. Files fan out over 256 subdirectories by key prefix.

Bounded reads: a file is opened and ``fstat``-ed first; one larger than the caller's ``max_bytes`` is refused
(``ChunkOversize``) without reading a byte of it. An entry whose own read fails (an I/O error, a directory in its
place) is ``EntryUnreadable``; only a store directory that is gone or unreadable is ``StoreUnavailable``.

Capacity (``capacity_bytes``; spec ``disk:PATH?capacity=10G``): LRU eviction over entry files, by access time
tracked in memory (reads and writes), seeded from the files' mtimes at open. The bound covers the files this
process knows: those found at open, its own writes and its hits; entries another process adds to a shared
directory count once this one reads them. A full disk (ENOSPC/EDQUOT) on a write removes the partial file, evicts
least recently used entries (at least the entry's size) and retries once; still full, the write fails as
``StoreFull`` (a counted failed write; the tier stays up).

Cleaning at open: temporary files (``.tmp-*``, a writer killed mid-write) are removed, and so are chunks whose
layer set cannot be whole. A chunk is usable only with all of its layers: with the layer count known
(``num_layers=``, or ``prune_incomplete(L)`` later: the engine's restorer calls it) every layer 0..L-1 must be
there; without it, the layers must be 0..k with no gap (writers store layers in order, so a gap means lost files,
while 0..k may be a chunk still being written). Files younger than ``grace_s`` are left alone either way: they may
belong to a writer of another process sharing the directory.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

from kvtide.log import get_logger, warn_limited
from kvtide.store.base import (
    ChunkCorrupt,
    ChunkMissing,
    ChunkOversize,
    EntryUnreadable,
    KVStore,
    StoreFull,
    StoreUnavailable,
)

SUFFIX = ".kvt"
TMP_PREFIX = ".tmp-"
_ENTRY = re.compile(r"^([0-9a-f]+)\.(\d+)$")
_FULL = (errno.ENOSPC, errno.EDQUOT)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

log = get_logger("store")


def parse_size(text: str) -> int:
    """Bytes of ``10G``, ``512M``, ``64K``, ``1T`` (binary units; an optional trailing B or iB) or a plain integer."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(f"size {text!r} is not a number with an optional unit K, M, G or T (e.g. 10G)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return n


def parse_disk_spec(rest: str) -> tuple[str, int | None]:
    """(path, capacity bytes or None) of the part of a ``disk:PATH[?capacity=SIZE]`` spec after ``disk:``."""
    path, sep, query = rest.partition("?")
    if not path:
        raise ValueError("store 'disk:PATH' needs a path")
    capacity = None
    if sep:
        for part in query.split("&"):
            k, eq, v = part.partition("=")
            if k != "capacity" or not eq:
                raise ValueError(f"store 'disk:{rest}': unknown option {part!r} (known: capacity=SIZE, e.g. "
                                 f"disk:{path}?capacity=10G)")
            try:
                capacity = parse_size(v)
            except ValueError as e:
                raise ValueError(f"store 'disk:{rest}': capacity: {e}") from None
    return path, capacity


def _write_all(f: BinaryIO, blob: bytes) -> None:
    """Write the whole record (a seam: tests put a full disk here)."""
    f.write(blob)


class DiskStore(KVStore):
    """Entries under ``root``; ``fsync=True`` also survives power loss at the cost of write latency.

    ``capacity_bytes``: LRU bound over entry bytes (None: none). ``num_layers``: a chunk needs all of them (cleaning
    at open). ``grace_s``: temporary files and chunks touched more recently are not cleaned. ``records``:
    ``secret``, ``store_token_ids`` (``KVStore.configure_records``)."""

    def __init__(self, root: str | os.PathLike[str], fsync: bool = False, drop_bad: bool = True,
                 capacity_bytes: int | None = None, num_layers: int | None = None, grace_s: float = 60.0,
                 **records: Any) -> None:
        if capacity_bytes is not None and (not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool)
                                           or capacity_bytes <= 0):
            raise ValueError(f"capacity_bytes must be None or an int > 0, got {capacity_bytes!r}")
        if num_layers is not None and (not isinstance(num_layers, int) or num_layers <= 0):
            raise ValueError(f"num_layers must be None or an int > 0, got {num_layers!r}")
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s!r}")
        super().__init__(drop_bad, **records)
        self.root = Path(root)
        self.fsync = fsync
        self.capacity_bytes = capacity_bytes
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # entry name -> bytes, least recently used first
        self._used = 0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot create store directory {self.root}: {e}") from e
        self._open(num_layers)

    def describe(self) -> str:
        return f"disk tier {self.root}"

    def path(self, name: str) -> Path:
        return self.root / name[:2] / (name + SUFFIX)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._files)

    # ---- opening: index, sweep, prune
    def _scan(self) -> tuple[list[tuple[float, str, int]], dict[str, dict[int, float]]]:
        """Entry files as (mtime, name, size), and per chunk its layers' mtimes; stale temporary files removed."""
        now = time.time()
        files: list[tuple[float, str, int]] = []
        chunks: dict[str, dict[int, float]] = {}
        swept = 0
        try:
            subdirs = [d for d in os.scandir(self.root) if d.is_dir(follow_symlinks=False)]
        except OSError as e:
            raise StoreUnavailable(f"cannot list store directory {self.root}: {e}") from e
        for d in subdirs:
            try:
                entries = list(os.scandir(d.path))
            except OSError:
                continue
            for f in entries:
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                if f.name.startswith(TMP_PREFIX):
                    if now - st.st_mtime >= self.grace_s and _unlink(f.path):
                        swept += 1
                    continue
                if not f.name.endswith(SUFFIX) or not stat.S_ISREG(st.st_mode):
                    continue
                name = f.name[:-len(SUFFIX)]
                m = _ENTRY.match(name)
                if m is None:
                    continue
                files.append((st.st_mtime, name, st.st_size))
                chunks.setdefault(m.group(1), {})[int(m.group(2))] = st.st_mtime
        if swept:
            self.stats.add(swept=swept)
            log.info("%s: removed %d temporary files left by interrupted writes", self.describe(), swept)
        return files, chunks

    def _open(self, num_layers: int | None) -> None:
        files, chunks = self._scan()
        files.sort()
        with self._lock:
            for _, name, size in files:
                self._files[name] = size
                self._used += size
        self._prune(chunks, num_layers)
        if self.capacity_bytes is not None:
            with self._lock:
                victims = self._victims(0, keep=None)
            self._evict(victims)

    def prune_incomplete(self, num_layers: int) -> int:
        """Remove chunks that do not hold every layer 0..num_layers-1 (older than ``grace_s``); returns the files
        removed."""
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"num_layers must be an int > 0, got {num_layers!r}")
        return self._prune(self._scan()[1], num_layers)

    def _prune(self, chunks: dict[str, dict[int, float]], num_layers: int | None) -> int:
        now = time.time()
        removed = 0
        for hexkey, layers in chunks.items():
            want = range(num_layers) if num_layers is not None else range(max(layers) + 1)
            if len(layers) == len(want) and all(i in layers for i in want):
                continue
            if now - max(layers.values()) < self.grace_s:
                continue
            for i in layers:
                name = f"{hexkey}.{i}"
                if _unlink(self.path(name)):
                    removed += 1
                self._forget(name)
        if removed:
            self.stats.add(swept=removed)
            log.info("%s: removed %d entry files of chunks missing layers", self.describe(), removed)
        return removed

    # ---- index
    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._files.pop(name, None)
            if size is not None:
                self._used -= size

    def _touch(self, name: str, size: int) -> None:
        with self._lock:
            old = self._files.pop(name, None)
            self._used += size - (old or 0)
            self._files[name] = size

    def _victims(self, need: int, keep: str | None) -> list[str]:
        """Under the lock: least recently used names to drop so ``need`` more bytes fit the capacity."""
        if self.capacity_bytes is None:
            return []
        replaced = self._files.get(keep, 0) if keep is not None else 0  # an entry rewritten frees its old bytes
        return self._oldest(self._used - replaced + need - self.capacity_bytes, keep)

    def _oldest(self, nbytes: int, keep: str | None) -> list[str]:
        """Under the lock: least recently used names (never ``keep``) holding at least ``nbytes``."""
        out, freed = [], 0
        for name, size in self._files.items():
            if freed >= nbytes:
                break
            if name != keep:
                out.append(name)
                freed += size
        return out

    def _evict(self, names: list[str]) -> int:
        freed = 0
        for name in names:
            with self._lock:
                size = self._files.pop(name, None)
                if size is None:
                    continue
                self._used -= size
            _unlink(self.path(name))
            freed += size
        if names:
            self.stats.add(evictions=len(names))
        return freed

    # ---- the tier
    def _write(self, name: str, blob: bytes) -> bool:
        size = len(blob)
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            self.stats.add(rejected=1)
            return False
        with self._lock:
            victims = self._victims(size, keep=name)
        self._evict(victims)
        try:
            self._write_file(name, blob)
        except OSError as e:
            if e.errno not in _FULL:
                raise StoreUnavailable(f"{name}: write failed: {e}", name) from e
            with self._lock:
                victims = self._oldest(size, keep=name)
            if not victims:
                raise StoreFull(f"{name}: disk full and nothing to evict: {e}", name) from e
            warn_limited(log, "store.disk.full", "%s: disk full; evicted %d entries to write %s", self.describe(),
                         len(victims), name)
            self._evict(victims)
            try:
                self._write_file(name, blob)
            except OSError as e2:
                if e2.errno in _FULL:
                    raise StoreFull(f"{name}: disk full after evicting {len(victims)} entries: {e2}", name) from e2
                raise StoreUnavailable(f"{name}: write failed: {e2}", name) from e2
        self._touch(name, size)
        return True

    def _write_file(self, name: str, blob: bytes) -> None:
        """Temporary file, then rename over the target; the temporary file is removed on any failure."""
        target = self.path(name)
        target.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                _write_all(f, blob)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            _unlink(tmp)
            raise

    def _read(self, name: str, max_bytes: int | None = None) -> bytes:
        try:
            f = open(self.path(name), "rb")
        except FileNotFoundError:
            if not self.root.is_dir():
                raise StoreUnavailable(f"{name}: store directory {self.root} is gone", name) from None
            raise ChunkMissing(f"{name}: no file", name) from None
        except OSError as e:
            raise self._read_error(name, e) from e
        with f:
            try:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise EntryUnreadable(f"{name}: not a regular file", name)
                if max_bytes is not None and st.st_size > max_bytes:
                    raise ChunkOversize(f"{name}: file of {st.st_size} bytes, more than the {max_bytes} a record of "
                                        "this shape takes; not read", name)
                data = f.read(st.st_size + 1)
            except OSError as e:
                raise self._read_error(name, e) from e
        if len(data) != st.st_size:
            raise ChunkCorrupt(f"{name}: file changed size while read ({st.st_size} -> {len(data)}+ bytes)", name)
        self._touch(name, len(data))
        return data

    def _read_error(self, name: str, e: OSError) -> StoreUnavailable | EntryUnreadable:
        """Tier-level if the store directory itself is gone or unreadable, else this entry's own failure."""
        try:
            ok = self.root.is_dir() and os.access(self.root, os.R_OK | os.X_OK)
        except OSError:
            ok = False
        if not ok:
            return StoreUnavailable(f"{name}: store directory {self.root} unreadable: {e}", name)
        return EntryUnreadable(f"{name}: read failed: {e}", name)

    def _delete(self, name: str) -> None:
        try:
            os.unlink(self.path(name))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StoreUnavailable(f"{name}: delete failed: {e}", name) from e
        finally:
            self._forget(name)

    def _exists(self, name: str) -> bool:
        try:
            return self.path(name).is_file()
        except OSError as e:
            raise StoreUnavailable(f"{name}: stat failed: {e}", name) from e

    def total_bytes(self) -> int:
        """Bytes held by entry files (walks the tree: for reports, not hot paths)."""
        return sum(p.stat().st_size for p in self.root.glob("*/*" + SUFFIX))


def _unlink(path: str | os.PathLike[str]) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
