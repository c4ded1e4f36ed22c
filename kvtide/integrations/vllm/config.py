"""The connector's settings, read from vLLM's ``kv_connector_extra_config`` and validated like kvtide's own config.

The store settings are ``RestoreConfig`` fields (``store``, ``chunk_tokens``, ``store_codec``, ``namespace``,
``secret``, the tier's timeouts and breaker, ...): each value is parsed by that field's annotation
(``kvtide.config_values``: ``"256"`` and ``256`` both work, a bad one names its key and the expected type) and the
whole set is checked by ``RestoreConfig`` itself, so a spec, codec or bound that kvtide would refuse is refused
here with the same message. The connector's own settings (planned split, load deadline, saving) follow the same
rules. Unknown keys are errors (with the closest known key), and so are ``RestoreConfig`` fields that belong to
kvtide's engine and mean nothing inside vLLM (``method``, ``steal``, ...). The secret is never echoed.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtide.config import RestoreConfig, redact_url
from kvtide.config_values import parse_value

WHERE = "kv_connector_extra_config"
# RestoreConfig fields the connector uses (everything else there drives kvtide's own engine)
STORE_FIELDS = ("store", "memory_bytes", "chunk_tokens", "bandwidth_gbps", "store_codec", "write_queue_bytes",
                "store_timeout_s", "breaker_failures", "breaker_backoff_s", "flush_timeout_s", "secret",
                "namespace", "store_token_ids")
ENGINE_ONLY_FIELDS = ("method", "max_batch", "write_on_finish", "steal", "spill", "hedge", "merge_load_layers",
                      "load_workers", "load_read_ahead", "lookup_budget_s")


@dataclass(frozen=True, repr=False)
class ConnectorConfig:
    """What the connector does besides the store (``restore`` holds the store settings).

    ``planned_split``: load only the prefix of a match that the split planner picks and let vLLM recompute the rest
    (False: always load the whole match); ``split_margin``: a split must beat loading the whole match by this
    fraction of the predicted time (``split.plan_split``). ``load_timeout_s``: a layer whose KV is not in place this long after the
    step's loads started is reported as failed (vLLM recomputes it). ``save``: store the chunks vLLM computes;
    ``save_decode``: also chunks completed by generated tokens (a multi-turn conversation's next prompt holds
    them). ``kv_layout``: how vLLM's paged KV is laid out (``auto``: from the attention backend; ``cpu``: vLLM's
    CPU backend, ``gpu``: the CUDA backends; ``kvtide.integrations.vllm.layout``). ``max_known_chunks``: chunks
    remembered as stored (not written again) per process."""

    restore: RestoreConfig = field(default_factory=RestoreConfig)
    planned_split: bool = True
    split_margin: float = 0.15
    load_timeout_s: float = 10.0
    save: bool = True
    save_decode: bool = True
    kv_layout: Literal["auto", "cpu", "gpu"] = "auto"
    max_known_chunks: int = 1 << 16

    def __post_init__(self) -> None:
        if not isinstance(self.restore, RestoreConfig):
            raise ValueError(f"{WHERE}: restore must be a RestoreConfig, got {type(self.restore).__name__}")
        for name in ("planned_split", "save", "save_decode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{WHERE}.{name} must be a bool, got {getattr(self, name)!r}")
        m = self.split_margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1:
            raise ValueError(f"{WHERE}.split_margin must be a number in [0, 1), got {m!r}")
        t = self.load_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"{WHERE}.load_timeout_s must be a number of seconds > 0, got {t!r}")
        if self.kv_layout not in ("auto", "cpu", "gpu"):
            raise ValueError(f"{WHERE}.kv_layout must be auto, cpu or gpu, got {self.kv_layout!r}")
        n = self.max_known_chunks
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{WHERE}.max_known_chunks must be an int >= 1, got {n!r}")

    def __repr__(self) -> str:  # the settings the connector reads, secret and URL password hidden
        return f"ConnectorConfig({describe(self)})"


_OWN = {f.name: f for f in dataclasses.fields(ConnectorConfig) if f.name != "restore"}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_extra_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """The connector's config from ``kv_connector_extra_config`` (None or {}: every default, an in-process memory
    store). Raises ValueError naming the key for an unknown key, a value of the wrong type or a value kvtide
    refuses."""
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"{WHERE} must be a mapping, got {type(extra).__name__}")
    restore_hints, own_hints = _hints(RestoreConfig), _hints(ConnectorConfig)
    store: dict[str, Any] = {}
    own: dict[str, Any] = {}
    for key, raw in extra.items():
        if not isinstance(key, str):
            raise ValueError(f"{WHERE}: key {key!r} is not a string")
        where = f"{WHERE}.{key}"
        if key in STORE_FIELDS:
            tp = restore_hints[key]
            if key == "secret" and isinstance(raw, str) and raw:
                store[key] = raw  # taken as given ('none' is a secret, not None); never echoed
            else:
                try:
                    store[key] = parse_value(raw, tp, where)
                except ValueError:
                    if key == "secret":
                        raise ValueError(f"{where}: expected a non-empty string or none") from None
                    raise
        elif key in _OWN:
            own[key] = parse_value(raw, own_hints[key], where)
        elif key in ENGINE_ONLY_FIELDS:
            raise ValueError(f"{where}: a setting of kvtide's own engine, not used inside vLLM (the connector "
                             f"reads: {', '.join(STORE_FIELDS + tuple(_OWN))})")
        else:
            known = list(STORE_FIELDS) + list(_OWN)
            match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f" (did you mean '{match[0]}'?)" if match else ""
            raise ValueError(f"{WHERE}: unknown key '{key}'{hint}")
    try:
        restore = RestoreConfig(**store)
    except (ValueError, TypeError) as e:
        msg = str(e)  # RestoreConfig names its field, except the store parser's own messages
        raise ValueError(msg.replace("RestoreConfig.", f"{WHERE}.") if "RestoreConfig." in msg
                         else f"{WHERE}.store: {msg}") from None
    return ConnectorConfig(restore=restore, **own)


def describe(cfg: ConnectorConfig) -> dict[str, Any]:
    """The effective settings for a log line (secret and URL passwords hidden)."""
    r = cfg.restore
    store = redact_url(r.store)
    out: dict[str, Any] = {"store": store, "secret": "<set>" if r.secret else None}
    for name in STORE_FIELDS:
        if name not in out:
            out[name] = getattr(r, name)
    out.update({name: getattr(cfg, name) for name in _OWN})
    return out
