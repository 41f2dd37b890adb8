"""The launch sequence: plan → preflight → (the launch's own writes) → processes → warm-up.

Control flow: :func:`~kvpersist.stack.launch_plan.prepare_launch` (load, size once, render, plan) →
:func:`~kvpersist.stack.preflight.preflight` (gathers facts, judges them: every problem at
once; uses the sizing it is handed, never sizes again, never writes) → after a clean verdict,
the launch's first writes: the cache root when it is to be created (0700), the state
(:func:`prepare_state`) → the crash-window check (:mod:`kvpersist.stack.crash_window`: after
an unclean stop, verify and quarantine what was written since the last launch, before the
server starts) → :func:`~kvpersist.stack.processes.start_server` /
:func:`~kvpersist.stack.processes.start_vllm` (processes, pid files, waiting for health) →
the prime and the warm-up (:mod:`kvpersist.stack.warm.prime`, :mod:`kvpersist.stack.warm.readiness`:
after vLLM serves, before the launch reports ready; a failed one is a warning, never a failed
launch). Stopping and inspecting are in
:mod:`kvpersist.stack.processes`. The use cases in :mod:`kvpersist.actions.lifecycle` call
these; the click commands only parse and format.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from kvpersist.errors import CheckFailed, ConfigError, KvpError, Problem
from kvpersist.l2.fleet import host as fleet
from kvpersist.l2.fleet.host import RecordOutcome
from kvpersist.l2.inventory import Sizing
from kvpersist.l2.keys import store as keys
from kvpersist.stack import crash_window, vllm_args
from kvpersist.stack.canary.run import CanaryRun, recompute_reason, run_canary
from kvpersist.stack.canary.verdict import FAILED
from kvpersist.stack.crash_window import CrashCheck
from kvpersist.stack.launch_options import DEFAULTS, LaunchOptions
from kvpersist.stack.launch_plan import LaunchPlan, Prepared, recompute_plan
from kvpersist.stack.lmcache_exec import read_off_record
from kvpersist.stack.locate import Location
from kvpersist.stack.preflight import Preflight, preflight, root_creation_note
from kvpersist.stack.processes import (
    Progress,
    Spawned,
    Started,
    begin_preread,
    quiet,
    refuse_if_running,
    server_state,
    spawn_server,
    spawn_vllm,
    stop_vllm,
    vllm_state,
    wait_ready,
)
from kvpersist.stack.render import Rendered
from kvpersist.stack.warm.handoff import Handoff
from kvpersist.stack.warm.prime import PrimeRun, prime_vllm
from kvpersist.stack.warm.readiness import (
    NO_WARM_SET,
    StartedWarmup,
    WarmupRun,
    run_warmup,
    start_warmup,
)
from kvpersist.stack.weights import WeightsCheck, manifest_with_weights, save_digests
from kvpersist.system import procs
from kvpersist.system.files import atomic_write_json, make_dirs, service_uids

#: the crash-window check's bound while vLLM starts beside it: the server must be up before
#: vLLM registers its KV layout (what is left is checked at the next launch)
CRASH_SECONDS_BESIDE_VLLM = 15.0

# --------------------------------------------------------------------------- after the verdict


def proceed(pre: Preflight) -> list[str]:
    """The launch's first step after the preflight: raise ConfigError listing every problem
    (exit 2); else create the cache root when it is to be created (0700, its parent exists)
    and return the notes (the preflight's, then what was created). Raises ConfigError when
    the root cannot be created."""
    if pre.problems:
        raise ConfigError(list(pre.problems), "preflight")
    notes = list(pre.notes)
    if pre.create_root:
        notes.append(create_cache_root(pre.create_root))
    return notes


def create_cache_root(root: str) -> str:
    """Create the cache root ``root`` (mode 0700; its parent exists) and return the note
    saying so. Raises ConfigError when it cannot be created (as preflight would list it)."""
    try:
        os.mkdir(root, 0o700)
    except OSError as exc:
        raise ConfigError([Problem("KVP_CACHE_ROOT", f"cannot create {root}: {exc.strerror}",
                                   "create it as the cache owner")], "preflight") from exc
    return root_creation_note(root)


def prepare_state(plan: LaunchPlan, rendered: Rendered, sizing: Sizing, *,
                  progress: Progress = quiet, weights: WeightsCheck | None = None) -> list[str]:
    """Create state/log directories (0700); make the namespace's serde key ready (adopt
    the root key, or create one: :func:`~kvpersist.l2.keys.store.prepare_launch_key`); write the
    manifest (with the weights record: the first launch's, or ``weights``' at the first) and
    the budget record (what ``health`` reports without scanning). Returns notes (e.g. a new
    key, an adopted one, a changed key fingerprint, the weights' digest cache that could not
    be written). Raises KvpError if the state cannot be written."""
    notes: list[str] = []
    for d in (plan.state_dir, str(Path(plan.server_log).parent)):
        try:
            make_dirs(d)
        except OSError as exc:
            raise KvpError(f"cannot create {d}: {exc.strerror}; check KVP_STATE_DIR and "
                           "KVP_LOG_DIR and their owner") from exc
    if plan.serde == "aesgcm":
        # before the manifest is written: a manifest means "launched before" (keyplan)
        scan = sizing.measurement.scan if sizing.measurement else None
        key = keys.prepare_launch_key(
            plan.state_dir, plan.namespace, plan.serde_key_file,
            has_files=bool(scan and plan.namespace in scan.prefixes),
            manifest_file=plan.manifest_file, also=service_uids(plan.service_user))
        notes += key.notes
    notes += save_digests(weights)
    atomic_write_json(plan.manifest_file,
                      manifest_with_weights(rendered.manifest, plan.manifest_file, weights))
    atomic_write_json(plan.budget_record, {"schema": "kvpersist.budget-record/1",
                                           "recorded_at_ns": time.time_ns(),
                                           "plan": sizing.plan.to_dict()})
    progress(f"manifest {plan.manifest_file}")
    return notes


# --------------------------------------------------------------------------- the whole launch


@dataclass(frozen=True)
class LaunchResult:
    plan: LaunchPlan
    notes: tuple[str, ...]
    #: what this launch started (None: it ran already, or was not asked for)
    server: Started | None
    vllm: Started | None = None
    crash: CrashCheck | None = None
    #: the warm-up after vLLM (None: not run, --no-vllm or --no-warmup)
    warmup: WarmupRun | None = None
    #: this host's fleet record on the shared tier (None: no shared tier, or the server was
    #: already running)
    fleet_record: RecordOutcome | None = None
    #: the priming request to the vLLM this launch started (None: none started, or
    #: ``warmup`` False)
    prime: PrimeRun | None = None
    #: the cache server's pid: the one started, or the one that ran already
    server_pid: int | None = None
    #: the canary's run (None: not run: no vLLM started, ``--no-canary``, KVP_CANARY off)
    canary: CanaryRun | None = None
    #: why vLLM serves without the cache connector ('' : it has it); see docs/canary.md
    recompute: str = ""


@dataclass(frozen=True)
class Running:
    """What of the deployment runs before a launch (pid files checked, not trusted)."""

    server: procs.PidState
    vllm: procs.PidState | None

    def to_start(self, *, with_vllm: bool, vllm_mode: str) -> tuple[bool, bool]:
        """(start the server, start vLLM) for a launch that asks for vLLM or not (pure).
        Raises CheckFailed when nothing is left to start."""
        start_server = not self.server.running
        if vllm_mode == "process":
            start_vllm = with_vllm and not (self.vllm is not None and self.vllm.running)
        else:  # a container's state is not tracked here: it starts with the server or not
            start_vllm = with_vllm and start_server
        if not start_server and not start_vllm:
            what = [f"the cache server (pid {self.server.pid}, pid file "
                    f"{self.server.pid_file})"]
            if with_vllm and self.vllm is not None and self.vllm.running:
                what.append(f"vLLM (pid {self.vllm.pid})")
            raise CheckFailed(f"already running: {' and '.join(what)}; `kvp-admin status` "
                              "shows it, `kvp-admin restart` restarts it, `kvp-admin stop` "
                              "stops it")
        return start_server, start_vllm


def running(plan: LaunchPlan, *, with_vllm: bool) -> Running:
    """What of ``plan``'s deployment runs now."""
    return Running(server_state(plan),
                   vllm_state(plan) if with_vllm and plan.vllm_mode == "process" else None)


