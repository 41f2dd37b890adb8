"""The L2 master key of LMCache's ``aesgcm`` serde (the I/O layer for key files).

LMCache derives one AES key per ``cache_salt`` from this master key with HKDF-SHA256 and
authenticates every chunk frame with AES-GCM: a tampered, truncated or foreign file fails
its tag and becomes a load miss (recompute), never wrong output.

The toolkit creates the key once: 32 random bytes, mode 0600, in a 0700 directory, written
atomically. It never prints or logs the key; only a fingerprint (a one-way digest) is shown.
Under systemd the key can come from a credential (``LoadCredential=``): point
``KVP_SERDE_KEY_FILE`` at ``$CREDENTIALS_DIRECTORY/<name>``; an existing key is used as is.

What a key change means: every chunk written under the old key fails authentication under
the new one, so the whole cache at that root becomes unreadable (misses, recompute). Stock
LMCache never rewrites a key whose file exists, so those files stay misses until removed;
``kvp-admin verify --apply`` quarantines them. Rotating the key therefore equals starting
the cache from empty; the namespace does not change (the key is not a KV-compatibility
field), which is why launch records the fingerprint and warns when it changes.

Each namespace has its own key (:mod:`kvpersist.config.key_paths` says where,
:mod:`kvpersist.l2.keys.plan` decides which key a launch uses and what ``shred`` destroys):
:func:`prepare_launch_key` is that step of a launch, :func:`destroy_key` the first step of a
shred, :func:`write_tombstone` its record (docs/keys-and-shred.md).
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpersist.config.key_paths import (
    FINGERPRINT_NAME,
    KEY_NAME,
    TOMBSTONE_NAME,
    is_namespace_key,
    keys_dir,
    namespace_dir_problem,
    namespace_key_dir,
    namespace_key_path,
    root_key_path,
    tombstone_path,
)
from kvpersist.errors import EXIT_USAGE, KvpError
from kvpersist.l2.keys.plan import ADOPT, LaunchKeyFacts, LaunchKeyPlan, plan_launch_key
from kvpersist.system.files import (
    atomic_write,
    atomic_write_json,
    make_dirs,
    read_owner_only,
    trust_problems,
)
from kvpersist.system.untrusted import MAX_RECORD_BYTES, UnreadableFile, read_json, read_text

KEY_BYTES = 32
FINGERPRINT_FILE = FINGERPRINT_NAME
TOMBSTONE_SCHEMA = "kvpersist.key-tombstone/1"


class KeyError_(KvpError):
    """The key file is unusable (unreadable, too short, readable by others): a configuration
    error, exit 2 (issue 40: ``scrub`` exited 1, its code for dirty padding left)."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class KeyInfo:
    """A usable key: where it is, its fingerprint, and whether this call created it."""

    path: str
    fingerprint: str
    created: bool


def fingerprint(key: bytes) -> str:
    """A 16-hex one-way fingerprint of ``key`` (safe to log; pure)."""
    return hashlib.sha256(b"kvpersist-l2-key-fingerprint\0" + key).hexdigest()[:16]


#: the most of a key file that is read (LMCache's own key is 32 bytes; a larger file is
#: refused rather than read without bound)
KEY_MAX_BYTES = 1 << 20


def read_key(path: str | os.PathLike[str], also: tuple[int, ...] = ()) -> bytes:
    """The key bytes at ``path``; raises KeyError_ if missing, short, not owner-only, or not
    owned by this user (or the service user's uid in ``also``) under trusted directories
    (:func:`~kvpersist.system.files.trust_problems`, then
    :func:`~kvpersist.system.files.read_owner_only`)."""
    p = Path(path)
    trust = trust_problems(p, also=also)
    if trust:
        raise KeyError_(f"key file {p} cannot be trusted: " + "; ".join(trust))
    try:
        data = read_owner_only(p, what="key file", max_bytes=KEY_MAX_BYTES, also=also,
                               fix="check KVP_SERDE_KEY_FILE (launch creates the key)")
    except KvpError as exc:
        raise KeyError_(str(exc)) from exc
    if len(data) < 16:
        raise KeyError_(f"key file {p} holds {len(data)} bytes; at least 16 are needed")
    return data


