"""GGUF -> Hugging Face-style safetensors directory, done once per model and cached.

Dequantising a GGUF file takes seconds to minutes; loading safetensors takes well under one. The cache directory
is an ordinary HF checkpoint (config.json, model.safetensors, tokenizer.json, tokenizer_config.json), so the
same loader serves bundled models and any HF safetensors directory, and transformers can read it too.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .registry import BundledModel, ModelNotFoundError, cache_root, sha256_of

CONVERT_VERSION = 1

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}


def hf_tensor_name(gguf_name: str) -> str:
    """Map a GGUF tensor name (blk.3.attn_q.weight) to its HF name (model.layers.3.self_attn.q_proj.weight)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, base, suffix = parts[1], parts[2], parts[3]
        if base not in _LAYER_NAMES:
            raise ValueError(f"unsupported GGUF tensor {gguf_name}")
        return f"model.layers.{layer}.{_LAYER_NAMES[base]}.{suffix}"
    base, suffix = parts[0], parts[1]
    if base not in _TOP_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name}")
    return f"{_TOP_NAMES[base]}.{suffix}"


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's rotate-half halves)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def gguf_to_hf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture '{arch}' (supported: {', '.join(_ARCHS)})")
    cls, model_type = _ARCHS[arch]
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    hidden = int(g("embedding_length"))
    heads = int(g("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length")),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": "float32",
        "kvtide_convert_version": CONVERT_VERSION,
    }
    scaling = g("rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(g("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(g("rope.scaling.original_context_length", cfg["max_position_embeddings"])),
        }
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF files with precomputed rope_freqs (Llama 3.1 style) are not supported yet")
    return cfg


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Dequantise every tensor of a GGUF file into fp32 safetensors plus config and tokenizer files."""
    import gguf
    import torch
    from gguf import quants
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    cfg = gguf_to_hf_config(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        tensors: dict[str, torch.Tensor] = {}
        with _progress(progress) as bar:
            task = bar.add_task(f"dequantising {gguf_path.name}", total=len(reader.tensors))
            for t in reader.tensors:
                w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
                base = t.name.split(".")
                if cfg["model_type"] == "llama" and len(base) > 2 and base[2] in ("attn_q", "attn_k"):
                    n = cfg["num_attention_heads"] if base[2] == "attn_q" else cfg["num_key_value_heads"]
                    w = unpermute_rope(w, n)
                tensors[hf_tensor_name(t.name)] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
                bar.advance(task)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        _convert_tokenizer(gguf_path, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _convert_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """transformers knows how to rebuild a fast tokenizer (vocab, merges, pre-tokenizer, chat template) from GGUF."""
    import logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    finally:
        hf_logging.set_verbosity(level)
    tok.save_pretrained(str(out_dir))


class _progress:
    """A rich progress bar on stderr (stdout carries the CLI's generated text), or a silent stand-in."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=Console(stderr=True))
            return self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            return self._bar.__exit__(*exc)
        return False

    def add_task(self, *a, **k):
        return 0

    def advance(self, *a, **k):
        pass


def bundled_dir(model: BundledModel) -> Path:
    return cache_root() / "models" / model.name


def ensure_converted(model: BundledModel, progress: bool = True) -> Path:
    """Return the converted directory of a bundled model, converting it on first use."""
    out = bundled_dir(model)
    cfg = out / "config.json"
    if cfg.exists() and json.loads(cfg.read_text()).get("kvtide_convert_version") == CONVERT_VERSION:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with gguf_file(model, out.parent) as path:
        return convert_gguf(path, out, progress)


@contextlib.contextmanager
def gguf_file(model: BundledModel, scratch: Path):
    """The model's GGUF file; split packages are joined once into `scratch`, checked, and removed afterwards."""
    parts = model.gguf_parts()
    if len(parts) == 1:
        yield parts[0]
        return
    joined_dir = Path(tempfile.mkdtemp(prefix=".join-", dir=scratch))
    joined = joined_dir / f"{model.name}.gguf"
    try:
        with open(joined, "wb") as dst:
            for p in parts:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 24)
        if model.gguf_sha256 and sha256_of([joined]) != model.gguf_sha256:
            raise ModelNotFoundError(
                f"the pieces of '{model.name}' do not add up to the expected file (sha256 mismatch); "
                f"reinstall with: {model.install_command} --force-reinstall"
            )
        yield joined
    finally:
        shutil.rmtree(joined_dir, ignore_errors=True)
