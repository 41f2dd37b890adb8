"""Readiness: the warm-up between "vLLM serves" and "the deployment is ready".

Order, wherever a deployment starts (``kvp-admin launch``, the systemd units, the
``KV_PERSIST=1`` hook): the cache server is healthy → vLLM answers and has registered its KV
layout with the server (a vLLM worker registers before the OpenAI server answers) → the
prime (:mod:`kvpersist.stack.warm.prime`: one short request, so that the first user does not
pay vLLM's first-request cost) → the warm-up (:mod:`kvpersist.stack.warm.run`, the engine
``kvp-admin warmup CONFIG --wait S`` runs too: the warm set's chunks L2 → L1) → ready. A
prime or a warm-up that fails or times out never takes the deployment down: vLLM keeps
serving, cold, and health reports a failed warm-up *degraded* (component ``warmup``) until the
next warm-up succeeds or the cache server restarts.

The warm-up runs as a child process (it runs as the service user and imports vLLM):
``python -m kvpersist.stack.warm.run CONFIG --wait S --json``, given the config argument and
the environment the launch loaded the deployment with, so that it loads the same deployment
(once: another process cannot be handed the parent's). Its pid is kept in
``S/pids/<name>.warmup.pid`` after it ends (checked against :data:`WARMUP_MARKERS`), and its
state is the record it writes, ``S/warmup.json`` (``{"state": "warming"|"done"|"failed",
"namespace", "started", "finished", "requested_chunks", "found_chunks", "bytes", "seconds",
"error"}``).

:func:`judge` (pure) turns that record, the pid file's state and the cache server's start time
into health checks; :func:`run_warmup` and :func:`warmup_after_vllm` do the I/O.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvpersist.errors import KvpError
from kvpersist.stack.canary.run import CanaryRun, recompute_reason, run_canary
from kvpersist.stack.canary.verdict import FAILED
from kvpersist.stack.locate import Location
from kvpersist.stack.processes import vllm_ready
from kvpersist.stack.warm import gate
from kvpersist.stack.warm.handoff import Handoff, write_handoff
from kvpersist.stack.warm.prime import PRIME_TIMEOUT_S, PrimeRun, prime_vllm
from kvpersist.system import procs
from kvpersist.system.untrusted import (
    MAX_STATE_BYTES,
    UnreadableFile,
    read_json_object,
    read_tail,
)

#: the warm-up child's module (``python -m``): kvp-admin's own command line
WARMUP_MODULE = "kvpersist.cli"
#: argv markers of the warm-up child (its pid file is checked against them): only the child
#: a launch starts is handed the rendered plan
WARMUP_MARKERS = (WARMUP_MODULE, "--rendered")
#: seconds a warm-up may run past its own ``--wait`` (process start, the tokenizer's import)
#: before the launch stops it; also how long past that a "warming" record without a known
#: process still counts as warming
GRACE_S = 90.0
#: how much of the end of a log is read for its last line
LOG_TAIL_BYTES = 64 << 10

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# --------------------------------------------------------------------------- judgement (pure)


@dataclass(frozen=True)
class WarmupFacts:
    """What health found about the warm-up (plain data)."""

    #: the record as read (None: there is none)
    record: dict[str, Any] | None = None
    #: why the record could not be read ("" when it could, or there is none)
    error: str = ""
    #: the warm-up pid file: running / stale / absent, its pid and why it is stale
    pid_state: str = "absent"
    pid: int | None = None
    pid_reason: str = ""
    #: when the cache server's process started (epoch seconds; None: unknown)
    server_started: float | None = None
    #: KVP_WARMUP_WAIT
    wait_s: float = 120.0
    #: when the facts were gathered (epoch seconds)
    now: float = 0.0


def epoch_of(value: Any) -> float | None:
    """Epoch seconds of a record's time (pure): a number (seconds; nanoseconds when above
    1e12) or an ISO 8601 string (a naive one is UTC); None when absent or unreadable (a
    number too big for a float included)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        try:
            return float(value) / 1e9 if value > 1e12 else float(value)
        except OverflowError:
            return None
    if isinstance(value, str) and value:
        try:
            dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        return dt.timestamp()
    return None


