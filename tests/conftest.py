"""Shared fixtures: bundled models are converted once per machine (cache dir), engines built once per session."""
from __future__ import annotations

import functools
import gc
from collections import OrderedDict

import pytest
import torch

from kvtide.models.registry import BUNDLED

torch.set_num_threads(max(1, torch.get_num_threads()))

MODELS = list(BUNDLED)


def require_model(name: str) -> None:
    if not BUNDLED[name].installed():
        pytest.fail(f"bundled model {name} is not installed: {BUNDLED[name].install_command}")


@functools.cache
def hf_reference(name: str):
    """transformers' own model and tokenizer, loaded straight from the GGUF (its dequantiser, not ours)."""
    import logging
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kvtide.models.convert import ensure_converted, gguf_file

    hf_logging.set_verbosity(logging.ERROR)
    m = BUNDLED[name]
    ensure_converted(m, progress=False)
    with gguf_file(m, Path(tempfile.gettempdir())) as gguf:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    return model, tok


_ENGINES: OrderedDict[str, object] = OrderedDict()
MAX_ENGINES = 3  # each holds its weights and KV cache: keep the suite well inside a 24 GiB machine


def engine_llm(name: str, **kw):
    """One LLM per (model, options), reused across tests (loading is the slow part); least recently used dropped."""
    from kvtide import LLM

    key = f"{name}|{kw!r}"
    if key in _ENGINES:
        _ENGINES.move_to_end(key)
        return _ENGINES[key]
    while len(_ENGINES) >= MAX_ENGINES:
        _ENGINES.popitem(last=False)
        gc.collect()
    _ENGINES[key] = LLM(name, progress=False, **kw)
    return _ENGINES[key]
