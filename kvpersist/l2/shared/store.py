"""Talk to the shared tier's store (Redis/Valkey, standalone or cluster) for ``report``,
``prune`` and ``health``: the I/O half of :mod:`kvpersist.l2.shared.wire`.

Listing is server-side iteration only: ``SCAN MATCH`` on every primary node (never ``KEYS``);
value sizes come from ``STRLEN`` in pipelines of one SCAN page. A prune deletes one namespace
in bounded batches (one pipeline per page) under a lock held *in the store* (``SET NX PX``,
refreshed per batch, released only by its holder), so two hosts never prune the same
namespace at once. Running it again deletes nothing more.

Every key is untrusted: one of another type than its name says (``WRONGTYPE``) is foreign,
counted and skipped (:class:`~kvpersist.l2.shared.wire.Skipped`), never read as what it is
not and never deleted; a prune deletes only keys that *parse* as the namespace's chunk keys
(the SCAN pattern only narrows the walk), each one only if it is a string, checked and
deleted in one script (no ``TYPE``: the recommended ACL does not grant it). Keys are sent back
as the bytes the store gave (decoded with ``surrogateescape``).

Every value is untrusted too, and so is its size: a fleet record, a prune lock's holder and a
namespace's index are read by scripts (``EVAL``) that ask the length first (``STRLEN``,
``SCARD``) and send the value only when it is small enough to be what its name says
(:data:`~kvpersist.l2.fleet.records.MAX_RECORD_BYTES`,
:data:`~kvpersist.l2.fleet.records.MAX_INDEX_MEMBERS`); a 100 MB value or a set of a
million members is never fetched, only counted as foreign. Checking and reading in one
script leaves no window for a value to grow in between.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvpersist.config.shared_tier import SharedSecret, SharedTier
from kvpersist.errors import CheckFailed, KvpError
from kvpersist.l2.fleet.records import (
    MAX_RECORD_BYTES,
    WRONG_TYPE,
    Oversized,
    Stored,
    is_fleet_key,
    is_record_key,
)
from kvpersist.l2.layout import display_name
from kvpersist.l2.shared.wire import (
    NOT_A_CHUNK,
    NOT_A_STRING,
    Skipped,
    StoreBudget,
    lock_key,
    match_pattern,
    namespace_of,
    plan_store_budget,
)
from kvpersist.system.untrusted import bounded_resp_parser

SCAN_COUNT = 500


def _errors() -> tuple[type[Exception], ...]:
    """What redis-py raises for a store that cannot serve (the cluster client's own
    exception type does not derive from RedisError)."""
    import redis
    from redis.exceptions import RedisClusterException

    return (redis.RedisError, RedisClusterException)


def store_errors() -> tuple[type[Exception], ...]:
    """The exception types a failing store raises (for callers that catch them)."""
    return _errors()


#: how :func:`describe` starts the error of a certificate the CA does not vouch for
TLS_UNTRUSTED = "TLS certificate not trusted"


def describe(exc: BaseException) -> str:
    """A store error as the user should read it: a TLS certificate the CA does not vouch for
    is named as such (redis-py reports it as a connection error)."""
    text = str(exc)
    if len(text) > 1000:  # the store's own words, bounded
        text = f"{text[:1000]}... ({len(text) - 1000:,} more characters)"
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
        return (f"{TLS_UNTRUSTED} ({text}); tls_ca= must name the CA that signed "
                "the store's certificate")
    return text


class ForeignKey(KvpError):
    """A key kvpersist must write holds another type (someone else's key under its name)."""


def is_wrong_type(reply: Any) -> bool:
    """True for the store's answer to a command on a key of another type (``WRONGTYPE``)."""
    import redis

    return isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE")


def replies(pipe: Any) -> list[Any]:
    """Run ``pipe``: its replies, a ``WRONGTYPE`` one left in its place (a foreign key);
    any other error raised."""
    answers = pipe.execute(raise_on_error=False)
    if not isinstance(answers, list):
        raise unexpected("a pipeline", answers)
    for r in answers:
        if isinstance(r, Exception) and not is_wrong_type(r):
            raise r
    return answers


def unexpected(what: str, reply: Any) -> Exception:
    """The error for a reply that is not what ``what`` returns (a store, or something
    answering on its port, that is not Redis/Valkey): a store error (``redis``'s
    ``InvalidResponse``), which every caller reports as it reports an unreachable store."""
    from redis.exceptions import InvalidResponse

    shown = display_name(repr(reply)[:80])
    return InvalidResponse(f"the store answered {what} with {shown}, which is not what it "
                           "returns: is this a Redis or Valkey server?")


def integer(reply: Any, what: str) -> int:
    """``reply`` as an integer reply of ``what``; else :func:`unexpected`."""
    if isinstance(reply, int) and not isinstance(reply, bool):
        return reply
    raise unexpected(what, reply)


def array(reply: Any, what: str, *, ints: int = 0, at_least: int = 0) -> list[Any]:
    """``reply`` as an array reply of ``what`` whose first ``ints`` items are integers and
    that has at least ``max(ints, at_least)`` items; else :func:`unexpected`."""
    if (isinstance(reply, list) and len(reply) >= max(ints, at_least)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in reply[:ints])):
        return reply
    raise unexpected(what, reply)


