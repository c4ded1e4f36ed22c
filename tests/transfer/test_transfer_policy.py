"""TransferPolicy's policy keys: each key's goodput meter and residuals see only the transfers made under it (the
shared-state policy let one decision process's transfers steer another's choice), the default key is the
instance's own, and malformed or surplus keys are refused naming the field."""
from __future__ import annotations

import json

import pytest

from kvtide.transfer.baselines import KIVI_2BIT
from kvtide.transfer.controller import Profile
from kvtide.transfer.handoff import SendResult
from kvtide.transfer.online import OnlineConfig
from kvtide.transfer.policy import PolicyKeyError, TransferPolicy, check_policy_key

PEER = "decode-1"
VOLUME = 100_000_000  # bytes of raw KV per hand-off
# 5x smaller on the wire, 2 s of coding for VOLUME: worth it only on a slow link (below 40 MB/s)
LOSSY = Profile(KIVI_2BIT, 5.0, 1e8, 1e8, 0.98)


def _policy(**kw) -> TransferPolicy:
    # the guess is a fast link: with nothing measured, BF16 wins; epsilon 0: no exploration in the choices
    return TransferPolicy([LOSSY], guess_bandwidth=1e11, config=OnlineConfig(epsilon=0.0), **kw)


def _sent(wire: int, write_s: float, total_s: float, span_s: float | None = None) -> SendResult:
    """A transfer whose writes filled their span (the link set the pace) unless ``span_s`` says otherwise."""
    return SendResult("p", "s", 30, VOLUME, wire, 0.5, write_s, total_s, write_s if span_s is None else span_s)


def _slow(policy: TransferPolicy, key: str) -> None:
    """One transfer under ``key`` at 1 MB/s (BF16, named: no decision)."""
    policy.observe(PEER, policy.named(PEER, "none|none|none", key), _sent(1_000_000, 1.0, 1.0), key)


def test_a_keys_measured_bandwidth_steers_only_its_own_decisions():
    policy = _policy()
    assert policy.decide(PEER, VOLUME, 0.97, None).name == "bf16"  # the fast guess
    _slow(policy, "arm-a")
    a = policy.decide(PEER, VOLUME, 0.97, None, key="arm-a")
    assert a.name == LOSSY.name and a.measured and a.bandwidth == pytest.approx(1e6)
    for key in ("", "arm-b"):  # neither the instance's own state nor another key saw that transfer
        other = policy.decide(PEER, VOLUME, 0.97, None, key=key)
        assert other.name == "bf16" and not other.measured and other.bandwidth == 1e11
    assert policy.observed(PEER, "arm-a") == 1 and policy.observed(PEER, "") == 0
    assert policy.observed(PEER, "arm-b") == 0


def test_a_keys_residuals_steer_only_its_own_decisions():
    policy = _policy()
    for key in ("arm-a", "arm-b"):
        _slow(policy, key)
    d = policy.decide(PEER, VOLUME, 0.97, None, key="arm-a")
    assert d.name == LOSSY.name
    # the lossy profile took far longer than modelled under arm-a (a slow codec there): arm-a learns to avoid it
    policy.observe(PEER, d, _sent(VOLUME // 5, 1.0, 1000.0), key="arm-a")
    assert policy.decide(PEER, VOLUME, 0.97, None, key="arm-a").name == "bf16"
    assert policy.decide(PEER, VOLUME, 0.97, None, key="arm-b").name == LOSSY.name


def test_named_keys_are_bounded_and_checked():
    policy = _policy(max_keys=2)
    policy.admit("x")
    policy.admit("y")
    policy.admit("x")  # a kept key is always admitted
    policy.admit("")  # the default key is not counted
    with pytest.raises(PolicyKeyError, match="policy_key.*already keeps 2"):
        policy.admit("z")
    with pytest.raises(PolicyKeyError, match="policy_key"):
        policy.decide(PEER, VOLUME, 0.97, None, key="z")
    assert sorted(policy.keys()) == ["", "x", "y"]
    for bad in ("", "a b", "x" * 65, 7, None, "k\n"):
        with pytest.raises(PolicyKeyError, match="'policy_key' must be"):
            check_policy_key(bad)
    assert check_policy_key("no-bandwidth-model.v2_1") == "no-bandwidth-model.v2_1"
    with pytest.raises(ValueError, match="max_keys"):
        _policy(max_keys=-1)


def test_packaged_table_prefers_the_gpu_rates_on_cuda():
    from kvtide.transfer.policy import packaged_table
    cpu, gpu = packaged_table("smollm2-135m"), packaged_table("smollm2-135m", "cuda")
    assert cpu.name == "profiles_smollm2-135m.json" and gpu.name == "profiles_smollm2-135m_gpu.json"
    assert "H200" in json.loads(gpu.read_text())["info"]["throughput"]
    assert packaged_table("no-such-model", "cuda") is None


def test_a_gpu_table_read_without_a_gpu_leaves_out_its_gpu_only_codecs(monkeypatch):
    """nvCOMP's ANS has no host coder: a CPU instance given the GPU table must not choose it (every hand-off
    would fail to encode and be recomputed); the nvzstd profiles stay (their format has a host coder)."""
    import kvtide.transfer.policy as policy
    from kvtide.transfer.policy import packaged_table, table_profiles
    path = str(packaged_table("smollm2-135m", "cuda"))
    names = {p.name for p in table_profiles(path, "cpu")}
    assert names and not any(n.endswith("|nvans") for n in names)
    assert any(n.endswith("|nvzstd") for n in names)
    monkeypatch.setattr(policy, "gpu_ready", lambda device: True)  # a CUDA device with nvCOMP keeps them all
    every = {p.name for p in table_profiles(path, "cuda")}
    assert names < every and any(n.endswith("|nvans") for n in every)
