"""A deployment's fleet record on its shared tier (I/O; the rules are in
:mod:`kvpersist.l2.fleet.records`).

``launch`` (and ``launch --foreground``, systemd) writes the record, with the launch's time
(``since``) and the namespace's files and bytes on the cache root from the scan the launch
sizes its budget with (``nvme``); ``health`` refreshes it while the cache server answers,
with the status it found (``health``), keeping ``since`` and ``nvme`` of the record it
replaces (health never scans the root); ``stop`` deletes it. None of these ever fails because of the
record: an unreachable store, refused credentials or an unreadable key give a
:class:`RecordOutcome` that says so (a warning), and the deployment serves as before.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from kvpersist import __version__
from kvpersist.config.deployment import Deployment
from kvpersist.config.shared_tier import SharedTier
from kvpersist.errors import KvpError
from kvpersist.l2.fleet.records import (
    RECORD_TTL_S,
    FleetRecord,
    HealthStamp,
    NvmeUse,
    Stored,
    decode_record,
    host_id,
    host_rows,
    index_key,
    key_conflicts,
    record_key,
    serde_fingerprint,
)
from kvpersist.l2.fleet.store import (
    delete_record,
    read_index,
    scan_record_keys,
    write_record,
)
from kvpersist.l2.keys import store as keys
from kvpersist.l2.layout import display_name
from kvpersist.l2.shared.credentials import read_secret_file
from kvpersist.l2.shared.store import READ_BATCH, connect, read_values, store_errors
from kvpersist.l2.shared.wire import SKIPPED_SHOWN
from kvpersist.system.files import service_uids
from kvpersist.system.untrusted import MAX_RECORD_BYTES, UnreadableFile, read_bytes

if TYPE_CHECKING:
    from kvpersist.l2.inventory import Sizing

#: short: a launch, stop or health run never waits long for a store that does not answer
TIMEOUT_S = 2.0
MACHINE_ID_FILE = "/etc/machine-id"


def machine_id(path: str = MACHINE_ID_FILE) -> str:
    """This machine's id (systemd's ``/etc/machine-id``: 32 hex digits), or '' where there is
    none or it is not one (read as untrusted, links followed: not a regular file, bigger than
    a record, anything but hex digits). Never raises."""
    try:
        text = read_bytes(path, max_bytes=MAX_RECORD_BYTES).decode("ascii", "replace").strip()
    except (FileNotFoundError, UnreadableFile):
        return ""
    return text if 0 < len(text) <= 64 and all(c in "0123456789abcdef" for c in text) else ""


@dataclass(frozen=True)
class FleetHost:
    """What this host's record reads of a deployment, as plain values (:func:`host_of`; a
    launch plan carries them)."""

    deployment: str
    namespace: str
    state_dir: str
    service_user: str
    serde: str
    serde_key_file: str
    #: KVP_SHARED_TIER as written ('' : none), parsed (None: none, or it does not parse),
    #: and its secret file
    tier_url: str = ""
    tier: SharedTier | None = None
    secret_file: str = ""


def host_of(dep: Deployment) -> FleetHost:
    """What this host's record reads of ``dep`` (pure)."""
    s = dep.settings
    return FleetHost(dep.name, dep.namespace, s.state_dir, s.service_user, s.serde,
                     s.serde_key_file, s.shared_tier, dep.shared, s.shared_tier_secret_file)


def own_record(dep: Deployment | FleetHost, now: float | None = None) -> FleetRecord:
    """This host's record of a deployment (a :class:`Deployment` or its :class:`FleetHost`;
    nothing is written). Raises KvpError when the serde key cannot be read (e.g. not yet
    created, or another user's)."""

    h = host_of(dep) if isinstance(dep, Deployment) else dep
    fingerprint = ""
    if h.serde == "aesgcm":
        fingerprint = serde_fingerprint(keys.read_key(h.serde_key_file,
                                                      service_uids(h.service_user)))
    hostname = socket.gethostname()
    return FleetRecord(namespace=h.namespace, host=hostname,
                       host_id=host_id(hostname, machine_id(), h.state_dir),
                       deployment=h.deployment, version=__version__, serde=h.serde,
                       serde_key_fingerprint=fingerprint,
                       updated_at=time.time() if now is None else now, ttl_s=RECORD_TTL_S)


