"""The checks before a launch: facts gathered with I/O, a pure verdict.

Shaped like :mod:`kvpersist.stack.health`: :func:`gather` reads what a launch needs into a
frozen :class:`PreflightFacts` — the cache root and its parent (stat, access, free space,
``O_DIRECT``), who owns the cache, state, log and key paths, the shared tier's secret and CA
files and its store, the ports, the executables, the identity against the weights and the
installed software (:mod:`kvpersist.stack.identity_check`), the weights' fingerprint against
the namespace's record (:func:`~kvpersist.stack.weights.check_weights`) and, only when all of
that passed, the extra and engine arguments as vLLM's own parser reads them
(:mod:`kvpersist.stack.vllm_args`: it costs a vLLM import) — and :func:`judge` (pure) turns
them into a :class:`Preflight`: every problem at once, and notes.

Preflight writes nothing: not the cache root (a missing root whose parent is a directory is
"to be created", by the launch, after a clean verdict), not the state dir, not the weights'
digest cache (the launch saves it, :func:`~kvpersist.stack.weights.save_digests`). So
``kvp-admin launch --check`` leaves the filesystem as it found it.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from dataclasses import dataclass, replace

from kvpersist.config.deployment import container_mount_problems
from kvpersist.errors import ConfigError, KvpError, Problem
from kvpersist.l2.inventory import Sizing
from kvpersist.l2.layout import display_name
from kvpersist.l2.shared.credentials import check_ca_file, read_secret_file
from kvpersist.l2.shared.store import TLS_UNTRUSTED, probe
from kvpersist.stack import identity_check, vllm_args
from kvpersist.stack.launch_plan import LaunchChecks, LaunchPlan
from kvpersist.stack.render import serde_warnings
from kvpersist.stack.warm.run import read_warm_set
from kvpersist.stack.weights import WeightsCheck, check_weights
from kvpersist.system import procs, vllm_seam
from kvpersist.system.files import (
    accessible_to_others,
    direct_io_problem,
    fs_info,
    service_uids,
    trust_problems,
)
from kvpersist.system.software import installed_vllm_version

#: less free space than this on the cache root's filesystem refuses a launch
MIN_FREE_BYTES = 256 << 20
TRUST_FIX = ("the service user must own its cache, state and key, and no other user may be "
             "able to replace them")
CA_FIX = ("point tls_ca= at the PEM file of the CA that signed the store's certificate, owned "
          "by root or the service user, mode 0644 or stricter")


@dataclass(frozen=True)
class Preflight:
    """Result of the checks before a launch: problems block it, notes are informational."""

    problems: tuple[Problem, ...]
    notes: tuple[str, ...]
    #: the weights fingerprint check (what prepare_state records in the manifest)
    weights: WeightsCheck | None = None
    #: the cache root the launch creates (0700) before anything else ('' : it exists)
    create_root: str = ""
    #: vLLM's parser verdict to remember after a clean verdict: (key, notes); None: nothing
    #: to remember (not run, remembered already, not cacheable, or problems)
    args_verdict: tuple[str, tuple[str, ...]] | None = None


# --------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class RootFacts:
    """The cache root as found. ``kind``: ``dir``, ``absent`` or ``other`` (it exists and is
    no directory)."""

    path: str
    kind: str
    parent_is_dir: bool = False
    #: its mode (a directory)
    mode: int | None = None
    #: this user can write and enter the root (``dir``) or, ``absent``, its parent
    writable: bool = False
    #: the filesystem holding it is mounted read-only (looked at when it is not writable)
    read_only: bool = False
    #: bytes free for unprivileged users where it is (or will be); None: not looked at
    avail_bytes: int | None = None
    #: why files there cannot be opened with O_DIRECT ('' : they can, or not checked)
    direct_io_problem: str = ""


@dataclass(frozen=True)
class PortFacts:
    key: str
    host: str
    port: int
    bindable: bool


@dataclass(frozen=True)
class SharedFacts:
    """The shared tier's secret file, CA file and store."""

    secret_file: str
    endpoint: str
    #: why the secret file's path cannot be trusted (owner, directories above it)
    trust: tuple[str, ...] = ()
    #: why the secret file cannot be read ('' : read, or not tried for a path not trusted)
    secret_error: str = ""
    #: why the CA file (``tls_ca=``) is refused ('' : fine, or none)
    ca_error: str = ""
    #: the store answered that its TLS certificate is not trusted ('' : not so, not probed)
    store_tls_error: str = ""
    #: what refuses the store's budget (noeviction, volatile-*)
    store_problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class ArgsFacts:
    """vLLM's own parser on the extra and engine arguments (``key``: the check's key when
    this verdict is to be remembered, :func:`kvpersist.stack.vllm_args.check_key`)."""

    problems: tuple[Problem, ...]
    notes: tuple[str, ...]
    key: str = ""


