"""The weights fingerprint of a namespace (pure).

A namespace promises that every KV block under it was computed from the same bytes. The
identity names the model by id and revision; the fingerprint checks that the files at
``KVP_MODEL_PATH`` are still the ones the namespace was first served with.

What counts (:func:`counts`): the top-level files of the model directory that vLLM reads,
i.e. the weights (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``), every
``*.json`` (``config.json``, ``generation_config.json``, the tokenizer files, the safetensors
index, quantization and preprocessor configs, ``chat_template.json``, ``params.json``), chat
templates (``*.jinja``), tokenizer vocabularies (``*.model``, ``*.tiktoken``, ``*.txt``:
``tokenizer.model``, ``merges.txt``, ``vocab.txt``) and remote code (``*.py``, run with
``--trust-remote-code``). Hidden names and subdirectories do not count: vLLM's loaders and
transformers' tokenizer read the top level only. A ``KVP_MODEL_PATH`` that is a file (GGUF)
is that one file.

Per file the digest is the sha256 of its content, whatever layout it came from, so the same
bytes give the same fingerprint in a hub cache, a ``--local-dir`` download or a copy. The
fingerprint is the sha256 of the canonical JSON of the sorted ``[name, size, sha256]`` triples
(:func:`combine`).

Where a digest comes from (:func:`decide`): a cached digest whose file still has the same
(device, inode, size, mtime_ns, ctime_ns); else a digest the layout names (a hub blob named by
its sha256, a ``--local-dir`` download's recorded sha256 etag), trusted only at a path the
cache has never seen a file at, or for the same inode under a new name: a file changed in
place keeps its name, and a file replaced by rename (a new inode where the cache knew another)
is a new file whatever its name says; else the file is read.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpersist.errors import Problem

SCHEME = "kvpersist.weights/1"
#: weight formats vLLM loads
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: configs, tokenizer files, chat templates, remote code
OTHER_SUFFIXES = (".json", ".jinja", ".model", ".tiktoken", ".txt", ".py")
#: how a digest was obtained
SOURCES = ("cache", "hub-blob", "hf-metadata", "read")

_SHA256 = re.compile(r"[0-9a-f]{64}\Z")


def counts(name: str) -> bool:
    """True if a top-level file called ``name`` is part of the fingerprint."""
    return bool(name) and not name.startswith(".") and name.endswith(
        WEIGHT_SUFFIXES + OTHER_SUFFIXES)


def is_sha256(text: str) -> bool:
    """True for 64 lowercase hex digits (a sha256 as the hub writes it)."""
    return bool(_SHA256.match(text))


# --------------------------------------------------------------------------- per-file digests


@dataclass(frozen=True)
class StatKey:
    """What must not change for a cached digest to be reused. ``ctime_ns`` is there because
    a user cannot set it back: a file rewritten in place with its mtime restored is read
    again."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: Any) -> StatKey:
        """From an ``os.stat_result`` (or anything with the same attributes)."""
        return cls(int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns),
                   int(st.st_ctime_ns))

    def to_list(self) -> list[int]:
        return [self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns]

    @classmethod
    def from_list(cls, value: Any) -> StatKey:
        """Raises ValueError unless ``value`` is a list of five integers."""
        if (not isinstance(value, list) or len(value) != 5
                or not all(type(v) is int for v in value)):
            raise ValueError(f"bad stat key {value!r}")
        return cls(*value)


@dataclass(frozen=True)
class CacheEntry:
    """A digest computed (or taken from a name) earlier, for the file that had ``key``.
    ``named`` is the digest the layout named for that path when the entry was made (empty
    if none): a name is trusted again only when it differs from this one."""

    key: StatKey
    sha256: str
    source: str
    named: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key.to_list(), "sha256": self.sha256, "source": self.source,
                "named": self.named}

    @classmethod
    def from_dict(cls, data: Any) -> CacheEntry:
        """Raises ValueError for anything but an entry written by :meth:`to_dict`."""
        if not isinstance(data, dict):
            raise ValueError("not an object")
        sha, source, named = data.get("sha256"), data.get("source"), data.get("named", "")
        if not isinstance(sha, str) or not is_sha256(sha):
            raise ValueError(f"bad sha256 {sha!r}")
        if source not in SOURCES or source == "cache":
            raise ValueError(f"bad source {source!r}")
        if not isinstance(named, str) or (named and not is_sha256(named)):
            raise ValueError(f"bad named digest {named!r}")
        return cls(StatKey.from_list(data.get("key")), sha, source, named)


