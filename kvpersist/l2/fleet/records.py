"""Fleet records on the shared tier (pure): which hosts serve a namespace, and with which
serde key.

Every host that runs a deployment with a shared tier keeps one small record per
(namespace, host, deployment) in the store::

    kvpersist-fleet:<namespace>:<host id>  ->  {"schema": "kvpersist.fleet-record/1",
        "namespace", "host", "host_id", "deployment", "version", "serde",
        "serde_key_fingerprint", "updated_at", "ttl_s"[, "since", "health", "nvme"]}

(the last three optional: since when this host serves the namespace, the status its last
health run recorded, its NVMe use for the namespace as the launch measured it; a record of
an older kvpersist has none of them) with a TTL of :data:`RECORD_TTL_S`, and the namespace's
index, the set ``kvpersist-fleet:<namespace>`` of the host ids that wrote one (its TTL
restarts at every write), so that ``health`` and ``prune`` read one namespace's records
without scanning the store's keyspace (millions of chunk keys); a member whose record lapsed
is skipped by readers and removed by the next writer. ``launch`` writes it, the periodic
``health`` run refreshes it while the cache server answers, a clean ``stop`` deletes it; a
host that vanishes drops out when its TTL runs out. ``health`` compares the fingerprints of
the records of one namespace (:func:`key_conflicts`), ``prune`` treats a namespace with any
record as active.

The fingerprint is ``HMAC-SHA256(serde key, FINGERPRINT_LABEL)``, truncated to 16 hex: equal
keys give equal fingerprints, and without the key nobody can compute it or test a guessed
key offline faster than a brute force of the key itself. It is neither the key nor a plain
hash of it (a plain hash of a key from a small set could be looked up).

Whatever the store holds is untrusted, whoever should have written it: a record is read
only when its value is at most :data:`MAX_RECORD_BYTES` (the store is asked its length
first), an index only when it has at most :data:`MAX_INDEX_MEMBERS` members, and a record is
used only when it parses as this schema with every field of its type
(:func:`decode_record`); anything else is foreign: counted, named escaped, skipped.

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
from kvpersist.system.untrusted import UnreadableFile, parse_json

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


#: the statuses a health run records (``kvp-admin health``'s verdicts)
HEALTH_STATES = ("healthy", "degraded", "warming", "down")
#: the canary states a health run records (docs/canary.md; ``none``: no run yet)
CANARY_STATES = ("passed", "failed", "unknown", "none")
#: the latest time an optional field may name (unix seconds, the year 5138): a larger number
#: is not a time a host wrote
MAX_TIME_S = 100_000_000_000
#: the longest ``ttl_s`` a record may hold: a year (kvpersist writes 1,290 s; issue 40: one of
#: 400 digits ended ``fleet status`` with ``OverflowError``)
MAX_TTL_S = 365 * 86400
#: the largest count of files or bytes an ``nvme`` field may hold (a signed 64-bit integer)
MAX_COUNT = (1 << 63) - 1


@dataclass(frozen=True)
class HealthStamp:
    """The status the last ``health`` run on the host found, and when (unix seconds)."""

    status: str  # one of HEALTH_STATES
    at: float
    #: the namespace's canary on the host as that health run read it (one of
    #: CANARY_STATES; None: not known, e.g. a record of an older kvpersist)
    canary: str | None = None


@dataclass(frozen=True)
class NvmeUse:
    """The namespace's chunk files and bytes on the host's cache root, and when they were
    measured (unix seconds): the launch's scan (the one it sizes the budget with)."""

    files: int
    bytes: int
    at: float


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
    #: when this host started serving the namespace (the launch's time, kept by the refreshes)
    since: float | None = None
    #: the status the last health run recorded
    health: HealthStamp | None = None
    #: this host's files and bytes of the namespace, as the launch measured them
    nvme: NvmeUse | None = None

    @property
    def key(self) -> str:
        return record_key(self.namespace, self.host_id)

    def to_dict(self) -> dict[str, Any]:
        """The record as stored; an optional field that is None is left out (a record
        without them is the one an older kvpersist writes and reads)."""
        doc = {k: v for k, v in asdict(self).items() if v is not None}
        if isinstance(doc.get("health"), dict) and doc["health"].get("canary") is None:
            doc["health"].pop("canary")  # as an older kvpersist writes it
        return {"schema": SCHEMA, **doc}

    def expires_at(self) -> float:
        """When the record lapses by its own fields (``updated_at + ttl_s``)."""
        return self.updated_at + self.ttl_s

    def lapsed(self, now: float) -> bool:
        """Past its TTL by its own fields (the store may still return it: another clock, a
        TTL the store did not apply)."""
        return self.expires_at() < now

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


