"""The sender's choice of a compression profile per hand-off: the online controller fed by measured goodput.

Profiles come from a KVServe table (``kvtide bench kvserve-profiles`` writes them; the bundled models' tables
ship in ``data/``) plus the lossless pipelines measured at start-up on KV of the model's layer shape. The bandwidth a decision assumes is the
EWMA goodput of recent writes to that peer (bytes over the write's own seconds, pacing included), not a nominal
rate; before the first transfer to a peer, ``guess_bandwidth``. Each finished transfer's measured span (first encode
to last write) is folded back into the controller's residuals.

A caller may name a policy key: that key's goodput meters and controllers see only the transfers made under it,
so several independent decision processes (a benchmark's arms, tenants kept apart) can share one instance without
learning from each other. The default key ``""`` is the instance's own state; at most ``max_keys`` named keys are
kept (a state's learning is never dropped silently, so a key past the bound is refused, `PolicyKeyError`).
"""
from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..log import get_logger
from .baselines import BF16 as BF16_SPEC, ZIPFUSION
from .controller import BF16, Profile
from .handoff import SendResult
from .nvcodecs import gpu_ready
from .online import Decision, OnlineConfig, OnlineController
from .pipeline import Pipeline
from .profiler import measure
from .table import load_profiles
from .transport.pacing import GoodputMeter

log = get_logger("transfer")

# lossless pipelines that give identical tokens: BF16 as is, byte-plane zstd, the ZipFusion format
LOSSLESS_SPECS = ("none|none|zstd", ZIPFUSION)
MAX_POLICY_KEYS = 16  # named policy states one instance keeps besides its own
_KEY = re.compile(r"[A-Za-z0-9._-]{1,64}")


class PolicyKeyError(ValueError):
    """A policy key that is malformed, or new when the instance already keeps ``max_keys`` of them."""