@dataclass(frozen=True)
class PreflightFacts:
    """What :func:`gather` found (plain data; :func:`judge` reads only this)."""

    with_vllm: bool
    pinned: bool
    namespace: str
    #: notes from the config and the sizing, shown as they are
    dep_notes: tuple[str, ...]
    serde: str
    foreign_notes: tuple[str, ...]
    listener_notes: tuple[str, ...]
    budget_notes: tuple[str, ...]
    root: RootFacts
    use_direct_io: bool
    generic_config: str
    service_user_error: str
    #: (setting, why) for the cache root, state dir, log dir and key paths
    trust: tuple[tuple[str, str], ...]
    shared: SharedFacts | None
    ports: tuple[PortFacts, ...]
    server_exe: str
    server_exe_found: bool
    vllm_mode: str
    model_target: str
    model_exists: bool
    docker_found: bool
    identity_problems: tuple[Problem, ...]
    identity_notes: tuple[str, ...]
    weights: WeightsCheck
    #: None: not checked (no vLLM, or another problem came first)
    vllm_args: ArgsFacts | None = None
    #: what LMCache's clean-up at a clean stop would delete under the cache root that is
    #: not LMCache's own (``ScanResult.lmcache_cleans``): how many, the first few (escaped)
    tmp_files: int = 0
    tmp_samples: tuple[str, ...] = ()
    #: KVP_ALLOW_LMCACHE_TMP_CLEANUP (or ``launch --allow-lmcache-tmp-cleanup``)
    allow_tmp_cleanup: bool = False
    #: what is wrong with the warm set (KVP_WARMUP_FILE), read and parsed as the warm-up
    #: will (with vLLM only: the warm-up runs after vLLM serves)
    warm_set_problems: tuple[Problem, ...] = ()
    #: KVP_CONTAINER_ENGINE (``docker_found``: whether it is installed)
    container_engine: str = "docker"
    #: the container's mounts that, symlinks resolved, would show it a private path
    mount_problems: tuple[Problem, ...] = ()
    #: the vLLM release that will run (None: not known) and what says so
    vllm_version: str | None = None
    vllm_version_of: str = "the installed vLLM"
    #: KVP_ALLOW_UNSUPPORTED_VLLM (or ``--allow-unsupported-vllm``)
    allow_unsupported_vllm: bool = False


def resolved_mount_problems(c: LaunchChecks) -> list[Problem]:
    """The container's mounts (KVP_CONTAINER_MOUNTS, the weights) against the private paths,
    both with symlinks resolved (the pure check of the deployment compares them as
    written)."""
    mounts = [(k, os.path.realpath(m)) for k, m in c.container_mounts]
    private = [(k, os.path.realpath(p)) for k, p in c.private_paths]
    return container_mount_problems(private, mounts, "KVP_IMAGE")


