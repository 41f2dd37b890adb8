"""The one reader of files kvpersist did not write itself in this run (I/O): model files, state
files, manifests, pins, warm sets, digest caches, records read back from the shared tier.

Every such file is untrusted, whoever is supposed to have written it: a FIFO must not hang a
command, a link to ``/dev/zero`` must not exhaust its memory, a document nested 100,000 deep
must not crash it with ``RecursionError``, a number too big for a float must not become
``inf``. So:

* :func:`read_bytes` opens with ``O_NONBLOCK`` (a FIFO cannot block the open) and, where no
  symbolic link is expected, ``O_NOFOLLOW``; it checks on the *open descriptor* that it is a
  regular file (``fstat``: a name swapped after a check cannot fool it) and reads at most the
  cap of its kind, plus one byte to tell "too big" from "exactly the cap".
* :func:`parse_json` parses a document of bounded nesting depth (checked before the parser
  recurses), refuses ``NaN``/``Infinity`` and numbers that overflow a float, and turns every
  way of failing (``ValueError``, ``RecursionError``, ``MemoryError``, bad UTF-8) into an
  :class:`UnreadableFile` naming the file.
* :func:`read_json` is both.
* :class:`ChunkFile` opens a file named like an LMCache chunk (relative to a directory
  descriptor, never through a symlink, never blocking) whose size must be at most what
  LMCache can write for its namespace's geometry, and reads it in bounded blocks: a 50 GB
  sparse file named like a chunk costs one ``fstat``, a real one a block of memory.
* :func:`http` reads an HTTP reply of the cache server or vLLM (their admin and OpenAI
  APIs) up to :data:`MAX_HTTP_BYTES`, in a bounded time; :func:`http_lines` a streamed one
  line by line, each line and the whole bounded; :meth:`HttpReply.json` parses it as
  untrusted JSON.
* :func:`bounded_resp_parser` is the parser of every reply of the shared tier's store: a
  reply that announces or sends more than :data:`MAX_REPLY_BYTES` is refused before it is
  read (a store that announced ``$2147483647`` and streamed zeros ended ``fleet status``,
  ``upgrade plan`` and ``metrics`` with ``MemoryError``).

:class:`UnreadableFile` is a :class:`~kvpersist.errors.KvpError` (exit 2: the operator fixes
or removes the file) that carries the path, why and the fix; :meth:`UnreadableFile.problem`
gives the :class:`~kvpersist.errors.Problem` for a list of problems. Callers that keep going
without the file (a cache that is computed again, a state file that makes a verdict) catch it
and say so; none of them guesses a value.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvpersist.errors import EXIT_USAGE, KvpError, Problem

#: the deepest nesting of arrays and objects any file kvpersist reads may have (a model's
#: config.json nests 3-4 levels, a manifest 3; a warm-set line with tool schemas ~10)
MAX_JSON_DEPTH = 64

#: caps by kind of file, in bytes (a file past its cap is refused, never read whole)
MAX_STATE_BYTES = 4 << 20       # a state file kvpersist writes (manifest, pins, records)
MAX_MODEL_JSON_BYTES = 64 << 20  # config.json, tokenizer_config.json (chat templates inside)
MAX_TEMPLATE_BYTES = 4 << 20    # a chat template (.jinja)
MAX_RECORD_BYTES = 64 << 10     # a small record (a pid file, a download record)
#: a chunk file is read in blocks of at most this many bytes, whatever its size
CHUNK_BLOCK_BYTES = 1 << 20
#: the most bytes one reply of the shared tier's store may take: kvpersist asks for SCAN
#: pages of 500 keys, INFO, lengths and values read by bounded scripts (a fleet record is
#: at most 4 KiB), never a chunk's value
MAX_REPLY_BYTES = 16 << 20
#: the longest line of such a reply (a status, an error, a length)
MAX_REPLY_LINE_BYTES = 1 << 20
#: the most bytes of an HTTP reply read (the cache server's and vLLM's JSON answers are a
#: few KiB; a streamed reply's lines are bounded one by one, :data:`MAX_HTTP_LINE_BYTES`)
MAX_HTTP_BYTES = 4 << 20
MAX_HTTP_LINE_BYTES = 1 << 20

#: the flags of every open: read-only, not inherited, never blocking on a FIFO
_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
_READ_BLOCK = 1 << 20


class UnreadableFile(KvpError):
    """A file that exists (or should) but cannot be used as what it should be: not a regular
    file, too big, not UTF-8, not JSON, nested too deep, a number out of range. Exit 2."""

    exit_code = EXIT_USAGE

    def __init__(self, path: str, why: str, fix: str = "") -> None:
        self.path, self.why, self.fix = path, why, fix
        super().__init__(f"{path}: {why}" + (f"; {fix}" if fix else ""))

    def problem(self) -> Problem:
        """This error as a Problem (for a ConfigError that lists every problem at once)."""
        return Problem(self.path, self.why, self.fix)


def show_path(path: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> str:
    """``path`` as text that is safe to print whatever bytes it holds: undecodable bytes
    and control characters escaped (``\\xff``, ``\\n``), never raising."""
    raw = os.fsencode(path)
    text = raw.decode("utf-8", errors="backslashreplace")
    return _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def read_bytes(path: str | os.PathLike[str], *, max_bytes: int, follow: bool = True,
               dir_fd: int | None = None, fix: str = "") -> bytes:
    """The bytes of the regular file ``path`` (relative to ``dir_fd`` when given), at most
    ``max_bytes`` of them.

    ``follow=False`` adds ``O_NOFOLLOW``: a symbolic link is refused (kvpersist's own state
    files are never links). Raises FileNotFoundError when nothing is there (callers decide what
    absent means), :class:`UnreadableFile` for everything else: not a regular file (a FIFO, a
    device such as ``/dev/zero``, a directory), larger than ``max_bytes``, a symlink where none
    is expected, or an error of the open or the read. ``fix`` is added to the message.
    """
    shown = show_path(path)
    flags = _FLAGS | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise UnreadableFile(shown, "is a symbolic link, where a file is expected",
                                 fix or "replace the link by the file itself") from None
        raise UnreadableFile(shown, f"cannot open: {exc.strerror or exc}", fix) from None
    except ValueError as exc:  # a NUL byte in the name
        raise UnreadableFile(shown, f"cannot open: {exc}", fix) from None
    try:
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise UnreadableFile(shown, f"cannot read: {exc.strerror or exc}", fix) from None
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile(shown, f"is not a regular file ({_kind(st.st_mode)})",
                                 fix or "replace it by a regular file")
        if st.st_size > max_bytes:
            raise UnreadableFile(shown, f"is {st.st_size:,} bytes, larger than the "
                                 f"{max_bytes:,} bytes such a file may hold", fix)
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            try:
                block = os.read(fd, min(_READ_BLOCK, max_bytes + 1 - size))
            except OSError as exc:
                raise UnreadableFile(shown, f"cannot read: {exc.strerror or exc}",
                                     fix) from None
            if not block:
                break
            chunks.append(block)
            size += len(block)
        if size > max_bytes:  # it grew after the fstat
            raise UnreadableFile(shown, f"is larger than the {max_bytes:,} bytes such a "
                                 "file may hold", fix)
        return b"".join(chunks)
    finally:
        os.close(fd)


class TooLarge(UnreadableFile):
    """A file larger than its format allows (never read). Exit 2 where it ends a command;
    verify and scrub name it and go on."""


class ChunkFile:
    """A regular file named like a chunk, open for reading (``write``: and writing) relative
    to the directory descriptor ``dir_fd``, never through a symbolic link and never blocking
    on a FIFO; checked on the open descriptor to be a regular file of at most ``max_bytes``.

    Raises OSError from the open (ELOOP for a symlink, FileNotFoundError when gone),
    :class:`UnreadableFile` for what is not a regular file and :class:`TooLarge` for a file
    past ``max_bytes``. A context manager; ``st`` is the ``fstat`` of the open file;
    ``on_read`` is called with the size of every read (a byte count, a rate cap)."""

    def __init__(self, dir_fd: int, name: str, *, max_bytes: int, write: bool = False,
                 where: str = "", on_read: Callable[[int], None] | None = None) -> None:
        self.on_read = on_read
        shown = where or show_path(name)
        mode = os.O_RDWR if write else os.O_RDONLY
        self.fd = os.open(name, mode | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                          dir_fd=dir_fd)
        try:
            self.st = os.fstat(self.fd)
            if not stat.S_ISREG(self.st.st_mode):
                raise UnreadableFile(shown, f"is not a regular file ({_kind(self.st.st_mode)})")
            if self.st.st_size > max_bytes:
                raise TooLarge(shown, f"is {self.st.st_size:,} bytes, larger than the "
                               f"{max_bytes:,} bytes a chunk of its namespace can be: not read",
                               "kvp-admin verify CONFIG --apply moves it to the quarantine")
        except BaseException:
            os.close(self.fd)
            raise
        self.size = self.st.st_size

    def pread(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end of the file). At most
        :data:`CHUNK_BLOCK_BYTES` at once is the caller's to ask. Raises OSError."""
        parts: list[bytes] = []
        done = 0
        while done < n:
            b = os.pread(self.fd, n - done, offset + done)
            if not b:
                break
            parts.append(b)
            done += len(b)
        if self.on_read is not None and done:
            self.on_read(done)
        return b"".join(parts)

    def blocks(self, start: int, end: int) -> Iterator[bytes]:
        """The bytes ``[start, end)`` in blocks of at most :data:`CHUNK_BLOCK_BYTES` (the
        last block short if the file is). Raises OSError."""
        pos = start
        while pos < end:
            b = self.pread(pos, min(CHUNK_BLOCK_BYTES, end - pos))
            if not b:
                return
            yield b
            pos += len(b)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ChunkFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_tail(path: str | os.PathLike[str], *, max_bytes: int, follow: bool = True) -> bytes:
    """The last ``max_bytes`` (at most) of the regular file ``path`` (a log), read with one
    ``pread`` whatever its size: a FIFO, a device or a directory is refused as by
    :func:`read_bytes`. Raises FileNotFoundError or :class:`UnreadableFile`."""
    shown = show_path(path)
    flags = _FLAGS | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise UnreadableFile(shown, "is a symbolic link, where a file is expected") \
                from None
        raise UnreadableFile(shown, f"cannot open: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UnreadableFile(shown, f"cannot open: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile(shown, f"is not a regular file ({_kind(st.st_mode)})")
        return os.pread(fd, max_bytes, max(0, st.st_size - max_bytes))
    except OSError as exc:
        raise UnreadableFile(shown, f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return f"mode {mode:o}"


def read_text(path: str | os.PathLike[str], *, max_bytes: int, follow: bool = True,
              dir_fd: int | None = None, fix: str = "") -> str:
    """:func:`read_bytes` decoded as strict UTF-8, with no newline translation (a CR stays a
    CR). Raises FileNotFoundError or :class:`UnreadableFile`."""
    return decode(read_bytes(path, max_bytes=max_bytes, follow=follow, dir_fd=dir_fd,
                             fix=fix), show_path(path), fix)


def decode(data: bytes, where: str, fix: str = "") -> str:
    """``data`` as strict UTF-8; raises :class:`UnreadableFile` naming ``where`` and the
    offset of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableFile(where, f"is not UTF-8 text ({exc.reason} at byte {exc.start})",
                             fix) from None


def json_depth(doc: Any) -> int:
    """The deepest nesting of arrays and objects in the parsed document ``doc`` (a scalar is
    0, ``[]`` is 1). Iterative and in memory of its depth, not its width: never recursive,
    and a document of five million empty objects costs one iterator a level."""
    if not isinstance(doc, dict | list):
        return 0
    deepest = 1
    stack: list[Any] = [iter(doc.values() if isinstance(doc, dict) else doc)]
    while stack:
        for child in stack[-1]:
            if isinstance(child, dict | list):
                stack.append(iter(child.values() if isinstance(child, dict) else child))
                deepest = max(deepest, len(stack))
                break
        else:
            stack.pop()
    return deepest


def containers_at_most(text: str) -> int:
    """An upper bound of the arrays and objects the JSON ``text`` holds: its ``[`` and ``{``
    (those inside strings counted too). Counted in C, before anything is parsed."""
    return text.count("[") + text.count("{")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def parse_json(data: bytes | str, where: str, *, max_depth: int = MAX_JSON_DEPTH,
               max_containers: int | None = None, fix: str = "") -> Any:
    """The JSON document ``data`` (bytes must be UTF-8), nested at most ``max_depth`` deep,
    with finite numbers only (``NaN``, ``Infinity`` and ``1e309`` are refused; integers of
    more than 4,300 digits too, by Python's own limit).

    ``max_containers``: refuse, before parsing, a document that may hold more arrays and
    objects than that (:func:`containers_at_most`): each costs ~64 bytes once parsed, so a
    16 MiB file of ``[{},{},...]`` would cost 400 MB; a reader whose format holds few sets it.

    Raises :class:`UnreadableFile` naming ``where`` for every way of failing: never
    ``RecursionError``, ``MemoryError`` or ``ValueError``."""
    text = decode(data, where, fix) if isinstance(data, bytes) else data
    if max_containers is not None:
        found = containers_at_most(text)
        if found > max_containers:
            raise UnreadableFile(where, f"holds {found:,} '[' and '{{', more than the "
                                 f"{max_containers:,} arrays and objects such a file may "
                                 "hold", fix or "replace it by the file it should be")
    try:
        # the C parser stops at the interpreter's recursion limit with RecursionError;
        # anything shallower is measured once parsed, without recursion
        doc = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise UnreadableFile(where, f"is not valid JSON: {exc.msg} (line {exc.lineno} column "
                             f"{exc.colno})", fix) from None
    except RecursionError:
        raise UnreadableFile(where, f"is nested deeper than the {max_depth} levels any file "
                             "kvpersist reads may be", fix or "replace it by the file it "
                             "should be") from None
    except (ValueError, MemoryError) as exc:
        raise UnreadableFile(where, f"is not usable JSON: {type(exc).__name__}: "
                             f"{str(exc)[:200]}", fix) from None
    deepest = json_depth(doc)
    if deepest > max_depth:
        raise UnreadableFile(where, f"is nested {deepest:,} levels deep, more than the "
                             f"{max_depth} any file kvpersist reads may be",
                             fix or "replace it by the file it should be")
    return doc


def read_json(path: str | os.PathLike[str], *, max_bytes: int, follow: bool = True,
              dir_fd: int | None = None, max_depth: int = MAX_JSON_DEPTH,
              max_containers: int | None = None, fix: str = "",
              where: str = "") -> Any:
    """:func:`read_bytes` then :func:`parse_json`; ``where`` names the file in messages
    (default: ``path``, which is only its name when ``dir_fd`` is given). Raises
    FileNotFoundError or :class:`UnreadableFile`."""
    data = read_bytes(path, max_bytes=max_bytes, follow=follow, dir_fd=dir_fd, fix=fix)
    return parse_json(data, where or show_path(path), max_depth=max_depth,
                      max_containers=max_containers, fix=fix)


def read_json_object(path: str | os.PathLike[str], *, max_bytes: int, follow: bool = True,
                     dir_fd: int | None = None, max_containers: int | None = None,
                     fix: str = "", where: str = "") -> dict[str, Any]:
    """:func:`read_json` of a document that must be a JSON object. Raises
    FileNotFoundError or :class:`UnreadableFile` (also when it is another JSON type)."""
    doc = read_json(path, max_bytes=max_bytes, follow=follow, dir_fd=dir_fd,
                    max_containers=max_containers, fix=fix, where=where)
    if not isinstance(doc, dict):
        raise UnreadableFile(where or show_path(path), f"is a JSON {type(doc).__name__}, not "
                             "an object", fix)
    return doc


def bounded_resp_parser(max_bytes: int = MAX_REPLY_BYTES) -> type[Any]:
    """A redis-py RESP2 parser class (``parser_class=``) that refuses a reply of more than
    ``max_bytes``: one announced longer (``$2147483647``) before a byte of it is read, one
    that streams past it (an endless line, a huge array) as soon as it does. The refusal is
    a ``redis.ConnectionError`` (the connection is dropped: what follows in the stream is
    not trusted either), whose message says why."""
    from redis._parsers.resp2 import _RESP2Parser
    from redis._parsers.socket import SocketBuffer
    from redis.exceptions import ConnectionError as StoreConnectionError
    from redis.exceptions import RedisError
    from redis.utils import SENTINEL

    def too_large(size: int) -> Exception:
        return StoreConnectionError(f"the store sent or announced a reply longer than the "
                                    f"{max_bytes:,} bytes kvpersist reads (at least "
                                    f"{size - 2:,}): not read")

    class _Buffer(SocketBuffer):
        def _size(self) -> int:
            buf = self._live_buffer()
            pos = buf.tell()
            end = buf.seek(0, os.SEEK_END)
            buf.seek(pos)
            return end

        def _read_from_socket(self, length: int | None = None, *args: Any,
                              **kw: Any) -> bool:
            if length is not None and self._size() + length > max_bytes:
                raise too_large(self._size() + length)
            got = bool(super()._read_from_socket(length, *args, **kw))
            if self._size() > max_bytes:
                raise too_large(self._size())
            return got

        def readline(self, timeout: Any = SENTINEL) -> bytes:
            # redis-py's own loop, with a bound on the line (a status, an error, a length:
            # never long) so that an endless line costs neither memory nor quadratic copies
            buf = self._live_buffer()
            try:
                data = buf.readline()
                while not data.endswith(b"\r\n"):
                    if len(data) > MAX_REPLY_LINE_BYTES:
                        raise too_large(len(data) + 2)
                    self._read_from_socket(timeout=timeout)
                    data += buf.readline()
            except ValueError:  # the buffer was closed under the read
                raise StoreConnectionError("Connection closed by server.") from None
            line = bytes(data[:-2])
            # an array announcing more items than the bound can hold (each takes at least
            # 4 bytes, ":1\r\n") is refused before its first item is read
            if line[:1] == b"*" and line[1:].isdigit() and int(line[1:]) > max_bytes // 4:
                raise too_large(int(line[1:]) * 4)
            return line

    class BoundedParser(_RESP2Parser):
        def read_response(self, *args: Any, **kw: Any) -> Any:
            try:
                reply = super().read_response(*args, **kw)
            except RedisError as exc:  # "Protocol Error: <the whole line>": shortened
                raise _shortened(exc) from None
            return _shortened(reply) if isinstance(reply, RedisError) else reply

        def on_connect(self, connection: Any) -> None:
            super().on_connect(connection)  # type: ignore[no-untyped-call]
            self._buffer = _Buffer(connection._sock, self.socket_read_size,
                                   connection.socket_timeout)

    return BoundedParser


#: the longest message of a store error kept (a hostile store's error line can be megabytes)
MAX_REPLY_MESSAGE = 300


def _shortened(exc: Any) -> Any:
    """``exc`` (a redis-py error), its message cut to :data:`MAX_REPLY_MESSAGE` characters and
    escaped (:func:`show_path`'s rules) when it is longer or not printable."""
    text = str(exc)
    if len(text) <= MAX_REPLY_MESSAGE and text.isprintable():
        return exc
    cut = show_path(text[:MAX_REPLY_MESSAGE].encode("utf-8", "surrogateescape"))
    more = len(text) - MAX_REPLY_MESSAGE
    return type(exc)(cut + (f"... ({more:,} more characters)" if more > 0 else ""))


@dataclass(frozen=True)
class HttpReply:
    """An HTTP reply read with a bound: its status and at most ``max_bytes`` of its body
    (``cut``: there was more, not read)."""

    status: int
    body: bytes
    cut: bool = False

    def json(self, where: str) -> Any:
        """The body as untrusted JSON (:func:`parse_json`). Raises UnreadableFile, also for
        a body cut at the bound."""
        if self.cut:
            raise UnreadableFile(where, f"answered more than the {len(self.body):,} bytes "
                                 "kvpersist reads")
        return parse_json(self.body, where)

    def object(self, where: str = "the reply") -> dict[str, Any]:
        """The body if it is a JSON object, else ``{}`` (an answer that is not one is read as
        an answer without the fields asked for)."""
        try:
            doc = self.json(where)
        except UnreadableFile:
            return {}
        return doc if isinstance(doc, dict) else {}

    def text(self, limit: int = 300) -> str:
        """The first ``limit`` characters of the body, escaped (:func:`show_path`)."""
        return show_path(self.body[:limit * 4].decode("utf-8", "replace")[:limit])


def http(method: str, url: str, *, timeout: float, json_body: Any = None,
         max_bytes: int = MAX_HTTP_BYTES) -> HttpReply:
    """``method`` on ``url`` with ``requests``: the reply read up to ``max_bytes`` (streamed,
    never more), within ``timeout`` for the connection and for each read and at most twice
    ``timeout`` for the whole body. Raises ``requests.RequestException`` as ``requests``
    does (``requests.Timeout`` for a body that trickles past the bound)."""
    import requests

    deadline = time.monotonic() + 2 * timeout
    with requests.request(method, url, json=json_body, timeout=timeout, stream=True) as r:
        parts: list[bytes] = []
        size = 0
        for block in r.iter_content(65536):
            parts.append(block)
            size += len(block)
            if size > max_bytes:
                return HttpReply(r.status_code, b"".join(parts)[:max_bytes], True)
            if time.monotonic() > deadline:
                raise requests.Timeout(f"{url} sent its answer for more than {2 * timeout:g} s")
        return HttpReply(r.status_code, b"".join(parts))


def http_lines(response: Any, *, max_line: int = MAX_HTTP_LINE_BYTES,
               max_bytes: int = 64 * MAX_HTTP_BYTES) -> Iterator[bytes]:
    """The lines of a streamed ``requests`` reply (``\\n``, ``\\r\\n``), each at most
    ``max_line`` bytes and ``max_bytes`` in all. Raises UnreadableFile beyond either."""
    pending = b""
    total = 0
    for block in response.iter_content(65536):
        total += len(block)
        if total > max_bytes:
            raise UnreadableFile(str(response.url), f"streamed more than {max_bytes:,} bytes")
        pending += block
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
        if len(pending) > max_line:
            raise UnreadableFile(str(response.url), f"streamed a line longer than "
                                 f"{max_line:,} bytes")
    if pending:
        yield pending.rstrip(b"\r")
