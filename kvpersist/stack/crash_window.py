"""The crash-window check at launch (I/O): after an unclean stop, verify the chunk files
written since the last launch and quarantine those that fail, before the server starts.

Records (see :mod:`kvpersist.stack.stops` for what they mean) live beside the pid file. The
check reuses :func:`kvpersist.l2.verify.root.verify_root` with ``since_ns`` (only files modified at
or after it), a read-rate cap and a time bound; quarantine is verify's rename into
``<cache root>/.kvpersist/quarantine/`` through directory descriptors. Nothing is deleted.
Each check is appended as one JSON line to ``<log dir>/launch.log``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpersist.errors import KvpError
from kvpersist.l2.frames import MAX_CHUNK_FILE_BYTES
from kvpersist.l2.keys import store as keys
from kvpersist.l2.pins.store import read_pins
from kvpersist.l2.scrub import scrub_root
from kvpersist.l2.tree import open_root
from kvpersist.l2.verify import frame_store
from kvpersist.l2.verify.frame_store import SERDE_NONE, FrameSummary
from kvpersist.l2.verify.root import EMPTY_WINDOW, verify_root
from kvpersist.stack.launch_options import CRASH_RATE_MB_S, CRASH_SECONDS
from kvpersist.stack.locate import Location
from kvpersist.stack.render import SERDE_NONE_WARNING
from kvpersist.stack.stops import CleanStop, CrashWindow, Launched, decide
from kvpersist.system import procs
from kvpersist.system.files import atomic_write_json, make_dirs, service_uids
from kvpersist.system.untrusted import MAX_RECORD_BYTES, UnreadableFile, read_json_object

SCHEMA = "kvpersist.crash-window/1"
LAUNCH_LOG = "launch.log"
#: defaults: read at most this many MB/s, and stop reading after this many seconds
DEFAULT_RATE_MB_S = CRASH_RATE_MB_S
DEFAULT_SECONDS = CRASH_SECONDS

def launched_record(loc: Location) -> str:
    return _beside_pid_file(loc, "launched.json")


def clean_stop_record(loc: Location) -> str:
    return _beside_pid_file(loc, "clean-stop.json")


def _beside_pid_file(loc: Location, suffix: str) -> str:
    base = loc.server_pid_file
    return (base[:-len(".pid")] if base.endswith(".pid") else base) + "." + suffix


def read_record(path: str) -> tuple[dict[str, Any] | None, str]:
    """The JSON object at ``path`` and why it could not be read: ``(None, "")`` when it is
    absent. Read as untrusted (:mod:`kvpersist.system.untrusted`: a FIFO, a device, a link,
    a directory, more than :data:`~kvpersist.system.untrusted.MAX_RECORD_BYTES`, deep
    nesting, NaN are each a reason, never a hang or a traceback). Never raises."""
    try:
        return read_json_object(path, follow=False, max_bytes=MAX_RECORD_BYTES), ""
    except FileNotFoundError:
        return None, ""
    except UnreadableFile as exc:
        return None, exc.why


def window_of(loc: Location, pid_state: procs.PidState) -> CrashWindow:
    """The decision for ``loc`` given its server pid file's state (read before launch
    removes a stale pid file). A clean-stop record that cannot be read, or is not one, is no
    clean stop; a launch record that cannot be read, or is not one, makes every file of the
    namespace checked (:func:`~kvpersist.stack.stops.decide`). Never raises."""
    mtime: int | None = None
    if pid_state.state == "stale":
        try:
            mtime = os.stat(pid_state.pid_file, follow_symlinks=False).st_mtime_ns
        except OSError:
            mtime = None
    doc, why = read_record(launched_record(loc))
    launched = Launched.from_dict(doc)
    if doc is not None and launched is None:
        why = "not a kvpersist launch record"
    clean, _ = read_record(clean_stop_record(loc))
    return decide(pid_state=pid_state.state, pid_file_mtime_ns=mtime, launched=launched,
                  clean_stop=CleanStop.from_dict(clean),
                  launched_unreadable=f"{launched_record(loc)}: {why}" if why else "")


def record_launch(loc: Location, *, carry_since_ns: int | None = None) -> Launched:
    """Write the launch record (before the server starts). ``carry_since_ns``: the start of a
    crash window whose check did not finish, so the next launch checks it again. Raises
    KvpError if it cannot be written."""
    now = time.time_ns()
    rec = Launched(now, min(now, carry_since_ns) if carry_since_ns is not None else now)
    _write(launched_record(loc), rec.to_dict())
    return rec


def record_clean_stop(loc: Location, pid: int | None, how: str) -> CleanStop:
    """Write the clean-stop marker. Raises KvpError if it cannot be written."""
    rec = CleanStop(time.time_ns(), pid, how)
    _write(clean_stop_record(loc), rec.to_dict())
    return rec


def _write(path: str, obj: dict[str, Any]) -> None:
    try:
        make_dirs(os.path.dirname(path))
        atomic_write_json(path, obj)
    except OSError as exc:
        raise KvpError(f"cannot write {path}: {exc.strerror}") from exc


@dataclass
class CrashCheck:
    """What the crash-window check at a launch found and did (``kvpersist.crash-window/1``)."""

    unclean: bool
    reason: str
    since_ns: int | None = None
    serde: str = ""
    ran: bool = False
    files: int = 0
    authenticated: int = 0
    bytes_read: int = 0
    reference_reads: int = 0
    failed: int = 0
    quarantined: list[str] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    unchecked: int = 0
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    #: files of the window whose padding after the frame was zeroed (kvpersist.l2.scrub);
    #: the scrub has its own time bound, ``deadline_s`` again (the rest: the next scrub)
    scrubbed: int = 0
    scrub_seconds: float = 0.0
    #: the check of the namespace's frame record, at every launch (aesgcm): its files
    #: changed since the record saw them read (13 bytes each), a frame recorded under
    #: another chunk's name quarantined (``moved``, in ``findings`` and ``quarantined``)
    frames: FrameSummary | None = None

    @property
    def complete(self) -> bool:
        return not self.unchecked

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = SCHEMA
        d["complete"] = self.complete
        return d

    def summary(self) -> str:
        """One line for the launch's progress output and log."""
        if not self.unclean:
            return f"crash window: not checked ({self.reason})"
        if not self.ran:
            return f"crash window: {self.reason}; not checked"
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((self.since_ns or 0) / 1e9))
        what = "authenticated" if self.serde == "aesgcm" else "sizes checked (serde none)"
        line = (f"crash window: {self.reason}; checked {self.files} chunk file(s) modified "
                f"since {since}: {self.authenticated if self.serde == 'aesgcm' else self.files}"
                f" {what}, {self.failed} failed, {len(self.quarantined)} quarantined "
                f"({self.bytes_read / 1e6:.1f} MB read in {self.seconds:.1f} s)")
        if self.scrubbed:
            line += f"; padding zeroed after the frame of {self.scrubbed} file(s)"
        if self.unchecked:
            line += (f"; {self.unchecked} file(s) NOT checked (time bound reached): the next "
                     "launch checks them again, or run `kvp-admin verify CONFIG --apply`")
        return line

    def frames_line(self) -> str:
        """One line on the frame record's check ('' when it did not run)."""
        f = self.frames
        if f is None:
            return ""
        if not f.applies:
            return f"frame record: does not apply ({f.reason})"
        moved = [q for q in self.quarantined if ".moved." in q or ".dup." in q]
        line = (f"frame record: {f.files} chunk file(s), {f.unchanged} as recorded, "
                f"{f.read} changed read ({f.new} new, {f.rewritten} rewritten, {f.restored} "
                f"restored), {f.moved + f.dup} under another chunk's name, {len(moved)} "
                f"quarantined, {f.gone} gone ({f.seconds:.2f} s)")
        if f.unchecked:
            line += (f"; {f.unchecked} changed file(s) NOT read (time bound reached): the "
                     "next launch reads them")
        return line


