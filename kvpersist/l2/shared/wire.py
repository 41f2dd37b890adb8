"""Keys and budget of the shared tier (pure).

LMCache's resp and valkey adapters store one string value per chunk under the wire key
``<model name>@<kv rank, 8 hex>@<group, hex>@<chunk hash, hex>[@<cache salt>]``; the model
name is the namespace. kvpersist's own keys on the store (prune locks) start with
``kvpersist-`` and never contain a namespace's ``@`` pattern.

A key is what its name says only if its type agrees: a chunk-named key that is a list, hash
or set, a fleet record that is a hash, an index that is not a set is *foreign* — counted
(:class:`Skipped`), shown escaped, never read as what it is not, never deleted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvpersist.l2.layout import display_name, is_namespace

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


#: how many keys of each kind :class:`Skipped` names (the others are counted)
SKIPPED_SHOWN = 10
#: the kinds of skipped keys
NOT_A_STRING = "chunk-named key of another type than a string"
NOT_A_CHUNK = "matches the namespace's pattern but is not a chunk key"


@dataclass
class Skipped:
    """Keys skipped as foreign, per kind: how many, and the first :data:`SKIPPED_SHOWN`
    (as the store holds them, bytes that are not UTF-8 kept by ``surrogateescape``;
    :func:`skipped_lines` escapes them with :func:`~kvpersist.l2.layout.display_name`)."""

    kinds: dict[str, list[Any]] = field(default_factory=dict)  # kind -> [count, [names]]

    def add(self, kind: str, key: str) -> None:
        entry = self.kinds.setdefault(kind, [0, []])
        entry[0] += 1
        if len(entry[1]) < SKIPPED_SHOWN:
            entry[1].append(key)

    @property
    def count(self) -> int:
        return sum(int(n) for n, _ in self.kinds.values())

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count,
                "kinds": {k: {"count": n, "first": list(names)}
                          for k, (n, names) in sorted(self.kinds.items())}}



def skipped_lines(doc: dict[str, Any]) -> list[str]:
    """One line per kind of a :meth:`Skipped.to_dict`: ``3 <kind> skipped (never touched):
    a, b, c and N more`` (pure)."""
    out = []
    for kind, entry in sorted((doc.get("kinds") or {}).items()):
        n, names = int(entry["count"]), list(entry["first"])
        more = f" and {n - len(names):,} more" if n > len(names) else ""
        out.append(f"{n:,} keys skipped as foreign ({kind}; never touched): "
                   f"{', '.join(display_name(str(k)) for k in names)}{more}")
    return out


def bounded(items: list[str], limit: int = SKIPPED_SHOWN) -> list[str]:
    """The first ``limit`` of ``items`` and, when there are more, a last line counting them
    (pure)."""
    if len(items) <= limit:
        return list(items)
    return [*items[:limit], f"... and {len(items) - limit} more"]


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
