"""Namespace manifests: what render/launch recorded about each namespace (I/O: reading).

A manifest is ``<state dir>/manifests/<namespace>.json`` (schema ``kvpersist.manifest/1``),
written when a deployment is launched; report joins it with the files on disk to show which
model a namespace belongs to, and prune removes it with the namespace's last file.

A manifest is read as untrusted (:mod:`kvpersist.system.untrusted`): relative to its
directory's descriptor, never through a symlink, never blocking on a FIFO, at most
:data:`~kvpersist.system.untrusted.MAX_STATE_BYTES`, depth-limited, finite numbers only, and
typed (:func:`parse_manifest`). One that fails any of it is a problem naming the file (the
first :data:`~kvpersist.errors.MAX_PROBLEMS` listed, the others counted) and is not used:
report shows no model for its namespace, and the inventory does not take an unpinned
deployment's active namespace from it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpersist.errors import MAX_PROBLEMS, Problem, Problems
from kvpersist.l2.layout import MANIFESTS_DIR, META_DIR, is_namespace
from kvpersist.l2.tree import RootDir
from kvpersist.system.untrusted import (
    MAX_STATE_BYTES,
    UnreadableFile,
    parse_json,
    read_bytes,
    show_path,
)

if TYPE_CHECKING:
    from kvpersist.config.deployment import Deployment

#: the longest string a manifest's identity or deployment values may hold (a path)
MAX_VALUE_CHARS = 4096


@dataclass(frozen=True)
class Manifest:
    """``.kvpersist/manifests/<namespace>.json`` as written at render/launch time."""

    namespace: str
    lmcache_model_name: str
    pinned: bool
    identity: dict[str, Any] | None
    deployment: dict[str, Any]
    mtime_ns: int = 0

    def field(self, key: str) -> Any:
        return (self.identity or {}).get(key)


def parse_manifest(text: str | bytes, source: str = "") -> Manifest:
    """Parse one manifest document (bytes must be UTF-8).

    Raises ValueError naming ``source`` when it is not a kvpersist manifest: not JSON (or
    nested too deep, or holding NaN: :func:`~kvpersist.system.untrusted.parse_json`), another
    schema, a bad namespace, or a field of the wrong type (``lmcache_model_name`` a string,
    ``pinned`` a boolean, ``identity`` an object or null, ``deployment`` an object; their
    values strings of at most :data:`MAX_VALUE_CHARS`, numbers, booleans or null, or, one
    level down, objects and arrays of those)."""
    try:
        data = parse_json(text, source)
    except UnreadableFile as exc:
        raise ValueError(f"{source}: {exc.why}") from None
    if not isinstance(data, dict) or data.get("schema") != "kvpersist.manifest/1":
        raise ValueError(f"{source}: not a kvpersist.manifest/1 document")
    ns = data.get("namespace")
    if not isinstance(ns, str) or not is_namespace(ns):
        raise ValueError(f"{source}: bad namespace {str(ns)[:80]!r}")
    name = data.get("lmcache_model_name", ns)
    pinned = data.get("pinned", False)
    ident = data.get("identity")
    dep = data.get("deployment", {})
    why = ("lmcache_model_name is not a string" if not _short(name) else
           "pinned is not true or false" if not isinstance(pinned, bool) else
           "identity is not an object" if ident is not None and not isinstance(ident, dict)
           else "deployment is not an object" if not isinstance(dep, dict) else
           _values_problem("identity", ident or {}) or _values_problem("deployment", dep))
    if why:
        raise ValueError(f"{source}: {why}")
    return Manifest(namespace=ns, lmcache_model_name=name or ns, pinned=pinned,
                    identity=ident, deployment=dep)


def _short(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= MAX_VALUE_CHARS


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float) or _short(value)


def _values_problem(field: str, values: dict[str, Any]) -> str:
    """Why a value of the manifest object ``field`` is not one report may show, or ''."""
    for key, value in values.items():
        inner = list(value.values()) if isinstance(value, dict) else (
            value if isinstance(value, list) else [value])
        if not _short(key) or not all(_scalar(v) for v in inner):
            return (f"{field}.{key[:80]} is not a string of at most {MAX_VALUE_CHARS:,} "
                    "characters, a number, a boolean or null")
    return ""


def default_manifest_dirs(root: str | os.PathLike[str]) -> list[str]:
    """Where manifests of a root's deployments are when KVP_STATE_DIR is not set: beside the
    root (``<parent>/.kvpersist/<root name>/manifests``, the default since 0.2) and inside it
    (``<root>/.kvpersist/manifests``, kvpersist 0.1)."""
    r = Path(os.path.abspath(root))
    return [str(r.parent / META_DIR / r.name / MANIFESTS_DIR),
            str(r / META_DIR / MANIFESTS_DIR)]


def read_manifests(
    root: RootDir, extra_dirs: tuple[str, ...] | list[str] = ()
) -> tuple[dict[str, Manifest], list[str]]:
    """All readable manifests of the open ``root`` by namespace, and messages about bad ones.

    Reads the :func:`default_manifest_dirs` of ``root`` and any ``extra_dirs`` (the manifest
    directories of deployments whose KVP_STATE_DIR is set); the newest manifest of a
    namespace wins.
    """
    return read_manifests_at(root.path, extra_dirs)


def read_manifests_at(
    root: str | os.PathLike[str], extra_dirs: tuple[str, ...] | list[str] = ()
) -> tuple[dict[str, Manifest], list[str]]:
    """:func:`read_manifests` for a root named by its path, not open (it may not exist yet:
    the inventory asks which namespaces are active before anything is scanned).

    Every ``*.json`` entry of a manifest directory is read (a link, a FIFO, a directory named
    so is a problem, never followed nor opened blocking); problems name their file, the first
    :data:`~kvpersist.errors.MAX_PROBLEMS` listed and the others counted. Never raises."""
    found: dict[str, Manifest] = {}
    problems = Problems()
    dirs = [*default_manifest_dirs(root), *extra_dirs]
    for mdir in dict.fromkeys(os.path.realpath(d) for d in dirs):
        try:
            dfd = os.open(mdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.add(Problem(show_path(mdir), exc.strerror or str(exc)))
            continue
        try:
            _read_dir(dfd, mdir, found, problems)
        finally:
            os.close(dfd)
    listed = [f"{p.where}: {p.message}" for p in problems.kept]
    if problems.more:
        listed.append(f"and {problems.more:,} more unreadable manifest(s) (the first "
                      f"{MAX_PROBLEMS} are listed)")
    return found, listed


def _read_dir(dfd: int, mdir: str, found: dict[str, Manifest], problems: Problems) -> None:
    """Read the manifests of the directory ``dfd`` (``mdir``) into ``found``."""
    try:
        entries = list(os.scandir(dfd))
    except OSError as exc:
        problems.add(Problem(show_path(mdir), exc.strerror or str(exc)))
        return
    for e in entries:
        if not e.name.endswith(".json"):
            continue
        where = show_path(os.path.join(mdir, e.name))
        try:
            st = os.stat(e.name, dir_fd=dfd, follow_symlinks=False)
            data = read_bytes(e.name, dir_fd=dfd, follow=False, max_bytes=MAX_STATE_BYTES)
            m = parse_manifest(data, where)
        except FileNotFoundError:
            continue  # removed since the listing (a prune)
        except UnreadableFile as exc:
            problems.add(Problem(where, exc.why))
            continue
        except ValueError as exc:
            problems.add(Problem(where, str(exc).removeprefix(f"{where}: ")))
            continue
        except OSError as exc:
            problems.add(Problem(where, exc.strerror or str(exc)))
            continue
        if e.name != f"{m.namespace}.json":
            problems.add(Problem(where, f"namespace {m.namespace} does not match the file "
                                 "name"))
            continue
        old = found.get(m.namespace)
        if old is None or old.mtime_ns < st.st_mtime_ns:
            found[m.namespace] = Manifest(
                m.namespace, m.lmcache_model_name, m.pinned, m.identity, m.deployment,
                st.st_mtime_ns,
            )


def manifest_dirs(deployments: Iterable[Deployment]) -> list[str]:
    """The manifest directories of deployments (``<KVP_STATE_DIR>/manifests``)."""
    out = []
    for d in deployments:
        if d.settings.state_dir:
            out.append(os.path.join(d.settings.state_dir, MANIFESTS_DIR))
    return out


def remove_manifest(manifest_dir: str, namespace: str) -> bool:
    """Remove ``<manifest_dir>/<namespace>.json`` if it is a regular file; True if removed.

    The directory is opened without following a symlink and the file is removed relative to
    it. Raises OSError (other than a missing file or directory)."""
    try:
        dfd = os.open(manifest_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        name = f"{namespace}.json"
        try:
            st = os.lstat(name, dir_fd=dfd)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return False
        os.unlink(name, dir_fd=dfd)
        return True
    finally:
        os.close(dfd)
