"""The deployment's processes (I/O): their state, starting them, stopping them.

The cache server and vLLM each have a pid file that is checked, never trusted alone
(:mod:`kvpersist.system.procs`). :func:`start_server` / :func:`start_vllm` start a process in
the background and wait until it answers; :func:`stop_deployment` stops vLLM, then the cache
server (a server that exited on SIGTERM is recorded as cleanly stopped,
:mod:`kvpersist.stack.crash_window`). Stopping and inspecting need only a
:class:`~kvpersist.stack.locate.Location` (pure, no scan). Used by
:mod:`kvpersist.stack.launch` and :mod:`kvpersist.stack.warm.readiness`; imports neither.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvpersist.errors import CheckFailed, KvpError
from kvpersist.stack import crash_window
from kvpersist.stack.launch_plan import LaunchPlan
from kvpersist.stack.locate import Location
from kvpersist.stack.preread import start_preread
from kvpersist.system import procs
from kvpersist.system.untrusted import UnreadableFile, read_tail

Progress = Callable[[str], None]
#: the least time ``stop`` gives vLLM between SIGTERM and SIGKILL: its drain of the requests
#: in flight (``stack.render.VLLM_DRAIN_SECONDS``) and its own shutdown after it
VLLM_STOP_SECONDS = 45.0


def quiet(_: str) -> None:
    pass


# --------------------------------------------------------------------------- state


def server_state(loc: Location) -> procs.PidState:
    """The cache server's pid-file state: this deployment's own pid file, or (when that is
    absent) the one kvpersist 0.1 kept in the cache root, if it names a live cache server of
    this cache root on this deployment's port."""
    st = procs.check_pid_file(loc.server_pid_file, loc.server_markers)
    if st.state != "absent":
        return st
    # the legacy pid file is shared by every deployment of the root: it counts only for the
    # server listening on this deployment's port
    legacy = procs.check_pid_file(loc.legacy_server_pid_file, loc.server_markers,
                                  (("--port", str(loc.listen["lmcache"][1])),))
    return legacy if legacy.running else st


def vllm_state(loc: Location) -> procs.PidState:
    """vLLM's pid-file state (direct-process mode)."""
    return procs.check_pid_file(loc.vllm_pid_file, loc.vllm_markers)


def vllm_ready(plan: Location, timeout: float = 2.0) -> bool:
    """True if vLLM answers ``/health`` and ``/v1/models`` lists the served name with the
    namespace as its root (the namespace reaches LMCache)."""
    return plan.vllm(timeout).serves(plan.namespace, plan.served_model_name)


# --------------------------------------------------------------------------- starting


@dataclass(frozen=True)
class Started:
    """A process that launch started (or found running)."""

    what: str
    pid: int | None
    seconds: float
    already_running: bool = False
    log: str = ""


def _log_tail(path: str, lines: int = 15) -> str:
    """The last ``lines`` lines of the log ``path`` (each cut to 500 characters), read from
    its last 64 KiB only; '' when it is absent or not a regular file (a FIFO, a device)."""
    try:
        tail = read_tail(path, max_bytes=64 << 10, follow=False)
    except (FileNotFoundError, UnreadableFile):
        return ""
    text = tail.decode("utf-8", "replace").splitlines()
    return "\n".join(line[:500] for line in text[-lines:])


def refuse_if_running(state: procs.PidState, what: str, progress: Progress) -> None:
    """Raise CheckFailed when ``state`` is a live process; remove a stale pid file, after
    stopping what the dead process left running (:func:`stop_leftovers`)."""
    if state.running:
        raise CheckFailed(f"{what} is already running (pid {state.pid}, pid file "
                          f"{state.pid_file}); stop it first with `kvp-admin stop`")
    if state.state == "stale":
        progress(f"stale pid file {state.pid_file}: {state.reason}; removing it")
        note = stop_leftovers(state, what)
        if note:
            progress(note)
        procs.remove_pid_file(state.pid_file)


def stop_leftovers(state: procs.PidState, what: str) -> str:
    """Stop the processes the dead process of a stale pid file left running in its session
    (vLLM's engine core and workers outlive a ``kill -9`` of vLLM, each holding its memory:
    a launch beside them can fail for lack of memory); a line saying what was stopped, ''
    when nothing was left."""
    if state.state != "stale" or state.pid is None:
        return ""
    found = procs.leftovers(state.pid)
    if not found:
        return ""
    pids = ", ".join(str(p.pid) for p in found)
    mib = procs.resident_bytes(found) / (1 << 20)
    n = procs.stop_leftovers(found)
    return (f"stopped {n} process{'es' if n != 1 else ''} that {what} (pid {state.pid}, "
            f"dead) left running: pid {pids}, {mib:,.0f} MiB resident")


