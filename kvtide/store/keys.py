"""Prefix-chunk keys: a chained hash, so a key names a chunk *and everything before it*.

key_0 = H(root || tokens_0), key_c = H(key_{c-1} || tokens_c). The root binds the KV to everything that made it:
the model id and shapes, a fingerprint of the weights' *content* (``kvtide.models.fingerprint``; never only a path),
a hash of the model config, the compute dtype, the KV dtype, the chunk size, an optional namespace (a tenant), and
a salt derived from the store secret (``RecordAuth.key_salt``: without the secret, entry names cannot be computed).
Two prompts share key_c exactly when they share the first (c+1)*chunk tokens under all of these; the stored record
also keeps the chunk's token ids (or their hash), checked on every hit, so a hash collision or a mixed-up entry is
caught instead of feeding wrong KV to attention.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

KEY_VERSION = 2
DIGEST_BYTES = 16


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"kvtide-key-v1")
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))  # length-prefixed: no ambiguity between parts
        h.update(p)
    return h.digest()


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Canonical encoding of token ids (uint32 little endian); rejects ids outside [0, 2^32)."""
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4").tobytes()


@dataclass(frozen=True)
class KeySpace:
    """What besides the tokens decides whether stored KV is reusable.

    ``dtype``: the KV dtype. ``weights``: a fingerprint of the weights' content; ``model_config``: a hash of the
    model's arguments; ``compute_dtype``: the dtype the KV was computed in; ``namespace``: entries of one namespace
    are never found from another (None: the shared one); ``salt``: secret-derived bytes (empty: no secret)."""

    model_id: str
    chunk_tokens: int
    dtype: str = "bfloat16"
    weights: str = ""
    model_config: str = ""
    compute_dtype: str = ""
    namespace: str | None = None
    salt: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must be non-empty")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be an int > 0, got {self.chunk_tokens!r}")
        if not self.dtype:
            raise ValueError("dtype must be non-empty")
        if self.namespace is not None and (not isinstance(self.namespace, str) or not self.namespace):
            raise ValueError(f"namespace must be None or a non-empty string, got {self.namespace!r}")
        if not isinstance(self.salt, bytes):
            raise ValueError(f"salt must be bytes, got {type(self.salt).__name__}")

    @property
    def root(self) -> bytes:
        ns = b"\x00" if self.namespace is None else b"\x01" + self.namespace.encode()  # None differs from every name
        return _h(b"root", str(KEY_VERSION).encode(), self.model_id.encode(), str(self.chunk_tokens).encode(),
                  self.dtype.encode(), self.weights.encode(), self.model_config.encode(), self.compute_dtype.encode(),
                  ns, self.salt)


@dataclass(frozen=True)
class ChunkKey:
    """Key of full chunk ``index`` of a prefix; ``hex`` is the chained digest."""

    hex: str
    index: int

    def entry_name(self, layer: int) -> str:
        """Name of one (chunk, layer) entry in a store."""
        if layer < 0:
            raise ValueError(f"layer must be >= 0, got {layer}")
        return f"{self.hex}.{layer}"


def chunk_keys(tokens: Sequence[int] | np.ndarray, space: KeySpace) -> list[ChunkKey]:
    """Keys of every *full* chunk of ``tokens`` (a partial tail chunk is never stored)."""
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    C = space.chunk_tokens
    prev = space.root
    out: list[ChunkKey] = []
    for c in range(arr.size // C):
        prev = _h(prev, token_bytes(arr[c * C : (c + 1) * C]))
        out.append(ChunkKey(prev.hex(), c))
    return out


def chunk_tokens(tokens: Sequence[int] | np.ndarray, key: ChunkKey, space: KeySpace) -> np.ndarray:
    """The token ids of chunk ``key.index`` (what its record must hold)."""
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    C = space.chunk_tokens
    return arr[key.index * C : (key.index + 1) * C]


def profile_key(key: ChunkKey, profile: str) -> ChunkKey:
    """The key of chunk ``key``'s entries stored under a KVServe profile (a pipeline spec): derived from the lossless
    key (so from everything it binds, the store secret's salt included) and the spec, never equal to a lossless key,
    so a lossy entry can never answer a lossless fetch."""
    if not isinstance(profile, str) or not profile:
        raise ValueError(f"profile must be a non-empty pipeline spec, got {profile!r}")
    return ChunkKey(_h(b"profile", bytes.fromhex(key.hex), profile.encode()).hex(), key.index)