def decode_key(key: Any) -> str:
    """A key as the store gave it, as text (bytes that are not UTF-8 kept by
    ``surrogateescape``)."""
    return key.decode("utf-8", "surrogateescape") if isinstance(key, bytes) else str(key)


def raw_key(key: str) -> bytes:
    """The key as the store holds it (:meth:`SharedStore.scan` decoded it with
    ``surrogateescape``)."""
    return key.encode("utf-8", "surrogateescape")


LOCK_TTL_MS = 60_000
#: how often redis-py retries a command that failed on a connection error or timeout: once,
#: at once (a pooled connection the store closed). redis-py's default, 3 retries with
#: backoff, made a health check against an unreachable store take 51 s and ``metrics`` 62 s
#: (each call: 4 connection attempts of ``timeout`` plus backoff); now each call costs at
#: most two ``timeout`` (docs/fleet.md, "The shared tier over a network")
COMMAND_RETRIES = 1
# pcall: a lock key replaced by a key of another type is a lost lock, not a script error
_RELEASE = ("if redis.pcall('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('del', KEYS[1]) else return 0 end")
_REFRESH = ("if redis.pcall('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end")
#: read a string no longer than ARGV[1] bytes: {size, value}; {size} when it is longer (the
#: value is never sent), {-1} for a key of another type, {-2} when there is none
_GET_BOUNDED = ("local n = redis.pcall('strlen', KEYS[1]) "
                "if type(n) == 'table' then "
                "if string.find(n.err, 'WRONGTYPE', 1, true) == 1 then return {-1} end "
                "return n end "
                "if n > tonumber(ARGV[1]) then return {n} end "
                "local v = redis.call('get', KEYS[1]) "
                "if not v then return {-2} end "
                "return {n, v}")
#: the longest prune-lock value shown (``host:pid:token``)
MAX_LOCK_HOLDER_BYTES = 1024
#: keys read per pipeline (one SCAN page's worth)
READ_BATCH = SCAN_COUNT
#: delete a key only if it is a string (a chunk): {size, deleted}, {-1, 0} for another type
_UNLINK_STRING = ("local n = redis.pcall('strlen', KEYS[1]) "
                  "if type(n) ~= 'number' then return {-1, 0} end "
                  "return {n, redis.call('unlink', KEYS[1])}")


