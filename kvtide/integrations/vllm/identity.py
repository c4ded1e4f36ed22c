"""The store keys' root for a vLLM model: what besides the tokens decides whether stored KV is reusable.

Both sides of the connector (vLLM's scheduler and its worker) build the same ``KeySpace`` from the same config:
the model's architecture and shapes, a fingerprint of the weights' *content* (a local directory's safetensors
files, hashed once per file version and cached: ``kvtide.models.fingerprint``), a hash of the model config (path
and version fields left out, so the same weights elsewhere share entries), the dtype vLLM computes in and the KV
cache dtype, the chunk size, the namespace and the secret's salt. "vllm/" in the compute dtype keeps entries of
vLLM apart from kvtide's own engine, whose kernels differ. A model named by a hub id rather than a directory is
bound by its name and revision only (vLLM resolves the files; their content is not hashed).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from kvtide.models.fingerprint import weights_fingerprint
from kvtide.store.auth import RecordAuth, resolve_secret
from kvtide.store.keys import KeySpace


def weights_id(model: str, revision: str | None = None) -> str:
    """The weights' fingerprint: by content for a local directory of safetensors, else name and revision."""
    p = Path(model).expanduser()
    if p.is_dir() and any(p.glob("*.safetensors")):
        return weights_fingerprint(str(p.resolve()), p.resolve())
    return f"name:{model}@{revision or 'default'}"


def config_id(hf_config: Mapping[str, Any]) -> str:
    """Hash of a model config's fields, leaving out where it was read from and which library wrote it."""
    kept = {k: v for k, v in hf_config.items() if not k.startswith("_") and k != "transformers_version"}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:32]


def vllm_keyspace(*, model_type: str, num_layers: int, hidden_size: int, num_kv_heads: int, head_dim: int,
                  weights: str, model_config: str, dtype: str, kv_dtype: str, chunk_tokens: int,
                  namespace: str | None, secret: str | None) -> KeySpace:
    """The ``KeySpace`` of a vLLM model (``secret`` None: ``$KVTIDE_STORE_SECRET`` if set)."""
    key = resolve_secret(secret)
    return KeySpace(f"vllm|{model_type}|{num_layers}x{hidden_size}x{num_kv_heads}x{head_dim}", chunk_tokens,
                    kv_dtype, weights=weights, model_config=model_config, compute_dtype=f"vllm/{dtype}",
                    namespace=namespace, salt=RecordAuth(key).key_salt if key is not None else b"")
