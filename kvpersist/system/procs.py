"""Processes: pid files, liveness, starting in the background, stopping (the I/O layer).

A pid file holds one decimal pid and nothing else (what systemd's ``PIDFile=`` and shell
tools expect). It is never trusted on its own: a recorded pid counts as *ours* only if a
process with that pid exists, was created no later than the pid file was written (a pid
recycled by the kernel after our process died is younger than the file), and its command
line carries the expected markers. Anything else is a *stale* pid file, reported with the
reason.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import psutil

from kvpersist.errors import KvpError
from kvpersist.system.files import atomic_write
from kvpersist.system.untrusted import MAX_RECORD_BYTES, UnreadableFile, read_bytes

#: A process may be created up to this long after its pid file's mtime (the file is
#: written right after the fork, but file system timestamps are coarse).
_CREATE_SLACK_S = 2.0


@dataclass(frozen=True)
class PidState:
    """What a pid file says: ``running`` (pid is ours), ``stale`` (reason says why) or
    ``absent`` (no pid file)."""

    state: str
    pid: int | None = None
    reason: str = ""
    pid_file: str = ""

    @property
    def running(self) -> bool:
        return self.state == "running"


def read_pid_file(path: str | os.PathLike[str]) -> int | None:
    """The pid recorded in ``path``, or None if the file is missing or not a positive int."""
    return pid_file_problem(path)[0]


#: the largest pid Linux hands out (``pid_max`` is at most 2**22)
_MAX_PID = 1 << 22


def pid_file_problem(path: str | os.PathLike[str]) -> tuple[int | None, str]:
    """The pid recorded in ``path`` and why there is none ("" when the file is absent, or
    holds one).

    Read as untrusted (:mod:`kvpersist.system.untrusted`): a pid file is kvpersist's own,
    so a symbolic link, a FIFO (never blocking), a device, a directory or a file bigger than
    :data:`~kvpersist.system.untrusted.MAX_RECORD_BYTES` is refused with the reason; so is
    text that is not one decimal pid from 1 to 2**22 on its first line. Never raises."""
    try:
        data = read_bytes(path, follow=False, max_bytes=MAX_RECORD_BYTES)
    except FileNotFoundError:
        return None, ""
    except UnreadableFile as exc:
        return None, f"pid file unreadable: {exc.why}"
    first = data.split(b"\n", 1)[0].strip()
    if first.isdigit() and len(first) <= 8 and 0 < int(first) <= _MAX_PID:
        return int(first), ""
    return None, "pid file does not hold a pid"


def write_pid_file(path: str | os.PathLike[str], pid: int) -> None:
    """Atomically write ``pid`` to ``path`` (owner-only, like everything in the state dir;
    monitoring reads it as the service user or through ``kvp-admin status``). Raises
    KvpError if it cannot be written."""
    atomic_write(path, f"{pid}\n")


def remove_pid_file(path: str | os.PathLike[str], pid: int | None = None) -> None:
    """Remove ``path`` if it exists (and, when ``pid`` is given, still records that pid)."""
    if pid is not None and read_pid_file(path) != pid:
        return
    try:
        Path(path).unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise KvpError(f"cannot remove the pid file {path}: {exc.strerror or exc}; it is not "
                       "a file kvpersist wrote: remove it by hand") from exc


def cmdline_matches(cmdline: Sequence[str], markers: Iterable[str],
                    pairs: Iterable[tuple[str, str]] = ()) -> bool:
    """True if every marker is a substring of some argument of ``cmdline`` and every
    ``(flag, value)`` pair stands in it as two consecutive arguments or ``flag=value`` (pure)."""
    args = list(cmdline)
    if not all(any(m in arg for arg in args) for m in markers):
        return False
    return all(
        any(a == f"{flag}={value}" or (a == flag and args[i + 1:i + 2] == [value])
            for i, a in enumerate(args))
        for flag, value in pairs)


def check_pid_file(path: str | os.PathLike[str], markers: Iterable[str],
                   pairs: Iterable[tuple[str, str]] = ()) -> PidState:
    """Classify the pid file at ``path`` (see module docstring); never raises for a bad file
    (one that cannot be read, :func:`pid_file_problem`, is *stale* with the reason). The
    process must carry ``markers`` and ``pairs`` (:func:`cmdline_matches`)."""
    path = Path(path)
    markers = tuple(markers)
    pid, why = pid_file_problem(path)
    if pid is None:
        if why or os.path.lexists(path):
            return PidState("stale", None, why or "pid file does not hold a pid", str(path))
        return PidState("absent", None, "", str(path))
    try:
        mtime = path.stat(follow_symlinks=False).st_mtime
        proc = psutil.Process(pid)
        created = proc.create_time()
        cmdline = proc.cmdline()
        status = proc.status()
    except psutil.ZombieProcess:  # exited while being read, not yet reaped
        return PidState("stale", pid, f"process {pid} has exited (zombie)", str(path))
    except psutil.NoSuchProcess:  # never there, or exited (and reaped) while being read
        return PidState("stale", pid, f"process {pid} is not running", str(path))
    except (psutil.AccessDenied, OSError) as exc:
        return PidState("stale", pid, f"process {pid} cannot be inspected: {exc}", str(path))
    if status == psutil.STATUS_ZOMBIE:
        return PidState("stale", pid, f"process {pid} has exited (zombie)", str(path))
    if created > mtime + _CREATE_SLACK_S:
        return PidState("stale", pid, f"pid {pid} was recycled: that process started after "
                        "the pid file was written", str(path))
    if not cmdline_matches(cmdline, markers, pairs):
        # no command line: a kernel thread, or a process exiting while it was read
        shown = " ".join(cmdline)[:120] or "no command line"
        return PidState("stale", pid, f"pid {pid} now belongs to another program ({shown})",
                        str(path))
    return PidState("running", pid, "", str(path))


def port_in_use(host: str, port: int) -> bool:
    """True if something accepts TCP connections on host:port (0.5 s timeout)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                       socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect((host, port))
        except OSError:
            return False
        return True