def check_policy_key(key: object, field: str = "policy_key") -> str:
    """``key`` if it is a policy key (1-64 of ``A-Z a-z 0-9 . _ -``); `PolicyKeyError` naming ``field`` if not."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise PolicyKeyError(f"'{field}' must be 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' or '-', "
                             f"got {key!r:.80}")
    return key


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


def packaged_table(model: str, device: str | torch.device = "cpu") -> Path | None:
    """The KVServe table shipped for a bundled model (its prose workload), if one ships: on a CUDA device the one
    whose coding rates were measured on a GPU (``profiles_<model>_gpu.json``, bench/kvserve_gpu.py) where it exists."""
    data = Path(__file__).resolve().parent / "data"
    names = [f"profiles_{model}.json"]
    if torch.device(device).type == "cuda":
        names.insert(0, f"profiles_{model}_gpu.json")
    return next((data / n for n in names if (data / n).exists()), None)


def runnable(spec: str, device: str | torch.device) -> bool:
    """Whether this instance can encode ``spec``: a codec with no host implementation (nvCOMP's ANS) needs a CUDA
    device with nvCOMP."""
    codec = Pipeline(spec).codec
    return codec.cpu_format or gpu_ready(device)


def table_profiles(path: str, device: str | torch.device = "cpu") -> list[Profile]:
    """A KVServe table's profiles that ``device`` can encode (a GPU table read by a CPU instance loses its
    GPU-only codecs, logged); a spec this build cannot parse is an error now, not at the first transfer."""
    profiles = [p for p in load_profiles(path) if p.name != BF16.name]
    kept = [p for p in profiles if runnable(p.name, device)]
    if len(kept) < len(profiles):
        log.warning("%s: %d profile(s) need a CUDA device with nvCOMP and are left out here: %s", path,
                    len(profiles) - len(kept), sorted({p.name for p in profiles} - {p.name for p in kept}))
    return kept


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


@dataclass
class _State:
    """One decision process: its goodput meter per peer and its two controllers (lossless requests, any)."""
    lossless: OnlineController
    any: OnlineController
    meters: dict[str, GoodputMeter]


class TransferPolicy:
    """Thread-safe: the prefill side's pull handlers decide and observe from worker threads. Every method takes
    the policy ``key`` whose state it reads and updates (``""``: the instance's own)."""

    def __init__(self, profiles: list[Profile], guess_bandwidth: float, config: OnlineConfig | None = None,
                 alpha: float = 0.3, max_keys: int = MAX_POLICY_KEYS):
        if not guess_bandwidth > 0 or not math.isfinite(guess_bandwidth):
            raise ValueError(f"guess_bandwidth must be a positive number of bytes/s, got {guess_bandwidth!r}")
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 0:
            raise ValueError(f"max_keys must be an int >= 0, got {max_keys!r}")
        # a lossless request chooses among lossless pipelines only (a lossy profile's measured quality can reach 1.0)
        self._lossless_profiles = [p for p in profiles if Pipeline(spec_of(p)).lossless]
        self._all_profiles = list(profiles)
        self.config = config
        self.guess = guess_bandwidth
        self.alpha = alpha
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._states: dict[str, _State] = {"": self._new_state()}
        self.profiles = list(self._states[""].any.profiles)

    def _new_state(self) -> _State:
        return _State(OnlineController(self._lossless_profiles, self.config),
                      OnlineController(self._all_profiles, self.config), {})

    def admit(self, key: str) -> None:
        """Make sure ``key`` has a state: create it if there is room, else `PolicyKeyError`."""
        with self._lock:
            self._state(key)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._states)

    def _state(self, key: str) -> _State:  # under the lock
        s = self._states.get(key)
        if s is None:
            check_policy_key(key)
            if len(self._states) - 1 >= self.max_keys:
                raise PolicyKeyError(f"'policy_key' {key!r} is new and this instance already keeps "
                                     f"{self.max_keys} policy keys; reuse one of them")
            s = self._states[key] = self._new_state()
        return s

    def _bandwidth(self, s: _State, peer: str) -> tuple[float, bool]:
        m = s.meters.get(peer)
        rate = m.rate if m is not None else None
        return (rate, True) if rate else (self.guess, False)

    def bandwidth(self, peer: str, key: str = "") -> tuple[float, bool]:
        """The bandwidth ``key`` would assume to ``peer`` now and whether it was measured (else the guess)."""
        with self._lock:
            return self._bandwidth(self._state(key), peer)

    def observed(self, peer: str, key: str = "") -> int:
        """Transfers to ``peer`` folded into ``key``'s goodput meter so far (0 for a key not kept)."""
        with self._lock:
            s = self._states.get(key)
            m = s.meters.get(peer) if s is not None else None
            return m.count if m is not None else 0

    def decide(self, peer: str, volume: int, min_quality: float, slo_s: float | None, key: str = "") -> Choice:
        with self._lock:
            s = self._state(key)
            bw, measured = self._bandwidth(s, peer)
            ctl = s.lossless if min_quality >= 1.0 else s.any
            d = ctl.decide(bw, float(max(volume, 1)), slo_s, min(min_quality, 1.0))
            return Choice(d, spec_of(d.profile), bw, measured, ctl is s.lossless)

    def named(self, peer: str, spec: str, key: str = "") -> Choice:
        """A profile the request named (a benchmark's fixed method, an operator's pin): no decision to learn from,
        its quality from the table where the table has it (1.0 for a lossless pipeline)."""
        canon = Pipeline(spec).to_spec()
        bw, measured = self.bandwidth(peer, key)
        known = {Pipeline(spec_of(p)).to_spec(): p for p in self.profiles}
        p = known.get(canon)
        quality = p.quality if p is not None else (1.0 if Pipeline(canon).lossless else None)
        return Choice(None, canon, bw, measured, name=p.name if p is not None else canon, quality=quality)

    def observe(self, peer: str, choice: Choice, result: SendResult, key: str = "") -> None:
        """Fold a finished transfer into ``key``'s goodput meter to ``peer`` and, if decided, its controller."""
        with self._lock:
            s = self._state(key)
            m = s.meters.get(peer)
            if m is None:
                m = s.meters[peer] = GoodputMeter(self.alpha)
            if result.wire_span_s > 0 and result.wire_bytes > 0:
                m.observe_transfer(result.wire_bytes, result.write_s, result.wire_span_s)
            if choice.decision is not None:
                (s.lossless if choice.lossless_only else s.any).observe(choice.decision, result.total_s)