def check_crash_window(plan: Location, srv: procs.PidState, *, how: str,
                       rate_mb_s: float | None, deadline_s: float | None,
                       progress: Progress = quiet) -> CrashCheck:
    """Before the server starts: decide from ``srv`` (the pid file's state, read before a
    stale one is removed) and the stop records whether the last stop was unclean; if so,
    verify the files written since the last launch and quarantine those that fail; log the
    result; write this launch's record. Raises KvpError if the key, the root or the records
    cannot be read or written."""
    window = crash_window.window_of(plan, srv)
    res = crash_window.check(plan, window, rate_mb_s=rate_mb_s, deadline_s=deadline_s)
    progress(res.summary())
    if res.frames_line():
        progress(res.frames_line())
    for q in res.quarantined:
        progress(f"quarantined {q}")
    for w in res.warnings:
        progress(f"WARNING: {w}")
    crash_window.log_check(plan, res, how=how)
    crash_window.record_launch(plan, carry_since_ns=res.since_ns if res.unchecked else None)
    return res


def launch(prepared: Prepared, opts: LaunchOptions = DEFAULTS, *,
           progress: Progress = quiet) -> LaunchResult:
    """Start whatever of the deployment does not run yet (the cache server, and with
    ``opts.with_vllm`` vLLM; each is an independent process): preflight what will start,
    prepare state, check the crash window after an unclean stop (bounded by the options)
    before the server starts, start the cache server, write this host's fleet record on the
    shared tier (a failure is a warning note), then vLLM, then, with ``opts.warmup``, the
    priming request to the vLLM it started (:mod:`kvpersist.stack.warm.prime`; a failure is a
    warning) and the warm-up, bounded by ``opts.warmup_wait`` seconds (default
    KVP_WARMUP_WAIT): the launch returns, ready, after it. A vLLM that runs already
    reconnects to a server started here by itself (LMCache's connector re-registers its KV
    layout); a vLLM started beside a running server connects to it.

    With ``opts.foreground`` (systemd) the same sequence starts the cache server alone and
    execs it in this process, after writing the pid file with this pid: it does not return.

    Raises ConfigError listing every preflight problem (exit 2), CheckFailed if everything
    asked for runs already (exit 1), KvpError if a process fails to come up (after stopping
    it). If vLLM fails, the cache server is left running (it is healthy) and reported. A
    warm-up that fails or times out raises nothing: the result says so, vLLM serves cold.
    """
    rendered, plan, sizing = prepared.rendered, prepared.plan, prepared.sizing
    now = running(plan, with_vllm=opts.with_vllm and not opts.foreground)
    if opts.foreground:
        refuse_if_running(now.server, "the cache server", progress)
        with_server, start_vllm_too = True, False
    else:
        with_server, start_vllm_too = now.to_start(with_vllm=opts.with_vllm,
                                                   vllm_mode=plan.vllm_mode)
    pre = preflight(plan, sizing, with_vllm=start_vllm_too, with_server=with_server)
    notes = proceed(pre)
    if not with_server:
        notes.append(f"the cache server already runs (pid {now.server.pid}): starting vLLM "
                     "only")
    elif opts.with_vllm and not start_vllm_too and not opts.foreground:
        notes.append(f"vLLM already runs (pid {now.vllm.pid if now.vllm else '?'}): starting "
                     "the cache server only; vLLM reconnects to it by itself")
    for n in notes:
        progress(n)
    state_notes = prepare_state(plan, rendered, sizing, progress=progress,
                                weights=pre.weights)
    if pre.args_verdict is not None:
        state_notes += vllm_args.remember_verdict(plan.state_dir, *pre.args_verdict)
    for n in state_notes:
        progress(n)
    notes += state_notes
    if opts.foreground:
        _exec_server(prepared, now.server, opts, progress)
    # vLLM first: it loads its weights while the crash window is checked and the server
    # starts. It needs the server only when it registers its KV layout, at the end of its
    # start (LMCache's connector then waits up to lmcache.mp.mq_timeout for an answer).
    # An unbounded crash-window check (crash_seconds None) runs before vLLM starts instead.
    crash_seconds = opts.crash_seconds
    beside = start_vllm_too and crash_seconds is not None
    vsp = spawn_vllm(plan, progress=progress) if beside else None
    crash = server = record = None
    try:
        if with_server:
            if vsp is not None and crash_seconds is not None:
                crash_seconds = min(crash_seconds, CRASH_SECONDS_BESIDE_VLLM)
            crash = check_crash_window(plan, now.server, how="launch",
                                       rate_mb_s=opts.crash_rate_mb_s,
                                       deadline_s=crash_seconds, progress=progress)
            notes.append(begin_preread(plan, progress))
            ssp = spawn_server(plan, progress=progress)
            if start_vllm_too and vsp is None:
                vsp = spawn_vllm(plan, progress=progress)
            server = wait_ready(ssp, opts.server_timeout)
            progress(f"lmcache server healthy in {server.seconds:.1f} s (pid {server.pid})")
            off = read_off_record(plan.shared_off_file, server.pid)
            if off is not None:
                notes.append(f"WARNING: {off.message()}")
                progress(notes[-1])
        elif start_vllm_too and vsp is None:
            vsp = spawn_vllm(plan, progress=progress)
    except BaseException:
        if vsp is not None:  # vLLM would wait for a server that is not coming
            progress(f"stopping vLLM (pid {vsp.pid}): the cache server did not start")
            vsp.abandon()
        raise
    if with_server:
        record = fleet_record(prepared)
        if record is not None:
            progress(record.note())
            notes.append(record.note())
    # the warm-up child starts now, while vLLM loads: its start, imports and plan are done
    # when vLLM serves; it prefetches beside the prime and the canary and waits at its gate
    # before it sends anything to vLLM (stack/warm/gate.py)
    early: StartedWarmup | WarmupRun | None = None
    handoff = Handoff.of(rendered.vllm_argv, rendered.lmcache_server_argv)
    if (vsp is not None and opts.with_vllm and opts.warmup and plan.checks.warmup_file
            and not rendered.recompute):
        early = start_warmup(plan, prepared.config or plan.config, handoff,
                             env=prepared.environ or os.environ, wait_s=opts.warmup_wait,
                             early=True, progress=progress)
    try:
        prepared, vllm, primed, canary, recompute = _serve(prepared, opts, vsp, server, now,
                                                           progress)
    except BaseException:
        if isinstance(early, StartedWarmup):
            early.cancel("the launch failed before vLLM was ready")
        raise
    plan = prepared.plan
    warm: WarmupRun | None = None
    if recompute and opts.with_vllm:
        if isinstance(early, StartedWarmup):
            early.cancel("the canary failed: vLLM serves without the cache")
        warm = WarmupRun("skipped", "vLLM serves without the cache (the canary failed)")
    elif opts.with_vllm and (vllm is not None or plan.vllm_mode == "process"):
        if opts.warmup and not plan.checks.warmup_file:
            warm = NO_WARM_SET
        elif opts.warmup:
            if isinstance(early, StartedWarmup):
                early.release()
                warm = early.finish()
            else:
                warm = early or run_warmup(plan, prepared.config or plan.config, handoff,
                                           env=prepared.environ or os.environ,
                                           wait_s=opts.warmup_wait, progress=progress)
            progress(warmup_summary(warm))
    server_pid = server.pid if server is not None else now.server.pid
    return LaunchResult(plan, tuple(notes), server, vllm, crash, warm, record, primed,
                        server_pid, canary, recompute)


