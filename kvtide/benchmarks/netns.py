"""A real bandwidth limit for the transfer benchmarks: two network namespaces joined by a `tc`-shaped veth pair.

`ShapedLink(rate_gbps, delay_ms)` creates namespaces ``kvt<pid>_<n>a`` and ``..b``, a veth pair between them with
the two addresses of a private /30, and on each end's egress a token bucket filter (``tbf``) at the rate, under
a ``netem`` delay when ``delay_ms`` > 0; so both directions are shaped. A process started with
`exec_argv` runs inside one side and reaches the other at ``addresses``. `set_rate` changes the limit live
(``tc qdisc replace``); ``rate_gbps=None`` leaves the link unshaped. Everything is removed on exit, also after an
exception. Needs root, ``ip`` and ``tc`` (iproute2) and a kernel that allows network namespaces, veth and tbf:
`netns_available` says whether this host does, and why not. A delay also needs the kernel's netem qdisc, which
some kernels (minimal VM kernels) leave out: then ``delay_ms > 0`` fails with that reason.
"""
from __future__ import annotations

import functools
import itertools
import os
import shutil
import subprocess
from collections.abc import Sequence

from kvtide.log import get_logger

log = get_logger("benchmarks.netns")

SUBNET = ("10.231.0.1", "10.231.0.2")  # a /30 that lives only inside the two namespaces: no clash with the host
_PREFIX = "kvt"
_ids = itertools.count()


def _run(argv: Sequence[str], check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


@functools.cache
def netns_available() -> tuple[bool, str]:
    """(True, "") when this host can build a `ShapedLink`: root, ``ip`` and ``tc``, and a namespace with a veth
    and a tbf qdisc can actually be made (containers often forbid one of them); else (False, the reason)."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found (apt-get install iproute2)"
    ns = f"{_PREFIX}{os.getpid()}probe"
    try:
        _run(["ip", "netns", "add", ns])
        try:
            _run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
            _run(["tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1gbit", "burst", "128kb",
                  "latency", "50ms"])
        finally:
            _run(["ip", "netns", "del", ns], check=False)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot build a shaped namespace pair here: {e}"
    return True, ""


def _tbf_args(rate_gbps: float) -> list[str]:
    """tbf at ``rate_gbps``: a bucket of >= 1 ms of traffic (and >= two 64 KiB GSO packets), 50 ms of queue."""
    rate_bps = rate_gbps * 1e9
    burst = max(128 << 10, int(rate_bps / 8 * 1e-3))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "50ms"]


class ShapedLink:
    """Two namespaces and a veth pair shaped to ``rate_gbps`` each way (None: unshaped), ``delay_ms`` one way."""

    def __init__(self, rate_gbps: float | None, delay_ms: float = 0.0):
        if rate_gbps is not None and not rate_gbps > 0:
            raise ValueError(f"rate_gbps: expected a positive number or None, got {rate_gbps!r}")
        if not delay_ms >= 0:
            raise ValueError(f"delay_ms: expected a non-negative number, got {delay_ms!r}")
        n = next(_ids)
        tag = f"{_PREFIX}{os.getpid()}_{n}"
        self.namespaces = (f"{tag}a", f"{tag}b")
        self.devices = (f"{tag}a"[-15:], f"{tag}b"[-15:])  # interface names: at most 15 characters
        self.addresses = SUBNET
        self.rate_gbps = rate_gbps
        self.delay_ms = delay_ms
        self._up = False

    # -- lifetime --------------------------------------------------------------------------------------------
    def __enter__(self) -> ShapedLink:
        ok, why = netns_available()
        if not ok:
            raise RuntimeError(f"ShapedLink: {why}")
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        (na, nb), (da, db) = self.namespaces, self.devices
        self._up = True  # from here on close() has something to remove
        _run(["ip", "netns", "add", na])
        _run(["ip", "netns", "add", nb])
        _run(["ip", "link", "add", da, "netns", na, "type", "veth", "peer", "name", db, "netns", nb])
        for ns, dev, addr in ((na, da, self.addresses[0]), (nb, db, self.addresses[1])):
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
        self._shape(self.rate_gbps, first=True)
        log.debug("shaped link %s <-> %s at %s Gbps, %s ms", na, nb, self.rate_gbps, self.delay_ms)

    def close(self) -> None:
        """Remove both namespaces (and with them the veth pair and its qdiscs); idempotent."""
        if not self._up:
            return
        self._up = False
        for ns in self.namespaces:
            _run(["ip", "netns", "del", ns], check=False)

    # -- shaping ---------------------------------------------------------------------------------------------
    def _shape(self, rate_gbps: float | None, first: bool = False) -> None:
        for ns, dev in zip(self.namespaces, self.devices):
            tc = ["tc", "-n", ns, "qdisc"]
            if self.delay_ms > 0:
                if first:
                    try:
                        _run([*tc, "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms",
                              "limit", "100000"])
                    except RuntimeError as e:
                        raise RuntimeError(f"ShapedLink: delay_ms needs the netem qdisc (sch_netem): {e}") from e
                where = ["parent", "1:", "handle", "2:"]
            else:
                where = ["root", "handle", "2:"]
            if rate_gbps is None:
                if not first:
                    _run([*tc, "del", "dev", dev, *where], check=False)
            else:
                _run([*tc, "replace", "dev", dev, *where, *_tbf_args(rate_gbps)])

    def set_rate(self, rate_gbps: float | None) -> None:
        """Change the limit of both directions now (None: remove it); connections stay up."""
        if rate_gbps is not None and not rate_gbps > 0:
            raise ValueError(f"rate_gbps: expected a positive number or None, got {rate_gbps!r}")
        if not self._up:
            raise RuntimeError("ShapedLink.set_rate: the link is not up (use it as a context manager)")
        self._shape(rate_gbps)
        self.rate_gbps = rate_gbps

    # -- processes -------------------------------------------------------------------------------------------
    def exec_argv(self, side: int | str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside side 0/"a" (at ``addresses[0]``) or 1/"b" (at ``addresses[1]``)."""
        index = {0: 0, 1: 1, "a": 0, "b": 1}.get(side)  # type: ignore[call-overload]
        if index is None:
            raise ValueError(f"side: expected 0, 1, 'a' or 'b', got {side!r}")
        return ["ip", "netns", "exec", self.namespaces[index], *argv]


def remove_stale() -> list[str]:
    """Delete namespaces left by `ShapedLink`s of processes that no longer exist (a killed benchmark)."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX):].split("_")[0].removesuffix("probe")
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed
