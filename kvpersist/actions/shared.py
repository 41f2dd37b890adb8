"""Use cases on the shared tier: ``report --tier shared`` and ``prune --tier shared``.

The deployments (``--config``, default: every config under configs/ with a shared tier) name
the tier, its credentials and the namespaces active here; the fleet records on the store
(:mod:`kvpersist.l2.fleet.records`) name the namespaces other hosts serve. The same rules as
on disk: a dry run unless ``apply``, an active namespace (here or on any host) only with
``force``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpersist.config.deployment import Deployment
from kvpersist.config.loader import deployments_with_shared_tier
from kvpersist.config.shared_tier import SharedTier
from kvpersist.errors import KvpError, UsageError
from kvpersist.l2.fleet import host as fleet
from kvpersist.l2.fleet.records import FleetRecord, by_namespace, describe_hosts, host_rows
from kvpersist.l2.shared.credentials import read_secret_file
from kvpersist.l2.shared.store import (
    SharedStore,
    connect,
    describe,
    prune_namespace,
    store_errors,
    usage,
)
from kvpersist.l2.shared.wire import namespace_problem
from kvpersist.system.files import service_uids

REPORT_SCHEMA = "kvpersist.shared-report/1"
PRUNE_SCHEMA = "kvpersist.shared-prune/1"


@dataclass(frozen=True)
class SharedContext:
    tier: SharedTier
    deployments: tuple[Deployment, ...]
    active: frozenset[str]

    def connect(self) -> SharedStore:

        dep = self.deployments[0]
        secret = read_secret_file(dep.settings.shared_tier_secret_file,
                                  also=service_uids(dep.settings.service_user))
        return connect(self.tier, secret)


def shared_context(configs: Sequence[str]) -> SharedContext:
    """Load the deployments that use a shared tier. Raises UsageError when none does or they
    name different tiers, ConfigError for a config that does not load."""

    deps = deployments_with_shared_tier(configs)
    if not deps:
        raise UsageError("no deployment config has a shared tier; name one with --config")
    tiers = {d.shared for d in deps}
    if len(tiers) != 1:
        raise UsageError("the configs name different shared tiers; give --config for one")
    tier = tiers.pop()
    assert tier is not None
    return SharedContext(tier, tuple(deps), frozenset(d.namespace for d in deps))


def report_shared(configs: Sequence[str]) -> dict[str, Any]:
    """Per-namespace keys and bytes on the shared tier, the hosts whose fleet records name
    each namespace, and the store's budget as read back. A namespace is ``active`` when a
    config here uses it or any host has a live record of it. Raises KvpError when the store
    cannot be reached."""
    ctx = shared_context(configs)
    store = ctx.connect()
    try:
        budget = store.budget()
        found = usage(store)
        records, problems = fleet.read_keys(store, found.record_keys)  # no second scan
    except store_errors() as exc:  # failed, or answered what a store does not, mid-way
        raise KvpError(f"shared tier {ctx.tier.endpoint}: {describe(exc)}") from exc
    finally:
        _close(store)
    now = time.time()
    hosts = by_namespace(records)
    sizes = {ns: found.namespaces.get(ns, [0, 0]) for ns in {*found.namespaces, *hosts}}
    rows = [{"namespace": ns, "keys": n, "bytes": b,
             "active": ns in ctx.active or ns in hosts,
             "configured": ns in ctx.active, "hosts": host_rows(hosts.get(ns, []), now)}
            for ns, (n, b) in sorted(sizes.items(), key=lambda kv: (-kv[1][1], kv[0]))]
    return {"schema": REPORT_SCHEMA, "tier": ctx.tier.to_dict(), "store": budget.to_dict(),
            "namespaces": rows, "chunk_keys": sum(r["keys"] for r in rows),
            "chunk_bytes": sum(r["bytes"] for r in rows), "other_keys": found.other_keys,
            "fleet_records": found.fleet_records, "fleet_keys": found.fleet_keys,
            "skipped_keys": found.skipped.to_dict(),
            "fleet_record_problems": problems,
            "active": sorted(ctx.active)}


def active_reasons(namespaces: Sequence[str], configured: frozenset[str],
                   users: dict[str, list[FleetRecord]], now: float) -> list[str]:
    """Why each of ``namespaces`` is active (pure): a deployment configured here uses it,
    or a host has a live fleet record of it (named, with the age of its record)."""
    out = []
    for ns in namespaces:
        why = []
        if ns in configured:
            why.append("a deployment configured here uses it")
        if users.get(ns):
            why.append(f"{len(users[ns])} host(s) serve it: "
                       f"{describe_hosts(users[ns], now)}")
        if why:
            out.append(f"{ns} is active ({'; '.join(why)})")
    return out


def prune_shared(configs: Sequence[str], namespaces: Sequence[str], *, apply: bool,
                 force: bool, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Delete (``apply``) or count the chunk keys of ``namespaces`` on the shared tier.
    Raises UsageError for a bad or active (without ``force``) namespace, CheckFailed when
    another host holds a namespace's lock, KvpError when the store cannot be reached."""
    if not namespaces:
        raise UsageError("on the shared tier, name what to delete with --namespace NS")
    for ns in namespaces:
        problem = namespace_problem(ns)
        if problem:
            raise UsageError(f"--namespace: {problem}")
    ctx = shared_context(configs)
    store = ctx.connect()
    try:
        wanted = list(dict.fromkeys(namespaces))
        users = {ns: fleet.read_namespace(store, ns)[0] for ns in wanted}
        if not force:
            refused = active_reasons(wanted, ctx.active, users, time.time())
            if refused:
                raise UsageError("; ".join(refused) + ". Add --force to delete the keys on "
                                 "the shared tier anyway")
        results = [prune_namespace(store, ns, apply=apply, progress=progress)
                   for ns in wanted]
    except store_errors() as exc:  # failed, or answered what a store does not, mid-way
        raise KvpError(f"shared tier {ctx.tier.endpoint}: {describe(exc)}; run it again "
                       "once the store answers (what was deleted stays deleted)") from exc
    finally:
        _close(store)
    return {"schema": PRUNE_SCHEMA, "tier": ctx.tier.to_dict(), "dry_run": not apply,
            "namespaces": [r.to_dict() for r in results],
            "deleted_keys": sum(r.keys for r in results),
            "deleted_bytes": sum(r.bytes for r in results)}


def _close(store: SharedStore) -> None:
    """Close ``store``; a store that fails even that is already reported."""
    with contextlib.suppress(*store_errors()):
        store.close()
