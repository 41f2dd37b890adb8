"""Pin manifests on a cache root (I/O): write, read, measure, remove.

``<root>/.kvpersist/pins/<namespace>.json`` (:mod:`kvpersist.l2.pins`). Everything is opened
relative to directory descriptors, never through a symlink, as :mod:`kvpersist.l2.runs` does.
Reading never creates anything; a manifest that is unreadable or not ours is reported and
ignored (its files are then not protected, and the problem says so).

Every function takes the open root (:class:`~kvpersist.l2.tree.RootDir`, opened and closed by the
use case).
"""

from __future__ import annotations

import json
import os
import stat as stat_mod
from typing import Any

from kvpersist.errors import KvpError
from kvpersist.l2.layout import META_DIR, is_namespace
from kvpersist.l2.pins import (
    MAX_BYTES,
    PINS_DIR,
    PinnedUsage,
    PinSet,
    parse_pin_document,
    pins_name,
)
from kvpersist.l2.tree import RootDir, meta_dir, open_rel, read_small_at, replace_at
from kvpersist.l2.usage import HIST_BUCKET_NS


def pins_path(root: str | os.PathLike[str], namespace: str) -> str:
    """``<root>/.kvpersist/pins/<namespace>.json``: where the pin manifest of ``namespace``
    lives (pure: the path as ``root`` names it)."""
    return os.path.join(os.fspath(root), META_DIR, PINS_DIR, pins_name(namespace))


def write_pins(root: RootDir, doc: dict[str, Any]) -> str:
    """Write a pin manifest (atomic, owner-only) into the root; return its path.
    Raises KvpError when it cannot be written (e.g. ``.kvpersist`` is a symlink)."""
    namespace = str(doc["namespace"])
    data = (json.dumps(doc, sort_keys=True) + "\n").encode()
    final = pins_name(namespace)
    dfd = meta_dir(root, PINS_DIR)
    try:
        replace_at(dfd, final, data)
    except OSError as exc:
        raise KvpError(f"cannot write {pins_path(root.path, namespace)}: "
                       f"{exc.strerror or exc}; run as the user that owns the cache") from None
    finally:
        os.close(dfd)
    return pins_path(root.path, namespace)


def read_pins(root: RootDir) -> tuple[dict[str, PinSet], list[str]]:
    """Every namespace's pins on ``root`` and problems met (a manifest not ours, unreadable,
    or naming files that are not its namespace's chunk files). Never creates anything."""
    pins: dict[str, PinSet] = {}
    problems: list[str] = []
    try:
        dfd = open_rel(root.fd, f"{META_DIR}/{PINS_DIR}")
    except FileNotFoundError:
        return pins, problems
    except OSError as exc:
        return pins, [f"{META_DIR}/{PINS_DIR}: {exc.strerror or exc}"]
    try:
        for name in sorted(os.listdir(dfd)):
            ns = name[:-5] if name.endswith(".json") else ""
            if not is_namespace(ns):
                continue
            pset, why = _read(dfd, name, ns)
            if pset is not None:
                pins[ns] = pset
            elif why:
                problems.append(f"{META_DIR}/{PINS_DIR}/{name}: {why}; its files are "
                                "not protected")
    finally:
        os.close(dfd)
    return pins, problems


def _read(dfd: int, name: str, namespace: str) -> tuple[PinSet | None, str]:
    try:
        doc = _load(dfd, name)
    except _Unreadable as exc:
        return None, str(exc)
    return parse_pin_document(doc, namespace)


class _Unreadable(KvpError):
    pass


def _load(dfd: int, name: str) -> Any:
    """The JSON document in ``name`` (never through a symlink); raises _Unreadable."""
    try:
        data = read_small_at(dfd, name, MAX_BYTES)
    except OSError as exc:
        raise _Unreadable(str(exc.strerror or exc)) from None
    if data is None:
        raise _Unreadable("too big")
    try:
        return json.loads(data)
    except ValueError:
        raise _Unreadable("not JSON") from None


def read_pin_document(root: RootDir, namespace: str) -> dict[str, Any] | None:
    """The pin manifest of ``namespace`` as a document, if it is a valid one (else None)."""
    try:
        dfd = open_rel(root.fd, f"{META_DIR}/{PINS_DIR}")
    except OSError:
        return None
    try:
        doc = _load(dfd, pins_name(namespace))
    except _Unreadable:
        return None
    finally:
        os.close(dfd)
    if not isinstance(doc, dict) or parse_pin_document(doc, namespace)[0] is None:
        return None
    return doc


def remove_pins(root: RootDir, namespace: str) -> bool:
    """Remove the pin manifest of ``namespace``; True if one was removed."""
    try:
        dfd = open_rel(root.fd, f"{META_DIR}/{PINS_DIR}")
    except FileNotFoundError:
        return False
    try:
        os.unlink(pins_name(namespace), dir_fd=dfd)
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)
    return True


def measure_pins(root: RootDir, pins: PinSet, *, hist: bool = False) -> PinnedUsage:
    """Stat each pinned file relative to the open root (never through a symlink): present
    files and bytes, missing ones, and (``hist``) their last-use histogram in the scan's
    buckets."""
    root_fd = root.fd
    files = nbytes = missing = 0
    use: dict[int, list[int]] = {}
    for rel in sorted(pins.files):
        head, _, name = rel.rpartition("/")
        try:
            if head:
                dfd = open_rel(root_fd, head)
                try:
                    st = os.lstat(name, dir_fd=dfd)
                finally:
                    os.close(dfd)
            else:
                st = os.lstat(name, dir_fd=root_fd)
        except OSError:
            missing += 1
            continue
        if not stat_mod.S_ISREG(st.st_mode):
            missing += 1
            continue
        files += 1
        nbytes += st.st_size
        if hist:
            b = max(st.st_mtime_ns, st.st_atime_ns) // HIST_BUCKET_NS
            h = use.setdefault(b, [0, 0])
            h[0] += 1
            h[1] += st.st_size
    return PinnedUsage(files, nbytes, missing, use if hist else None)
