"""Llama-family decoder (Llama, Qwen2) in plain torch, over a flat batch of tokens.

The model sees one flat sequence of tokens from many requests (continuous batching: no padding); everything that
knows which token belongs to which request and where its KV lives sits behind the `attention` callable passed to
`forward`. Module names equal Hugging Face's, so checkpoints load without renaming.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .rope import apply_rope, rope_tables


@dataclass(frozen=True)
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    architecture: str = "llama"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelArgs.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(f"unsupported model_type '{model_type}' (supported: llama, qwen2)")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_scaling") or None
        theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # transformers >= 5 nests theta and scaling here
        if params:
            theta = params.get("rope_theta", theta)
            if params.get("rope_type", "default") != "default":
                rope = params
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta or 10000.0),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            architecture=model_type,
        )

    @classmethod
    def llama3_8b(cls, num_layers: int = 32) -> "ModelArgs":
        """Llama-3.1-8B shape, for GPU benchmarks with random weights."""
        return cls(
            hidden_size=4096, intermediate_size=14336, num_layers=num_layers, num_heads=32, num_kv_heads=8,
            head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
            max_position_embeddings=131072, architecture="llama",
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers, at 2 bytes per value."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


class Attention(Protocol):
    """Writes this layer's new K/V into the paged cache, then attends. q: [T, Hq, D], k/v: [T, Hk, D]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        a = args
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        self.shape = (a.num_heads, a.num_kv_heads, a.head_dim)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hq, hk, d = self.shape
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, hq, d), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, hk, d), cos, sin)
        return q, k, self.v_proj(x).view(t, hk, d)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = SelfAttention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, layer: int, h: torch.Tensor, cos, sin, attention: Attention) -> torch.Tensor:
        q, k, v = self.before_attention(h, cos, sin)
        return self.after_attention(h, attention(layer, q, k, v))

    # The two halves around the attention call, so a caller can run each as one CUDA graph (engine/cuda_graphs.py).
    # Every op in them works row by row: a row's output depends on that row's input alone.
    def before_attention(self, h: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.qkv(self.input_layernorm(h), cos, sin)

    def after_attention(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn.o_proj(attn.reshape(h.shape[0], -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    # what ``load_model`` loaded, by content (``kvtide.models.fingerprint``); None: built otherwise
    weights_fingerprint: str | None = None

    def __init__(self, args: ModelArgs, max_positions: int | None = None):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(args.head_dim, args.rope_theta, args.rope_scaling, max_positions or args.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
        layers: range | None = None, h: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run `layers` (all by default) over a flat token batch; `h` replaces the embeddings when resuming midway."""
        if h is None:
            h = self.embed(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        for i in layers if layers is not None else range(self.args.num_layers):
            h = self.model.layers[i](i, h, cos, sin, attention)
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows of ``positions``."""
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, for the rows that are sampled; float32 for the sampler."""
        return self.lm_head(self.model.norm(h)).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        h = self.hidden_states(input_ids, positions, attention)
        if logit_rows is not None:
            h = h[logit_rows]
        return self.logits(h)
