"""The frame record on the cache root, and its check against the files (I/O).

The record of a namespace (:mod:`kvpersist.l2.verify.frame_record`: which frame each chunk
name held) is ``<cache root>/.kvpersist/frames/<namespace>.frames``: beside the files it
describes, so that it follows the root (a state dir is per deployment, and ``verify`` may be
run on a root alone), in kvpersist's own directory (0700, never through a symlink), written
owner-only (0600) through a temp file that is fsynced and renamed, then the directory
fsynced. Its name holds no ``.tmp.``: LMCache's clean-up at a graceful stop deletes such names
anywhere under the root.

It is read as untrusted: opened relative to the directory's descriptor without following a
symlink and without blocking (a FIFO), checked on the descriptor to be a regular file of the
root's owner that group and others cannot write, of at most
:data:`~kvpersist.l2.verify.frame_record.MAX_RECORD_BYTES`, and decoded by
:func:`~kvpersist.l2.verify.frame_record.decode` (version, namespace, counts, names,
checksum). A record that fails any of this is refused, with a warning naming it and why:
the check then starts a new record (what the old one knew is lost, and said so).

:func:`bind_frames` is the check: given the namespace's chunk files as a walk listed them,
the identities that authentication already read (verify, the crash-window check, scrub: no
file is read twice), it reads the first 13 bytes of each other file that changed since the
record saw it (a new inode or ctime), judges every identity read, and learns what is not a
finding.
"""

from __future__ import annotations

import os
import stat as stat_mod
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvpersist.errors import KvpError
from kvpersist.l2.frames import Deadline
from kvpersist.l2.layout import META_DIR
from kvpersist.l2.tree import RootDir, meta_dir, open_rel, replace_at
from kvpersist.l2.verify.frame_record import (
    HEADER_BYTES,
    MAX_RECORD_BYTES,
    FrameRecord,
    Verdict,
    decode,
    encode,
    identity_of,
    judge,
)
from kvpersist.l2.verify.quarantine import Seen
from kvpersist.system.untrusted import ChunkFile, UnreadableFile

FRAMES_DIR = "frames"
SUFFIX = ".frames"
#: why the record does not apply to a deployment with ``serde: none``
SERDE_NONE = ("serde none: a chunk file holds no frame, so it has no identity to record; "
              "verify's size, type and permission rules still apply")


def record_name(namespace: str) -> str:
    return f"{namespace}{SUFFIX}"


def record_path(root: RootDir, namespace: str) -> str:
    """Where ``namespace``'s record is, as shown in messages."""
    return os.path.join(root.given or root.path, META_DIR, FRAMES_DIR, record_name(namespace))


@dataclass
class FrameSummary:
    """What a check of the frame record saw and did (the ``frames`` object of verify's, the
    crash-window check's and scrub's JSON)."""

    applies: bool = True
    #: why it does not apply (``serde: none``)
    reason: str = ""
    #: names in the record before the check
    recorded: int = 0
    #: chunk files of the namespace listed
    files: int = 0
    #: identities given by the authentication of this run (no read of their own)
    authenticated: int = 0
    #: files whose first bytes were read: they changed since the record saw them
    read: int = 0
    unchanged: int = 0
    new: int = 0
    rewritten: int = 0
    restored: int = 0
    moved: int = 0
    dup: int = 0
    #: recorded names whose files are gone
    gone: int = 0
    #: changed files not read: the time bound ran out (the next check reads them)
    unchecked: int = 0
    #: files whose first bytes are not an aesgcm frame (verify's ``size``/``auth`` business)
    not_frames: int = 0
    #: names not learned: the record is full
    full: int = 0
    #: the record's size on disk after the check (0: not written)
    record_bytes: int = 0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the record file