def connect_problem(host: str, port: int, timeout: float) -> str:
    """'' when a TCP connection to ``host:port`` opens within ``timeout`` seconds (closed at
    once, nothing sent), else why not: what a client's first connect meets. Never raises."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return ""
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"


def port_bindable(host: str, port: int) -> bool:
    """True if a listener could bind host:port right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                       socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


#: ports :func:`free_port` has handed out in this process
_GIVEN_PORTS: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now and that this process has not handed out
    before (for tests and demos).

    The kernel's next free port may well be the one it gave a moment ago, since nothing
    listens on it until the deployment starts: three calls for one deployment's listeners
    return a repeated port about 3 times in 10,000, and a deployment whose listeners share a
    port does not load ("port N is also KVP_LMCACHE_PORT"). Raises KvpError if no new port
    turns up in 100 tries."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port
    raise KvpError(f"no free TCP port on {host} that was not handed out already")


def start_background(argv: Sequence[str], *, log_path: str | os.PathLike[str],
                     env: Mapping[str, str] | None = None, cwd: str | None = None,
                     umask: int = 0o077,
                     as_ids: tuple[int, int] | None = None) -> subprocess.Popen[bytes]:
    """Start ``argv`` detached (own session/process group), stdout+stderr appended to
    ``log_path`` (created 0600), stdin from /dev/null, with ``umask``. Returns the Popen.
    ``as_ids`` (root only): run it as that (uid, gid), without supplementary groups, the log
    file then belonging to that user.

    Raises OSError if the program cannot be started.
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        if as_ids is None:
            return subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
                umask=umask, close_fds=True,
            )
        os.fchown(fd, *as_ids)
        return subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
            umask=umask, close_fds=True, user=as_ids[0], group=as_ids[1], extra_groups=[],
        )
    finally:
        os.close(fd)


def exec_foreground(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                    cwd: str | None = None, umask: int = 0o077) -> NoReturn:
    """Replace this process with ``argv`` (for systemd). Never returns on success."""
    os.umask(umask)
    if cwd:
        os.chdir(cwd)
    os.execvpe(argv[0], list(argv), dict(env) if env is not None else dict(os.environ))


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def exit_watch(pid: int) -> Callable[[], bool]:
    """A function that says whether process ``pid``, as it is now, has exited (gone, a
    zombie, or its pid taken by another process since: psutil compares the start time).
    A ``pid`` that does not exist now has exited already."""
    try:
        p = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return lambda: True
    return lambda: _exited(p)


def _exited(p: psutil.Process) -> bool:
    """True once ``p`` has exited: gone, or a zombie its parent has not reaped yet (a zombie
    holds no memory, port or file any more; init may take seconds to reap one)."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_exited(ps: Iterable[psutil.Process], timeout: float,
                interval: float = 0.02) -> list[psutil.Process]:
    """Wait up to ``timeout`` seconds until every process of ``ps`` has exited (a zombie
    counts: see :func:`_exited`); return those still running."""
    left = [p for p in ps if not _exited(p)]
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        time.sleep(interval)
        left = [p for p in left if not _exited(p)]
    return left


@dataclass(frozen=True)
class StopResult:
    """How a stop went: ``how`` is terminated / killed / not-running."""

    pid: int | None
    how: str
    seconds: float