def _counts(rec: Mapping[str, Any]) -> str:
    found, requested = rec.get("found_chunks"), rec.get("requested_chunks")
    out = f"{found if found is not None else '?'}/{requested if requested is not None else '?'}"
    out += " chunks found"
    nbytes = rec.get("bytes")
    if isinstance(nbytes, int | float) and not isinstance(nbytes, bool):
        out += f", {int(nbytes) >> 20} MiB"
    secs = rec.get("seconds")
    if isinstance(secs, int | float) and not isinstance(secs, bool):
        out += f" in {float(secs):.1f} s"
    return out


def judge(f: WarmupFacts, namespace: str) -> tuple[str, str] | None:
    """The warm-up's check for ``namespace``: ``(status, detail)`` with status ``ok``,
    ``warming``, ``degraded`` or ``skipped``, or None when there is no record at all.

    * a record for another namespace, or one started before the cache server (whose L1 it
      warmed is gone), is ignored (``skipped``);
    * ``warming`` while the warm-up's process runs; a "warming" record whose process is
      gone (killed, crashed) is ``degraded``; without a pid file (a warm-up run by hand) the
      record counts as warming for ``wait_s`` + :data:`GRACE_S` after it started, then as
      stuck (``degraded``);
    * ``failed`` → ``degraded`` (vLLM serves, cold); ``done`` → ``ok``, whatever was found
      (missing chunks are not computed yet: normal).
    """
    if f.error:
        return "degraded", f"warm-up record unreadable: {f.error}"
    rec = f.record
    if rec is None:
        return None
    ns = rec.get("namespace")
    if ns != namespace:
        return "skipped", (f"the warm-up record is for namespace {ns!r}, not {namespace}: "
                           "ignored")
    started = epoch_of(rec.get("started"))
    if (started is not None and f.server_started is not None
            and started < f.server_started - 1.0):
        return "skipped", ("the last warm-up ran before the cache server started (its L1 is "
                           "gone): this server has not been warmed")
    state = rec.get("state")
    if state == "done" and rec.get("warm_set") is False:
        return "skipped", "no warm set (KVP_WARMUP_FILE is empty): nothing to warm"
    if state == "done":
        return "ok", f"warm: {_counts(rec)}"
    if state == "failed":
        return "degraded", (f"warm-up failed ({rec.get('error') or 'no reason given'}; "
                            f"{_counts(rec)}): serving, cold; `kvp-admin warmup` retries")
    if state != "warming":
        return "degraded", f"warm-up record has an unknown state {state!r}"
    age = f"{f.now - started:.0f} s" if started is not None else "an unknown time"
    if f.pid_state == "running":
        return "warming", f"warming (pid {f.pid}) for {age}"
    if f.pid_state == "stale":
        return "degraded", (f"the warm-up ended without a result ({f.pid_reason}): serving, "
                            "cold; `kvp-admin warmup` retries")
    limit = f.wait_s + GRACE_S
    if started is not None and f.now - started <= limit:
        return "warming", f"warming for {age}"
    return "degraded", (f"the warm-up has said 'warming' for {age}, more than "
                        f"KVP_WARMUP_WAIT + {GRACE_S:.0f} s, with no process known: it died; "
                        "serving, cold; `kvp-admin warmup` retries")


# --------------------------------------------------------------------------- reading (I/O)


#: the fields of a warm-up record (``kvpersist.warmup/1``) and what each may hold; a record
#: is read as these fields only (others are dropped), each checked
_RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "schema": (str,), "state": (str,), "namespace": (str,), "started": (str, int, float),
    "finished": (str, int, float), "requested_chunks": (int,), "found_chunks": (int,),
    "bytes": (int,), "seconds": (int, float), "error": (str,), "warm_set": (bool,),
    "warm_file_sha256": (str,)}
