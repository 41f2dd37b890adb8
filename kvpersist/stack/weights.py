"""The weights fingerprint at launch (I/O): list, stat and hash the files at
``KVP_MODEL_PATH``, keep the digests in the state dir, compare with the namespace's record.

What counts and how digests combine is in :mod:`kvpersist.config.fingerprint` (pure). Here:

* :func:`fingerprint_weights` stats every counted file once, takes each digest from the
  digest cache (``S/weights-digests.json``: by (device, inode), valid while (size,
  mtime_ns, ctime_ns) are unchanged), from the hub layout's blob name or a ``--local-dir``
  download's metadata (the sha256 etag huggingface_hub recorded, valid under its own rule:
  the file not modified more than a second after the metadata was written), or else reads
  the file (streamed, 1 MiB buffer) and caches the result. A name is never trusted for a
  new (device, inode) at a path where the cache knew another one: a file replaced by
  rename is read. A later launch costs one ``stat`` per file.
* :func:`check_weights` is the preflight step: fingerprint, then compare with the record
  in the namespace's manifest; a different fingerprint is a :class:`Problem` (the launch is
  refused before anything starts, nothing under the cache root is touched).
  Preflight writes nothing: it asks for the digest cache to be kept unsaved
  (``write_cache=False``), and :func:`save_digests` writes it when the launch goes ahead.
* :func:`manifest_with_weights` is what :func:`~kvpersist.stack.launch.prepare_state` writes:
  the manifest with the record kept from the first launch (or made now, at the first).

The digest cache and the manifest live in ``KVP_STATE_DIR``, which preflight requires to be
owned by the service user: whoever can write there could forge digests. Both are still read
as untrusted (:mod:`kvpersist.system.untrusted`: a regular file, never through a link, within
a cap, depth-limited JSON): a digest cache that cannot be used is ignored with a note and
every file is read again; a manifest that cannot be read is a problem. A counted file of the
model that is not a regular file (a FIFO, a device) is refused, never opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import stat
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpersist import __version__
from kvpersist.config.fingerprint import (
    CacheEntry,
    Comparison,
    FileDigest,
    StatKey,
    WeightsRecord,
    cache_id,
    compare,
    counts,
    decide,
    entries_to_keep,
    is_sha256,
    make_record,
    record_from_manifest,
    refusal,
)
from kvpersist.errors import KvpError, Problem
from kvpersist.stack.locate import Location
from kvpersist.system.files import atomic_write_json
from kvpersist.system.untrusted import (
    MAX_RECORD_BYTES,
    MAX_STATE_BYTES,
    UnreadableFile,
    decode,
    read_bytes,
    read_json,
    read_json_object,
)

CACHE_SCHEMA = "kvpersist.weights-digests/1"
READ_CHUNK = 1 << 20
HUB_REPO_PREFIXES = ("models--",)
LOCAL_DIR_METADATA = (".cache", "huggingface", "download")
#: the most entries the top level of a model directory may hold
MAX_MODEL_ENTRIES = 100_000
#: the largest digest cache read: MAX_ENTRIES entries with paths of up to 4,096 bytes
MAX_CACHE_BYTES = 48 << 20


class WeightsError(KvpError):
    """The weights cannot be fingerprinted (missing, unreadable, changing while read)."""


# --------------------------------------------------------------------------- files


def model_files(model_path: str) -> list[tuple[str, str]]:
    """The counted files of ``model_path`` as ``(name, path)``, sorted by name.

    A directory: its top-level entries that :func:`counts` accepts and that are (or link
    to) regular files. A file: that file. Raises WeightsError if the path is missing, or a
    counted entry is a broken link or cannot be listed.
    """
    try:
        st = os.stat(model_path)
    except OSError as exc:
        raise WeightsError(f"KVP_MODEL_PATH {model_path}: {exc.strerror}") from exc
    if stat.S_ISREG(st.st_mode):
        return [(os.path.basename(model_path), model_path)]
    if not stat.S_ISDIR(st.st_mode):
        raise WeightsError(f"KVP_MODEL_PATH {model_path} is neither a directory nor a file")
    out = []
    try:
        with os.scandir(model_path) as it:
            entries = []
            for e in it:
                entries.append(e)
                if len(entries) > MAX_MODEL_ENTRIES:
                    raise WeightsError(f"KVP_MODEL_PATH {model_path} holds more than "
                                       f"{MAX_MODEL_ENTRIES:,} entries: not a model directory")
    except OSError as exc:
        raise WeightsError(f"cannot list {model_path}: {exc.strerror}") from exc
    for e in entries:
        if not counts(e.name):
            continue
        try:
            if not e.is_file(follow_symlinks=True):
                if e.is_symlink() and not os.path.exists(e.path):
                    raise WeightsError(f"{e.path} is a broken link")
                if not e.is_dir(follow_symlinks=True):
                    raise WeightsError(f"{e.path} is not a regular file (a FIFO, a device "
                                       "or a socket): vLLM cannot load it")
                continue
        except OSError as exc:
            raise WeightsError(f"cannot stat {e.path}: {exc.strerror}") from exc
        out.append((e.name, e.path))
    return sorted(out)


def hub_blob_sha256(real_path: str) -> str:
    """The sha256 a hub cache names a blob by (``models--ORG--NAME/blobs/<sha256>``), or ''.

    Git-LFS files are stored under their LFS oid, the sha256 of their content; small
    non-LFS files under their git blob sha1 (40 hex), which is not a sha256 of the content:
    those are read (they are small; the hub requires LFS above 10 MB)."""
    p = Path(real_path)
    if (p.parent.name == "blobs" and p.parent.parent.name.startswith(HUB_REPO_PREFIXES)
            and is_sha256(p.name)):
        return p.name
    return ""


def local_dir_sha256(model_dir: str, name: str, mtime: float) -> str:
    """The sha256 etag that a ``huggingface-cli download --local-dir`` recorded for ``name``
    (``.cache/huggingface/download/<name>.metadata``: commit, etag, timestamp), or ''.

    Valid only as huggingface_hub itself decides: the file's mtime at most one second after
    the metadata's timestamp (a file modified after its download has outdated metadata).
    A 40-hex etag (git sha1 of a small non-LFS file) is not a content sha256: ''. A record
    that cannot be read (not a regular file, past its cap, not UTF-8, a timestamp that is
    not a finite number) names nothing."""
    meta = os.path.join(model_dir, *LOCAL_DIR_METADATA, name + ".metadata")
    try:
        lines = decode(read_bytes(meta, max_bytes=MAX_RECORD_BYTES), meta).splitlines()
        etag, timestamp = lines[1].strip(), float(lines[2].strip())
    except (OSError, UnreadableFile, ValueError, IndexError):
        return ""
    if is_sha256(etag) and math.isfinite(timestamp) and mtime - 1 <= timestamp:
        return etag
    return ""


def read_sha256(path: str) -> tuple[str, StatKey]:
    """sha256 of ``path``'s content, streamed (bounded memory), and the stat it had.

    Raises WeightsError if it cannot be read, is not a regular file (a FIFO put there since
    it was listed: opened without blocking, never read) or changed while being read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise WeightsError(f"cannot read {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb", buffering=0) as f:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise WeightsError(f"{path} is not a regular file: vLLM cannot load it")
            before = StatKey.of(st)
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            h = hashlib.sha256()
            buf = bytearray(READ_CHUNK)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])
            after = StatKey.of(os.fstat(fd))
        except OSError as exc:
            raise WeightsError(f"cannot read {path}: {exc.strerror}") from exc
    if after != before:
        raise WeightsError(f"{path} changed while it was being read; try again once the "
                           "weights are in place")
    return h.hexdigest(), before


