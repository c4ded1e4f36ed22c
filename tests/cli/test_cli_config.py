"""The CLI's config and logging: --config files under KVTIDE_* env under flags, --print-config, --log-level."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import yaml

from kvtide.cli import main
from kvtide.log import reset_limits


@pytest.fixture(autouse=True)
def _kvtide_logger_restored():
    """main() configures the process's `kvtide` logger; put it back for the other tests."""
    logger = logging.getLogger("kvtide")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    reset_limits()
    yield
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]
    reset_limits()


def printed_config(capsys, *args: str) -> dict:
    assert main(["generate", "hi", "--print-config", *args]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_log_level_configures_only_the_kvtide_logger(capsys):
    root_level = logging.getLogger().level
    assert main(["--log-level", "debug", "generate", "hi", "--print-config"]) == 0
    logger = logging.getLogger("kvtide")
    ours = [h for h in logger.handlers if getattr(h, "kvtide_cli", False)]
    assert logger.level == logging.DEBUG and len(ours) == 1 and ours[0].stream is sys.stderr
    assert main(["generate", "hi", "--print-config", "--log-level", "error"]) == 0  # after the command works too
    assert logger.level == logging.ERROR and len([h for h in logger.handlers if getattr(h, "kvtide_cli", False)]) == 1
    assert main(["generate", "hi", "--print-config"]) == 0
    assert logger.level == logging.WARNING  # the default
    assert logging.getLogger().level == root_level
    with pytest.raises(SystemExit):
        main(["--log-level", "loud", "models"])


def test_print_config_flag_over_env_over_file(tmp_path, capsys, monkeypatch):
    f = tmp_path / "kvtide.yaml"
    f.write_text("device: cpu\ncache:\n  kv_cache_bytes: 1048576\n  compress: true\n"
                 "scheduler:\n  max_num_seqs: 3\n  max_num_batched_tokens: 100\nrestore:\n  method: load\n")
    for name in list(os.environ):
        if name.startswith("KVTIDE_") and name != "KVTIDE_CACHE_DIR":
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVTIDE_SCHEDULER_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("KVTIDE_SCHEDULER_MAX_NUM_BATCHED_TOKENS", "200")
    monkeypatch.setenv("KVTIDE_RESTORE_MAX_BATCH", "2")
    cfg = printed_config(capsys, "--config", str(f), "--max-num-seqs", "7", "--num-pages", "64", "--no-compress",
                         "--restore-store", "pinned")
    assert cfg["device"] == "cpu" and cfg["model"] == "smollm2-135m"
    assert cfg["scheduler"]["max_num_seqs"] == 7 and cfg["scheduler"]["max_num_batched_tokens"] == 200
    assert cfg["cache"]["num_pages"] == 64 and cfg["cache"]["kv_cache_bytes"] is None  # the flag owns the budget
    assert cfg["cache"]["compress"] is False
    assert cfg["restore"] == {**cfg["restore"], "method": "load", "max_batch": 2, "store": "pinned"}
    monkeypatch.delenv("KVTIDE_RESTORE_MAX_BATCH")
    assert printed_config(capsys)["restore"] is False  # no flag, file or variable turns it on


def test_bad_config_exits_2_naming_the_problem(tmp_path, capsys, monkeypatch):
    f = tmp_path / "kvtide.yaml"
    f.write_text("cache:\n  page_sise: 32\n")
    assert main(["generate", "hi", "--config", str(f), "--print-config"]) == 2
    assert "unknown key 'cache.page_sise' (did you mean 'cache.page_size'?)" in capsys.readouterr().err
    monkeypatch.setenv("KVTIDE_CACHE_PAGE_SIZE", "abc")
    assert main(["chat", "--print-config"]) == 2
    assert "KVTIDE_CACHE_PAGE_SIZE='abc': expected an int" in capsys.readouterr().err
    monkeypatch.delenv("KVTIDE_CACHE_PAGE_SIZE")
    assert main(["demo", "--print-config", "--num-pages", "64", "--kv-cache-bytes", "4096"]) == 2
    assert "not both" in capsys.readouterr().err


def test_unknown_variable_warning_follows_the_log_level():
    """As a user runs it: the warning is on stderr at the default level and gone at --log-level error."""
    env = {**os.environ, "KVTIDE_SCHEDULER_MAX_NUM_SEQ": "4"}
    run = [sys.executable, "-m", "kvtide.cli"]
    r = subprocess.run([*run, "generate", "hi", "--print-config"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "KVTIDE_SCHEDULER_MAX_NUM_SEQ ignored (did you mean 'KVTIDE_SCHEDULER_MAX_NUM_SEQS'?)" in r.stderr
    r = subprocess.run([*run, "--log-level", "error", "generate", "hi", "--print-config"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0 and "KVTIDE_SCHEDULER_MAX_NUM_SEQ" not in r.stderr, r.stderr


def test_generate_builds_its_engine_from_the_config_file(tmp_path, capsys):
    """The file reaches the engine (its context window refuses the prompt); a flag then overrides it."""
    f = tmp_path / "kvtide.yaml"
    f.write_text("device: cpu\nscheduler:\n  max_model_len: 4\n")
    prompt = "The capital of France is"
    assert main(["generate", prompt, "--config", str(f), "--max-tokens", "2"]) == 2
    assert "(model 4," in capsys.readouterr().err
    assert main(["generate", prompt, "--config", str(f), "--max-tokens", "2", "--max-model-len", "64"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(" Paris") and "2 tokens" in out.err
