"""Optional dependencies: a missing extra fails with its pip command; a present one imports as usual."""
from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from kvtide import extras
from kvtide.extras import MissingExtra, require, require_extra

ROOT = Path(__file__).resolve().parents[1]


def test_present_module_is_returned():
    assert require("json", "serve") is sys.modules["json"]
    assert require("xml.dom", "serve").__name__ == "xml.dom"


def test_absent_module_names_the_extra():
    with pytest.raises(MissingExtra, match=r"pip install 'kvtide\[transfer\]'") as e:
        require("kvtide_no_such_module", "transfer", "the test codec")
    assert isinstance(e.value, ModuleNotFoundError) and e.value.name == "kvtide_no_such_module"
    assert "the test codec needs" in str(e.value)


def test_a_broken_installed_module_keeps_its_own_error(tmp_path, monkeypatch):
    (tmp_path / "kvtide_broken_pkg.py").write_text("import kvtide_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as e:
        require("kvtide_broken_pkg", "bench")
    assert not isinstance(e.value, MissingExtra) and e.value.name == "kvtide_missing_dependency"


def test_unknown_extra_is_an_error():
    with pytest.raises(ValueError, match="unknown extra"):
        require("json", "no-such-extra")


def test_require_extra_checks_every_module(monkeypatch):
    require_extra("serve")  # the test install has it
    monkeypatch.setitem(extras.EXTRAS, "serve", ("fastapi", "kvtide_no_such_module"))
    with pytest.raises(MissingExtra, match=r"kvtide\[serve\]"):
        require_extra("serve", "kvtide serve")


def test_extras_are_pyproject_extras():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras.EXTRAS) <= set(declared)


def test_redis_tier_without_redis_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` now fails as if it were not installed
    monkeypatch.delitem(sys.modules, "kvtide.store.redis_store", raising=False)
    with pytest.raises(MissingExtra, match=r"pip install 'kvtide\[redis\]'"):
        importlib.import_module("kvtide.store.redis_store")


def test_zstd_codec_without_zstandard_names_the_extra(monkeypatch):
    from kvtide.transfer.pipeline import Pipeline

    monkeypatch.setitem(sys.modules, "zstandard", None)
    kv = torch.randn(2, 2, 16, 2, 8).to(torch.bfloat16)  # [layers, K|V, tokens, kv_heads, head_dim]
    with pytest.raises(MissingExtra, match=r"kvtide\[transfer\]"):
        Pipeline("none|none|zstd").encode(kv)
