"""The kvp role over SSH and a rolling upgrade across three real hosts (issue 41).

Three hosts whose PID 1 is systemd 252, with sshd and an NVMe stand-in each, in network
namespaces on a test subnet that exists only inside them (tests/deploy/_hosts.py); the
controller (``ansible-playbook``, testinfra) in a namespace of its own on the same bridge, the
shared tier's ``redis-server`` (an ACL user with a password) in the store's. The operator's
commands, exactly: ``ansible-playbook -i INVENTORY ansible/kvpersist.yml`` and
``ansible/rolling.yml`` with the ssh connection and a key the test made, testinfra's
``ssh://`` backend. One deployment, ``roll`` (the tiny demo model in float32), on every host;
vLLM (CPU build) runs on h1 (``vllm: true``), from v2 on h3 too (a host that gains vLLM in
the roll: one vLLM start less at the converge); h2 runs its cache server alone.

1. The role converges the three hosts (changed on each), a second run changes nothing,
   ``--check --diff`` changes nothing; the store's password and the serde keys never appear in
   the output; the units run under systemd.
2. tests/infra's checks through ``ssh://`` on each host: the service user, modes, identity.env,
   units installed, enabled and their timers scheduled, the cache server listening on
   loopback, nothing group- or world-accessible.
3. h1 answers a returning user's chat on v1: its chunks on h1's NVMe and in the store.
   ``kvp-admin upgrade plan`` v1 -> v2 on h1 names the field (``engine_args``), the old
   namespace's files there and its keys in the store (written by the three hosts).
4. The roll of a KV-affecting change (v2: ``--hf-overrides.rope_theta``) with h2 made to fail
   its health (its new config keeps more free space than its NVMe has): h1 rolls (vLLM
   restarted by systemd on v2, warm set computed before ready; the returning user's chat
   comes from the cache with the answer of a cold run of v2), h2 fails, the roll stops
   there, h3 is never touched (same cache server process, still v1).
5. h2 fixed, the roll resumed (``kvp_roll_skip_ready``): h1 skipped (same vLLM process), h2
   and h3 roll (h3's new vLLM's warm-up finds the warm set in the store, computes nothing,
   and its first chat comes from the cache with the cold answer); after the last host v1 is
   reported stale on h1, nothing is deleted. (A
   resume once restarted h1 on a loaded machine, when the skip check was one health probe;
   it now waits ``kvp_roll_skip_wait_seconds`` for healthy and says why it rolls a host.)
6. ``kvp-admin fleet status`` over SSH on h2 and on h3: v2 has three live hosts that agree.
7. The stale namespace is deleted only when asked (``kvp_prune_stale_after_roll``), all but
   its warm-set pins (``prune --stale`` keeps them); v2 and h1's vLLM untouched.
8. ``rolling.yml --check --diff --limit h1`` of the next change (v3) shows it, stops, starts
   and writes nothing.

Every behaviour tests/deploy/test_rolling.py asserts with three deployments on one machine (the
local connection, ``kvp_roll_via: kvp-admin``) is asserted here too, on real hosts over SSH
with systemd; that module stays in the default suite, this one is opt-in
(tests/deploy/conftest.py has the figures).
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..fullstack._nsclient import NsClient
from ..integration._redis import Redis, start_redis
from . import _deployment as dep
from . import _hosts
from ._hosts import STORE_IP, Hosts

pytestmark = [pytest.mark.deploy, pytest.mark.fullstack]

HOSTS = ("h1", "h2", "h3")
#: the hosts whose deployment runs vLLM too, per version (h2 runs the cache server alone)
VLLM_HOSTS = {"v1": ("h1",), "v2": ("h1", "h3"), "v3": ("h1", "h3")}
NAME = "roll"
ROOT = f"{_hosts.CACHE_PARENT}/{NAME}"
CONFIG = f"/etc/kvpersist/{NAME}/identity.env"
ENGINE = {"v1": "--enforce-eager", "v2": "--enforce-eager --hf-overrides.rope_theta=20000",
          "v3": "--enforce-eager --hf-overrides.rope_theta=30000"}
PLAYBOOK = _hosts.ANSIBLE_DIR / "kvpersist.yml"
ROLLING = _hosts.ANSIBLE_DIR / "rolling.yml"


@dataclass
class Fleet:
    hosts: Hosts
    redis: Redis
    model: str
    workdir: Path
    ns: dict[str, str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    inventory: Path | None = None
    #: what earlier tests left for later ones
    seen: dict[str, Any] = field(default_factory=dict)
    #: the hosts whose vLLM runs now (h3's starts when it rolls to v2)
    vllm_on: set[str] = field(default_factory=lambda: {"h1"})

    # -- what the operator edits between runs
    def deployment(self, host: str, version: str, **extra: Any) -> dict[str, Any]:
        env = dep.demo_env(self.model, ENGINE[version], **extra)
        if version != "v1":
            env["KVP_WARMUP_COMPUTE"] = "true"
        return {"name": NAME, "cache_root": ROOT, "vllm": host in VLLM_HOSTS[version], "env": env,
                "shared_tier": {"url": self.redis.url, "username": self.redis.user,
                                "password": self.redis.password},
                "serde_keys": [{"namespace": ns, "key_b64": k} for ns, k in self.keys.items()]}

    def write_inventory(self, version: str, versions: dict[str, str] | None = None,
                        **per_host: dict[str, Any]) -> Path:
        """The inventory of every host on ``version`` (``versions``: other ones per host),
        with ``per_host``'s extra env keys."""
        self.inventory = self.hosts.inventory(
            {h: {"kvp_deployments": [self.deployment(h, (versions or {}).get(h, version),
                                                     **per_host.get(h, {}))]}
             for h in HOSTS}, dep.group_vars())
        return self.inventory

    def playbook(self, playbook: Path, *extra: str) -> _hosts.PlaybookRun:
        assert self.inventory is not None
        run = self.hosts.playbook(playbook, self.inventory, *extra)
        self.hosts.timings[f"{playbook.name} {' '.join(extra)}".strip()] = round(run.seconds, 1)
        return run

    def kvp_vars(self, host: str, version: str) -> Path:
        """The role's variables ``host`` was deployed with, for tests/infra's --kvp-vars."""
        path = self.workdir / f"kvp-vars-{host}.yml"
        path.write_text(yaml.safe_dump({**dep.group_vars(),
                                        "kvp_deployments": [self.deployment(host, version)]}))
        path.chmod(0o600)
        return path

    # -- a host, over SSH as an operator would
    def kvp(self, host: str, *args: str, check: bool = False,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return self.hosts.ssh(host, shlex.join([f"{_hosts.HOST_VENV}/bin/kvp-admin", *args]),
                              check=check, timeout=timeout)

    def health(self, host: str) -> tuple[int, dict[str, Any]]:
        args = ["health", CONFIG, "--json"] + ([] if host in self.vllm_on else ["--no-vllm"])
        r = self.kvp(host, *args)
        return r.returncode, json.loads(r.stdout)

    def main_pid(self, host: str, unit: str) -> int:
        return int(self.hosts.hosts[host].show(f"{unit}@{NAME}.service", "MainPID")["MainPID"])

    def chunk_files(self, host: str, ns: str) -> list[str]:
        out = self.hosts.hosts[host].sh(f"ls {ROOT} | grep '^{ns}_' || true").stdout
        return sorted(out.split())

    def warmup(self, host: str) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.hosts.hosts[host].exec(
            "cat", f"/var/lib/kvpersist/{NAME}/warmup.json").stdout)
        return doc

    def cold(self, host: str) -> str:
        """The returning user's request under a fresh cache salt on ``host``: nothing of
        any cache can match it (the answer to compare the cached ones with)."""
        with NsClient(self.hosts.hosts[host].wrap, "http://127.0.0.1:8000") as c:
            got = c.send({"op": "references", "requests": [[0, 0, dep.CHAT]],
                          "max_tokens": 24})
        assert "error" not in got, got
        return str(got["answers"][0][2])

    def returning_user(self, host: str = "h1") -> tuple[str, float]:
        """The returning user's chat on ``host`` (inside its namespace, on its loopback):
        the answer and the prompt tokens served from a cache (LMCache's, or vLLM's own
        prefix cache that the warm-up's load filled from LMCache)."""
        with NsClient(self.hosts.hosts[host].wrap, "http://127.0.0.1:8000") as c:
            before = (c.send({"op": "metric", "name": dep.HITS})["value"]
                      + c.send({"op": "metric", "name": dep.LOCAL_HITS})["value"])
            got = c.send({"op": "chat", "messages": dep.CHAT, "max_tokens": 24})
            assert "error" not in got, got
            after = (c.send({"op": "metric", "name": dep.HITS})["value"]
                     + c.send({"op": "metric", "name": dep.LOCAL_HITS})["value"])
        return str(got["text"]), after - before


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    data, model = dep.make_data(tmp_path_factory.mktemp("hosts-data"))
    hosts = _hosts.start_hosts(HOSTS, data=data)
    redis: Redis | None = None
    try:
        redis = start_redis(hosts.base / "store", host=STORE_IP, wrap=hosts.net.store_wrap)
        f = Fleet(hosts, redis, model, hosts.base / "work")
        f.ns = {v: dep.namespace_of(dep.demo_env(model, ENGINE[v]), f.workdir / v)
                for v in ENGINE}
        f.keys = {f.ns[v]: base64.b64encode(secrets.token_bytes(32)).decode() for v in ENGINE}
        yield f
        print("\nreal hosts, the fleet, measured (s):", json.dumps(hosts.timings, indent=1))
    finally:
        if redis is not None:
            redis.stop()
        hosts.close()


