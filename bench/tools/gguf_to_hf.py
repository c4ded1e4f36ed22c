"""Write a bundled model's GGUF as a plain Hugging Face directory, for engines that read HF checkpoints (vLLM).

transformers dequantises the GGUF itself (not kvtide's converter), so the directory is an independent copy of the
same weights. A GGUF-loaded model carries a ``quantization_config`` and refuses ``save_pretrained``; the model is
rebuilt from its config without it and given the loaded state dict, then saved as fp32 safetensors with the
tokenizer and a generation config.

    python bench/tools/gguf_to_hf.py --out /work/smollm2-hf [--model smollm2-135m] [--check]
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import torch

from kvtide.models.convert import gguf_file
from kvtide.models.registry import DEFAULT_MODEL, get_bundled

CHECK_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
]


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity(logging.ERROR)


def load_from_gguf(gguf: Path):
    """transformers' own GGUF loader: (fp32 model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tok


def rebuild_plain(model) -> torch.nn.Module:
    """The same architecture and weights without the GGUF quantization_config, so save_pretrained accepts it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"state dict does not fit the rebuilt model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    plain.tie_weights()
    return plain.eval()


def write_hf_dir(model_name: str, out: Path) -> Path:
    """Convert the bundled model `model_name` into `out` (config.json, model.safetensors, tokenizer, generation)."""
    from transformers import GenerationConfig

    _quiet_transformers()
    with gguf_file(get_bundled(model_name), Path(tempfile.gettempdir())) as gguf:
        src, tok = load_from_gguf(gguf)
    plain = rebuild_plain(src)
    plain.generation_config = GenerationConfig(
        bos_token_id=plain.config.bos_token_id, eos_token_id=plain.config.eos_token_id,
        pad_token_id=tok.pad_token_id, do_sample=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def greedy(model, tok, prompt: str, n: int) -> list[int]:
    x = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                           pad_token_id=model.config.eos_token_id)
    return y[0, x.shape[1]:].tolist()


def check_against_gguf(model_name: str, out: Path, n: int = 16) -> bool:
    """Greedy tokens from the written directory equal those of the GGUF loaded directly, prompt by prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    with gguf_file(get_bundled(model_name), Path(tempfile.gettempdir())) as gguf:
        ref_model, ref_tok = load_from_gguf(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    ok = True
    for prompt in CHECK_PROMPTS:
        same_ids = tok.encode(prompt) == ref_tok.encode(prompt)
        a, b = greedy(model, tok, prompt, n), greedy(ref_model, ref_tok, prompt, n)
        ok &= same_ids and a == b
        print(f"{'same' if same_ids and a == b else 'DIFFERENT'}: {prompt!r} -> {tok.decode(a)!r}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory to write (created if missing)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name")
    ap.add_argument("--check", action="store_true", help="compare greedy output with the GGUF loaded directly")
    args = ap.parse_args(argv)
    write_hf_dir(args.model, args.out)
    print(f"wrote {args.out}: {', '.join(sorted(p.name for p in args.out.iterdir()))}")
    if args.check and not check_against_gguf(args.model, args.out):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