@dataclass(frozen=True)
class Oversized:
    """A value larger than :data:`MAX_RECORD_BYTES`, left on the store unread (only its
    length was asked): not a record kvpersist wrote, foreign."""

    size: int


#: a stored value as read: the bytes, None (gone), :data:`WRONG_TYPE` or :class:`Oversized`
Stored = bytes | str | None | WrongType | Oversized

#: the largest record value read back (one kvpersist writes is ~400 bytes): a larger value is
#: never fetched, only its length (:mod:`kvpersist.l2.shared.store` asks ``STRLEN`` first)
MAX_RECORD_BYTES = 4096
#: the most members a namespace's index may have (one per host serving the namespace): a
#: larger set is not kvpersist's index, its members are never fetched
MAX_INDEX_MEMBERS = 4096
#: the longest host id (:func:`host_id`: 63 characters of host name, ``-``, 8 hex); a longer
#: index member is not a host id and is never fetched
MAX_HOST_ID_BYTES = 72
#: the longest text field of a record (a host name has at most 64 characters)
MAX_FIELD_CHARS = 256

_STR_FIELDS = ("namespace", "host", "host_id", "deployment", "version", "serde",
               "serde_key_fingerprint")


def _field_problem(doc: dict[str, Any]) -> str:
    """Why the fields of a parsed record are not this schema's, or '' (pure): every text
    field a printable string of at most :data:`MAX_FIELD_CHARS`, ``updated_at`` a time from 0
    to :data:`MAX_TIME_S`, ``ttl_s`` a whole number from 1 to :data:`MAX_TTL_S`. A missing
    field, or one of another type, is never replaced by a default. Fields this version does
    not know are ignored (a newer kvpersist may add some; refusing its records would make its
    namespaces look unused)."""
    for name in _STR_FIELDS:
        value = doc.get(name)
        if not isinstance(value, str):
            return f"{name} is {'missing' if value is None else _json_type(value)}, not text"
        if len(value) > MAX_FIELD_CHARS or not value.isprintable():
            return f"{name} is not printable text of at most {MAX_FIELD_CHARS} characters"
    updated, ttl = doc.get("updated_at"), doc.get("ttl_s")
    if not _is_time(updated):
        return f"updated_at is not {_TIME}"
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= MAX_TTL_S:
        return f"ttl_s is not a whole number of seconds from 1 to {MAX_TTL_S:,}"
    return _optional_problem(doc)


def _is_time(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and 0 <= value <= MAX_TIME_S)


