"""kvtide inside vLLM: a KV connector (``KVConnectorBase_V1``) over kvtide's stores, verified records, ZipFusion
codec and a planned load/recompute split.

    from vllm import LLM
    from vllm.config import KVTransferConfig
    llm = LLM(model, kv_transfer_config=KVTransferConfig(
        kv_connector="KvtideConnector", kv_connector_module_path="kvtide.integrations.vllm", kv_role="kv_both",
        kv_load_failure_policy="recompute", kv_connector_extra_config={"store": "disk:/var/kv", "chunk_tokens": 256}))

``KvtideConnector`` (and ``flush_saves``) import vLLM; the other modules of this package do not, so the config,
layouts, split planner and both sides' logic are usable and testable without it.
"""
from __future__ import annotations

from typing import Any

__all__ = ["KvtideConnector", "flush_saves", "process_totals"]


def __getattr__(name: str) -> Any:  # vLLM's factory does getattr(import_module(path), "KvtideConnector")
    if name in ("KvtideConnector", "flush_saves"):
        from kvtide.integrations.vllm import connector

        return getattr(connector, name)
    if name == "process_totals":
        from kvtide.integrations.vllm.stats import process_totals

        return process_totals
    raise AttributeError(name)
