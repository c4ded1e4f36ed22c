"""OpenAI request bodies, checked field by field before anything reaches the engine.

`parse_completion` and `parse_chat` take the decoded JSON body and return a `GenerationRequest`, or raise `APIError`
(400) naming the field, the value and what was expected. Wrong types are 400 like wrong values (never 422). Fields
that would change the result but that kvtide does not implement (logprobs, penalties, tools, ...) are refused
rather than ignored; fields with no effect on the output (``user``, ``metadata``, ...) are ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # each one's length: every generated token is checked against all of them
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
# set to anything but their neutral value, these change what is sampled: refused, never silently ignored
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0), "min_tokens": (None, 0), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "prompt_logprobs": (None, 0), "use_beam_search": (None, False),
}


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param)


@dataclass
class GenerationRequest:
    """One /v1/completions or /v1/chat/completions call, checked. ``prompts`` are strings or token-id lists
    (chat: empty until the template renders ``messages``); every prompt runs ``n`` times."""

    chat: bool
    model: str | None
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, str]] | None = None
    max_tokens: int | None = None  # None: the default of the endpoint
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    # prefill/decode hand-off (kvtide/server/pd.py): the params a prefill leg answered with, and the caller's
    # minimum relative quality (None: the server's default) and transfer SLO in seconds
    kv_transfer_params: dict[str, Any] | None = None
    kv_min_quality: float | None = None
    kv_slo_s: float | None = None
    kv_profile: str | None = None  # a pipeline spec the hand-off must use (None: the controller chooses)
    kv_policy_key: str | None = None  # whose policy state the prefill side decides with and updates (None: its own)

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"


def parse_completion(body: Any, max_choices: int) -> GenerationRequest:
    body = _object(body)
    req = GenerationRequest(chat=False, model=_model(body))
    req.prompts = _prompts(body.get("prompt"))
    req.max_tokens = _int(body, "max_tokens", 1)
    _common(body, req, max_choices, len(req.prompts))
    return req


def parse_chat(body: Any, max_choices: int) -> GenerationRequest:
    body = _object(body)
    req = GenerationRequest(chat=True, model=_model(body))
    req.messages = _messages(body.get("messages"))
    req.max_tokens = _int(body, "max_completion_tokens", 1)
    if req.max_tokens is None:
        req.max_tokens = _int(body, "max_tokens", 1)
    _common(body, req, max_choices, 1)
    return req


# ---- fields ----------------------------------------------------------------------------------------------------

def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {_kind(body)}")
    return body


def _common(body: dict[str, Any], req: GenerationRequest, max_choices: int, num_prompts: int) -> None:
    for name, neutral in UNSUPPORTED.items():
        if name in body and not any(_same(body[name], v) for v in neutral):
            raise bad(name, f"'{name}' is not supported by kvtide (got {_show(body[name])})")
    best_of = body.get("best_of")
    if best_of is not None and not _same(best_of, body.get("n", 1) or 1):
        raise bad("best_of", f"'best_of' is not supported by kvtide (got {_show(best_of)})")
    req.temperature = _number(body, "temperature", 1.0, low=0.0)
    req.top_p = _number(body, "top_p", 1.0, low=0.0, low_open=True, high=1.0)
    top_k = _int(body, "top_k", -1)
    req.top_k = 0 if top_k is None or top_k == -1 else top_k  # -1 and 0: off (vLLM)
    req.seed = _int(body, "seed", 0, 2**63 - 1)
    req.ignore_eos = _bool(body, "ignore_eos", False)
    req.stop = _stop(body.get("stop"))
    req.n = _int(body, "n", 1) or 1
    if num_prompts * req.n > max_choices:
        raise bad("n" if req.n > 1 else "prompt", f"n={req.n} over {num_prompts} prompt(s) makes "
                  f"{num_prompts * req.n} sequences; "
                  f"this server allows at most {max_choices} per request")
    req.stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", f"'stream_options' must be an object, got {_kind(opts)}")
        if not req.stream:
            raise bad("stream_options", "'stream_options' is only allowed with 'stream': true")
        req.include_usage = _bool(opts, "include_usage", False, where="stream_options.include_usage")
    _kv_transfer(body, req, num_prompts)


def _kv_transfer(body: dict[str, Any], req: GenerationRequest, num_prompts: int) -> None:
    """``kv_transfer_params`` (an object, as a prefill leg returned it) and ``kv_transfer`` ({min_quality, slo_ms,
    profile, policy_key})."""
    params = body.get("kv_transfer_params")
    if params is not None:
        if not isinstance(params, dict):
            raise bad("kv_transfer_params", f"'kv_transfer_params' must be an object, got {_kind(params)}")
        if num_prompts * req.n != 1:
            raise bad("kv_transfer_params", "'kv_transfer_params' is for one prompt with n=1")
        url = params.get("remote_url")
        if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))
                                or len(url) > 2048):
            raise bad("kv_transfer_params.remote_url", f"'remote_url' must be an http(s):// URL, got {_show(url)}")
        do = params.get("do_remote_decode")
        if do is not None and not isinstance(do, bool):
            raise bad("kv_transfer_params.do_remote_decode", f"'do_remote_decode' must be a boolean, got {_show(do)}")
        req.kv_transfer_params = params
    kv = body.get("kv_transfer")
    if kv is None:
        return
    if not isinstance(kv, dict):
        raise bad("kv_transfer", f"'kv_transfer' must be an object, got {_kind(kv)}")
    unknown = sorted(set(kv) - {"min_quality", "slo_ms", "profile", "policy_key"})
    if unknown:
        raise bad("kv_transfer", f"'kv_transfer' has unknown fields {unknown}; expected min_quality, slo_ms, profile, "
                  "policy_key")
    prof = kv.get("profile")
    if prof is not None:
        if not isinstance(prof, str) or not prof or len(prof) > 256:
            raise bad("kv_transfer.profile", f"'profile' must be a pipeline spec string, got {_show(prof)}")
        req.kv_profile = prof
    if kv.get("policy_key") is not None:
        from ..transfer.policy import PolicyKeyError, check_policy_key
        try:
            req.kv_policy_key = check_policy_key(kv["policy_key"])
        except PolicyKeyError as e:
            raise bad("kv_transfer.policy_key", str(e)) from None
    if kv.get("min_quality") is not None:
        req.kv_min_quality = _number(kv, "min_quality", 1.0, low=0.0, high=1.0)
    if kv.get("slo_ms") is not None:
        req.kv_slo_s = _number(kv, "slo_ms", 0.0, low=0.0, low_open=True) / 1000.0


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("model", f"'model' must be a non-empty string, got {_show(model)}")
    return model


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if prompt is None:
        raise bad("prompt", "'prompt' is required")
    single = isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt)
                                         and all(_is_int(t) for t in prompt))
    if single:
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise bad("prompt", f"'prompt' must be a non-empty string, a list of strings or a list of token ids, "
                  f"got {_kind(prompt)}")
    out: list[str | list[int]] = []
    for i, p in enumerate(items):
        where = "prompt" if single else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise bad("prompt", f"'{where}' is an empty string")
            out.append(p)
        elif isinstance(p, list) and p and all(_is_int(t) for t in p):
            if any(t < 0 for t in p):
                raise bad("prompt", f"'{where}' holds negative token ids")
            out.append(list(p))
        else:
            raise bad("prompt", f"'{where}' must be a non-empty string or a non-empty list of token ids, "
                      f"got {_kind(p)}")
    return out


def _messages(messages: Any) -> list[dict[str, str]]:
    if messages is None:
        raise bad("messages", "'messages' is required")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"'messages' must be a non-empty list of messages, got {_kind(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad("messages", f"'messages[{i}]' must be an object with 'role' and 'content', got {_kind(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise bad("messages", f"'messages[{i}].role' must be one of {', '.join(sorted(ROLES))}, "
                      f"got {_show(role)}")
        out.append({"role": role, "content": _content(m.get("content"), i)})
    return out


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad("messages", f"'messages[{i}].content[{j}]' must be a text part "
                          f"({{\"type\": \"text\", \"text\": ...}}); kvtide serves text only, got {_show(part)}")
            parts.append(part["text"])
        return "".join(parts)
    raise bad("messages", f"'messages[{i}].content' must be a string or a list of text parts, got {_kind(content)}")


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad("stop", f"'stop' must be a non-empty string or a list of them, got {_show(stop)}")
    if len(items) > MAX_STOP:
        raise bad("stop", f"'stop' has {len(items)} strings, at most {MAX_STOP} are allowed")
    long = [s for s in items if len(s) > MAX_STOP_CHARS]
    if long:
        raise bad("stop", f"a stop string has {len(long[0])} characters, at most {MAX_STOP_CHARS} are allowed")
    return list(items)


def _int(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or v < low or (high is not None and v > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise bad(name, f"'{name}' must be an integer {bound}, got {_show(v)}")
    return v


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float | None = None,
            low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
        and (v > low if low_open else v >= low) and (high is None or v <= high)
    if not ok:
        lo = f"{'(' if low_open else '['}{low:g}"
        bound = f"in {lo}, {high:g}]" if high is not None else f"{'>' if low_open else '>='} {low:g}"
        raise bad(name, f"'{name}' must be a number {bound}, got {_show(v)}")
    return float(v)


def _bool(body: dict[str, Any], name: str, default: bool, where: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(where or name, f"'{where or name}' must be true or false, got {_show(v)}")
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same kind (1 == 1.0, but True is not 1)."""
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) \
            or not isinstance(b, (int, float)):
        return type(a) is type(b) and a == b
    return a == b


def _kind(v: Any) -> str:
    if isinstance(v, list):
        return "an empty list" if not v else "a list"
    if isinstance(v, str):
        return "an empty string" if not v else "a string"
    return {dict: "an object", bool: "a boolean", int: "an integer", float: "a number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _show(v: Any) -> str:
    """A value for an error message, cut short (a client's value is echoed at most 80 characters)."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."
