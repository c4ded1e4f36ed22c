"""Resolve a model name or path to (model, tokenizer): bundled name, HF safetensors directory, or .gguf file."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .convert import convert_gguf, ensure_converted
from .fingerprint import weights_fingerprint
from .llama import CausalLM, ModelArgs
from .registry import BUNDLED, ModelNotFoundError, cache_root, get_bundled
from .tokenizer import NullTokenizer, Tokenizer


def resolve_model_dir(model: str, progress: bool = True) -> Path:
    """A directory holding config.json, *.safetensors and tokenizer files, converting GGUF on first use."""
    if model in BUNDLED:
        return ensure_converted(BUNDLED[model], progress)
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFoundError(f"{p} is a directory but holds no config.json (expected a Hugging Face checkpoint)")
        return p
    if p.is_file() and p.suffix == ".gguf":
        key = hashlib.sha256(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}".encode()).hexdigest()[:16]
        out = cache_root() / "models" / f"{p.stem}-{key}"
        return out if (out / "config.json").exists() else convert_gguf(p, out, progress)
    get_bundled(model)  # raises the "unknown model" error listing bundled names
    raise AssertionError("unreachable")


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {directory}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


def build_model(args: ModelArgs, state_dict: dict[str, torch.Tensor] | None, device: torch.device | str,
                dtype: torch.dtype, max_positions: int | None = None, seed: int = 0) -> CausalLM:
    """Instantiate without a wasted random init; random weights (std 0.02) when no state dict is given."""
    with torch.device("meta"):
        model = CausalLM(args, max_positions)
    model.to_empty(device=device)
    if state_dict is None:
        gen = torch.Generator(device=device).manual_seed(seed)
        for p in model.parameters():
            p.data.normal_(0.0, 0.02, generator=gen) if p.dim() > 1 else p.data.fill_(1.0)
            p.data = p.data.to(dtype)
    else:
        sd = dict(state_dict)
        if args.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [m for m in missing if not (args.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.to(dtype)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    from .rope import rope_tables

    cos, sin = rope_tables(args.head_dim, args.rope_theta, args.rope_scaling, max_positions or args.max_position_embeddings)
    model.rope_cos = cos.to(device)
    model.rope_sin = sin.to(device)
    return model.eval().requires_grad_(False)


RANDOM_PRESETS = {
    "llama3-8b": ModelArgs.llama3_8b,
    "tiny": lambda: ModelArgs(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=32, vocab_size=1000, max_position_embeddings=4096),
    # the CUDA ZipFusion kernel's shapes (head_dim 128, GQA group 4) at test size
    "tiny-d128": lambda: ModelArgs(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8, num_kv_heads=2,
                                   head_dim=128, vocab_size=1000, max_position_embeddings=4096),
}


def load_model(model: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               max_positions: int | None = None, progress: bool = True) -> tuple[CausalLM, Tokenizer, str]:
    """Returns the model, its tokenizer and the resolved directory.

    `random:<preset>` (e.g. random:llama3-8b) builds a model of that shape with random weights and no tokenizer,
    for GPU benchmarks at shapes whose weights are not reachable here.
    The model's ``weights_fingerprint`` names its weights by content (``kvtide.models.fingerprint``).
    """
    if model.startswith("random:"):
        preset = model.split(":", 1)[1]
        if preset not in RANDOM_PRESETS:
            raise ModelNotFoundError(f"unknown random preset '{preset}' (known: {', '.join(RANDOM_PRESETS)})")
        args = RANDOM_PRESETS[preset]()
        net = build_model(args, None, device, dtype, max_positions or 32768)
        net.weights_fingerprint = weights_fingerprint(model)
        return net, NullTokenizer(), model
    directory = resolve_model_dir(model, progress)
    cfg = json.loads((directory / "config.json").read_text())
    args = ModelArgs.from_hf_config(cfg)
    net = build_model(args, load_state_dict(directory), device, dtype, max_positions)
    net.weights_fingerprint = weights_fingerprint(model, directory)
    return net, Tokenizer(directory), str(directory)