@dataclass(frozen=True)
class Decision:
    """How to get one file's digest: ``cache`` or ``named`` (``sha256`` given, no read) or
    ``read`` (hash the content)."""

    how: str
    sha256: str = ""
    source: str = ""


def decide(key: StatKey, cached: CacheEntry | None, named: str = "", named_source: str = "",
           *, rehash: bool = False, replaced: bool = False) -> Decision:
    """The cache-hit decision for one file whose stat is ``key``.

    ``cached`` is the entry kept for its (device, inode), ``named`` the sha256 its layout
    names (hub blob name or ``--local-dir`` metadata; empty if none) and ``named_source``
    where that came from. ``replaced``: the cache knew another (device, inode) at this path,
    so this is a new file put there (a copy renamed over it, its mtime perhaps restored):
    its name is not trusted, it is read. ``rehash`` ignores both cache and names.
    """
    if rehash:
        return Decision("read")
    if cached is not None and cached.key == key:
        return Decision("cache", cached.sha256, cached.source)
    if named and not replaced and (cached is None or cached.named != named):
        return Decision("named", named, named_source)
    return Decision("read")


def cache_id(key: StatKey) -> str:
    """Where a digest is kept in the cache: the file's device and inode, so that weights
    moved aside and restored (renamed, same inodes) still hit."""
    return f"{key.dev}:{key.ino}"


#: entries kept per path for files replaced there (another inode at the same path now)
KEEP_PER_PATH = 2
#: how long an entry whose path is gone is kept (weights moved aside may come back)
KEEP_GONE_S = 30 * 86400
#: at most this many entries in all (the most recently used win)
MAX_ENTRIES = 8192


def entries_to_keep(entries: Mapping[str, tuple[str, int, StatKey]], used: set[str],
                    now_at: Mapping[str, StatKey | None], now: int) -> set[str]:
    """Which cache entries to keep when the cache is written.

    ``entries`` maps a :func:`cache_id` to (path last seen at, when last used, stat key);
    ``used`` are the ids used now; ``now_at`` gives the stat of what is at each path now
    (None: nothing); ``now`` is the time in the same unit as the "last used" values
    (seconds). Kept: the used ones; of the others, never a file changed in place since
    (it can never hit again); an unchanged file still at its path; the
    :data:`KEEP_PER_PATH` most recent of those replaced at a path; those whose path is gone
    for :data:`KEEP_GONE_S` after their last use (moved aside, perhaps to be restored);
    :data:`MAX_ENTRIES` in all, the most recently used first."""
    candidates: list[tuple[int, str]] = []
    replaced: dict[str, list[tuple[int, str]]] = {}
    for ident, (path, seen, key) in entries.items():
        if ident in used:
            continue
        cur = now_at.get(path)
        if cur is None:
            if now - seen <= KEEP_GONE_S:
                candidates.append((seen, ident))
        elif cache_id(cur) != ident:
            replaced.setdefault(path, []).append((seen, ident))
        elif cur == key:
            candidates.append((seen, ident))
    for items in replaced.values():
        candidates += sorted(items, reverse=True)[:KEEP_PER_PATH]
    room = max(0, MAX_ENTRIES - len(used))
    return set(used) | {ident for _, ident in sorted(candidates, reverse=True)[:room]}


# --------------------------------------------------------------------------- the fingerprint


@dataclass(frozen=True)
class FileDigest:
    """One counted file: its name in the model directory, size and content sha256."""

    name: str
    size: int
    sha256: str


def combine(files: Iterable[FileDigest]) -> str:
    """The fingerprint (64 hex) of a set of file digests: sha256 of the canonical JSON
    ``{"files": [[name, size, sha256], ...], "scheme": SCHEME}``, files sorted by name.
    Raises ValueError if a name appears twice."""
    items = sorted(files, key=lambda f: f.name)
    names = [f.name for f in items]
    if len(set(names)) != len(names):
        raise ValueError("a file name appears twice")
    payload = {"scheme": SCHEME, "files": [[f.name, f.size, f.sha256] for f in items]}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("ascii")).hexdigest()


