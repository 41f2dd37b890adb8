"""``kvp-admin fleet status`` (pure): per namespace, the hosts whose fleet records name it,
their serde-key agreement, the last health each recorded and their NVMe use.

Input: what the namespace's index named (:func:`kvpersist.l2.fleet.store.read_index`: each
member's host id and its record as stored, None when the record is gone), read without a
scan of the store. Each member is one row:

* ``live``: its record decodes (:func:`~kvpersist.l2.fleet.records.decode_record`) and is within its
  TTL by its own fields (``updated_at + ttl_s``);
* ``stale``: its record decodes but ``updated_at + ttl_s`` is past (the store still returned
  it: another clock, or a TTL the store did not apply); not counted as serving;
* ``gone``: the index names it but the store has no record (it lapsed; the next write of a
  record removes the member);
* a record that does not decode is foreign: no row, a problem (the first
  :data:`~kvpersist.l2.shared.wire.SKIPPED_SHOWN` named, the rest counted).

The live hosts of a namespace **agree** when they all have the same serde and key
fingerprint; **disagree** otherwise (chunks each side stores miss on the other); a namespace
without live hosts has ``none``; one whose index is not kvpersist's (another type, too many
members) is ``unknown`` (its records are not searched for: that would be a scan of the
store). The exit code is 1 when any namespace disagrees, else 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpersist.l2.fleet.records import FleetRecord, Stored, decode_record, record_key
from kvpersist.l2.shared.wire import SKIPPED_SHOWN

SCHEMA = "kvpersist.fleet-status/1"
STATES = ("live", "stale", "gone")
AGREEMENTS = ("agree", "disagree", "none", "unknown")


@dataclass(frozen=True)
class HostRow:
    """One member of a namespace's index: its state and its record (None when gone)."""

    host_id: str
    state: str  # one of STATES
    record: FleetRecord | None = None

    def to_dict(self, now: float) -> dict[str, Any]:
        r = self.record
        if r is None:
            return {"host_id": self.host_id, "state": self.state, "host": None,
                    "deployment": None, "version": None, "serde": None,
                    "serde_key_fingerprint": None, "updated_at": None, "age_s": None,
                    "expires_in_s": None, "since": None, "health": None, "nvme": None}
        return {"host_id": self.host_id, "state": self.state, "host": r.host,
                "deployment": r.deployment, "version": r.version, "serde": r.serde,
                "serde_key_fingerprint": r.serde_key_fingerprint,
                "updated_at": r.updated_at, "age_s": round(r.age_s(now), 1),
                "expires_in_s": round(r.expires_at() - now, 1), "since": r.since,
                "health": None if r.health is None else {
                    "status": r.health.status, "at": r.health.at,
                    "age_s": round(max(0.0, now - r.health.at), 1),
                    "canary": r.health.canary},
                "nvme": None if r.nvme is None else {
                    "files": r.nvme.files, "bytes": r.nvme.bytes, "at": r.nvme.at,
                    "age_s": round(max(0.0, now - r.nvme.at), 1)}}


@dataclass(frozen=True)
class NamespaceStatus:
    """One namespace: its rows (by host id), what kept rows out, and the agreement."""

    namespace: str
    rows: tuple[HostRow, ...]
    #: the deployments configured here that use the namespace ('' for --namespace only)
    configured: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    #: False: the index is not kvpersist's, its records were not read
    indexed: bool = True

    @property
    def live(self) -> list[FleetRecord]:
        return [r.record for r in self.rows if r.state == "live" and r.record is not None]

    def key_groups(self) -> dict[tuple[str, str], list[str]]:
        """(serde, fingerprint) -> host ids of the live records holding it."""
        out: dict[tuple[str, str], list[str]] = {}
        for r in self.live:
            out.setdefault((r.serde, r.serde_key_fingerprint), []).append(r.host_id)
        return out

    @property
    def agreement(self) -> str:
        if not self.indexed:
            return "unknown"
        groups = len(self.key_groups())
        return "none" if groups == 0 else "agree" if groups == 1 else "disagree"

    def to_dict(self, now: float) -> dict[str, Any]:
        return {"namespace": self.namespace, "configured": list(self.configured),
                "agreement": self.agreement,
                "fingerprints": [{"serde": serde, "serde_key_fingerprint": fp,
                                  "hosts": hosts}
                                 for (serde, fp), hosts in sorted(self.key_groups().items())],
                "live": len(self.live),
                "hosts": [r.to_dict(now) for r in self.rows],
                "problems": list(self.problems)}


def host_state(rec: FleetRecord, now: float) -> str:
    """``live`` or ``stale`` (past ``updated_at + ttl_s``) of a record that decoded (pure)."""
    return "stale" if rec.lapsed(now) else "live"


def namespace_status(namespace: str, members: Sequence[tuple[str, Stored]] | None,
                     now: float, *, configured: Sequence[str] = (),
                     index_problem: str = "", limit: int = SKIPPED_SHOWN) -> NamespaceStatus:
    """The status of ``namespace`` from its index's members (host id, stored record), or
    None when the index is not kvpersist's (``index_problem`` says why) (pure). Every
    stored value is decoded as untrusted; a foreign one is a problem, never a row."""
    problems = [index_problem] if index_problem else []
    if members is None:
        return NamespaceStatus(namespace, (), tuple(configured), tuple(problems), False)
    rows: list[HostRow] = []
    more = 0
    for host, raw in sorted(members, key=lambda m: m[0]):
        if raw is None:
            rows.append(HostRow(host, "gone"))
            continue
        rec, why = decode_record(record_key(namespace, host), raw)
        if rec is not None:
            rows.append(HostRow(host, host_state(rec, now), rec))
        elif len(problems) < limit + (1 if index_problem else 0):
            problems.append(why)
        else:
            more += 1
    if more:
        problems.append(f"... and {more:,} more")
    return NamespaceStatus(namespace, tuple(rows), tuple(configured), tuple(problems))


@dataclass(frozen=True)
class FleetStatus:
    """``kvp-admin fleet status`` (JSON schema ``kvpersist.fleet-status/1``)."""

    tier: dict[str, Any]
    namespaces: tuple[NamespaceStatus, ...]
    checked_at: float
    notes: tuple[str, ...] = field(default=())

    @property
    def agree(self) -> bool:
        return all(n.agreement != "disagree" for n in self.namespaces)

    @property
    def exit_code(self) -> int:
        """0: no namespace's live hosts disagree; 1: some do."""
        return 0 if self.agree else 1

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "tier": self.tier, "checked_at": self.checked_at,
                "namespaces": [n.to_dict(self.checked_at) for n in self.namespaces],
                "agree": self.agree,
                "disagree": [n.namespace for n in self.namespaces
                             if n.agreement == "disagree"],
                "exit_code": self.exit_code, "notes": list(self.notes)}
