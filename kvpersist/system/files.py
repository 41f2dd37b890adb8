"""Small filesystem helpers for the I/O layer: one atomic writer, one statvfs reader, one
checked reader of small files that must not be changed (or, secrets, read) by others.

Every error is raised as :class:`~kvpersist.errors.KvpError` with the path and a fix, so a
caller never lets an ``OSError`` reach the user as a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpersist.errors import EXIT_USAGE, KvpError, UsageError
from kvpersist.system.untrusted import show_path

#: mode bits that let users other than the owner and its group into a directory (the cache
#: root: the KV data it holds reveals prompts)
OTHERS_BITS = 0o007
#: mode bits that make a secret (the L2 master key, the shared tier's password file) readable
#: by someone other than its owner
SECRET_BITS = 0o077
#: mode bits that let group or others change a file anyone may read (a CA certificate)
WRITE_BITS = 0o022


def accessible_to_others(mode: int) -> bool:
    """True when a directory of ``mode`` lets users other than its owner and group in (pure):
    the cache root must not."""
    return bool(stat.S_IMODE(mode) & OTHERS_BITS)


def readable_by_others(mode: int) -> bool:
    """True when a secret file of ``mode`` is not owner-only (pure)."""
    return bool(stat.S_IMODE(mode) & SECRET_BITS)


def make_dirs(path: str | os.PathLike[str], mode: int = 0o700) -> None:
    """Create the directory ``path`` and every missing directory above it, each with
    ``mode`` (``Path.mkdir(parents=True, mode=...)`` gives the parents the default mode: a
    fresh state dir's ``.kvpersist`` was seen at 0755). An existing directory is left as it
    is. Raises OSError (FileExistsError when something else than a directory is there)."""
    target = Path(os.path.abspath(path))
    missing: list[Path] = []
    while not target.is_dir():
        missing.append(target)
        if target.parent == target:
            break
        target = target.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            if not d.is_dir():  # another process may have made it meanwhile
                raise


def atomic_write(path: str | os.PathLike[str], text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` through a temp file + fsync + rename, with ``mode``.

    Readers see the old file or the new one, never a half-written one. Missing parent
    directories are created 0700 (:func:`make_dirs`). Raises KvpError if the file cannot be
    written.
    """
    target = Path(path)
    try:
        make_dirs(target.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise KvpError(f"cannot write {show_path(target)}: {exc.strerror or exc}; check that "
                       "its directory exists and is writable by this user") from exc
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise KvpError(f"cannot write {show_path(target)}: {exc.strerror or exc}") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike[str], obj: Any, mode: int = 0o600) -> None:
    """:func:`atomic_write` of ``obj`` as indented, key-sorted JSON with a final newline."""
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", mode)


def nearest_existing(path: str | os.PathLike[str]) -> Path:
    """``path`` or its closest existing ancestor (for statvfs before the root exists)."""
    current = Path(os.path.abspath(path))
    while not current.exists() and current.parent != current:
        current = current.parent
    return current


@dataclass(frozen=True)
class FsInfo:
    """The filesystem holding a path (from statvfs): size, free, free for unprivileged users,
    and whether this process's mount of it is read-only (``ST_RDONLY``: every write from here
    fails with EROFS).

    ``fs_read_only`` is the filesystem's own state (its superblock's options in
    ``/proc/self/mountinfo``; None where they could not be read): ``read_only`` with
    ``fs_read_only`` False means only this process's view is read-only (a read-only bind
    mount, or a sandbox such as systemd's ``ProtectSystem=strict``), not the filesystem the
    cache server writes to."""

    total_bytes: int
    free_bytes: int
    avail_bytes: int
    read_only: bool = False
    fs_read_only: bool | None = None

    @property
    def sandboxed(self) -> bool:
        """Read-only here, read-write in itself: a read-only view (see the class)."""
        return self.read_only and self.fs_read_only is False

    @property
    def filesystem_read_only(self) -> bool:
        """The filesystem itself is read-only (where that could not be read: this view)."""
        return self.read_only and not self.sandboxed


def _unescape_mount_path(field: str) -> str:
    """A path field of mountinfo (spaces, tabs, newlines and backslashes as octal escapes)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def superblock_read_only(mountinfo: str, path: str) -> bool | None:
    """Whether the filesystem mounted at the deepest mount point above ``path`` (absolute,
    symlinks resolved) is read-only in itself, from the text of ``/proc/self/mountinfo``
    (pure): the ``ro`` of its super options (the last field), not of the mount's own options.
    None where no line names a mount point above ``path`` or a line cannot be read."""
    best: tuple[int, bool] | None = None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) < 10 or "-" not in fields[6:]:
            continue
        point = _unescape_mount_path(fields[4])
        sep = fields.index("-", 6)
        if len(fields) < sep + 4:
            continue
        inside = path == point or point == "/" or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), "ro" in fields[sep + 3].split(","))
    return None if best is None else best[1]


def fs_info(path: str | os.PathLike[str]) -> FsInfo:
    """statvfs of the filesystem holding ``path`` (or its nearest existing ancestor), and the
    filesystem's own read-only state where this process's mount of it is read-only.

    Raises KvpError if it cannot be read.
    """
    where = nearest_existing(path)
    try:
        sv = os.statvfs(where)
    except (OSError, ValueError) as exc:
        raise KvpError(f"cannot stat the filesystem of {path}: {exc}") from exc
    read_only = bool(sv.f_flag & os.ST_RDONLY)
    fs_read_only: bool | None = read_only
    if read_only:  # the filesystem itself, or only this view of it?
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                fs_read_only = superblock_read_only(f.read(), os.path.realpath(where))
        except OSError:
            fs_read_only = None
    return FsInfo(total_bytes=sv.f_blocks * sv.f_frsize, free_bytes=sv.f_bfree * sv.f_frsize,
                  avail_bytes=sv.f_bavail * sv.f_frsize, read_only=read_only,
                  fs_read_only=fs_read_only)


def trust_problems(path: str | os.PathLike[str], uid: int | None = None,
                   also: tuple[int, ...] = ()) -> list[str]:
    """Why ``path`` cannot be trusted by the user ``uid`` (default: this process), as sshd
    checks its key files: the path itself (if it exists) must belong to ``uid`` (or to one of
    ``also``: the service user, when root acts for it); every directory above it must belong
    to one of those or to root and must not be writable by group or others unless it has the
    sticky bit (``/tmp``). Anyone who can replace a directory on the way can replace what
    lies below it (a key, a chunk file that authenticates).

    Returns every problem found (empty when trusted); symlinks on the way are reported, not
    followed. Never raises.
    """
    me = os.geteuid() if uid is None else uid
    trusted = {me, *also}
    out: list[str] = []
    current = Path(os.path.abspath(path))
    try:
        st = os.lstat(current)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        return [f"{current}: cannot check its owner ({exc.strerror})"]
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            out.append(f"{current} is a symbolic link; point the setting at the real path")
        elif st.st_uid not in trusted:
            out.append(f"{current} belongs to uid {st.st_uid}, not to this user (uid {me})"
                       + (f" nor to the service user (uid {also[0]})" if also else "")
                       + ": chown it to the service user, or run as its owner")
    for parent in current.parents:
        try:
            pst = os.lstat(parent)
        except FileNotFoundError:
            continue  # not created yet
        except OSError as exc:
            out.append(f"{parent}: cannot check its owner ({exc.strerror})")
            continue
        if stat.S_ISLNK(pst.st_mode):
            continue  # an operator's link (e.g. /var -> /srv/var): its target is checked too
        if pst.st_uid not in trusted | {0}:
            out.append(f"{parent} (above {current}) belongs to uid {pst.st_uid}: that user "
                       f"could replace what lies below it")
        if pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not pst.st_mode & stat.S_ISVTX:
            out.append(f"{parent} (above {current}) is writable by group or others without "
                       f"the sticky bit (mode {stat.S_IMODE(pst.st_mode):04o}): anyone could "
                       f"replace what lies below it; chmod go-w {parent}")
    return out


def service_uids(user: str) -> tuple[int, ...]:
    """The uid of the service user ``user`` as a tuple for :func:`trust_problems` (empty for
    no user). Raises KvpError if there is no such user on this host."""
    if not user:
        return ()
    import pwd

    try:
        return (pwd.getpwnam(user).pw_uid,)
    except KeyError:
        raise KvpError(f"KVP_SERVICE_USER: no user {user!r} on this host; create the service "
                       "user or fix the name") from None


def open_textfile_dir(directory: str | os.PathLike[str]) -> int:
    """The descriptor of the textfile directory ``directory``, opened without following a
    symbolic link at its last component (the caller closes it). Raises UsageError (exit 2)
    for a symbolic link, something that is not a directory or a directory that does not
    exist; KvpError when it cannot be opened."""
    shown = show_path(directory)
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(directory):
            raise UsageError(f"--textfile {shown} is a symbolic link: kvpersist writes no file "
                             "through one; give the directory itself (readlink -f)") from None
        if isinstance(exc, FileNotFoundError | NotADirectoryError):
            raise UsageError(f"--textfile {shown}: {exc.strerror}; give node_exporter's "
                             "textfile-collector directory") from None
        raise KvpError(f"cannot open {shown}: {exc.strerror or exc}") from None


def write_textfile_at(dir_fd: int, name: str, registry: Any, shown: str = "") -> None:
    """Write a ``prometheus_client`` registry's exposition as ``name`` in the directory
    ``dir_fd``: a temp file created beside it (``O_EXCL``, never through a link), then
    renamed over ``name`` (node_exporter never reads half a file; a link named ``name`` is
    replaced, never followed). The file is 0644: node_exporter (another user) reads it; it
    holds no secret. Raises KvpError."""
    from prometheus_client import generate_latest

    data = generate_latest(registry)
    tmp = f".{name}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644, dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise KvpError(f"cannot write {shown or name}: {exc.strerror or exc}; check that this "
                       "user may write there") from exc


def direct_io_problem(directory: str | os.PathLike[str]) -> str:
    """Why files in ``directory`` cannot be opened with ``O_DIRECT`` ('' when they can, or
    when the probe cannot tell). The probe is an unnamed ``O_TMPFILE`` opened with
    ``O_DIRECT``: nothing is created under a name, nothing is left behind. tmpfs, for one,
    refuses O_DIRECT with EINVAL."""
    import errno

    flags = getattr(os, "O_TMPFILE", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if not flags or not direct:
        return ""
    try:
        fd = os.open(directory, flags | os.O_RDWR | direct | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return f"the filesystem of {os.fspath(directory)} does not support O_DIRECT"
        return ""  # no O_TMPFILE support (EISDIR, EOPNOTSUPP), no permission...: unknown
    os.close(fd)
    return ""


def file_problems(path: str | os.PathLike[str], st: os.stat_result, *,
                  owners: Collection[int] | None, me: int, secret: bool) -> list[str]:
    """Why the file that ``st`` describes (an ``fstat`` of the open ``path``) cannot be trusted
    (pure): not a regular file; owned by a uid not in ``owners`` (None: not checked here);
    with ``secret``, readable by others (:data:`SECRET_BITS`); without (a file that is no
    secret, e.g. a CA certificate), writable by group or others (:data:`WRITE_BITS`). Each
    problem names ``path`` and its fix."""
    p = os.fspath(path)
    if not stat.S_ISREG(st.st_mode):
        return [f"{p} is not a regular file"]
    out = []
    if owners is not None and st.st_uid not in owners:
        out.append(f"{p} belongs to uid {st.st_uid}, not to the cache server's user (uid "
                   f"{me}); chown it")
    mode = stat.S_IMODE(st.st_mode)
    if secret and readable_by_others(mode):
        out.append(f"{p} is readable by others (mode {mode:04o}); chmod 600 {p}")
    elif not secret and mode & WRITE_BITS:
        out.append(f"{p} is writable by group or others (mode {mode:04o}); chmod go-w {p}")
    return out


class UnusableSecret(KvpError):
    """A key, secret or CA file a setting names cannot be used (missing, a link, a FIFO, too
    big, readable by others, not what its format says): a configuration error, exit 2,
    whichever command meets it (issue 40: ``fleet status`` and ``scrub`` exited 1, which
    ``scrub`` also means for "dirty padding left")."""

    exit_code = EXIT_USAGE


def read_checked(path: str | os.PathLike[str], *, what: str, fix: str, max_bytes: int,
                 also: tuple[int, ...] = (), secret: bool = True) -> tuple[bytes, list[str]]:
    """Open ``path`` without following a symbolic link and without blocking (a FIFO), check
    what was opened (:func:`file_problems`: with ``secret`` it must belong to this user or one
    of ``also`` and be readable by nobody else) and read at most ``max_bytes`` of it.

    Returns (the bytes read: none when it is not a regular file or, ``secret``, when it has a
    problem; every problem found). Raises :class:`UnusableSecret` (exit 2: "``what``
    ``path``: why; ``fix``") when it cannot be opened or read."""
    p = os.fspath(path)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(p, flags)
    except OSError as exc:
        raise UnusableSecret(f"{what} {p}: {exc.strerror}" + (f"; {fix}" if fix else "")
                             ) from exc
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        problems = file_problems(p, st, owners={me, *also} if secret else None, me=me,
                                 secret=secret)
        if not stat.S_ISREG(st.st_mode) or (secret and problems):
            return b"", problems
        chunks: list[bytes] = []
        left = max_bytes
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), problems
    except OSError as exc:
        raise UnusableSecret(f"cannot read {what} {p}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def read_owner_only(path: str | os.PathLike[str], *, what: str, max_bytes: int,
                    also: tuple[int, ...] = (), fix: str = "") -> bytes:
    """The content of the secret file ``path``: a regular file (no symbolic link, no FIFO)
    that belongs to this user (or one of ``also``: the service user, when root acts for it),
    readable by nobody else, of at most ``max_bytes`` bytes. ``what`` names it in errors
    ("shared tier secret file"), ``fix`` says what to check when it cannot be opened.

    Raises :class:`UnusableSecret` (exit 2: a configuration error) naming the file, the
    first problem and its fix (never the content)."""
    data, problems = read_checked(path, what=what, fix=fix, max_bytes=max_bytes + 1,
                                  also=also, secret=True)
    if problems:
        raise UnusableSecret(f"{what} {problems[0]}")
    if len(data) > max_bytes:
        raise UnusableSecret(f"{what} {os.fspath(path)} holds more than {max_bytes} bytes; "
                             "point the setting at the right file")
    return data
