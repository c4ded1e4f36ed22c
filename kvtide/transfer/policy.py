"""The sender's choice of a compression profile per hand-off: the online controller fed by measured goodput.

Profiles come from a KVServe table (``kvtide bench kvserve-profiles`` writes them; the bundled models' tables
ship in ``data/``) plus the lossless pipelines measured at start-up on KV of the model's layer shape. The bandwidth a decision assumes is the
EWMA goodput of recent writes to that peer (bytes over the write's own seconds, pacing included), not a nominal
rate; before the first transfer to a peer, ``guess_bandwidth``. Each finished transfer's measured span (first encode
to last write) is folded back into the controller's residuals.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .baselines import BF16 as BF16_SPEC, ZIPFUSION
from .controller import BF16, Profile
from .handoff import SendResult
from .online import Decision, OnlineConfig, OnlineController
from .pipeline import Pipeline
from .profiler import measure
from .table import load_profiles
from .transport.pacing import GoodputMeter

# lossless pipelines that give identical tokens: BF16 as is, byte-plane zstd, the ZipFusion format
LOSSLESS_SPECS = ("none|none|zstd", ZIPFUSION)


def spec_of(profile: Profile) -> str:
    """The pipeline spec of a profile (the controller's BF16 reference is named ``bf16``)."""
    return BF16_SPEC if profile.name == BF16.name else profile.name


def measured_lossless(layer_shape: tuple[int, int, int], seed: int = 0) -> list[Profile]:
    """Lossless profiles measured here on normal BF16 KV of one layer's shape [tokens, kv_heads, head_dim]
    (ratio and coding speed; quality 1 by construction)."""
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn((1, 2, *layer_shape), generator=g) * 0.5).to(torch.bfloat16)
    out = []
    for spec in LOSSLESS_SPECS:
        ratio, enc, dec = measure(spec, kv, repeats=2)
        out.append(Profile(spec, max(ratio, 1e-3), enc, dec, 1.0))
    return out


def packaged_table(model: str) -> Path | None:
    """The KVServe table shipped for a bundled model (its prose workload), if one ships."""
    path = Path(__file__).resolve().parent / "data" / f"profiles_{model}.json"
    return path if path.exists() else None


def table_profiles(path: str) -> list[Profile]:
    """A KVServe table's profiles plus the lossless ones it lacks (those are what lossless requests may use)."""
    profiles = [p for p in load_profiles(path) if p.name != BF16.name]
    for p in profiles:
        Pipeline(p.name)  # a spec this build cannot run is an error now, not at the first transfer
    return profiles


@dataclass
class Choice:
    decision: Decision | None  # None: the caller named the profile (not the controller's decision)
    spec: str
    bandwidth: float  # bytes/s the decision assumed
    measured: bool  # whether that bandwidth was measured (else the guess)
    lossless_only: bool = True
    name: str = ""  # the profile's name (its spec, or bf16)
    quality: float | None = None  # its profiled relative quality (None: a named lossy spec not in the table)

    def __post_init__(self) -> None:
        if self.decision is not None:
            self.name = self.name or self.decision.profile.name
            self.quality = self.decision.profile.quality if self.quality is None else self.quality


class TransferPolicy:
    """Thread-safe: the prefill side's pull handlers decide and observe from worker threads."""

    def __init__(self, profiles: list[Profile], guess_bandwidth: float, config: OnlineConfig | None = None,
                 alpha: float = 0.3):
        if not guess_bandwidth > 0 or not math.isfinite(guess_bandwidth):
            raise ValueError(f"guess_bandwidth must be a positive number of bytes/s, got {guess_bandwidth!r}")
        # a lossless request chooses among lossless pipelines only (a lossy profile's measured quality can reach 1.0)
        lossless = [p for p in profiles if Pipeline(spec_of(p)).lossless]
        self.lossless = OnlineController(lossless, config)
        self.any = OnlineController(profiles, config)
        self.profiles = list(self.any.profiles)
        self.guess = guess_bandwidth
        self.alpha = alpha
        self._meters: dict[str, GoodputMeter] = {}
        self._lock = threading.Lock()

    def bandwidth(self, peer: str) -> tuple[float, bool]:
        m = self._meters.get(peer)
        rate = m.rate if m is not None else None
        return (rate, True) if rate else (self.guess, False)

    def decide(self, peer: str, volume: int, min_quality: float, slo_s: float | None) -> Choice:
        with self._lock:
            bw, measured = self.bandwidth(peer)
            ctl = self.lossless if min_quality >= 1.0 else self.any
            d = ctl.decide(bw, float(max(volume, 1)), slo_s, min(min_quality, 1.0))
            return Choice(d, spec_of(d.profile), bw, measured, ctl is self.lossless)

    def named(self, peer: str, spec: str) -> Choice:
        """A profile the request named (a benchmark's fixed method, an operator's pin): no decision to learn from,
        its quality from the table where the table has it (1.0 for a lossless pipeline)."""
        canon = Pipeline(spec).to_spec()
        bw, measured = self.bandwidth(peer)
        known = {Pipeline(spec_of(p)).to_spec(): p for p in self.profiles}
        p = known.get(canon)
        quality = p.quality if p is not None else (1.0 if Pipeline(canon).lossless else None)
        return Choice(None, canon, bw, measured, name=p.name if p is not None else canon, quality=quality)

    def observe(self, peer: str, choice: Choice, result: SendResult) -> None:
        with self._lock:
            m = self._meters.get(peer)
            if m is None:
                m = self._meters[peer] = GoodputMeter(self.alpha)
            if result.write_s > 0 and result.wire_bytes > 0:
                m.observe(result.wire_bytes, result.write_s)
            if choice.decision is not None:
                (self.lossless if choice.lossless_only else self.any).observe(choice.decision, result.total_s)
