"""Use cases: launch (and its preflight-only and foreground forms), stop, status.

``stop`` and ``status`` load the deployment and :func:`~kvpersist.stack.locate.locate` it;
they never scan the cache root or plan a budget, so they work when the budget is invalid.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from kvpersist.config.deployment import Deployment
from kvpersist.config.loader import load_deployment
from kvpersist.errors import Problem, UsageError
from kvpersist.l2.fleet import host as fleet
from kvpersist.l2.fleet.host import RecordOutcome
from kvpersist.stack import crash_window
from kvpersist.stack import launch as lc
from kvpersist.stack import processes as proc
from kvpersist.stack.canary.run import CanaryRun
from kvpersist.stack.health import health_report
from kvpersist.stack.launch_options import DEFAULTS, STOP_TIMEOUT, LaunchOptions
from kvpersist.stack.launch_plan import LaunchPlan, prepare_launch
from kvpersist.stack.locate import Location, locate
from kvpersist.stack.preflight import preflight
from kvpersist.stack.processes import Progress, Stopped, quiet
from kvpersist.stack.stops import systemd_stop_was_clean, systemd_stop_was_deliberate
from kvpersist.stack.warm.handoff import Handoff
from kvpersist.stack.warm.prime import PrimeRun
from kvpersist.stack.warm.readiness import WarmupRun, log_to, warmup_after_vllm
from kvpersist.stack.warm.run import render_handoff
from kvpersist.system.procs import PidState

if TYPE_CHECKING:
    from kvpersist.stack.health import HealthReport



def load_located(config: str) -> tuple[Deployment, Location]:
    """Load ``config`` (an incomplete identity is accepted: stop/status/health must reach
    whatever runs) and locate it. Raises ConfigError for a config that does not load."""

    dep = load_deployment(config, allow_unpinned=True)
    return dep, locate(dep)


@dataclass(frozen=True)
class CheckResult:
    """``launch --check``: would a launch proceed?"""

    config: str
    namespace: str
    problems: tuple[Problem, ...]
    notes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "namespace": self.namespace, "ok": self.ok,
                "problems": [str(p) for p in self.problems], "notes": list(self.notes)}


def check_launch(config: str, opts: LaunchOptions = DEFAULTS) -> CheckResult:
    """Preflight only: size once, render, check; start nothing, write nothing (a cache root
    to be created is a note). Configuration problems (including the budget's) raise
    ConfigError; preflight problems are in the result. vLLM is checked unless
    ``opts.with_vllm`` is False or ``opts.foreground`` (the cache server alone)."""
    p = prepare_launch(config, opts)
    pre = preflight(p.plan, p.sizing, with_vllm=opts.with_vllm and not opts.foreground)
    return CheckResult(p.dep.name, p.dep.namespace, pre.problems, pre.notes)


@dataclass(frozen=True)
class LaunchOutcome:
    """What ``kvp-admin launch`` started."""

    config: str
    namespace: str
    plan: LaunchPlan
    result: lc.LaunchResult

    def to_dict(self) -> dict[str, Any]:
        plan, res = self.plan, self.result
        srv, v = res.server, res.vllm
        out: dict[str, Any] = {
            "config": self.config,
            "namespace": self.namespace,
            "cache_root": plan.cache_root,
            "manifest": plan.manifest_file,
            "notes": list(res.notes),
            "started": [n for n, p in (("server", srv), ("vllm", v)) if p is not None],
            "lmcache": {"pid": res.server_pid,
                        "started": srv is not None, "pid_file": plan.server_pid_file,
                        "log": plan.server_log, "http": plan.server_http_url,
                        "seconds_to_healthy": round(srv.seconds, 2) if srv else None},
            "vllm": None,
            "crash_window": res.crash.to_dict() if res.crash is not None else None,
            "prime": res.prime.to_dict() if res.prime is not None else None,
            "warmup": res.warmup.to_dict() if res.warmup is not None else None,
            "canary": res.canary.to_dict() if res.canary is not None else None,
            "recompute": res.recompute or None,
            "fleet_record": (res.fleet_record.to_dict() if res.fleet_record is not None
                             else None),
        }
        if v is not None:
            out["vllm"] = {"pid": v.pid, "mode": plan.vllm_mode, "url": plan.vllm_url,
                           "log": plan.vllm_log, "pid_file": plan.vllm_pid_file,
                           "served_model_name": plan.served_model_name,
                           "seconds_to_ready": round(v.seconds, 2)}
        return out


def launch(config: str, opts: LaunchOptions = DEFAULTS, *,
           progress: Progress = quiet) -> LaunchOutcome:
    """Size, render, preflight, check the crash window after an unclean stop, start the
    deployment and warm it up (see :func:`lc.launch`); with ``opts.foreground`` exec the
    cache server in this process (systemd): it returns only by raising."""
    p = prepare_launch(config, opts)
    progress(f"launching {p.dep.name} (namespace {p.dep.namespace})")
    return LaunchOutcome(p.dep.name, p.dep.namespace, p.plan, lc.launch(p, opts,
                                                                         progress=progress))


@dataclass(frozen=True)
class WarmupOnlyOutcome:
    """``launch --warmup-only``: the readiness step of a vLLM started by someone else."""

    config: str
    namespace: str
    warmup: WarmupRun
    #: the priming request (None: vLLM did not serve in time)
    prime: PrimeRun | None = None
    #: the canary's run (None: not run)
    canary: CanaryRun | None = None

    @property
    def canary_failed(self) -> bool:
        """This step's canary failed: exit 3, so that the vLLM unit fails (and its restart
        starts vLLM without the cache) and run-vllm-with-persist.sh stops vLLM
        (docs/canary.md)."""
        return self.canary is not None and self.canary.state == "failed"

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "namespace": self.namespace,
                "prime": self.prime.to_dict() if self.prime is not None else None,
                "canary": self.canary.to_dict() if self.canary is not None else None,
                "warmup": self.warmup.to_dict()}


def warmup_only(config: str, *, deadline_s: float = 1800.0, vllm_pid: int | None = None,
                environ: dict[str, str] | None = None,
                progress: Progress = quiet) -> WarmupOnlyOutcome:
    """For the vLLM unit's ``ExecStartPost`` and the ``KV_PERSIST=1`` hook: wait until the
    deployment's vLLM serves its namespace, then run the warm-up, within ``deadline_s`` (see
    :func:`kvpersist.stack.warm.readiness.warmup_after_vllm`; ``vllm_pid``: stop waiting
    when that process exits). Never scans or sizes; raises only ConfigError for a config
    that does not load. The warm-up child is handed this deployment's rendered arguments
    (rendered once, here)."""
    import os

    dep, loc = load_located(config)
    logged = log_to(loc.warmup_log, progress)
    handoff = render_handoff(dep) if dep.settings.warmup_file else Handoff((), ())
    step = warmup_after_vllm(loc, config, handoff, warm_file=dep.settings.warmup_file,
                             env=dict(os.environ if environ is None else environ),
                             deadline_s=deadline_s, vllm_pid=vllm_pid, progress=logged)
    logged(lc.warmup_summary(step.warmup))
    return WarmupOnlyOutcome(dep.name, dep.namespace, step.warmup, step.prime, step.canary)


@dataclass(frozen=True)
class StopOutcome:
    config: str
    namespace: str
    stopped: tuple[Stopped, ...]
    #: this host's fleet record (None: no shared tier)
    fleet_record: RecordOutcome | None = None

    @property
    def ok(self) -> bool:
        """No stale pid file was left that could not be removed (else exit 1)."""
        return not any(s.error for s in self.stopped)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "namespace": self.namespace,
                "stopped": [asdict(s) for s in self.stopped],
                "fleet_record": (self.fleet_record.to_dict() if self.fleet_record is not None
                                 else None)}


def stop(config: str, *, timeout: float = STOP_TIMEOUT, vllm: bool = True,
         server: bool = True) -> StopOutcome:
    """Stop vLLM (unless ``vllm`` is False), then the cache server (unless ``server`` is
    False); when the server stopped, delete this host's fleet record on the shared tier (the
    host no longer serves the namespace; a record that cannot be deleted lapses after its
    TTL). Never scans or sizes."""
    dep, loc = load_located(config)
    stopped = tuple(proc.stop_deployment(loc, timeout=timeout, vllm=vllm, server=server))
    record = fleet.delete(dep) if dep.settings.shared_tier and server else None
    return StopOutcome(dep.name, dep.namespace, stopped, record)


@dataclass(frozen=True)
class RestartOutcome:
    """``kvp-admin restart``: what was stopped, then what the launch started."""

    config: str
    restarted: tuple[str, ...]
    stop: StopOutcome
    launch: LaunchOutcome

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "restarted": list(self.restarted),
                "stopped": self.stop.to_dict()["stopped"], "launch": self.launch.to_dict()}


def restart(config: str, opts: LaunchOptions = DEFAULTS, *, only: str | None = None,
            timeout: float = STOP_TIMEOUT, progress: Progress = quiet) -> RestartOutcome:
    """Stop the deployment (or ``only`` one of its processes: ``vllm`` or ``server``), then
    start what is not running (:func:`launch` with ``opts``, vLLM included): the persisted
    KV stays on disk either way. ``timeout``: seconds from SIGTERM to SIGKILL.
    The launch's preflight runs after the stop (the ports must be free); a preflight that
    refuses leaves the stopped part stopped and raises ConfigError (exit 2). Raises
    UsageError for another ``only``."""
    if only is not None and only not in proc.COMPONENTS:
        raise UsageError(f"--only must be one of {', '.join(proc.COMPONENTS)}, not {only!r}")
    if only is not None and load_located(config)[1].vllm_mode != "process":
        raise UsageError("--only needs vLLM as a process of kvp-admin's (KVP_IMAGE unset); a "
                         "container is restarted with `kvp-admin restart CONFIG` or by its "
                         "own runtime")
    vllm, server = only in (None, "vllm"), only in (None, "server")
    stopped = stop(config, timeout=timeout, vllm=vllm, server=server)
    for s in stopped.stopped:
        progress(f"stopped {s.what}: {s.how}" + (f" (pid {s.pid})" if s.pid else ""))
    out = launch(config, replace(opts, with_vllm=True, foreground=False), progress=progress)
    started = tuple(n for n, p in (("vllm", out.result.vllm), ("server", out.result.server))
                    if p is not None)
    return RestartOutcome(stopped.config, started, stopped, out)


@dataclass(frozen=True)
class StopPostOutcome:
    """``stop --systemd-stop-post``: what systemd reported and whether a clean stop was
    recorded."""

    config: str
    clean: bool
    service_result: str
    exit_code: str
    exit_status: str
    record: str
    #: what became of this host's fleet record ('' : untouched)
    fleet_record: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def systemd_stop_post(config: str, environ: dict[str, str]) -> StopPostOutcome:
    """For the unit's ``ExecStopPost``: stop nothing; record a clean stop when systemd's
    environment says the server exited by itself with success (see
    :func:`kvpersist.stack.stops.systemd_stop_was_clean`); delete this host's fleet record
    when the unit ended without a failure (a ``systemctl stop``, see
    :func:`kvpersist.stack.stops.systemd_stop_was_deliberate`). Raises KvpError if the record
    cannot be written."""

    dep, loc = load_located(config)
    clean = systemd_stop_was_clean(environ)
    if clean:
        crash_window.record_clean_stop(loc, None, "systemd")
    record = ""
    if dep.settings.shared_tier and systemd_stop_was_deliberate(environ):
        record = fleet.delete(dep).note()
    return StopPostOutcome(dep.name, clean, environ.get("SERVICE_RESULT", ""),
                           environ.get("EXIT_CODE", ""), environ.get("EXIT_STATUS", ""),
                           crash_window.clean_stop_record(loc), record)


@dataclass(frozen=True)
class StatusOutcome:
    config: str
    namespace: str
    loc: Location
    server: PidState
    server_healthy: bool
    vllm: PidState | None
    vllm_ready: bool

    @property
    def running(self) -> bool:
        return self.server.running and self.server_healthy

    def to_dict(self) -> dict[str, Any]:
        loc, srv, vst = self.loc, self.server, self.vllm
        return {
            "config": self.config,
            "namespace": self.namespace,
            "cache_root": loc.cache_root,
            "lmcache": {"state": srv.state, "pid": srv.pid, "reason": srv.reason,
                        "pid_file": loc.server_pid_file, "healthy": self.server_healthy,
                        "http": loc.server_http_url},
            "vllm": {"mode": loc.vllm_mode, "state": vst.state if vst else "unknown",
                     "pid": vst.pid if vst else None, "reason": vst.reason if vst else "",
                     "ready": self.vllm_ready, "url": loc.vllm_url},
        }


def status(config: str) -> StatusOutcome:
    """Whether the deployment's cache server and vLLM run (pid files checked, not trusted)."""
    dep, loc = load_located(config)
    srv = proc.server_state(loc)
    srv_ok = loc.lmcache(2.0).healthy() if srv.running else False
    vst = proc.vllm_state(loc) if loc.vllm_mode == "process" else None
    return StatusOutcome(dep.name, dep.namespace, loc, srv, srv_ok, vst,
                         proc.vllm_ready(loc, 2.0))


def health(config: str, *, timeout: float = 3.0, expect_vllm: bool = True,
           wait: float = 0.0, refresh_record: bool = False,
           with_canary: bool = False) -> HealthReport:
    """Probe the deployment (see :mod:`kvpersist.stack.health`); never scans the root.
    ``refresh_record``: refresh this host's fleet record while the cache server answers;
    ``with_canary``: run the known-answer canary first."""

    dep, loc = load_located(config)
    return health_report(dep, loc, timeout=timeout, expect_vllm=expect_vllm, wait=wait,
                         refresh_record=refresh_record, with_canary=with_canary)