#: the longest string a record's field may hold but ``error`` (cut, when shown, to
#: :data:`ERROR_SHOWN`)
_FIELD_CHARS = 256
ERROR_SHOWN = 1000


def read_record(path: str) -> tuple[dict[str, Any] | None, str]:
    """The warm-up record at ``path`` and an error message (``(None, "")`` when absent).

    Read as untrusted (:mod:`kvpersist.system.untrusted`: never through a link, never
    blocking on a FIFO, at most :data:`~kvpersist.system.untrusted.MAX_STATE_BYTES`,
    depth-limited, finite numbers only) and typed: the record holds the fields of
    :data:`_RECORD_FIELDS` only, each null or of its type (strings at most 256 characters,
    ``error`` cut to :data:`ERROR_SHOWN`; integers from 0 to 2**63 - 1). One that fails is
    the error (health: *degraded*, "warm-up record unreadable"). Never raises."""
    try:
        doc = read_json_object(path, follow=False, max_bytes=MAX_STATE_BYTES)
    except FileNotFoundError:
        return None, ""
    except UnreadableFile as exc:
        return None, str(exc)
    record: dict[str, Any] = {}
    for key, types in _RECORD_FIELDS.items():
        value: Any = doc.get(key)
        if value is None:
            record[key] = None
            continue
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            return None, f"{path}: {key} is a JSON {type(value).__name__}, not what a " \
                "warm-up record holds there"
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < 1 << 63:
            return None, f"{path}: {key} is out of range"
        if isinstance(value, str) and key != "error" and len(value) > _FIELD_CHARS:
            return None, f"{path}: {key} is longer than {_FIELD_CHARS} characters"
        if key == "error" and isinstance(value, str) and len(value) > ERROR_SHOWN:
            value = f"{value[:ERROR_SHOWN]}… ({len(value) - ERROR_SHOWN:,} more characters)"
        record[key] = value
    return record, ""


def gather(loc: Location, server_pid: int | None) -> WarmupFacts:
    """The warm-up facts of a deployment: its record, its pid file (checked, not trusted)
    and when the cache server ``server_pid`` started. Never raises."""
    record, error = read_record(loc.warmup_state_file)
    st = procs.check_pid_file(loc.warmup_pid_file, WARMUP_MARKERS)
    started = procs.start_time(server_pid) if server_pid else None
    return WarmupFacts(record, error, st.state, st.pid, st.reason, started, loc.warmup_wait,
                       time.time())


# --------------------------------------------------------------------------- running (I/O)


@dataclass(frozen=True)
class WarmupRun:
    """What the warm-up step did: ``state`` is ``done``, ``failed`` (also a timeout, a crash,
    or bad input) or ``skipped``; the record as the warm-up left it."""

    state: str
    detail: str
    seconds: float = 0.0
    exit_code: int | None = None
    pid: int | None = None
    record: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.state != "failed"

    def to_dict(self) -> dict[str, Any]:
        rec = self.record or {}
        return {"state": self.state, "detail": self.detail, "seconds": round(self.seconds, 2),
                "exit_code": self.exit_code, "pid": self.pid,
                "requested_chunks": rec.get("requested_chunks"),
                "found_chunks": rec.get("found_chunks"), "bytes": rec.get("bytes")}


def warmup_argv(config: str, wait_s: float, handoff_file: str, *,
                python: str | None = None) -> list[str]:
    """The warm-up command (pure): ``python -m kvpersist.cli warmup CONFIG --wait S --json
    --rendered FILE``: ``kvp-admin warmup`` handed the launch's rendered plan."""
    return [python or sys.executable, "-m", WARMUP_MODULE, "warmup", config,
            "--wait", f"{wait_s:g}", "--json", "--rendered", handoff_file]