def _is_count(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= MAX_COUNT


_TIME = f"a number of seconds from 0 to {MAX_TIME_S:,}"


def _optional_problem(doc: dict[str, Any]) -> str:
    """Why an optional field of a parsed record is not this schema's, or '' (pure). A field
    that is absent (or ``null``) is None; one that is present must be whole: ``since`` a time
    (:data:`MAX_TIME_S`), ``health`` an object with ``status`` one of :data:`HEALTH_STATES`
    and ``at`` a time, ``nvme`` an object with ``files`` and ``bytes`` whole numbers from 0 to
    :data:`MAX_COUNT` and ``at`` a time (keys these objects do not know are ignored)."""
    since, health, nvme = doc.get("since"), doc.get("health"), doc.get("nvme")
    if since is not None and not _is_time(since):
        return f"since is not {_TIME}"
    if health is not None and not (isinstance(health, dict)
                                   and isinstance(health.get("status"), str)
                                   and health["status"] in HEALTH_STATES
                                   and _is_time(health.get("at"))):
        return (f"health is not an object of a status ({', '.join(HEALTH_STATES)}) and its "
                f"time ({_TIME})")
    if nvme is not None and not (isinstance(nvme, dict) and _is_count(nvme.get("files"))
                                 and _is_count(nvme.get("bytes")) and _is_time(nvme.get("at"))):
        return (f"nvme is not an object of files and bytes (whole numbers from 0 to "
                f"{MAX_COUNT:,}) and their time ({_TIME})")
    return ""


def _optional_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """The optional fields of a record that passed :func:`_field_problem` (pure)."""
    since, health, nvme = doc.get("since"), doc.get("health"), doc.get("nvme")
    return {"since": None if since is None else float(since),
            "health": None if health is None else HealthStamp(
                health["status"], float(health["at"]),
                health.get("canary") if health.get("canary") in CANARY_STATES else None),
            "nvme": None if nvme is None else NvmeUse(nvme["files"], nvme["bytes"],
                                                      float(nvme["at"]))}


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


def decode_record(key: str, raw: Stored) -> tuple[FleetRecord | None, str]:
    """A record from its key and stored value; (None, why) for anything else (pure).

    The value is untrusted: it must be this schema's JSON (at most
    :data:`MAX_RECORD_BYTES`, parsed by :func:`~kvpersist.system.untrusted.parse_json`:
    never a ``RecursionError``, ``NaN`` or ``Infinity``), every field of its type
    (:func:`_field_problem`), and its namespace and host id the ones its key names (a record
    copied under another key is not trusted). A key of another type (:data:`WRONG_TYPE`)
    or a value too large to be a record (:class:`Oversized`) is foreign. ``why`` starts with
    the key, escaped."""
    shown = display_name(key)
    if raw is None:
        return None, f"{shown}: gone"
    if isinstance(raw, WrongType):
        return None, f"{shown}: not a string (a key of another type, foreign): skipped"
    if isinstance(raw, Oversized):
        return None, (f"{shown}: {raw.size:,} bytes, more than the {MAX_RECORD_BYTES:,} a "
                      "fleet record may hold (foreign, not read): skipped")
    if len(raw) > MAX_RECORD_BYTES:
        return None, (f"{shown}: {len(raw):,} bytes, more than the {MAX_RECORD_BYTES:,} a "
                      "fleet record may hold (foreign): skipped")
    try:
        doc = parse_json(raw, shown)
    except UnreadableFile as exc:
        return None, f"{shown}: {exc.why} (not a fleet record, foreign): skipped"
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        return None, f"{shown}: not a {SCHEMA} record (foreign): skipped"
    problem = _field_problem(doc)
    if problem:
        return None, f"{shown}: {problem} (not a {SCHEMA} record, foreign): skipped"
    rec = FleetRecord(namespace=doc["namespace"], host=doc["host"], host_id=doc["host_id"],
                      deployment=doc["deployment"], version=doc["version"],
                      serde=doc["serde"], serde_key_fingerprint=doc["serde_key_fingerprint"],
                      updated_at=float(doc["updated_at"]), ttl_s=doc["ttl_s"],
                      **_optional_fields(doc))
    if not is_namespace(rec.namespace) or not _HOST_ID.match(rec.host_id):
        return None, f"{shown}: bad namespace or host id (foreign): skipped"
    if rec.key != key:
        return None, (f"{shown}: the record names another key ({display_name(rec.key)}; "
                      "foreign): skipped")
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
