"""Real Redis servers (Debian's ``redis-server``) for the shared-tier tests: standalone or a
3-primary cluster made by ``redis-cli --cluster create``, each on free loopback ports with its
own temp directory, an ACL user with a password and the default user disabled. Optionally
TLS only (plaintext port 0, a throwaway CA and server certificate made by ``openssl``) and a
second, narrowed ACL user for the deployments (the first keeps every right for the tests' own
``redis-cli``).

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
#: the deployments' user when a narrowed ACL is under test
SERVICE_USER = "kvp-svc"


@dataclass(frozen=True)
class Tls:
    """A throwaway CA and a server certificate it signed (127.0.0.1 and localhost)."""

    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    r = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {args[0]}: {r.stderr}")


def make_ca(d: Path, name: str = "kvp test CA") -> tuple[Path, Path]:
    """A self-signed CA certificate and its key under ``d`` (created 0700)."""
    d.mkdir(parents=True, mode=0o700, exist_ok=True)
    ca, key = d / "ca.crt", d / "ca.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
             "-out", str(ca), "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    ca.chmod(0o644)
    return ca, key


def make_tls(d: Path, ip: str = "127.0.0.1") -> Tls:
    """A CA and a server certificate for ``ip`` (and localhost) signed by it, under ``d``."""
    ca, ca_key = make_ca(d)
    key, csr, cert, ext = d / "server.key", d / "server.csr", d / "server.crt", d / "ext.cnf"
    ext.write_text(f"subjectAltName=IP:{ip},DNS:localhost\nbasicConstraints=CA:FALSE\n"
                   "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
             "-subj", f"/CN={ip}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return Tls(ca, cert, key)


@dataclass
class RedisNode:
    port: int
    dir: Path
    password: str
    proc: subprocess.Popen[bytes] | None = None
    #: the cluster bus port (default would be port + 10000, above 65535 for high ports)
    bus_port: int = 0
    extra: tuple[str, ...] = ()
    tls: Tls | None = None
    #: the rules of the deployments' own user (SERVICE_USER); '' = they use ACL_USER
    acl: str = ""
    #: the address it binds and is reached at
    host: str = "127.0.0.1"
    #: what runs it and its clients (e.g. ``ip netns exec NS``: inside a network namespace)
    wrap: tuple[str, ...] = ()

    def conf(self, cluster: bool, maxmemory: str, policy: str) -> str:
        listen = ([f"port {self.port}"] if self.tls is None else
                  ["port 0", f"tls-port {self.port}", f"tls-cert-file {self.tls.cert}",
                   f"tls-key-file {self.tls.key}", f"tls-ca-cert-file {self.tls.ca}",
                   "tls-auth-clients no"])
        lines = [*listen, f"bind {self.host}", "protected-mode yes",
                 f"dir {self.dir}", 'save ""', "appendonly yes", "appendfsync always",
                 f"maxmemory {maxmemory}", f"maxmemory-policy {policy}",
                 "user default off",
                 f"user {ACL_USER} on >{self.password} ~* &* +@all"]
        if self.acl:
            lines.append(f"user {SERVICE_USER} on >{self.password} {self.acl}")
        if cluster:
            lines += ["cluster-enabled yes", f"cluster-config-file {self.dir}/nodes.conf",
                      f"cluster-port {self.bus_port}",
                      "cluster-node-timeout 2000",
                      f"masteruser {ACL_USER}", f"masterauth {self.password}"]
        return "\n".join([*lines, *self.extra]) + "\n"

    def cli(self, *args: str, check: bool = True) -> str:
        # the password goes through REDISCLI_AUTH, not argv (this is a test's own client)
        env = {**os.environ, "REDISCLI_AUTH": self.password}
        tls = ["--tls", "--cacert", str(self.tls.ca)] if self.tls else []
        r = subprocess.run([*self.wrap, REDIS_CLI, "-h", self.host, "-p", str(self.port), *tls,
                            "--user", ACL_USER, *args],
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
    def tls(self) -> Tls | None:
        return self.nodes[0].tls

    @property
    def user(self) -> str:
        """The deployments' ACL user."""
        return SERVICE_USER if self.nodes[0].acl else ACL_USER

    @property
    def url(self) -> str:
        seeds = ",".join(f"{n.host}:{n.port}" for n in self.nodes)
        options = (["cluster=1"] if self.cluster else []) + (
            [f"tls=1&tls_ca={self.tls.ca}"] if self.tls else [])
        return f"valkey://{seeds}" + ("?" + "&".join(options) if options else "")

    def secret_text(self) -> str:
        return f"username={self.user}\npassword={self.password}\n"

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
            node.proc = subprocess.Popen([*node.wrap, REDIS_SERVER, str(conf)], stdout=out,
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
                policy: str = "allkeys-lru", tls: bool = False, acl: str = "",
                host: str = "127.0.0.1", wrap: tuple[str, ...] = ()) -> Redis:
    """Start a standalone server (or a 3-primary cluster) under ``base``; ``tls``: TLS only,
    with a CA made under ``base/tls``; ``acl``: the deployments get their own user with
    these rules (e.g. ``resetkeys ~kvp-* -@all +get``); ``host``: the address every node
    binds (its certificate names it); ``wrap``: what runs the servers and the tests' own
    ``redis-cli`` (``ip netns exec NS`` for a store in a network namespace)."""
    password = secrets.token_urlsafe(24)
    count = 3 if cluster else 1
    certs = make_tls(base / "tls", host) if tls else None
    nodes = []
    for i in range(count):
        d = base / f"redis{i}"
        d.mkdir(parents=True, mode=0o700)
        nodes.append(RedisNode(free_port(), d, password, bus_port=free_port(), tls=certs,
                               acl=acl, host=host, wrap=wrap))
    r = Redis(nodes, cluster, password, maxmemory, policy)
    try:
        for n in nodes:
            r.start_node(n)
        if cluster:
            nodes[0].cli("--cluster", "create",
                         *[f"{n.host}:{n.port}" for n in nodes],
                         "--cluster-replicas", "0", "--cluster-yes")
            r.wait_cluster_ok()
    except BaseException:
        with contextlib.suppress(Exception):
            r.stop()
        raise
    return r
