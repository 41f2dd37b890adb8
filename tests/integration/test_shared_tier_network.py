"""The shared tier over a real network (docs/fleet.md, "The shared tier over a network").

Two hosts and the store each in their own network namespace (tests/integration/_netns.py):
the store's namespace holds a bridge with 10.213.0.1, each host's namespace a veth pair to
it; the addresses exist only inside these namespaces. The store is a real TLS-only
``redis-server`` whose deployments' user has exactly ``ACL_RULES`` (as in production); each
host runs a stock ``lmcache server`` started by ``kvp-admin launch`` inside its namespace,
on its own loopback, with its own cache root; LMCache's valkey adapter talks to the store
over the link. LMCache's own MP client (tests/integration/_netdriver.py, in the host's
namespace) stores on host A and retrieves on host B; the time of a retrieve (lookup,
prefetch from L1, the NVMe or the store, retrieve) is what a vLLM request would wait for.

Faults on host B's link only: added delay, loss, a partition (link down) during a retrieve,
a store restart. For each: the bytes B gets are the bytes A stored (a chunk that misses is
recomputed, never wrong), B keeps serving from L1 and its NVMe, the added latency is bounded
by the adapter's timeouts, ``health`` is degraded while the store is unreachable and healthy
after the heal without a restart of the server, the alert fires (a real Prometheus) and the
time to recover is measured. A 3-primary cluster in the store's namespace is partitioned
and healed too.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.shared_tier import (
    ACL_CLUSTER_RULES,
    ACL_RULES,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
)

from ..fullstack._stack import Stack, wait_until
from ._netdriver import NetDriver
from ._netns import STORE_IP, Net, make_net
from ._prometheus import monitoring, short_for_rules
from ._redis import Redis, start_redis
from .test_shared_tier import host

pytestmark = pytest.mark.integration

#: sequences host A stores (4 chunks of 256 tokens each, 256 KiB per chunk): as many as
#: the tests ask B for fresh ones
STORED = range(1, 21)
#: sequences host A stores on the cluster
CLUSTER_STORED = range(1, 4)
CHUNKS = 4
#: LMCache's valkey adapter runs the EXISTS (lookup) and GET (load) of one request on its
#: worker threads; while the store does not answer, each waits for the request timeout, so
#: a lookup costs one timeout per round of ``workers`` keys
WORKERS = 8
PARTITION_BOUND_S = math.ceil(CHUNKS / WORKERS) * DEFAULT_TIMEOUT_S
#: what the shared 2-core machine may add to a measured time (other tests run beside)
SLACK_S = 2.0


@dataclass
class Fleet:
    net: Net
    redis: Redis
    a: Stack
    b: Stack
    ns: str
    stored: dict[int, list[str]]
    d: NetDriver
    #: the 3-primary cluster in the store's namespace, and one server per host using it
    cluster: Redis
    ca: Stack
    cb: Stack
    cluster_stored: dict[int, list[str]]
    #: host B's client of ``cb``
    dc: NetDriver
    fresh_seqs: Iterator[int] = field(default_factory=lambda: iter(STORED))
    #: what each test measured (printed at the end of the module: pytest -s shows it)
    measured: dict[str, Any] = field(default_factory=dict)

    def fresh(self) -> int:
        """A sequence A stored that B never asked for: B must get it from the store."""
        return next(self.fresh_seqs)

    def retrieve(self, seq: int) -> dict[str, Any]:
        """B retrieves ``seq``; asserts that whatever hit is what A stored (a prefix: vLLM
        recomputes the rest)."""
        got = self.d.retrieve(seq)
        want = self.stored.get(seq)
        if got["hit"]:
            assert want is not None and got["digests"] == want[:got["hit"]], (seq, got)
        return got

    def health(self, s: Stack | None = None, probe_s: float = 3.0
               ) -> tuple[int, dict[str, Any], float]:
        """``kvp-admin health`` of host B (or ``s``) in its namespace; each probe bounded by
        ``probe_s`` (the default is the health timer's: with 1 s, the cache server's own
        admin API once answered too late during a partition on this loaded machine, and
        the server was reported degraded)."""
        s = s or self.b
        t0 = time.monotonic()
        r = s.kvp("health", s.config, "--no-vllm", "--json", "--timeout", str(probe_s),
                  timeout=120)
        return r.returncode, json.loads(r.stdout), time.monotonic() - t0


def not_ok(doc: dict[str, Any]) -> list[dict[str, str]]:
    """The checks of a health document that are not ok (for an assertion's message)."""
    return [c for c in doc.get("checks", []) if c.get("status") != "ok"]


def in_parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` at once (each is mostly waiting on a process); every result, or the
    first exception once all have ended."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
    return [f.result() for f in futures]


def host_on(tmp: Path, name: str, net: Net, r: Redis) -> Stack:
    """Host ``name`` (its own cache root, state and ports) in namespace ``name[0]``, using
    the store ``r``; every host shares one serde key file (the fleet's key, which the
    Ansible role distributes)."""
    s = host(tmp, name, r)
    s.wrapper = net.hosts[name[0]].wrap
    s.env["KVP_SERDE_KEY_FILE"] = str(tmp / "fleet-key" / "l2-master.key")
    return s


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One network for the module: the TLS store and the cluster in the store's namespace,
    hosts A and B with a server for each store (four servers, launched at once)."""
    tmp = tmp_path_factory.mktemp("net")
    net = make_net("a", "b")
    stores: list[Redis] = []
    stacks: list[Stack] = []
    drivers: list[NetDriver] = []
    try:
        def standalone() -> Redis:
            r = start_redis(tmp / "store", tls=True, acl=ACL_RULES, host=STORE_IP,
                            wrap=net.store_wrap)
            stores.append(r)
            return r

        def cluster() -> Redis:
            r = start_redis(tmp / "cluster", cluster=True, host=STORE_IP,
                            wrap=net.store_wrap, acl=f"{ACL_RULES} {ACL_CLUSTER_RULES}")
            stores.append(r)
            return r

        r, rc = in_parallel(standalone, cluster)
        stacks += [host_on(tmp, "a", net, r), host_on(tmp, "b", net, r),
                   host_on(tmp, "ac", net, rc), host_on(tmp, "bc", net, rc)]
        a, b, ca, cb = stacks
        shown, shown_c = in_parallel(a.render, cb.render)
        ns = shown["namespace"]
        tier = shown["shared_tier"]
        assert (tier["adapter"], tier["tls"], tier["endpoint"]) == (
            "valkey", True, f"{STORE_IP}:{r.nodes[0].port}")
        assert (shown["shared_l2_adapter"]["request_timeout"],
                shown["shared_l2_adapter"]["connection_timeout"]) == (
            DEFAULT_TIMEOUT_S, DEFAULT_CONNECT_TIMEOUT_S)
        assert shown_c["namespace"] == ns
        assert shown_c["shared_tier"]["cluster"] and shown_c["shared_tier"]["adapter"] == "valkey"
        in_parallel(*[lambda s=s: s.launch("--no-vllm", "--timeout", "240") for s in stacks])
        # LMCache's client in each host's namespace, one per server, started at once
        for s in stacks:
            drivers.append(NetDriver(s.wrapper, s.rpc, s.http, ns, wait=False))
        da, d, dac, dbc = (x.wait_ready() for x in drivers)
        stored = {seq: da.store(seq) for seq in STORED}
        cluster_stored = {seq: dac.store(seq) for seq in CLUSTER_STORED}
        assert wait_until(lambda: len(r.scan_keys(f"{ns}@*")) == CHUNKS * len(STORED), 60)
        f = Fleet(net, r, a, b, ns, stored, d, rc, ca, cb, cluster_stored, dbc)
        yield f
        print("\nmeasured:", json.dumps(f.measured, indent=1))
    finally:
        net.heal_all()  # a stop writes to the store (its fleet record)
        # (the no-op keeps the pool's size above zero when nothing was started)
        in_parallel(*[x.close for x in drivers], lambda: None)
        in_parallel(*[s.cleanup for s in stacks], *[r.stop for r in stores],
                    lambda: None)
        net.close()


def added(fl: Fleet, fault: str, apply: Any, clear: Any) -> dict[str, float]:
    """B's retrieve times without and with a fault, paired: a sequence only the store holds
    and one in B's L1, before and while ``apply()`` holds; ``clear()`` always runs."""
    warm = fl.fresh()
    assert fl.retrieve(warm)["hit"] == CHUNKS  # now in B's L1
    base_store = fl.retrieve(fl.fresh())
    base_l1 = fl.retrieve(warm)
    assert base_store["hit"] == CHUNKS and base_l1["hit"] == CHUNKS
    apply()
    try:
        seq = fl.fresh()
        faulty = fl.retrieve(seq)
        faulty_l1 = fl.retrieve(warm)
    finally:
        clear()
    again = fl.retrieve(seq)  # what missed under the fault hits once it is gone
    assert again["hit"] == CHUNKS
    out = {"store_s": base_store["s"], "store_fault_s": faulty["s"],
           "store_added_s": faulty["s"] - base_store["s"], "store_hits": faulty["hit"],
           "l1_s": base_l1["s"], "l1_fault_s": faulty_l1["s"],
           "l1_added_s": faulty_l1["s"] - base_l1["s"]}
    fl.measured[fault] = out
    assert faulty_l1["hit"] == CHUNKS  # L1 serves under every fault
    return out


@pytest.mark.parametrize("ms", [5, 50])
def test_delay(fleet: Fleet, ms: int) -> None:
    """Every packet from B to the store held ``ms`` ms: every chunk still arrives, with the
    same bytes; the lookup and load cost a few round trips more."""
    m = added(fleet, f"delay {ms} ms", lambda: fleet.net.delay("b", ms),
              lambda: fleet.net.clear("b"))
    assert m["store_hits"] == CHUNKS
    # a lookup (EXISTS) and a load (GET of 256 KiB, TCP's window opening) are some round
    # trips each; the L1 hit still waits for the EXISTS round
    assert m["store_added_s"] < 20 * ms / 1000 + SLACK_S, m
    assert m["l1_added_s"] < 4 * ms / 1000 + SLACK_S, m


@pytest.mark.parametrize("pct", [1, 10])
def test_loss(fleet: Fleet, pct: int) -> None:
    """``pct`` % of the packets lost each way: TCP retransmits; a chunk whose GET outlives
    the request timeout is a miss (recomputed), never wrong bytes (checked in
    ``Fleet.retrieve``), and the wait stays bounded by the timeouts."""
    m = added(fleet, f"loss {pct} %", lambda: fleet.net.loss("b", pct),
              lambda: fleet.net.clear("b"))
    if pct == 1:
        assert m["store_hits"] == CHUNKS, m
    bound = 2 * PARTITION_BOUND_S + SLACK_S  # one timeout for EXISTS, one for GET
    assert m["store_added_s"] < bound and m["l1_added_s"] < PARTITION_BOUND_S + SLACK_S, m


def test_partition_during_a_retrieve_then_heal(fleet: Fleet, tmp_path: Path) -> None:
    fl, b, net = fleet, fleet.b, fleet.net
    rules = short_for_rules(tmp_path / "rules.yml")
    with monitoring(tmp_path / "mon", rules=rules) as mon:

        up = "kvpersist_shared_tier_up"

        def metrics(want: float) -> None:
            """kvp-admin metrics writes the textfile; Prometheus scrapes ``up == want``."""
            t0 = time.monotonic()
            b.kvp("metrics", b.config, "--no-vllm", "--timeout", "2", "--textfile",
                  str(mon.textfile_dir), timeout=120)
            fl.measured.setdefault("metrics_s", []).append(time.monotonic() - t0)
            mon.wait_value(up, lambda v: v == want, timeout=30, what=f"{up} == {want}")

        metrics(1)
        own = 10_001  # stored by B itself (L1, its NVMe, the store) before the partition
        own_digests = fl.d.store(own)
        fl.stored[own] = own_digests
        assert wait_until(lambda: len(b.chunk_files(fl.ns + "_")) >= CHUNKS, 30)
        assert wait_until(lambda: len(fl.redis.scan_keys(f"{fl.ns}@*")) ==
                          CHUNKS * (len(STORED) + 1), 30)
        warm = fl.fresh()
        assert fl.retrieve(warm)["hit"] == CHUNKS
        base = fl.retrieve(warm)["s"]

        # the partition lands while B loads a sequence from the store: a delay of 300 ms
        # stretches the retrieve (EXISTS, then GET), the link goes down after its EXISTS
        net.delay("b", 300)
        seq = fl.fresh()
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.update(fl.retrieve(seq)))
        t.start()
        time.sleep(0.45)
        net.partition("b")
        t0 = time.monotonic()
        t.join(60)
        net.clear("b")
        assert not t.is_alive() and box, "the retrieve did not come back"
        # the GETs in flight wait for the request timeout, then miss: recomputed
        assert box["s"] < 0.3 + 2 * PARTITION_BOUND_S + SLACK_S, box
        fl.measured["partition: retrieve cut"] = {"s": box["s"], "hits": box["hit"]}

        # while the store is unreachable: L1 serves, the NVMe serves, B stores on its NVMe
        during = fl.retrieve(warm)
        assert during["hit"] == CHUNKS
        assert during["s"] - base < PARTITION_BOUND_S + SLACK_S, (during, base)
        fl.d.clear_l1()
        nvme = fl.retrieve(own)
        assert nvme["hit"] == CHUNKS and nvme["digests"] == own_digests
        missed = fl.retrieve(fl.fresh())  # only the store holds it: a miss, bounded
        assert missed["hit"] == 0 and missed["s"] < PARTITION_BOUND_S + SLACK_S, missed
        new = 10_002
        fl.stored[new] = fl.d.store(new)
        assert wait_until(lambda: len(b.chunk_files(fl.ns + "_")) >= 2 * CHUNKS, 30)
        fl.measured["partition"] = {"l1_s": base, "l1_partition_s": during["s"],
                                    "nvme_partition_s": nvme["s"],
                                    "store_only_partition_s": missed["s"]}
        code, doc, took = fl.health()
        assert code == 1 and doc["components"]["shared_tier"] == "degraded", doc
        assert doc["components"]["cache_server"] == "ok", not_ok(doc)
        fl.measured["partition"]["health_s"] = took
        metrics(0)
        mon.wait_for('ALERTS{alertname="KvpersistSharedTierDown",alertstate="firing"}',
                     lambda res: len(res) == 1, timeout=30, what="the alert fires")
        assert mon.values(up) == [0]

        # heal: no restart; the adapter reconnects, fresh sequences hit from the store
        net.heal("b")
        healed = time.monotonic()
        after = fl.fresh()  # a miss leaves nothing behind: the same sequence is asked again
        assert wait_until(lambda: fl.retrieve(after)["hit"] == CHUNKS, 60, interval=0.2)
        fl.measured["partition"]["recovery_s"] = time.monotonic() - healed
        fl.measured["partition"]["down_s"] = healed - t0
        code, doc, _ = fl.health()
        assert code == 0 and doc["components"]["shared_tier"] == "ok", doc
        metrics(1)
        mon.wait_for('ALERTS{alertname="KvpersistSharedTierDown",alertstate="firing"}',
                     lambda res: res == [], timeout=30, what="the alert resolves")
        # what B stored during the partition reached only its NVMe, not the store
        assert len(fl.redis.scan_keys(f"{fl.ns}@*")) == CHUNKS * (len(STORED) + 1)


def test_store_restart(fleet: Fleet) -> None:
    """The store killed (SIGKILL: the kernel resets its connections) and started again with
    its data (AOF): B serves from L1 meanwhile; the adapter reconnects by itself."""
    fl = fleet
    warm = fl.fresh()
    assert fl.retrieve(warm)["hit"] == CHUNKS
    base = fl.retrieve(warm)["s"]
    fl.redis.kill()
    killed = time.monotonic()
    try:
        during = fl.retrieve(warm)
        assert during["hit"] == CHUNKS
        missed = fl.retrieve(fl.fresh())
        assert missed["hit"] == 0
        code, doc, took = fl.health()
        assert code == 1 and doc["components"]["shared_tier"] == "degraded", doc
    finally:
        fl.redis.restart()
    restarted = time.monotonic()
    after = fl.fresh()
    assert wait_until(lambda: fl.retrieve(after)["hit"] == CHUNKS, 60, interval=0.2)
    fl.measured["store restart"] = {
        "l1_s": base, "l1_down_s": during["s"], "store_only_down_s": missed["s"],
        "health_s": took, "down_s": restarted - killed,
        "recovery_s": time.monotonic() - restarted}
    assert during["s"] - base < PARTITION_BOUND_S + SLACK_S
    code, doc, _ = fl.health()
    assert code == 0, doc


def _retrieve_until_whole(d: Any, seq: int, timeout: float) -> list[dict[str, Any]]:
    """Every retrieve of ``seq`` until one hits all its chunks or ``timeout`` passes."""
    seen = [d.retrieve(seq)]
    deadline = time.monotonic() + timeout
    while seen[-1]["hit"] != CHUNKS and time.monotonic() < deadline:
        time.sleep(0.2)
        seen.append(d.retrieve(seq))
    return seen


def test_cluster_partition_and_heal(fleet: Fleet) -> None:
    """A 3-primary cluster in the store's namespace (the recommended cluster ACL): A stored,
    B gets A's chunks from every primary over the link; partitioned, B serves from L1
    within the bound and health is degraded; healed, B hits from the cluster again, no
    restart."""
    fl, net, r, stored = fleet, fleet.net, fleet.cluster, fleet.cluster_stored
    keys = [n.cli("--scan", "--pattern", f"{fl.ns}@*").split() for n in r.nodes]
    assert sum(len(k) for k in keys) == CHUNKS * len(stored)
    assert sum(1 for k in keys if k) >= 2  # spread over the primaries
    first, second, *rest = stored
    d = fl.dc
    got = d.retrieve(first)
    assert got["hit"] == CHUNKS and got["digests"] == stored[first]
    base = d.retrieve(first)["s"]
    net.partition("b")
    try:
        during = d.retrieve(first)
        assert during["hit"] == CHUNKS and during["digests"] == stored[first]
        assert during["s"] - base < PARTITION_BOUND_S + SLACK_S, (during, base)
        missed = d.retrieve(second)
        assert missed["hit"] == 0
        code, doc, _ = fl.health(fl.cb)
        assert code == 1 and doc["components"]["shared_tier"] == "degraded", doc
        assert doc["components"]["cache_server"] == "ok", not_ok(doc)
    finally:
        net.heal("b")
    healed = time.monotonic()
    assert wait_until(lambda: d.retrieve(second)["hit"] == CHUNKS, 60, interval=0.2)
    recovery = time.monotonic() - healed
    for seq in (second, *rest):
        # each primary's connection comes back on its own: right after the heal a sequence
        # whose later chunks live on a primary not yet reconnected is a shorter prefix hit
        # (the rest recomputed), never other bytes; every sequence hits whole again
        seen = _retrieve_until_whole(d, seq, 60)
        assert seen[-1]["hit"] == CHUNKS, seen[-1]
        for got in seen:
            assert (got["digests"] or []) == stored[seq][:got["hit"]], (seq, got)
    code, doc, _ = fl.health(fl.cb)
    assert code == 0 and doc["components"]["shared_tier"] == "ok", doc
    fl.measured["cluster partition"] = {"l1_s": base, "l1_partition_s": during["s"],
                                        "store_only_partition_s": missed["s"],
                                        "recovery_s": recovery}