# --------------------------------------------------------------------------- digest cache


@dataclass(frozen=True)
class Cached:
    """A digest cache entry, where its file was last seen and when (seconds since the
    epoch)."""

    entry: CacheEntry
    path: str
    seen: int


def load_cache(path: str) -> tuple[dict[str, Cached], list[str]]:
    """The digest cache at ``path`` by :func:`~kvpersist.config.fingerprint.cache_id`
    (empty if missing) and notes about what was ignored: a cache that is not a regular file
    of at most :data:`MAX_CACHE_BYTES` (never a link), not JSON, or not the schema is ignored
    as a whole, an entry that is not what :meth:`CacheEntry.to_dict` writes is dropped;
    either way the files are read again, never trusted."""
    try:
        data = read_json(path, max_bytes=MAX_CACHE_BYTES, follow=False)
    except FileNotFoundError:
        return {}, []
    except UnreadableFile as exc:
        return {}, [f"weights digest cache {exc.path} ignored ({exc.why}); the files are "
                    "read again"]
    if not isinstance(data, dict) or data.get("schema") != CACHE_SCHEMA \
            or not isinstance(data.get("files"), dict):
        return {}, [f"weights digest cache {path} ignored (not {CACHE_SCHEMA})"]
    out: dict[str, Cached] = {}
    for ident, raw in data["files"].items():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            entry = CacheEntry.from_dict(raw)
            if cache_id(entry.key) == ident:
                out[ident] = Cached(entry, str(raw["path"]), int(raw["seen"]))
    return out, []