def _no_secret_in(f: Fleet, output: str) -> None:
    assert f.redis.password not in output
    for key in f.keys.values():
        assert key not in output


def test_the_role_converges_the_hosts_over_ssh(fleet: Fleet) -> None:
    fleet.write_inventory("v1")
    first = fleet.playbook(PLAYBOOK, "--diff")
    assert first.returncode == 0, first.output[-6000:] + fleet.hosts.journals()
    counts = first.recap()
    assert sorted(counts) == list(HOSTS), counts
    for h in HOSTS:
        assert counts[h]["failed"] == counts[h]["unreachable"] == 0, counts
        assert counts[h]["changed"] > 0, counts
    _no_secret_in(fleet, first.output)
    second = fleet.playbook(PLAYBOOK)
    assert second.returncode == 0, second.output[-6000:]
    assert all(c["changed"] == 0 for c in second.recap().values()), second.output[-6000:]
    assert "RUNNING HANDLER" not in second.output
    check = fleet.playbook(PLAYBOOK, "--check", "--diff")
    assert check.returncode == 0, check.output[-6000:]
    assert all(c["changed"] == 0 for c in check.recap().values()), check.output[-6000:]
    _no_secret_in(fleet, second.output + check.output)
    for h in HOSTS:
        host = fleet.hosts.hosts[h]
        assert host.systemctl("is-active", f"kvp-lmcache@{NAME}.service").stdout.strip() \
            == "active"
        vllm = host.systemctl("is-active", f"kvp-vllm@{NAME}.service", check=False)
        assert vllm.stdout.strip() == ("active" if h in fleet.vllm_on else "inactive"), \
            (h, vllm.stdout)
        code, doc = fleet.health(h)
        assert (code, doc["status"], doc["namespace"]) == (0, "healthy", fleet.ns["v1"]), \
            (h, doc["checks"])