def gather(plan: LaunchPlan, sizing: Sizing, *,
           with_vllm: bool, with_server: bool = True) -> PreflightFacts:
    """Read everything the verdict needs for a launch of ``plan`` (I/O, never a write).
    ``sizing`` is the launch's one budget plan (shown as notes, never computed again here).
    The vLLM-argument check runs last, only when :func:`judge` finds nothing else wrong.
    ``with_server=False``: the deployment's cache server already runs (a launch of vLLM
    alone): its ports are its own, not checked. Raises KvpError only when the filesystem of
    the cache root cannot be looked at."""
    c = plan.checks
    also: tuple[int, ...] = ()
    user_error = ""
    try:
        also = service_uids(plan.service_user)
    except KvpError as exc:
        user_error = str(exc)
    scan = sizing.measurement.scan if sizing.measurement else None
    cleans = scan.lmcache_cleans if scan else None
    trust: list[tuple[str, str]] = []
    for key, path in (("KVP_CACHE_ROOT", plan.cache_root), ("KVP_STATE_DIR", plan.state_dir),
                      ("KVP_LOG_DIR", os.path.dirname(plan.server_log)),
                      ("KVP_SERDE_KEY_FILE", plan.serde_key_file)):
        if key == "KVP_SERDE_KEY_FILE" and plan.serde != "aesgcm":
            continue
        trust += [(key, why) for why in trust_problems(path, also=also)]
    ports = [("KVP_LMCACHE_PORT", *plan.listen["lmcache"]),
             ("KVP_LMCACHE_HTTP_PORT", *plan.listen["lmcache_http"])] if with_server else []
    if with_vllm:
        ports.append(("KVP_VLLM_PORT", *plan.listen["vllm"]))
    exe = plan.server_argv[0]
    identity = identity_check.check(c.identity, vllm_launched=with_vllm)
    process = plan.vllm_mode == "process"
    version = plan.vllm_version
    facts = PreflightFacts(
        with_vllm=with_vllm, pinned=c.pinned, namespace=plan.namespace,
        dep_notes=c.notes, serde=plan.serde, foreign_notes=tuple(foreign_notes(sizing)),
        listener_notes=tuple(listener_notes(c.remote_listeners, with_vllm=with_vllm)),
        budget_notes=tuple(budget_notes(sizing)),
        root=gather_root(plan.cache_root, direct_io=c.use_direct_io),
        use_direct_io=c.use_direct_io, generic_config=c.generic_config,
        service_user_error=user_error, trust=tuple(trust), shared=gather_shared(c, also),
        ports=tuple(PortFacts(key, host, port, procs.port_bindable(host, port))
                    for key, host, port in ports),
        server_exe=exe, server_exe_found=bool(os.path.exists(exe) or shutil.which(exe)),
        vllm_mode=plan.vllm_mode, model_target=plan.model_target,
        model_exists=os.path.exists(plan.model_target),
        docker_found=bool(shutil.which(plan.container_engine)) if with_vllm else False,
        container_engine=plan.container_engine,
        mount_problems=tuple(resolved_mount_problems(c)) if with_vllm and
        plan.vllm_mode == "container" else (),
        identity_problems=tuple(identity.launch_problems()),
        identity_notes=tuple(identity.launch_notes()),
        weights=check_weights(plan, pinned=c.pinned, with_vllm=with_vllm, write_cache=False),
        tmp_files=cleans.files if cleans and with_server else 0,
        tmp_samples=tuple(cleans.samples) if cleans else (),
        allow_tmp_cleanup=c.allow_tmp_cleanup,
        warm_set_problems=warm_set_problems(c) if with_vllm else (),
        vllm_version=version,
        vllm_version_of="the installed vLLM" if process and version == installed_vllm_version()
        else "the vLLM the deployment names (KVP_VLLM_BUILD, KVP_IMAGE)",
        allow_unsupported_vllm=c.allow_unsupported_vllm)
    if with_vllm and not judge(facts).problems:  # costs a vLLM import: last, when all passed
        if version not in vllm_seam.RELEASES:  # opted in: its parser is not known
            why = vllm_seam.support_problem(version, facts.vllm_version_of)
            facts = replace(facts, vllm_args=ArgsFacts((), (
                f"vLLM's own parser not run: {why}; the flag table of vLLM "
                f"{vllm_seam.table_version(version)} read the arguments",)))
        else:
            facts = replace(facts, vllm_args=gather_args(plan))
    return facts


