"""The pin manifest of a namespace: which chunk files are its warm set (pure).

``kvp-admin warmup`` computes, with LMCache's own key code, the chunk files every session of
the deployment needs first, and records them in ``<root>/.kvpersist/pins/<namespace>.json``
(``kvpersist.pins/1``). The read-only commands use it without importing lmcache:
``prune --to-budget`` and ``--stale`` never select a pinned file, ``report`` counts pinned
files and bytes per namespace, ``verify`` checks them first. A pin is kvpersist's own: LMCache's
in-process L2 LRU does not know it (docs/warm-restart.md says how to size the budget so the
server need not evict them).

Nothing here touches the filesystem.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from kvpersist.l2.layout import is_shard_dir_name, parse_chunk_name

SCHEMA = "kvpersist.pins/1"
PINS_DIR = "pins"
#: a pin manifest bigger than this is not ours (~130,000 pinned files: about what a 16 MiB
#: warm set pins at 256-token chunks and 8 ranks); what it costs once parsed stays far below
#: 512 MiB
MAX_BYTES = 16 << 20
#: a pin manifest holds one object and one array (file names hold no brackets)
MAX_CONTAINERS = 8


@dataclass(frozen=True)
class PinSet:
    """The pinned chunk files of one namespace (paths relative to the cache root)."""

    namespace: str
    warm_file_sha256: str
    files: frozenset[str]
    #: why the manifest could not be read ("" when it could): then ``files`` is empty and
    #: the namespace is held whole (:attr:`held`)
    unreadable: str = ""

    @property
    def names(self) -> frozenset[str]:
        """The file names alone (a chunk's name is unique in its root, sharded or not)."""
        return frozenset(f.rsplit("/", 1)[-1] for f in self.files)

    @property
    def held(self) -> bool:
        """Every file of the namespace counts as pinned (its manifest is unreadable)."""
        return bool(self.unreadable)


def held_set(namespace: str, why: str) -> PinSet:
    """The pins of a namespace whose manifest cannot be read: all of its files."""
    return PinSet(namespace, "", frozenset(), why)


@dataclass(frozen=True)
class PinRead:
    """What :func:`kvpersist.l2.pins.store.read_pins` found on a root: the pins by namespace
    (held ones included), the problems met (each names its file), and why the pins directory
    could not be listed ("" when it could: then every namespace is held)."""

    pins: Mapping[str, PinSet]
    problems: tuple[str, ...] = ()
    unreadable_dir: str = ""

    @property
    def names(self) -> frozenset[str]:
        """Every pinned file name (:func:`all_names`)."""
        return all_names(self.pins.values())

    @property
    def held(self) -> frozenset[str]:
        """The namespaces held whole (their manifest is unreadable)."""
        return frozenset(ns for ns, p in self.pins.items() if p.held)

    def holds(self, namespace: str) -> bool:
        """Whether every file of ``namespace`` counts as pinned."""
        if self.unreadable_dir:
            return True
        p = self.pins.get(namespace)
        return p is not None and p.held


def pins_name(namespace: str) -> str:
    """The manifest's file name in ``.kvpersist/pins/``."""
    return f"{namespace}.json"


def relpath_problem(rel: str, namespace: str) -> str:
    """Why ``rel`` is not a chunk file of ``namespace`` at its place in the root, or ''."""
    parts = rel.split("/")
    if len(parts) not in (1, 3):
        return f"{rel!r}: not a chunk file path (flat, or ab/cd/<name> with shard_dirs)"
    chunk = parse_chunk_name(parts[-1])
    if chunk is None:
        return f"{rel!r}: not an LMCache chunk file name"
    if chunk.prefix != namespace:
        return f"{rel!r}: belongs to {chunk.prefix}, not {namespace}"
    if len(parts) == 3 and (not all(is_shard_dir_name(p) for p in parts[:2])
                            or (parts[0], parts[1]) != chunk.shard()):
        return f"{rel!r}: not in its shard directory"
    return ""


def pin_document(namespace: str, warm_file_sha256: str, files: Sequence[str], *,
                 world_size: int, chunk_size: int, hash_algorithm: str, shard_dirs: bool,
                 chunks: int, created_ns: int) -> dict[str, Any]:
    """The pin manifest of ``namespace``. Raises ValueError for a file that is not one of the
    namespace's chunk files (the key code and the layout parser disagree)."""
    for rel in files:
        why = relpath_problem(rel, namespace)
        if why:
            raise ValueError(why)
    return {"schema": SCHEMA, "namespace": namespace, "warm_file_sha256": warm_file_sha256,
            "world_size": world_size, "chunk_size": chunk_size,
            "hash_algorithm": hash_algorithm, "shard_dirs": shard_dirs, "chunks": chunks,
            "created_ns": created_ns, "files": sorted(dict.fromkeys(files))}


def parse_pin_document(doc: Any, namespace: str) -> tuple[PinSet | None, str]:
    """The pins of ``namespace`` from a parsed manifest, or (None, why it is not one).
    A manifest naming any file that is not the namespace's chunk file is refused whole."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        return None, "not a kvpersist pin manifest"
    if doc.get("namespace") != namespace:
        return None, f"names namespace {doc.get('namespace')!r}, not {namespace}"
    files = doc.get("files")
    sha = doc.get("warm_file_sha256")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files) \
            or not _is_sha256(sha):
        return None, "malformed (files, warm_file_sha256)"
    for rel in files:
        why = relpath_problem(rel, namespace)
        if why:
            return None, why
    return PinSet(namespace, sha, frozenset(files)), ""


def _is_sha256(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and len(value) == 64 and all(
        c in "0123456789abcdef" for c in value)


@dataclass(frozen=True)
class PinnedUsage:
    """What the pinned files of one namespace hold on disk (measured by a stat of each)."""

    files: int = 0
    bytes: int = 0
    missing: int = 0
    #: last use (max of mtime and atime) bucket -> [files, bytes], as the scan's histogram
    use_hist: Mapping[int, Sequence[int]] | None = None
    #: write time (mtime) bucket -> [files, bytes], as the scan's ``write_hist``
    write_hist: Mapping[int, Sequence[int]] | None = None

    def to_dict(self) -> dict[str, int]:
        return {"files": self.files, "bytes": self.bytes, "missing": self.missing}


@dataclass(frozen=True)
class Unpinned:
    """A namespace's usage less its pinned files: what retention may choose from.

    Satisfies :class:`kvpersist.l2.retention.UsageView`."""

    files: int
    bytes: int
    use_hist: dict[int, list[int]]
    last_use_ns: int


def without_pins(files: int, nbytes: int, use_hist: Mapping[int, Sequence[int]],
                 last_use_ns: int, pinned: PinnedUsage) -> Unpinned:
    """Subtract ``pinned`` (measured at the same time) from a prefix's scan figures. Counts
    never go below zero (a file may have changed between the scan and the stat)."""
    hist = {b: [int(v[0]), int(v[1])] for b, v in use_hist.items()}
    for b, (f, n) in (pinned.use_hist or {}).items():
        h = hist.get(b)
        if h is None:
            continue
        h[0] = max(0, h[0] - int(f))
        h[1] = max(0, h[1] - int(n))
        if not h[0]:
            del hist[b]
    return Unpinned(max(0, files - pinned.files), max(0, nbytes - pinned.bytes), hist,
                    last_use_ns)


def all_names(pins: Iterable[PinSet]) -> frozenset[str]:
    """Every pinned file name of several namespaces."""
    out: set[str] = set()
    for p in pins:
        out |= p.names
    return frozenset(out)