class SharedStore:
    """A connection to the store; ``nodes()`` are per-primary clients (one for standalone)."""

    def __init__(self, tier: SharedTier, secret: SharedSecret, timeout: float = 3.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        self.tier = tier
        # RESP2 (AUTH, no HELLO: a reply that is not a map cannot break the handshake) and
        # every reply through the bounded parser (system/untrusted.py)
        parser = bounded_resp_parser()
        common: dict[str, Any] = {"username": secret.username, "password": secret.password,
                                  "socket_timeout": timeout, "socket_connect_timeout": timeout,
                                  "retry": Retry(NoBackoff(), COMMAND_RETRIES),
                                  "ssl": tier.tls, "protocol": 2}
        if tier.tls_ca:
            common["ssl_ca_certs"] = tier.tls_ca
        self.client: Any
        if tier.cluster:
            base = redis.SSLConnection if tier.tls else redis.Connection

            class Bounded(base):  # type: ignore[valid-type,misc]
                def __init__(self, *args: Any, **kw: Any) -> None:
                    super().__init__(*args, **{**kw, "parser_class": parser})

            self.client = RedisCluster(
                startup_nodes=[ClusterNode(h, p)  # type: ignore[no-untyped-call]
                               for h, p in tier.nodes], connection_class=Bounded, **common)
        else:
            host, port = tier.nodes[0]
            self.client = redis.Redis(host=host, port=port, db=tier.db, **common)
            self.client.connection_pool.connection_kwargs["parser_class"] = parser

    def nodes(self) -> list[Any]:
        return [client for _, client in self.named_nodes()]

    def named_nodes(self) -> list[tuple[str, Any]]:
        """(``host:port``, client) of every primary node (the one node of a standalone)."""
        if not self.tier.cluster:
            host, port = self.tier.nodes[0]
            return [(f"{host}:{port}", self.client)]
        return [(f"{n.host}:{n.port}", self.client.get_redis_connection(n))
                for n in self.client.get_primaries()]

    def close(self) -> None:
        self.client.close()

    def scan(self, pattern: str) -> Iterator[tuple[Any, list[str]]]:
        """(node client, one page of keys) for every page of ``SCAN MATCH pattern`` on every
        primary node."""
        for node in self.nodes():
            cursor = 0
            while True:
                reply = node.scan(cursor=cursor, match=pattern, count=SCAN_COUNT)
                if (not isinstance(reply, tuple | list) or len(reply) != 2
                        or not isinstance(reply[1], list)
                        or not all(isinstance(k, bytes | str) for k in reply[1])):
                    raise unexpected("SCAN", reply)
                cursor, page = integer(reply[0], "SCAN"), reply[1]
                keys = [decode_key(k) for k in page]
                if keys:
                    yield node, keys
                if int(cursor) == 0:
                    break

    def memory(self) -> list[NodeMemory]:
        """Each primary's memory figures (``INFO memory``) and evictions (``INFO stats``)."""
        out = []
        for name, node in self.named_nodes():
            mem, stats = node.info("memory"), node.info("stats")
            if not isinstance(mem, dict) or not isinstance(stats, dict):
                raise unexpected("INFO", mem if not isinstance(mem, dict) else stats)
            out.append(NodeMemory(name, int(mem.get("used_memory", 0)),
                                  int(mem.get("maxmemory", 0)),
                                  str(mem.get("maxmemory_policy", "")),
                                  int(stats.get("evicted_keys", 0))))
        return out

    def budget(self) -> StoreBudget:
        return budget_of(self.memory())


@dataclass(frozen=True)
class NodeMemory:
    """One primary's memory as read back: used, ``maxmemory`` (0: unlimited), the eviction
    policy and the keys it evicted since it started."""

    node: str
    used_memory_bytes: int
    maxmemory_bytes: int
    policy: str
    evicted_keys: int


def budget_of(nodes: list[NodeMemory]) -> StoreBudget:
    """The store's budget, judged over its nodes (pure)."""
    return plan_store_budget([n.maxmemory_bytes for n in nodes],
                             [n.used_memory_bytes for n in nodes], [n.policy for n in nodes])


def connect(tier: SharedTier, secret: SharedSecret, timeout: float = 3.0) -> SharedStore:
    """Connect (and authenticate) to the store. Raises KvpError with the reason."""
    import redis

    try:
        store = SharedStore(tier, secret, timeout)
        for node in store.nodes():
            node.ping()
        return store
    except redis.AuthenticationError as exc:
        raise KvpError(f"shared tier {tier.endpoint}: authentication failed ({exc})") from exc
    except _errors() as exc:
        raise KvpError(f"shared tier {tier.endpoint}: {describe(exc)}") from exc


# --------------------------------------------------------------------------- probe (health)


@dataclass(frozen=True)
class StoreProbe:
    """What health learns from the store (``nodes``: the per-node figures behind ``budget``)."""

    reachable: bool
    auth_ok: bool
    latency_ms: float | None = None
    budget: StoreBudget | None = None
    error: str = ""
    nodes: tuple[NodeMemory, ...] = ()

    @property
    def up(self) -> bool:
        """Reachable and authenticated on every primary."""
        return self.reachable and self.auth_ok

    def to_dict(self) -> dict[str, Any]:
        return {"reachable": self.reachable, "auth_ok": self.auth_ok,
                "latency_ms": self.latency_ms, "error": self.error,
                "budget": self.budget.to_dict() if self.budget else None}


def probe(tier: SharedTier, secret: SharedSecret, timeout: float = 2.0) -> StoreProbe:
    """Ping every primary (latency: the slowest), read the budget. Never raises."""
    found, store = _probe_open(tier, secret, timeout)
    if store is not None:
        _close(store)
    return found


def _close(store: SharedStore) -> None:
    with contextlib.suppress(*_errors()):
        store.close()


def _probe_open(tier: SharedTier, secret: SharedSecret,
                timeout: float) -> tuple[StoreProbe, SharedStore | None]:
    """:func:`probe`, and the store still open when it is up (the caller closes it)."""
    import redis

    try:
        store = SharedStore(tier, secret, timeout)
    except redis.AuthenticationError as exc:
        return StoreProbe(True, False, error=f"authentication failed: {exc}"), None
    except _errors() as exc:
        return StoreProbe(False, False, error=describe(exc)), None
    try:
        worst = 0.0
        for node in store.nodes():
            t0 = time.perf_counter()
            node.ping()
            worst = max(worst, (time.perf_counter() - t0) * 1000)
        nodes = store.memory()
        return StoreProbe(True, True, round(worst, 2), budget_of(nodes),
                          nodes=tuple(nodes)), store
    except redis.AuthenticationError as exc:
        found = StoreProbe(True, False, error=f"authentication failed: {exc}")
    except redis.ResponseError as exc:
        auth = any(w in str(exc) for w in ("WRONGPASS", "NOAUTH", "NOPERM"))
        found = StoreProbe(True, not auth, error=describe(exc))
    except _errors() as exc:
        found = StoreProbe(False, False, error=describe(exc))
    _close(store)
    return found, None


# --------------------------------------------------------------------------- measure (metrics)


@dataclass(frozen=True)
class StoreMeasurement:
    """What ``metrics`` learns from the store: the probe (up, latency, per-node memory) and,
    when it is up, the usage scan of ``report --tier shared`` and how long it took
    (``usage`` None: not measured, ``error`` says why)."""

    probe: StoreProbe
    usage: SharedUsage | None = None
    scan_seconds: float | None = None
    error: str = ""


def measure(tier: SharedTier, secret: SharedSecret, timeout: float = 3.0) -> StoreMeasurement:
    """Probe the store, then (when it is up) scan it as ``report --tier shared`` does, on the
    same connection. Never raises: a store that is down or fails mid-scan says so in the
    result."""
    found, store = _probe_open(tier, secret, timeout)
    if store is None:
        return StoreMeasurement(found, error=found.error)
    try:
        t0 = time.perf_counter()
        counted = usage(store)
        return StoreMeasurement(found, counted, time.perf_counter() - t0)
    except _errors() as exc:
        return StoreMeasurement(found, error=f"scan failed: {describe(exc)}")
    finally:
        _close(store)


# --------------------------------------------------------------------------- usage (report)


@dataclass
class SharedUsage:
    """Per-namespace keys and value bytes on the store, and what is not a chunk key
    (``other_keys`` counts the ``skipped`` ones too)."""

    namespaces: dict[str, list[int]] = field(default_factory=dict)  # ns -> [keys, bytes]
    other_keys: int = 0
    #: chunk-named keys of another type than a string (foreign)
    skipped: Skipped = field(default_factory=Skipped)
    #: kvpersist's fleet records (kvpersist.l2.fleet.records), apart from the other keys
    record_keys: list[str] = field(default_factory=list)
    #: every fleet key: the records and the namespaces' index sets
    fleet_keys: int = 0

    @property
    def fleet_records(self) -> int:
        return len(self.record_keys)

    def add(self, ns: str, size: int) -> None:
        entry = self.namespaces.setdefault(ns, [0, 0])
        entry[0] += 1
        entry[1] += size


def _sizes(node: Any, keys: list[str]) -> list[int | None]:
    """``STRLEN`` of each key (0: gone meanwhile); None for a key of another type."""
    if not keys:
        return []
    pipe = node.pipeline(transaction=False)
    for k in keys:
        pipe.strlen(raw_key(k))
    return [None if is_wrong_type(v) else integer(v, "STRLEN") for v in replies(pipe)]


def usage(store: SharedStore, pattern: str = "*") -> SharedUsage:
    """Scan the store (``pattern``, default every key) and sum chunk keys per namespace; a
    chunk-named key that is not a string is counted as another key and skipped."""
    out = SharedUsage()
    for node, keys in store.scan(pattern):
        chunk = [(k, namespace_of(k)) for k in keys]
        mine = [(k, ns) for k, ns in chunk if ns]
        fleet = [k for k in keys if is_fleet_key(k)]
        out.fleet_keys += len(fleet)
        out.record_keys += [k for k in fleet if is_record_key(k)]
        out.other_keys += len(chunk) - len(mine) - len(fleet)
        for (k, ns), size in zip(mine, _sizes(node, [k for k, _ in mine]), strict=True):
            if size is None:
                out.other_keys += 1
                out.skipped.add(NOT_A_STRING, k)
            else:
                out.add(str(ns), size)
    return out


# --------------------------------------------------------------------------- prune


@dataclass
class SharedPruneResult:
    namespace: str
    dry_run: bool
    keys: int = 0
    bytes: int = 0
    batches: int = 0
    #: keys the SCAN pattern matched that are not this namespace's chunks (left as they are)
    skipped: Skipped = field(default_factory=Skipped)

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "dry_run": self.dry_run,
                "deleted_keys": self.keys, "deleted_bytes": self.bytes,
                "batches": self.batches, "skipped_keys": self.skipped.to_dict()}


