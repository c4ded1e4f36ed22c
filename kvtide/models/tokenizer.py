"""Tokenizer and chat template read from a model directory, on the `tokenizers` library (no transformers at run time)."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream


class Tokenizer:
    def __init__(self, directory: str | Path):
        d = Path(directory)
        if not (d / "tokenizer.json").exists():
            raise FileNotFoundError(f"no tokenizer.json in {d}")
        self._tok = _HFTokenizer.from_file(str(d / "tokenizer.json"))
        tcfg = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").exists() else {}
        mcfg = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
        template = tcfg.get("chat_template")
        if (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text()
        self.chat_template: str | None = template
        self.bos_token = _token_str(tcfg.get("bos_token"))
        self.eos_token = _token_str(tcfg.get("eos_token"))
        eos: set[int] = set()
        cfg_eos = mcfg.get("eos_token_id")
        if isinstance(cfg_eos, int):
            eos.add(cfg_eos)
        elif isinstance(cfg_eos, list):
            eos.update(cfg_eos)
        if self.eos_token and (i := self._tok.token_to_id(self.eos_token)) is not None:
            eos.add(i)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = self._tok.get_vocab_size()
        self._template = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def detokenizer(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self._tok)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the model's own Jinja template, in the sandbox transformers uses."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use plain prompts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg: str):
                raise ValueError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )


class NullTokenizer:
    """For random-weight models: prompts must be token ids, and no text is produced."""

    chat_template = None
    eos_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str) -> list[int]:
        raise ValueError("this model has no tokenizer (random weights): pass prompts as lists of token ids")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def detokenizer(self) -> "_NullDetokenizer":
        return _NullDetokenizer()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise ValueError("this model has no tokenizer or chat template")


class _NullDetokenizer:
    def step(self, token_id: int) -> str:
        return ""


class IncrementalDetokenizer:
    """Text deltas as tokens arrive; holds back bytes that do not yet form whole UTF-8 characters."""

    def __init__(self, tok: _HFTokenizer):
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, token_id) or ""


def _token_str(v) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v
