"""Remove one conversation's chunk keys from the shared tier (I/O on the store).

:func:`forget_keys` is given a connected :class:`~kvpersist.l2.shared.store.SharedStore`, the
namespace and the wire keys of a plan's keys. Only keys that parse as the namespace's chunk
keys (:func:`~kvpersist.l2.shared.wire.namespace_of`) are ever sent to the store; the others
are counted as foreign. The dry run asks each key's ``STRLEN`` (pipelined: a key of another
type answers ``WRONGTYPE`` and is foreign, never read); ``apply`` runs, per key, the script
``prune`` uses: delete it only if it is a string, in one step (no window between the check
and the delete). The cluster client routes each command by its key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpersist.l2.shared.store import (
    READ_BATCH,
    SharedStore,
    array,
    integer,
    is_wrong_type,
    raw_key,
    replies,
)
from kvpersist.l2.shared.wire import NOT_A_CHUNK, NOT_A_STRING, Skipped, namespace_of

#: delete a key only if it is a string (a chunk): {size, deleted}, {-1, 0} for another type
_UNLINK_STRING = ("local n = redis.pcall('strlen', KEYS[1]) "
                  "if type(n) ~= 'number' then return {-1, 0} end "
                  "return {n, redis.call('unlink', KEYS[1])}")


@dataclass
class KeysOutcome:
    """The shared tier: what was found and what was (or would be) deleted, in keys."""

    namespace: str
    dry_run: bool
    found_keys: int = 0
    found_bytes: int = 0
    deleted_keys: int = 0
    deleted_bytes: int = 0
    absent: int = 0
    kept_pinned_keys: int = 0
    kept_pinned_bytes: int = 0
    skipped: Skipped = field(default_factory=Skipped)

    def to_dict(self) -> dict[str, Any]:
        return {"found": {"keys": self.found_keys, "bytes": self.found_bytes},
                "deleted": {"keys": self.deleted_keys, "bytes": self.deleted_bytes},
                "kept_pinned": {"keys": self.kept_pinned_keys,
                                "bytes": self.kept_pinned_bytes},
                "absent": self.absent, "skipped_keys": self.skipped.to_dict()}


def _sizes(store: SharedStore, keys: list[str]) -> list[int | None]:
    """``STRLEN`` of each key (0: absent), None for a key of another type."""
    out: list[int | None] = []
    for i in range(0, len(keys), READ_BATCH):
        pipe = store.client.pipeline(transaction=False)
        for k in keys[i:i + READ_BATCH]:
            pipe.strlen(raw_key(k))
        out += [None if is_wrong_type(v) else integer(v, "STRLEN") for v in replies(pipe)]
    return out


def forget_keys(store: SharedStore, namespace: str, keys: Sequence[str], *, apply: bool,
                kept: Sequence[str] = ()) -> KeysOutcome:
    """Measure (and with ``apply`` delete) ``keys`` of ``namespace`` on the store; ``kept``
    (the pins a forget keeps) are measured only. Raises what the store raises
    (:func:`~kvpersist.l2.shared.store.store_errors`) when it cannot serve."""
    out = KeysOutcome(namespace, not apply)
    mine: list[str] = []
    for k in keys:
        if namespace_of(k) == namespace:
            mine.append(k)
        else:
            out.skipped.add(NOT_A_CHUNK, k)
    held = [k for k in kept if namespace_of(k) == namespace]
    for size in _sizes(store, held):
        if size:
            out.kept_pinned_keys += 1
            out.kept_pinned_bytes += size
    if not apply:
        for k, size in zip(mine, _sizes(store, mine), strict=True):
            if size is None:
                out.skipped.add(NOT_A_STRING, k)
            elif size:
                out.found_keys += 1
                out.found_bytes += size
            else:
                out.absent += 1
        return out
    for i in range(0, len(mine), READ_BATCH):
        batch = mine[i:i + READ_BATCH]
        pipe = store.client.pipeline(transaction=False)
        for k in batch:
            # execute_command: redis-py's cluster pipeline has no eval(), but routes an EVAL
            # by its key like any command
            pipe.execute_command("EVAL", _UNLINK_STRING, 1, raw_key(k))
        for k, r in zip(batch, replies(pipe), strict=True):
            size, gone = array(r, "a script", ints=2)[:2]
            if size < 0:
                out.skipped.add(NOT_A_STRING, k)
            elif gone:
                out.found_keys += 1
                out.found_bytes += size
                out.deleted_keys += 1
                out.deleted_bytes += size
            else:
                out.absent += 1
    return out