def gather_args(plan: LaunchPlan) -> ArgsFacts:
    """vLLM's parser verdict on the launch's arguments: the one remembered in the state dir
    for the same key (same vLLM build, same arguments), else a new check (a vLLM import)."""
    inputs = plan.checks.parser
    key = vllm_args.check_key(inputs, plan.vllm_mode, plan.vllm_argv, plan.vllm_env)
    cached = vllm_args.cached_verdict(plan.state_dir, key)
    if cached is not None:
        return ArgsFacts((), (*cached, "vLLM's own parser check: the same vLLM build and "
                          "arguments as at a launch that passed it; not run again"))
    args = vllm_args.check_deployment(inputs, plan.vllm_mode, plan.vllm_argv, plan.vllm_env)
    return ArgsFacts(tuple(args.problems), tuple(args.notes), key)


def warm_set_problems(c: LaunchChecks) -> tuple[Problem, ...]:
    """The problems of the deployment's warm set (KVP_WARMUP_FILE), read and parsed as the
    warm-up reads it (bounded, untrusted): a bad one is found before anything starts, not
    after vLLM serves. Empty without a warm set."""
    if not c.warmup_file:
        return ()
    try:
        read_warm_set(c.warmup_file, c.source)
    except ConfigError as exc:
        return tuple(exc.problems)
    return ()


def gather_root(root: str, *, direct_io: bool) -> RootFacts:
    """The cache root at ``root`` (or, absent, its parent): kind, mode, access, free space
    and, with ``direct_io``, whether O_DIRECT works there. Creates nothing. Raises KvpError
    if the free space cannot be read."""
    try:
        st: os.stat_result | None = os.stat(root)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise KvpError(f"cannot look at the cache root {root}: {exc.strerror}; check "
                           "KVP_CACHE_ROOT and the directories above it") from exc
        st = None
    parent = os.path.dirname(os.path.abspath(root))
    if st is not None and not stat.S_ISDIR(st.st_mode):
        return RootFacts(root, "other")
    if st is None:
        if not os.path.isdir(parent):
            return RootFacts(root, "absent")
        where, facts = parent, RootFacts(root, "absent", parent_is_dir=True,
                                         writable=os.access(parent, os.W_OK | os.X_OK))
    else:
        where, facts = root, RootFacts(root, "dir", mode=stat.S_IMODE(st.st_mode),
                                       writable=os.access(root, os.W_OK | os.X_OK))
    if not facts.writable:
        try:
            return replace(facts, read_only=fs_info(where).read_only)
        except KvpError:
            return facts
    return replace(facts, avail_bytes=fs_info(where).avail_bytes,
                   direct_io_problem=direct_io_problem(where) if direct_io else "")


def gather_shared(c: LaunchChecks, also: tuple[int, ...]) -> SharedFacts | None:
    """The shared tier's secret file (its path trusted, then read owner-only), its CA file
    and, when both are fine, its store (TLS and budget). None without a shared tier. An
    unreachable store is no fact against a launch (it starts degraded)."""
    if not c.shared_tier_url:
        return None
    tier = c.shared_tier
    path = c.shared_tier_secret_file
    facts = SharedFacts(path, tier.endpoint if tier else c.shared_tier_url,
                        trust=tuple(trust_problems(path, also=also)))
    secret = None
    if not facts.trust:
        try:
            secret = read_secret_file(path, also=also)
        except KvpError as exc:
            facts = replace(facts, secret_error=str(exc))
    if tier is not None and tier.tls_ca:
        try:
            check_ca_file(tier.tls_ca, also=also)
        except KvpError as exc:
            facts = replace(facts, ca_error=str(exc))
    if tier is None or secret is None or facts.ca_error:
        return facts
    found = probe(tier, secret)
    if found.error.startswith(TLS_UNTRUSTED):
        return replace(facts, store_tls_error=found.error)
    return replace(facts, store_problems=tuple(found.budget.problems) if found.budget else ())