def ensure_key(path: str | os.PathLike[str], also: tuple[int, ...] = ()) -> KeyInfo:
    """Return the key at ``path``, creating it (32 random bytes, 0600, parent 0700) if it
    does not exist. Never overwrites. Raises KeyError_ if an existing key is unusable."""
    p = Path(path)
    created = install_key(p, os.urandom(KEY_BYTES)) if not p.exists() else False
    key = read_key(p, also)
    return KeyInfo(str(p), fingerprint(key), created)


def install_key(p: Path, data: bytes) -> bool:
    """Write ``data`` as the key file ``p`` (0600, parents 0700, fsynced) unless one exists;
    True if this call wrote it. Never overwrites. Raises OSError."""
    make_dirs(p.parent)
    # never ".tmp." in a name kvpersist writes: LMCache deletes such names under its root
    tmp = p.with_name(f".{p.name}.new-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, p)  # fails if another launcher created it meanwhile
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def recorded_fingerprint(state_dir: str | os.PathLike[str],
                         namespace: str = "") -> str | None:
    """The key fingerprint recorded for a cache (``<state_dir>/keys/...fingerprint``; with
    ``namespace``, ``<state_dir>/keys/<namespace>/...fingerprint``), or
    None when none is recorded, or the record is not one (read as untrusted: not a regular
    file, a link, bigger than a record, not 16 hex digits): then launch does not warn of a
    key change and records the fingerprint again. Never raises."""
    try:
        where = Path(keys_dir(os.fspath(state_dir)))
        if namespace:
            where = Path(namespace_key_dir(os.fspath(state_dir), namespace))
        text = read_text(where / FINGERPRINT_FILE, follow=False,
                         max_bytes=MAX_RECORD_BYTES).strip()
    except (FileNotFoundError, NotADirectoryError, UnreadableFile, ValueError):
        return None
    return text if len(text) == 16 and all(c in "0123456789abcdef" for c in text) else None


def record_fingerprint(state_dir: str | os.PathLike[str], fp: str, namespace: str = "") -> None:
    """Record ``fp`` as the key fingerprint this cache's (``namespace``'s) files are written
    with."""
    where = Path(keys_dir(os.fspath(state_dir)))
    if namespace:
        where = Path(namespace_key_dir(os.fspath(state_dir), namespace))
    atomic_write(where / FINGERPRINT_FILE, fp + "\n")



# --------------------------------------------------------------------------- per namespace


def launch_key_facts(state_dir: str, namespace: str, key_file: str, *, has_files: bool,
                     manifest_file: str) -> LaunchKeyFacts:
    """The facts :func:`~kvpersist.l2.keys.plan.plan_launch_key` decides on (lstat only)."""
    explicit = key_file != namespace_key_path(state_dir, namespace)
    return LaunchKeyFacts(
        explicit=explicit, own_key=os.path.lexists(key_file),
        shredded=os.path.lexists(tombstone_path(state_dir, namespace)),
        root_key=os.path.lexists(root_key_path(state_dir)), has_files=has_files,
        has_manifest=os.path.lexists(manifest_file),
        root_fingerprint_recorded=os.path.lexists(Path(keys_dir(state_dir))
                                                  / FINGERPRINT_FILE))


@dataclass(frozen=True)
class LaunchKey:
    """The launch's key step: the plan, the key used, and what to tell the operator."""

    plan: LaunchKeyPlan
    info: KeyInfo
    notes: tuple[str, ...] = ()


def prepare_launch_key(state_dir: str, namespace: str, key_file: str, *, has_files: bool,
                       manifest_file: str, also: tuple[int, ...] = ()) -> LaunchKey:
    """Make ``namespace``'s key ready before the server starts: adopt the root key (a 0600
    copy), create a new one, or use the one there (:func:`launch_key_facts`, then
    :func:`~kvpersist.l2.keys.plan.plan_launch_key`); record its fingerprint in the
    namespace's key directory and warn when it changed. Call it before the manifest is
    written (a manifest means "launched before"). Raises KeyError_ for a key that cannot be
    read or written."""
    facts = launch_key_facts(state_dir, namespace, key_file, has_files=has_files,
                             manifest_file=manifest_file)
    plan = plan_launch_key(facts)
    notes: list[str] = []
    if plan.action == ADOPT:
        root = root_key_path(state_dir)
        data = read_key(root, also)
        try:
            install_key(Path(key_file), data)
        except OSError as exc:
            raise KeyError_(f"cannot write {key_file}: {exc.strerror or exc}") from exc
        notes.append(f"{namespace} adopted the root L2 key {root} as its own key {key_file} "
                     f"(fingerprint {fingerprint(data)}): {plan.reason}")
    try:
        info = ensure_key(key_file, also)
    except OSError as exc:
        raise KeyError_(f"cannot create {key_file}: {exc.strerror or exc}") from exc
    if info.created:
        notes.append(f"created L2 master key {info.path} for {namespace} (0600, fingerprint "
                     f"{info.fingerprint}): {plan.reason}")
    old = recorded_fingerprint(state_dir, namespace)
    if old and old != info.fingerprint:
        notes.append(f"WARNING: the L2 key of {namespace} changed (fingerprint {old} -> "
                     f"{info.fingerprint}): files written under the old key are permanent "
                     "misses; run `kvp-admin verify --apply` to quarantine them")
    record_fingerprint(state_dir, info.fingerprint, namespace)
    return LaunchKey(plan, info, tuple(notes))


def key_fingerprint_at(path: str, also: tuple[int, ...] = ()) -> str | None:
    """The fingerprint of the key at ``path``, or None when there is none or it cannot be
    read (then it is reported, never used)."""
    try:
        return fingerprint(read_key(path, also)) if os.path.lexists(path) else None
    except KeyError_:
        return None


@dataclass(frozen=True)
class StateKeys:
    """The keys under one state dir: each namespace's own key's fingerprint, the shredded
    namespaces, and the root key's fingerprint (None: no root key)."""

    state_dir: str
    fingerprints: dict[str, str] = field(default_factory=dict)
    tombstoned: frozenset[str] = frozenset()
    root_fp: str | None = None


def state_keys(state_dir: str, also: tuple[int, ...] = ()) -> StateKeys:
    """Read ``<state_dir>/keys`` (directories only, never through a symlink; names that are
    not namespaces are ignored)."""
    kd = keys_dir(state_dir)
    fps: dict[str, str] = {}
    dead: set[str] = set()
    try:
        names = sorted(os.listdir(kd))
    except (FileNotFoundError, NotADirectoryError):
        names = []
    except OSError as exc:
        raise KeyError_(f"cannot list {kd}: {exc.strerror or exc}") from exc
    for name in names:
        sub = os.path.join(kd, name)
        if namespace_dir_problem(name) or not stat.S_ISDIR(os.lstat(sub).st_mode):
            continue
        fp = key_fingerprint_at(os.path.join(sub, KEY_NAME), also)
        if fp is not None:
            fps[name] = fp
        if os.path.lexists(os.path.join(sub, TOMBSTONE_NAME)):
            dead.add(name)
    return StateKeys(state_dir, fps, frozenset(dead),
                     key_fingerprint_at(root_key_path(state_dir), also))


def key_lookup(state_dir: str, also: tuple[int, ...] = ()) -> Callable[[str], bytes | None]:
    """Each namespace's master key under ``state_dir`` for verify: its own key; for a
    namespace with none and no tombstone, the root key (its files predate per-namespace keys);
    None otherwise. Keys are read once each."""
    cache: dict[str, bytes | None] = {}

    def read(path: str) -> bytes | None:
        if path not in cache:
            try:
                cache[path] = read_key(path, also) if os.path.lexists(path) else None
            except KeyError_:
                cache[path] = None
        return cache[path]

    def lookup(namespace: str) -> bytes | None:
        if namespace_dir_problem(namespace):
            return None
        own = read(namespace_key_path(state_dir, namespace))
        if own is not None:
            return own
        if os.path.lexists(tombstone_path(state_dir, namespace)):
            return None
        return read(root_key_path(state_dir))

    return lookup


@dataclass(frozen=True)
class DestroyedKey:
    """A key file :func:`destroy_key` overwrote and unlinked."""

    path: str
    fingerprint: str
    bytes: int
    at_ns: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "fingerprint": self.fingerprint, "bytes": self.bytes,
                "destroyed_at_ns": self.at_ns}


