"""Use case: crypto-shred one namespace (``kvp-admin shred``; docs/keys-and-shred.md).

Order, with ``apply``: (1) destroy the namespace's key (overwrite, fsync, unlink) in every
state dir of the root, and the root key when the namespace was migrated and no other
namespace uses it; (2) write a tombstone beside it, so a later launch creates a new key and
never adopts the root key again; (3) remove the data as ``prune --namespace NS`` does, on the
shared tier too when the configs name one. Once (1) is done every file and shared-tier key
of the namespace fails authentication, whatever survives (2) and (3). A dry run does
nothing and reports all three. Refusals (an active namespace without ``force``, a key set
by the operator's ``KVP_SERDE_KEY_FILE``) come before step (1).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from kvpersist.actions.prune import PruneRequest
from kvpersist.actions.tiers import TierPrune, prune_tiers
from kvpersist.config.key_paths import (
    is_namespace_key,
    namespace_dir_problem,
    namespace_key_path,
    root_key_path,
)
from kvpersist.config.loader import LEGACY_STATE_ENTRIES
from kvpersist.errors import EXIT_OK, UsageError
from kvpersist.l2.inventory import Inventory, open_existing, resolve_inventory, scan
from kvpersist.l2.keys import store as keys
from kvpersist.l2.keys.plan import ShredKeyPlan, plan_shred_keys, root_key_users
from kvpersist.l2.layout import MANIFESTS_DIR
from kvpersist.system.files import service_uids

SCHEMA = "kvpersist.shred/1"


@dataclass
class ShredOutcome:
    """What shred did (or would do): the key plans, each step in the order it ran, the
    prune of the data."""

    namespace: str
    dry_run: bool
    tier: str
    key_plans: list[ShredKeyPlan] = field(default_factory=list)
    destroyed: list[keys.DestroyedKey] = field(default_factory=list)
    tombstones: list[str] = field(default_factory=list)
    #: (step, time in ns) in the order they ran: "keys", "tombstone", "data"
    steps: list[tuple[str, int]] = field(default_factory=list)
    prune: TierPrune | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """1 when a file could not be deleted, else 0."""
        return self.prune.exit_code if self.prune is not None else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        prune = self.prune.to_dict() if self.prune is not None else None
        return {"schema": SCHEMA, "namespace": self.namespace, "dry_run": self.dry_run,
                "tier": self.tier,
                "keys": [p.to_dict() for p in self.key_plans],
                "keys_to_destroy": [k for p in self.key_plans for k in p.destroy],
                "destroyed": [d.to_dict() for d in self.destroyed],
                "tombstones": self.tombstones,
                "steps": [{"step": s, "at_ns": t} for s, t in self.steps],
                "data": prune, "warnings": self.warnings,
                "exit_code": self.exit_code}


def state_dirs(inv: Inventory) -> list[str]:
    """The state dirs whose keys belong to the root: each configured deployment's, the
    default one beside the root if it exists, and kvpersist 0.1's inside the root only when
    it holds 0.1's state (``keys``, ``manifests`` or ``models``). The root's own metadata
    directory (``<root>/.kvpersist``: pins, the prune lock, runs) is not a state dir: a
    tombstone written there would make the loader take it for 0.1's state and move every
    deployment of the root onto it."""
    root = PurePosixPath(inv.root)
    # a deployment never launched has no state dir: nothing to destroy, none to create
    dirs = {d.settings.state_dir for d in inv.deployments if os.path.isdir(d.settings.state_dir)}
    beside = root.parent / ".kvpersist" / root.name
    if os.path.isdir(beside):
        dirs.add(str(beside))
    inside = root / ".kvpersist"
    if any(os.path.lexists(inside / e) for e in LEGACY_STATE_ENTRIES):
        dirs.add(str(inside))
    return sorted(dirs)


def present_namespaces(state_dir: str, on_root: set[str]) -> set[str]:
    """The namespaces with files at the root (``on_root``) or a manifest in ``state_dir``."""
    try:
        names = os.listdir(os.path.join(state_dir, MANIFESTS_DIR))
    except OSError:
        names = []
    return on_root | {n[:-len(".json")] for n in names
                      if n.endswith(".json") and not namespace_dir_problem(n[:-5])}


def plan_keys(namespace: str, inv: Inventory, on_root: set[str],
              also: tuple[int, ...]) -> list[ShredKeyPlan]:
    """The key plan of ``namespace`` in every state dir of the root (reads the keys)."""
    plans = []
    for sd in state_dirs(inv):
        have = keys.state_keys(sd, also)
        own = namespace_key_path(sd, namespace)
        own_fp = have.fingerprints.get(namespace)
        users = root_key_users(namespace, have.root_fp, have.fingerprints, have.tombstoned,
                               present_namespaces(sd, on_root))
        plans.append(plan_shred_keys(
            namespace, sd, own_key=own if os.path.lexists(own) else None, own_fp=own_fp,
            root_key=root_key_path(sd) if have.root_fp is not None else None,
            root_fp=have.root_fp, users=users, shredded=namespace in have.tombstoned))
    return plans


def shred(namespace: str, root: str | None, configs: Sequence[str], *, apply: bool = False,
          force: bool = False,
          between: Callable[[ShredOutcome], None] | None = None) -> ShredOutcome:
    """Shred ``namespace`` (``apply``) or report what would go (dry run).

    ``between`` is called after the keys are destroyed and the tombstones written, before
    any data is removed. Raises UsageError for a name that is not a namespace, an active
    namespace without ``force``, or a key set by ``KVP_SERDE_KEY_FILE``; KeyError_ when a key
    cannot be destroyed (nothing else is done then); what prune raises."""
    problem = namespace_dir_problem(namespace)
    if problem:
        raise UsageError(f"--namespace: {problem}")
    inv = resolve_inventory(root, configs)
    if namespace in inv.active and not force:
        raise UsageError(f"{namespace} is the active namespace of a deployment on this root "
                         "(a configured deployment serves it): stop it first, or add --force")
    mine = [d for d in inv.deployments if d.namespace == namespace]
    explicit = [d for d in mine if d.settings.serde == "aesgcm" and not is_namespace_key(
        d.settings.state_dir, namespace, d.settings.serde_key_file)]
    if explicit:
        raise UsageError(f"{explicit[0].name} sets KVP_SERDE_KEY_FILE "
                         f"({explicit[0].settings.serde_key_file}): that key is the "
                         "operator's; destroy it at its source, then run `kvp-admin prune "
                         f"--namespace {namespace} --apply`")
    also: tuple[int, ...] = ()
    for d in inv.deployments:
        if d.settings.service_user:
            also += service_uids(d.settings.service_user)
    with open_existing(inv.root) as handle:
        on_root = set(scan(handle).prefixes)
    tier = "all" if configs and all(d.settings.shared_tier for d in inv.deployments) \
        and inv.deployments else "local"
    out = ShredOutcome(namespace, not apply, tier, plan_keys(namespace, inv, on_root, also))
    req = PruneRequest(namespaces=(namespace,), force=force)
    if not apply:
        out.prune = prune_tiers(tier, root, configs, req, apply=False)
        return out
    for p in out.key_plans:
        for path in p.destroy:
            out.destroyed.append(keys.destroy_key(path, also))
    out.steps.append(("keys", time.time_ns()))
    for p in out.key_plans:
        out.tombstones.append(keys.write_tombstone(
            p.state_dir, namespace, [d for d in out.destroyed
                                     if os.path.dirname(d.path).startswith(p.state_dir)]))
    out.steps.append(("tombstone", time.time_ns()))
    if between is not None:
        between(out)
    out.prune = prune_tiers(tier, root, configs, req, apply=True)
    out.steps.append(("data", time.time_ns()))
    return out
