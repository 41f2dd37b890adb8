"""Which key a namespace uses at launch, and what ``shred`` destroys (pure: facts in, a
frozen plan out; docs/keys-and-shred.md).

At launch (:func:`plan_launch_key`), in this order:

1. ``KVP_SERDE_KEY_FILE`` set by the operator: that file, as given (created if missing);
2. the namespace has its own key: it is used;
3. the namespace was shredded (a tombstone): a new key is created and the root key is
   never adopted again, so files the shred could not reach (copies, the shared tier's
   replicas) stay unreadable;
4. a root key (kvpersist before per-namespace keys) exists and the namespace has files at
   the root, or a manifest (it was launched before), or no launch has recorded the root
   key's fingerprint yet (it was installed for the deployments of this state dir, e.g. by
   the Ansible role's ``serde_key_b64``): the namespace adopts it (a 0600 copy), so every
   chunk it wrote stays readable;
5. otherwise: a new key, 32 random bytes.

For ``shred`` (:func:`plan_shred_keys`): the namespace's own key is destroyed; the root key
too, when the namespace uses it (a migrated namespace) and no other namespace does. Other
namespaces use the root key when their own key is a copy of it (same fingerprint), or when
they have files or a manifest but no key of their own and no tombstone (they would adopt it
at their next launch).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any

USE, ADOPT, CREATE, EXPLICIT = "use", "adopt", "create", "explicit"


@dataclass(frozen=True)
class LaunchKeyFacts:
    """What launch knows about one namespace's key (gathered by the I/O layer)."""

    explicit: bool  # KVP_SERDE_KEY_FILE set by the operator
    own_key: bool  # <state>/keys/<ns>/l2-master.key exists
    shredded: bool  # <state>/keys/<ns>/shredded.json exists
    root_key: bool  # <state>/keys/l2-master.key exists
    has_files: bool  # chunk files of the namespace at the cache root
    has_manifest: bool  # <state>/manifests/<ns>.json (launched before)
    root_fingerprint_recorded: bool  # <state>/keys/l2-master.key.fingerprint


@dataclass(frozen=True)
class LaunchKeyPlan:
    """``action``: use / adopt / create / explicit, and why (one sentence)."""

    action: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"action": self.action, "reason": self.reason}


def plan_launch_key(f: LaunchKeyFacts) -> LaunchKeyPlan:
    """The key decision of a launch (the rules in the module docstring)."""
    if f.explicit:
        return LaunchKeyPlan(EXPLICIT, "KVP_SERDE_KEY_FILE is set: that key is used as is")
    if f.own_key:
        return LaunchKeyPlan(USE, "the namespace's own key")
    if f.shredded:
        return LaunchKeyPlan(CREATE, "the namespace was shredded: a new key (files written "
                             "under the destroyed key are misses; the root key is never "
                             "adopted again)")
    if f.root_key and f.has_files:
        return LaunchKeyPlan(ADOPT, "its files at the cache root were written with the root "
                             "key: adopted (a copy), so they stay readable")
    if f.root_key and f.has_manifest:
        return LaunchKeyPlan(ADOPT, "it was launched before with the root key: adopted "
                             "(a copy), so its chunks (here or on the shared tier) stay "
                             "readable")
    if f.root_key and not f.root_fingerprint_recorded:
        return LaunchKeyPlan(ADOPT, "the root key was installed for this state dir and no "
                             "launch used it yet: adopted (a copy)")
    return LaunchKeyPlan(CREATE, "a new namespace: its own new key")


@dataclass(frozen=True)
class ShredKeyPlan:
    """What shred does to the keys of ``namespace`` under one state dir."""

    namespace: str
    state_dir: str
    #: the key files to destroy, in order (the namespace's own key, then the root key)
    destroy: tuple[str, ...]
    #: the namespace's key is (a copy of) the root key
    migrated: bool
    #: other namespaces that still use the root key (then it is kept)
    root_key_users: tuple[str, ...] = ()
    #: the root key that stays because of ``root_key_users`` ('' when none stays)
    root_key_kept: str = ""
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "state_dir": self.state_dir,
                "destroy": list(self.destroy), "migrated": self.migrated,
                "root_key_users": list(self.root_key_users),
                "root_key_kept": self.root_key_kept, "notes": list(self.notes)}


def root_key_users(namespace: str, root_fp: str | None, key_fps: Mapping[str, str],
                   tombstoned: Set[str], present: Set[str]) -> tuple[str, ...]:
    """The namespaces other than ``namespace`` that use the root key of fingerprint
    ``root_fp``: their own key is a copy of it (``key_fps``: namespace -> fingerprint of its
    own key), or they are ``present`` (files or a manifest) with no key of their own and no
    tombstone, and would adopt it at their next launch."""
    if root_fp is None:
        return ()
    users = {ns for ns, fp in key_fps.items() if fp == root_fp}
    users |= {ns for ns in present if ns not in key_fps and ns not in tombstoned}
    return tuple(sorted(users - {namespace}))


def plan_shred_keys(namespace: str, state_dir: str, *, own_key: str | None,
                    own_fp: str | None, root_key: str | None, root_fp: str | None,
                    users: tuple[str, ...], shredded: bool) -> ShredKeyPlan:
    """What to destroy for ``namespace`` under ``state_dir``: ``own_key`` (its path, or None
    when it has none) with fingerprint ``own_fp``; ``root_key`` (path or None) with
    ``root_fp``; ``users``: :func:`root_key_users`; ``shredded``: a tombstone exists."""
    migrated = root_fp is not None and (own_fp == root_fp or (own_key is None
                                                              and not shredded))
    destroy = [own_key] if own_key else []
    notes: list[str] = []
    kept = ""
    if migrated and root_key:
        if users:
            kept = root_key
            notes.append(f"{namespace} uses the root key {root_key}, which "
                         f"{len(users)} other namespace(s) use too ({', '.join(users[:5])}"
                         f"{'...' if len(users) > 5 else ''}): it is kept, so a copy of "
                         f"{namespace}'s chunks (a backup, a flash page, a shared-tier "
                         "replica) stays readable by whoever holds that key until the last "
                         "of them is shredded")
        else:
            destroy.append(root_key)
            notes.append(f"no other namespace uses the root key {root_key}: it is destroyed "
                         "too")
    if not destroy:
        notes.append(f"{namespace} has no key under {state_dir}"
                     + (" (already shredded)" if shredded else ""))
    return ShredKeyPlan(namespace, state_dir, tuple(destroy), migrated, users, kept,
                        tuple(notes))
