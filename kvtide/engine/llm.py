"""`LLM`: the offline facade over `LLMEngine` (batch generate, token streaming, chat)."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence as Seq

from ..config import CacheConfig, EngineConfig, SchedulerConfig
from .llm_engine import LLMEngine, RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """LLM(model="smollm2-135m", device="cpu", cache=CacheConfig(...), ...).generate(prompts, params)."""

    def __init__(self, model: str = "smollm2-135m", *, progress: bool = True, cache: CacheConfig | None = None,
                 scheduler: SchedulerConfig | None = None, **engine_kwargs):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = set(engine_kwargs) - fields
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(fields))}")
        config = EngineConfig(model=model, cache=cache or CacheConfig(), scheduler=scheduler or SchedulerConfig(),
                              **engine_kwargs)
        self.engine = LLMEngine(config, progress=progress)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """One finished output per prompt, in prompt order. All prompts are validated before any runs."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if not prompts:
            return []
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, plist)):
                try:
                    ids.append(self.engine.add_request(p, sp))
                except (ValueError, TypeError) as e:
                    raise type(e)(f"prompt {i}: {e}") from None
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields outputs as tokens arrive; each carries `new_text` and `new_token_ids`. Other queued requests run too."""
        rid = self.engine.add_request(prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)

    def chat_prompt(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.chat_prompt(messages)], params)[0]