def test_testinfra_checks_each_host_through_ssh(fleet: Fleet) -> None:
    for group in (("h1",), ("h2", "h3")):
        t0 = time.monotonic()
        r = fleet.hosts.testinfra(fleet.kvp_vars(group[0], "v1"), group)
        fleet.hosts.timings[f"testinfra {','.join(group)}"] = round(time.monotonic() - t0, 1)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-8000:]
        summary = [line for line in r.stdout.splitlines() if line.strip()][-1]
        assert re.search(r"\d+ passed", summary), out[-3000:]
        assert not re.search(r"\b(failed|skipped|errors?|xfailed)\b", summary), out[-3000:]
        for h in group:
            addr = re.escape(fleet.hosts.hosts[h].addr)
            ran = re.findall(rf"^PASSED \S+\[ssh://(?:root@)?{addr}[]-]", r.stdout, re.M)
            assert len(ran) >= 15, (h, out[-4000:])
        _no_secret_in(fleet, out)


def test_host_1_serves_v1_and_stores_a_chat_on_its_nvme_and_in_the_store(fleet: Fleet) -> None:
    text, _ = fleet.returning_user()
    assert text
    assert len(fleet.chunk_files("h1", fleet.ns["v1"])) >= 5
    assert fleet.redis.scan_keys(f"{fleet.ns['v1']}@*")
    fleet.seen["h3_server"] = fleet.main_pid("h3", "kvp-lmcache")


