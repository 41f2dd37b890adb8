"""Use case: find chunk files that can never be valid; quarantine with ``apply``."""

from __future__ import annotations

from collections.abc import Callable

from kvpersist.config.loader import load_deployment
from kvpersist.l2.frames import MAX_CHUNK_FILE_BYTES, max_chunk_file_bytes
from kvpersist.l2.inventory import open_existing
from kvpersist.l2.keys import store as keys
from kvpersist.l2.pins.store import read_pins
from kvpersist.l2.runs import record_run
from kvpersist.l2.verify import frame_store
from kvpersist.l2.verify.frame_store import FrameSummary
from kvpersist.l2.verify.root import VerifyResult, verify_root
from kvpersist.system.files import service_uids


def verify(config: str, *, apply: bool = False, all_namespaces: bool = False,
           rate_mb_s: float | None = 200.0, temp_age: float = 600.0,
           progress: Callable[[int, int], None] | None = None) -> VerifyResult:
    """Load ``config``, read its serde key (aesgcm) and verify its cache root; with aesgcm,
    against the namespace's frame record too, which it then writes (what it learned, in a
    dry run as well: the record is kvpersist's, not the cache).

    Raises ConfigError for a config that does not load, KvpError for an unreadable key or
    root."""

    dep = load_deployment(config, allow_unpinned=True)
    s = dep.settings
    also = service_uids(s.service_user)
    key = key_for = None
    if s.serde == "aesgcm":
        key, key_for = keys.namespace_keys(s.state_dir, dep.namespace, s.serde_key_file, also)
    # a chunk file of the namespace past what its geometry allows is a finding, never read
    limit = max_chunk_file_bytes(dep.identity_values, dep.generic.chunk_size)
    with open_existing(s.cache_root, purpose="verify") as root:
        pins = read_pins(root)
        record, refused = (frame_store.load(root, dep.namespace) if s.serde == "aesgcm"
                           else (None, ""))
        res = verify_root(root, dep.namespace, serde=s.serde, key=key, apply=apply,
                          temp_age=temp_age, rate_mb_s=rate_mb_s or None,
                          all_namespaces=all_namespaces, progress=progress,
                          first=pins.names, key_for=key_for,
                          max_bytes_for=lambda p: limit if p == dep.namespace
                          else MAX_CHUNK_FILE_BYTES, record=record)
        res.warnings.extend(pins.problems)
        if refused:
            res.warnings.append(refused)
        if record is None:
            res.frames = FrameSummary(applies=False, reason=frame_store.SERDE_NONE)
        elif res.frames is not None:  # learned in a dry run too: the record is not the cache
            res.frames.record_bytes, unwritten = frame_store.save(root, record)
            res.warnings.extend(res.frames.warnings + ([unwritten] if unwritten else []))
        moved = sum(1 for f in res.findings if f.kind == "moved")
        left = len(res.findings) - (len(res.quarantined) if apply else 0)
        warning = record_run(root, "verify", ok=left == 0, mode="apply" if apply else "check",
                             counts={"files": res.files, "findings": len(res.findings),
                                     "quarantined": len(res.quarantined),
                                     "bytes_read": res.bytes_read, "moved": moved})
    if warning:
        res.warnings.append(warning)
    return res