@dataclass
class Spawned:
    """A process started in the background whose readiness is not known yet (see
    :func:`wait_ready`)."""

    name: str
    proc: procs.Child
    t0: float
    log: str
    pid_file: str | None
    ready: Callable[[], bool]
    interval: float
    stop_timeout: float
    not_ready: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def abandon(self) -> None:
        """Stop it (another part of the launch failed) and remove its pid file."""
        procs.stop_process(self.proc.pid, timeout=self.stop_timeout)
        procs.wait_child(self.proc, 10)
        if self.pid_file:
            procs.remove_pid_file(self.pid_file, self.proc.pid)


def spawn_server(plan: LaunchPlan, *, progress: Progress = quiet) -> Spawned:
    """Start the cache server in the background (its readiness: :func:`wait_ready`).
    Refuses (CheckFailed) when the pid file names a live server; a stale one is removed."""
    refuse_if_running(server_state(plan), "the cache server", progress)
    progress(f"starting lmcache server (log {plan.server_log})")
    return _spawn("lmcache server", plan.server_argv, log=plan.server_log, env=plan.server_env,
                  cwd=plan.state_dir, pid_file=plan.server_pid_file,
                  ready=lambda: plan.lmcache(1.0).healthy(),
                  interval=0.25, stop_timeout=10, not_ready="not healthy")


def start_server(plan: LaunchPlan, *, timeout: float = 60.0,
                 progress: Progress = quiet) -> Started:
    """Start the cache server in the background and wait until ``/healthcheck`` answers.

    Refuses (CheckFailed) when the pid file names a live server; a stale pid file is
    removed. Raises KvpError with the log's tail if the server exits or is not healthy in
    ``timeout`` seconds (the half-started process is stopped).
    """
    return wait_ready(spawn_server(plan, progress=progress), timeout)


def _spawn(name: str, argv: list[str], *, log: str, env: Mapping[str, str], cwd: str,
           pid_file: str | None, ready: Callable[[], bool], interval: float,
           stop_timeout: float, not_ready: str) -> Spawned:
    """Start ``argv`` in the background (umask 077) and write its pid file."""
    t0 = time.monotonic()
    proc = procs.start_background(argv, log_path=log, env=env, cwd=cwd, umask=0o077)
    if pid_file:
        procs.write_pid_file(pid_file, proc.pid)
    return Spawned(name, proc, t0, log, pid_file, ready, interval, stop_timeout, not_ready)


def wait_ready(sp: Spawned, timeout: float) -> Started:
    """Wait until ``sp`` is ready (``timeout`` seconds from its start); on failure stop it,
    remove its pid file and raise KvpError with the log's tail."""
    left = max(0.0, timeout - (time.monotonic() - sp.t0))
    ok = procs.wait_for(sp.ready, left, sp.interval,
                        should_abort=lambda: sp.proc.poll() is not None)
    if not ok:
        code = sp.proc.poll()
        sp.abandon()
        why = f"exited with status {code}" if code is not None else \
            f"{sp.not_ready} after {timeout:.0f} s"
        raise KvpError(f"{sp.name} {why}; last lines of {sp.log}:\n{_log_tail(sp.log)}")
    return Started(sp.name, sp.proc.pid, time.monotonic() - sp.t0, log=sp.log)


def begin_preread(plan: LaunchPlan, progress: Progress = quiet) -> str:
    """Start the hot-files pre-read in the background (never waits, never raises) and return
    a one-line note of what happened."""
    if not plan.preread_argv:
        note = f"hot-files pre-read off ({plan.preread_skip})"
    else:
        pid, why = start_preread(plan.preread_argv, log=plan.preread_log, cwd=plan.state_dir)
        note = why or (f"hot-files pre-read started in the background (pid {pid}, "
                       f"result in {plan.preread_log})")
    progress(note)
    return note


def ensure_model_link(plan: LaunchPlan) -> None:
    """Make ``<model_link_dir>/<namespace>`` a symlink to the weights (atomic replace)."""
    link_dir = Path(plan.model_link_dir)
    link_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    link = Path(plan.model_link)
    target = os.path.abspath(plan.model_target)
    if link.is_symlink() and os.readlink(link) == target:
        return
    tmp = link_dir / f".{link.name}.new-{os.getpid()}"  # never ".tmp." (see keys.py)
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def spawn_vllm(plan: LaunchPlan, *, progress: Progress = quiet) -> Spawned:
    """Start vLLM for the deployment in the background (its readiness: :func:`wait_ready`,
    serving the namespace). Direct process: ``python <the release's serve arguments>
    <rendered args>`` in the model-link directory, pid file ``S/vllm.pid``. Container: the
    rendered ``docker run``. Raises CheckFailed if it already runs."""
    if plan.vllm_mode == "process":
        refuse_if_running(vllm_state(plan), "vLLM", progress)
    ensure_model_link(plan)
    progress(f"starting vLLM ({plan.vllm_mode}, log {plan.vllm_log})")
    return _spawn("vLLM", plan.vllm_argv, log=plan.vllm_log, env=plan.vllm_env,
                  cwd=plan.model_link_dir,
                  pid_file=plan.vllm_pid_file if plan.vllm_mode == "process" else None,
                  ready=lambda: vllm_ready(plan, 2.0), interval=0.1, stop_timeout=15,
                  not_ready="not ready")