def _not_mine(state_dir: str) -> str:
    """Why this process should not write into ``state_dir`` ('' if it may: it owns the
    directory, or it does not exist yet)."""
    try:
        owner = os.stat(state_dir).st_uid
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"{state_dir}: {exc.strerror}"
    return "" if owner == os.geteuid() else f"{state_dir} belongs to uid {owner}"


def _stat_key(path: str) -> StatKey | None:
    try:
        return StatKey.of(os.stat(path))
    except OSError:
        return None


def save_cache(path: str, entries: dict[str, Cached], used: set[str]) -> list[str]:
    """Write the digest cache (atomic, 0600), keeping what
    :func:`~kvpersist.config.fingerprint.entries_to_keep` keeps (one ``stat`` per path of
    an entry not used now). Returns notes; never raises. Skipped when the state dir belongs
    to another user (root acting for the service user): a file that user could not read
    back would only cost a re-read."""
    why = _not_mine(os.path.dirname(path))
    if why:
        return [f"weights digest cache not written: {why}"]
    paths = {c.path for i, c in entries.items() if i not in used}
    keep = entries_to_keep({i: (c.path, c.seen, c.entry.key) for i, c in entries.items()},
                           used, {p: _stat_key(p) for p in paths}, int(time.time()))
    files = {i: {**c.entry.to_dict(), "path": c.path, "seen": c.seen}
             for i, c in sorted(entries.items()) if i in keep}
    try:
        atomic_write_json(path, {"schema": CACHE_SCHEMA, "files": files})
    except KvpError as exc:
        return [f"weights digest cache not written: {exc}"]
    return []


# --------------------------------------------------------------------------- fingerprint


@dataclass(frozen=True)
class DigestCache:
    """A digest cache to write (:func:`save_cache`'s arguments): what a fingerprint taken with
    ``write_cache=False`` would have saved."""

    path: str
    entries: dict[str, Cached]
    used: frozenset[str]


@dataclass(frozen=True)
class Fingerprinted:
    """The current weights: their record, where each digest came from, what it cost."""

    record: WeightsRecord
    sources: dict[str, int]
    bytes_read: int
    seconds: float
    notes: tuple[str, ...] = ()
    #: the digest cache left to write (``write_cache=False`` and something new was learnt)
    unsaved: DigestCache | None = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        how = ", ".join(f"{n} {s}" for s, n in sorted(self.sources.items()) if n)
        gib = self.record.total_bytes / (1 << 30)
        return (f"{len(self.record.files)} files, {gib:.2f} GiB; digests: {how or 'none'}; "
                f"{self.bytes_read / (1 << 30):.2f} GiB read in {self.seconds:.2f} s")

    def to_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.record.fingerprint, "files": len(self.record.files),
                "bytes": self.record.total_bytes, "sources": dict(self.sources),
                "bytes_read": self.bytes_read, "seconds": round(self.seconds, 4)}


