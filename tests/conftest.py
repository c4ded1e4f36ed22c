"""Shared fixtures: bundled models are converted once per machine (cache dir), engines built once per session."""
from __future__ import annotations

import functools

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
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kvtide.models.convert import ensure_converted

    hf_logging.set_verbosity(logging.ERROR)
    m = BUNDLED[name]
    parts = m.gguf_parts()
    if len(parts) == 1:
        gguf = parts[0]
    else:  # the joined file is not kept by the converter; join once more for the reference
        import shutil
        import tempfile

        gguf = Path(tempfile.mkdtemp()) / f"{name}.gguf"
        with open(gguf, "wb") as dst:
            for p in parts:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 24)
    ensure_converted(m, progress=False)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    if len(parts) > 1:
        gguf.unlink()
    return model, tok


_ENGINES: dict[str, object] = {}


def engine_llm(name: str, **kw):
    """One LLM per (model, options) for the whole session: loading is the slow part."""
    from kvtide import LLM

    key = f"{name}|{kw!r}"
    if key not in _ENGINES:
        _ENGINES[key] = LLM(name, progress=False, **kw)
    return _ENGINES[key]
