"""Benchmarks that run against any OpenAI-compatible server (``kvtide bench serve``), kvtide's or vLLM's alike."""
