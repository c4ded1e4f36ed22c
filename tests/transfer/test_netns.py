"""The shaped link of the transfer benchmarks: two namespaces, a tc-limited veth pair, Mooncake TCP across it.

A sender in one namespace writes 16 MB into a receiver in the other; the measured rate is within 25% of the limit,
follows a live `set_rate`, and is far higher unshaped. Skipped, with the reason, where the host cannot build
namespaces (not root, no iproute2, a kernel without veth or tbf).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest
from test_transport_mooncake import Peer, peer_argv  # the peer program and its driver

from kvtide.benchmarks.netns import ShapedLink, netns_available

OK, WHY = netns_available()
needs_netns = pytest.mark.skipif(not OK, reason=WHY)
needs_mooncake = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                    reason="the pd extra (Mooncake) is not installed")
N = 16 << 20


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_availability_is_a_reason_or_nothing():
    ok, why = netns_available()
    assert isinstance(ok, bool) and isinstance(why, str) and (ok == (why == ""))


@needs_netns
def test_link_is_removed_even_after_an_exception():
    with pytest.raises(KeyError):
        with ShapedLink(0.5) as link:
            assert set(link.namespaces) <= _namespaces()
            argv = link.exec_argv("b", ["true"])
            assert argv[:4] == ["ip", "netns", "exec", link.namespaces[1]] and argv[4:] == ["true"]
            for side, addr in enumerate(link.addresses):
                shown = subprocess.run(link.exec_argv(side, ["ip", "-o", "addr", "show"]), capture_output=True,
                                       text=True, timeout=10).stdout
                assert f"{addr}/30" in shown and link.devices[side] in shown
            raise KeyError("boom")
    assert not set(link.namespaces) & _namespaces()
    with pytest.raises(ValueError):
        link.exec_argv("c", ["true"])
    with pytest.raises(ValueError):
        ShapedLink(0)


def _send(sender: Peer, receiver: Peer, dst: dict, seed: int) -> float:
    """One 16 MB write across the link; returns its rate in bytes/s after checking the bytes arrived."""
    out = json.loads(sender.ask(f"write {N} {seed} {json.dumps(dst)}", timeout=25))
    assert receiver.ask("sha") == out["sha"]
    return N / out["seconds"]


@needs_netns
@needs_mooncake
def test_shaped_rate_over_mooncake_tcp():
    with ShapedLink(0.2) as link:
        a, b = link.addresses
        with Peer(link.exec_argv("b", peer_argv("receive", "--host", b, "--nbytes", str(N)))) as receiver, \
                Peer(link.exec_argv("a", peer_argv("send", "--host", a))) as sender:
            dst = json.loads(receiver.ask(timeout=25))
            assert dst["session"].startswith(f"{b}:")
            json.loads(sender.ask(f"write 4096 0 {json.dumps(dst)}", timeout=25))  # handshake, warm-up
            shaped = _send(sender, receiver, dst, 1)
            assert abs(shaped / 25e6 - 1) < 0.25, shaped  # 0.2 Gbps = 25 MB/s, payload rate
            link.set_rate(0.4)
            faster = _send(sender, receiver, dst, 2)
            assert abs(faster / 50e6 - 1) < 0.25, faster
            link.set_rate(None)
            unshaped = _send(sender, receiver, dst, 3)
            assert unshaped > 4 * faster, (unshaped, faster)
