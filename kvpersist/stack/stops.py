"""Was the cache server's last stop clean? (pure: values in, a decision out)

kvpersist writes two small records beside the server's pid file
(``<state>/pids/<config>.lmcache.pid``):

* ``<config>.lmcache.launched.json`` at every launch, *before* the server starts:
  ``{"schema": "kvpersist.launched/1", "launched_at_ns", "check_since_ns"}``;
* ``<config>.lmcache.clean-stop.json`` when the server stopped cleanly: ``kvp-admin stop``
  saw it exit after SIGTERM (its store queue drained), or systemd's ``ExecStopPost`` reported
  that the main process exited by itself with success (``kvp-admin stop --systemd-stop-post``):
  ``{"schema": "kvpersist.clean-stop/1", "stopped_at_ns", "pid", "how"}``.

:func:`decide` turns those records and the pid file's state into a :class:`CrashWindow`: after
an unclean stop (the server was killed, crashed, or stopped with SIGKILL after the timeout)
the files written since the last launch may be what a crash left behind, and launch checks
them before the server starts (:mod:`kvpersist.stack.crash_window`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

LAUNCHED_SCHEMA = "kvpersist.launched/1"
CLEAN_STOP_SCHEMA = "kvpersist.clean-stop/1"


@dataclass(frozen=True)
class Launched:
    launched_at_ns: int
    #: where the next crash-window check starts: this launch, or earlier when the check at
    #: this launch did not finish (its window carries over)
    check_since_ns: int

    def to_dict(self) -> dict[str, Any]:
        return {"schema": LAUNCHED_SCHEMA, "launched_at_ns": self.launched_at_ns,
                "check_since_ns": self.check_since_ns}

    @classmethod
    def from_dict(cls, d: Any) -> Launched | None:
        """The record, or None if ``d`` is not one (an unreadable record is no record)."""
        if not isinstance(d, dict) or d.get("schema") != LAUNCHED_SCHEMA:
            return None
        at, since = d.get("launched_at_ns"), d.get("check_since_ns", d.get("launched_at_ns"))
        if not (_ns(at) and _ns(since)):
            return None
        return cls(at, since)


@dataclass(frozen=True)
class CleanStop:
    stopped_at_ns: int
    pid: int | None
    how: str  # "terminated" (kvp-admin stop) / "systemd" (ExecStopPost)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": CLEAN_STOP_SCHEMA, "stopped_at_ns": self.stopped_at_ns,
                "pid": self.pid, "how": self.how}

    @classmethod
    def from_dict(cls, d: Any) -> CleanStop | None:
        """The record, or None if ``d`` is not one (a field of the wrong type included)."""
        if not isinstance(d, dict) or d.get("schema") != CLEAN_STOP_SCHEMA:
            return None
        at, pid, how = d.get("stopped_at_ns"), d.get("pid"), d.get("how", "")
        if not _ns(at) or not (pid is None or _ns(pid)) or not (
                isinstance(how, str) and len(how) <= 64):
            return None
        return cls(at, pid, how)


def _ns(value: Any) -> TypeGuard[int]:
    """A time in nanoseconds (or a pid): an int, not a bool, from 0 to 2**63 - 1."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


@dataclass(frozen=True)
class CrashWindow:
    """Whether the last stop was unclean, and from when files must be checked."""

    unclean: bool
    since_ns: int | None
    reason: str


def decide(*, pid_state: str, pid_file_mtime_ns: int | None, launched: Launched | None,
           clean_stop: CleanStop | None, launched_unreadable: str = "") -> CrashWindow:
    """Decide from the pid file's state (``absent`` / ``stale`` / ``running``, see
    :func:`kvpersist.system.procs.check_pid_file`) and the two records (an unreadable
    clean-stop record is no clean stop).

    * a clean stop recorded at or after the last launch: clean, nothing to check;
    * a launch recorded and no clean stop after it: unclean, check files modified since the
      launch (or since the start of an earlier check that did not finish);
    * a launch record that exists but cannot be read (``launched_unreadable`` says why):
      when the last launch was is unknown, so unclean, and every file is checked (since 0;
      the check's time bound holds, and what it leaves carries over to the next launch);
    * no launch record (a deployment started before kvpersist wrote one) but the pid file of
      a dead server: unclean, since the pid file was written (at that server's start);
    * otherwise (first launch, nothing known): nothing to check.
    """
    if pid_state == "running":
        return CrashWindow(False, None, "the server is running")
    if launched is None and launched_unreadable:
        return CrashWindow(True, 0, f"the launch record is unreadable ({launched_unreadable}):"
                           " when the last launch was is unknown, so every file is checked")
    if launched is not None:
        if clean_stop is not None and clean_stop.stopped_at_ns >= launched.launched_at_ns:
            return CrashWindow(False, None, f"clean stop ({clean_stop.how})")
        why = ("the pid file names a dead server" if pid_state == "stale"
               else "no clean stop was recorded after the last launch")
        return CrashWindow(True, launched.check_since_ns, f"unclean stop: {why}")
    if pid_state == "stale" and pid_file_mtime_ns is not None:
        if clean_stop is not None and clean_stop.stopped_at_ns >= pid_file_mtime_ns:
            return CrashWindow(False, None, f"clean stop ({clean_stop.how})")
        return CrashWindow(True, pid_file_mtime_ns,
                           "unclean stop: the pid file names a dead server (no launch record)")
    return CrashWindow(False, None, "no earlier run recorded")


def systemd_stop_was_clean(environ: dict[str, str]) -> bool:
    """Whether systemd's ``ExecStopPost`` environment says the main process exited by itself
    with success (``SERVICE_RESULT=success``, ``EXIT_CODE=exited``, ``EXIT_STATUS=0``). Killed
    by any signal (SIGKILL, a timeout, a crash) is not clean."""
    return (environ.get("SERVICE_RESULT") == "success"
            and environ.get("EXIT_CODE") == "exited"
            and environ.get("EXIT_STATUS") == "0")


def systemd_stop_was_deliberate(environ: dict[str, str]) -> bool:
    """Whether systemd's ``ExecStopPost`` environment says the unit ended without a failure
    (``SERVICE_RESULT=success``): a ``systemctl stop`` whose SIGTERM ended the server counts
    (systemd treats SIGTERM as a clean signal; stock LMCache 0.5.6 ends by it), a crash, a
    timeout or a failed exit does not (``Restart=on-failure`` starts it again). Weaker than
    :func:`systemd_stop_was_clean`: enough to withdraw the host's fleet record, not to skip
    the crash-window check."""
    return environ.get("SERVICE_RESULT") == "success"