def destroy_key(path: str, also: tuple[int, ...] = ()) -> DestroyedKey:
    """Overwrite the key file ``path`` with random bytes, fsync, unlink, fsync its directory.

    Opened without following a symlink; it must be a regular, owner-only file (as
    :func:`read_key` requires). Overwriting does not reach copies a flash translation layer
    or a snapshot keeps: that is why the key is destroyed rather than the data relied on to
    be gone. Raises KeyError_ when the file cannot be destroyed."""
    key = read_key(path, also)
    fp = fingerprint(key)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KeyError_(f"{path} is not a regular file")
            os.write(fd, os.urandom(max(st.st_size, KEY_BYTES)))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(path)
        dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        raise KeyError_(f"cannot destroy the key {path}: {exc.strerror or exc}") from exc
    return DestroyedKey(path, fp, len(key), time.time_ns())


def write_tombstone(state_dir: str, namespace: str, destroyed: list[DestroyedKey]) -> str:
    """Record in ``<state_dir>/keys/<namespace>/shredded.json`` that ``namespace``'s key was
    destroyed (fingerprints and times, never a key): launch then never adopts the root key
    for it again. Returns the path. Raises KvpError if it cannot be written."""
    path = tombstone_path(state_dir, namespace)
    atomic_write_json(path, {"schema": TOMBSTONE_SCHEMA, "namespace": namespace,
                             "shredded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                          time.gmtime()),
                             "destroyed": [d.to_dict() for d in destroyed]})
    return path