# --------------------------------------------------------------------------- notes (pure)


def listener_notes(remote: tuple[tuple[str, str], ...], *, with_vllm: bool) -> list[str]:
    """A note for every port that binds a non-loopback address (``remote``: (component,
    description) of each; each opted in by its ``KVP_ALLOW_REMOTE_*`` key; a bind without one
    never gets this far)."""
    return [f"network: {what}" for component, what in remote
            if with_vllm or component != "vllm"]


def foreign_notes(sizing: Sizing) -> list[str]:
    """What launch should say about files under the cache root that are not LMCache's: they
    are never touched by kvpersist (those LMCache's clean-up would delete are judged apart:
    :func:`tmp_cleanup_verdict`)."""
    scan = sizing.measurement.scan if sizing.measurement else None
    if scan is None or not (scan.foreign.files or scan.foreign_dirs):
        return []
    return [f"{scan.foreign.files} foreign file(s) and {scan.foreign_dirs} foreign dir(s) "
            f"under the cache root {display_name(scan.root)}: kvpersist never touches them, "
            "but keep only LMCache's files there"]


#: how many of the files LMCache's clean-up would delete a refusal names
TMP_SHOWN = 5
TMP_OPT_IN = "KVP_ALLOW_LMCACHE_TMP_CLEANUP"


def tmp_cleanup_verdict(f: PreflightFacts) -> tuple[list[Problem], list[str]]:
    """Files under the cache root that are not LMCache's but have ``.tmp.`` in their names
    (pure): LMCache 0.5.6's clean-up at a clean stop (``FileDynamicNixlStorageAgent.
    cleanup``) deletes every such file, so a launch is refused (nothing is deleted but by
    an explicit command) unless the operator accepted it (:data:`TMP_OPT_IN`); then it is a
    warning. LMCache's own temp files (an interrupted write, normal after a kill -9) are
    not counted. Returns (problems, notes)."""
    if not f.tmp_files:
        return [], []
    shown = ", ".join(display_name(s) for s in f.tmp_samples[:TMP_SHOWN])
    more = f.tmp_files - min(len(f.tmp_samples), TMP_SHOWN)
    what = (f"{f.tmp_files} file(s) under the cache root {display_name(f.root.path)} that "
            f"are not LMCache's have '.tmp.' in their names ({shown}"
            f"{f' and {more} more' if more else ''}): LMCache deletes every such file under "
            "its cache root when it stops cleanly")
    if f.allow_tmp_cleanup:
        return [], [f"WARNING: {what}; launching anyway ({TMP_OPT_IN}=true or "
                    "--allow-lmcache-tmp-cleanup): the next clean stop deletes them"]
    return [Problem("KVP_CACHE_ROOT", what,
                    "move them out of the cache root (kvp-admin report lists them), or "
                    f"accept that a clean stop deletes them: {TMP_OPT_IN}=true in the "
                    "config, or launch --allow-lmcache-tmp-cleanup once")], []


def budget_notes(sizing: Sizing) -> list[str]:
    """The budget plan's verdict as notes: over budget is not a reason to refuse a launch
    (the server still serves what is on disk; health reports it degraded)."""
    plan = sizing.plan
    out = [f"budget: {r}" for r in plan.reasons[:2]]
    out += [f"budget warning: {w}" for w in plan.warnings]
    out += [f"budget problem: {p}" for p in plan.problems]
    return out


def root_creation_note(root: str) -> str:
    """What the launch says once it created the cache root (pure)."""
    return f"created cache root {root} (mode 0700)"


# --------------------------------------------------------------------------- the verdict


