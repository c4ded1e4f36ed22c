"""`ServerConfig`: the ``server:`` section of a config file (``KVTIDE_SERVER_<FIELD>``, `kvtide serve` flags).

Resolved by `kvtide.config_load.load_settings(..., server_type=ServerConfig)` like the engine's sections, so the
precedence is the same everywhere: CLI flag > environment > file > default. Every bound on what a client may send
lives here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the bound one is logged)
    served_model_name: str | None = None  # the `model` clients must send; None: the engine's model name
    # requests accepted beyond those the engine runs at once (scheduler.max_num_seqs); past it a request gets 503
    # with Retry-After. Counts engine requests: a request with n=4 takes four.
    max_queued_requests: int = 256
    retry_after_s: int = 1  # the Retry-After of a 503
    shutdown_timeout_s: float = 30.0  # SIGTERM: in-flight requests may finish for this long, then they are cut
    max_request_bytes: int = 1 << 20  # request bodies beyond it get 413, unread
    max_choices: int = 64  # engine requests one HTTP request may make (prompts x n)
    log_stats_interval_s: float = 10.0  # the periodic throughput / cache log line (0: off)
    # prefill/decode disaggregation (kvtide/server/pd.py): "both" serves whole requests; "prefill" also serves its
    # cached KV at /v1/kv/pull; "decode" pulls a request's KV named by its kv_transfer_params before running it
    role: str = "both"
    advertise_url: str | None = None  # the URL peers reach this instance at (None: http://host:port)
    kv_transport: str = "mooncake"  # mooncake (Mooncake Transfer Engine) | inproc (one process, tests)
    kv_transfer_host: str = "127.0.0.1"  # the transport's local address
    kv_transfer_protocol: str = "tcp"  # tcp | rdma (Mooncake)
    kv_transfer_timeout_s: float = 30.0  # a hand-off not complete by then is abandoned: the prompt is recomputed
    # the largest receive buffer a decode instance allocates for one request, and the most either role keeps
    # registered for reuse between hand-offs (transfer/transport/pool.py)
    kv_transfer_max_bytes: int = 8 << 30
    kv_profiles: str | None = None  # a KVServe profile table (kvtide bench kvserve-profiles); None: the bundled model's
    kv_bandwidth_guess_gbps: float = 10.0  # what the policy assumes of a peer before its first measured transfer
    kv_pacing_gbps: float | None = None  # sender-side token bucket on the transport (None: the link's own rate)
    kv_min_quality: float = 1.0  # a request's default minimum relative quality (1.0: lossless)
    # a decode instance takes lossy hand-offs only when told: their KV then enters its cache like any other, so
    # later requests sharing the prefix reuse it (a deployment's choice); otherwise every hand-off is lossless
    kv_accept_lossy: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"ServerConfig.host must be a non-empty string, got {self.host!r}")
        _int(self, "port", 0, 65535)
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name.strip()):
            raise ValueError(f"ServerConfig.served_model_name must be None or a non-empty string, "
                             f"got {self.served_model_name!r}")
        _int(self, "max_queued_requests", 0)
        _int(self, "retry_after_s", 0)
        _int(self, "max_request_bytes", 1024)
        _int(self, "max_choices", 1)
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"ServerConfig.role must be both, prefill or decode, got {self.role!r}")
        if self.kv_transport not in ("mooncake", "inproc"):
            raise ValueError(f"ServerConfig.kv_transport must be mooncake or inproc, got {self.kv_transport!r}")
        if self.kv_transfer_protocol not in ("tcp", "rdma"):
            raise ValueError(f"ServerConfig.kv_transfer_protocol must be tcp or rdma, got {self.kv_transfer_protocol!r}")
        if self.advertise_url is not None and (not isinstance(self.advertise_url, str)
                                               or not self.advertise_url.startswith(("http://", "https://"))):
            raise ValueError(f"ServerConfig.advertise_url must be None or an http(s):// URL, got {self.advertise_url!r}")
        _int(self, "kv_transfer_max_bytes", 1 << 20)
        for name in ("kv_transfer_timeout_s", "kv_bandwidth_guess_gbps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"ServerConfig.{name} must be a finite number > 0, got {v!r}")
        v = self.kv_pacing_gbps
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
            raise ValueError(f"ServerConfig.kv_pacing_gbps must be None or a finite number > 0, got {v!r}")
        if not isinstance(self.kv_accept_lossy, bool):
            raise ValueError(f"ServerConfig.kv_accept_lossy must be true or false, got {self.kv_accept_lossy!r}")
        v = self.kv_min_quality
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ValueError(f"ServerConfig.kv_min_quality must be a number in [0, 1], got {v!r}")
        for name in ("shutdown_timeout_s", "log_stats_interval_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"ServerConfig.{name} must be a finite number of seconds >= 0, got {v!r}")


def _int(cfg: ServerConfig, name: str, low: int, high: int | None = None) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"ServerConfig.{name} must be an integer {bound}, got {v!r}")


def role_restore_defaults(role: str, page_size: int) -> dict[str, Any]:
    """A P/D role's KV tier (under the file, env and flags): in memory, chunks of one page so a hand-off covers
    all but the prompt's last partial page; the decode side loads what arrives rather than planning a recompute,
    and keeps no copies of its own requests."""
    if role == "prefill":
        return {"store": "memory", "chunk_tokens": page_size, "write_on_finish": True}
    return {"store": "memory", "chunk_tokens": page_size, "method": "load", "write_on_finish": False, "spill": False}
