"""kvtide: a KV-cache layer for LLM serving (engine, resident compression, restoration, transfer)."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineConfig", "CacheConfig", "SchedulerConfig", "RestoreConfig", "__version__"]


def __getattr__(name: str):
    # Lazy: `import kvtide` stays cheap for the CLI and for users of one submodule (codecs, planner, ...).
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams

        return SamplingParams
    if name in ("EngineConfig", "CacheConfig", "SchedulerConfig", "RestoreConfig"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'kvtide' has no attribute '{name}'")
