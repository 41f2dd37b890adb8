"""Use case ``kvp-admin fleet status``: the fleet records of the namespaces this host knows,
read from the shared tier's store (I/O; the status itself is built by
:mod:`kvpersist.l2.fleet.status`).

Which namespaces: those of the deployments configured here that have a shared tier
(``--config``, default every config under configs/ with one; they must name one tier) and
every ``--namespace`` given. Each is read through its index (one bounded script, then one
bounded read per member), never by a scan of the store's keyspace. Nothing is written.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from kvpersist.config.loader import deployments_with_shared_tier
from kvpersist.errors import EXIT_USAGE, KvpError, UsageError
from kvpersist.l2.fleet.records import index_key
from kvpersist.l2.fleet.status import FleetStatus, NamespaceStatus, namespace_status
from kvpersist.l2.fleet.store import read_index
from kvpersist.l2.layout import display_name
from kvpersist.l2.shared.credentials import read_secret_file
from kvpersist.l2.shared.store import SharedStore, connect, describe, store_errors
from kvpersist.l2.shared.wire import namespace_problem
from kvpersist.system.files import service_uids


class StoreUnreachable(KvpError):
    """The shared tier's store did not answer, or refused the credentials (exit 2: nothing
    could be checked)."""

    exit_code = EXIT_USAGE


def fleet_status(configs: Sequence[str] = (), namespaces: Sequence[str] = (), *,
                 timeout: float = 3.0) -> FleetStatus:
    """The fleet status of the configured namespaces and ``namespaces``. Raises UsageError
    (a bad namespace, no config with a shared tier, configs naming different tiers),
    ConfigError, KvpError for an unusable secret file, StoreUnreachable when the store
    cannot be reached or fails while read."""
    for ns in namespaces:
        problem = namespace_problem(ns)
        if problem:
            raise UsageError(f"--namespace {display_name(ns)}: {problem}")
    deps = deployments_with_shared_tier(configs)
    if not deps:
        raise UsageError("no deployment config has a shared tier; name one with --config")
    tiers = {d.shared for d in deps}
    if len(tiers) != 1:
        raise UsageError("the configs name different shared tiers; give --config for one")
    tier = tiers.pop()
    assert tier is not None
    configured: dict[str, list[str]] = {}
    for d in deps:
        configured.setdefault(d.namespace, []).append(d.name)
    wanted = list(dict.fromkeys([*sorted(configured), *namespaces]))
    secret = read_secret_file(deps[0].settings.shared_tier_secret_file,
                              also=service_uids(deps[0].settings.service_user))
    try:
        store = connect(tier, secret, timeout)
    except KvpError as exc:
        raise StoreUnreachable(f"{exc}; nothing was checked") from exc
    try:
        found = [_read(store, ns, configured.get(ns, [])) for ns in wanted]
    except store_errors() as exc:
        raise StoreUnreachable(f"shared tier {tier.endpoint}: {describe(exc)}; nothing was "
                               "checked") from exc
    finally:
        with contextlib.suppress(*store_errors()):
            store.close()
    return FleetStatus(tier.to_dict(), tuple(found), time.time())


def _read(store: SharedStore, ns: str, configured: Sequence[str]) -> NamespaceStatus:
    """One namespace through its index (no scan). Raises what the store raises."""
    index = read_index(store, ns)
    now = time.time()
    problem = f"{display_name(index_key(ns))} {index.problem}" if index.problem else ""
    if index.members is None:
        problem += (" (not kvpersist's index): its hosts are not listed (no scan of the "
                    "store); delete that key (the next launch or health run writes the "
                    "index again)")
    return namespace_status(ns, index.members, now, configured=configured,
                            index_problem=problem)
