"""Pin manifests on a cache root (I/O): write, read, measure, remove.

``<root>/.kvpersist/pins/<namespace>.json`` (:mod:`kvpersist.l2.pins.usage`). Everything is opened
relative to directory descriptors, never through a symlink, as :mod:`kvpersist.l2.runs` does,
and read as untrusted (:mod:`kvpersist.system.untrusted`: a FIFO, a device, a link, a directory,
a file past :data:`~kvpersist.l2.pins.usage.MAX_BYTES`, a document nested deep or holding NaN are
each refused without hanging or reading it whole). Reading never creates anything; a
manifest that is unreadable or not ours is reported by name and its namespace is *held*
whole (every file of it counts as pinned: ``prune --stale/--unpinned/--to-budget`` leaves
them); a pins directory that cannot be listed holds every namespace.

Every function takes the open root (:class:`~kvpersist.l2.tree.RootDir`, opened and closed by the
use case).
"""

from __future__ import annotations

import json
import os
import stat as stat_mod
from typing import Any

from kvpersist.errors import MAX_PROBLEMS, KvpError, Problem, Problems
from kvpersist.l2.layout import META_DIR, is_namespace
from kvpersist.l2.pins.usage import (
    MAX_BYTES,
    MAX_CONTAINERS,
    PINS_DIR,
    PinnedUsage,
    PinRead,
    PinSet,
    held_set,
    parse_pin_document,
    pins_name,
)
from kvpersist.l2.tree import RootDir, meta_dir, open_rel, replace_at
from kvpersist.l2.usage import HIST_BUCKET_NS
from kvpersist.system.untrusted import UnreadableFile, read_json


def pins_path(root: str | os.PathLike[str], namespace: str) -> str:
    """``<root>/.kvpersist/pins/<namespace>.json``: where the pin manifest of ``namespace``
    lives (pure: the path as ``root`` names it)."""
    return os.path.join(os.fspath(root), META_DIR, PINS_DIR, pins_name(namespace))


def write_pins(root: RootDir, doc: dict[str, Any]) -> str:
    """Write a pin manifest (atomic, owner-only) into the root; return its path.
    Raises KvpError when it cannot be written (e.g. ``.kvpersist`` is a symlink) or would be
    bigger than its readers accept (:data:`~kvpersist.l2.pins.usage.MAX_BYTES`)."""
    namespace = str(doc["namespace"])
    data = (json.dumps(doc, sort_keys=True) + "\n").encode()
    final = pins_name(namespace)
    if len(data) > MAX_BYTES:
        raise KvpError(f"the pin manifest of {namespace} would be {len(data):,} bytes, more "
                       f"than the {MAX_BYTES:,} its readers accept: make the warm set smaller")
    dfd = meta_dir(root, PINS_DIR)
    try:
        replace_at(dfd, final, data)
    except OSError as exc:
        raise KvpError(f"cannot write {pins_path(root.path, namespace)}: "
                       f"{exc.strerror or exc}; run as the user that owns the cache") from None
    finally:
        os.close(dfd)
    return pins_path(root.path, namespace)


def read_pins(root: RootDir) -> PinRead:
    """Every namespace's pins on ``root``: the readable manifests, and for each one that is
    unreadable, not ours, or naming files that are not its namespace's chunk files, a
    *held* set (:func:`~kvpersist.l2.pins.usage.held_set`) and a problem naming it (the first
    :data:`~kvpersist.errors.MAX_PROBLEMS` listed, the others counted). A pins directory
    that cannot be listed is :attr:`~kvpersist.l2.pins.usage.PinRead.unreadable_dir` (every
    namespace held). Never raises for what it reads; never creates anything."""
    pins: dict[str, PinSet] = {}
    problems = Problems()
    where_dir = f"{META_DIR}/{PINS_DIR}"
    try:
        dfd = meta_dir(root, PINS_DIR, create=False)
    except FileNotFoundError:
        return PinRead(pins)
    except KvpError as exc:  # a link or a file in its place, or no permission
        why = f"{where_dir} cannot be listed: {exc}"
        return PinRead(pins, (f"{why}; every namespace is held as pinned until it is fixed",),
                       why)
    try:
        names = sorted(os.listdir(dfd))
        for name in names:
            ns = name[:-5] if name.endswith(".json") else ""
            if not is_namespace(ns):
                continue
            pset, why = _read(dfd, name, ns)
            if pset is None:
                problem = Problem(f"{where_dir}/{name}", why)  # a quote cut to its bound
                pset = held_set(ns, problem.message)
                problems.add(problem)
            pins[ns] = pset
    except OSError as exc:
        why = f"{where_dir}: cannot be listed ({exc.strerror or exc})"
        return PinRead(pins, (f"{why}; every namespace is held as pinned until it is fixed",),
                       why)
    finally:
        os.close(dfd)
    listed = [f"{p.where}: {p.message}; every file of its namespace is held as pinned until "
              "it is fixed or removed" for p in problems.kept]
    if problems.more:
        listed.append(f"and {problems.more:,} more unreadable pin manifest(s) in {where_dir} "
                      f"(the first {MAX_PROBLEMS} are listed); their namespaces are held too")
    return PinRead(pins, tuple(listed))


def _read(dfd: int, name: str, namespace: str) -> tuple[PinSet | None, str]:
    try:
        doc = _load(dfd, name)
    except UnreadableFile as exc:
        return None, exc.why
    return parse_pin_document(doc, namespace)


def _load(dfd: int, name: str) -> Any:
    """The JSON document in ``name`` (never through a symlink, at most
    :data:`~kvpersist.l2.pins.usage.MAX_BYTES`); raises UnreadableFile (also when it is absent)."""
    try:
        return read_json(name, dir_fd=dfd, follow=False, max_bytes=MAX_BYTES,
                         max_containers=MAX_CONTAINERS, where=f"{META_DIR}/{PINS_DIR}/{name}")
    except FileNotFoundError:
        raise UnreadableFile(name, "is gone") from None


def read_pin_document(root: RootDir, namespace: str) -> dict[str, Any] | None:
    """The pin manifest of ``namespace`` as a document, if it is a valid one (else None:
    the warm-up then computes the pins again and writes a valid one over it)."""
    try:
        dfd = open_rel(root.fd, f"{META_DIR}/{PINS_DIR}")
    except OSError:
        return None
    try:
        doc = _load(dfd, pins_name(namespace))
    except UnreadableFile:
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
    files and bytes, missing ones, and (``hist``) their last-use and write-time histograms in
    the scan's buckets."""
    root_fd = root.fd
    files = nbytes = missing = 0
    use: dict[int, list[int]] = {}
    written: dict[int, list[int]] = {}
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
            h = written.setdefault(st.st_mtime_ns // HIST_BUCKET_NS, [0, 0])
            h[0] += 1
            h[1] += st.st_size
    return PinnedUsage(files, nbytes, missing, use if hist else None,
                       written if hist else None)
