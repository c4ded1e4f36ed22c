"""The config loader: defaults < file < KVTIDE_* env < explicit for every section, typed parsing with errors that
name their source, unknown names, the restore switch, the server section, and the printed form."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import yaml

from kvtide.config import CacheConfig, EngineConfig, RestoreConfig, SchedulerConfig
from kvtide.config_load import OTHER_ENV_VARS, config_dict, load_config, load_settings
from kvtide.log import reset_limits

# one field of each section: (file/override key path, env variable, default, file value, env string, env value,
# explicit value)
FIELDS = [
    (("device",), "KVTIDE_DEVICE", "auto", "cpu", "cuda:1", "cuda:1", "cuda:0"),
    (("cache", "page_size"), "KVTIDE_CACHE_PAGE_SIZE", 16, 32, "64", 64, 128),
    (("scheduler", "max_num_seqs"), "KVTIDE_SCHEDULER_MAX_NUM_SEQS", 64, 3, "5", 5, 7),
    (("restore", "method"), "KVTIDE_RESTORE_METHOD", "cacheflow", "load", "cake", "cake", "layerwise"),
]
IDS = [".".join(f[0]) for f in FIELDS]


@pytest.fixture(autouse=True)
def _fresh_limits():
    reset_limits()  # the unknown-variable warning is rate-limited per name
    yield
    reset_limits()


def nested(path: tuple[str, ...], value):
    return {path[0]: value} if len(path) == 1 else {path[0]: {path[1]: value}}


def get(cfg: EngineConfig, path: tuple[str, ...]):
    obj = cfg
    for p in path:
        obj = getattr(obj, p) if obj is not None else None
    return obj


def write(tmp_path, data, name="kvtide.yaml"):
    p = tmp_path / name
    p.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("path, var, default, file_value, env_raw, env_value, explicit", FIELDS, ids=IDS)
def test_precedence_explicit_over_env_over_file_over_default(tmp_path, path, var, default, file_value, env_raw,
                                                             env_value, explicit):
    f = write(tmp_path, nested(path, file_value))
    on = {"KVTIDE_RESTORE": "1"} if path[0] == "restore" else {}  # restore is off unless configured
    assert get(load_config(env=on), path) == default
    assert get(load_config(file=f, env={}), path) == file_value
    assert get(load_config(file=f, env={var: env_raw}), path) == env_value
    assert get(load_config(nested(path, explicit), file=f, env={var: env_raw}), path) == explicit
    assert get(load_config(nested(path, explicit), env={var: env_raw}), path) == explicit


def test_the_layers_fill_different_fields_of_one_section(tmp_path):
    f = write(tmp_path, {"cache": {"page_size": 32, "block_size": 1024}})
    cfg = load_config({"cache": {"compress": True}}, file=f, env={"KVTIDE_CACHE_BLOCK_SIZE": "256"})
    assert (cfg.cache.page_size, cfg.cache.block_size, cfg.cache.compress) == (32, 256, True)


def test_an_explicit_section_instance_is_never_overridden_by_env(monkeypatch):
    """Old from_env let KVTIDE_CACHE_PAGE_SIZE replace the page size of an explicit cache=CacheConfig(...)."""
    monkeypatch.setenv("KVTIDE_CACHE_PAGE_SIZE", "32")
    monkeypatch.setenv("KVTIDE_DEVICE", "cuda")
    cfg = EngineConfig.from_env(cache=CacheConfig(page_size=64), device="cpu")
    assert cfg.cache.page_size == 64 and cfg.device == "cpu"
    assert EngineConfig.from_env().cache.page_size == 32


def test_the_highest_layer_owns_the_cache_budget(tmp_path):
    """num_pages and kv_cache_bytes are one budget: a flag for one replaces the file's other, not clashes with it."""
    f = write(tmp_path, {"cache": {"kv_cache_bytes": 1 << 20}})
    cfg = load_config({"cache": {"num_pages": 64}}, file=f, env={})
    assert (cfg.cache.num_pages, cfg.cache.kv_cache_bytes) == (64, None)
    cfg = load_config(file=f, env={"KVTIDE_CACHE_NUM_PAGES": "8"})
    assert (cfg.cache.num_pages, cfg.cache.kv_cache_bytes) == (8, None)
    with pytest.raises(ValueError, match="not both"):  # one layer setting both is still an error
        load_config(env={"KVTIDE_CACHE_NUM_PAGES": "8", "KVTIDE_CACHE_KV_CACHE_BYTES": "4096"})