def service_ids(loc: Location) -> tuple[int, int] | None:
    """(uid, gid) to run the warm-up as: the deployment's KVP_SERVICE_USER when root runs
    kvp-admin (the vLLM unit runs as root for docker), so that the record, the pid file and
    the log belong to the user whose health check reads them; None otherwise."""
    if os.geteuid() != 0 or not loc.service_user:
        return None
    import pwd

    try:
        pw = pwd.getpwnam(loc.service_user)
    except KeyError:
        return None
    return (pw.pw_uid, pw.pw_gid) if pw.pw_uid != 0 else None


@dataclass
class StartedWarmup:
    """A warm-up child that runs (:func:`start_warmup`); :meth:`finish` waits for it.
    With a gate (an early start, :mod:`kvpersist.stack.warm.gate`) it waits before vLLM
    until :meth:`release` or :meth:`cancel`."""

    loc: Location
    proc: procs.Child
    wait: float
    t0: float
    started_at: float
    gate: str = ""
    ids: tuple[int, int] | None = None

    def release(self) -> None:
        """Open the gate: the child goes on to vLLM; the wait counts from now. A gate that
        cannot be written stops the child (its result says so)."""
        self.t0 = time.monotonic()
        if self.gate:
            try:
                gate.open_gate(self.gate, ids=self.ids)
            except (OSError, KvpError):
                procs.stop_process(self.proc.pid, timeout=10)

    def cancel(self, why: str) -> None:
        """Close the gate (``why``) and wait for the child to end (stopped if it does not
        within a few seconds). Never raises."""
        try:
            if self.gate:
                gate.open_gate(self.gate, why, ids=self.ids)
        except (OSError, KvpError):
            pass
        if procs.wait_child(self.proc, 5.0) is None:
            procs.stop_process(self.proc.pid, timeout=10)
            procs.wait_child(self.proc, 30)

    def finish(self) -> WarmupRun:
        """Wait for the child at most S + :data:`GRACE_S` seconds from the start (or the
        :meth:`release`), stop it past that; what it did."""
        loc, proc, wait = self.loc, self.proc, self.wait
        code = procs.wait_child(proc, max(0.0, wait + GRACE_S - (time.monotonic() - self.t0)))
        if code is None:
            procs.stop_process(proc.pid, timeout=10)
            procs.wait_child(proc, 30)
        seconds = time.monotonic() - self.t0
        record, error = read_record(loc.warmup_state_file)
        if record is not None and (record.get("namespace") != loc.namespace or (
                epoch_of(record.get("started")) or 0) < self.started_at - 1.0):
            record = None  # another namespace's, or an earlier run's
        if code is None:
            return WarmupRun("failed", f"the warm-up did not end within {wait + GRACE_S:.0f} "
                             "s and was stopped", seconds, None, proc.pid, record)
        if code == 0:
            if record is None or record.get("warm_set") is False:  # no warm set
                return WarmupRun("skipped", "no warm set (KVP_WARMUP_FILE is empty)", seconds,
                                 0, proc.pid, record)
            return WarmupRun("done", f"warm: {_counts(record)}", seconds, 0, proc.pid, record)
        why = (record or {}).get("error") or error or _last_line(loc.warmup_log)
        return WarmupRun("failed", f"exit {code}: {why or 'no reason given'}", seconds, code,
                         proc.pid, record)


