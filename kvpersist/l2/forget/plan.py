"""What ``kvp-admin forget`` removes, tier by tier: the plan, pure.

Given the chunk keys of a conversation (computed with LMCache's own key code by
:mod:`kvpersist.stack.conversation.chunk_keys`: one key per complete chunk and TP rank,
object group 0)
and the namespace's warm-set pins, :func:`plan_forget` returns a frozen :class:`ForgetPlan`:
every key, which of them are pins (kept unless ``include_pinned``) and the targets. Every
key is parse-checked before it enters a plan: its file name must parse
(:func:`kvpersist.l2.layout.parse_chunk_name`) as a chunk of the namespace with the given
salt, in the shard directory its hash says, and its shared-tier key must parse as the
namespace's (:func:`kvpersist.l2.shared.wire.namespace_of`); anything else is refused, so a
disagreement between LMCache's naming and kvpersist's parser can never delete another file.

A key is the same chunk on every tier: its file on the NVMe (``relpath``), its wire key on
the shared tier (``wire_key``) and its object in the server's memory (:meth:`ChunkKey.encoded`,
the body of ``DELETE /cache/objects``).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpersist.l2.layout import display_name, parse_chunk_name
from kvpersist.l2.shared.wire import namespace_of

SCHEMA = "kvpersist.forget/1"


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """One chunk of one TP rank, as every tier names it."""

    #: the request (1-based, :func:`kvpersist.stack.conversation.input.conversation_requests`)
    #: that first holds the chunk, and the chunk's index in it
    request: int
    index: int
    kv_rank: int
    chunk_hash: str
    salt: str
    #: the file under the cache root (``<name>`` or ``ab/cd/<name>``)
    relpath: str
    #: the key on the shared tier
    wire_key: str

    @property
    def name(self) -> str:
        return posixpath.basename(self.relpath)

    def encoded(self, model_name: str) -> dict[str, Any]:
        """LMCache's ``EncodedObjectKey`` (the wire form of ``DELETE /cache/objects``)."""
        return {"chunk_hash_hex": self.chunk_hash, "model_name": model_name,
                "kv_rank": self.kv_rank, "object_group_id": 0, "cache_salt": self.salt}


@dataclass(frozen=True)
class ForgetPlan:
    """The chunks of one conversation in one namespace and which of them go."""

    namespace: str
    salt: str
    include_pinned: bool
    #: tokens of each request keyed (in order)
    request_tokens: tuple[int, ...]
    #: every distinct key, in request and chunk order (rank-minor)
    keys: tuple[ChunkKey, ...]
    #: the relpaths of ``keys`` that are warm-set pins of the namespace
    pinned: frozenset[str]
    #: why every key counts as pinned (the pin manifest cannot be read), or ""
    pins_held: str = ""

    def is_pinned(self, key: ChunkKey) -> bool:
        return bool(self.pins_held) or key.relpath in self.pinned

    @property
    def targets(self) -> tuple[ChunkKey, ...]:
        """The keys to remove from every tier."""
        if self.include_pinned:
            return self.keys
        return tuple(k for k in self.keys if not self.is_pinned(k))

    @property
    def kept(self) -> tuple[ChunkKey, ...]:
        """The pinned keys kept (none with ``include_pinned``)."""
        if self.include_pinned:
            return ()
        return tuple(k for k in self.keys if self.is_pinned(k))

    @property
    def chunks(self) -> int:
        """Distinct chunks (a chunk is one key per TP rank)."""
        return len({k.chunk_hash for k in self.keys})

    def to_dict(self) -> dict[str, Any]:
        pinned = [k for k in self.keys if self.is_pinned(k)]
        return {"requests": [{"request": i, "tokens": n}
                             for i, n in enumerate(self.request_tokens, start=1)],
                "chunks": self.chunks, "keys": len(self.keys),
                "pinned_keys": len(pinned),
                "pinned_chunks": len({k.chunk_hash for k in pinned}),
                "target_keys": len(self.targets), "kept_pinned_keys": len(self.kept),
                "pins_held": self.pins_held}


def key_problem(key: ChunkKey, namespace: str, salt: str) -> str:
    """Why ``key`` may not enter a plan of ``namespace`` with ``salt`` ('' when it may)."""
    chunk = parse_chunk_name(key.name)
    if chunk is None:
        return f"its file name {display_name(key.name)} does not parse"
    if chunk.prefix != namespace:
        return f"its file name {display_name(key.name)} is not of {namespace}"
    if (chunk.salt or "") != salt or chunk.chunk_hash != key.chunk_hash \
            or chunk.kv_rank != key.kv_rank or chunk.group != 0:
        return f"its file name {display_name(key.name)} names another key"
    if key.relpath not in (chunk.relpath(False), chunk.relpath(True)):
        return f"{display_name(key.relpath)} is not where LMCache keeps that chunk"
    if namespace_of(key.wire_key) != namespace:
        return f"its shared-tier key {display_name(key.wire_key)} is not of {namespace}"
    return ""


def plan_forget(namespace: str, keys: Iterable[ChunkKey], *, request_tokens: Sequence[int],
                salt: str = "", pinned: Iterable[str] = (), pins_held: str = "",
                include_pinned: bool = False) -> ForgetPlan:
    """The plan for ``keys`` (duplicates dropped, first kept) of ``namespace``: ``pinned``
    are the relpaths of the namespace's warm-set pins, ``pins_held`` why every file of it
    counts as pinned (its manifest is unreadable). Raises ValueError naming the first key
    that is not the namespace's (see the module docstring)."""
    seen: set[str] = set()
    out: list[ChunkKey] = []
    for k in keys:
        why = key_problem(k, namespace, salt)
        if why:
            raise ValueError(f"chunk {k.index} of request {k.request}: {why}")
        if k.relpath not in seen:
            seen.add(k.relpath)
            out.append(k)
    pins = frozenset(pinned) & seen
    return ForgetPlan(namespace, salt, include_pinned, tuple(request_tokens), tuple(out),
                      pins, pins_held)
