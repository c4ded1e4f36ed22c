"""A live `kvtide serve` app on 127.0.0.1 (uvicorn in a thread over one SmolLM2 engine), shared by the server tests."""
from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from kvtide import SamplingParams
from kvtide.benchmarks.procs import free_port
from kvtide.engine.llm import LLM
from kvtide.server.app import build_app
from kvtide.server.config import ServerConfig
from kvtide.server.serving import Serving

from .app_thread import app_thread

MODEL = "smollm2-135m"
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# greedy tokens with clear logit margins (tests/engine/test_loop.py): batches of other shapes cannot flip them
PROMPTS = ["Item 0: a list of things that", "Item 7: a list of things that", "Once upon a time", "def f(x):",
           "The capital of France is", "import numpy as np", "The first president of the United States",
           "In the beginning", "Dear friend,", "SELECT * FROM", "The best way to learn"]
MAX_REQUEST_BYTES = 64 << 10


@dataclass
class Live:
    llm: LLM
    serving: Serving
    url: str  # http://127.0.0.1:PORT

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)

    def reference(self, prompt: str, max_tokens: int = MAX_TOKENS):
        """The greedy output of LLM.generate on the same engine."""
        return self.llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine holds no request and no page (what an aborted request must leave)."""
        eng = self.llm.engine
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not eng.seqs and not eng.has_unfinished() and not any(eng.block_manager.ref_count) \
                    and self.serving.admission.in_flight == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"engine not idle after {timeout} s: {list(eng.seqs)}, "
                             f"{self.serving.admission.in_flight} admitted")


@pytest.fixture(scope="session")
def live():
    llm = LLM(MODEL, device="cpu", cache={"num_pages": 256}, progress=False)
    cfg = ServerConfig(port=free_port(), max_request_bytes=MAX_REQUEST_BYTES, log_stats_interval_s=0.5)
    app = build_app(llm, cfg)
    with app_thread(app, cfg.port, timeout_graceful_shutdown=5):
        yield Live(llm, app.state.serving, f"http://127.0.0.1:{cfg.port}")