def start_warmup(loc: Location, config: str, handoff: Handoff, *, env: Mapping[str, str],
                 wait_s: float | None = None, cwd: str | None = None, early: bool = False,
                 progress: Progress = _quiet) -> StartedWarmup | WarmupRun:
    """Start the warm-up child (:func:`warmup_argv`; output appended to the warm-up log,
    pid in the warm-up pid file, kept after it ends; as KVP_SERVICE_USER when run by root).
    ``early``: while vLLM still loads, with a gate (``loc.warmup_gate_file``): the child
    prefetches once vLLM serves and waits at the gate before vLLM. Returns the running child,
    or the failed WarmupRun when it cannot be started (never raises for that)."""
    wait = loc.warmup_wait if wait_s is None else wait_s
    argv = warmup_argv(config, wait, loc.warmup_handoff_file)
    ids = service_ids(loc)
    if ids is not None:
        # the service user's home and JIT cache, as in the cache server's unit
        env = {**env, "HOME": loc.state_dir,
               "NUMBA_CACHE_DIR": env.get("NUMBA_CACHE_DIR",
                                          os.path.join(loc.state_dir, "numba-cache"))}
    progress(f"warming up (at most {wait:g} s; log {loc.warmup_log})")
    t0, started_at = time.monotonic(), time.time()
    log_dir = os.path.dirname(loc.warmup_log)
    gate_file = loc.warmup_gate_file if early else ""
    try:
        if not os.path.isdir(log_dir):
            os.makedirs(log_dir, mode=0o700)
            if ids is not None:
                os.chown(log_dir, *ids, follow_symlinks=False)
        gate.clear(loc.warmup_gate_file)
        write_handoff(loc.warmup_handoff_file,
                      Handoff(handoff.vllm_argv, handoff.server_argv, gate_file), ids)
        proc = procs.start_background(argv, log_path=loc.warmup_log, env=env, cwd=cwd,
                                      as_ids=ids)
    except (OSError, KvpError) as exc:
        return WarmupRun("failed", f"cannot start the warm-up: {exc}",
                         time.monotonic() - t0)
    try:
        procs.write_pid_file(loc.warmup_pid_file, proc.pid)
        if ids is not None:
            os.chown(loc.warmup_pid_file, *ids, follow_symlinks=False)
    except (OSError, KvpError) as exc:  # a pid file is not worth the warm-up
        progress(f"WARNING: warm-up pid file {loc.warmup_pid_file} not written: {exc}")
    return StartedWarmup(loc, proc, wait, t0, started_at, gate_file, ids)


def run_warmup(loc: Location, config: str, handoff: Handoff, *, env: Mapping[str, str],
               wait_s: float | None = None, cwd: str | None = None,
               progress: Progress = _quiet) -> WarmupRun:
    """Run the warm-up (:func:`start_warmup`, no gate) and wait for it at most S +
    :data:`GRACE_S` seconds (then stop it). S defaults to KVP_WARMUP_WAIT. ``config`` and
    ``env`` are what the deployment was loaded with: the child loads the same one;
    ``handoff`` (the rendered arguments it uses) is written to ``loc.warmup_handoff_file``
    for it. Never raises for a warm-up that fails: the result says so; vLLM keeps serving
    either way."""
    started = start_warmup(loc, config, handoff, env=env, wait_s=wait_s, cwd=cwd,
                           progress=progress)
    return started if isinstance(started, WarmupRun) else started.finish()


def _last_line(path: str) -> str:
    """The last non-blank line of the log ``path`` (at most 300 characters), read from its
    last :data:`LOG_TAIL_BYTES` only (a log may be huge, a FIFO or a device: '' then)."""
    try:
        tail = read_tail(path, max_bytes=LOG_TAIL_BYTES, follow=False)
    except (FileNotFoundError, UnreadableFile):
        return ""
    lines = [ln.strip() for ln in tail.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def log_to(path: str, progress: Progress) -> Progress:
    """``progress`` that also appends each line, time-stamped, to the log at ``path`` (the
    scripts run the readiness step detached, its output discarded: the log keeps it).
    A line that cannot be written is only shown."""

    def both(msg: str) -> None:
        progress(msg)
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} kvp-admin launch " \
               f"--warmup-only: {msg}\n"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        except OSError:
            return
        try:
            os.write(fd, line.encode("utf-8", "replace"))
        except OSError:
            pass
        finally:
            os.close(fd)

    return both


NO_WARM_SET = WarmupRun("skipped", "no warm set (KVP_WARMUP_FILE is empty)")


