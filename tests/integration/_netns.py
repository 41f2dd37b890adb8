"""A small network of network namespaces for the shared tier over a real link: one "store"
namespace holding a bridge with the store's address, and one namespace per "host", each
joined to the bridge by its own veth pair. Addresses come from a test subnet
(``10.213.0.0/24``) that exists only inside these namespaces: nothing is routed anywhere
else, and every namespace has its own loopback (a host's cache server binds 127.0.0.1 in
its own namespace).

Faults, per host (on that host's path to the store only):

- ``partition``: the store's end of the host's veth goes down (the host's interface loses
  its carrier; packets are dropped, nobody answers, TCP sees only silence);
- ``loss(pct)``: iptables' ``statistic`` match drops that share of the packets in each
  direction (host to store and store to host), independently;
- ``delay(ms)``: every packet from the host to the store is held ``ms`` milliseconds
  (its round trip to the store grows by ``ms``) by :mod:`tests.integration._netem`, the
  userspace stand-in for ``tc ... netem delay`` (this kernel has no ``sch_netem``).

``Net.close`` stops what it started (by pid) and deletes the namespaces, which removes
their veths and rules; use it in a ``finally``.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass, field

from ..conftest import REPO

SUBNET = "10.213.0"
STORE_IP = f"{SUBNET}.1"
PREFIX = 24


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


@dataclass
class Host:
    name: str
    ns: str
    addr: str
    #: the host's end of its veth (in ``ns``) and the store's end (in the store namespace)
    dev: str
    peer: str
    netem: subprocess.Popen[str] | None = None

    @property
    def wrap(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns)


@dataclass
class Net:
    token: str
    store_ns: str
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def store_wrap(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.store_ns)

    def run(self, host: str, *argv: str, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``argv`` inside ``host``'s namespace (``"store"``: the store's)."""
        wrap = self.store_wrap if host == "store" else self.hosts[host].wrap
        r = subprocess.run([*wrap, *argv], capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{host}: {' '.join(argv)}: {r.stderr.strip()}")
        return r

    # -- faults
    def partition(self, host: str) -> None:
        ip("-n", self.store_ns, "link", "set", self.hosts[host].peer, "down")

    def heal(self, host: str) -> None:
        ip("-n", self.store_ns, "link", "set", self.hosts[host].peer, "up")

    def loss(self, host: str, percent: float) -> None:
        p = f"{percent / 100:.4f}"
        for chain, way in (("OUTPUT", "-d"), ("INPUT", "-s")):
            self.run(host, "iptables", "-w", "-A", chain, way, STORE_IP, "-m", "statistic",
                     "--mode", "random", "--probability", p, "-j", "DROP")

    def delay(self, host: str, ms: float) -> None:
        h = self.hosts[host]
        if h.netem is not None:
            raise RuntimeError(f"{host} already has a delay")
        h.netem = subprocess.Popen(
            [*h.wrap, sys.executable, "-m", "tests.integration._netem", "--queue", "0",
             "--delay-ms", str(ms)], cwd=REPO, stdout=subprocess.PIPE, text=True,
            start_new_session=True)
        assert h.netem.stdout is not None
        if h.netem.stdout.readline().strip() != "ready":
            self._stop_netem(h)
            raise RuntimeError(f"the delay on {host} did not start")
        self.run(host, "iptables", "-w", "-A", "OUTPUT", "-d", STORE_IP, "-j", "NFQUEUE",
                 "--queue-num", "0")

    def clear(self, host: str) -> None:
        """Every loss and delay of ``host`` removed (a partition is healed by ``heal``)."""
        self.run(host, "iptables", "-w", "-F", "OUTPUT")
        self.run(host, "iptables", "-w", "-F", "INPUT")
        self._stop_netem(self.hosts[host])

    @staticmethod
    def _stop_netem(h: Host) -> None:
        if h.netem is not None and h.netem.poll() is None:
            h.netem.send_signal(signal.SIGTERM)
            try:
                h.netem.wait(timeout=10)
            except subprocess.TimeoutExpired:
                h.netem.kill()
                h.netem.wait()
        h.netem = None

    def heal_all(self) -> None:
        """Every host's link up and its loss and delay removed (best effort: a teardown
        after a failed test stops servers that write to the store)."""
        for name in self.hosts:
            with contextlib.suppress(Exception):
                self.heal(name)
            with contextlib.suppress(Exception):
                self.clear(name)

    def close(self) -> None:
        for h in self.hosts.values():
            with contextlib.suppress(Exception):
                self._stop_netem(h)
        for ns in [*(h.ns for h in self.hosts.values()), self.store_ns]:
            ip("netns", "del", ns, check=False)


def make_net(*hosts: str) -> Net:
    """The store namespace (bridge ``STORE_IP``/24) and one namespace per name in ``hosts``
    (addresses .2, .3, ...), each joined to the bridge by a veth pair; all links up,
    loopbacks up. Raises RuntimeError (after removing what it made) if a step fails."""
    token = secrets.token_hex(3)
    net = Net(token, f"kvpn-{token}-store")
    try:
        ip("netns", "add", net.store_ns)
        ip("-n", net.store_ns, "link", "set", "lo", "up")
        ip("-n", net.store_ns, "link", "add", "kvbr", "type", "bridge")
        ip("-n", net.store_ns, "addr", "add", f"{STORE_IP}/{PREFIX}", "dev", "kvbr")
        ip("-n", net.store_ns, "link", "set", "kvbr", "up")
        for i, name in enumerate(hosts):
            h = Host(name, f"kvpn-{token}-{name}", f"{SUBNET}.{i + 2}", f"kv{name}{token}",
                     f"kv{name}{token}p")
            ip("netns", "add", h.ns)
            net.hosts[name] = h
            ip("link", "add", h.dev, "netns", h.ns, "type", "veth", "peer", "name", h.peer,
               "netns", net.store_ns)
            ip("-n", h.ns, "addr", "add", f"{h.addr}/{PREFIX}", "dev", h.dev)
            for args in (("lo", "up"), (h.dev, "up")):
                ip("-n", h.ns, "link", "set", *args)
            ip("-n", net.store_ns, "link", "set", h.peer, "master", "kvbr")
            ip("-n", net.store_ns, "link", "set", h.peer, "up")
    except BaseException:
        net.close()
        raise
    return net