def load(root: RootDir, namespace: str) -> tuple[FrameRecord, str]:
    """The record of ``namespace`` on the open ``root`` (an empty one when there is none),
    and a warning when one was there but refused (then the record returned is empty, and
    marked changed so that a new one replaces it). Never raises."""
    where = record_path(root, namespace)
    fresh = FrameRecord(namespace)
    try:
        dfd = open_rel(root.fd, f"{META_DIR}/{FRAMES_DIR}")
    except FileNotFoundError:
        return fresh, ""
    except (OSError, ValueError) as exc:
        return fresh, _refused(where, getattr(exc, "strerror", None) or str(exc))
    try:
        data = _read_bounded(dfd, record_name(namespace), root)
    except FileNotFoundError:
        return fresh, ""
    except _Refused as exc:
        fresh.changed = True
        return fresh, _refused(where, str(exc))
    finally:
        os.close(dfd)
    try:
        return decode(data, namespace), ""
    except ValueError as exc:
        fresh.changed = True
        return fresh, _refused(where, str(exc))


def _refused(where: str, why: str) -> str:
    return (f"frame record {where} refused: {why}; a new record is started (the frames it "
            "held are forgotten: a frame moved meanwhile under another name is not found)")


class _Refused(KvpError):
    """Why a record file is not read (caught here: a refused record is a warning)."""