def lock_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _chunks_of(ns: str, keys: list[str], skipped: Skipped) -> list[str]:
    """The keys that parse as ``ns``'s chunk keys; the others are counted in ``skipped``."""
    mine = []
    for k in keys:
        if namespace_of(k) == ns:
            mine.append(k)
        else:
            skipped.add(NOT_A_CHUNK, k)
    return mine


def _lock_holder_of(store: SharedStore, key: str) -> str:
    """Who holds the prune lock ``key`` (its value, at most :data:`MAX_LOCK_HOLDER_BYTES`
    read), for the refusal's message."""
    [(_, other)] = read_values(store, [key], max_bytes=MAX_LOCK_HOLDER_BYTES)
    if other is WRONG_TYPE or isinstance(other, Oversized):
        what = ("a key of another type" if other is WRONG_TYPE else
                f"a value of {other.size:,} bytes" if isinstance(other, Oversized) else "")
        return (f"{what}, not a lock kvpersist wrote: delete it if no prune of the "
                "namespace runs")
    if other is None:
        return "released meanwhile"
    return decode_key(other)


def prune_namespace(store: SharedStore, ns: str, *, apply: bool,
                    progress: Callable[[int], None] | None = None) -> SharedPruneResult:
    """Delete (``apply``) or count every chunk key of ``ns``, one SCAN page per batch, under
    the store-wide lock: only keys that parse as ``ns``'s chunk keys and are strings; the
    others are counted in ``skipped`` and left as they are. Raises CheckFailed if another
    host holds the lock (or a foreign key sits under the lock's name)."""
    res = SharedPruneResult(ns, dry_run=not apply)
    if not apply:
        for node, keys in store.scan(match_pattern(ns)):
            mine = _chunks_of(ns, keys, res.skipped)
            for k, size in zip(mine, _sizes(node, mine), strict=True):
                if size is None:
                    res.skipped.add(NOT_A_STRING, k)
                else:
                    res.keys += 1
                    res.bytes += size
            res.batches += 1
        return res
    key, holder = lock_key(ns), lock_holder()
    if not store.client.set(key, holder, nx=True, px=LOCK_TTL_MS):
        raise CheckFailed(f"another prune of {ns} holds the shared tier's lock ({key} = "
                          f"{display_name(_lock_holder_of(store, key))}); try again "
                          f"when it is done (the lock expires {LOCK_TTL_MS // 1000} s after "
                          "its holder stops refreshing it)")
    try:
        for node, keys in store.scan(match_pattern(ns)):
            if not store.client.eval(_REFRESH, 1, key, holder, LOCK_TTL_MS):
                raise CheckFailed(f"lost the shared tier's prune lock of {ns}; stopped after "
                                  f"{res.keys} keys (run it again)")
            mine = _chunks_of(ns, keys, res.skipped)
            pipe = node.pipeline(transaction=False)
            for k in mine:
                pipe.eval(_UNLINK_STRING, 1, raw_key(k))
            for k, r in zip(mine, replies(pipe), strict=True):
                size, gone = array(r, "a script", ints=2)[:2]
                if size < 0:
                    res.skipped.add(NOT_A_STRING, k)
                elif gone:
                    res.keys += 1
                    res.bytes += size
            res.batches += 1
            if progress:
                progress(res.keys)
    finally:
        store.client.eval(_RELEASE, 1, key, holder)
    return res