@pytest.mark.parametrize("var, raw, expected", [
    ("KVTIDE_CACHE_PAGE_SIZE", "abc", "an int"),
    ("KVTIDE_CACHE_PAGE_SIZE", "1.5", "an int"),
    ("KVTIDE_CACHE_COMPRESS", "maybe", "a bool (true/false, 1/0, yes/no, on/off)"),
    ("KVTIDE_CACHE_GPU_MEMORY_UTILIZATION", "fast", "a finite float"),
    ("KVTIDE_CACHE_GPU_MEMORY_UTILIZATION", "nan", "a finite float"),
    ("KVTIDE_CACHE_NUM_PAGES", "many", "an int or none"),
    ("KVTIDE_ASYNC_SCHEDULING", "sometimes", "a bool (true/false, 1/0, yes/no, on/off) or none"),
    ("KVTIDE_RESTORE_BANDWIDTH_GBPS", "inf", "a finite float or none"),
])
def test_a_bad_env_value_names_the_variable_and_the_type(var, raw, expected):
    with pytest.raises(ValueError) as e:
        load_config(env={var: raw})
    assert str(e.value) == f"{var}={raw!r}: expected {expected}"


def test_strings_parse_by_annotation():
    cfg = load_config(env={"KVTIDE_CACHE_COMPRESS": "on", "KVTIDE_CACHE_ENABLE_PREFIX_CACHING": "No",
                           "KVTIDE_CACHE_NUM_PAGES": "1_000", "KVTIDE_SCHEDULER_MAX_MODEL_LEN": "auto",
                           "KVTIDE_ASYNC_SCHEDULING": "none", "KVTIDE_RESTORE_HEDGE": "0.25",
                           "KVTIDE_RESTORE_STORE_CODEC": "zip", "KVTIDE_FULL_CUDA_GRAPHS": "true"})
    assert cfg.cache.compress is True and cfg.cache.enable_prefix_caching is False and cfg.cache.num_pages == 1000
    assert cfg.scheduler.max_model_len is None and cfg.async_scheduling is None and cfg.full_cuda_graphs is True
    assert cfg.restore.hedge == 0.25 and cfg.restore.store_codec == "zip"
    assert load_config(env={"KVTIDE_RESTORE_STORE_CODEC": "none"}).restore.store_codec is None


def test_a_validation_error_names_where_the_value_came_from(tmp_path):
    with pytest.raises(ValueError, match=r"power of two, got 12 \(set by KVTIDE_CACHE_PAGE_SIZE='12'\)"):
        load_config(env={"KVTIDE_CACHE_PAGE_SIZE": "12"})
    f = write(tmp_path, {"restore": {"chunk_tokens": 24}})
    with pytest.raises(ValueError, match=r"chunk_tokens \(24\) must be a multiple.*set by .*kvtide.yaml: "
                                         r"restore.chunk_tokens"):
        load_config(file=f, env={})


def test_unknown_env_variable_warns_with_the_closest_name(caplog):
    caplog.set_level(logging.WARNING, logger="kvtide.config")
    cfg = load_config(env={"KVTIDE_CACHE_PAGE_SIZ": "32", "KVTIDE_SCHEDULER_MAX_NUM_SEQ": "3", "OTHER_PAGE_SIZE": "1"})
    assert cfg.cache.page_size == 16 and cfg.scheduler.max_num_seqs == 64
    msgs = [r.getMessage() for r in caplog.records if r.name == "kvtide.config"]
    assert any("KVTIDE_CACHE_PAGE_SIZ ignored" in m and "did you mean 'KVTIDE_CACHE_PAGE_SIZE'" in m for m in msgs)
    assert any("did you mean 'KVTIDE_SCHEDULER_MAX_NUM_SEQS'" in m for m in msgs)
    assert len(msgs) == 2, msgs


def test_variables_read_elsewhere_are_not_warned_about(caplog):
    caplog.set_level(logging.WARNING, logger="kvtide.config")
    env = {name: "1" for name in OTHER_ENV_VARS} | {"KVTIDE_SERVER_PORT": "9000"}  # server: reserved for serve
    assert {"KVTIDE_CACHE_DIR", "KVTIDE_STORE_SECRET", "KVTIDE_PDL_NUDGE"} <= OTHER_ENV_VARS
    load_config(env=env)
    assert [r for r in caplog.records if r.name == "kvtide.config"] == []


