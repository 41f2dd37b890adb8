"""Walking an L2 cache root (I/O): one descriptor-based walker that never follows a symlink.

Every directory below the root is opened with :data:`DIR_FLAGS` (``O_NOFOLLOW``,
``O_DIRECTORY``) relative to its parent's descriptor, so a symlink below the root is never
followed, not even one swapped in for a directory during a walk. The root itself may be a symlink
the operator set up: :func:`open_root` resolves it once and turns every way of failing to open it
into a :class:`~kvpersist.errors.KvpError` with a fix; the :class:`RootDir` it returns is the
handle a use case opens once and passes down (the l2 functions take it, never a path).

Two walks share one engine:

- :func:`walk_dirs` is generic: the caller lists each directory itself and names the
  subdirectories to walk next (:meth:`Dir.descend`), so every directory is listed once (the
  scanner walks the whole tree this way, foreign and metadata directories included).
- :func:`chunk_dirs` knows the layout: it yields the root and every ``ab/cd`` shard directory
  two levels down (both names two lowercase hex digits), never ``.kvpersist``, never a foreign
  directory. :meth:`ChunkDir.entries` lists a directory for the caller; the walker picks the
  shard directories out of that same listing, so a flat root is listed once.

Descriptors handed out belong to the walk: valid until it moves on, closed when it is exhausted
or its ``with`` block ends. :func:`meta_dir` opens (and creates) kvpersist's own directories
under ``.kvpersist`` the same way, refusing symlinks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as stat_mod
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, TypeVar

from kvpersist.errors import KvpError, UsageError
from kvpersist.l2.layout import META_DIR, display_name, is_shard_dir_name

#: How every directory of a walk is opened: read-only, must be a directory, never a symlink.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: How a file found by a walk is opened for reading: never through a symlink, and a fifo swapped
#: in for it cannot block the open.
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

#: The two shard directory names of a chunk directory (``("ab", "cd")``).
Shard = tuple[str, str]
#: Called with the relative path of a directory that could not be opened or listed.
ErrorFn = Callable[[str, OSError], None]

T = TypeVar("T")
W = TypeVar("W")


# --------------------------------------------------------------------------- opening


def open_dir(name: str, dir_fd: int | None = None) -> int:
    """Open directory ``name`` (relative to ``dir_fd`` when given) without following a symlink.

    Raises OSError (``ENOTDIR`` for a symlink or a file)."""
    return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


def open_rel(root_fd: int, rel: str) -> int:
    """Open directory ``rel`` below the root (``a/b``; "" is the root itself) one component at a
    time, never through a symlink. The caller closes the descriptor. Raises OSError, or
    ValueError for a path that leaves the root."""
    parts = [p for p in rel.split("/") if p and p != "."]
    if ".." in parts or rel.startswith("/"):
        raise ValueError(f"not a path below the cache root: {rel!r}")
    fd = open_dir(".", root_fd)
    try:
        for part in parts:
            nfd = open_dir(part, fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class RootDir:
    """The open cache root: THE handle every l2 function that works on a root takes.

    ``path`` is the root resolved once (symlinks followed when it was opened), ``fd`` a
    descriptor of it, ``given`` the root as the caller named it (for messages).

    The contract: the use case opens the root once (:func:`open_root`, or
    :func:`kvpersist.l2.inventory.open_existing` for a root that must hold a cache) and closes it
    with ``with``; the l2 functions it hands the root to use ``fd`` (and ``path`` for messages)
    and never close it. A child process forked during the ``with`` block inherits it; one that
    lists the root at the same time as this process takes :meth:`reopen` (a descriptor shares
    its read position between processes).
    """

    path: str
    fd: int
    #: the root as the caller named it (for messages)
    given: str = ""

    def reopen(self) -> int:
        """A new descriptor of this same directory (its own read position), opened relative to
        ``fd``, so never a path resolved again. The caller closes it. Raises OSError."""
        return open_dir(".", self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RootDir:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def replace_at(dfd: int, final: str, data: bytes) -> None:
    """Write ``data`` to ``final`` in the directory ``dfd`` atomically (a temp file created
    owner-only without following a symlink, fsynced, then renamed over ``final``); the temp
    file is removed on any failure, which is raised."""
    tmp = f".{final}.{os.getpid()}.part"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dfd)
    try:
        try:
            os.fchmod(fd, 0o600)  # a leftover temp file of an earlier crash keeps its mode
            view = memoryview(data)
            while view:  # a short write (a signal, a full disk's last blocks) is continued
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise


def open_root(root: str | os.PathLike[str], *, purpose: str = "open") -> RootDir:
    """Resolve ``root`` (it may be a symlink) and open it as a directory: the handle of one use
    case (the caller closes it, with ``with``).

    ``purpose`` names the operation in messages (``cannot scan /x: ...``). Raises UsageError when
    the root does not exist or is not a directory, KvpError when it cannot be opened.
    """
    given = os.fspath(root)
    path = os.path.realpath(given)
    shown = display_name(given)
    try:
        fd = open_dir(path)
    except FileNotFoundError:
        raise UsageError(f"cannot {purpose} {shown}: no such directory (check --root or "
                         "KVP_CACHE_ROOT; only `kvp-admin launch` creates one, mode 0700)"
                         ) from None
    except NotADirectoryError:
        raise UsageError(f"cannot {purpose} {shown}: not a directory (check --root or "
                         "KVP_CACHE_ROOT)") from None
    except PermissionError as exc:
        raise KvpError(f"cannot {purpose} {shown}: {exc.strerror}; run as the user that owns "
                       "the cache (or one that may read it)") from None
    except OSError as exc:
        raise KvpError(f"cannot {purpose} {shown}: {exc.strerror or exc}; check that the "
                       "filesystem is mounted and healthy") from None
    return RootDir(path, fd, given)


def meta_dir(root: RootDir, *names: str, create: bool = True) -> int:
    """Open ``<root>/.kvpersist/<names...>`` one directory at a time, creating missing ones 0700
    when ``create``; never through a symlink. The caller closes the descriptor.

    Raises KvpError (with a fix) if one of them is a symlink or not a directory, or cannot be
    created or opened; FileNotFoundError if one is missing and ``create`` is False.
    """
    fd = open_dir(".", root.fd)
    rel = ""
    try:
        for name in (META_DIR, *names):
            rel = f"{rel}/{name}" if rel else name
            where = os.path.join(root.path, rel)
            try:
                nfd = _open_or_make(name, fd, create)
            except FileNotFoundError:
                raise
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    kind = _kind_of(name, fd)
                    raise KvpError(f"{where} is {kind}, not a directory; kvpersist will not "
                                   f"write through it (move it away, e.g. mv {where} "
                                   f"{where}.bak)") from None
                raise KvpError(f"cannot create or open {where}: {exc.strerror or exc}; run as "
                               "the user that owns the cache") from None
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_or_make(name: str, dir_fd: int, create: bool) -> int:
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
    return open_dir(name, dir_fd)


def _kind_of(name: str, dir_fd: int) -> str:
    try:
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
    except OSError:
        return "not a directory"
    return "a symbolic link" if stat_mod.S_ISLNK(mode) else "a file"


# --------------------------------------------------------------------------- walks


class Walk(Generic[W]):
    """An iterator over a walk that closes the walk's descriptors when it is exhausted, when
    :meth:`close` is called, or at the end of a ``with`` block."""

    __slots__ = ("_gen",)

    def __init__(self, gen: Generator[W, None, None]) -> None:
        self._gen = gen

    def __iter__(self) -> Iterator[W]:
        return self._gen  # a for loop then resumes the generator directly

    def __next__(self) -> W:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    def __enter__(self) -> Walk[W]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class Dir(Generic[T]):
    """A directory handed out by :func:`walk_dirs`: an open descriptor, its path relative to the
    root ("" for the root), its depth (0 for the root), the caller's ``tag``, and ``subdirs``,
    the ``(name, tag)`` pairs to walk after it (:meth:`descend` appends one; a hot loop may
    append to the list itself)."""

    __slots__ = ("fd", "rel", "depth", "tag", "subdirs")

    def __init__(self, fd: int, rel: str, depth: int, tag: T) -> None:
        self.fd = fd
        self.rel = rel
        self.depth = depth
        self.tag = tag
        self.subdirs: list[tuple[str, T]] = []

    def descend(self, name: str, tag: T) -> None:
        """Walk subdirectory ``name`` (with ``tag``) after this directory; it is opened relative
        to this directory's descriptor, never through a symlink."""
        self.subdirs.append((name, tag))

    def path_of(self, name: str) -> str:
        """The relative path of entry ``name`` of this directory."""
        return f"{self.rel}/{name}" if self.rel else name


