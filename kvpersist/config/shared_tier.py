"""The optional shared KV tier (``KVP_SHARED_TIER``): parse its URL, choose LMCache's adapter
and build the adapter JSON without credentials (pure).

``KVP_SHARED_TIER`` is empty (no shared tier) or a URL::

    valkey://host:port[,host:port...]?cluster=0&tls=0&tls_ca=/path&db=0&workers=8&adapter=auto
                                      &timeout=1&connect_timeout=10

(``redis://`` is accepted as a synonym). Query keys, all optional:

===============  =======  ====================================================
key              default  meaning
===============  =======  ====================================================
cluster          0        1: a Redis/Valkey cluster; the nodes are seeds
tls              0        1: TLS to the store
tls_ca           (none)   with tls=1: absolute path of the PEM CA file that signed the
                          store's certificate (default: the system trust store)
db               0        logical database (standalone only)
workers          8        LMCache's I/O worker threads for this tier
adapter          auto     ``resp``, ``valkey`` or ``auto`` (see :func:`choose_adapter`)
timeout          1        seconds one command to the store may take (the valkey
                          adapter's ``request_timeout``; LMCache's default is 5)
connect_timeout  10       seconds one connection attempt may take (its
                          ``connection_timeout``, LMCache's default)
===============  =======  ====================================================

The two timeouts bound what an unreachable store costs every lookup (docs/fleet.md, "The
shared tier over a network"); LMCache's ``resp`` adapter has none (a partition blocks its
lookups until TCP gives up), so they need the ``valkey`` adapter, and ``auto`` takes
``resp`` only for a store on this host's loopback.

Credentials never appear in the URL (a ``user:password@`` part is refused): the ACL user and
password live in the owner-only file named by ``KVP_SHARED_TIER_SECRET_FILE``
(:func:`parse_secret`), which only the launcher reads, in the cache server's own process
(:mod:`kvpersist.stack.lmcache_exec`). Nothing here reads files.

Keys on the store are LMCache's wire keys ``<model name>@<kv rank>@<group>@<chunk hash>``;
the model name is the namespace, so ``kvp-<32 hex>@*`` matches exactly one namespace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

SCHEMES = ("valkey", "redis")
ADAPTERS = ("auto", "resp", "valkey")
QUERY_KEYS = ("cluster", "tls", "tls_ca", "db", "workers", "adapter", "timeout",
              "connect_timeout")
#: the valkey adapter's request and connection timeouts kvpersist renders (seconds), and
#: the range a URL may set. Measured on a real link (docs/fleet.md, "The shared tier over a
#: network"): while the store is unreachable every lookup waits about one ``timeout`` per
#: round of ``workers`` keys (LMCache's 5 s made it 5 s per round); the connection timeout
#: does not enter that wait, but it bounds the adapter's start, where LMCache creates one
#: client per worker and fails the server if one is not connected in time (1 s failed a
#: cluster's start on a loaded host), so it stays at LMCache's 10 s
DEFAULT_TIMEOUT_S = 1.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
TIMEOUT_RANGE_S = (0.1, 60.0)
#: rustls (valkey-glide's TLS, through rustls-native-certs) and OpenSSL read this variable
#: for their trust store; the launcher sets it in the cache server's own process
CA_ENV = "SSL_CERT_FILE"
#: LMCache reads these in the resp adapter's factory when the JSON leaves them empty; the
#: launcher sets them in its own process (never in a child's exec environment)
RESP_ENV_USER = "LMCACHE_RESP_USERNAME"
RESP_ENV_PASSWORD = "LMCACHE_RESP_PASSWORD"  # noqa: S105 - a variable name, not a secret
#: The least ACL a deployment's user needs (docs/fleet.md, "Secrets"), found by reading the
#: adapters' code and confirmed by the integration tests (nothing else in the store's ACL
#: LOG): the key patterns of the chunk keys (``kvp-<ns>@...``) and of the prune lock
#: (``kvpersist-lock:prune:<ns>``); LMCache's resp adapter sends SET GET EXISTS DEL, its
#: valkey adapter the same and INFO (glide's connection adds PING); kvpersist's report,
#: prune and health send SCAN STRLEN UNLINK PING INFO, SET NX PX and EVAL of the lock
#: scripts (which run GET DEL PEXPIRE); the fleet records (``kvpersist-fleet:<ns>...``,
#: written by launch and health) SET EX, DEL, EXISTS and, inside EVAL (a value is read only
#: when its length fits), STRLEN and GET; the index set SADD EXPIRE SREM and, inside EVAL,
#: SCARD then SMEMBERS. AUTH and HELLO need no rule. SCARD was added after 0.2.0: an ACL
#: without it still works (the script then counts SMEMBERS' answer inside the store, and
#: each read leaves one entry in the ACL LOG).
ACL_RULES = ("resetkeys ~kvp-* ~kvpersist-* resetchannels -@all "
             "+get +set +exists +del +unlink +strlen +scan +eval +pexpire +info +ping "
             "+sadd +srem +smembers +scard +expire")
#: What a cluster adds: CLUSTER SLOTS (glide's and redis-py's topology), COMMAND (redis-py's
#: key routing) and CLIENT SETNAME (glide names its management connections; refused, it only
#: fills the ACL LOG)
ACL_CLUSTER_RULES = "+cluster|slots +command +client|setname"
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})\Z")


@dataclass(frozen=True)
class SharedTier:
    """A parsed ``KVP_SHARED_TIER``."""

    url: str
    nodes: tuple[tuple[str, int], ...]
    cluster: bool = False
    tls: bool = False
    db: int = 0
    workers: int = 8
    adapter: str = "resp"  # the adapter chosen (never "auto")
    #: the CA file that verifies the store's certificate ('' = the system trust store)
    tls_ca: str = ""
    #: the valkey adapter's request and connection timeouts, seconds (resp has none)
    timeout: float = DEFAULT_TIMEOUT_S
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S

    @property
    def endpoint(self) -> str:
        """``host:port[,host:port...]``: where the tier is, for reports (no secret)."""
        return ",".join(f"{h}:{p}" for h, p in self.nodes)

    @property
    def store_id(self) -> str:
        """Which store (and logical database) this is, for metric labels: the nodes sorted
        (a cluster's seeds in any order are the same cluster), ``/<db>`` when not 0. Built
        from host:port only: never a credential."""
        nodes = ",".join(sorted(f"{h}:{p}" for h, p in self.nodes))
        return f"{nodes}/{self.db}" if self.db else nodes

    def to_dict(self) -> dict[str, Any]:
        valkey = self.adapter == "valkey"
        return {"url": self.url, "endpoint": self.endpoint, "cluster": self.cluster,
                "tls": self.tls, "tls_ca": self.tls_ca, "db": self.db, "workers": self.workers,
                "adapter": self.adapter,
                "timeout_s": self.timeout if valkey else None,
                "connect_timeout_s": self.connect_timeout if valkey else None}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or IPv4 address) is this host's loopback."""
    return host == "localhost" or (host.startswith("127.") and
                                   all(p.isdigit() for p in host.split(".")))


def choose_adapter(requested: str, *, cluster: bool, tls: bool, db: int, nodes: int,
                   loopback: bool = True, timeouts: bool = False) -> tuple[str, str]:
    """Which LMCache adapter serves the tier; returns (adapter, problem or '').

    ``auto`` takes ``resp`` (LMCache's native C++ client) for a single standalone node
    without TLS on db 0 *on this host's loopback* (``loopback``) when no timeout is set
    (``timeouts``): it reads its credentials from its own process environment, so they
    never appear in the server's ``GET /config``. But it sets no timeout on its sockets:
    across a network, a partition blocks every lookup of the server (even of chunks in L1)
    until TCP gives up, measured > 150 s (docs/fleet.md, "The shared tier over a
    network"). Everything else takes ``valkey`` (valkey-glide: cluster, TLS, db, request
    and connection timeouts), whose credentials are adapter-JSON fields and therefore
    visible in ``GET /config`` on the loopback admin port (docs/fleet.md, "Secrets").
    """
    needs_valkey = cluster or tls or db != 0 or nodes > 1
    if requested == "resp" and needs_valkey:
        return "", ("adapter=resp serves one standalone node without TLS on db 0 only; "
                    "use adapter=valkey (or auto)")
    if requested == "resp" and timeouts:
        return "", ("timeout and connect_timeout need adapter=valkey (or auto): LMCache's "
                    "resp adapter has no timeouts")
    if requested == "auto":
        return ("valkey" if needs_valkey or timeouts or not loopback else "resp"), ""
    return requested, ""


def _seconds(options: dict[str, str], key: str, default: float) -> tuple[float, str]:
    """A timeout option in seconds (``0.5``, ``2``), within TIMEOUT_RANGE_S."""
    raw = options.get(key)
    if raw is None:
        return default, ""
    lo, hi = TIMEOUT_RANGE_S
    if not re.fullmatch(r"[0-9]{1,3}(\.[0-9]{1,3})?", raw) or not lo <= float(raw) <= hi:
        return 0.0, f"{key} must be a number of seconds from {lo:g} to {hi:g}, got {raw!r}"
    return float(raw), ""


def parse_shared_tier(value: str) -> tuple[SharedTier | None, str]:
    """Parse a ``KVP_SHARED_TIER`` value; returns (tier or None for empty, problem or '')."""
    value = value.strip()
    if not value:
        return None, ""
    try:
        parts = urlsplit(value)
    except ValueError as exc:
        return None, f"is not a URL: {exc}"
    if parts.scheme not in SCHEMES:
        return None, (f"must start with valkey:// or redis://, got {parts.scheme or value!r}")
    if "@" in parts.netloc:
        return None, ("must not carry credentials (user:password@): they would be visible "
                      "to every user; put them in KVP_SHARED_TIER_SECRET_FILE")
    if parts.path not in ("", "/") or parts.fragment:
        return None, "takes no path or fragment: valkey://host:port[,host:port...]?options"
    nodes: list[tuple[str, int]] = []
    for item in parts.netloc.split(","):
        host, sep, port_text = item.strip().rpartition(":")
        if not sep or not _HOST.match(host) or not port_text.isdigit():
            return None, f"node {item!r} must be host:port (a name or IPv4 address)"
        port = int(port_text)
        if not 1 <= port <= 65535:
            return None, f"node {item!r}: port must be 1-65535"
        nodes.append((host, port))
    try:
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        return None, f"query {parts.query!r} must be key=value pairs joined by '&'"
    options: dict[str, str] = {}
    for key, raw in query:
        if key not in QUERY_KEYS:
            return None, f"unknown option {key!r} (known: {', '.join(QUERY_KEYS)})"
        if key in options:
            return None, f"option {key!r} given twice"
        options[key] = raw
    flags: dict[str, bool] = {}
    for key in ("cluster", "tls"):
        raw = options.get(key, "0")
        if raw not in ("0", "1"):
            return None, f"{key} must be 0 or 1, got {raw!r}"
        flags[key] = raw == "1"
    tls_ca = options.get("tls_ca", "")
    if "tls_ca" in options:
        if not flags["tls"]:
            return None, "tls_ca needs tls=1 (it verifies the store's TLS certificate)"
        if not tls_ca.startswith("/") or "\x00" in tls_ca or "/../" in f"{tls_ca}/":
            return None, f"tls_ca must be an absolute path without '..', got {tls_ca!r}"
    db_text, workers_text = options.get("db", "0"), options.get("workers", "8")
    if not db_text.isdigit() or int(db_text) > 15:
        return None, f"db must be an integer 0-15, got {db_text!r}"
    if not workers_text.isdigit() or not 1 <= int(workers_text) <= 64:
        return None, f"workers must be an integer 1-64, got {workers_text!r}"
    db = int(db_text)
    if flags["cluster"] and db:
        return None, "db must be 0 in cluster mode (a cluster has database 0 only)"
    if not flags["cluster"] and len(nodes) > 1:
        return None, "several nodes need cluster=1 (a standalone store has one address)"
    timeout, problem = _seconds(options, "timeout", DEFAULT_TIMEOUT_S)
    if problem:
        return None, problem
    connect_timeout, problem = _seconds(options, "connect_timeout", DEFAULT_CONNECT_TIMEOUT_S)
    if problem:
        return None, problem
    requested = options.get("adapter", "auto")
    if requested not in ADAPTERS:
        return None, f"adapter must be one of {', '.join(ADAPTERS)}, got {requested!r}"
    adapter, problem = choose_adapter(
        requested, cluster=flags["cluster"], tls=flags["tls"], db=db, nodes=len(nodes),
        loopback=all(is_loopback(h) for h, _ in nodes),
        timeouts="timeout" in options or "connect_timeout" in options)
    if problem:
        return None, problem
    return SharedTier(url=value, nodes=tuple(nodes), cluster=flags["cluster"],
                      tls=flags["tls"], db=db, workers=int(workers_text),
                      adapter=adapter, tls_ca=tls_ca, timeout=timeout,
                      connect_timeout=connect_timeout), ""


def adapter_json(tier: SharedTier, serde: dict[str, Any] | None) -> dict[str, Any]:
    """The ``--l2-adapter`` object of the shared tier, *without* credentials (the launcher
    adds them in the server's own process). ``max_capacity_gb`` stays 0: the store evicts
    (allkeys-lru), LMCache's byte counter could not see the other hosts' writes anyway."""
    if tier.adapter == "resp":
        host, port = tier.nodes[0]
        out: dict[str, Any] = {"type": "resp", "host": host, "port": port,
                               "num_workers": tier.workers}
    else:
        out = {"type": "valkey", "startup_nodes": tier.endpoint,
               "cluster_mode": tier.cluster, "tls_enable": tier.tls,
               "num_workers": tier.workers, "request_timeout": tier.timeout,
               "connection_timeout": tier.connect_timeout}
        if not tier.cluster:
            out["database_id"] = tier.db
    if serde:
        out["serde"] = dict(serde)
    return out


# --------------------------------------------------------------------------- the secret file


@dataclass(frozen=True)
class SharedSecret:
    """The ACL user and password of the shared tier. ``repr`` never shows the password."""

    username: str
    password: str

    def __repr__(self) -> str:
        return f"SharedSecret(username={self.username!r}, password=<redacted>)"


def parse_secret(text: str) -> tuple[SharedSecret | None, str]:
    """Parse the secret file's text: ``username=NAME`` and ``password=PW`` lines (``#``
    comments and blank lines allowed; the password is taken verbatim after the first
    ``=``). Returns (secret or None, problem or ''); a problem never quotes the password."""
    values: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or key not in ("username", "password"):
            return None, f"line {number}: expected username=... or password=..."
        if key in values:
            return None, f"line {number}: {key} given twice"
        values[key] = value.rstrip("\r") if key == "password" else value.strip()
    if not values.get("password"):
        return None, "no password=... line"
    user = values.get("username", "")
    if user and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", user):
        return None, "username must be 1-128 characters of A-Z a-z 0-9 _ . : -"
    return SharedSecret(user or "default", values["password"]), ""
