"""Work in forked child processes: one job split over workers (:func:`run_parts`, used by scan
and prune on big trees), and one untrusted computation run under bounds (:func:`call_bounded`,
used to render a model's chat template)."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import resource
import select
import signal
import time
from collections.abc import Callable
from typing import TypeVar

from kvpersist.errors import KvpError

R = TypeVar("R")


def run_parts(n: int, work: Callable[[int, Callable[[int], None] | None], R],
              progress: Callable[[int], None] | None, what: str) -> list[R]:
    """Run ``work(part, progress)`` for parts 0..n-1 and return the results in part order.

    Part 0 runs in this process (reporting ``progress`` scaled by ``n``); parts 1..n-1 run in
    forked children that send back their pickled result through a pipe. Raises KvpError if a
    worker fails.
    """
    if n <= 1:
        return [work(0, progress)]
    children: list[tuple[int, int]] = []
    for part in range(1, n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 0
            try:
                os.close(r)
                data = pickle.dumps(work(part, None), protocol=pickle.HIGHEST_PROTOCOL)
                with os.fdopen(w, "wb") as f:
                    f.write(data)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        children.append((pid, r))
    scaled = (lambda k: progress(k * n)) if progress is not None else None
    results: list[R] = [work(0, scaled)]
    for pid, r in children:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or not data:
            raise KvpError(f"{what} worker process {pid} failed (exit status {code}) and its "
                           f"share of the work is unknown; run the {what} again")
        results.append(pickle.loads(data))
    return results


# --------------------------------------------------------------------------- bounded calls

#: the defaults of :func:`call_bounded`: wall-clock seconds, bytes returned, memory added
BOUNDED_SECONDS = 5.0
BOUNDED_RESULT_BYTES = 1 << 20
BOUNDED_MEMORY = 256 << 20

_OK, _FAILED = b"0", b"1"


class BoundedCallError(KvpError):
    """A call run by :func:`call_bounded` did not return within its bounds: it raised (any
    exception), ran past its time, ran out of its memory, returned too much or was killed.
    ``why`` says which, in one line."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(why)


def call_bounded(fn: Callable[[], bytes], *, seconds: float = BOUNDED_SECONDS,
                 max_bytes: int = BOUNDED_RESULT_BYTES,
                 memory: int = BOUNDED_MEMORY) -> bytes:
    """The bytes ``fn()`` returns, computed in a forked child under bounds that stop anything
    it may do, C-level work included (a huge integer power, a string of ten gigabytes): it
    may run ``seconds`` of wall-clock time (then it is killed) and as much CPU time
    (``RLIMIT_CPU``, in whole seconds, so that it dies even if this process does), map
    ``memory`` bytes more than this process has mapped (``RLIMIT_AS``; never more than the
    limit already set) and return at most ``max_bytes``.

    ``fn`` runs in a copy of this process: it sees its memory, and nothing it changes comes
    back but the bytes it returns. Raises :class:`BoundedCallError` with why for every way of
    failing: an exception of any type in ``fn`` (its type and message), the time, the
    memory (``MemoryError``), a result larger than ``max_bytes``, a kill by a signal."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        _bounded_child(fn, r, w, seconds, memory)
    os.close(w)
    reaped = False
    try:
        data = _read_until(r, time.monotonic() + seconds, max_bytes + 1)
        if data is None:
            raise BoundedCallError(f"still running after {seconds:g} s (stopped)")
        if len(data) > max_bytes + 1:  # the status byte and max_bytes
            raise BoundedCallError(f"returned more than {max_bytes:,} bytes (stopped)")
        status = _reap(pid, time.monotonic() + 1.0)
        reaped = status is not None
        if data[:1] == _FAILED:
            raise BoundedCallError(data[1:].decode("utf-8", "backslashreplace"))
        if data[:1] == _OK and status == 0:
            return data[1:]
        raise BoundedCallError(_death(status, seconds))
    finally:
        os.close(r)
        if not reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _bounded_child(fn: Callable[[], bytes], r: int, w: int, seconds: float,
                   memory: int) -> None:  # pragma: no cover - runs in the child
    """Limit this child, call ``fn``, write the status byte and the result (or the error) to
    ``w``; never returns."""
    code = 0
    try:
        os.close(r)
        cpu = math.ceil(seconds) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        want = _mapped() + memory
        if soft != resource.RLIM_INFINITY:
            want = min(want, soft)
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))
        try:
            payload = _OK + fn()
        except MemoryError:
            payload = _FAILED + (f"needed more than the {memory >> 20} MiB of memory it may "
                                 "use (stopped)").encode()
        except BaseException as exc:  # noqa: BLE001 - every way of failing is reported
            text = " ".join(str(exc)[:500].split())
            payload = _FAILED + f"{type(exc).__name__}: {text}".encode("utf-8",
                                                                        "backslashreplace")
        view = memoryview(payload)
        while view:
            view = view[os.write(w, view):]
    except BaseException:  # noqa: BLE001 - the parent sees no result and the exit code
        code = 1
    finally:
        os._exit(code)


def _mapped() -> int:
    """The bytes this process maps now (its virtual size), 0 if unknown."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _read_until(fd: int, deadline: float, limit: int) -> bytes | None:
    """What the pipe ``fd`` gives until its end, None when ``deadline`` passes first; stops
    once more than ``limit`` bytes came."""
    chunks: list[bytes] = []
    size = 0
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while size <= limit:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if not poller.poll(max(1, math.ceil(left * 1000))):
            continue
        block = os.read(fd, min(1 << 16, limit + 1 - size))
        if not block:
            break
        chunks.append(block)
        size += len(block)
    return b"".join(chunks)


def _reap(pid: int, deadline: float) -> int | None:
    """The exit status of the child ``pid`` (as :func:`os.waitstatus_to_exitcode`: negative
    for a signal) once it ends, None if it is still running at ``deadline``."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.0005)


def _death(status: int | None, seconds: float) -> str:
    if status is None:
        return "did not end after returning its result (stopped)"
    if status == -signal.SIGXCPU:
        return f"used more than {math.ceil(seconds) + 1} s of CPU time (stopped)"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = str(-status)
        return f"was killed by signal {name}"
    return f"failed in its process (exit status {status}), likely out of memory"