def fingerprint_weights(model_path: str, cache_file: str, *, rehash: bool = False,
                        write_cache: bool = True) -> Fingerprinted:
    """Fingerprint the weights at ``model_path`` using (and updating) the digest cache.

    ``rehash`` reads every file, ignoring cache and names (an audit; a name that does not
    match the content is noted). ``write_cache=False`` writes nothing: what the cache would
    be given is returned as ``unsaved`` (:func:`save_digests`). Raises WeightsError (see
    :func:`model_files`, :func:`read_sha256`)."""
    t0 = time.monotonic()
    files = model_files(model_path)
    cache, notes = load_cache(cache_file)
    old_paths = {i: c.path for i, c in cache.items()}
    ids_at: dict[str, set[str]] = {}
    for i, c in cache.items():
        ids_at.setdefault(c.path, set()).add(i)
    now = int(time.time())
    model_dir = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    sources: Counter[str] = Counter()
    digests: list[FileDigest] = []
    used: set[str] = set()
    bytes_read = 0
    for name, path in files:
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except OSError as exc:
            raise WeightsError(f"cannot stat {path}: {exc.strerror}") from exc
        key = StatKey.of(st)
        old = cache.get(cache_id(key))
        if old is not None and old.entry.key == key and not rehash:
            named, named_source = old.entry.named, ""  # a hit: no name is read
        else:
            named, named_source = hub_blob_sha256(real), "hub-blob"
            if not named and not os.path.islink(path):
                named, named_source = (local_dir_sha256(model_dir, name, st.st_mtime),
                                       "hf-metadata")
        replaced = old is None and bool(ids_at.get(real))
        d = decide(key, old.entry if old else None, named, named_source, rehash=rehash,
                   replaced=replaced)
        if d.how == "read":
            sha, key = read_sha256(real)
            bytes_read += key.size
            source = "read"
            if named and named != sha:
                how = "replaced" if replaced else "modified"
                notes.append(f"{path}: its content's sha256 is {sha[:16]}…, not the "
                             f"{named[:16]}… its {named_source} names: {how} after download")
        else:
            sha, source = d.sha256, d.source
        sources["cache" if d.how == "cache" else source] += 1
        cache[cache_id(key)] = Cached(CacheEntry(key, sha, source, named), real, now)
        used.add(cache_id(key))
        digests.append(FileDigest(name, key.size, sha))
    unsaved = None
    if (sources["read"] or sources["hub-blob"] or sources["hf-metadata"]
            or any(cache[i].path != old_paths.get(i) for i in used)):
        if write_cache:
            notes += save_cache(cache_file, cache, used)
        else:
            unsaved = DigestCache(cache_file, cache, frozenset(used))
    record = make_record(digests, os.path.abspath(model_path),
                         recorded_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         recorded_by=f"kvpersist {__version__}")
    return Fingerprinted(record, {s: sources[s] for s in sorted(sources)}, bytes_read,
                         time.monotonic() - t0, tuple(notes), unsaved)


def save_digests(check: WeightsCheck | None) -> list[str]:
    """Write the digest cache a check taken with ``write_cache=False`` left unsaved (nothing
    when there is none). Returns notes; never raises (see :func:`save_cache`)."""
    unsaved = check.current.unsaved if check is not None and check.current else None
    if unsaved is None:
        return []
    return save_cache(unsaved.path, unsaved.entries, set(unsaved.used))


# --------------------------------------------------------------------------- the check


def read_record(manifest_file: str) -> WeightsRecord | None:
    """The weights record of the manifest at ``manifest_file``: None if there is no manifest
    or it has no record. Raises WeightsError if it cannot be read or parsed (see
    :func:`_read_manifest`)."""
    data = _read_manifest(manifest_file)
    if data is None:
        return None
    try:
        return record_from_manifest(data)
    except ValueError as exc:
        raise WeightsError(f"{manifest_file}: {exc}") from exc


def _read_manifest(manifest_file: str) -> dict[str, Any] | None:
    """The namespace manifest at ``manifest_file`` as an object, None if there is none.
    Raises WeightsError if it is not a regular file of at most
    :data:`~kvpersist.system.untrusted.MAX_STATE_BYTES` (a link included), not JSON or not
    an object."""
    try:
        return read_json_object(manifest_file, max_bytes=MAX_STATE_BYTES, follow=False)
    except FileNotFoundError:
        return None
    except UnreadableFile as exc:
        raise WeightsError(f"cannot read the namespace manifest {exc.path}: {exc.why}") \
            from None


@dataclass(frozen=True)
class WeightsCheck:
    """The preflight step's result. ``status``: ``first`` (nothing recorded: this launch
    records ``record``), ``same``, ``changed`` (a problem) or ``unchecked`` (why in notes).
    ``record`` is what the manifest holds after this launch (None: leave it as it is)."""

    status: str
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()
    record: WeightsRecord | None = None
    current: Fingerprinted | None = None
    comparison: Comparison | None = field(default=None)

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status,
                "current": self.current.to_dict() if self.current else None,
                "recorded": self.record.to_dict() if self.record and self.status != "first"
                else None,
                "comparison": self.comparison.to_dict() if self.comparison else None,
                "problems": [str(p) for p in self.problems], "notes": list(self.notes)}


