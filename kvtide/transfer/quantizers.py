"""Quantizers: uniform asymmetric integer quantisation of transformed KV, with per-(layer, K|V, head) bit maps.

A bit map entry is 1..8 (integer codes), 16 (keep BF16 as is) or 0 (prune: keep only ``sink`` + ``win``
tokens, the DuoAttention streaming-head press). Scale and minimum of each group are stored as float16
(float32 when values exceed its range); codes are computed against the *stored* scale and minimum, so the
per-group bound ``s/2 + 2^-10 (|m| + Q s) + (Q+1) 2^-24`` holds for what the decoder sees.

Axes: ``token`` groups ``g`` channels of one token (KIVI values); ``channel`` groups ``g`` tokens of one
channel (KIVI keys), whose leftover tail plus the ``r`` most recent tokens stay in BF16.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from .errors import SpecError
from .stage import Stage, Stream, check_int, register

AXES = ("token", "channel")
OUTLIER_STREAMS = ("ko.i", "ko.k")  # residual outlier key channels: uint8 indices, their BF16 values


def _bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """BF16 bit patterns as int16 on ``t``'s device (the stream records them as uint16)."""
    return t.contiguous().to(torch.bfloat16).view(torch.int16)


def _tensor(a: np.ndarray | torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A decoded stream as a tensor on ``device`` (uint16 BF16 bits as int16; numpy arrays copied)."""
    if isinstance(a, torch.Tensor):
        return a if device is None else a.to(device)
    a = a.view(np.int16) if a.dtype == np.uint16 else a
    return torch.from_numpy(a.copy()).to(device or "cpu")


def _from_bf16(a: np.ndarray | torch.Tensor, shape: tuple[int, ...], device: torch.device | str | None = None
               ) -> torch.Tensor:
    return _tensor(a, device).view(torch.bfloat16).float().reshape(shape)


def _exact(t: torch.Tensor) -> bool:
    return bool((t.to(torch.bfloat16).float() == t).all())


class Quantizer(Stage):
    registry: ClassVar[dict[str, type]] = {}

    def encode(self, y: torch.Tensor, head_scores: torch.Tensor | None) -> tuple[dict[str, Stream], dict[str, Any]]:
        raise NotImplementedError

    def decode(self, streams: dict[str, np.ndarray | torch.Tensor], meta: dict[str, Any], shape: tuple[int, ...],
               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Streams may be numpy arrays or tensors; the result is on ``device`` (None: the CPU)."""
        raise NotImplementedError

    def bound(self, streams: dict[str, np.ndarray], meta: dict[str, Any], shape: tuple[int, ...]) -> float:
        raise NotImplementedError


@register(Quantizer)
@dataclass(frozen=True)
class Bypass(Quantizer):
    """Store transformed values as BF16: exact when the transform is the identity."""

    name: ClassVar[str] = "none"

    def encode(self, y, head_scores):
        return {"v": Stream(_bf16_bits(y), bf16=True)}, {"x": _exact(y)}

    def decode(self, streams, meta, shape, device=None):
        return _from_bf16(streams["v"], shape, device), None

    def bound(self, streams, meta, shape):
        if meta["x"] or streams["v"].size == 0:
            return 0.0
        return float(_from_bf16(streams["v"], (-1,)).abs().max()) * 2.0**-8


@dataclass(frozen=True)
class Grouped(Quantizer):
    """Shared machinery; subclasses only say which bits each (layer, K|V, head) gets."""

    g: int = 32
    r: int = 0
    kax: str = "token"
    vax: str = "token"
    o: int = 0  # residual outliers: the o key channels of largest max |K| per (layer, head) kept in BF16

    def __post_init__(self) -> None:
        check_int("group size g", self.g, 1, 1 << 16)
        check_int("recent tokens r", self.r, 0, 1 << 24)
        check_int("outlier channels o", self.o, 0, 255)
        for ax in (self.kax, self.vax):
            if ax not in AXES:
                raise SpecError(f"axis must be one of {AXES}, got {ax!r}")

    def bit_map(self, L: int, H: int, head_scores: torch.Tensor | None) -> np.ndarray:
        raise NotImplementedError

    # --- encode -------------------------------------------------------------------------------------------
    def encode(self, y, head_scores):
        L, _, T, H, D = y.shape
        bm = self.bit_map(L, H, head_scores)
        streams: dict[str, Stream] = {}
        exact = True
        if self.o:
            y, idx, vals = self._split_outliers(y)
            streams[OUTLIER_STREAMS[0]] = Stream(idx.to(torch.uint8))
            streams[OUTLIER_STREAMS[1]] = Stream(_bf16_bits(vals), bf16=True)
            exact &= _exact(vals)
        for kv in (0, 1):
            sl = y[:, kv].permute(0, 2, 1, 3)  # [L, H, T, D]
            axis = self.kax if kv == 0 else self.vax
            for b in sorted(set(bm[:, kv].ravel().tolist())):
                z = sl[torch.from_numpy(bm[:, kv] == b).to(y.device)]
                p = f"{kv}.{b}."
                if b in (0, 16):
                    keep = z if b == 16 else z[:, _kept_tokens(T, self._sink(), self._win())]
                    streams[p + "k"] = Stream(_bf16_bits(keep), bf16=True)
                    exact &= _exact(keep)
                    continue
                zq, rest = self._split(z, axis)
                if zq.numel():
                    red = -1 if axis == "token" else 2
                    mn, mx = zq.amin(red, keepdim=True), zq.amax(red, keepdim=True)
                    q = (1 << b) - 1
                    big = max(float(mn.abs().max()), float(mx.abs().max()))
                    mdt = torch.float16 if big < 6.0e4 else torch.float32
                    m = mn.to(mdt).float()
                    s = ((mx - mn) / q).to(mdt).float()
                    codes = ((zq - m) / torch.where(s > 0, s, torch.ones_like(s))).round_().clamp_(0, q)
                    streams[p + "c"] = Stream(codes.to(torch.uint8), bits=b)
                    streams[p + "s"] = Stream(s.to(mdt))
                    streams[p + "m"] = Stream(m.to(mdt))
                streams[p + "r"] = Stream(_bf16_bits(rest), bf16=True)
                exact &= _exact(rest)
        return streams, {"bm": bm.tolist(), "x": exact}

    def _split_outliers(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y with the outlier key channels zeroed, their indices [L, H, o] ascending, values [L, H, T, o])."""
        L, _, T, H, D = y.shape
        if self.o >= D or D > 256:
            raise SpecError(f"{self.o} outlier channels need head_dim in ({self.o}, 256], got {D}")
        k = y[:, 0].permute(0, 2, 1, 3)  # [L, H, T, D]
        idx = torch.topk(k.abs().amax(2), self.o, dim=-1).indices.sort(-1).values  # [L, H, o]
        full = idx[:, :, None, :].expand(L, H, T, self.o)
        vals = torch.gather(k, -1, full)
        y = y.clone()
        y[:, 0] = k.scatter(-1, full, 0.0).permute(0, 2, 1, 3)
        return y, idx, vals

    def _sink(self) -> int:
        return getattr(self, "sink", 0)

    def _win(self) -> int:
        return getattr(self, "win", 0)

    def _split(self, z: torch.Tensor, axis: str) -> tuple[torch.Tensor, torch.Tensor]:
        n, T, D = z.shape
        if axis == "token":
            gd = min(self.g, D)
            if D % gd:
                raise SpecError(f"group size {self.g} does not divide head_dim {D}")
            tq = T - min(self.r, T)
            return z[:, :tq].reshape(n, tq, D // gd, gd), z[:, tq:]
        tq = max(0, (T - self.r) // self.g * self.g)
        return z[:, :tq].reshape(n, tq // self.g, self.g, D), z[:, tq:]

    # --- decode -------------------------------------------------------------------------------------------
    def decode(self, streams, meta, shape, device=None):
        L, _, T, H, D = shape
        dev = torch.device(device or "cpu")
        bm = np.asarray(meta["bm"], dtype=np.int64).reshape(L, 2, H)
        out = torch.zeros(L, 2, H, T, D, device=dev)
        mask = torch.ones(L, 2, H, T, dtype=torch.bool, device=dev) if (bm == 0).any() else None
        for kv in (0, 1):
            for b in sorted(set(bm[:, kv].ravel().tolist())):
                sel = torch.from_numpy(bm[:, kv] == b).to(dev)
                n = int(sel.sum())
                p = f"{kv}.{b}."
                if b == 16:
                    out[:, kv][sel] = _from_bf16(streams[p + "k"], (n, T, D), dev)
                    continue
                if b == 0:
                    idx = _kept_tokens(T, self._sink(), self._win())
                    z = torch.zeros(n, T, D, device=dev)
                    z[:, idx] = _from_bf16(streams[p + "k"], (n, len(idx), D), dev)
                    out[:, kv][sel] = z
                    m = torch.zeros(n, T, dtype=torch.bool, device=dev)
                    m[:, idx] = True
                    mask[:, kv][sel] = m  # type: ignore[index]
                    continue
                rest = _from_bf16(streams[p + "r"], (n, -1, D), dev)
                tq = T - rest.shape[1]
                if tq:
                    c = _tensor(streams[p + "c"], dev).float()
                    zq = c * _tensor(streams[p + "s"], dev).float() + _tensor(streams[p + "m"], dev).float()
                    z = torch.cat([zq.reshape(n, tq, D), rest], 1)
                else:
                    z = rest
                out[:, kv][sel] = z
        if self.o:
            self._merge_outliers(out, streams, L, T, H, D, dev)
        y = out.permute(0, 1, 3, 2, 4).contiguous()
        return y, (mask.permute(0, 1, 3, 2).contiguous() if mask is not None else None)

    def _merge_outliers(self, out: torch.Tensor, streams, L: int, T: int, H: int, D: int, dev: torch.device) -> None:
        """Write the BF16 outlier key channels over their decoded (zeroed) place in ``out`` [L, 2, H, T, D]."""
        idx = _tensor(streams[OUTLIER_STREAMS[0]], dev).long().reshape(L, H, self.o)
        if idx.numel() and int(idx.max()) >= D:
            raise ValueError(f"outlier channel index {int(idx.max())} >= head_dim {D}")
        vals = _from_bf16(streams[OUTLIER_STREAMS[1]], (L, H, T, self.o), dev)
        out[:, 0] = out[:, 0].scatter(-1, idx[:, :, None, :].expand(L, H, T, self.o), vals)

    def bound(self, streams, meta, shape):
        worst = 0.0
        for name, a in streams.items():
            if name.endswith(".s"):
                b = int(name.split(".")[1])
                q = (1 << b) - 1
                s = a.astype(np.float64)
                m = np.abs(streams[name[:-1] + "m"].astype(np.float64))
                eps = 2.0**-10 if a.dtype == np.float16 else 2.0**-22
                if s.size:
                    worst = max(worst, float(np.max(s / 2 + eps * (m + q * s) + (q + 1) * 2.0**-24)))
            elif not meta["x"] and (name.endswith(".r") or name.endswith(".k")) and a.size:
                worst = max(worst, float(_from_bf16(a, (-1,)).abs().max()) * 2.0**-8)
        return worst


def _kept_tokens(T: int, sink: int, win: int) -> list[int]:
    s = min(sink, T)
    return list(range(s)) + list(range(max(s, T - win), T))


def _check_bits(name: str, b: Any, allow0: bool = False) -> None:
    ok = isinstance(b, int) and not isinstance(b, bool) and (1 <= b <= 8 or b == 16 or (allow0 and b == 0))
    if not ok:
        raise SpecError(f"{name} must be 1..8 or 16{' or 0' if allow0 else ''}, got {b!r}")


@register(Quantizer)
@dataclass(frozen=True)
class Uniform(Grouped):
    """Uniform asymmetric quantisation with separate key/value bits and axes."""

    name: ClassVar[str] = "uniform"
    k: int = 4
    v: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bits("k", self.k)
        _check_bits("v", self.v)

    def bit_map(self, L, H, head_scores):
        bm = np.empty((L, 2, H), dtype=np.int64)
        bm[:, 0], bm[:, 1] = self.k, self.v
        return bm


@register(Quantizer)
@dataclass(frozen=True)
class Kivi(Uniform):
    """KIVI: keys per channel, values per token, the ``r`` most recent tokens in full precision."""

    name: ClassVar[str] = "kivi"
    k: int = 2
    v: int = 2
    r: int = 32
    kax: str = field(default="channel", init=False, repr=False)
    vax: str = field(default="token", init=False, repr=False)


@register(Quantizer)
@dataclass(frozen=True)
class LayerWise(Grouped):
    """Layer-wise bit allocation (CacheGen/PyramidKV): ``b`` lists bits for equal bands of layers, front first."""

    name: ClassVar[str] = "layer"
    b: tuple[int, ...] | int = (8, 4, 2)

    def __post_init__(self) -> None:
        super().__post_init__()
        bs = self.b if isinstance(self.b, tuple) else (self.b,)
        if not bs:
            raise SpecError("layer: b needs at least one entry")
        for x in bs:
            _check_bits("layer bits", x)

    def bit_map(self, L, H, head_scores):
        bs = self.b if isinstance(self.b, tuple) else (self.b,)
        per_layer = [bs[min(len(bs) - 1, i * len(bs) // L)] for i in range(L)]
        return np.broadcast_to(np.asarray(per_layer, dtype=np.int64)[:, None, None], (L, 2, H)).copy()


@register(Quantizer)
@dataclass(frozen=True)
class MixHQ(Grouped):
    """Head-wise mixed precision: the top ``frac`` of heads by score at ``hi`` bits, the rest at ``lo``.

    ``lo=0`` prunes streaming heads to ``sink`` + ``win`` tokens (DuoAttention press); ``hi=16`` keeps BF16.
    Scores ([layers, kv_heads], higher = retrieval head) are measured offline and passed at encode; the bit
    map travels in the blob, so decoding needs no scores.
    """

    name: ClassVar[str] = "mixhq"
    hi: int = 8
    lo: int = 2
    frac: float = 0.25
    g: int = 32
    r: int = 32
    kax: str = "channel"
    vax: str = "token"
    sink: int = 4  # type: ignore[misc]
    win: int = 64  # type: ignore[misc]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bits("hi", self.hi)
        _check_bits("lo", self.lo, allow0=True)
        if not isinstance(self.frac, (int, float)) or not 0.0 <= self.frac <= 1.0:
            raise SpecError(f"frac must be in [0, 1], got {self.frac!r}")
        check_int("sink", self.sink, 0, 1 << 24)
        check_int("win", self.win, 0, 1 << 24)

    def _scores(self, L, H, head_scores) -> torch.Tensor:
        """The measured head scores as a finite float64 [L, H] tensor (ValueError naming the problem otherwise)."""
        if head_scores is None:
            raise ValueError(f"{self.name} needs head_scores [layers, kv_heads] (pass them to the Pipeline)")
        sc = torch.as_tensor(head_scores, dtype=torch.float64)
        if tuple(sc.shape) != (L, H) or not torch.isfinite(sc).all():
            raise ValueError(f"head_scores must be finite and shaped ({L}, {H}), got {tuple(sc.shape)}")
        return sc

    def bit_map(self, L, H, head_scores):
        sc = self._scores(L, H, head_scores)
        n_hi = int(round(self.frac * L * H))
        order = torch.argsort(-sc.flatten(), stable=True)[:n_hi]
        per_head = np.full(L * H, self.lo, dtype=np.int64)
        per_head[order.numpy()] = self.hi
        return np.repeat(per_head.reshape(L, 1, H), 2, axis=1)


@register(Quantizer)
@dataclass(frozen=True)
class MixLQ(MixHQ):
    """Layer-wise mixed precision from the same measured head scores: the top ``frac`` of layers by mean head
    score at ``hi`` bits, the rest at ``lo`` (the layer-granularity form of MixHQ the KVServe paper names)."""

    name: ClassVar[str] = "mixlq"

    def bit_map(self, L, H, head_scores):
        sc = self._scores(L, H, head_scores)
        n_hi = int(round(self.frac * L))
        order = torch.argsort(-sc.mean(1), stable=True)[:n_hi]
        per_layer = np.full(L, self.lo, dtype=np.int64)
        per_layer[order.numpy()] = self.hi
        return np.broadcast_to(per_layer[:, None, None], (L, 2, H)).copy()