def stop_process(pid: int, *, timeout: float = 30.0, kill_group: bool = True) -> StopResult:
    """SIGTERM ``pid``; after ``timeout`` seconds SIGKILL it. Descendants (vLLM's engine and
    workers) that outlive it are SIGKILLed too, and so is its process group when it leads
    one and ``kill_group``. Returns how it ended.
    """
    t0 = time.monotonic()
    try:
        proc = psutil.Process(pid)
        family = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return StopResult(pid, "not-running", 0.0)
    try:
        pgid = os.getpgid(pid)
    except OSError:
        pgid = None
    with contextlib.suppress(psutil.NoSuchProcess):
        proc.send_signal(signal.SIGTERM)
    how = "terminated"
    if wait_exited([proc], timeout):
        how = "killed"
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
        wait_exited([proc], 5)
    # Children get a moment to exit after their parent, then are killed.
    left = wait_exited(family[1:], 5)
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    if kill_group and pgid is not None and pgid == pid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    return StopResult(pid, how, time.monotonic() - t0)


#: what may be left of a killed service, one of whose session's processes outlives it: vLLM's
#: engine core and workers (they name themselves ``VLLM::...``), Python's multiprocessing
#: helpers, the cache server's children
LEFTOVER_MARKERS = ("VLLM::", "vllm", "lmcache", "multiprocessing")


def leftovers(pid: int, markers: Iterable[str] = LEFTOVER_MARKERS) -> list[psutil.Process]:
    """The live processes of the session that ``pid`` led, once ``pid`` itself is gone: what a
    service started by :func:`start_background` (a session of its own) left behind when it was
    killed. vLLM's engine core and worker survive a ``kill -9`` of its API server, holding
    their memory (gigabytes) until they are stopped.

    Empty when a process ``pid`` is alive (a live leader's session is not a leftover), when
    ``pid`` <= 1, or when any member's name and command line carry none of ``markers`` (a
    session that is not a service's is never touched). The kernel does not hand out a pid
    again while a session or process group of that number exists, so members found are the
    dead process's own."""
    if pid <= 1 or alive(pid):
        return []
    found: list[psutil.Process] = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == pid or os.getsid(proc.pid) != pid:
                continue
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            words = [proc.name(), *proc.cmdline()]
        except (OSError, psutil.Error):
            continue
        if not any(m in w for m in markers for w in words):
            return []
        found.append(proc)
    return found


def stop_leftovers(found: Sequence[psutil.Process], *, timeout: float = 10.0) -> int:
    """SIGKILL the processes ``found`` (:func:`leftovers`) and wait up to ``timeout`` seconds
    for them to go; returns how many were stopped. No SIGTERM first: nobody waits for their
    work any more, and a shutdown gives vLLM's engine a moment to act on requests its dead API
    server will never answer (store their KV) — the kill takes that moment away."""
    for p in found:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(list(found), timeout=timeout)
    return len(found)


def resident_bytes(found: Iterable[psutil.Process]) -> int:
    """The resident memory of the processes ``found`` (those gone count 0)."""
    total = 0
    for p in found:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.5,
             should_abort: Callable[[], bool] | None = None) -> bool:
    """Poll ``predicate()`` until true (True) or ``timeout`` passes (False). If
    ``should_abort()`` becomes true, return False early."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if should_abort is not None and should_abort():
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def cmdline(pid: int) -> list[str] | None:
    """The command line of process ``pid``, or None when it cannot be read (gone, another
    user's, a zombie)."""
    try:
        return list(psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return None


def listeners_of_port(port: int) -> set[int]:
    """The pids of the processes listening on TCP ``port`` (any address). Raises OSError
    when the sockets cannot be listed."""
    try:
        conns = psutil.net_connections(kind="inet")
    except psutil.Error as exc:
        raise OSError(str(exc)) from exc
    return {c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr
            and c.laddr.port == port and c.pid}


def listening_addresses(pid: int) -> list[str]:
    """``ip:port`` of every TCP socket process ``pid`` listens on, sorted. Raises OSError
    when they cannot be read."""
    try:
        conns = psutil.Process(pid).net_connections(kind="inet")
    except psutil.Error as exc:
        raise OSError(str(exc)) from exc
    return sorted({f"{c.laddr.ip}:{c.laddr.port}" for c in conns
                   if c.status == psutil.CONN_LISTEN})


#: a child started by :func:`start_background`
Child = subprocess.Popen[bytes]
#: what :func:`run` raises past its timeout
TimeoutExpired = subprocess.TimeoutExpired


def wait_child(child: Child, timeout: float) -> int | None:
    """The exit status of ``child`` once it exits within ``timeout`` seconds, else None (it
    still runs)."""
    try:
        return child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def run(argv: Sequence[str], *, timeout: float, input_text: str | None = None,
        env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end (text in and out, captured; never raises for its status).
    Raises OSError when it cannot start, subprocess.TimeoutExpired past ``timeout``."""
    return subprocess.run(list(argv), input=input_text, capture_output=True, text=True,
                          env=dict(env) if env is not None else None, timeout=timeout,
                          check=False)


def start_time(pid: int) -> float | None:
    """When process ``pid`` started (epoch seconds), or None when it cannot be read."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def memory_total_bytes() -> int:
    """This host's physical memory in bytes."""
    return int(psutil.virtual_memory().total)