# --------------------------------------------------------------------------- bounded reads


def read_values(store: SharedStore, keys: list[str], *,
                max_bytes: int = MAX_RECORD_BYTES) -> list[tuple[str, Stored]]:
    """(key, value) of ``keys``, each value read only when it is at most ``max_bytes``
    (one script per key, pipelined by :data:`READ_BATCH`; the cluster client routes each
    to its node): a key that is gone has the value None, one of another type
    :data:`~kvpersist.l2.fleet.records.WRONG_TYPE`, a longer one
    :class:`~kvpersist.l2.fleet.records.Oversized` (never fetched)."""
    out: list[tuple[str, Stored]] = []
    for i in range(0, len(keys), READ_BATCH):
        batch = keys[i:i + READ_BATCH]
        pipe = store.client.pipeline(transaction=False)
        for k in batch:
            # execute_command: redis-py's cluster pipeline has no eval(), but routes an EVAL
            # by its key like any command
            pipe.execute_command("EVAL", _GET_BOUNDED, 1, raw_key(k), max_bytes)
        out += [(k, _stored(r)) for k, r in zip(batch, replies(pipe), strict=True)]
    return out


def _stored(reply: Any) -> Stored:
    """A reply of :data:`_GET_BOUNDED` as a stored value."""
    status = array(reply, "a script", ints=1)[0]
    if status == -1:
        return WRONG_TYPE
    if status == -2:
        return None
    if len(reply) == 1:
        return Oversized(status)
    value = reply[1]
    if not isinstance(value, bytes):
        raise unexpected("a script", reply)
    return value