def _serve(prepared: Prepared, opts: LaunchOptions, vsp: Spawned | None,
           server: Started | None, now: Running, progress: Progress
           ) -> tuple[Prepared, Started | None, PrimeRun | None, CanaryRun | None, str]:
    """After the processes are spawned: wait for vLLM, prime it, run the canary (a failed
    one: vLLM again, recomputing). Returns the plan vLLM runs under, its start, the prime,
    the canary and why vLLM serves without the cache ('' : it has it)."""
    plan, rendered = prepared.plan, prepared.rendered
    vllm: Started | None = None
    if vsp is not None:
        vllm = wait_ready(vsp, opts.vllm_timeout)
        progress(f"vLLM serves in {vllm.seconds:.1f} s (pid {vllm.pid})")
    primed: PrimeRun | None = None
    if vllm is not None and opts.warmup:
        primed = prime_vllm(plan)
        progress(primed.summary())
    canary: CanaryRun | None = None
    recompute = rendered.recompute
    if recompute and vllm is not None:
        progress(f"WARNING: vLLM serves WITHOUT the cache (recompute): {recompute}")
    elif opts.canary and plan.canary_enabled and (vllm is not None or (
            server is not None and now.vllm is not None and now.vllm.running)):
        # a vLLM started here, or one that runs on beside the cache server started here
        canary = run_canary(plan, when="launch", tier="l2" if server is not None else "l1")
        progress(canary.summary())
        if canary.state == FAILED:
            prepared, vllm = _serve_recomputed(prepared, opts, progress)
            recompute = prepared.rendered.recompute
    return prepared, vllm, primed, canary, recompute