def walk_dirs(root_fd: int, tag: T, *, on_error: ErrorFn | None = None) -> Walk[Dir[T]]:
    """Walk the directories below ``root_fd`` that the caller chooses, depth first.

    The root comes first (with ``tag``; its descriptor stays the caller's). While it holds a
    :class:`Dir`, the caller lists it and calls :meth:`Dir.descend` for the subdirectories to
    walk; they follow in that order, each opened relative to its parent. A subdirectory that
    cannot be opened (gone, a symlink by now, no permission) is reported to ``on_error`` and
    skipped.
    """
    return Walk(_walk(root_fd, tag, on_error))


def _walk(root_fd: int, tag: T, on_error: ErrorFn | None) -> Generator[Dir[T], None, None]:
    # per directory: one Dir, one open, one yield (the scanner walks every directory this way)
    top: Dir[T] = Dir(root_fd, "", 0, tag)
    yield top
    top.subdirs.reverse()  # subdirectories are popped from the end: in the caller's order
    stack = [top]
    try:
        while stack:
            parent = stack[-1]
            todo = parent.subdirs
            if not todo:
                stack.pop()
                if parent is not top:
                    os.close(parent.fd)
                continue
            name, sub_tag = todo.pop()
            rel = f"{parent.rel}/{name}" if parent.rel else name
            try:
                fd = os.open(name, DIR_FLAGS, dir_fd=parent.fd)
            except OSError as exc:
                if on_error is not None:
                    on_error(rel, exc)
                continue
            d = Dir(fd, rel, parent.depth + 1, sub_tag)
            stack.append(d)
            yield d
            subs = d.subdirs
            if not subs:  # a leaf (most directories): done with it at once
                stack.pop()
                os.close(fd)
            elif len(subs) > 1:
                subs.reverse()
    finally:
        for d in stack:
            if d is not top:
                os.close(d.fd)


