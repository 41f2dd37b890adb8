"""Fleet records on the shared tier (pure): which hosts serve a namespace, and with which
serde key.

Every host that runs a deployment with a shared tier keeps one small record per
(namespace, host, deployment) in the store::

    kvpersist-fleet:<namespace>:<host id>  ->  {"schema": "kvpersist.fleet-record/1",
        "namespace", "host", "host_id", "deployment", "version", "serde",
        "serde_key_fingerprint", "updated_at", "ttl_s"}

with a TTL of :data:`RECORD_TTL_S`, and the namespace's index, the set
``kvpersist-fleet:<namespace>`` of the host ids that wrote one (its TTL restarts at every
write), so that ``health`` and ``prune`` read one namespace's records without scanning the
store's keyspace (millions of chunk keys); a member whose record lapsed is skipped by
readers and removed by the next writer. ``launch`` writes it, the periodic ``health`` run
refreshes it while the cache server answers, a clean ``stop`` deletes it; a host that
vanishes drops out when its TTL runs out. ``health`` compares the fingerprints of the
records of one namespace (:func:`key_conflicts`), ``prune`` treats a namespace with any
record as active.

The fingerprint is ``HMAC-SHA256(serde key, FINGERPRINT_LABEL)``, truncated to 16 hex: equal
keys give equal fingerprints, and without the key nobody can compute it or test a guessed
key offline faster than a brute force of the key itself. It is neither the key nor a plain
hash of it (a plain hash of a key from a small set could be looked up).

Record keys start with ``kvpersist-``: never a chunk key (those start with the namespace,
``kvp-<hex>@``), so report, prune and LMCache never mistake one for the other.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvpersist.l2.layout import display_name, is_namespace

SCHEMA = "kvpersist.fleet-record/1"
PREFIX = "kvpersist-fleet:"
ALL_PATTERN = PREFIX + "*"
FINGERPRINT_LABEL = b"kvpersist fleet serde-key fingerprint v1"
FINGERPRINT_HEX = 16

#: the health timer's default period (``kvp_health_interval``), its randomized delay, and the
#: longest a health run may take (``TimeoutStartSec`` of kvp-health@.service)
HEALTH_PERIOD_S = 300
HEALTH_JITTER_S = 30
HEALTH_RUN_S = 300
#: how many refreshes in a row may be missed before a record lapses
MISSED_REFRESHES = 3

_HOST = re.compile(r"[^A-Za-z0-9.-]+")
_HOST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,62}-[0-9a-f]{8}\Z")


def record_ttl(period_s: int = HEALTH_PERIOD_S, jitter_s: int = HEALTH_JITTER_S,
               run_s: int = HEALTH_RUN_S, misses: int = MISSED_REFRESHES) -> int:
    """Seconds a record lives without a refresh (pure)::

        ttl = misses × (period + jitter) + run

    One refresh comes at most ``period + jitter`` after the previous run *ended* (systemd's
    ``OnUnitActiveSec`` plus ``RandomizedDelaySec``), and a run may take ``run`` seconds
    before it refreshes; so a record lapses only after ``misses`` refreshes in a row were
    missed. Defaults: 3 × (300 + 30) + 300 = 1,290 s (21.5 min). Raises ValueError for a
    negative input or fewer than one miss."""
    if min(period_s, jitter_s, run_s) < 0 or misses < 1:
        raise ValueError("period, jitter and run must be >= 0 and misses >= 1")
    return misses * (period_s + jitter_s) + run_s


RECORD_TTL_S = record_ttl()


def serde_fingerprint(key: bytes) -> str:
    """``HMAC-SHA256(key, FINGERPRINT_LABEL)`` as 16 hex (pure). Raises ValueError for an
    empty key."""
    if not key:
        raise ValueError("empty serde key")
    return hmac.new(key, FINGERPRINT_LABEL, hashlib.sha256).hexdigest()[:FINGERPRINT_HEX]


def host_id(hostname: str, machine_id: str, state_dir: str) -> str:
    """The record's host id (pure): the host name (characters outside ``A-Za-z0-9.-``
    replaced, at most 63) and 8 hex of ``sha256(machine id, state dir)``, so two deployments
    of one namespace on one host (their own state dirs) are two hosts; a renamed host gets a
    new id (its old record lapses)."""
    name = _HOST.sub("-", hostname).strip("-.")[:63] or "host"
    digest = hashlib.sha256(f"{machine_id}\0{state_dir}".encode()).hexdigest()[:8]
    return f"{name}-{digest}"


def record_key(namespace: str, host: str) -> str:
    """``kvpersist-fleet:<namespace>:<host id>``."""
    return f"{PREFIX}{namespace}:{host}"


def index_key(namespace: str) -> str:
    """``kvpersist-fleet:<namespace>``: the set of host ids with a record of the namespace."""
    return f"{PREFIX}{namespace}"


def match_pattern(namespace: str) -> str:
    """The SCAN MATCH pattern of one namespace's records (``namespace`` has no glob
    characters: it passed :func:`~kvpersist.l2.layout.is_namespace`)."""
    return f"{PREFIX}{namespace}:*"


def is_fleet_key(key: str) -> bool:
    """True for any key of the fleet records (a record or a namespace's index)."""
    return key.startswith(PREFIX)


def parse_record_key(key: str) -> tuple[str, str] | None:
    """(namespace, host id) of a record key; None for anything else (an index, another
    key)."""
    if not key.startswith(PREFIX):
        return None
    ns, sep, host = key[len(PREFIX):].partition(":")
    if not sep or not is_namespace(ns) or not _HOST_ID.match(host):
        return None
    return ns, host


def is_record_key(key: str) -> bool:
    """True for a record key (``kvpersist-fleet:<namespace>:<host id>``)."""
    return parse_record_key(key) is not None


@dataclass(frozen=True)
class FleetRecord:
    """One host's record of one namespace."""

    namespace: str
    host: str
    host_id: str
    deployment: str
    version: str
    serde: str  # aesgcm / none
    serde_key_fingerprint: str  # "" without a key (serde none)
    updated_at: float  # unix seconds
    ttl_s: int = RECORD_TTL_S

    @property
    def key(self) -> str:
        return record_key(self.namespace, self.host_id)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}

    def encode(self) -> str:
        """The stored JSON (sorted keys, compact)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def age_s(self, now: float) -> float:
        """Seconds since the last refresh (0 for a clock ahead of ``now``)."""
        return max(0.0, now - self.updated_at)

    def same_key(self, other: FleetRecord) -> bool:
        """Can the two hosts read each other's chunks (same serde, same key)?"""
        return (self.serde, self.serde_key_fingerprint) == (other.serde,
                                                            other.serde_key_fingerprint)


