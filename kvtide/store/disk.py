"""Local-disk tier: one file per (chunk, layer) entry; persists across runs.

Writes go to a temporary file in the same directory and are renamed over the target (os.replace is atomic
on POSIX), so a crash leaves the old entry or the new one, never half of one; the record's length and
checksum still catch a torn or edited file. Files fan out over 256 subdirectories by key prefix.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from kvtide.store.base import ChunkMissing, KVStore, StoreUnavailable

SUFFIX = ".kvt"


class DiskStore(KVStore):
    """Entries under ``root``; ``fsync=True`` also survives power loss at the cost of write latency."""

    def __init__(self, root: str | os.PathLike[str], fsync: bool = False, drop_bad: bool = True) -> None:
        super().__init__(drop_bad)
        self.root = Path(root)
        self.fsync = fsync
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot create store directory {self.root}: {e}") from e

    def path(self, name: str) -> Path:
        return self.root / name[:2] / (name + SUFFIX)

    def _write(self, name: str, blob: bytes) -> None:
        target = self.path(name)
        try:
            target.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as e:
            raise StoreUnavailable(f"{name}: write failed: {e}", name) from e

    def _read(self, name: str) -> bytes:
        try:
            with open(self.path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise ChunkMissing(f"{name}: no file", name) from None
        except OSError as e:
            if e.errno == errno.ENOENT:
                raise ChunkMissing(f"{name}: no file", name) from None
            raise StoreUnavailable(f"{name}: read failed: {e}", name) from e

    def _delete(self, name: str) -> None:
        try:
            os.unlink(self.path(name))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StoreUnavailable(f"{name}: delete failed: {e}", name) from e

    def _exists(self, name: str) -> bool:
        try:
            return self.path(name).is_file()
        except OSError as e:
            raise StoreUnavailable(f"{name}: stat failed: {e}", name) from e

    def total_bytes(self) -> int:
        """Bytes held by entry files (walks the tree: for reports, not hot paths)."""
        return sum(p.stat().st_size for p in self.root.glob("*/*" + SUFFIX))
