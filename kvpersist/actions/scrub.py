"""Use case: zero the padding after each chunk file's aesgcm frame (``apply``), or count it."""

from __future__ import annotations

from collections.abc import Callable

from kvpersist.config.loader import load_deployment
from kvpersist.errors import UsageError
from kvpersist.l2.frames import max_chunk_file_bytes
from kvpersist.l2.inventory import open_existing
from kvpersist.l2.keys.store import namespace_keys
from kvpersist.l2.scrub import ScrubResult, scrub_root
from kvpersist.l2.verify import frame_store
from kvpersist.system.files import service_uids


def scrub(config: str, *, apply: bool = False, since_ns: int | None = None,
          progress: Callable[[int, int], None] | None = None) -> ScrubResult:
    """Load ``config``, read its namespace's serde key (the one verify authenticates it
    with) and scrub the padding of its namespace's chunk
    files (only those modified at or after ``since_ns`` when given). The identities of the
    frames it authenticates are judged against the namespace's frame record and learned
    (``moved``: held under another chunk's name; ``verify --apply`` quarantines them).

    Raises ConfigError for a config that does not load, UsageError for a deployment without
    the aesgcm serde (nothing to scrub: its files hold the KV in clear), KvpError for an
    unreadable key or root."""
    dep = load_deployment(config, allow_unpinned=True)
    s = dep.settings
    if s.serde != "aesgcm":
        raise UsageError(f"{config}: KVP_L2_SERDE is {s.serde!r}: the chunk files hold the KV "
                         "in clear, there is no padding to scrub (set KVP_L2_SERDE=aesgcm)")
    key, _ = namespace_keys(s.state_dir, dep.namespace, s.serde_key_file,
                            service_uids(s.service_user))
    with open_existing(s.cache_root, purpose="scrub") as root:
        record, refused = frame_store.load(root, dep.namespace)
        res = scrub_root(root, dep.namespace, key, apply=apply, since_ns=since_ns,
                         progress=progress,
                         max_bytes=max_chunk_file_bytes(dep.identity_values,
                                                        dep.generic.chunk_size),
                         record=record)
        _, unwritten = frame_store.save(root, record)
    res.warnings.extend(w for w in (refused, unwritten) if w)
    return res
