"""Real Redis servers (Debian's ``redis-server``) for the shared-tier tests: standalone or a
3-primary cluster made by ``redis-cli --cluster create``, each on free loopback ports with its
own temp directory, an ACL user with a password and the default user disabled.

Nothing here is mocked; every instance is stopped by pid.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..conftest import free_port

REDIS_SERVER = "redis-server"
REDIS_CLI = "redis-cli"
ACL_USER = "kvp-fleet"


@dataclass
class RedisNode:
    port: int
    dir: Path
    password: str
    proc: subprocess.Popen[bytes] | None = None
    #: the cluster bus port (default would be port + 10000, above 65535 for high ports)
    bus_port: int = 0
    extra: tuple[str, ...] = ()

    def conf(self, cluster: bool, maxmemory: str, policy: str) -> str:
        lines = [f"port {self.port}", "bind 127.0.0.1", "protected-mode yes",
                 f"dir {self.dir}", 'save ""', "appendonly yes", "appendfsync always",
                 f"maxmemory {maxmemory}", f"maxmemory-policy {policy}",
                 "user default off",
                 f"user {ACL_USER} on >{self.password} ~* &* +@all"]
        if cluster:
            lines += ["cluster-enabled yes", f"cluster-config-file {self.dir}/nodes.conf",
                      f"cluster-port {self.bus_port}",
                      "cluster-node-timeout 2000",
                      f"masteruser {ACL_USER}", f"masterauth {self.password}"]
        return "\n".join([*lines, *self.extra]) + "\n"

    def cli(self, *args: str, check: bool = True) -> str:
        # the password goes through REDISCLI_AUTH, not argv (this is a test's own client)
        env = {**os.environ, "REDISCLI_AUTH": self.password}
        r = subprocess.run([REDIS_CLI, "-p", str(self.port), "--user", ACL_USER, *args],
                           env=env, capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)}: {r.stderr}{r.stdout}")
        return r.stdout


@dataclass
class Redis:
    """One standalone server or a cluster of ``len(nodes)`` primaries."""

    nodes: list[RedisNode]
    cluster: bool
    password: str
    maxmemory: str = "512mb"
    policy: str = "allkeys-lru"
    logs: list[Path] = field(default_factory=list)

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"valkey://{seeds}" + ("?cluster=1" if self.cluster else "")

    def secret_text(self) -> str:
        return f"username={ACL_USER}\npassword={self.password}\n"

    def write_secret(self, path: Path) -> Path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.secret_text())
        return path

    def start_node(self, node: RedisNode) -> None:
        conf = node.dir / "redis.conf"
        conf.write_text(node.conf(self.cluster, self.maxmemory, self.policy))
        conf.chmod(0o600)
        log = node.dir / "redis.log"
        self.logs.append(log)
        with log.open("ab") as out:
            node.proc = subprocess.Popen([REDIS_SERVER, str(conf)], stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {log.read_text()[-2000:]}")
            if node.cli("ping", check=False).strip() == "PONG":
                return
            time.sleep(0.1)
        raise RuntimeError(f"redis-server on {node.port} did not answer")

    def kill(self) -> None:
        """SIGKILL every node (a crash: no clean shutdown)."""
        for n in self.nodes:
            if n.proc and n.proc.poll() is None:
                n.proc.send_signal(signal.SIGKILL)
                n.proc.wait(timeout=10)

    def restart(self) -> None:
        for n in self.nodes:
            self.start_node(n)
        if self.cluster:
            self.wait_cluster_ok()

    def stop(self) -> None:
        for n in self.nodes:
            if n.proc and n.proc.poll() is None:
                n.proc.terminate()
                try:
                    n.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    n.proc.kill()
                    n.proc.wait()

    def wait_cluster_ok(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("cluster", "info", check=False)
                   for n in self.nodes):
                return
            time.sleep(0.2)
        raise RuntimeError("cluster did not reach cluster_state:ok")

    def scan_keys(self, pattern: str = "*") -> list[str]:
        """Every key matching ``pattern`` on every node (SCAN, through redis-cli)."""
        out: list[str] = []
        for n in self.nodes:
            out += [k for k in n.cli("--scan", "--pattern", pattern).split("\n") if k]
        return sorted(out)


def start_redis(base: Path, *, cluster: bool = False, maxmemory: str = "512mb",
                policy: str = "allkeys-lru") -> Redis:
    """Start a standalone server (or a 3-primary cluster) under ``base``."""
    password = secrets.token_urlsafe(24)
    count = 3 if cluster else 1
    nodes = []
    for i in range(count):
        d = base / f"redis{i}"
        d.mkdir(parents=True, mode=0o700)
        nodes.append(RedisNode(free_port(), d, password, bus_port=free_port()))
    r = Redis(nodes, cluster, password, maxmemory, policy)
    try:
        for n in nodes:
            r.start_node(n)
        if cluster:
            nodes[0].cli("--cluster", "create",
                         *[f"127.0.0.1:{n.port}" for n in nodes],
                         "--cluster-replicas", "0", "--cluster-yes")
            r.wait_cluster_ok()
    except BaseException:
        with contextlib.suppress(Exception):
            r.stop()
        raise
    return r
