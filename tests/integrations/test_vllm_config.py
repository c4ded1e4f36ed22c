"""kv_connector_extra_config is validated like kvtide's own config: parsed by type, checked by RestoreConfig,
unknown and engine-only keys refused, the secret never echoed (no vLLM needed)."""
from __future__ import annotations

import pytest

from kvtide.integrations.vllm.config import ConnectorConfig, describe, from_extra_config


def test_defaults_and_parsing():
    cfg = from_extra_config(None)
    assert cfg.restore.store == "memory" and cfg.restore.chunk_tokens == 256 and cfg.planned_split
    cfg = from_extra_config({"store": "disk:/tmp/kv?capacity=1G", "chunk_tokens": "128", "store_codec": "zip",
                             "namespace": "tenant-a", "planned_split": "off", "load_timeout_s": "2.5",
                             "bandwidth_gbps": 10, "kv_layout": "cpu"})
    r = cfg.restore
    assert (r.store, r.chunk_tokens, r.store_codec, r.namespace, r.bandwidth_gbps) == \
        ("disk:/tmp/kv?capacity=1G", 128, "zip", "tenant-a", 10.0)
    assert cfg.planned_split is False and cfg.load_timeout_s == 2.5 and cfg.kv_layout == "cpu"


@pytest.mark.parametrize("extra,match", [
    ({"chunk_tokens": "abc"}, r"kv_connector_extra_config\.chunk_tokens='abc': expected an int"),
    ({"chunk_tokens": 0}, r"kv_connector_extra_config\.chunk_tokens must be positive"),
    ({"store": "s3://bucket"}, r"kv_connector_extra_config\.store: unknown store"),
    ({"store": "disk:"}, r"kv_connector_extra_config\.store: .*needs a path"),
    ({"store_codec": "lz4"}, r"store_codec must be None or 'zip'"),
    ({"chunk_tokenz": 128}, r"unknown key 'chunk_tokenz' \(did you mean 'chunk_tokens'\?\)"),
    ({"method": "cake"}, r"kv_connector_extra_config\.method: a setting of kvtide's own engine"),
    ({"planned_split": "maybe"}, r"planned_split='maybe': expected a bool"),
    ({"load_timeout_s": 0}, r"load_timeout_s must be a number of seconds > 0"),
    ({"split_margin": 1.5}, r"split_margin must be a number in \[0, 1\)"),
    ({"kv_layout": "tpu"}, r"kv_layout='tpu': expected one of"),
    ({"breaker_failures": -1}, r"breaker_failures must be an int >= 0"),
    ({"namespace": 123}, r"namespace=123: expected a string"),
])
def test_bad_values_name_their_key(extra, match):
    with pytest.raises(ValueError, match=match):
        from_extra_config(extra)


def test_secret_is_kept_and_never_echoed():
    cfg = from_extra_config({"secret": "none", "store": "redis://user:hunter2@db:6379/0"})
    assert cfg.restore.secret == "none"  # a secret, not None
    shown = repr(describe(cfg)) + repr(cfg)
    assert "hunter2" not in shown and "'none'" not in shown.replace("'secret': '<set>'", "")
    with pytest.raises(ValueError) as e:
        from_extra_config({"secret": 12345})
    assert "12345" not in str(e.value)


def test_not_a_mapping():
    with pytest.raises(ValueError, match="must be a mapping"):
        from_extra_config(["store", "memory"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="restore must be a RestoreConfig"):
        ConnectorConfig(restore={"store": "memory"})  # type: ignore[arg-type]
