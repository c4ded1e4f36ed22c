"""`LLM`: the offline facade over `LLMEngine` (batch generate, token streaming, chat)."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence as Seq
from typing import Any

from ..config import EngineConfig
from ..config_load import load_config
from .llm_engine import LLMEngine, RequestOutput
from .loop import EngineLoop, RequestError
from .sampling_params import SamplingParams


class LLM:
    """LLM("smollm2-135m", device="cpu", cache=CacheConfig(...), ...).generate(prompts, params).

    Settings resolve as explicit arguments > ``KVTIDE_*`` environment > ``config`` file (YAML/JSON) > defaults
    (`kvtide.config_load`); ``config`` may also be a whole ``EngineConfig``. Safe to share between threads."""

    def __init__(self, model: str | None = None, *, config: "str | os.PathLike | EngineConfig | None" = None,
                 progress: bool = True, **options: Any):
        explicit = dict(options)
        if model is not None:
            explicit["model"] = model
        if isinstance(config, EngineConfig):
            cfg = dataclasses.replace(config, **explicit) if explicit else config
        else:
            cfg = load_config(explicit, file=config)
        self.config = cfg
        self.engine = LLMEngine(cfg, progress=progress)
        self.tokenizer = self.engine.tokenizer
        self.loop = EngineLoop(self.engine)  # callers step the engine in turn; ``llm.loop.start()`` for a thread

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """One finished output per prompt, in prompt order. All prompts are validated before any runs (a bad one
        raises, naming its index). A request that fails while it runs comes back with ``finish_reason="error"``
        and ``.error``; the others are unaffected. Safe to call from many threads at once."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if not prompts:
            return []
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} sampling params for {len(prompts)} prompts")
        handles = self.loop.submit_many(prompts, plist)
        try:
            return [h.result() for h in handles]
        finally:
            for h in handles:  # interrupted (KeyboardInterrupt): nothing of this call keeps running
                h.abort()

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields outputs as tokens arrive; each carries `new_text` and `new_token_ids`. Other requests run too.

        A request that fails raises ``RequestError`` (its partial output on ``.output``) after what it produced.
        Closing the generator, or dropping it, aborts the request."""
        handle = self.loop.submit(prompt, params)
        try:
            for out in handle:
                if out.finish_reason == "error":
                    raise RequestError(out)
                yield out
        finally:
            handle.abort()

    def chat_prompt(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.chat_prompt(messages)], params)[0]
