"""Namespace manifests: what render/launch recorded about each namespace (I/O: reading).

A manifest is ``<state dir>/manifests/<namespace>.json`` (schema ``kvpersist.manifest/1``),
written when a deployment is launched; report joins it with the files on disk to show which
model a namespace belongs to, and prune removes it with the namespace's last file.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpersist.l2.layout import MANIFESTS_DIR, META_DIR, is_namespace
from kvpersist.l2.tree import RootDir

if TYPE_CHECKING:
    from kvpersist.config.deployment import Deployment



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


def parse_manifest(text: str, source: str = "") -> Manifest:
    """Parse one manifest document. Raises ValueError if it is not a kvpersist manifest."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("schema") != "kvpersist.manifest/1":
        raise ValueError(f"{source}: not a kvpersist.manifest/1 document")
    ns = data.get("namespace")
    if not isinstance(ns, str) or not is_namespace(ns):
        raise ValueError(f"{source}: bad namespace {ns!r}")
    ident = data.get("identity")
    dep = data.get("deployment")
    return Manifest(
        namespace=ns,
        lmcache_model_name=str(data.get("lmcache_model_name") or ns),
        pinned=bool(data.get("pinned")),
        identity=ident if isinstance(ident, dict) else None,
        deployment=dep if isinstance(dep, dict) else {},
    )


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
    the inventory asks which namespaces are active before anything is scanned)."""
    found: dict[str, Manifest] = {}
    problems: list[str] = []
    dirs = [*default_manifest_dirs(root), *extra_dirs]
    for mdir in dict.fromkeys(os.path.realpath(d) for d in dirs):
        try:
            entries = list(os.scandir(mdir))
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"{mdir}: {exc.strerror}")
            continue
        for e in entries:
            if not e.name.endswith(".json") or not e.is_file(follow_symlinks=False):
                continue
            try:
                st = e.stat(follow_symlinks=False)
                with open(e.path, encoding="utf-8") as f:
                    m = parse_manifest(f.read(), e.path)
            except (OSError, ValueError) as exc:
                problems.append(str(exc))
                continue
            if e.name != f"{m.namespace}.json":
                problems.append(f"{e.path}: namespace {m.namespace} does not match the file name")
                continue
            old = found.get(m.namespace)
            if old is None or old.mtime_ns < st.st_mtime_ns:
                found[m.namespace] = Manifest(
                    m.namespace, m.lmcache_model_name, m.pinned, m.identity, m.deployment,
                    st.st_mtime_ns,
                )
    return found, problems


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
