"""A compression profile as a pipeline Transform -> Quantizer -> Codec, built from a spec string.

``Pipeline(spec).encode(kv)`` takes one request's KV, a BF16 tensor [layers, 2, tokens, kv_heads, head_dim]
(or a dict of such), and returns a self-describing blob (a bytearray; see container.py); ``decode`` inverts it.
Lossless pipelines (transform and quantizer ``none``) are bit-exact; for the others ``error_bound(blob)``
states the max abs error, before the final rounding to BF16 (<= 2^-8 |x| more).

Stages run on the KV's device: a CUDA tensor is transformed, quantised and (for codecs with ``device_encode``, e.g.
the nvCOMP ones in nvcodecs.py) coded on the GPU; ``decode(blob, device=...)`` decodes onto a device. The blob
does not depend on where it was made: integer codes, scales and BF16 streams are the same bits on every device for
the ``none`` and ``delta`` transforms (min/max reductions and IEEE division round alike); ``hadamard`` (a matmul)
and ``affine`` (mean/std) may differ in the last float bit between devices, which can move a code by one step,
within the stated error bound.

Decoding treats the blob as untrusted: ``max_values`` bounds the values its entries may declare (default
``container.MAX_VALUES``; pass what you expect), each entry's streams are checked against the stages
(layout.py) before any is decoded, and every failure is a ContainerError.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from . import codecs, nvcodecs, quantizers, transforms  # noqa: F401  (registers the stages)
from .codecs import Codec
from .container import MAX_VALUES, Entry, StreamRecord, pack, pack_into, unpack
from .errors import ContainerError, SpecError
from .layout import check_entry
from .quantizers import Quantizer
from .spec import format_spec, parse_spec
from .stage import Stream
from .transforms import Transform

KV = torch.Tensor | Mapping[str, torch.Tensor]


def _check_kv(x: Any, key: str | None) -> torch.Tensor:
    where = f"kv[{key!r}]" if key is not None else "kv"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{where} must be bfloat16, got {x.dtype}")
    if x.dim() != 5 or x.shape[1] != 2 or min(x.shape) < 1:
        raise ValueError(f"{where} must be [layers, 2, tokens, kv_heads, head_dim] and non-empty, got {tuple(x.shape)}")
    return x


class Pipeline:
    """One compression profile; cheap to build, stateless between calls."""

    def __init__(self, spec: str, head_scores: torch.Tensor | None = None) -> None:
        t, q, c = parse_spec(spec)
        self.transform: Transform = Transform.from_stage(t)
        self.quantizer: Quantizer = Quantizer.from_stage(q)
        self.codec: Codec = Codec.from_stage(c)
        self.head_scores = head_scores

    @classmethod
    def from_spec(cls, spec: str, head_scores: torch.Tensor | None = None) -> "Pipeline":
        return cls(spec, head_scores)

    def to_spec(self) -> str:
        """Canonical spec: parameters in declared order, defaults omitted."""
        return format_spec((self.transform.to_stage(), self.quantizer.to_stage(), self.codec.to_stage()))

    @property
    def spec(self) -> str:
        return self.to_spec()

    @property
    def lossless(self) -> bool:
        return self.transform.name == "none" and self.quantizer.name == "none"

    def __repr__(self) -> str:
        return f"Pipeline({self.to_spec()!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pipeline) and other.to_spec() == self.to_spec()

    def __hash__(self) -> int:
        return hash(self.to_spec())

    # --- encode ----------------------------------------------------------------------------------------------
    def encode(self, kv: KV, head_scores: torch.Tensor | None = None) -> bytearray:
        return pack(self.to_spec(), self._encode_entries(kv, head_scores))

    def encode_into(self, kv: KV, out: Any, head_scores: torch.Tensor | None = None) -> int:
        """``encode`` written into the writable buffer ``out`` (e.g. a transport's registered staging memory);
        returns the blob's length. ``ValueError`` if it does not fit."""
        return pack_into(out, self.to_spec(), self._encode_entries(kv, head_scores))

    def _encode_entries(self, kv: KV, head_scores: torch.Tensor | None) -> list[Entry]:
        scores = head_scores if head_scores is not None else self.head_scores
        if isinstance(kv, Mapping):
            if not kv:
                raise ValueError("kv dict is empty")
            return [self._encode_one(_check_kv(v, str(k)), str(k), scores) for k, v in kv.items()]
        return [self._encode_one(_check_kv(kv, None), None, scores)]

    def _encode_one(self, kv: torch.Tensor, key: str | None, scores: torch.Tensor | None) -> Entry:
        if self.lossless:  # bit patterns straight through: float round trips would canonicalise NaN payloads
            side, qs, qmeta = {}, {"v": Stream(kv.detach().contiguous().view(torch.int16), bf16=True)}, {"x": True}
        else:
            x = kv.detach().to(torch.float32)
            y, side = self.transform.encode(x)
            qs, qmeta = self.quantizer.encode(y, scores)
        streams = {"t." + k: Stream(v) for k, v in side.items()}
        streams.update({"q." + k: v for k, v in qs.items()})
        if not self.codec.device_encode:
            streams = {k: s.host() for k, s in streams.items()}
        recs = []
        for name, s in streams.items():  # GPU-coded streams stay on the device until pack copies them out together
            coded = self.codec.encode_device(s)
            recs.append(StreamRecord(name, s.dtype, s.shape, s.bits, s.bf16,
                                     coded if coded is not None else self.codec.encode(s)))
        return Entry(key, tuple(kv.shape), "bfloat16", {"q": qmeta}, recs)

    # --- decode ----------------------------------------------------------------------------------------------
    def _entries(self, blob: bytes, max_values: int = MAX_VALUES) -> list[Entry]:
        return self._checked(*unpack(blob, max_values))

    def _checked(self, spec: str, entries: list[Entry]) -> list[Entry]:
        if spec != self.to_spec():
            raise ContainerError(f"blob was encoded with {spec[:200]!r}, not {self.to_spec()!r} (use transfer.decode)")
        for e in entries:
            check_entry(self, e)
        return entries

    def _arrays(self, e: Entry, device: torch.device | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The entry's decoded streams: numpy arrays, or tensors on ``device`` when one is given."""
        t, q = {}, {}
        for s in e.streams:
            args = (s.payload, np.dtype(s.dtype), s.shape, s.bits, s.bf16)
            a = self.codec.decode(*args) if device is None else self.codec.decode_tensor(*args, device)
            (t if s.name.startswith("t.") else q)[s.name[2:]] = a
        return t, q

    def _decode_one(self, e: Entry, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        try:
            t, q = self._arrays(e, device)
            if self.lossless:
                v = q["v"]
                if math.prod(v.shape) != math.prod(e.shape):
                    raise ContainerError("stream size does not match the recorded shape")
                if isinstance(v, torch.Tensor):
                    return v.reshape(e.shape).view(torch.bfloat16), None
                v = v.view(np.int16).reshape(e.shape)  # a codec's array owns its memory (Codec.decode)
                return torch.from_numpy(v if v.flags.writeable else v.copy()).view(torch.bfloat16), None
            y, mask = self.quantizer.decode(q, e.meta["q"], e.shape, device)
            x = self.transform.decode(y, t)
        except ContainerError:
            raise
        except _INCONSISTENT as ex:
            raise ContainerError(f"blob content inconsistent with its spec: {ex}") from ex
        if tuple(x.shape) != e.shape:
            raise ContainerError(f"decoded shape {tuple(x.shape)} != recorded {e.shape}")
        return x.to(torch.bfloat16), mask

    def decode_with_mask(self, blob: bytes, max_values: int = MAX_VALUES, device: torch.device | str | None = None
                         ) -> tuple[KV, Any]:
        """Also return the kept-token mask [layers, 2, tokens, kv_heads] (None without pruning): pruned
        positions decode as zeros and the attention must skip them. ``device``: where to decode (None: the CPU,
        through the host codecs)."""
        return self._decode_entries(self._entries(blob, max_values), None if device is None else torch.device(device))

    def _decode_entries(self, entries: list[Entry], device: torch.device | None = None) -> tuple[KV, Any]:
        outs = [self._decode_one(e, device) for e in entries]
        if len(entries) == 1 and entries[0].key is None:
            return outs[0]
        return {e.key: o[0] for e, o in zip(entries, outs)}, {e.key: o[1] for e, o in zip(entries, outs)}

    def decode(self, blob: bytes, max_values: int = MAX_VALUES, device: torch.device | str | None = None) -> KV:
        return self.decode_with_mask(blob, max_values, device)[0]

    def error_bound(self, blob: bytes, max_values: int = MAX_VALUES) -> float:
        """Max abs error of decode (kept positions) against the input, before the final BF16 rounding."""
        worst = 0.0
        for e in self._entries(blob, max_values):
            try:
                t, q = self._arrays(e)
                qb = self.quantizer.bound(q, e.meta["q"], e.shape)
                worst = max(worst, qb * self.transform.gain(e.shape, t) if qb else 0.0)
            except ContainerError:
                raise
            except _INCONSISTENT as ex:
                raise ContainerError(f"blob content inconsistent with its spec: {ex}") from ex
        return worst


# what stages raise on content the layout checks let through (ArithmeticError: OverflowError and the like)
_INCONSISTENT = (KeyError, ValueError, RuntimeError, IndexError, TypeError, ArithmeticError)


def decode(blob: bytes, max_values: int = MAX_VALUES) -> KV:
    """Decode any container with the pipeline named inside it."""
    spec, entries = unpack(blob, max_values)
    try:
        p = Pipeline(spec)
    except SpecError as ex:
        raise ContainerError(f"blob names an invalid pipeline spec {spec[:200]!r}: {ex}") from ex
    return p._decode_entries(p._checked(spec, entries))[0]


def compressed_ratio(kv: KV, blob: bytes) -> float:
    """Raw BF16 bytes over blob bytes (container overhead included)."""
    ts = kv.values() if isinstance(kv, Mapping) else [kv]
    return sum(math.prod(t.shape) * 2 for t in ts) / len(blob)