@dataclass(frozen=True)
class AfterVllm:
    """The readiness step of a vLLM started by someone else: the prime (None: vLLM did not
    serve in time) and the warm-up."""

    prime: PrimeRun | None
    warmup: WarmupRun
    #: the canary's run (None: not run: vLLM did not serve, KVP_CANARY off, or the
    #: namespace serves recomputed after a failure)
    canary: CanaryRun | None = None


def warmup_after_vllm(loc: Location, config: str, handoff: Handoff, *, warm_file: str,
                      env: Mapping[str, str], deadline_s: float, cwd: str | None = None,
                      vllm_pid: int | None = None,
                      progress: Progress = _quiet) -> AfterVllm:
    """For the units and the hook, which start vLLM themselves: wait until vLLM serves the
    namespace, prime it (:mod:`kvpersist.stack.warm.prime`), then :func:`run_warmup`, all of it
    within ``deadline_s`` seconds (the vLLM unit's start timeout must not expire under it):
    the warm-up gets KVP_WARMUP_WAIT or what is left, whichever is less. Without a warm set
    (``warm_file`` empty) the warm-up is skipped, the prime is not. ``vllm_pid``: the vLLM
    process (the unit's main process): the wait ends as soon as it exits, so that a vLLM
    that dies while it starts fails its unit at once instead of after the whole deadline.
    Never raises for a vLLM that does not come up in time (the result says so)."""
    t0 = time.monotonic()
    vllm_bound = max(1.0, deadline_s - GRACE_S - 10.0)
    exited = procs.exit_watch(vllm_pid) if vllm_pid is not None else (lambda: False)
    progress(f"waiting for vLLM at {loc.vllm_url} to serve {loc.namespace} "
             f"(at most {vllm_bound:.0f} s)")
    if not procs.wait_for(lambda: vllm_ready(loc, 2.0), vllm_bound, 2.0,
                          should_abort=exited):
        what = "no warm-up" if warm_file else "not primed"
        why = (f"vLLM (pid {vllm_pid}) exited before it served the namespace" if exited()
               else f"vLLM did not serve the namespace within {vllm_bound:.0f} s")
        return AfterVllm(None, WarmupRun("failed", f"{why}: {what}", time.monotonic() - t0))
    progress(f"vLLM serves after {time.monotonic() - t0:.1f} s")
    primed = prime_vllm(loc, timeout=min(PRIME_TIMEOUT_S, max(1.0, deadline_s / 4)))
    progress(primed.summary())
    canary: CanaryRun | None = None
    if recompute_reason(loc):
        progress("vLLM serves without the cache (the canary failed): no canary, no warm-up")
        return AfterVllm(primed, WarmupRun("skipped", "vLLM serves without the cache (the "
                                           "canary failed)"))
    if loc.canary_enabled:
        canary = run_canary(loc, when="readiness")
        progress(canary.summary())
        if canary.state == FAILED:
            return AfterVllm(primed, WarmupRun("skipped", "the canary failed"), canary)
    if not warm_file:
        return AfterVllm(primed, NO_WARM_SET, canary)
    elapsed = time.monotonic() - t0
    wait = min(loc.warmup_wait, deadline_s - elapsed - GRACE_S)
    if wait < 1.0:
        return AfterVllm(primed, WarmupRun(
            "failed", f"no time left for a warm-up within {deadline_s:.0f} s", elapsed),
            canary)
    return AfterVllm(primed, run_warmup(loc, config, handoff, env=env, wait_s=wait, cwd=cwd,
                                        progress=progress), canary)


__all__ = ["GRACE_S", "AfterVllm", "NO_WARM_SET", "WARMUP_MARKERS", "WARMUP_MODULE", "WarmupFacts",
           "StartedWarmup", "WarmupRun", "epoch_of", "gather", "judge", "log_to", "read_record",
           "run_warmup", "service_ids", "start_warmup", "warmup_after_vllm", "warmup_argv"]