def check(loc: Location, window: CrashWindow, *, rate_mb_s: float | None = DEFAULT_RATE_MB_S,
          deadline_s: float | None = DEFAULT_SECONDS) -> CrashCheck:
    """Run the launch's check of the cache root: after an unclean stop (``window``), verify
    the chunk files of ``loc``'s namespace modified since ``window.since_ns`` with the
    deployment's key (aesgcm; sizes only with serde none) and quarantine those that fail;
    at every launch with the aesgcm serde, check the namespace's frame record
    (:mod:`kvpersist.l2.verify.frame_store`: a frame recorded under another chunk's name is
    quarantined, the rest learned) within the same time bound. Raises KvpError if the key or
    the cache root cannot be read, or the quarantine cannot be made safely."""

    res = CrashCheck(window.unclean, window.reason, window.since_ns, loc.serde)
    unclean = window.unclean and window.since_ns is not None
    if not os.path.isdir(loc.cache_root):
        if unclean:
            res.reason += " (no cache root yet)"
        return res
    if loc.serde != "aesgcm":
        res.frames = FrameSummary(applies=False, reason=SERDE_NONE)
        if not unclean:
            return res
    key = None
    if loc.serde == "aesgcm" and unclean:
        key = keys.read_key(loc.serde_key_file, service_uids(loc.service_user))
    elif unclean:
        res.warnings.append(SERDE_NONE_WARNING)
    with open_root(loc.cache_root, purpose="verify") as root:
        pins = read_pins(root)
        record = None
        if loc.serde == "aesgcm":
            record, refused = frame_store.load(root, loc.namespace)
            if refused:
                res.warnings.append(refused)
        # the warm set first: within the time bound, what every session needs is read first
        limit = loc.chunk_max_bytes  # a chunk-named file past it: a finding, never read
        v = verify_root(root, loc.namespace, serde=loc.serde, key=key, apply=True,
                        rate_mb_s=rate_mb_s or None,
                        since_ns=window.since_ns if unclean else EMPTY_WINDOW,
                        deadline_s=deadline_s, first=pins.names,
                        max_bytes_for=lambda p: limit if p == loc.namespace
                        else MAX_CHUNK_FILE_BYTES, record=record)
        res.skipped.extend(v.skipped)
        if key is not None:  # the padding of what was written since: zeros (cheap, measured)
            sc = scrub_root(root, loc.namespace, key, apply=True, since_ns=window.since_ns,
                            deadline_s=deadline_s, max_bytes=limit, record=record)
            res.scrubbed, res.scrub_seconds = sc.scrubbed, sc.seconds
            res.skipped.extend(sc.skipped)
        if record is not None and v.frames is not None:
            v.frames.record_bytes, unwritten = frame_store.save(root, record)
            if unwritten:
                v.frames.warnings.append(unwritten)
            res.warnings.extend(v.frames.warnings)
    if v.frames is not None:
        res.frames = v.frames
    res.quarantined, res.findings = v.quarantined, [asdict(f) for f in v.findings]
    if not unclean:
        return res
    res.ran = True
    res.warnings.extend(pins.problems)
    res.files, res.authenticated, res.bytes_read = v.files, v.authenticated, v.bytes_read
    res.reference_reads, res.unchecked = v.reference_reads, v.unchecked
    res.failed = len(v.findings)
    res.seconds = v.seconds
    return res


def log_check(loc: Location, res: CrashCheck, *, how: str) -> None:
    """Append the check as one JSON line to ``<log dir>/launch.log`` (best effort: a log that
    cannot be written never stops a launch)."""
    path = os.path.join(os.path.dirname(loc.server_log), LAUNCH_LOG)
    line = json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "config": loc.config, "namespace": loc.namespace, "launch": how,
                       "crash_window": res.to_dict()}, sort_keys=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass
