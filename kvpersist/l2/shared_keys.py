"""Keys and budget of the shared tier (pure).

LMCache's resp and valkey adapters store one string value per chunk under the wire key
``<model name>@<kv rank, 8 hex>@<group, hex>@<chunk hash, hex>[@<cache salt>]``; the model
name is the namespace. kvpersist's own keys on the store (prune locks) start with
``kvpersist-`` and never contain a namespace's ``@`` pattern.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvpersist.l2.layout import is_namespace

_WIRE = re.compile(r"(kvp-[0-9a-z-]{1,80})@[0-9a-f]{8}@[0-9a-f]+@[0-9a-f]+(@.*)?\Z", re.S)
LOCK_PREFIX = "kvpersist-lock:prune:"
#: the eviction policies that make a full store evict chunks (LMCache writes no TTL, so the
#: volatile-* policies behave like noeviction: a full store answers writes with an error)
EVICTING_POLICIES = ("allkeys-lru", "allkeys-lfu", "allkeys-random")


def namespace_of(key: str) -> str | None:
    """The namespace of a chunk key, or None for any other key."""
    m = _WIRE.match(key)
    return m.group(1) if m else None


def namespace_problem(ns: str) -> str:
    """Why ``ns`` cannot be pruned on the shared tier (must be a kvp namespace), or ''."""
    return "" if is_namespace(ns) else (
        f"{ns!r} is not a kvpersist namespace (kvp-<hex> or kvp-unpinned-<hex>)")


def match_pattern(ns: str) -> str:
    """The SCAN MATCH pattern of one namespace's chunk keys (``ns`` has no glob characters:
    see :func:`namespace_problem`)."""
    return f"{ns}@*"


def lock_key(ns: str) -> str:
    return f"{LOCK_PREFIX}{ns}"


@dataclass(frozen=True)
class StoreBudget:
    """The store's memory budget as read back (INFO memory / CONFIG GET), per node summed."""

    maxmemory_bytes: int
    used_memory_bytes: int
    policies: tuple[str, ...]
    nodes: int = 1
    problems: tuple[str, ...] = field(default=())
    warnings: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"maxmemory_bytes": self.maxmemory_bytes,
                "used_memory_bytes": self.used_memory_bytes,
                "eviction_policies": list(self.policies), "nodes": self.nodes,
                "problems": list(self.problems), "warnings": list(self.warnings)}


def plan_store_budget(maxmemory: list[int], used: list[int], policies: list[str]) -> StoreBudget:
    """Judge the store's per-node ``maxmemory`` and ``maxmemory-policy``.

    A problem (refused at launch): a policy that does not evict chunk keys — the store would
    answer writes with OOM errors instead of dropping the least recently used chunks. A
    warning: ``maxmemory 0`` (no limit: the store grows until the host swaps or the kernel
    kills it).
    """
    problems: list[str] = []
    warnings: list[str] = []
    bad = sorted({p for p in policies if p not in EVICTING_POLICIES})
    if bad:
        problems.append(f"maxmemory-policy {', '.join(bad)} does not evict chunk keys (LMCache "
                        "writes them without a TTL): a full store would refuse writes; set "
                        "maxmemory-policy allkeys-lru")
    if any(m == 0 for m in maxmemory):
        warnings.append("maxmemory 0 (unlimited) on some node: the store grows without bound; "
                        "set maxmemory to what the node may use for chunks")
    return StoreBudget(sum(maxmemory), sum(used), tuple(sorted(set(policies))),
                       len(policies), tuple(problems), tuple(warnings))