class ChunkDir:
    """A directory that holds chunk files: the root (``shard`` None) or a shard directory
    ``ab/cd`` (``shard`` ``("ab", "cd")``). ``fd`` is valid until the walk moves on."""

    __slots__ = ("fd", "rel", "shard", "_found")

    def __init__(self, fd: int, rel: str, shard: Shard | None) -> None:
        self.fd = fd
        self.rel = rel
        self.shard = shard
        self._found: list[str] | None = None

    def path_of(self, name: str) -> str:
        """The relative path of entry ``name`` of this directory."""
        return f"{self.rel}/{name}" if self.rel else name

    def entries(self) -> Iterator[os.DirEntry[str]]:
        """List this directory (``os.scandir`` of its descriptor; entries are neither filtered
        nor stat()ed). Listing the root this way also tells the walk its shard directories, so
        the root is not listed a second time. Raises OSError if the listing fails."""
        if self.shard is not None:
            with os.scandir(self.fd) as it:
                yield from it
            return
        found: list[str] = []
        with os.scandir(self.fd) as it:
            for e in it:
                name = e.name
                if len(name) == 2 and is_shard_dir_name(name) and e.is_dir(follow_symlinks=False):
                    found.append(name)
                yield e
        self._found = found


def chunk_dirs(root_fd: int, *, select: Callable[[Shard], bool] | None = None,
               on_error: ErrorFn | None = None) -> Walk[ChunkDir]:
    """The chunk directories of the cache root ``root_fd``: the root, then every ``ab/cd`` shard
    directory in name order (only those ``select`` accepts, if given; it is called once per
    shard directory, in that order).

    Never descends ``.kvpersist``, a foreign directory (any other name, or deeper), or a
    symlink. Directories that cannot be opened or listed are reported to ``on_error`` (with
    their relative path) and skipped.
    """
    return Walk(_chunk_walk(root_fd, select, on_error))


def _chunk_walk(root_fd: int, select: Callable[[Shard], bool] | None,
                on_error: ErrorFn | None) -> Generator[ChunkDir, None, None]:
    with walk_dirs(root_fd, None, on_error=on_error) as walk:
        for d in walk:
            if d.depth == 1:  # "ab": not a chunk directory itself, only its "cd"s are
                for b in _shard_subdirs(d.fd, d.rel, on_error):
                    if select is None or select((d.rel, b)):
                        d.descend(b, None)
                continue
            if d.depth == 0:
                cd = ChunkDir(d.fd, "", None)
                yield cd
                found = cd._found
                if found is None:  # the caller did not list the root (all of it)
                    found = _shard_subdirs(d.fd, "", on_error)
                for a in sorted(found):
                    d.descend(a, None)
            else:
                a, _, b = d.rel.partition("/")
                yield ChunkDir(d.fd, d.rel, (a, b))


def _shard_subdirs(fd: int, rel: str, on_error: ErrorFn | None) -> list[str]:
    """Sorted names of the shard-named real directories in directory ``fd``."""
    try:
        with os.scandir(fd) as it:
            return sorted(e.name for e in it if len(e.name) == 2 and is_shard_dir_name(e.name)
                          and e.is_dir(follow_symlinks=False))
    except OSError as exc:
        if on_error is not None:
            on_error(rel or ".", exc)
        return []