@dataclass(frozen=True)
class RecordOutcome:
    """What happened to this host's record: ``written``, ``deleted``, ``absent`` (nothing to
    delete), ``failed`` (``detail`` says why) or ``skipped`` (no shared tier)."""

    action: str
    key: str = ""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.action != "failed"

    def note(self) -> str:
        """One line for launch/stop output (a failure starts with ``WARNING:``)."""
        if self.action == "failed":
            return f"WARNING: fleet record {self.key or '-'} not updated: {self.detail}"
        return f"fleet record {self.key}: {self.action}" + (
            f" ({self.detail})" if self.detail else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _connect(h: FleetHost, timeout: float) -> Any:
    """A connection to the deployment's store. Raises KvpError (no shared tier, secret file,
    store unreachable, credentials refused)."""

    if h.tier is None:
        raise KvpError(f"{h.deployment} has no shared tier")
    secret = read_secret_file(h.secret_file, also=service_uids(h.service_user))
    return connect(h.tier, secret, timeout)


def nvme_use(sizing: Sizing | None, namespace: str) -> NvmeUse | None:
    """The namespace's chunk files and bytes from a launch's measurement of its cache root
    (no scan of its own); an absent root holds none. None when nothing was measured."""
    m = sizing.measurement if sizing is not None else None
    if m is None:
        return None
    if m.scan is None:  # the root does not exist yet
        return NvmeUse(0, 0, time.time())
    u = m.scan.prefixes.get(namespace)
    at = m.scan.started_ns / 1e9 if m.scan.started_ns else time.time()
    return NvmeUse(u.files, u.bytes, at) if u is not None else NvmeUse(0, 0, at)


def started_at(path: str) -> float | None:
    """When the file at ``path`` was last written (the cache server's pid file: when it
    started), or None."""
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def previous(store: Any, rec: FleetRecord) -> FleetRecord | None:
    """This host's record as the store holds it now (read bounded and decoded as any other
    host's: a foreign value is None). Raises what the store raises."""
    [(key, raw)] = read_values(store, [rec.key])
    return decode_record(key, raw)[0]


def write(dep: Deployment | FleetHost, *, timeout: float = TIMEOUT_S, launched: bool = False,
          nvme: NvmeUse | None = None, health: str = "", canary: str | None = None,
          started: float | None = None) -> RecordOutcome:
    """Write (or refresh) this host's record of a deployment (a :class:`Deployment` or its
    :class:`FleetHost`) with its TTL. Never raises.

    ``launched`` (a launch): ``since`` is now and ``nvme`` the launch's measurement. Else (a
    health refresh) ``since`` and ``nvme`` are kept from the record this one replaces (read
    back first); without one (it lapsed, or an older kvpersist wrote it) ``since`` is
    ``started`` (when the cache server started) and ``nvme`` unknown. ``health``: the status
    this run found, stamped now."""

    h = host_of(dep) if isinstance(dep, Deployment) else dep
    if not h.tier_url:
        return RecordOutcome("skipped")
    key = ""
    try:
        rec = own_record(h)
        key = rec.key
        store = _connect(h, timeout)
    except KvpError as exc:
        return RecordOutcome("failed", key, f"{exc}; the deployment serves without it, "
                             "`kvp-admin health` writes it once the store answers")
    try:
        stamp = HealthStamp(health, rec.updated_at, canary) if health else None
        if launched:
            rec = replace(rec, since=rec.updated_at, nvme=nvme, health=stamp)
        else:
            prev = previous(store, rec)
            if prev is not None and nvme is None:
                nvme = prev.nvme
            since = prev.since if prev is not None and prev.since is not None else started
            rec = replace(rec, since=since, health=stamp, nvme=nvme)
        write_record(store, rec.namespace, rec.host_id, rec.encode(), rec.ttl_s)
        return RecordOutcome("written", key, f"TTL {rec.ttl_s} s")
    except KvpError as exc:  # the index's key is someone else's
        return RecordOutcome("failed", key, str(exc))
    except store_errors() as exc:
        return RecordOutcome("failed", key, f"the store refused it: {exc}")
    finally:
        with contextlib.suppress(*store_errors()):
            store.close()


def delete(dep: Deployment, *, timeout: float = TIMEOUT_S) -> RecordOutcome:
    """Delete this host's record of ``dep`` (a host that stopped serving). Never raises;
    a record left behind lapses after its TTL."""

    if not dep.settings.shared_tier:
        return RecordOutcome("skipped")
    host = host_id(socket.gethostname(), machine_id(), dep.settings.state_dir)
    key = record_key(dep.namespace, host)
    try:
        store = _connect(host_of(dep), timeout)
    except KvpError as exc:
        return RecordOutcome("failed", key, f"{exc}; it lapses after its TTL")
    try:
        gone = delete_record(store, dep.namespace, host)
        return RecordOutcome("deleted" if gone else "absent", key)
    except store_errors() as exc:
        return RecordOutcome("failed", key, f"{exc}; it lapses after its TTL")
    finally:
        with contextlib.suppress(*store_errors()):
            store.close()


def decode_all(found: Iterable[tuple[str, Stored]],
               limit: int = SKIPPED_SHOWN) -> tuple[list[FleetRecord], list[str]]:
    """The valid records of (key, value) pairs and why the others were skipped as foreign:
    the first ``limit`` named, the rest counted in a last line (pure; a value None, i.e. a
    record that lapsed meanwhile, is no problem)."""
    records: list[FleetRecord] = []
    problems: list[str] = []
    more = 0
    for key, raw in found:
        rec, why = decode_record(key, raw)
        if rec is not None:
            records.append(rec)
        elif raw is not None:
            if len(problems) < limit:
                problems.append(why)
            else:
                more += 1
    return records, problems + ([f"... and {more:,} more"] if more else [])


def read_namespace(store: Any, ns: str) -> tuple[list[FleetRecord], list[str]]:
    """The live records of ``ns`` through its index (no scan of the keyspace); when the
    index's key is not kvpersist's index (another type, too many members), through a scan
    of the record keys, with a problem naming the key. Raises what the store raises (see
    :func:`kvpersist.l2.shared.store.store_errors`)."""

    found = read_index(store, ns)
    idx = display_name(index_key(ns))
    if found.members is not None:
        records, problems = decode_all([(record_key(ns, host), raw)
                                        for host, raw in found.members])
        return records, ([f"{idx} {found.problem}"] if found.problem else []) + problems
    records, problems = read_keys(store, scan_record_keys(store, ns))
    return records, [f"{idx} {found.problem} (not kvpersist's index): the records were "
                     "found by a scan of the store; delete that key (the next launch or "
                     "health run writes the index again)", *problems]


def read_keys(store: Any, keys: list[str]) -> tuple[list[FleetRecord], list[str]]:
    """The live records of ``keys`` (record keys a scan found), read and decoded one batch
    at a time (each value bounded: :func:`kvpersist.l2.shared.store.read_values`). Raises
    what the store raises."""

    def found() -> Iterator[tuple[str, Stored]]:
        for i in range(0, len(keys), READ_BATCH):
            yield from read_values(store, keys[i:i + READ_BATCH])

    return decode_all(found())


def fleet_facts(dep: Deployment, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """For ``health``: this host's record (computed, not written) against the live records
    of the namespace. Never raises; ``error`` says what could not be read."""

    out: dict[str, Any] = {"host_id": "", "record_key": "", "serde": dep.settings.serde,
                           "serde_key_fingerprint": "", "others": [], "conflicts": [],
                           "problems": [], "error": ""}
    try:
        own = own_record(dep)
    except KvpError as exc:
        return {**out, "error": f"own serde key unreadable: {exc}"}
    out.update(host_id=own.host_id, record_key=own.key,
               serde_key_fingerprint=own.serde_key_fingerprint)
    try:
        store = _connect(host_of(dep), timeout)
    except KvpError as exc:
        return {**out, "error": str(exc)}
    try:
        records, problems = read_namespace(store, dep.namespace)
    except store_errors() as exc:
        return {**out, "error": str(exc)}
    finally:
        with contextlib.suppress(*store_errors()):
            store.close()
    now = time.time()
    others = sorted((r for r in records if r.host_id != own.host_id), key=lambda r: r.host_id)
    out.update(others=host_rows(others, now),
               conflicts=host_rows(key_conflicts(own, others), now), problems=problems)
    return out
