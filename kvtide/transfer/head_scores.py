"""Offline head scores for MixHQ and the DuoAttention-like press: how much each KV head retrieves.

Method (cheap, and exactly what the press would throw away): run the real model over real prose and code
windows (corpus.py); for the last ``queries`` positions of each window, take each query head's softmax
attention and sum the mass on keys *outside* the streaming window, i.e. past the first ``sink`` tokens and
before the ``win`` most recent ones. Average over those queries, the windows, both workloads and the query
heads sharing a KV head. A head with a high score reads far context (retrieval head: keep it precise); a
low score means a sink+recent window would lose little (streaming head: quantise hard or prune).

Scores are [layers, kv_heads] in [0, 1], deterministic for given inputs, and stored as JSON under
``kvtide/transfer/data/head_scores_<model>.json``; ``python -m kvtide.transfer.head_scores`` writes them.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .corpus import WORKLOADS, windows
from .quality import prefix_kv

DATA_DIR = Path(__file__).with_name("data")


@dataclass(frozen=True)
class HeadScoreConfig:
    tokens: int = 512  # window length
    samples: int = 4  # windows per workload
    queries: int = 128  # scored query positions at the end of each window
    sink: int = 4
    win: int = 64

    def __post_init__(self) -> None:
        if min(self.tokens, self.samples, self.queries) < 1 or self.sink < 0 or self.win < 0:
            raise ValueError(f"bad head-score config {self}")
        if self.queries > self.tokens or self.sink + self.win >= self.tokens - self.queries + 1:
            raise ValueError("every scored query must see keys beyond sink + win: need sink + win < tokens - queries + 1")


def far_mass(q: torch.Tensor, k: torch.Tensor, queries: int, sink: int, win: int) -> torch.Tensor:
    """Mean causal attention mass beyond sink + recent window of the last ``queries`` positions: [Hq].
    q, k: [S, Hq, T, D]."""
    T, D = q.shape[2], q.shape[3]
    qp = torch.arange(T - queries, T)
    kp = torch.arange(T)
    s = (q[:, :, -queries:] @ k.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
    p = torch.softmax(s, -1)
    far = (kp[None, :] >= sink) & (kp[None, :] <= qp[:, None] - win)
    return (p * far).sum(-1).mean((0, 2))


def measure_head_scores(model: torch.nn.Module, tok, config: HeadScoreConfig | None = None) -> torch.Tensor:
    """[layers, kv_heads] float64 scores of ``model`` on prose and code windows (see module docstring)."""
    cfg = config or HeadScoreConfig()
    a = model.args
    total = torch.zeros(a.num_layers, a.num_heads, dtype=torch.float64)

    def probe(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        total[layer] += far_mass(q, k, cfg.queries, cfg.sink, cfg.win).double()

    for wl in WORKLOADS:
        ids = torch.tensor(windows(tok, wl, cfg.samples, cfg.tokens), dtype=torch.long)
        prefix_kv(model, ids, probe)
    per_q = total / len(WORKLOADS)
    return per_q.view(a.num_layers, a.num_kv_heads, a.num_heads // a.num_kv_heads).mean(-1)


def path_for(model_name: str) -> Path:
    return DATA_DIR / f"head_scores_{model_name}.json"


def save_head_scores(path: Path, scores: torch.Tensor, model_name: str, config: HeadScoreConfig) -> None:
    doc = {"model": model_name, "method": "attention mass beyond sink+recent window (see head_scores.py)",
           "config": asdict(config), "workloads": list(WORKLOADS), "measured": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "shape": list(scores.shape), "scores": scores.tolist()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def load_head_scores(model_name: str, measure_if_missing: bool = True) -> torch.Tensor:
    """Stored scores of a bundled model; measured (and stored) on first use when absent."""
    p = path_for(model_name)
    if p.exists():
        doc = json.loads(p.read_text())
        s = torch.tensor(doc["scores"], dtype=torch.float64)
        if list(s.shape) != doc["shape"]:
            raise ValueError(f"{p}: scores shape {list(s.shape)} != recorded {doc['shape']}")
        return s
    if not measure_if_missing:
        raise FileNotFoundError(p)
    from .quality import bundled_model
    model, tok = bundled_model(model_name)
    cfg = HeadScoreConfig()
    s = measure_head_scores(model, tok, cfg)
    save_head_scores(p, s, model_name, cfg)
    return s


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="measure head scores of bundled models on real text")
    ap.add_argument("--model", action="append", help="bundled model name (repeatable; default both)")
    ap.add_argument("--tokens", type=int, default=HeadScoreConfig.tokens)
    ap.add_argument("--samples", type=int, default=HeadScoreConfig.samples)
    args = ap.parse_args(argv)
    from .quality import bundled_model
    cfg = HeadScoreConfig(tokens=args.tokens, samples=args.samples)
    for name in args.model or ["smollm2-135m", "qwen2.5-coder-0.5b"]:
        t0 = time.perf_counter()
        model, tok = bundled_model(name)
        s = measure_head_scores(model, tok, cfg)
        save_head_scores(path_for(name), s, name, cfg)
        print(f"{name}: {tuple(s.shape)} mean {float(s.mean()):.3f} min {float(s.min()):.3f} "
              f"max {float(s.max()):.3f} ({time.perf_counter() - t0:.0f} s) -> {path_for(name)}")


if __name__ == "__main__":
    main()