def fleet_record(prepared: Prepared) -> RecordOutcome | None:
    """Write this host's record on the shared tier for the cache server this launch starts,
    with the launch's measurement of the namespace's files (None: no shared tier). Never
    fails the launch: a store that does not answer is a warning (the outcome's note)."""
    host = prepared.plan.fleet
    if host is None or host.tier is None:
        return None
    return fleet.write(host, launched=True, nvme=fleet.nvme_use(prepared.sizing, host.namespace))


def _serve_recomputed(prepared: Prepared, opts: LaunchOptions,
                      progress: Progress) -> tuple[Prepared, Started]:
    """The canary failed: stop the vLLM this launch started (it must not serve from a cache
    path that failed) and start it again without the cache connector. Returns the plan it
    runs under and its start."""
    plan = prepared.plan
    progress("stopping vLLM: it must not serve from a cache path that failed; starting it "
             "again WITHOUT the cache connector (recompute; the namespace's files are kept)")
    stop_vllm(plan, timeout=max(opts.server_timeout, 60.0))
    again = recompute_plan(prepared, recompute_reason(plan))
    vllm = wait_ready(spawn_vllm(again.plan, progress=progress), opts.vllm_timeout)
    progress(f"vLLM serves, recomputing, in {vllm.seconds:.1f} s (pid {vllm.pid})")
    return again, vllm


