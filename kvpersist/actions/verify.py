"""Use case: find chunk files that can never be valid; quarantine with ``apply``."""

from __future__ import annotations

import os
from collections.abc import Callable

from kvpersist.config.key_paths import is_namespace_key, root_key_path, tombstone_path
from kvpersist.config.loader import load_deployment
from kvpersist.l2 import keys
from kvpersist.l2.inventory import open_root
from kvpersist.l2.pin_store import read_pins
from kvpersist.l2.runs import record_run
from kvpersist.l2.verify import VerifyResult, verify_root
from kvpersist.system.files import service_uids


def verify(config: str, *, apply: bool = False, all_namespaces: bool = False,
           rate_mb_s: float | None = 200.0, temp_age: float = 600.0,
           progress: Callable[[int, int], None] | None = None) -> VerifyResult:
    """Load ``config``, read its serde key (aesgcm) and verify its cache root.

    Raises ConfigError for a config that does not load, KvpError for an unreadable key or
    root."""

    dep = load_deployment(config, allow_unpinned=True)
    s = dep.settings
    also = service_uids(s.service_user)
    key = key_for = None
    if s.serde == "aesgcm":
        key, key_for = namespace_keys(s.state_dir, dep.namespace, s.serde_key_file, also)
    with open_root(s.cache_root, purpose="verify") as root:
        pins = read_pins(root)
        res = verify_root(root, dep.namespace, serde=s.serde, key=key, apply=apply,
                          temp_age=temp_age, rate_mb_s=rate_mb_s or None,
                          all_namespaces=all_namespaces, progress=progress,
                          first=pins.names, key_for=key_for)
        res.warnings.extend(pins.problems)
        left = len(res.findings) - (len(res.quarantined) if apply else 0)
        warning = record_run(root, "verify", ok=left == 0, mode="apply" if apply else "check",
                             counts={"files": res.files, "findings": len(res.findings),
                                     "quarantined": len(res.quarantined),
                                     "bytes_read": res.bytes_read})
    if warning:
        res.warnings.append(warning)
    return res


def namespace_keys(state_dir: str, namespace: str, key_file: str, also: tuple[int, ...],
                   ) -> tuple[bytes, Callable[[str], bytes | None]]:
    """(``namespace``'s master key, the key of every namespace): its key file; for a
    namespace not launched since per-namespace keys (no key file of its own, no tombstone),
    the root key it will adopt (docs/keys-and-shred.md); other namespaces' own keys (or the
    root key) for ``--all-namespaces``. Raises KeyError_ when ``namespace`` has no key."""
    lookup = keys.key_lookup(state_dir, also)
    root = root_key_path(state_dir)
    if not is_namespace_key(state_dir, namespace, key_file) or os.path.lexists(key_file) \
            or os.path.lexists(tombstone_path(state_dir, namespace)) \
            or not os.path.lexists(root):
        own = keys.read_key(key_file, also)
    else:  # not launched since per-namespace keys: the root key it will adopt
        own = keys.read_key(root, also)

    def key_for(prefix: str) -> bytes | None:
        return own if prefix == namespace else lookup(prefix)

    return own, key_for