def start_vllm(plan: LaunchPlan, *, timeout: float = 300.0,
               progress: Progress = quiet) -> Started:
    """:func:`spawn_vllm` and wait until it serves the namespace. Raises CheckFailed if it
    already runs, KvpError (with the log's tail) if it fails."""
    return wait_ready(spawn_vllm(plan, progress=progress), timeout)


# --------------------------------------------------------------------------- stopping


@dataclass(frozen=True)
class Stopped:
    what: str
    pid: int | None
    how: str  # terminated / killed / not-running / stale
    seconds: float = 0.0
    detail: str = ""
    #: what went wrong ("" when nothing did): a stale pid file that could not be removed
    error: str = ""


def stop_vllm(plan: Location, *, timeout: float = 60.0) -> Stopped:
    """Stop the deployment's vLLM (direct process via its pid file, or the container)."""
    if plan.vllm_mode == "container":
        engine = plan.container_engine
        if not shutil.which(engine):
            return Stopped("vLLM", None, "not-running", detail=f"{engine} not installed")
        r = procs.run([engine, "stop", "-t", str(int(timeout)), plan.container_name],
                      timeout=timeout + 30)
        how = "terminated" if r.returncode == 0 else "not-running"
        return Stopped("vLLM", None, how, detail=plan.container_name)
    return _stop_by_pid_file("vLLM", vllm_state(plan), timeout)


def stop_server(plan: Location, *, timeout: float = 30.0) -> Stopped:
    """Stop the cache server: SIGTERM, wait ``timeout``, then SIGKILL. L2 files stay. When it
    exited on SIGTERM (its store queue drained) a clean stop is recorded; killed, stale or
    not running records nothing (the next launch checks the crash window)."""
    res = _stop_by_pid_file("lmcache server", server_state(plan), timeout)
    if res.how == "terminated":
        crash_window.record_clean_stop(plan, res.pid, "terminated")
    return res


def _stop_by_pid_file(name: str, st: procs.PidState, timeout: float) -> Stopped:
    """Stop the process a checked pid file names. A stale pid file is only removed; one that
    cannot be (a directory in its place) is the result's ``error``, never raised: stopping
    the next process must not depend on it."""
    if st.state == "stale":
        left = stop_leftovers(st, name)
        detail = f"{st.reason}; {left}" if left else st.reason
        try:
            procs.remove_pid_file(st.pid_file)
        except KvpError as exc:  # a directory in its place: named, and the stop goes on
            return Stopped(name, st.pid, "stale", detail=detail, error=str(exc))
        return Stopped(name, st.pid, "stale", detail=detail)
    if not st.running or st.pid is None:
        return Stopped(name, None, "not-running")
    res = procs.stop_process(st.pid, timeout=timeout)
    procs.remove_pid_file(st.pid_file, st.pid)
    return Stopped(name, st.pid, res.how, res.seconds)


#: what ``stop``/``restart --only`` may name: each process of a deployment on its own
COMPONENTS = ("vllm", "server")


def stop_deployment(plan: Location, *, timeout: float = 30.0,
                    vllm: bool = True, server: bool = True) -> list[Stopped]:
    """vLLM first (it holds connections to the server), then the cache server; ``vllm`` /
    ``server`` False leaves that one running (they are independent processes: vLLM serves on,
    cold, while the server is away, and reconnects to it by itself)."""
    out = []
    if vllm:
        # vLLM drains the requests in flight first (--shutdown-timeout, rendered): wait for it
        out.append(stop_vllm(plan, timeout=max(timeout, VLLM_STOP_SECONDS)))
    if server:
        out.append(stop_server(plan, timeout=timeout))
    return out


__all__ = ["COMPONENTS", "Progress", "Spawned", "Started", "Stopped", "begin_preread",
           "ensure_model_link", "quiet", "refuse_if_running", "server_state",
           "spawn_server", "spawn_vllm", "start_server", "start_vllm", "stop_deployment",
           "stop_leftovers", "stop_server", "stop_vllm", "vllm_ready", "vllm_state", "wait_ready"]
