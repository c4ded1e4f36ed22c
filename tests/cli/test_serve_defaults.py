"""`kvtide serve` defaults on CUDA (CUDA graphs), below every explicit setting; compression stays opt-in."""
from __future__ import annotations

import os

import pytest
import torch
import yaml

from kvtide.cli import main


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVTIDE_") and name != "KVTIDE_CACHE_DIR":
            monkeypatch.delenv(name)


def printed_generate(capsys, *args: str) -> dict:
    assert main(["generate", "hi", "--print-config", *args]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def served_config(capsys, *args: str) -> dict:
    assert main(["serve", "--print-config", *args]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_cpu_serve_defaults(capsys, clean_env, monkeypatch):
    cfg = served_config(capsys, "--device", "cpu")
    assert cfg["cuda_graphs"] is False and cfg["cache"]["compress"] is False
    assert cfg["cpu_onednn"] is True  # the server's CPU default; in-process engines keep torch's GEMM
    assert printed_generate(capsys)["cpu_onednn"] is False
    monkeypatch.setenv("KVTIDE_CPU_ONEDNN", "0")
    assert served_config(capsys, "--device", "cpu")["cpu_onednn"] is False


def test_cuda_serve_defaults_yield_to_flags_env_and_file(capsys, clean_env, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --print-config builds no engine
    cfg = served_config(capsys)
    assert cfg["cuda_graphs"] is True and cfg["cache"]["compress"] is False
    assert served_config(capsys, "--compress")["cache"]["compress"] is True
    monkeypatch.setenv("KVTIDE_CUDA_GRAPHS", "0")
    assert served_config(capsys)["cuda_graphs"] is False
    monkeypatch.delenv("KVTIDE_CUDA_GRAPHS")
    f = tmp_path / "kvtide.yaml"
    f.write_text("cuda_graphs: false\n")
    assert served_config(capsys, "--config", str(f))["cuda_graphs"] is False
    assert served_config(capsys, "--device", "cpu")["cuda_graphs"] is False


def test_pd_roles_get_a_kv_tier_of_page_chunks_below_explicit_settings(capsys, clean_env, monkeypatch):
    cfg = served_config(capsys, "--device", "cpu")
    assert not cfg["restore"] and cfg["server"]["role"] == "both"
    pre = served_config(capsys, "--device", "cpu", "--role", "prefill")
    assert pre["server"]["role"] == "prefill"
    assert pre["restore"]["store"] == "memory" and pre["restore"]["chunk_tokens"] == pre["cache"]["page_size"]
    assert pre["restore"]["write_on_finish"] is True
    dec = served_config(capsys, "--device", "cpu", "--role", "decode", "--kv-transport", "inproc")
    assert dec["restore"]["method"] == "load" and dec["restore"]["write_on_finish"] is False
    assert dec["server"]["kv_transport"] == "inproc"
    monkeypatch.setenv("KVTIDE_RESTORE_CHUNK_TOKENS", "64")  # an explicit setting wins over the role's default
    assert served_config(capsys, "--device", "cpu", "--role", "decode")["restore"]["chunk_tokens"] == 64


def test_bad_role_settings_exit_2(capsys, clean_env):
    assert main(["serve", "--print-config", "--device", "cpu", "--role", "decode", "--kv-min-quality", "2"]) == 2
    assert "kv_min_quality" in capsys.readouterr().err