def test_upgrade_plan_names_the_flag_and_the_old_namespaces_data(fleet: Fleet) -> None:
    """On h1 as an operator would before the roll: the installed identity.env against the
    next one (v2's engine flag)."""
    h1 = fleet.hosts.hosts["h1"]
    new = "/root/upgrade-v2/identity.env"
    h1.sh(f"install -d -m 0700 /root/upgrade-v2 && sed \"s|^KVP_ENGINE_ARGS=.*|"
          f"KVP_ENGINE_ARGS='{ENGINE['v2']}'|\" {CONFIG} > {new} && chmod 0640 {new}")
    r = fleet.kvp("h1", "upgrade", "plan", CONFIG, new, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    plan = json.loads(r.stdout)
    assert (plan["old"]["namespace"], plan["new"]["namespace"]) == (fleet.ns["v1"],
                                                                    fleet.ns["v2"])
    assert [c["field"] for c in plan["changes"]] == ["engine_args"], plan["changes"]
    local, shared = plan["old_data"]["local"], plan["old_data"]["shared"]
    assert local["files"] == len(fleet.chunk_files("h1", fleet.ns["v1"])) > 0, local
    assert shared["keys"] > 0 and len(shared["hosts"]) == 3, shared
    assert any("KVP_WARMUP_COMPUTE=1" in (s["command"] or "") for s in plan["steps"]), \
        plan["steps"]
    _no_secret_in(fleet, r.stdout + r.stderr)


def test_the_roll_stops_at_a_host_that_fails_its_gate(fleet: Fleet) -> None:
    assert "h3_server" in fleet.seen, "v1 did not serve"
    vllm_before = fleet.main_pid("h1", "kvp-vllm")
    fleet.write_inventory("v2", h2={"KVP_L2_RESERVE": "100T"})
    # h2's cache server never becomes healthy: the role's wait for it fails the host after
    # kvp_health_wait_seconds (a healthy one answers at once)
    run = fleet.playbook(ROLLING, "-e", "kvp_health_wait_seconds=20",
                         "-e", "kvp_roll_ready_wait_seconds=60")
    counts = run.recap()
    assert run.returncode != 0, run.output[-4000:]
    assert counts["h1"]["failed"] == 0 and counts["h2"]["failed"] == 1, counts
    assert "h3" not in counts or counts["h3"]["changed"] == 0, counts
    assert " is stale " not in run.output
    _no_secret_in(fleet, run.output)
    # h1: rolled by systemd (a new vLLM process), ready on v2, the warm set computed by its
    # vLLM before ready and stored into the shared tier
    assert fleet.main_pid("h1", "kvp-vllm") not in (0, vllm_before)
    code, doc = fleet.health("h1")
    assert (code, doc["namespace"]) == (0, fleet.ns["v2"]), doc["checks"]
    warm = fleet.warmup("h1")
    assert warm["state"] == "done" and warm["computed_chunks"] == warm["requested_chunks"] > 0
    assert fleet.redis.scan_keys(f"{fleet.ns['v2']}@*")
    # h2: its cache server runs v2 but it is not healthy (the gate's reason)
    code, doc = fleet.health("h2")
    assert (code, doc["status"], doc["namespace"]) == (1, "degraded", fleet.ns["v2"])
    assert "cache_root.free_space" in [c["name"] for c in doc["checks"]
                                       if c["status"] == "degraded"], doc["checks"]
    # h3: never touched, the same cache server process on v1, no vLLM yet
    code, doc = fleet.health("h3")
    assert (code, doc["namespace"]) == (0, fleet.ns["v1"]), doc["checks"]
    assert fleet.main_pid("h3", "kvp-lmcache") == fleet.seen["h3_server"]
    assert fleet.main_pid("h3", "kvp-vllm") == 0
    # h1's first request comes from the cache, with the answer of a quiet cold run of v2
    text, hits = fleet.returning_user()
    assert hits >= (warm["requested_chunks"] - 1) * dep.CHUNK, hits
    fleet.seen["v2_answer"] = fleet.cold("h1")
    assert text == fleet.seen["v2_answer"], (text, fleet.seen["v2_answer"])
    fleet.seen["h1_vllm_v2"] = fleet.main_pid("h1", "kvp-vllm")


def test_the_resumed_roll_rolls_the_rest_and_reports_the_stale_namespace(fleet: Fleet) -> None:
    assert "h1_vllm_v2" in fleet.seen, "the stopped roll did not run"
    fleet.write_inventory("v2")
    before = fleet.health("h1")
    run = fleet.playbook(ROLLING, "-e", "kvp_roll_skip_ready=true")
    assert run.returncode == 0, run.output[-6000:]
    assert all(c["failed"] == 0 for c in run.recap().values()), run.recap()
    fleet.vllm_on.add("h3")
    h1 = fleet.hosts.hosts["h1"]
    # the playbook says why a host it does not skip is rolled again
    why = re.findall(r'"msg": "(.*)"', run.output.split("TASK [Read the namespace")[0])
    assert fleet.main_pid("h1", "kvp-vllm") == fleet.seen["h1_vllm_v2"], (  # skipped
        why, before, h1.show(f"kvp-vllm@{NAME}.service", "NRestarts", "ExecMainStartTimestamp"),
        run.output[:6000], h1.journal("-u", f"kvp-vllm@{NAME}.service", "-n", "60"))
    for h in HOSTS:
        code, doc = fleet.health(h)
        assert (code, doc["namespace"]) == (0, fleet.ns["v2"]), (h, doc["checks"])
    # h3 (a fresh v2 on its NVMe) found the warm set h1 computed in the store, and its
    # returning user's first request comes from the cache with the cold answer
    w3 = fleet.warmup("h3")
    assert w3["computed_chunks"] == 0 and w3["found_chunks"] == w3["requested_chunks"] > 0, w3
    text, hits = fleet.returning_user("h3")
    assert hits >= (w3["requested_chunks"] - 1) * dep.CHUNK, hits
    assert text == fleet.seen["v2_answer"], (text, fleet.seen["v2_answer"])
    v1_files = fleet.chunk_files("h1", fleet.ns["v1"])
    assert v1_files
    assert re.search(rf"{ROOT}: {fleet.ns['v1']} is stale \({len(v1_files)} files", run.output), \
        run.output[-4000:]
    assert fleet.chunk_files("h1", fleet.ns["v1"]) == v1_files  # reported, not deleted
    _no_secret_in(fleet, run.output)


def test_fleet_status_from_any_host(fleet: Fleet) -> None:
    for h in ("h2", "h3"):
        r = fleet.kvp(h, "fleet", "status", "--config", CONFIG, "--namespace", fleet.ns["v1"],
                      "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        by_ns = {n["namespace"]: n for n in doc["namespaces"]}
        v2 = by_ns[fleet.ns["v2"]]
        live = [x for x in v2["hosts"] if x["state"] == "live"]
        assert sorted(x["host"] for x in live) == list(HOSTS), v2
        assert v2["agreement"] == "agree" and v2["configured"], v2
        assert all(x["deployment"] == NAME for x in live)
        # every host stopped serving v1 with a clean stop, which deleted its record
        assert not [x for x in by_ns[fleet.ns["v1"]]["hosts"] if x["state"] == "live"]
        _no_secret_in(fleet, r.stdout + r.stderr)


def test_the_stale_namespace_is_deleted_only_when_asked(fleet: Fleet) -> None:
    v1_files = fleet.chunk_files("h1", fleet.ns["v1"])
    v2_files = fleet.chunk_files("h1", fleet.ns["v2"])
    # v1's warm set, pinned by h1's warm-up on v1: `prune --stale` keeps pinned files
    # (docs/warm-restart.md); only `prune --namespace` deletes them
    pins = json.loads(fleet.hosts.hosts["h1"].exec(
        "cat", f"{ROOT}/.kvpersist/pins/{fleet.ns['v1']}.json").stdout)
    pinned = sorted(Path(f).name for f in pins["files"])
    assert v1_files and v2_files and pinned and set(pinned) < set(v1_files)
    run = fleet.playbook(ROLLING, "-e", "kvp_roll_skip_ready=true",
                         "-e", "kvp_prune_stale_after_roll=true")
    assert run.returncode == 0, run.output[-6000:]
    assert re.search(rf"{fleet.ns['v1']} is stale \({len(v1_files)} files, \d+ bytes, "
                     rf"{len(pinned)} of them its warm set's pins\); +pruned below", run.output), \
        run.output[-4000:]
    assert fleet.chunk_files("h1", fleet.ns["v1"]) == pinned
    assert fleet.chunk_files("h1", fleet.ns["v2"]) == v2_files
    assert fleet.main_pid("h1", "kvp-vllm") == fleet.seen["h1_vllm_v2"]  # nothing restarted
    code, _ = fleet.health("h1")
    assert code == 0


def test_check_diff_of_the_next_change_shows_it_and_stops_nothing(fleet: Fleet) -> None:
    pids = {h: fleet.main_pid(h, "kvp-vllm") for h in sorted(fleet.vllm_on)}
    servers = {h: fleet.main_pid(h, "kvp-lmcache") for h in HOSTS}
    fleet.write_inventory("v2", versions={"h1": "v3"})
    run = fleet.playbook(ROLLING, "--check", "--diff", "--limit", "h1")
    assert run.returncode == 0, run.output[-4000:]
    assert "rope_theta=30000" in run.output and "rope_theta=20000" in run.output
    assert {h: fleet.main_pid(h, "kvp-vllm") for h in sorted(fleet.vllm_on)} == pids
    assert {h: fleet.main_pid(h, "kvp-lmcache") for h in HOSTS} == servers
    assert "30000" not in fleet.hosts.hosts["h1"].exec("cat", CONFIG).stdout
    assert fleet.health("h1")[0] == 0
    _no_secret_in(fleet, run.output)
