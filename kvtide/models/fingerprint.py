"""Fingerprints of what a model computes with: its weights' content and its config, for keys of stored KV.

A KV chunk is only reusable by an engine with the same weights, so store keys (``kvtide.store.keys.KeySpace``)
include a hash of the weights' *content*, never only their path: a file changed behind the same path gets a new
fingerprint. Bundled models hash the file(s) they ship and the converted weights loaded; a GGUF file, or a
safetensors directory's weight files, are hashed where they lie. Hashing runs once per file version: the digest is
cached under the kvtide cache directory (``KVTIDE_CACHE_DIR``, beside the converted weights) keyed by the file's
resolved path, size, mtime, ctime and inode, so any rewrite hashes again. ``random:<preset>`` models are named by
preset and seed (their weights are a function of both). A model built some other way is fingerprinted from its
parameters' bytes (``tensor_fingerprint``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable

import torch

from .registry import BUNDLED, cache_root

FINGERPRINT_VERSION = 1
_CHUNK = 1 << 22


def _stat_key(path: Path) -> dict[str, int | str]:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino}


def _cache_file(path: Path) -> Path:
    return cache_root() / "fingerprints" / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")


def file_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 of the file's content (hex), computed once per version of the file and cached."""
    p = Path(path).resolve()
    key = _stat_key(p)
    cache = _cache_file(p)
    try:
        saved = json.loads(cache.read_text())
        if saved.get("version") == FINGERPRINT_VERSION and saved.get("stat") == key:
            return str(saved["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    digest = h.hexdigest()
    if _stat_key(p) == key:  # not rewritten while hashed: worth remembering
        _save(cache, {"version": FINGERPRINT_VERSION, "stat": key, "sha256": digest})
    return digest


def _save(cache: Path, record: dict) -> None:
    """Atomic write; a cache directory that cannot be written only costs the next load a hash again."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=cache.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, cache)
    except OSError:
        pass


def _combine(kind: str, parts: Iterable[tuple[str, str]]) -> str:
    h = hashlib.sha256(f"kvtide-weights/v{FINGERPRINT_VERSION}/{kind}".encode())
    for name, digest in parts:
        h.update(len(name).to_bytes(4, "little") + name.encode() + bytes.fromhex(digest))
    return h.hexdigest()[:32]


def weights_fingerprint(model: str, directory: str | os.PathLike[str] | None = None) -> str:
    """The fingerprint of ``model`` (a bundled name, ``random:<preset>``, a .gguf file or a safetensors
    directory; ``directory``: where it resolved, for directories)."""
    if model.startswith("random:"):
        return _combine("random", [(model, hashlib.sha256(b"seed=0").hexdigest())])
    if model in BUNDLED:  # the shipped file(s), and the converted weights actually loaded (a stale conversion
        parts = [(p.name, file_digest(p)) for p in BUNDLED[model].gguf_parts()]  # is then told apart too)
        loaded = _safetensors(Path(directory)) if directory is not None else []
        return _combine(f"bundled:{model}", parts + loaded)
    p = Path(model).expanduser()
    if p.is_file():
        return _combine("file", [(p.name, file_digest(p))])
    files = _safetensors(Path(directory) if directory is not None else p)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory or p} to fingerprint")
    return _combine("safetensors", files)


def _safetensors(directory: Path) -> list[tuple[str, str]]:
    return [(f.name, file_digest(f)) for f in sorted(directory.glob("*.safetensors"))]


def tensor_fingerprint(module: torch.nn.Module) -> str:
    """Fingerprint of a module's parameters and buffers by content (names, dtypes, shapes, bytes): for models not
    loaded from a file. Copies each tensor to the host once."""
    h = hashlib.sha256(f"kvtide-weights/v{FINGERPRINT_VERSION}/tensors".encode())
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:32]


def config_fingerprint(args: object) -> str:
    """Hash of a model's arguments (a dataclass such as ``ModelArgs``), every field included."""
    fields = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args)
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:32]


def model_fingerprint(module: torch.nn.Module) -> str:
    """The weights fingerprint ``load_model`` recorded on the model, else one from its parameters."""
    fp = getattr(module, "weights_fingerprint", None)
    return fp if fp else tensor_fingerprint(module)