def check_weights(loc: Location, *, pinned: bool, with_vllm: bool,
                  rehash: bool = False, write_cache: bool = True) -> WeightsCheck:
    """Fingerprint ``loc``'s weights and compare them with its namespace's record.

    Unchecked (a note, no problem): an unpinned namespace (nothing is reused), or weights
    missing on this host (preflight reports that itself when vLLM starts here; without vLLM
    the check runs again before vLLM starts). Weights that cannot be read are a problem
    when vLLM starts here, a note otherwise. A record that cannot be read, or a different
    fingerprint, is a problem. ``write_cache=False`` (preflight) leaves the digest cache
    unsaved (:func:`save_digests`)."""
    ns, path = loc.namespace, loc.model_target
    if not pinned:
        return WeightsCheck("unchecked", notes=(
            f"weights not fingerprinted: {ns} is a one-off (unpinned) namespace",))
    if not os.path.exists(path):
        later = "" if with_vllm else \
            " (they are checked again before vLLM starts with this namespace)"
        return WeightsCheck("unchecked", notes=(
            f"weights not checked: KVP_MODEL_PATH {path} does not exist on this host{later}",))
    try:
        recorded = read_record(loc.manifest_file)
    except WeightsError as exc:
        return WeightsCheck("unchecked", problems=(Problem(
            "KVP_STATE_DIR", f"{exc}; the weights cannot be compared with what {ns} was first "
            "served with", "restore the manifest, or remove it to record the weights now "
            "as the namespace's"),))
    try:
        cur = fingerprint_weights(path, loc.weights_cache, rehash=rehash,
                                  write_cache=write_cache)
    except WeightsError as exc:
        if with_vllm:
            return WeightsCheck("unchecked", problems=(Problem(
                "KVP_MODEL_PATH", str(exc), "make the weights readable by the service user"),))
        return WeightsCheck("unchecked", notes=(f"weights not checked: {exc}",))
    cmp = compare(recorded, cur.record)
    notes = list(cur.notes)
    if not cur.record.files:
        notes.append(f"KVP_MODEL_PATH {path} holds none of the files vLLM loads "
                     "(config.json, *.safetensors, ...)")
    if cmp.verdict == "changed":
        return WeightsCheck("changed", (refusal(ns, path, cmp, cur.record),), tuple(notes),
                            recorded, cur, cmp)
    if cmp.verdict == "same":
        assert recorded is not None
        notes.append(f"weights: fingerprint {cur.record.short} matches {ns}'s record "
                     f"(first served {recorded.recorded_at or 'before'}; {cur.describe()})")
        return WeightsCheck("same", (), tuple(notes), recorded, cur, cmp)
    notes.append(f"weights: fingerprint {cur.record.short}, not yet recorded for {ns}: "
                 f"recorded at its first launch ({cur.describe()})")
    return WeightsCheck("first", (), tuple(notes), cur.record, cur, cmp)


def manifest_with_weights(manifest: dict[str, Any], manifest_file: str,
                          check: WeightsCheck | None) -> dict[str, Any]:
    """``manifest`` with its ``weights`` record: the one the check decided on, else the one
    already in ``manifest_file`` (kept when the weights were not checked this time)."""
    record = check.record if check is not None else None
    if record is None:
        with contextlib.suppress(WeightsError):
            record = read_record(manifest_file)
    return {**manifest, "weights": record.to_dict()} if record is not None else manifest


def record_in_manifest(manifest_file: str, record: WeightsRecord,
                       fresh: Callable[[], dict[str, Any]]) -> str:
    """Add ``record`` to the manifest at ``manifest_file`` unless it already holds one (or
    write ``fresh()`` with it, if there is no manifest yet), atomically and owner-only.
    Returns a note saying what was done. Raises WeightsError if the manifest cannot be
    read."""
    why = _not_mine(os.path.dirname(os.path.dirname(manifest_file)))
    if why:
        return f"weights not recorded: {why}; the next launch records them"
    data = _read_manifest(manifest_file)
    if data is None:
        data = fresh()
    if data.get("weights") is not None:
        return "weights already recorded"
    atomic_write_json(manifest_file, {**data, "weights": record.to_dict()})
    return f"weights fingerprint {record.short} recorded in {manifest_file}"