def read_tombstone(state_dir: str, namespace: str) -> dict[str, Any] | None:
    """The tombstone of ``namespace`` (None: none, or not a tombstone). Never raises."""
    try:
        doc = read_json(tombstone_path(state_dir, namespace), follow=False,
                        max_bytes=MAX_RECORD_BYTES)
    except (OSError, UnreadableFile):
        return None
    return doc if isinstance(doc, dict) and doc.get("schema") == TOMBSTONE_SCHEMA else None


def namespace_keys(state_dir: str, namespace: str, key_file: str, also: tuple[int, ...],
                   ) -> tuple[bytes, Callable[[str], bytes | None]]:
    """(``namespace``'s master key, the key of every namespace): its key file; for a
    namespace not launched since per-namespace keys (no key file of its own, no tombstone),
    the root key it will adopt (docs/keys-and-shred.md); other namespaces' own keys (or the
    root key) for ``--all-namespaces``. Raises KeyError_ when ``namespace`` has no key."""
    lookup = key_lookup(state_dir, also)
    root = root_key_path(state_dir)
    if not is_namespace_key(state_dir, namespace, key_file) or os.path.lexists(key_file) \
            or os.path.lexists(tombstone_path(state_dir, namespace)) \
            or not os.path.lexists(root):
        own = read_key(key_file, also)
    else:  # not launched since per-namespace keys: the root key it will adopt
        own = read_key(root, also)

    def key_for(prefix: str) -> bytes | None:
        return own if prefix == namespace else lookup(prefix)

    return own, key_for