def _exec_server(prepared: Prepared, srv: procs.PidState, opts: LaunchOptions,
                 progress: Progress) -> NoReturn:
    """The foreground launch's last steps: the crash window, this host's fleet record (a
    failure is a warning), the hot-files pre-read, the pid file with this pid, and the exec
    of the cache server in this process."""
    plan = prepared.plan
    check_crash_window(plan, srv, how="foreground", rate_mb_s=opts.crash_rate_mb_s,
                       deadline_s=opts.crash_seconds, progress=progress)
    record = fleet_record(prepared)
    if record is not None:
        progress(record.note())
    begin_preread(plan, progress)
    progress(f"exec lmcache server for {plan.namespace} (pid file {plan.server_pid_file})")
    procs.write_pid_file(plan.server_pid_file, os.getpid())
    procs.exec_foreground(plan.server_argv, env=plan.server_env, cwd=plan.state_dir)


def warmup_summary(warm: WarmupRun) -> str:
    """One line on the warm-up for the launch's progress output (pure)."""
    if warm.state == "failed":
        return (f"WARNING: warm-up failed after {warm.seconds:.1f} s ({warm.detail}); vLLM "
                "serves, cold; health says degraded until a warm-up succeeds")
    if warm.state == "skipped":
        return f"warm-up skipped: {warm.detail}"
    return f"{warm.detail} ({warm.seconds:.1f} s); ready"