@pytest.mark.parametrize("data, message", [
    ({"modle": "x"}, "unknown key 'modle' (did you mean 'model'?)"),
    ({"cache": {"page_sise": 32}}, "unknown key 'cache.page_sise' (did you mean 'cache.page_size'?)"),
    ({"schedular": {"max_num_seqs": 2}}, "unknown key 'schedular' (did you mean 'scheduler'?)"),
    ({"cache": {"page_size": "abc"}}, "cache.page_size='abc': expected an int"),
    ({"cache": {"page_size": True}}, "cache.page_size=True: expected an int"),
    ({"cache": {"compress": "perhaps"}}, "cache.compress='perhaps': expected a bool"),
    ({"device": 3}, "device=3: expected a string"),
    ({"cache": [1, 2]}, "cache: expected a mapping of fields, got list"),
])
def test_a_bad_file_is_an_error_naming_the_key(tmp_path, data, message):
    f = write(tmp_path, data)
    with pytest.raises(ValueError) as e:
        load_config(file=f, env={})
    assert message in str(e.value) and str(f) in str(e.value)


def test_file_limits_and_formats(tmp_path):
    big = tmp_path / "big.yaml"
    with big.open("wb") as fh:  # sparse: the size check comes before any read
        fh.truncate(64 << 20)
    with pytest.raises(ValueError, match=r"67108864 bytes, expected at most 1048576"):
        load_config(file=big, env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache: {page_size: [")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(file=bad, env={})
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="expected a mapping of config keys, got list"):
        load_config(file=bad, env={})
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=str(deep)):
        load_config(file=deep, env={})
    inf = tmp_path / "inf.json"
    inf.write_text('{"restore": {"bandwidth_gbps": Infinity}}')
    with pytest.raises(ValueError, match="restore.bandwidth_gbps=inf: expected a finite float or none"):
        load_config(file=inf, env={})
    assert load_config(file=write(tmp_path, {"cache": {"page_size": 32}}, "c.json"), env={}).cache.page_size == 32
    with pytest.raises(ValueError, match="cannot read it"):
        load_config(file=tmp_path / "missing.yaml", env={})


def test_restore_is_off_unless_configured(tmp_path):
    assert load_config(env={}).restore is None
    cfg = load_config(env={"KVTIDE_RESTORE_METHOD": "load", "KVTIDE_RESTORE_STORE": "pinned"})
    assert cfg.restore == RestoreConfig(method="load", store="pinned")
    assert load_config(env={"KVTIDE_RESTORE": "1"}).restore == RestoreConfig()
    assert load_config(env={"KVTIDE_RESTORE": "0"}).restore is None
    with pytest.raises(ValueError, match="KVTIDE_RESTORE='off' turns restore off, but KVTIDE_RESTORE_METHOD is set"):
        load_config(env={"KVTIDE_RESTORE": "off", "KVTIDE_RESTORE_METHOD": "load"})
    assert load_config(file=write(tmp_path, {"restore": None}), env={}).restore == RestoreConfig()  # `restore:`
    off = write(tmp_path, {"restore": False}, "off.yaml")
    assert load_config(file=off, env={}).restore is None
    assert load_config(file=off, env={"KVTIDE_RESTORE_MAX_BATCH": "2"}).restore.max_batch == 2  # env over file
    assert load_config({"restore": None}, env={"KVTIDE_RESTORE_MAX_BATCH": "2"}).restore is None  # explicit off
    assert load_config({"restore": {"max_batch": 3}}, env={"KVTIDE_RESTORE": "0"}).restore.max_batch == 3


def test_from_env_reads_restore_and_keeps_explicit_values(monkeypatch):
    monkeypatch.setenv("KVTIDE_RESTORE_CHUNK_TOKENS", "64")
    monkeypatch.setenv("KVTIDE_RESTORE_METHOD", "cake")
    monkeypatch.setenv("KVTIDE_SEED", "9")
    cfg = EngineConfig.from_env(seed=3)
    assert cfg.restore.chunk_tokens == 64 and cfg.restore.method == "cake" and cfg.seed == 3
    assert EngineConfig.from_env(restore=RestoreConfig(method="load")).restore == RestoreConfig(method="load")


def test_explicit_values_and_unknown_options():
    base = EngineConfig(device="cpu", cache=CacheConfig(page_size=32))
    assert load_config(base, env={"KVTIDE_CACHE_PAGE_SIZE": "64", "KVTIDE_DEVICE": "cuda"}) == base
    with pytest.raises(TypeError, match=r"unknown config option 'cache.page_sise' \(did you mean 'cache.page_size'"):
        load_config({"cache": {"page_sise": 1}}, env={})
    with pytest.raises(TypeError, match=r"unknown config option 'devise' \(did you mean 'device'"):
        load_config({"devise": "cpu"}, env={})
    with pytest.raises(TypeError, match="section 'cache' must be a mapping or a CacheConfig, got SchedulerConfig"):
        load_config({"cache": SchedulerConfig()}, env={})
    with pytest.raises(TypeError, match="config section 'scheduler' cannot be None"):
        load_config({"scheduler": None}, env={})


@dataclasses.dataclass
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 8000


def test_the_server_section(tmp_path, caplog):
    f = write(tmp_path, {"model": "smollm2-135m", "server": {"port": 9000, "anything": [1]}})
    s = load_settings({"server": {"host": "0.0.0.0"}}, file=f, env={})
    assert s.server == {"port": 9000, "anything": [1], "host": "0.0.0.0"} and s.engine.model == "smollm2-135m"
    assert load_config(file=f, env={}) == EngineConfig()
    f = write(tmp_path, {"server": {"port": 9000}})
    s = load_settings(file=f, env={"KVTIDE_SERVER_HOST": "::1"}, server_type=ServerSection)
    assert s.server == ServerSection(host="::1", port=9000)
    with pytest.raises(ValueError, match="KVTIDE_SERVER_PORT='http': expected an int"):
        load_settings(env={"KVTIDE_SERVER_PORT": "http"}, server_type=ServerSection)
    with pytest.raises(ValueError, match=r"unknown key 'server.prot' \(did you mean 'server.port'"):
        load_settings(file=write(tmp_path, {"server": {"prot": 1}}), env={}, server_type=ServerSection)


@dataclasses.dataclass
class Guarded:
    password: str = "default-password"
    url: str = "redis://localhost"

    def __post_init__(self) -> None:
        if len(self.password) < 12:
            raise ValueError("Guarded.password is too short")
        if "@" in self.url and "ssl" not in self.url:
            raise ValueError("Guarded.url needs TLS")


def test_errors_never_echo_secrets():
    with pytest.raises(ValueError) as e:
        load_settings(env={"KVTIDE_SERVER_PASSWORD": "hunter2"}, server_type=Guarded)
    assert "KVTIDE_SERVER_PASSWORD=<redacted>" in str(e.value) and "hunter2" not in str(e.value)
    with pytest.raises(ValueError) as e:
        load_settings(env={"KVTIDE_SERVER_URL": "redis://u:hunter2@h"}, server_type=Guarded)
    assert "KVTIDE_SERVER_URL='redis://u:***@h'" in str(e.value) and "hunter2" not in str(e.value)


@dataclasses.dataclass
class OptionalSecret:
    password: str | None = None


def test_a_secret_string_is_taken_as_it_is():
    """'none' parses as None for other optional strings; a secret of 'none' must not silently become no secret."""
    assert load_settings(env={"KVTIDE_SERVER_PASSWORD": "none"}, server_type=OptionalSecret).server.password == "none"
    assert load_settings(env={"KVTIDE_SERVER_PASSWORD": ""}, server_type=OptionalSecret).server.password is None


def test_config_dict_round_trips_and_masks_secrets(tmp_path):
    cfg = load_config({"device": "cpu", "cache": {"num_pages": 64, "compress": True},
                       "restore": {"method": "load", "hedge": 0.5}}, env={})
    f = write(tmp_path, config_dict(cfg))
    assert load_config(file=f, env={}) == cfg
    off = load_config(env={})
    assert config_dict(off)["restore"] is False and load_config(file=write(tmp_path, config_dict(off)), env={}) == off
    shown = config_dict(load_config({"restore": {"store": "redis://user:hunter2@host:6379/1"}}, env={}))
    assert shown["restore"]["store"] == "redis://user:***@host:6379/1"


def test_restore_config_repr_hides_store_password_and_secret():
    cfg = RestoreConfig(store="redis://user:hunter2@127.0.0.1:6379/0", secret="s3cret-value")
    shown = repr(cfg)
    assert "hunter2" not in shown and "s3cret-value" not in shown
    assert "redis://user:***@127.0.0.1:6379/0" in shown and "chunk_tokens=256" in shown
