"""Start, stop and inspect a deployment's processes (the lifecycle engine).

Control flow: :func:`prepare_launch` (load, size once, render, plan) → :func:`preflight`
(reads the filesystem and ports, returns every problem at once; uses the sizing it is handed,
never sizes again) → the crash-window check (:mod:`kvpersist.stack.crash_window`: after an
unclean stop, verify and quarantine what was written since the last launch, before the server
starts) → :func:`start_server` / :func:`start_vllm` (processes, pid files, waiting
for health) → the warm-up (:mod:`kvpersist.stack.readiness`: after vLLM serves, before the
launch reports ready; a failed one is a warning, never a failed launch) →
:func:`stop_deployment` (a stop after which the server exited on SIGTERM is
recorded as clean). Stopping and inspecting need only a
:class:`~kvpersist.stack.locate.Location` (pure, no scan): they work whatever the budget says.
The use cases in :mod:`kvpersist.actions.lifecycle` call these; the click commands only parse
and format.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvpersist.config.deployment import Deployment, listeners
from kvpersist.errors import CheckFailed, ConfigError, KvpError, Problem
from kvpersist.l2.inventory import Sizing
from kvpersist.l2.preread import off_reason
from kvpersist.stack import crash_window
from kvpersist.stack.crash_window import CrashCheck
from kvpersist.stack.fleet import RecordOutcome
from kvpersist.stack.locate import Location, locate, vllm_mode
from kvpersist.stack.preread import preread_argv, start_preread
from kvpersist.stack.readiness import NO_WARM_SET, WarmupRun, run_warmup
from kvpersist.stack.render import Rendered, serde_warnings
from kvpersist.stack.weights import WeightsCheck, check_weights, manifest_with_weights
from kvpersist.system import procs
from kvpersist.system.files import (
    atomic_write_json,
    direct_io_problem,
    fs_info,
    service_uids,
    trust_problems,
)

VLLM_MODULE = "vllm.entrypoints.openai.api_server"

Progress = Callable[[str], None]


def quiet(_: str) -> None:
    pass


# --------------------------------------------------------------------------- the plan (pure)


@dataclass(frozen=True)
class LaunchPlan(Location):
    """A :class:`Location` plus the argv and environments to start the processes with."""

    server_argv: list[str] = field(default_factory=list)
    server_env: dict[str, str] = field(default_factory=dict)
    vllm_argv: list[str] = field(default_factory=list)
    vllm_env: dict[str, str] = field(default_factory=dict)
    #: the hot-files pre-read child (kvpersist/stack/preread.py); empty when it is off
    preread_argv: list[str] = field(default_factory=list)
    #: why there is no pre-read ('' when there is one)
    preread_skip: str = ""
    preread_log: str = ""


def lmcache_bin() -> str:
    """The ``lmcache`` executable: next to this Python (a venv), else on PATH."""
    sibling = Path(sys.executable).parent / "lmcache"
    if sibling.exists():
        return str(sibling)
    return shutil.which("lmcache") or "lmcache"


def plan_launch(dep: Deployment, rendered: Rendered, environ: Mapping[str, str],
                *, python: str | None = None, server_bin: str | None = None) -> LaunchPlan:
    """Build the launch plan of ``dep`` from its rendering (pure apart from the values
    passed in: ``environ`` is the environment to start children with)."""
    s = dep.settings
    server_argv = list(rendered.lmcache_server_argv)
    server_argv[0] = server_bin or server_argv[0]
    server_env = dict(environ)
    server_env.setdefault("LMCACHE_DISABLE_BANNER", "1")
    vllm_env = dict(environ)
    container = vllm_mode(dep) == "container" and bool(rendered.container_argv)
    if s.device == "cpu":
        vllm_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        vllm_env.setdefault("HF_HUB_OFFLINE", "1")
        vllm_env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if container:
        vllm_argv = list(rendered.container_argv)
    else:
        vllm_argv = [python or sys.executable, "-m", VLLM_MODULE, *rendered.vllm_argv]
    if s.shared_tier:
        # the shared tier's credentials enter in the server's own process (lmcache_exec)
        from kvpersist.config.deployment import shared_tier_of
        from kvpersist.stack.lmcache_exec import exec_argv

        tier = shared_tier_of(s)
        server_argv = exec_argv(python or sys.executable, s.shared_tier_secret_file,
                                server_argv, tls_ca=tier.tls_ca if tier else "")
        # the launcher must be this very kvpersist (the server's cwd is the state dir)
        here = str(Path(__file__).resolve().parents[2])
        server_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (here, server_env.get("PYTHONPATH", "")) if p)
    loc = locate(dep)
    skip = off_reason(s.preread_ram_share, dep.generic.l2_use_direct_io)
    pre_argv = [] if skip else preread_argv(python or sys.executable, loc.cache_root,
                                            loc.namespace, s.preread_ram_share)
    return LaunchPlan(**{f.name: getattr(loc, f.name) for f in fields(Location)},
                      server_argv=server_argv, server_env=server_env,
                      vllm_argv=vllm_argv, vllm_env=vllm_env, preread_argv=pre_argv,
                      preread_skip=skip,
                      preread_log=os.path.join(os.path.dirname(loc.server_log), "preread.log"))


# --------------------------------------------------------------------------- preflight (I/O)


@dataclass(frozen=True)
class Preflight:
    """Result of the checks before a launch: problems block it, notes are informational."""

    problems: tuple[Problem, ...]
    notes: tuple[str, ...]
    #: the weights fingerprint check (what prepare_state records in the manifest)
    weights: WeightsCheck | None = None


def preflight(dep: Deployment, plan: LaunchPlan, sizing: Sizing, *, with_vllm: bool,
              min_free_bytes: int = 256 << 20) -> Preflight:
    """Check what a launch needs; create the cache root (0700) if its parent exists.

    Checks: identity pinned (or explicitly unpinned), cache root a writable directory that
    others cannot read, free space, the ports free, the lmcache executable, the model
    weights (with vLLM), the identity against the weights and the installed software
    (:mod:`kvpersist.stack.identity_check`: a mismatch is a problem), the weights'
    fingerprint against the namespace's record (:func:`~kvpersist.stack.weights.check_weights`)
    and, once all of that passed, the extra and engine arguments as vLLM's own parser reads
    them (:mod:`kvpersist.stack.vllm_args`). ``sizing`` is the launch's one budget plan (shown
    as notes, never computed again here). Returns all problems at once; never raises for them.
    """
    problems: list[Problem] = []
    notes: list[str] = []
    root = Path(plan.cache_root)
    if not dep.pinned:
        notes.append(f"identity unpinned: one-off namespace {dep.namespace}, "
                     "nothing will be reused after a restart")
    notes += dep.notes
    notes += [f"WARNING: {w}" for w in serde_warnings(plan.serde)]
    notes += foreign_notes(sizing)
    notes += listener_notes(dep, with_vllm=with_vllm)
    if not root.exists():
        if root.parent.is_dir():
            try:
                root.mkdir(mode=0o700)
                notes.append(f"created cache root {root} (mode 0700)")
            except OSError as exc:
                problems.append(Problem("KVP_CACHE_ROOT", f"cannot create {root}: "
                                        f"{exc.strerror}", "create it as the cache owner"))
        else:
            problems.append(Problem("KVP_CACHE_ROOT", f"{root} does not exist",
                                    "create it on the NVMe filesystem (mode 0700)"))
    if root.is_dir():
        st = root.stat()
        if stat.S_IMODE(st.st_mode) & 0o007:
            problems.append(Problem("KVP_CACHE_ROOT",
                                    f"{root} is accessible to others (mode "
                                    f"{stat.S_IMODE(st.st_mode):04o}); KV data reveals prompts",
                                    f"chmod o-rwx {root}"))
        if not os.access(root, os.W_OK | os.X_OK):
            problems.append(Problem("KVP_CACHE_ROOT", f"{root} is not writable by this user",
                                    "run as the cache owner or fix ownership"))
        else:
            free = fs_info(root).avail_bytes
            if free < min_free_bytes:
                problems.append(Problem("KVP_CACHE_ROOT",
                                        f"only {free >> 20} MiB free on {root}",
                                        "free space or prune stale namespaces"))
    elif root.exists():
        problems.append(Problem("KVP_CACHE_ROOT", f"{root} is not a directory"))
    if root.is_dir():
        notes += budget_notes(sizing)
        why = direct_io_problem(root) if dep.generic.l2_use_direct_io else ""
        if why:
            problems.append(Problem(
                "l2.use_direct_io", f"{why}: every L2 read and write would fail",
                f"put KVP_CACHE_ROOT on the NVMe filesystem (ext4, xfs), or set "
                f"l2.use_direct_io: false in configs/{dep.settings.generic_config}/lmcache.yaml"))
    also: tuple[int, ...] = ()
    try:
        also = service_uids(dep.settings.service_user)
    except KvpError as exc:
        problems.append(Problem("KVP_SERVICE_USER", str(exc)))
    seen: set[str] = set()
    for key, path in (("KVP_CACHE_ROOT", plan.cache_root), ("KVP_STATE_DIR", plan.state_dir),
                      ("KVP_LOG_DIR", os.path.dirname(plan.server_log)),
                      ("KVP_SERDE_KEY_FILE", plan.serde_key_file)):
        if key == "KVP_SERDE_KEY_FILE" and plan.serde != "aesgcm":
            continue
        for why in trust_problems(path, also=also):
            if why in seen:
                continue
            seen.add(why)
            problems.append(Problem(key, why, "the service user must own its cache, state and "
                                    "key, and no other user may be able to replace them"))
    problems += shared_secret_problems(dep, also)
    ports = [("KVP_LMCACHE_PORT", *plan.listen["lmcache"]),
             ("KVP_LMCACHE_HTTP_PORT", *plan.listen["lmcache_http"])]
    if with_vllm:
        ports.append(("KVP_VLLM_PORT", *plan.listen["vllm"]))
    for key, host, port in ports:
        if not procs.port_bindable(host, port):
            problems.append(Problem(key, f"{host}:{port} is already in use",
                                    "stop what listens there or choose another port"))
    exe = plan.server_argv[0]
    if not (Path(exe).exists() or shutil.which(exe)):
        problems.append(Problem("lmcache", f"executable {exe!r} not found",
                                "pip install 'kvpersist[cache]' (lmcache==0.5.6 nixl)"))
    if with_vllm and plan.vllm_mode == "process" and not Path(plan.model_target).exists():
        problems.append(Problem("KVP_MODEL_PATH", f"{plan.model_target} does not exist",
                                "point it at the model weights directory"))
    if with_vllm and plan.vllm_mode == "container" and not shutil.which("docker"):
        problems.append(Problem("KVP_IMAGE", "docker is not installed",
                                "install Docker or set KVP_DEVICE=cpu for a direct process"))
    from kvpersist.stack import identity_check

    identity = identity_check.check_deployment(dep, vllm_launched=with_vllm)
    problems += identity.launch_problems()
    notes += identity.launch_notes()
    weights = check_weights(plan, pinned=dep.pinned, with_vllm=with_vllm)
    problems += weights.problems
    notes += weights.notes
    if with_vllm and not problems:  # costs a vLLM import: last, when all else passed
        from kvpersist.stack.vllm_args import check_deployment

        args = check_deployment(dep, plan.vllm_mode, plan.vllm_argv, plan.vllm_env)
        problems += args.problems
        notes += args.notes
    return Preflight(tuple(problems), tuple(notes), weights)


def shared_secret_problems(dep: Deployment, also: tuple[int, ...]) -> list[Problem]:
    """The shared tier's secret file must exist, belong to the service user, be readable by
    nobody else, and hold a password (its content is never shown); its CA file (``tls_ca=``)
    must be one that only root or the service user can change."""
    s = dep.settings
    if not s.shared_tier:
        return []
    key, path = "KVP_SHARED_TIER_SECRET_FILE", s.shared_tier_secret_file
    fix = (f"write username=... and password=... lines into {path} as the service user, "
           f"mode 0600 (the Ansible role does it from the vault)")
    out = [Problem(key, why, fix) for why in trust_problems(path, also=also)]
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        return [*out, Problem(key, f"{path}: {exc.strerror}", fix)]
    if stat.S_IMODE(st.st_mode) & 0o077:
        out.append(Problem(key, f"{path} is accessible to others (mode "
                           f"{stat.S_IMODE(st.st_mode):04o})", f"chmod 600 {path}"))
    from kvpersist.config.deployment import shared_tier_of
    from kvpersist.stack.lmcache_exec import check_ca_file

    tier = shared_tier_of(s)
    if tier is not None and tier.tls_ca:
        try:
            check_ca_file(tier.tls_ca, also=also)
        except KvpError as exc:
            out.append(Problem("KVP_SHARED_TIER", str(exc),
                               "point tls_ca= at the PEM file of the CA that signed the "
                               "store's certificate, owned by root or the service user, "
                               "mode 0644 or stricter"))
    if not out and os.access(path, os.R_OK):
        from kvpersist.stack.lmcache_exec import read_secret_file

        try:
            secret = read_secret_file(path, also=also)
        except KvpError as exc:
            return [*out, Problem(key, str(exc), fix)]
        out += shared_store_problems(dep, secret)
    return out


def shared_store_problems(dep: Deployment, secret: Any) -> list[Problem]:
    """Refuse a store that would answer writes with errors instead of evicting (noeviction,
    volatile-*), or whose TLS certificate the configured CA does not vouch for. An
    unreachable store is no reason to refuse: the deployment starts degraded and uses the
    shared tier once it answers."""
    from kvpersist.config.deployment import shared_tier_of
    from kvpersist.l2.shared_store import TLS_UNTRUSTED, probe

    tier = shared_tier_of(dep.settings)
    if tier is None:
        return []
    found = probe(tier, secret)
    if found.error.startswith(TLS_UNTRUSTED):
        # LMCache 0.5.6's valkey adapter connects while the server starts (it probes glide's
        # buffer GET in its constructor): with a certificate it cannot verify the server
        # exits ("invalid peer certificate: UnknownIssuer"), so say why before that
        return [Problem("KVP_SHARED_TIER", f"the store at {tier.endpoint}: {found.error}",
                        "set tls_ca= to the PEM file of the CA that signed the store's "
                        "certificate (docs/fleet.md, Configuration)")]
    if found.budget is None:
        return []
    return [Problem("KVP_SHARED_TIER", f"the store at {tier.endpoint}: {p}",
                    "CONFIG SET maxmemory-policy allkeys-lru (and in the store's config "
                    "file); see docs/fleet.md, Sizing") for p in found.budget.problems]


def listener_notes(dep: Deployment, *, with_vllm: bool) -> list[str]:
    """A note for every port that binds a non-loopback address (each opted in by its
    ``KVP_ALLOW_REMOTE_*`` key; a bind without one never gets this far)."""
    return [f"network: {lst.describe()}" for lst in listeners(dep.settings)
            if lst.remote and (with_vllm or lst.component != "vllm")]


def foreign_notes(sizing: Sizing) -> list[str]:
    """What launch should say about files under the cache root that are not LMCache's: they
    are never touched by kvpersist, but LMCache deletes every file whose name contains
    ``.tmp.`` under its root when it stops cleanly."""
    scan = sizing.measurement.scan if sizing.measurement else None
    if scan is None:
        return []
    out = []
    if scan.foreign.files or scan.foreign_dirs:
        out.append(f"{scan.foreign.files} foreign file(s) and {scan.foreign_dirs} foreign "
                   f"dir(s) under the cache root {scan.root}: kvpersist never touches them, "
                   "but keep only LMCache's files there")
    if scan.lmcache_cleans.files:
        out.append(f"WARNING: {scan.lmcache_cleans.files} file(s) that are not LMCache's have "
                   f"'.tmp.' in their names under {scan.root} (e.g. "
                   f"{', '.join(scan.lmcache_cleans.samples[:3])}): LMCache deletes every such "
                   "file under its cache root when it stops cleanly; move them out")
    return out


def budget_notes(sizing: Sizing) -> list[str]:
    """The budget plan's verdict as notes: over budget is not a reason to refuse a launch
    (the server still serves what is on disk; health reports it degraded)."""
    plan = sizing.plan
    out = [f"budget: {r}" for r in plan.reasons[:2]]
    out += [f"budget warning: {w}" for w in plan.warnings]
    out += [f"budget problem: {p}" for p in plan.problems]
    return out


# --------------------------------------------------------------------------- starting (I/O)


def prepare_state(plan: LaunchPlan, rendered: Rendered, sizing: Sizing, *,
                  progress: Progress = quiet, weights: WeightsCheck | None = None) -> list[str]:
    """Create state/log directories (0700), write the manifest (with the weights record:
    the first launch's, or ``weights``' at the first) and the budget record (what
    ``health`` reports without scanning), ensure the serde key. Returns notes (e.g. a new
    key, a changed key fingerprint). Raises KvpError if the state cannot be written."""
    from kvpersist.l2 import keys

    notes: list[str] = []
    for d in (plan.state_dir, str(Path(plan.server_log).parent)):
        try:
            Path(d).mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise KvpError(f"cannot create {d}: {exc.strerror}; check KVP_STATE_DIR and "
                           "KVP_LOG_DIR and their owner") from exc
    atomic_write_json(plan.manifest_file,
                      manifest_with_weights(rendered.manifest, plan.manifest_file, weights))
    atomic_write_json(plan.budget_record, {"schema": "kvpersist.budget-record/1",
                                           "recorded_at_ns": time.time_ns(),
                                           "plan": sizing.plan.to_dict()})
    if plan.serde == "aesgcm":
        info = keys.ensure_key(plan.serde_key_file, also=service_uids(plan.service_user))
        if info.created:
            notes.append(f"created L2 master key {info.path} (0600, fingerprint "
                         f"{info.fingerprint})")
        old = keys.recorded_fingerprint(plan.state_dir)
        if old and old != info.fingerprint:
            notes.append(f"WARNING: the L2 key changed (fingerprint {old} -> "
                         f"{info.fingerprint}): files written under the old key are "
                         "permanent misses; run `kvp-admin verify --apply` to quarantine them")
        keys.record_fingerprint(plan.state_dir, info.fingerprint)
    progress(f"manifest {plan.manifest_file}")
    return notes


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


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True if GET ``url`` answers 200 within ``timeout`` seconds."""
    import requests

    try:
        return requests.get(url, timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def _log_tail(path: str, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


@dataclass(frozen=True)
class Started:
    """A process that launch started (or found running)."""

    what: str
    pid: int | None
    seconds: float
    already_running: bool = False
    log: str = ""


def _refuse_if_running(state: procs.PidState, what: str, progress: Progress) -> None:
    if state.running:
        raise CheckFailed(f"{what} is already running (pid {state.pid}, pid file "
                          f"{state.pid_file}); stop it first with `kvp-admin stop`")
    if state.state == "stale":
        progress(f"stale pid file {state.pid_file}: {state.reason}; removing it")
        procs.remove_pid_file(state.pid_file)


def start_server(plan: LaunchPlan, *, timeout: float = 60.0,
                 progress: Progress = quiet) -> Started:
    """Start the cache server in the background and wait until ``/healthcheck`` answers.

    Refuses (CheckFailed) when the pid file names a live server; a stale pid file is
    removed. Raises KvpError with the log's tail if the server exits or is not healthy in
    ``timeout`` seconds (the half-started process is stopped).
    """
    _refuse_if_running(server_state(plan), "the cache server", progress)
    progress(f"starting lmcache server (log {plan.server_log})")
    return _start_and_wait(
        "lmcache server", plan.server_argv, log=plan.server_log, env=plan.server_env,
        cwd=plan.state_dir, pid_file=plan.server_pid_file,
        ready=lambda: http_ok(f"{plan.server_http_url}/healthcheck", 1.0),
        timeout=timeout, interval=0.5, stop_timeout=10, not_ready="not healthy")


def _start_and_wait(name: str, argv: list[str], *, log: str, env: Mapping[str, str],
                    cwd: str, pid_file: str | None, ready: Callable[[], bool], timeout: float,
                    interval: float, stop_timeout: float, not_ready: str) -> Started:
    """Start ``argv`` in the background (umask 077), write its pid file, wait until
    ``ready()``; on failure stop it, remove the pid file and raise KvpError with the log's
    tail."""
    t0 = time.monotonic()
    proc = procs.start_background(argv, log_path=log, env=env, cwd=cwd, umask=0o077)
    if pid_file:
        procs.write_pid_file(pid_file, proc.pid)
    ok = procs.wait_for(ready, timeout, interval, should_abort=lambda: proc.poll() is not None)
    if not ok:
        code = proc.poll()
        procs.stop_process(proc.pid, timeout=stop_timeout)
        proc.wait(timeout=10)
        if pid_file:
            procs.remove_pid_file(pid_file, proc.pid)
        why = f"exited with status {code}" if code is not None else \
            f"{not_ready} after {timeout:.0f} s"
        raise KvpError(f"{name} {why}; last lines of {log}:\n{_log_tail(log)}")
    return Started(name, proc.pid, time.monotonic() - t0, log=log)


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


def vllm_ready(plan: Location, timeout: float = 2.0) -> bool:
    """True if vLLM answers ``/health`` and ``/v1/models`` lists the served name with the
    namespace as its root (the namespace reaches LMCache)."""
    import requests

    try:
        if requests.get(f"{plan.vllm_url}/health", timeout=timeout).status_code != 200:
            return False
        models = requests.get(f"{plan.vllm_url}/v1/models", timeout=timeout).json()
    except (requests.RequestException, ValueError):
        return False
    data = models.get("data") if isinstance(models, dict) else None  # any JSON may answer
    return isinstance(data, list) and any(isinstance(m, dict) and m.get("root") == plan.namespace
                                          and m.get("id") == plan.served_model_name for m in data)


def start_vllm(plan: LaunchPlan, *, timeout: float = 300.0,
               progress: Progress = quiet) -> Started:
    """Start vLLM for the deployment and wait until it serves the namespace.

    Direct process: ``python -m vllm.entrypoints.openai.api_server <rendered args>`` in the
    model-link directory, pid file ``S/vllm.pid``. Container: the rendered ``docker run``.
    Raises CheckFailed if it already runs, KvpError (with the log's tail) if it fails.
    """
    if plan.vllm_mode == "process":
        _refuse_if_running(vllm_state(plan), "vLLM", progress)
    ensure_model_link(plan)
    progress(f"starting vLLM ({plan.vllm_mode}, log {plan.vllm_log})")
    return _start_and_wait(
        "vLLM", plan.vllm_argv, log=plan.vllm_log, env=plan.vllm_env, cwd=plan.model_link_dir,
        pid_file=plan.vllm_pid_file if plan.vllm_mode == "process" else None,
        ready=lambda: vllm_ready(plan, 2.0), timeout=timeout, interval=1.0, stop_timeout=15,
        not_ready="not ready")


def launch_foreground(dep: Deployment, rendered: Rendered, plan: LaunchPlan, sizing: Sizing,
                      *, progress: Progress = quiet) -> None:
    """The launch sequence for systemd: refuse if running, preflight (no vLLM), prepare the
    state, write this host's fleet record on the shared tier (a failure is a warning), write
    the pid file with this pid and exec the cache server in this process.

    Raises CheckFailed if a server already runs, ConfigError listing every preflight
    problem; on success it does not return. After an unclean stop the crash window is checked
    (and its findings quarantined) before the exec, as by :func:`launch`.
    """
    srv = server_state(plan)
    _refuse_if_running(srv, "the cache server", progress)
    pre = preflight(dep, plan, sizing, with_vllm=False)
    if pre.problems:
        raise ConfigError(list(pre.problems), "preflight")
    for n in pre.notes:
        progress(n)
    for n in prepare_state(plan, rendered, sizing, progress=progress, weights=pre.weights):
        progress(n)
    check_crash_window(plan, srv, how="foreground", progress=progress)
    if dep.settings.shared_tier:
        from kvpersist.stack import fleet

        progress(fleet.write(dep).note())
    begin_preread(plan, progress)
    progress(f"exec lmcache server for {plan.namespace} (pid file {plan.server_pid_file})")
    procs.write_pid_file(plan.server_pid_file, os.getpid())
    procs.exec_foreground(plan.server_argv, env=plan.server_env, cwd=plan.state_dir)


# --------------------------------------------------------------------------- stopping (I/O)


@dataclass(frozen=True)
class Stopped:
    what: str
    pid: int | None
    how: str  # terminated / killed / not-running / stale
    seconds: float = 0.0
    detail: str = ""


def stop_vllm(plan: Location, *, timeout: float = 60.0) -> Stopped:
    """Stop the deployment's vLLM (direct process via its pid file, or the container)."""
    if plan.vllm_mode == "container":
        import subprocess

        if not shutil.which("docker"):
            return Stopped("vLLM", None, "not-running", detail="docker not installed")
        r = subprocess.run(["docker", "stop", "-t", str(int(timeout)), plan.container_name],
                           capture_output=True, text=True, timeout=timeout + 30)
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
    """Stop the process a checked pid file names (a stale pid file is only removed)."""
    if st.state == "stale":
        procs.remove_pid_file(st.pid_file)
        return Stopped(name, st.pid, "stale", detail=st.reason)
    if not st.running or st.pid is None:
        return Stopped(name, None, "not-running")
    res = procs.stop_process(st.pid, timeout=timeout)
    procs.remove_pid_file(st.pid_file, st.pid)
    return Stopped(name, st.pid, res.how, res.seconds)


def stop_deployment(plan: Location, *, timeout: float = 30.0,
                    vllm: bool = True) -> list[Stopped]:
    """vLLM first (it holds connections to the server), then the cache server."""
    out = []
    if vllm:
        out.append(stop_vllm(plan, timeout=max(timeout, 30.0)))
    out.append(stop_server(plan, timeout=timeout))
    return out


# --------------------------------------------------------------------------- the whole launch


@dataclass(frozen=True)
class LaunchResult:
    plan: LaunchPlan
    notes: tuple[str, ...]
    started: tuple[Started, ...]
    crash: CrashCheck | None = None
    #: the warm-up after vLLM (None: not run, --no-vllm or --no-warmup)
    warmup: WarmupRun | None = None
    #: this host's fleet record on the shared tier (None: no shared tier)
    fleet_record: RecordOutcome | None = None


def check_crash_window(plan: Location, srv: procs.PidState, *, how: str,
                       rate_mb_s: float | None = crash_window.DEFAULT_RATE_MB_S,
                       deadline_s: float | None = crash_window.DEFAULT_SECONDS,
                       progress: Progress = quiet) -> CrashCheck:
    """Before the server starts: decide from ``srv`` (the pid file's state, read before a
    stale one is removed) and the stop records whether the last stop was unclean; if so,
    verify the files written since the last launch and quarantine those that fail; log the
    result; write this launch's record. Raises KvpError if the key, the root or the records
    cannot be read or written."""
    window = crash_window.window_of(plan, srv)
    res = crash_window.check(plan, window, rate_mb_s=rate_mb_s, deadline_s=deadline_s)
    progress(res.summary())
    for q in res.quarantined:
        progress(f"quarantined {q}")
    for w in res.warnings:
        progress(f"WARNING: {w}")
    crash_window.log_check(plan, res, how=how)
    crash_window.record_launch(plan, carry_since_ns=res.since_ns if res.unchecked else None)
    return res


@dataclass(frozen=True)
class Prepared:
    """A deployment ready to launch: loaded, sized once, rendered and planned."""

    dep: Deployment
    sizing: Sizing
    rendered: Rendered
    plan: LaunchPlan
    #: the config argument as given and the environment it was loaded with (the warm-up
    #: child loads the same deployment from them)
    config: str = ""
    environ: Mapping[str, str] = field(default_factory=dict)


def prepare_launch(config: str, *, environ: Mapping[str, str] | None = None,
                   allow_unpinned: bool = False) -> Prepared:
    """Load ``config``, size it once (scan + other deployments on its root), render it and
    build its launch plan. Raises ConfigError for configuration or budget problems."""
    from kvpersist.config.loader import load_deployment
    from kvpersist.l2.inventory import size_deployment
    from kvpersist.stack.render import TEMPLATE_NAMES, render
    from kvpersist.system.templates import read_templates

    env = dict(os.environ if environ is None else environ)
    dep = load_deployment(config, env, allow_unpinned=allow_unpinned)
    sizing = size_deployment(dep, environ=env)
    rendered = render(dep, read_templates(TEMPLATE_NAMES), l1_size_gb=sizing.l1_size_gb,
                      l2_capacity_gb=sizing.l2_capacity_gb, lmcache_bin=lmcache_bin())
    return Prepared(dep, sizing, rendered, plan_launch(dep, rendered, env), config, env)


def launch(prepared: Prepared, *, with_vllm: bool = True, server_timeout: float = 60.0,
           vllm_timeout: float = 300.0, progress: Progress = quiet,
           crash_rate_mb_s: float | None = crash_window.DEFAULT_RATE_MB_S,
           crash_seconds: float | None = crash_window.DEFAULT_SECONDS,
           warmup: bool = True, warmup_wait: float | None = None) -> LaunchResult:
    """Preflight, prepare state, check the crash window after an unclean stop (bounded by
    ``crash_rate_mb_s`` and ``crash_seconds``), start the cache server, write this host's
    fleet record on the shared tier (a failure is a warning note), then (``with_vllm``)
    vLLM, then (``warmup``) the warm-up, bounded by ``warmup_wait`` seconds (default
    KVP_WARMUP_WAIT): the launch returns, ready, after it.

    Raises ConfigError listing every preflight problem (exit 2), CheckFailed if already
    running (exit 1), KvpError if a process fails to come up (after stopping it). If vLLM
    fails, the cache server started here is left running (it is healthy) and reported. A
    warm-up that fails or times out raises nothing: the result says so, vLLM serves cold.
    """
    dep, rendered, plan, sizing = (prepared.dep, prepared.rendered, prepared.plan,
                                   prepared.sizing)
    srv = server_state(plan)
    if srv.running:
        raise CheckFailed(f"the cache server is already running (pid {srv.pid}, pid file "
                          f"{srv.pid_file}); `kvp-admin status` shows it, "
                          "`kvp-admin stop` stops it")
    if with_vllm and plan.vllm_mode == "process":
        vst = vllm_state(plan)
        if vst.running:
            raise CheckFailed(f"vLLM is already running (pid {vst.pid}); "
                              "`kvp-admin stop` stops it")
    pre = preflight(dep, plan, sizing, with_vllm=with_vllm)
    if pre.problems:
        raise ConfigError(list(pre.problems), "preflight")
    notes = list(pre.notes)
    for n in notes:
        progress(n)
    state_notes = prepare_state(plan, rendered, sizing, progress=progress,
                                weights=pre.weights)
    for n in state_notes:
        progress(n)
    notes += state_notes
    crash = check_crash_window(plan, srv, how="launch", rate_mb_s=crash_rate_mb_s,
                               deadline_s=crash_seconds, progress=progress)
    notes.append(begin_preread(plan, progress))
    started = [start_server(plan, timeout=server_timeout, progress=progress)]
    progress(f"lmcache server healthy in {started[0].seconds:.1f} s (pid {started[0].pid})")
    record = None
    if dep.settings.shared_tier:
        # never fails the launch: a store that does not answer is a warning
        from kvpersist.stack import fleet

        record = fleet.write(dep)
        progress(record.note())
        notes.append(record.note())
    warm: WarmupRun | None = None
    if with_vllm:
        started.append(start_vllm(plan, timeout=vllm_timeout, progress=progress))
        progress(f"vLLM serves in {started[1].seconds:.1f} s (pid {started[1].pid})")
        if warmup and not dep.settings.warmup_file:
            warm = NO_WARM_SET
        elif warmup:
            warm = run_warmup(plan, prepared.config or dep.name,
                              env=prepared.environ or os.environ, wait_s=warmup_wait,
                              progress=progress)
            progress(warmup_summary(warm))
    return LaunchResult(plan, tuple(notes), tuple(started), crash, warm, record)


def warmup_summary(warm: WarmupRun) -> str:
    """One line on the warm-up for the launch's progress output (pure)."""
    if warm.state == "failed":
        return (f"WARNING: warm-up failed after {warm.seconds:.1f} s ({warm.detail}); vLLM "
                "serves, cold; health says degraded until a warm-up succeeds")
    if warm.state == "skipped":
        return f"warm-up skipped: {warm.detail}"
    return f"{warm.detail} ({warm.seconds:.1f} s); ready"
