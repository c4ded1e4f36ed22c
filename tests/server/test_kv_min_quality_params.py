"""A request's ``kv_transfer.min_quality`` (else the server's ``kv_min_quality``) reaches its SamplingParams, where
the restorer reads the quality budget of a restoration (lossless by default)."""
from __future__ import annotations

from types import SimpleNamespace

from kvtide.server.config import ServerConfig
from kvtide.server.protocol import parse_completion
from kvtide.server.serving import Serving


def _params(body: dict, default: float = 1.0) -> list[float]:
    host = SimpleNamespace(cfg=ServerConfig(kv_min_quality=default), max_seq_len=4096)
    req = parse_completion({"prompt": [1, 2, 3], "max_tokens": 4, **body}, 4)
    return [p.kv_min_quality for p in Serving._params(host, req, [[1, 2, 3]])]


def test_lossless_unless_asked() -> None:
    assert _params({}) == [1.0]
    assert _params({"kv_transfer": {"min_quality": 0.97}}) == [0.97]
    assert _params({}, default=0.9) == [0.9]
    assert _params({"kv_transfer": {"min_quality": 1.0}}, default=0.9) == [1.0]
