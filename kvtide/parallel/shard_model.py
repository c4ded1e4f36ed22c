"""Build only one shard of a model: its layers, plus the embeddings (first shard) and norm + LM head (last).

The other layers are empty placeholders, so global layer indices stay valid (``CausalLM.hidden_states`` runs a
``range`` of them) while memory holds 1/S of the layers. Checkpoint weights are read tensor by tensor
(safetensors ``safe_open``), never the whole file; random weights are drawn per parameter name from a seeded
generator, so every layout (S = 1, 2, 4) gets the same model.
"""

from __future__ import annotations

import json
import zlib

import torch
from torch import nn

from kvtide.models.llama import CausalLM, ModelArgs
from kvtide.models.loader import RANDOM_PRESETS, resolve_model_dir
from kvtide.models.registry import ModelNotFoundError
from kvtide.models.rope import rope_tables
from kvtide.models.tokenizer import NullTokenizer, Tokenizer

RANDOM_MAX_POSITIONS = 32768  # as kvtide.models.loader.load_model for random presets


def model_args(model: str) -> ModelArgs:
    """The architecture of a model name (bundled name, directory, or ``random:<preset>``)."""
    if model.startswith("random:"):
        preset = model.split(":", 1)[1]
        if preset not in RANDOM_PRESETS:
            raise ModelNotFoundError(f"unknown random preset '{preset}' (known: {', '.join(RANDOM_PRESETS)})")
        return RANDOM_PRESETS[preset]()
    cfg = json.loads((resolve_model_dir(model, progress=False) / "config.json").read_text())
    return ModelArgs.from_hf_config(cfg)


def _prune(net: CausalLM, layers: range) -> None:
    a = net.args
    last = layers.stop == a.num_layers
    for i in range(a.num_layers):
        if i not in layers:
            net.model.layers[i] = nn.Module()
    if layers.start != 0 and not (last and a.tie_word_embeddings):
        net.model.embed_tokens = nn.Identity()  # type: ignore[assignment]
    if not last:
        net.model.norm = nn.Identity()  # type: ignore[assignment]
        net.lm_head = nn.Identity()  # type: ignore[assignment]


def load_shard(model: str, layers: range, device: torch.device, dtype: torch.dtype, seed: int = 0,
               max_positions: int | None = None) -> tuple[CausalLM, Tokenizer | NullTokenizer]:
    """The shard of ``model`` owning ``layers`` (global indices), on ``device`` in ``dtype``, and its tokenizer."""
    args = model_args(model)
    if not layers or layers.start < 0 or layers.stop > args.num_layers:
        raise ValueError(f"layers {layers} outside the model's {args.num_layers}")
    random = model.startswith("random:")
    if max_positions is None:
        max_positions = RANDOM_MAX_POSITIONS if random else args.max_position_embeddings
    with torch.device("meta"):
        net = CausalLM(args, max_positions)
    _prune(net, layers)
    net.to(dtype)
    net.to_empty(device=device)
    if args.tie_word_embeddings and layers.stop == args.num_layers:
        net.lm_head.weight = net.model.embed_tokens.weight
    params = dict(net.named_parameters())  # tied weights appear once
    if random:
        for name, p in params.items():
            if p.dim() > 1:
                g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                p.data.normal_(0.0, 0.02, generator=g)
            else:
                p.data.fill_(1.0)
        tok: Tokenizer | NullTokenizer = NullTokenizer()
    else:
        directory = resolve_model_dir(model, progress=False)
        _load_tensors(directory, params)
        tok = Tokenizer(directory)
    cos, sin = rope_tables(args.head_dim, args.rope_theta, args.rope_scaling, max_positions)
    net.rope_cos = cos.to(device)
    net.rope_sin = sin.to(device)
    return net.eval().requires_grad_(False), tok


def _load_tensors(directory, params: dict[str, nn.Parameter]) -> None:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {directory}")
    todo = set(params)
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for name in set(fh.keys()) & todo:
                    params[name].copy_(fh.get_tensor(name))
                    todo.discard(name)
    if todo:
        raise ValueError(f"checkpoint {directory} lacks {sorted(todo)[:5]}")