class WrongType:
    """What the store answered for a key of another type than the command reads (WRONGTYPE:
    a hash where a record's string was expected): a foreign key, skipped."""

    def __repr__(self) -> str:
        return "WRONG_TYPE"


WRONG_TYPE = WrongType()
#: a stored value as read: the bytes, None (gone), or :data:`WRONG_TYPE`
Stored = bytes | str | None | WrongType

_STR_FIELDS = ("namespace", "host", "host_id", "deployment", "version", "serde",
               "serde_key_fingerprint")


def decode_record(key: str, raw: Stored) -> tuple[FleetRecord | None, str]:
    """A record from its key and stored value; (None, why) for anything else (pure).

    The value must be this schema's JSON, and its namespace and host id must be the ones
    its key names (a record copied under another key is not trusted). A key of another type
    (:data:`WRONG_TYPE`) is foreign."""
    shown = display_name(key)
    if raw is None:
        return None, f"{shown}: gone"
    if isinstance(raw, WrongType):
        return None, f"{shown}: not a string (a key of another type, foreign): skipped"
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, f"{shown}: not JSON"
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        return None, f"{shown}: not a {SCHEMA} record"
    if not all(isinstance(doc.get(f), str) for f in _STR_FIELDS):
        return None, f"{shown}: a text field is missing"
    updated, ttl = doc.get("updated_at"), doc.get("ttl_s", RECORD_TTL_S)
    if (isinstance(updated, bool) or not isinstance(updated, (int, float))
            or isinstance(ttl, bool) or not isinstance(ttl, int)):
        return None, f"{shown}: updated_at or ttl_s is not a number"
    text = {f: str(doc[f]) for f in _STR_FIELDS}
    rec = FleetRecord(namespace=text["namespace"], host=text["host"],
                      host_id=text["host_id"], deployment=text["deployment"],
                      version=text["version"], serde=text["serde"],
                      serde_key_fingerprint=text["serde_key_fingerprint"],
                      updated_at=float(updated), ttl_s=ttl)
    if not is_namespace(rec.namespace) or not _HOST_ID.match(rec.host_id):
        return None, f"{shown}: bad namespace or host id"
    if rec.key != key:
        return None, f"{shown}: the record names another key ({rec.key})"
    return rec, ""


def by_namespace(records: Iterable[FleetRecord]) -> dict[str, list[FleetRecord]]:
    """Records grouped by namespace, each group by host id (pure)."""
    out: dict[str, list[FleetRecord]] = {}
    for r in sorted(records, key=lambda r: (r.namespace, r.host_id)):
        out.setdefault(r.namespace, []).append(r)
    return out


def key_conflicts(own: FleetRecord, records: Sequence[FleetRecord]) -> list[FleetRecord]:
    """The records of *other* hosts of ``own``'s namespace whose serde or key differs
    (pure): chunks each side stores fail authentication on the other, i.e. miss."""
    return [r for r in records if r.namespace == own.namespace and r.host_id != own.host_id
            and not own.same_key(r)]


def format_age(seconds: float) -> str:
    """``42 s``, ``7 min``, ``3 h`` (pure)."""
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h"


def describe_hosts(records: Sequence[FleetRecord], now: float) -> str:
    """``host-a-1a2b3c4d (deployment x, refreshed 2 min ago), ...`` (pure)."""
    return ", ".join(f"{r.host_id} (deployment {r.deployment}, refreshed "
                     f"{format_age(r.age_s(now))} ago)" for r in records)


def host_rows(records: Sequence[FleetRecord], now: float) -> list[dict[str, Any]]:
    """The records as report and health rows (pure)."""
    return [{"host": r.host, "host_id": r.host_id, "deployment": r.deployment,
             "version": r.version, "serde": r.serde,
             "serde_key_fingerprint": r.serde_key_fingerprint,
             "age_s": round(r.age_s(now), 1)} for r in records]
