"""bench/tools/gguf_to_hf.py: the written HF directory loads in plain transformers and decodes as kvtide does."""
from __future__ import annotations

import json

import torch

from bench.tools.gguf_to_hf import greedy, write_hf_dir
from kvtide import CacheConfig, SamplingParams
from tests.conftest import engine_llm, require_model

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]
N = 12


def test_hf_dir_greedy_equals_kvtide(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_model(MODEL)
    out = write_hf_dir(MODEL, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    assert {"model.safetensors", "tokenizer.json", "generation_config.json"} <= {p.name for p in out.iterdir()}

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    llm = engine_llm(MODEL, cache=CacheConfig(kv_dtype="float32"))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N))
    for prompt, o in zip(PROMPTS, outs):
        assert tok.encode(prompt) == o.prompt_token_ids, prompt
        assert greedy(model, tok, prompt, N) == o.token_ids, prompt