def judge(f: PreflightFacts, *, min_free_bytes: int = MIN_FREE_BYTES) -> Preflight:
    """Pure: every problem that refuses the launch and the notes, in a stable order (the
    cache root, the trust of its paths, the shared tier, the ports, the executables, the
    identity, the weights, vLLM's parser)."""
    problems: list[Problem] = []
    notes: list[str] = []
    if not f.pinned:
        notes.append(f"identity unpinned: one-off namespace {f.namespace}, "
                     "nothing will be reused after a restart")
    notes += f.dep_notes
    notes += [f"WARNING: {w}" for w in serde_warnings(f.serde)]
    notes += f.foreign_notes
    notes += f.listener_notes
    root_problems, create = _root_verdict(f.root, min_free_bytes)
    problems += root_problems
    tmp_problems, tmp_notes = tmp_cleanup_verdict(f)
    problems += tmp_problems
    notes += tmp_notes
    problems += f.warm_set_problems
    if create:
        notes.append(f"cache root {f.root.path} does not exist yet: the launch creates it "
                     "(mode 0700)")
    if f.root.kind == "dir" or create:
        notes += f.budget_notes
        if f.use_direct_io and f.root.direct_io_problem:
            problems.append(Problem(
                "l2.use_direct_io", f"{f.root.direct_io_problem}: every L2 read and write "
                "would fail", f"put KVP_CACHE_ROOT on the NVMe filesystem (ext4, xfs), or set "
                f"l2.use_direct_io: false in configs/{f.generic_config}/lmcache.yaml"))
    if f.service_user_error:
        problems.append(Problem("KVP_SERVICE_USER", f.service_user_error))
    seen: set[str] = set()
    for key, why in f.trust:
        if why not in seen:
            seen.add(why)
            problems.append(Problem(key, why, TRUST_FIX))
    if f.shared is not None:
        problems += shared_problems(f.shared)
    for p in f.ports:
        if not p.bindable:
            problems.append(Problem(p.key, f"{p.host}:{p.port} is already in use",
                                    "stop what listens there or choose another port"))
    if not f.server_exe_found:
        problems.append(Problem("lmcache", f"executable {f.server_exe!r} not found",
                                "pip install 'kvpersist[cache]' (lmcache==0.5.6 nixl)"))
    if f.with_vllm and f.vllm_mode == "process" and not f.model_exists:
        problems.append(Problem("KVP_MODEL_PATH", f"{f.model_target} does not exist",
                                "point it at the model weights directory"))
    if f.with_vllm and f.vllm_mode == "container" and not f.docker_found:
        engine = f.container_engine
        problems.append(Problem("KVP_IMAGE", f"{engine} is not installed",
                                f"install {engine} (KVP_CONTAINER_ENGINE), or unset KVP_IMAGE "
                                "for a direct process"))
    problems += f.mount_problems
    if f.with_vllm:
        unsupported = vllm_seam.support_problem(f.vllm_version, f.vllm_version_of)
        if unsupported and f.allow_unsupported_vllm:
            notes.append(f"{unsupported}; KVP_ALLOW_UNSUPPORTED_VLLM: running it anyway, "
                         "without the checks that need vLLM's internals (its own parser, the "
                         "warm-up's token ids)")
        elif unsupported:
            problems.append(Problem("vLLM", unsupported, vllm_seam.SUPPORT_FIX))
    problems += f.identity_problems
    notes += f.identity_notes
    problems += f.weights.problems
    notes += f.weights.notes
    if f.vllm_args is not None:
        problems += f.vllm_args.problems
        notes += f.vllm_args.notes
    remember = None
    if f.vllm_args is not None and f.vllm_args.key and not problems:
        remember = (f.vllm_args.key, f.vllm_args.notes)
    return Preflight(tuple(problems), tuple(notes), f.weights, f.root.path if create else "",
                     remember)


