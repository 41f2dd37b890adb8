"""ansible/rolling.yml run for real, and the upgrade it rolls (issue 25).

Three deployments stand for three hosts: one inventory, each host with the local connection,
its own prefix (config, state, cache root), its own ports, all sharing one real redis-server
as the shared tier and the namespace keys from the vault variables (``serde_keys``). Each is
a real cache server and real vLLM (CPU build, the tiny generated model, float32 so that a
cold answer and one from the cache are the same text), launched by ``kvp-admin`` as the
service user (``kvp_roll_via: kvp-admin``: systemd is not PID 1 here). The service user is
root here: the test machine's Python lives under /root (mode 0700), which no other user can
execute; that the role's files belong to an unprivileged service user is checked by the
converge tests (tests/infra).

1. v1 on the three (the role's playbook, then ``kvp-admin launch`` of the three at once);
   host 1 answers a returning user's chat: its chunks on host 1's NVMe and in the store.
2. ``kvp-admin upgrade plan`` v1 -> v2 (a KV-affecting engine flag, ``rope_theta``): names
   the field and the old namespace's data here and in the store.
3. The roll to v2 (``KVP_WARMUP_COMPUTE=true``) with host 2 made to fail its health (its
   new config keeps more free space than the filesystem has: ``cache_root.free_space``
   degraded): host 1 rolls and computes the warm set before ready (into the store too); host
   2 finds it in the store on a fresh NVMe, then fails the gate; the roll stops there; host
   3 was never touched and keeps serving v1. The first request on hosts 1 and 2 comes from
   the cache with the answer of a quiet cold run of v2.
4. Host 2 fixed, the roll again, resumed (``kvp_roll_skip_ready``): host 1 is skipped (rolled
   to these variables and healthy),
   hosts 2 and 3 roll (host 3 finds the warm set in the store) and end ready; after the last
   host the old namespace is reported stale on host 1, and nothing is pruned.
5. ``--check --diff`` of another change shows it and stops nothing.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
import yaml

from kvpersist.demo.chat import chat_completion, long_chat
from kvpersist.demo.model import generate_model

from ..conftest import free_port
from ..fullstack._stack import vllm_metric
from ..integration._redis import Redis, start_redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "infra"))
import kvp_converge  # noqa: E402

pytestmark = [pytest.mark.deploy, pytest.mark.fullstack]

HOSTS = ("h1", "h2", "h3")
USER = "root"
NAME = "roll"
ROOT = "/srv/nvme0/kvp/roll"
HITS = "vllm:external_prefix_cache_hits_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
CHUNK = 256
ENGINE = {"v1": "--enforce-eager",
          "v2": "--enforce-eager --hf-overrides.rope_theta=20000",
          "v3": "--enforce-eager --hf-overrides.rope_theta=30000"}
#: the returning user: a warm set holds the opening, the request adds the last question
CHAT = long_chat(turns=8, words_per_turn=150, seed=2525)
ROLLING = kvp_converge.ANSIBLE_DIR / "rolling.yml"


@dataclass
class Host:
    name: str
    prefix: Path
    ports: dict[str, int]

    @property
    def config(self) -> Path:
        return self.prefix / "etc" / "kvpersist" / NAME / "identity.env"

    @property
    def state(self) -> Path:
        return self.prefix / "var" / "lib" / "kvpersist" / NAME

    @property
    def root(self) -> Path:
        return self.prefix / ROOT.lstrip("/")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['KVP_VLLM_PORT']}"

    def chunk_files(self, ns: str) -> list[str]:
        return sorted(p.name for p in self.root.glob(f"{ns}_*.bin"))


@dataclass
class Fleet:
    base: Path
    model: Path
    warm: Path
    redis: Redis
    hosts: dict[str, Host]
    keys: dict[str, str]
    ns: dict[str, str] = field(default_factory=dict)
    #: the answer of a quiet cold run of v2 (a salted request: nothing from any cache)
    cold_v2: str = ""
    vllm_pids: dict[str, int] = field(default_factory=dict)

    # -- the inventory an operator edits between rolls
    def env(self, h: Host, version: str, **extra: str) -> dict[str, Any]:
        env: dict[str, Any] = dict(kvp_converge._IDENTITY)
        env.update({
            "KVP_KV_CACHE_DTYPE": "float32", "KVP_MODEL_DTYPE": "float32",
            "KVP_ENGINE_ARGS": ENGINE[version], "KVP_MODEL_PATH": str(self.model),
            "KVP_SERVED_MODEL_NAME": "cpu-demo", "KVP_DEVICE": "cpu", "KVP_L1_SIZE_GB": 1,
            "KVP_L2_BUDGET": "1G", "KVP_L2_RESERVE": "1M", "KVP_WARMUP_FILE": str(self.warm),
            "KVP_WARMUP_WAIT": 120, "KVP_VLLM_EXTRA_ARGS": "--max-num-seqs 4",
            **h.ports})
        if version != "v1":
            env["KVP_WARMUP_COMPUTE"] = "true"
        env.update(extra)
        return env

    def inventory(self, versions: dict[str, str], **per_host: dict[str, str]) -> Path:
        hosts: dict[str, Any] = {}
        for h in self.hosts.values():
            hosts[h.name] = {"kvp_root_prefix": str(h.prefix), "kvp_deployments": [{
                "name": NAME, "cache_root": ROOT, "vllm": True,
                "env": self.env(h, versions[h.name], **per_host.get(h.name, {})),
                "shared_tier": {"url": self.redis.url, "username": self.redis.user,
                                "password": self.redis.password},
                "serde_keys": [{"namespace": ns, "key_b64": key}
                               for ns, key in self.keys.items()],
            }]}
        doc = {"kvpersist": {"hosts": hosts, "vars": {
            "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "ansible_become_method": "su",
            "kvp_user": USER, "kvp_group": USER, "kvp_create_user": False,
            "kvp_venv": str(kvp_converge.VENV), "kvp_venv_create": False,
            "kvp_package_spec": "kvpersist", "kvp_install_lmcache": False,
            "kvp_pip_environment": {"PIP_NO_INDEX": "1", "PIP_NO_DEPS": "1"},
            "kvp_scripts_source": str(kvp_converge.REPO / "scripts"),
            "kvp_manage_services": False, "kvp_create_cache_parents": True,
            "kvp_docker_bin": str(self.base / "stand-in-bin" / "docker"),
            "kvp_metrics_textfile_dir": "", "kvp_roll_via": "kvp-admin"}}}
        path = self.base / "inventory.yml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        path.chmod(0o600)  # it holds the store's password, as a vault would
        return path

    def playbook(self, playbook: Path, *extra: str,
                 timeout: float = 1200) -> kvp_converge.PlaybookRun:
        argv = [str(kvp_converge.VENV / "bin" / "ansible-playbook"), "-i",
                str(self.base / "inventory.yml"), str(playbook), *extra]
        proc = subprocess.run(argv, capture_output=True, text=True,
                              env=kvp_converge.ansible_env(self.base, pythonpath=True),
                              timeout=timeout,
                              cwd=str(kvp_converge.REPO))
        return kvp_converge.PlaybookRun(argv, proc.returncode, proc.stdout + proc.stderr)

    # -- a host
    def kvp(self, h: Host, *args: str, as_user: bool = False,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
        env["PYTHONPATH"] = str(kvp_converge.REPO)
        argv = [str(kvp_converge.VENV / "bin" / "kvp-admin"), *args]
        if as_user:
            argv = ["runuser", "-u", USER, "--", *argv]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)

    def health(self, h: Host) -> tuple[int, dict[str, Any]]:
        r = self.kvp(h, "health", str(h.config), "--json")
        return r.returncode, json.loads(r.stdout)

    def namespace(self, h: Host) -> str:
        return self.kvp(h, "identity", "namespace", str(h.config)).stdout.strip()

    def vllm_pid(self, h: Host) -> int:
        return int((h.state / "pids" / f"{NAME}.vllm.pid").read_text())

    def warmup(self, h: Host) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((h.state / "warmup.json").read_text())
        return doc

    def returning_user(self, h: Host) -> tuple[str, float]:
        """The returning user's request on ``h``: its answer and the prompt tokens served
        from a cache: LMCache's, or vLLM's own prefix cache, which the warm-up's load of
        this very entry filled from LMCache (docs/warm-restart.md, "The loads into vLLM")."""
        before = vllm_metric(h.url, HITS) + vllm_metric(h.url, LOCAL_HITS)
        r = chat_completion(h.url, "cpu-demo", CHAT, max_tokens=24)
        return r.text, vllm_metric(h.url, HITS) + vllm_metric(h.url, LOCAL_HITS) - before

    def cold(self, h: Host) -> str:
        """The same request with a fresh cache salt: no chunk of any cache can match it."""
        r = requests.post(f"{h.url}/v1/chat/completions", timeout=300, json={
            "model": "cpu-demo", "messages": CHAT, "max_tokens": 24, "temperature": 0.0,
            "cache_salt": f"cold-{uuid.uuid4().hex}"})
        r.raise_for_status()
        return str(r.json()["choices"][0]["message"]["content"])


def recap(run: kvp_converge.PlaybookRun) -> dict[str, dict[str, int]]:
    """PLAY RECAP counts per host."""
    out = {}
    for host, counts in re.findall(r"^(\w+)\s+:\s+(ok=.*)$", run.output, re.M):
        out[host] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counts)}
    return out


def _namespace_of(fleet: Fleet, version: str) -> str:
    """The namespace of ``version`` (the identity alone decides it) without a roll."""
    h = fleet.hosts["h1"]
    d = fleet.base / "ns" / version
    d.mkdir(parents=True, exist_ok=True)
    lines = [f"{k}='{v}'" for k, v in fleet.env(h, version).items()]
    lines.append(f"KVP_CACHE_ROOT={fleet.base / 'ns' / 'root'}")
    (d / "identity.env").write_text("\n".join(lines) + "\n")
    r = fleet.kvp(h, "identity", "namespace", str(d / "identity.env"))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _stand_in_docker(base: Path) -> None:
    """The vLLM unit names a docker client; CI has none to name (it is never run here)."""
    d = base / "stand-in-bin"
    d.mkdir()
    (d / "docker").write_text("#!/bin/sh\nexit 0\n")
    (d / "docker").chmod(0o755)


def _stop_everything(fleet: Fleet) -> None:
    for h in fleet.hosts.values():
        if h.config.exists():
            fleet.kvp(h, "stop", str(h.config), timeout=180)
    # anything still holding a host's prefix (by path, never by name)
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(str(fleet.base) in a for a in p.info["cmdline"] or []):
                p.kill()
        except psutil.Error:
            continue


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    base = kvp_converge.make_base("kvp-roll-")
    _stand_in_docker(base)
    model = generate_model("tiny", base / "models")
    warm = base / "warm.jsonl"
    warm.write_text(json.dumps({"messages": CHAT[:-1]}) + "\n")
    warm.chmod(0o644)
    redis = start_redis(base / "store")
    hosts = {n: Host(n, base / n, {k: free_port() for k in (
        "KVP_LMCACHE_PORT", "KVP_LMCACHE_HTTP_PORT", "KVP_VLLM_PORT")}) for n in HOSTS}
    fleet = Fleet(base, model, warm, redis, hosts, {})
    try:
        fleet.ns = {v: _namespace_of(fleet, v) for v in ENGINE}
        fleet.keys = {fleet.ns[v]: base64.b64encode(secrets.token_bytes(32)).decode()
                      for v in ENGINE}
        yield fleet
    finally:
        _stop_everything(fleet)
        redis.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_v1_serves_on_three_hosts_and_host_1_stores_a_chat(fleet: Fleet) -> None:
    fleet.inventory({h: "v1" for h in HOSTS})
    run = fleet.playbook(kvp_converge.PLAYBOOK, "-f", "3")
    assert run.returncode == 0, run.output[-4000:]
    with ThreadPoolExecutor(3) as ex:
        launched = list(ex.map(
            lambda h: fleet.kvp(h, "launch", str(h.config), "--json", as_user=True),
            fleet.hosts.values()))
    for h, r in zip(fleet.hosts.values(), launched, strict=True):
        assert r.returncode == 0, (h.name, r.stdout[-2000:], r.stderr[-4000:])
        assert json.loads(r.stdout)["namespace"] == fleet.ns["v1"]
        assert fleet.health(h)[0] == 0
        assert psutil.Process(fleet.vllm_pid(h)).username() == USER
    h1 = fleet.hosts["h1"]
    text, _ = fleet.returning_user(h1)
    assert text
    assert len(h1.chunk_files(fleet.ns["v1"])) >= 5
    assert fleet.redis.scan_keys(f"{fleet.ns['v1']}@*")
    fleet.vllm_pids = {n: fleet.vllm_pid(h) for n, h in fleet.hosts.items()}


def test_upgrade_plan_names_the_flag_and_the_old_namespaces_data(fleet: Fleet) -> None:
    h1 = fleet.hosts["h1"]
    new = fleet.base / "plan" / "identity.env"
    new.parent.mkdir()
    new.write_text(re.sub(r"(?m)^KVP_ENGINE_ARGS=.*$", f"KVP_ENGINE_ARGS='{ENGINE['v2']}'",
                          h1.config.read_text()))
    r = fleet.kvp(h1, "upgrade", "plan", str(h1.config), str(new), "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert (plan["old"]["namespace"], plan["new"]["namespace"]) == (fleet.ns["v1"],
                                                                    fleet.ns["v2"])
    assert [c["field"] for c in plan["changes"]] == ["engine_args"], plan["changes"]
    local, shared = plan["old_data"]["local"], plan["old_data"]["shared"]
    assert local["files"] == len(h1.chunk_files(fleet.ns["v1"])) > 0, local
    assert shared["keys"] > 0 and len(shared["hosts"]) == 3, shared
    assert any("KVP_WARMUP_COMPUTE=1" in (s["command"] or "") for s in plan["steps"]), \
        plan["steps"]


def test_the_roll_stops_at_a_host_that_does_not_become_ready(fleet: Fleet) -> None:
    h1, h2, h3 = (fleet.hosts[n] for n in HOSTS)
    fleet.inventory({"h1": "v2", "h2": "v2", "h3": "v2"}, h2={"KVP_L2_RESERVE": "100T"})
    run = fleet.playbook(ROLLING, "-e", "kvp_roll_ready_wait_seconds=5")
    counts = recap(run)
    assert run.returncode != 0, run.output[-4000:]
    assert counts["h1"]["failed"] == 0 and counts["h2"]["failed"] == 1, counts
    assert "h3" not in counts or counts["h3"]["changed"] == 0, counts
    assert " is stale " not in run.output
    # host 1: rolled, ready, the warm set computed by its vLLM before ready (into the store)
    code, doc = fleet.health(h1)
    assert (code, doc["namespace"]) == (0, fleet.ns["v2"]), doc["checks"]
    w1 = fleet.warmup(h1)
    assert w1["state"] == "done" and w1["computed_chunks"] == w1["requested_chunks"] > 0, w1
    assert fleet.redis.scan_keys(f"{fleet.ns['v2']}@*")
    # host 2: serving v2, found the warm set in the store on a fresh NVMe, not ready
    code, doc = fleet.health(h2)
    assert (code, doc["status"], doc["namespace"]) == (1, "degraded", fleet.ns["v2"])
    assert "cache_root.free_space" in [c["name"] for c in doc["checks"]
                                       if c["status"] == "degraded"], doc["checks"]
    w2 = fleet.warmup(h2)
    assert w2["computed_chunks"] == 0 and w2["found_chunks"] == w1["requested_chunks"], w2
    # host 3: never touched, still serving v1 with the same vLLM
    code, doc = fleet.health(h3)
    assert (code, doc["namespace"]) == (0, fleet.ns["v1"]), doc["checks"]
    assert fleet.vllm_pid(h3) == fleet.vllm_pids["h3"]
    # the first request on hosts 1 and 2 comes from the cache, as a quiet cold run answers
    for h in (h1, h2):
        text, hits = fleet.returning_user(h)
        assert hits >= (w1["requested_chunks"] - 1) * CHUNK, (h.name, hits)
        if not fleet.cold_v2:
            fleet.cold_v2 = fleet.cold(h1)
        assert text == fleet.cold_v2, (h.name, text, fleet.cold_v2)


def test_the_roll_resumes_rolls_the_rest_and_reports_the_old_namespace(fleet: Fleet) -> None:
    h1, h2, h3 = (fleet.hosts[n] for n in HOSTS)
    assert fleet.cold_v2, "the stopped roll did not run"
    pid1 = fleet.vllm_pid(h1)
    assert h3.chunk_files(fleet.ns["v2"]) == []
    fleet.inventory({"h1": "v2", "h2": "v2", "h3": "v2"})
    t0 = time.monotonic()
    run = fleet.playbook(ROLLING, "-e", "kvp_roll_skip_ready=true")
    took = time.monotonic() - t0
    assert run.returncode == 0, run.output[-6000:]
    counts = recap(run)
    assert all(counts[n]["failed"] == 0 for n in HOSTS), counts
    assert fleet.vllm_pid(h1) == pid1  # rolled to these variables already: skipped
    for h in (h1, h2, h3):
        code, doc = fleet.health(h)
        assert (code, doc["namespace"]) == (0, fleet.ns["v2"]), (h.name, doc["checks"])
    w3 = fleet.warmup(h3)
    assert w3["computed_chunks"] == 0 and w3["found_chunks"] == w3["requested_chunks"] > 0, w3
    for h in (h2, h3):
        text, hits = fleet.returning_user(h)
        assert hits >= (w3["requested_chunks"] - 1) * CHUNK, (h.name, hits)
        assert text == fleet.cold_v2, (h.name, text)
    # after the last host: host 1's v1 chunks are reported stale, and nothing is pruned
    v1_files = h1.chunk_files(fleet.ns["v1"])
    assert re.search(rf"{h1.root}: {fleet.ns['v1']} is stale \({len(v1_files)} files",
                     run.output), run.output[-4000:]
    assert h1.chunk_files(fleet.ns["v1"]) == v1_files
    print(f"\nresumed roll of two hosts: {took:.0f} s")


def test_check_diff_shows_the_next_change_and_stops_nothing(fleet: Fleet) -> None:
    h1 = fleet.hosts["h1"]
    pids = {n: fleet.vllm_pid(h) for n, h in fleet.hosts.items()}
    fleet.inventory({"h1": "v3", "h2": "v2", "h3": "v2"})
    run = fleet.playbook(ROLLING, "--check", "--diff", "--limit", "h1")
    assert run.returncode == 0, run.output[-4000:]
    assert "rope_theta=30000" in run.output and "rope_theta=20000" in run.output
    assert {n: fleet.vllm_pid(h) for n, h in fleet.hosts.items()} == pids
    assert "30000" not in h1.config.read_text()
    assert fleet.health(h1)[0] == 0