@dataclass(frozen=True)
class WeightsRecord:
    """The fingerprint kept in a namespace's manifest (key ``weights``)."""

    fingerprint: str
    files: tuple[FileDigest, ...]
    model_path: str
    recorded_at: str = ""
    recorded_by: str = ""
    scheme: str = SCHEME

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def short(self) -> str:
        return self.fingerprint[:16]

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "fingerprint": self.fingerprint,
                "model_path": self.model_path, "recorded_at": self.recorded_at,
                "recorded_by": self.recorded_by, "bytes": self.total_bytes,
                "files": {f.name: {"size": f.size, "sha256": f.sha256} for f in self.files}}

    @classmethod
    def from_dict(cls, data: Any) -> WeightsRecord:
        """Parse a manifest's ``weights`` object. Raises ValueError if it is malformed or
        its fingerprint does not match its files (an edited record)."""
        if not isinstance(data, dict):
            raise ValueError("the weights record is not an object")
        scheme = data.get("scheme")
        if scheme != SCHEME:
            raise ValueError(f"unknown weights scheme {scheme!r} (this kvpersist knows "
                             f"{SCHEME}); a newer kvpersist recorded it")
        raw = data.get("files")
        if not isinstance(raw, dict):
            raise ValueError("the weights record has no files")
        files = []
        for name, f in raw.items():
            if not isinstance(f, dict) or type(f.get("size")) is not int \
                    or not isinstance(f.get("sha256"), str) or not is_sha256(f["sha256"]):
                raise ValueError(f"bad file entry {name!r} in the weights record")
            files.append(FileDigest(name, f["size"], f["sha256"]))
        fp = data.get("fingerprint")
        if fp != combine(files):
            raise ValueError("the weights record's fingerprint does not match its files")
        return cls(fp, tuple(sorted(files, key=lambda f: f.name)),
                   str(data.get("model_path", "")), str(data.get("recorded_at", "")),
                   str(data.get("recorded_by", "")), scheme)


def make_record(files: Iterable[FileDigest], model_path: str, *, recorded_at: str = "",
                recorded_by: str = "") -> WeightsRecord:
    """A :class:`WeightsRecord` of ``files`` (sorted, fingerprint computed)."""
    items = tuple(sorted(files, key=lambda f: f.name))
    return WeightsRecord(combine(items), items, model_path, recorded_at, recorded_by)


def record_from_manifest(manifest: Mapping[str, Any]) -> WeightsRecord | None:
    """The weights record of a parsed manifest, None if it has none. Raises ValueError if
    the record is malformed."""
    data = manifest.get("weights")
    return None if data is None else WeightsRecord.from_dict(data)


# --------------------------------------------------------------------------- comparing


@dataclass(frozen=True)
class Comparison:
    """``first`` (nothing recorded), ``same`` or ``changed`` (with the file names that
    differ)."""

    verdict: str
    changed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    recorded: WeightsRecord | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "changed": list(self.changed),
                "added": list(self.added), "removed": list(self.removed)}


def compare(recorded: WeightsRecord | None, current: WeightsRecord) -> Comparison:
    """Compare the current weights with the namespace's record."""
    if recorded is None:
        return Comparison("first")
    if recorded.fingerprint == current.fingerprint:
        return Comparison("same", recorded=recorded)
    old = {f.name: f for f in recorded.files}
    new = {f.name: f for f in current.files}
    return Comparison(
        "changed",
        changed=tuple(sorted(n for n in old.keys() & new.keys() if old[n] != new[n])),
        added=tuple(sorted(new.keys() - old.keys())),
        removed=tuple(sorted(old.keys() - new.keys())),
        recorded=recorded)


def _names(label: str, names: tuple[str, ...], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{label} {shown}{more}"


def refusal(namespace: str, model_path: str, cmp: Comparison,
            current: WeightsRecord) -> Problem:
    """The preflight problem for weights that changed since the namespace was first served."""
    rec = cmp.recorded
    parts = [_names(label, names) for label, names in
             (("changed:", cmp.changed), ("added:", cmp.added), ("removed:", cmp.removed))
             if names]
    since = f" on {rec.recorded_at}" if rec and rec.recorded_at else ""
    was = f"fingerprint {rec.short} -> {current.short}" if rec else ""
    detail = "; ".join([was, *parts]) if was else "; ".join(parts)
    return Problem("KVP_MODEL_PATH",
                   f"the weights at KVP_MODEL_PATH ({model_path}) changed since {namespace} "
                   f"was first served{since} ({detail})",
                   "bump KVP_MODEL_REVISION, or restore them")