def _root_verdict(r: RootFacts, min_free_bytes: int) -> tuple[list[Problem], bool]:
    """The cache root's problems, and whether the launch is to create it (pure)."""
    key, root = "KVP_CACHE_ROOT", r.path
    if r.kind == "other":
        return [Problem(key, f"{root} is not a directory")], False
    if r.kind == "absent" and not r.parent_is_dir:
        return [Problem(key, f"{root} does not exist",
                        "create it on the NVMe filesystem (mode 0700)")], False
    if r.kind == "absent" and not r.writable:
        return [Problem(key, f"cannot create {root}: Permission denied",
                        "create it as the cache owner")], False
    out = []
    if r.mode is not None and accessible_to_others(r.mode):
        out.append(Problem(key, f"{root} is accessible to others (mode {r.mode:04o}); KV data "
                                "reveals prompts", f"chmod o-rwx {root}"))
    if not r.writable and r.read_only:
        out.append(Problem(key, f"{root} is on a filesystem mounted read-only: every L2 write "
                                "would fail", "find why (dmesg), then remount it read-write "
                                "(mount -o remount,rw MOUNTPOINT)"))
    elif not r.writable:
        out.append(Problem(key, f"{root} is not writable by this user",
                           "run as the cache owner or fix ownership"))
    elif r.avail_bytes is not None and r.avail_bytes < min_free_bytes:
        out.append(Problem(key, f"only {r.avail_bytes >> 20} MiB free on {root}",
                           "free space or prune stale namespaces"))
    return out, r.kind == "absent"


def shared_problems(sh: SharedFacts) -> list[Problem]:
    """The shared tier's problems (pure): its secret file must belong to the service user,
    be readable by nobody else and hold a password (its content is never shown); its CA
    file must be one only root or the service user can change; a store that would answer
    writes with errors instead of evicting (noeviction, volatile-*), or whose certificate
    the CA does not vouch for, is refused. An unreachable store is not."""
    key, path = "KVP_SHARED_TIER_SECRET_FILE", sh.secret_file
    fix = (f"write username=... and password=... lines into {path} as the service user, "
           f"mode 0600 (the Ansible role does it from the vault)")
    out = [Problem(key, why, fix) for why in sh.trust]
    if sh.secret_error:
        out.append(Problem(key, sh.secret_error, fix))
    if sh.ca_error:
        out.append(Problem("KVP_SHARED_TIER", sh.ca_error, CA_FIX))
    if sh.store_tls_error:
        # LMCache 0.5.6's valkey adapter connects while the server starts (it probes glide's
        # buffer GET in its constructor): with a certificate it cannot verify the server
        # exits ("invalid peer certificate: UnknownIssuer"), so say why before that
        out.append(Problem("KVP_SHARED_TIER", f"the store at {sh.endpoint}: "
                           f"{sh.store_tls_error}", "set tls_ca= to the PEM file of the CA "
                           "that signed the store's certificate (docs/fleet.md, "
                           "Configuration)"))
    out += [Problem("KVP_SHARED_TIER", f"the store at {sh.endpoint}: {p}",
                    "CONFIG SET maxmemory-policy allkeys-lru (and in the store's config "
                    "file); see docs/fleet.md, Sizing") for p in sh.store_problems]
    return out


def preflight(plan: LaunchPlan, sizing: Sizing, *,
              with_vllm: bool, with_server: bool = True) -> Preflight:
    """:func:`gather`, then :func:`judge`: every problem at once; never raises for them, never
    writes."""
    return judge(gather(plan, sizing, with_vllm=with_vllm, with_server=with_server))


__all__ = ["MIN_FREE_BYTES", "ArgsFacts", "PortFacts", "Preflight", "PreflightFacts",
           "RootFacts", "SharedFacts", "budget_notes", "foreign_notes", "gather",
           "gather_args", "gather_root", "gather_shared", "judge", "listener_notes",
           "preflight", "root_creation_note", "shared_problems", "tmp_cleanup_verdict"]
