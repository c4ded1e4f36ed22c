"""Store entries kept under a KVServe profile (a transform | quantizer | codec pipeline, usually lossy).

Why: a remote pool's link (5-15 Gbps) moves a long prefix's KV slower than it is recomputed; an entry encoded by a
profile of the Pareto table carries a few times fewer bytes, so a restoration under a quality budget can load far
more of its prefix. Such entries live under their own keys (``KeySpace.profile``), so a lossless fetch never finds
one; their record says ``codec: "kvs1"`` and names the profile, checked again by the loader.

Payload of a ``kvs1`` record: the pipeline's container blob (:mod:`kvtide.transfer.container`) of the entry's KV as
one layer, [1, 2, tokens, kv_heads, head_dim]. Decoding is bounded before allocation (the container may declare
no more values than the record's shape holds) and every failure is ``ChunkCorrupt``.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any, Protocol

import torch

from kvtide.store.errors import ChunkCorrupt

CODEC = "kvs1"
MAX_PROFILE_CHARS = 512  # a spec longer than this is refused by the record parser
_SPEC_CHARS = re.compile(r"[A-Za-z0-9_.:,=/|+-]+\Z")


def check_profile_name(name: object) -> str | None:
    """Why ``name`` cannot be a stored profile's name (None when it can): a bounded spec string."""
    if not isinstance(name, str) or not name:
        return f"profile {name!r} is not a non-empty string"
    if len(name) > MAX_PROFILE_CHARS:
        return f"profile name of {len(name)} characters, more than {MAX_PROFILE_CHARS}"
    if not _SPEC_CHARS.match(name):
        return f"profile {name[:40]!r} has characters no pipeline spec uses"
    return None


class ProfileEntry:
    """One entry's KV as a profile's container ``blob`` (bytes or a uint8 view), the decoded ``shape``, and the
    profile's spec. ``dtype`` is that of the decoded KV (what the loader's dtype check compares)."""

    __slots__ = ("blob", "shape", "profile")
    dtype = torch.bfloat16

    def __init__(self, blob: Any, shape: tuple[int, ...], profile: str) -> None:
        why = check_profile_name(profile)
        if why is not None:
            raise ValueError(why)
        self.blob, self.shape, self.profile = blob, tuple(shape), profile

    @property
    def nbytes(self) -> int:
        return len(self.blob)

    @property
    def held_nbytes(self) -> int:
        return len(self.blob)

    def decode(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The KV (BF16, ``shape``) on ``device`` (None: the CPU); ChunkCorrupt for any blob that is not this
        profile's encoding of that shape. The container may declare at most the shape's values (checked before
        anything is allocated, by the registered codec)."""
        if _CODEC is None:
            raise ChunkCorrupt(f"{self.profile[:40]} entry: no profile codec registered (the transfer package registers one)",
                               "")
        numel = math.prod(self.shape)
        try:
            out = _CODEC.decode(self.blob, self.profile, numel, device)
        except ValueError as e:  # the codec's every refusal (ContainerError, SpecError are ValueErrors)
            raise ChunkCorrupt(f"{self.profile[:40]} entry: {str(e)[:160]}", "") from None
        if not isinstance(out, torch.Tensor) or out.numel() != numel or out.dtype != torch.bfloat16:
            raise ChunkCorrupt(f"{self.profile[:40]} entry does not decode to bfloat16 {list(self.shape)}", "")
        return out.reshape(self.shape)


class ProfileCodec(Protocol):
    """What encodes and decodes profile entries (``kvtide.transfer.store_codec`` registers the KVServe pipelines:
    the store knows no pipeline). ``decode`` raises ValueError for a blob it refuses, having allocated at most
    ``max_values`` values."""

    def encode(self, kv: torch.Tensor, spec: str) -> bytes: ...

    def decode(self, blob: Any, spec: str, max_values: int, device: Any) -> torch.Tensor: ...


_CODEC: ProfileCodec | None = None


def register_codec(codec: ProfileCodec) -> None:
    global _CODEC
    _CODEC = codec


def encode(kv: torch.Tensor, spec: str) -> ProfileEntry:
    """``kv`` [2, tokens, kv_heads, head_dim] (BF16) encoded by the pipeline ``spec`` (the registered codec)."""
    if kv.dtype != torch.bfloat16 or kv.dim() != 4 or kv.shape[0] != 2:
        raise ValueError(f"profile entries hold bfloat16 [2, tokens, heads, dim] KV, got {kv.dtype} {list(kv.shape)}")
    if _CODEC is None:
        raise RuntimeError("no profile codec registered (the transfer package registers one)")
    return ProfileEntry(_CODEC.encode(kv, spec), tuple(kv.shape), spec)


class PendingProfileEntry:
    """A chunk layer to be encoded by a profile on the store writer's thread (``materialize``), off the step loop.

    ``held_nbytes`` is 0: the KV tensor is shared with the lossless entry queued beside it, whose bytes the
    writer's queue bound already counts. ``on_encoded(spec, seconds, decode_seconds, tokens)`` reports each
    encoding; with ``probe`` the encoding is also decoded (on ``probe_device``), timed, so the planner knows the
    profile's decode cost before any restoration used it."""

    __slots__ = ("kv", "profile", "probe", "probe_device", "on_encoded")
    held_nbytes = 0

    def __init__(self, kv: torch.Tensor, profile: str, probe: bool = False, probe_device: Any = None,
                 on_encoded: Any = None) -> None:
        self.kv, self.profile, self.probe, self.probe_device, self.on_encoded = kv, profile, probe, probe_device, on_encoded

    def materialize(self) -> ProfileEntry:
        """The entry, encoded on ``probe_device`` when that is a GPU (the pipeline's stages run where the KV is; the
        blob does not depend on it), else on the CPU."""
        t0 = time.perf_counter()
        dev = torch.device(self.probe_device) if self.probe_device is not None else None
        kv = self.kv.to(dev) if dev is not None and dev.type == "cuda" else self.kv
        e = encode(kv, self.profile)
        t1 = time.perf_counter()
        dec = None
        if self.probe:
            e.decode(dev)
            if dev is not None and dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dec = time.perf_counter() - t1
        if self.on_encoded is not None:
            self.on_encoded(self.profile, t1 - t0, dec, int(self.kv.shape[1]))
        return e
