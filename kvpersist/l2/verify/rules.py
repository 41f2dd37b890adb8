"""What ``verify`` can tell about a chunk file without its plaintext (pure).

LMCache's aesgcm serde authenticates a frame but does not bind it to its object key (no
associated data): a valid frame of one chunk stored under another chunk's name authenticates
and is served as that chunk's KV. Nor does LMCache's POSIX adapter open chunk files with
``O_NOFOLLOW``, check that they are regular files, or report a file it cannot read as
anything but a miss. So, besides authentication, three rules (docs/lmcache-failure-paths.md):

* ``type``: an entry under a chunk name that is not a regular file. A symbolic link is read
  through (whatever it points to is served as this chunk); a FIFO blocks the adapter's event
  loop in ``open()`` (every L2 read and write of the server stalls until someone writes to
  it); anything else is a miss every time.
* ``perm``: a regular chunk file that the cache root's owner -- the user the server runs as --
  cannot read by its mode bits: LMCache gets EACCES, a miss every time, for as long as it
  stays (it never rewrites a name that exists).
* ``dup``: the same frame under two or more names. Each frame carries a 12-byte IV that the
  serializer draws from ``os.urandom`` for every write, so two names holding one IV are a
  copy or a hard link of one chunk's file under another chunk's name; which name is genuine
  cannot be told, so every one of them is a finding.

What no rule here can see: another chunk's frame renamed over a name (``mv``), which leaves
a single copy of a valid frame under the wrong name. The namespace's frame record
(:mod:`kvpersist.l2.verify.frame_record`) remembers under which name each frame was seen
and finds it (``moved``) when the record saw that frame before; a frame it never saw cannot
be told from a chunk LMCache stored again. Only a binding of the frame to its key in LMCache
(the upstream report) closes that fully.
"""

from __future__ import annotations

import stat as stat_mod
from collections.abc import Hashable, Iterable
from typing import TypeVar

T = TypeVar("T", bound=Hashable)

_KINDS = ((stat_mod.S_ISLNK, "a symbolic link"), (stat_mod.S_ISFIFO, "a FIFO"),
          (stat_mod.S_ISDIR, "a directory"), (stat_mod.S_ISSOCK, "a socket"),
          (stat_mod.S_ISCHR, "a character device"), (stat_mod.S_ISBLK, "a block device"))


def type_verdict(mode: int) -> str | None:
    """The ``type`` finding's detail for an entry of ``mode`` under a chunk name, or None
    for a regular file."""
    if stat_mod.S_ISREG(mode):
        return None
    what = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    if stat_mod.S_ISLNK(mode):
        return (f"{what}: LMCache reads chunk files through links, so whatever it points "
                "to is served as this chunk")
    if stat_mod.S_ISFIFO(mode):
        return (f"{what}: LMCache's load blocks opening it, and every L2 read and write of "
                "the server with it")
    return f"{what}, not a chunk file: LMCache finds the name and misses on it every time"


def readable_by(mode: int, file_uid: int, file_gid: int, uid: int, gid: int) -> bool:
    """Whether a process of ``uid``/``gid`` (no supplementary groups, no capability) may
    read a file of ``mode`` owned by ``file_uid``/``file_gid``, by its permission bits."""
    if file_uid == uid:
        return bool(mode & stat_mod.S_IRUSR)
    if file_gid == gid:
        return bool(mode & stat_mod.S_IRGRP)
    return bool(mode & stat_mod.S_IROTH)


def perm_verdict(mode: int, file_uid: int, file_gid: int, uid: int, gid: int) -> str | None:
    """The ``perm`` finding's detail for a regular chunk file that the cache root's owner
    (``uid``/``gid``, the server's user) cannot read, or None."""
    if readable_by(mode, file_uid, file_gid, uid, gid):
        return None
    return (f"mode {stat_mod.S_IMODE(mode):04o}, owner {file_uid}: the cache root's owner "
            f"(uid {uid}), the user the server runs as, cannot read it; LMCache misses on it "
            "every time and never stores the chunk again while it stays")


def shared_frames(frames: Iterable[tuple[bytes, T]]) -> dict[T, int]:
    """For ``(iv, file)`` pairs of authenticated frames: each file whose IV is also the IV of
    another file, with the number of files sharing it (a file listed twice counts once)."""
    by_iv: dict[bytes, list[T]] = {}
    for iv, f in frames:
        same = by_iv.setdefault(iv, [])
        if f not in same:
            same.append(f)
    return {f: len(fs) for fs in by_iv.values() if len(fs) > 1 for f in fs}


def dup_detail(count: int) -> str:
    """The ``dup`` finding's detail for a frame stored under ``count`` names."""
    return (f"the same aesgcm frame is stored under {count} names: a copy or a hard link of "
            "one chunk's file under another chunk's name, which LMCache serves as that chunk "
            "(the frame is valid; it is not bound to its name); which name is genuine cannot "
            "be told")