def _read_bounded(dfd: int, name: str, root: RootDir) -> bytes:
    """The record file ``name`` of ``dfd``: a regular file of the root's owner, not writable
    by group or others, of at most MAX_RECORD_BYTES. Raises FileNotFoundError or
    _Refused."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dfd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _Refused(f"cannot open it: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        owner = os.fstat(root.fd).st_uid
        if not stat_mod.S_ISREG(st.st_mode):
            raise _Refused("not a regular file")
        if st.st_uid != owner or st.st_mode & 0o022:
            raise _Refused(f"owner uid {st.st_uid}, mode {stat_mod.S_IMODE(st.st_mode):04o}: "
                           "only the cache root's owner may write it")
        if st.st_size > MAX_RECORD_BYTES:
            raise _Refused(f"{st.st_size:,} bytes, more than the {MAX_RECORD_BYTES:,} a "
                           "record may hold")
        parts: list[bytes] = []
        size = 0
        while size <= MAX_RECORD_BYTES:
            block = os.read(fd, min(1 << 20, MAX_RECORD_BYTES + 1 - size))
            if not block:
                break
            parts.append(block)
            size += len(block)
        if size > MAX_RECORD_BYTES:
            raise _Refused(f"more than the {MAX_RECORD_BYTES:,} bytes a record may hold")
        return b"".join(parts)
    except OSError as exc:
        raise _Refused(f"cannot read it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def save(root: RootDir, record: FrameRecord) -> tuple[int, str]:
    """Write ``record`` if it changed (atomically, owner-only). Returns (its size in bytes,
    0 when not written; a warning when it could not be written: the check's verdicts stand).
    """
    if not record.changed:
        return 0, ""
    data = encode(record)
    try:
        dfd = meta_dir(root, FRAMES_DIR)
        try:
            _replace(dfd, record_name(record.namespace), data)
        finally:
            os.close(dfd)
    except KvpError as exc:
        return 0, f"the frame record was not written: {exc}"
    except OSError as exc:
        return 0, (f"the frame record was not written: {record_path(root, record.namespace)}: "
                   f"{exc.strerror or exc}")
    record.changed = False
    return len(data), ""


def _replace(dfd: int, final: str, data: bytes) -> None:
    """``data`` as ``final`` in ``dfd`` (``replace_at``: 0600, never through a link, fsynced,
    renamed), then the directory fsynced. Raises OSError."""
    replace_at(dfd, final, data)
    os.fsync(dfd)


def remove(root: RootDir, namespace: str) -> bool:
    """Remove ``namespace``'s record (prune of a whole namespace); whether there was one.
    Raises OSError."""
    try:
        dfd = open_rel(root.fd, f"{META_DIR}/{FRAMES_DIR}")
    except FileNotFoundError:
        return False
    try:
        os.unlink(record_name(namespace), dir_fd=dfd)
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)
    return True


# --------------------------------------------------------------------------- the check

#: reads the first HEADER_BYTES of a listed file: None when it is gone or no longer the
#: file listed (then it is not judged); raises frames.Deadline past the time bound
HeaderReader = Callable[[Seen], bytes | None]


def bind_frames(record: FrameRecord, listed: Iterable[Seen], ivs: Mapping[str, bytes], *,
                skip: frozenset[str] | set[str] = frozenset(),
                read_header: HeaderReader, out_of_time: Callable[[], bool],
                complete: bool = True) -> tuple[list[tuple[Seen, str, str]], FrameSummary]:
    """Check the namespace's chunk files ``listed`` (by a walk: regular files named as its
    chunks) against ``record``, and learn from them.

    ``ivs``: the identities this run's authentication read (name -> IV), used as they are;
    every other listed file that the record does not know as it is now (inode, ctime) has
    its first bytes read with ``read_header``, while ``out_of_time`` says no (the rest is
    ``unchecked``: not judged, not learned, read by the next check). ``skip``: names that are
    findings already (not read, not judged). ``complete``: whether ``listed`` is every chunk
    file of the namespace (then a recorded name not listed is gone); a listing of a window
    is not.

    Returns the findings (the file, its kind ``moved`` or ``dup``, the detail) and the
    summary; ``record`` is updated in place (not written)."""
    t0 = time.monotonic()
    out = FrameSummary(recorded=len(record))
    by_name: dict[str, Seen] = {}
    twice: set[str] = set()
    for s in listed:
        if s.name in by_name:
            twice.add(s.name)  # flat and sharded at once: LMCache reads one; not judged
        by_name[s.name] = s
    out.files = len(by_name)
    seen: dict[str, bytes] = {}
    stats: dict[str, tuple[int, int]] = {}
    todo: list[Seen] = []
    for name, s in by_name.items():
        if name in skip or name in twice:
            continue
        iv = ivs.get(name)
        if iv is not None:
            seen[name], stats[name] = iv, (s.ino, s.ctime_ns)
            out.authenticated += 1
        elif record.known(name, s.ino, s.ctime_ns):
            out.unchanged += 1
        else:
            todo.append(s)
    for i, s in enumerate(todo):
        if out_of_time():
            out.unchecked = len(todo) - i
            break
        try:
            header = read_header(s)
        except Deadline:
            out.unchecked = len(todo) - i
            break
        if header is None:
            continue
        out.read += 1
        ident = identity_of(header)
        if ident is None:
            out.not_frames += 1
            continue
        seen[s.name], stats[s.name] = ident, (s.ino, s.ctime_ns)
    judged = judge(record, seen, set(by_name) if complete else None)
    for verdict in Verdict:
        if verdict != Verdict.UNCHANGED:
            setattr(out, str(verdict), judged.count(verdict))
    out.unchanged += judged.count(Verdict.UNCHANGED)
    out.gone = len(judged.gone)
    full_before = record.full
    record.learn(judged, seen, stats)
    out.full = record.full - full_before
    if out.full:
        out.warnings.append(f"the frame record is full ({MAX_RECORD_BYTES:,} bytes): "
                            f"{out.full} name(s) not recorded")
    findings = [(by_name[n], kind, detail) for n, (kind, detail) in judged.findings().items()]
    out.seconds = time.monotonic() - t0
    return findings, out


def header_reader(dirs_get: Callable[[str], int], max_bytes: int,
                  on_read: Callable[[int], None] | None = None) -> HeaderReader:
    """A :data:`HeaderReader` opening each file relative to its directory's descriptor
    (``dirs_get(rel)``) as a chunk file of at most ``max_bytes`` bytes (never through a
    symlink, never blocking), reading its first bytes only if it is still the file listed."""
    def read(s: Seen) -> bytes | None:
        try:
            with ChunkFile(dirs_get(s.rel), s.name, max_bytes=max_bytes,
                           on_read=on_read) as f:
                if not s.same(f.st) or f.st.st_ctime_ns != s.ctime_ns:
                    return None
                return f.pread(0, HEADER_BYTES)
        except (OSError, UnreadableFile):
            return None

    return read
