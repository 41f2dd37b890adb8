"""Health of a deployment: probes with timeouts (I/O) and a pure verdict.

``probe_all`` gathers facts — every HTTP call has a timeout and nothing scans the cache root
(the budget comes from the record the last launch wrote), so it never hangs, whatever the size
of the root — and ``verdict`` (pure) turns them into ``healthy`` (exit 0), ``degraded`` (1: still
serving, e.g. budget exhausted so no longer caching, or the cache server down while vLLM
serves without it, or the warm-up failed), ``down`` (2: not serving) or ``warming`` (3:
serving, while the warm-up loads the warm set into L1; see :mod:`kvpersist.stack.warm.readiness`).
Down outranks warming, warming outranks degraded: a load balancer that routes only on exit 0
never sends traffic to a deployment that is still warming.

JSON schema ``kvpersist.health/1``: ``{schema, config, namespace, status, exit_code,
checks: [{name, status, detail}], lmcache: {...}, vllm: {...}, cache_root: {...},
shared_tier: {..., fleet: {...}} | null, warmup: {...}, fleet_record: {...} | null}`` where a
check's status is ``ok``, ``degraded``, ``down``, ``warming`` or ``skipped``.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpersist.config.deployment import Deployment, listeners
from kvpersist.config.values import is_loopback
from kvpersist.errors import KvpError
from kvpersist.l2.budget import resolve_size
from kvpersist.l2.fleet import host as fleet
from kvpersist.l2.fleet.host import fleet_facts
from kvpersist.l2.shared.credentials import read_secret_file
from kvpersist.l2.shared.store import probe
from kvpersist.stack.canary.run import canary_status, run_canary
from kvpersist.stack.canary.verdict import canary_health
from kvpersist.stack.health_root import RootFacts, root_checks
from kvpersist.stack.lmcache_exec import off_note
from kvpersist.stack.locate import Location
from kvpersist.stack.processes import server_state, vllm_state
from kvpersist.stack.render import serde_warnings
from kvpersist.stack.warm.readiness import WarmupFacts, gather, judge
from kvpersist.stack.warm.run import cached_token_ids
from kvpersist.system import procs
from kvpersist.system.files import fs_info, service_uids
from kvpersist.system.untrusted import (
    MAX_STATE_BYTES,
    UnreadableFile,
    parse_json,
    read_json_object,
)

SCHEMA = "kvpersist.health/1"
EXIT = {"healthy": 0, "degraded": 1, "down": 2, "warming": 3}
#: how bad a check status is: the overall status is the worst check's
_RANK: dict[str, float] = {"ok": 0, "skipped": 0, "degraded": 1, "warming": 1.5, "down": 2}
_STATUS_OF_RANK = {0: "healthy", 1: "degraded", 1.5: "warming", 2: "down"}


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok / degraded / down / skipped
    detail: str


@dataclass
class Facts:
    """What the probes found (plain data; ``verdict`` reads only this)."""

    expect_vllm: bool = True
    server_pid_state: str = "absent"
    server_pid: int | None = None
    server_healthcheck: bool = False
    server_status: dict[str, Any] | None = None
    run_script_code: int | None = None
    server_listen: list[str] = field(default_factory=list)
    #: the process listening on the admin port, and whether its command line is this
    #: deployment's cache server (None: unknown, e.g. another user's process)
    http_listener_pid: int | None = None
    http_listener_ours: bool | None = None
    http_listener_cmd: str = ""
    configured_hosts: list[str] = field(default_factory=list)
    #: the deployment's non-loopback binds (each opted in): component, allow key, detail
    remote_binds: list[dict[str, str]] = field(default_factory=list)
    root_exists: bool = False
    root_mode: int | None = None
    root_writable: bool = False
    #: the filesystem holding the cache root is mounted read-only
    fs_read_only: bool = False
    #: read-only only in this process's view (a sandbox: the health unit's ProtectSystem)
    fs_sandboxed: bool = False
    fs_avail_bytes: int | None = None
    reserve_bytes: int | None = None
    budget: dict[str, Any] | None = None
    budget_error: str = ""
    vllm_health: bool = False
    vllm_models: list[dict[str, Any]] | None = None
    vllm_kv_port: int | None = None
    vllm_kv_checked: bool = False
    served_model_name: str = ""
    namespace: str = ""
    lmcache_port: int = 0
    #: the L2 serde the deployment renders (aesgcm / none)
    serde: str = "aesgcm"
    #: the shared tier (None: the deployment has none): endpoint, adapter and the probe
    shared_tier: dict[str, Any] | None = None
    #: the warm-up's record, pid file and the server's start (None: not checked, --no-vllm)
    warmup: WarmupFacts | None = None
    #: the namespace's canary record (kvpersist.stack.canary.run.canary_status; None: not
    #: checked, --no-vllm) and this health run's own canary run (None: not asked for)
    canary: dict[str, Any] | None = None
    canary_run: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)


def read_budget_record(path: str) -> tuple[dict[str, Any] | None, str]:
    """The budget figures of the last launch (``S/budget.json``) and an error message.

    Health reports these instead of scanning the root: a scan of a big root takes longer than
    any probe may. Read as untrusted (:mod:`kvpersist.system.untrusted`) and typed: the byte
    figures and ``recorded_at_ns`` integers from 0 to 2**63 - 1, ``within_budget`` a
    boolean; else the figures are None and the message names the file and why (the
    ``cache_root.budget`` check is then *skipped*). Never raises."""
    try:
        doc = read_json_object(path, follow=False, max_bytes=MAX_STATE_BYTES)
    except FileNotFoundError:
        return None, "no budget recorded yet (written by `kvp-admin launch`)"
    except UnreadableFile as exc:
        return None, f"budget record unreadable: {exc}"
    plan = doc["plan"] if isinstance(doc.get("plan"), dict) else {}
    out = {k: plan.get(k) for k in ("on_disk_bytes", "own_bytes", "limit_bytes",
                                    "l2_max_capacity_bytes", "within_budget")}
    out["recorded_at_ns"] = doc.get("recorded_at_ns")
    for key, value in out.items():
        if not (isinstance(value, bool) if key == "within_budget" else isinstance(value, int)
                and not isinstance(value, bool) and 0 <= value < 1 << 63):
            where = key if key == "recorded_at_ns" else f"plan.{key}"
            return None, f"budget record {path} unreadable: {where} is absent or mistyped"
    return out, ""


def probe_all(dep: Deployment, plan: Location, *, timeout: float = 3.0,
              expect_vllm: bool = True) -> Facts:
    """Probe the cache server, the cache root and vLLM of a deployment (its location).

    Never scans the cache root; every network call is bounded by ``timeout``."""
    s = dep.settings
    f = Facts(expect_vllm=expect_vllm, served_model_name=s.served_model_name,
              namespace=dep.namespace, lmcache_port=s.lmcache_port, serde=s.serde,
              configured_hosts=[s.lmcache_host, s.lmcache_http_host],
              remote_binds=[{"component": lst.component, "allow_key": lst.allow_key,
                             "detail": lst.describe()}
                            for lst in listeners(s) if lst.remote])
    st = server_state(plan)
    f.server_pid_state, f.server_pid = st.state, st.pid
    server = plan.lmcache(timeout)
    f.server_healthcheck = server.healthy()
    if f.server_healthcheck:
        f.server_status = server.status()
        # 404 while the endpoint is disabled, 422 when enabled: nothing is ever executed
        f.run_script_code = server.run_script_status()
        _identify_listener(f, plan)
    pid = st.pid if st.running else f.http_listener_pid if f.http_listener_ours else None
    if pid:
        try:
            f.server_listen = procs.listening_addresses(pid)
        except OSError as exc:
            f.errors.append(f"listening sockets unknown: {exc}")
    root = plan.cache_root
    try:
        rst = os.stat(root)
        f.root_exists = stat.S_ISDIR(rst.st_mode)
        f.root_mode = stat.S_IMODE(rst.st_mode)
        f.root_writable = os.access(root, os.W_OK | os.X_OK)
        fs = fs_info(root)
        f.fs_avail_bytes, f.fs_sandboxed = fs.avail_bytes, fs.sandboxed
        f.fs_read_only = fs.filesystem_read_only
        f.reserve_bytes = resolve_size(s.l2_reserve, fs.total_bytes, "KVP_L2_RESERVE")
    except (OSError, KvpError) as exc:
        f.errors.append(f"cache root: {exc}")
    if f.root_exists:
        f.budget, f.budget_error = read_budget_record(plan.budget_record)
    f.shared_tier = probe_shared(dep, timeout)
    if f.shared_tier is not None:  # None, or the server started without it (lmcache_exec)
        f.shared_tier["off_since_start"] = off_note(plan.shared_off_file, pid)
    if expect_vllm:
        vllm = plan.vllm(timeout)
        f.vllm_health = vllm.healthy()
        if f.vllm_health:
            models = vllm.models()
            if models is not None:
                f.vllm_models = models
        if plan.vllm_mode == "process":
            vst = vllm_state(plan)
            if vst.running and vst.pid:
                f.vllm_kv_checked, f.vllm_kv_port = True, _kv_port_of(vst.pid)

        f.warmup = gather(plan, pid)
        f.canary = canary_status(plan)
    return f


def _identify_listener(f: Facts, loc: Location) -> None:
    """Which process listens on the admin port, and is it this deployment's cache server?

    Something else answering ``/healthcheck`` there (a stray test server, another program)
    must not make a stopped cache server look healthy."""
    port = loc.listen["lmcache_http"][1]
    try:
        pids = procs.listeners_of_port(port)
    except OSError as exc:
        f.errors.append(f"listener of port {port} unknown: {exc}")
        return
    for pid in sorted(pids):
        cmd = procs.cmdline(pid)
        if cmd is None:
            continue
        f.http_listener_pid, f.http_listener_cmd = pid, " ".join(cmd)[:160]
        f.http_listener_ours = procs.cmdline_matches(cmd, loc.server_markers)
        if f.http_listener_ours:
            return


def _kv_port_of(pid: int) -> int | None:
    """The ``lmcache.mp.port`` in a vLLM process's ``--kv-transfer-config``."""
    argv = procs.cmdline(pid) or []
    for i, arg in enumerate(argv):
        raw = None
        if arg == "--kv-transfer-config" and i + 1 < len(argv):
            raw = argv[i + 1]
        elif arg.startswith("--kv-transfer-config="):
            raw = arg.split("=", 1)[1]
        if raw:
            try:
                doc = parse_json(raw, "--kv-transfer-config")  # any process's argv
                return int(doc["kv_connector_extra_config"]["lmcache.mp.port"])
            except (UnreadableFile, ValueError, KeyError, TypeError):
                return None
    return None


def probe_shared(dep: Deployment, timeout: float) -> dict[str, Any] | None:
    """Reachability, authentication, latency and budget of the deployment's shared tier
    (None without one). Never raises."""
    tier = dep.shared
    if tier is None:
        return None
    out: dict[str, Any] = {"endpoint": tier.endpoint, "adapter": tier.adapter}

    try:
        secret = read_secret_file(dep.settings.shared_tier_secret_file,
                                  also=service_uids(dep.settings.service_user))
    except KvpError as exc:
        return {**out, "reachable": None, "auth_ok": False, "latency_ms": None,
                "budget": None, "error": str(exc)}

    out.update(probe(tier, secret, timeout).to_dict())
    if out.get("reachable") and out.get("auth_ok"):
        out["fleet"] = fleet_facts(dep, timeout)
    return out


def shared_checks(shared: dict[str, Any]) -> list[Check]:
    """The shared tier's checks (pure). A shared tier that is down, refuses the credentials
    or would refuse writes makes the deployment *degraded*, never down: the server serves
    from L1 and the NVMe, and stores there, without it."""
    where = f"shared tier {shared['endpoint']}"
    if not shared.get("reachable"):
        return [Check("shared_tier.store", "degraded",
                      f"{where} unreachable ({shared.get('error') or 'no answer'}): serving "
                      "from L1 and the local NVMe only; nothing local is lost")]
    if not shared.get("auth_ok"):
        return [Check("shared_tier.store", "degraded",
                      f"{where} refused the credentials ({shared.get('error')}): fix the ACL "
                      "user or KVP_SHARED_TIER_SECRET_FILE")]
    out = [Check("shared_tier.store", "ok",
                 f"{where} reachable, authenticated, {shared.get('latency_ms')} ms")]
    budget = shared.get("budget") or {}
    problems, warnings = budget.get("problems") or [], budget.get("warnings") or []
    if problems:
        out.append(Check("shared_tier.budget", "degraded", "; ".join(problems)))
    else:
        out.append(Check("shared_tier.budget", "ok",
                         f"maxmemory {budget.get('maxmemory_bytes')} B, policy "
                         f"{', '.join(budget.get('eviction_policies') or [])}"
                         + (f"; warning: {'; '.join(warnings)}" if warnings else "")))
    fleet = shared.get("fleet")
    if fleet is not None:
        out.append(fleet_check(fleet))
    return out


def fleet_check(fleet: dict[str, Any]) -> Check:
    """``shared_tier.serde_key`` (pure): this host's serde key against the fleet records of
    the other hosts serving the namespace. A different key (or serde) is *degraded*: each
    side's chunks fail authentication on the other, i.e. miss (never wrong output)."""
    if fleet.get("error"):
        return Check("shared_tier.serde_key", "skipped",
                     f"fleet records not compared: {fleet['error']}")
    conflicts = fleet.get("conflicts") or []
    if conflicts:
        names = ", ".join(c["host_id"] for c in conflicts)
        theirs = {c["serde"] for c in conflicts}
        what = "serde key" if theirs == {fleet.get("serde")} else (
            f"serde ({fleet.get('serde')} here, {', '.join(sorted(theirs))} there)")
        return Check("shared_tier.serde_key", "degraded",
                     f"{what} differs from host {names}: chunks stored by {names} miss here "
                     "and vice versa; give every host of the tier the same key "
                     "of the namespace (serde_keys in the Ansible role; "
                     "docs/keys-and-shred.md)")
    others = fleet.get("others") or []
    if not others:
        return Check("shared_tier.serde_key", "ok",
                     "no other host has a fleet record of this namespace")
    return Check("shared_tier.serde_key", "ok",
                 f"same serde key as {len(others)} other host(s): "
                 + ", ".join(o["host_id"] for o in others))


def verdict(f: Facts) -> tuple[str, list[Check]]:
    """Pure: the overall status and the individual checks."""
    checks: list[Check] = []
    status_shape = isinstance((f.server_status or {}).get("storage_manager"), dict)
    impostor = f.server_healthcheck and (
        f.http_listener_ours is False or (f.http_listener_ours is None and not status_shape))
    srv_up = f.server_healthcheck and not impostor
    # ---- cache server
    if impostor:
        who = (f"pid {f.http_listener_pid}: {f.http_listener_cmd}" if f.http_listener_pid
               else "its /status is not LMCache's")
        checks.append(Check("lmcache.healthcheck", "down" if not f.expect_vllm else "degraded",
                            "the admin port answers /healthcheck, but not from this "
                            f"deployment's cache server ({who}); pid file "
                            f"{f.server_pid_state}"))
    elif srv_up:
        checks.append(Check("lmcache.healthcheck", "ok", "/healthcheck answers 200"))
        if f.http_listener_ours and f.server_pid_state != "running":
            checks.append(Check("lmcache.pid_file", "degraded",
                                f"the cache server runs (pid {f.http_listener_pid}) but its "
                                f"pid file is {f.server_pid_state}: `kvp-admin stop` cannot "
                                f"find it; stop pid {f.http_listener_pid} by hand and launch "
                                "again"))
    else:
        why = f"pid file {f.server_pid_state}" + (f" (pid {f.server_pid})"
                                                  if f.server_pid else "")
        checks.append(Check("lmcache.healthcheck", "down" if not f.expect_vllm else "degraded",
                            f"cache server not answering; {why}"))
    if srv_up:
        adapters = (((f.server_status or {}).get("storage_manager") or {})
                    .get("l2_adapters") or [])
        nixl = [a for a in adapters if "Nixl" in str(a.get("type", ""))]
        if not nixl:
            checks.append(Check("lmcache.l2_adapter", "degraded",
                                "no nixl_store_dynamic adapter in /status: nothing persists"))
        elif all(a.get("is_healthy") and a.get("event_loop_alive") for a in nixl):
            checks.append(Check("lmcache.l2_adapter", "ok",
                                f"{nixl[0].get('type')} healthy, event loop alive, "
                                f"{nixl[0].get('stored_object_count')} objects known"))
        else:
            checks.append(Check("lmcache.l2_adapter", "degraded",
                                f"L2 adapter unhealthy: {json.dumps(nixl)}"))
        if f.run_script_code == 404:
            checks.append(Check("lmcache.run_script", "ok", "/run_script disabled (404)"))
        else:
            checks.append(Check("lmcache.run_script", "degraded",
                                f"/run_script answered {f.run_script_code}: remote code "
                                "execution may be enabled; restart without "
                                "--run-script-api-enabled"))
        if f.server_listen:
            # Loopback is always fine; any other address must be one the deployment binds
            # (and has opted in for): anything else is reachable without an opt-in.
            allowed = set(f.configured_hosts)
            stray = [a for a in f.server_listen if a.rsplit(":", 1)[0] not in allowed
                     and not is_loopback(a.rsplit(":", 1)[0])]
            if stray:
                checks.append(Check("lmcache.listen", "degraded",
                                    f"listens on {', '.join(stray)}, which this deployment "
                                    "does not bind: reachable from the network without an "
                                    "opt-in; restart it (kvp-admin stop, then launch)"))
            else:
                checks.append(Check("lmcache.listen", "ok",
                                    f"listens on {', '.join(f.server_listen)}"))
    # ---- non-loopback binds: opted in (a config without the opt-in never loads), shown
    for bind in f.remote_binds:
        if f.expect_vllm or bind["component"] != "vllm":
            checks.append(Check(f"network.{bind['component']}", "ok", bind["detail"]))
    # ---- integrity at rest: allowed either way, said plainly
    if f.serde == "aesgcm":
        checks.append(Check("l2.serde", "ok", "aesgcm: a damaged chunk file fails "
                                              "authentication and is a miss"))
    else:
        checks.append(Check("l2.serde", "ok",
                            "; ".join(f"WARNING: {w}" for w in serde_warnings(f.serde))))
    # ---- cache root (kvpersist/stack/health_root.py)
    checks += [Check(*row) for row in root_checks(RootFacts(
        exists=f.root_exists, mode=f.root_mode, writable=f.root_writable,
        read_only=f.fs_read_only, sandboxed=f.fs_sandboxed, avail_bytes=f.fs_avail_bytes,
        reserve_bytes=f.reserve_bytes, budget=f.budget, budget_error=f.budget_error))]
    # ---- vLLM
    if not f.expect_vllm:
        checks.append(Check("vllm", "skipped", "not checked (--no-vllm)"))
    elif not f.vllm_health:
        checks.append(Check("vllm.health", "down", "vLLM /health not answering"))
    else:
        checks.append(Check("vllm.health", "ok", "/health answers 200"))
        models = f.vllm_models or []
        mine = [m for m in models if m["id"] == f.served_model_name]
        if not mine:
            checks.append(Check("vllm.models", "down",
                                f"/v1/models does not list {f.served_model_name!r}"))
        elif mine[0]["root"] != f.namespace:
            checks.append(Check("vllm.models", "degraded",
                                f"{f.served_model_name} is served from {mine[0]['root']!r}, "
                                f"not the namespace {f.namespace}: nothing it stores is "
                                "reusable by this deployment"))
        else:
            checks.append(Check("vllm.models", "ok",
                                f"{f.served_model_name} served with root {f.namespace}"))
        if f.vllm_kv_checked:
            if f.vllm_kv_port == f.lmcache_port:
                checks.append(Check("vllm.kv_transfer", "ok",
                                    f"--kv-transfer-config points at port {f.lmcache_port}"))
            else:
                checks.append(Check("vllm.kv_transfer", "degraded",
                                    f"--kv-transfer-config points at {f.vllm_kv_port}, the "
                                    f"cache server listens on {f.lmcache_port}"))
        if not srv_up:
            checks.append(Check("vllm.persistence", "degraded",
                                "vLLM serves without the cache server: correct output, "
                                "no persistence"))
    if f.shared_tier is not None:
        off = f.shared_tier.get("off_since_start")  # the server started without the tier
        checks += ([Check("shared_tier.server", "degraded", off["message"])] if off else [])
        checks += shared_checks(f.shared_tier)
    # ---- warm-up (only where vLLM is checked: it warms for vLLM's registered layout)
    if f.warmup is not None:
        judged = judge(f.warmup, f.namespace)
        if judged is not None:
            checks.append(Check("warmup", *judged))
    if f.canary is not None:
        checks.append(Check("canary", *canary_health(
            f.canary, f.canary_run,
            vllm_has_connector=f.vllm_kv_port is not None if f.vllm_kv_checked else None)))
    return overall(checks), checks


def overall(checks: list[Check]) -> str:
    """``healthy``, ``degraded``, ``warming`` or ``down``: the worst check (pure)."""
    worst = max((_RANK[c.status] for c in checks), default=0)
    return _STATUS_OF_RANK[worst]


#: The components of a deployment, each a group of checks (``kvpersist_component_health``).
COMPONENTS = ("cache_server", "cache_root", "vllm", "wiring", "shared_tier", "warmup",
              "canary")


def component_of(check: str) -> str:
    """The component a check belongs to (pure): ``lmcache.*`` and ``l2.*`` (the server's L2
    settings, e.g. its serde) are the cache server,
    ``cache_root*`` the cache root, ``vllm.health``/``vllm.models`` vLLM, and what connects
    them (``vllm.kv_transfer``, ``vllm.persistence``, ``network.*``) the wiring."""
    if check.startswith(("lmcache.", "l2.")):
        return "cache_server"
    if check == "cache_root" or check.startswith("cache_root."):
        return "cache_root"
    if check in ("vllm", "vllm.health", "vllm.models"):
        return "vllm"
    if check.startswith("shared_tier."):
        return "shared_tier"
    if check == "warmup" or check.startswith("warmup."):
        return "warmup"
    if check == "canary":
        return "canary"
    return "wiring"


def component_status(checks: tuple[Check, ...] | list[Check]) -> dict[str, str]:
    """Each component's worst check status (pure): ``ok``, ``degraded``, ``down``,
    ``warming`` (the ``warmup`` component while it runs), or ``skipped`` when all its checks
    were skipped; a component without checks is absent."""
    order: dict[str, float] = {**_RANK, "skipped": -1}
    worst: dict[str, str] = {}
    for c in checks:
        comp = component_of(c.name)
        if comp not in worst or order[c.status] > order[worst[comp]]:
            worst[comp] = c.status
    return {k: worst[k] for k in COMPONENTS if k in worst}


@dataclass(frozen=True)
class HealthReport:
    """The verdict of ``kvp-admin health`` (JSON schema ``kvpersist.health/1``)."""

    config: str
    namespace: str
    status: str
    checks: tuple[Check, ...]
    facts: Facts
    loc: Location
    #: this host's fleet record as refreshed by this run (None: not refreshed)
    fleet_record: dict[str, Any] | None = None

    @property
    def exit_code(self) -> int:
        return EXIT[self.status]

    def to_dict(self) -> dict[str, Any]:
        f, loc = self.facts, self.loc
        return {
            "schema": SCHEMA,
            "config": self.config,
            "namespace": self.namespace,
            "status": self.status,
            "exit_code": self.exit_code,
            "checks": [asdict(c) for c in self.checks],
            "components": component_status(self.checks),
            "lmcache": {"pid_state": f.server_pid_state, "pid": f.server_pid,
                        "http": loc.server_http_url, "listen": f.server_listen,
                        "healthy": f.server_healthcheck},
            "vllm": {"checked": f.expect_vllm, "url": loc.vllm_url, "healthy": f.vllm_health,
                     "models": f.vllm_models},
            "cache_root": {"path": loc.cache_root,
                           "mode": f"{f.root_mode:04o}" if f.root_mode is not None else None,
                           "avail_bytes": f.fs_avail_bytes, "read_only": f.fs_read_only,
                           "read_only_here": f.fs_sandboxed,
                           "reserve_bytes": f.reserve_bytes, "budget": f.budget},
            "shared_tier": f.shared_tier,
            "warmup": _warmup_dict(f.warmup, loc),
            "canary": None if f.canary is None else {**f.canary, "run": f.canary_run,
                                                     "record": loc.canary_file},
            "fleet_record": self.fleet_record,
            "errors": f.errors,
        }


def _canary_state(f: Facts) -> str | None:
    """The canary state a fleet record carries (None: not checked)."""
    if f.canary is None:
        return None
    if f.canary.get("state") == "failed":
        return "failed"
    last = f.canary_run or f.canary.get("last") or {}
    state = last.get("state") or f.canary.get("state")
    return state if state in ("passed", "unknown", "none") else "unknown"


def _warmup_dict(w: WarmupFacts | None, loc: Location) -> dict[str, Any] | None:
    """The warm-up part of ``health --json`` (None when not checked)."""
    if w is None:
        return None
    return {"record": w.record, "state_file": loc.warmup_state_file,
            "pid_file": loc.warmup_pid_file, "pid_state": w.pid_state, "pid": w.pid,
            "wait_s": w.wait_s}


def health_report(dep: Deployment, loc: Location, *, timeout: float = 3.0,
                  expect_vllm: bool = True, wait: float = 0.0,
                  interval: float = 2.0, refresh_record: bool = False,
                  with_canary: bool = False) -> HealthReport:
    """Probe (again until healthy or ``wait`` seconds pass: a deployment that is warming is
    waited for) and return the verdict.

    ``refresh_record``: with a shared tier, when this deployment's cache server answers,
    write this host's fleet record again, with ``status`` (its TTL restarts;
    :mod:`kvpersist.l2.fleet.host`);
    a failure adds a *degraded* ``shared_tier.fleet_record`` check, never more.

    ``with_canary``: run the known-answer canary first (``health --canary``, the health timer;
    :mod:`kvpersist.stack.canary.run`) when vLLM is expected and serves."""
    deadline = time.monotonic() + max(0.0, wait)
    run: dict[str, Any] | None = None
    if with_canary and expect_vllm and loc.vllm(timeout).healthy():
        n = dep.settings.canary_warm_sample
        ids = cached_token_ids(dep, loc)[0] if n else None
        run = run_canary(loc, when="health", warm_ids=ids, warm_n=n).to_dict()
    while True:
        facts = probe_all(dep, loc, timeout=timeout, expect_vllm=expect_vllm)
        facts.canary_run = run
        status, checks = verdict(facts)
        if status == "healthy" or time.monotonic() >= deadline:
            break
        time.sleep(interval)
    record: dict[str, Any] | None = None
    serving = any(c.name == "lmcache.healthcheck" and c.status == "ok" for c in checks)
    if refresh_record and dep.settings.shared_tier and serving:

        outcome = fleet.write(dep, timeout=min(timeout, fleet.TIMEOUT_S), health=status,
                              canary=_canary_state(facts),
                              started=fleet.started_at(loc.server_pid_file))
        record = outcome.to_dict()
        checks.append(Check("shared_tier.fleet_record", "ok" if outcome.ok else "degraded",
                            outcome.note().removeprefix("WARNING: ")))
        status = overall(checks)
    return HealthReport(dep.name, dep.namespace, status, tuple(checks), facts, loc, record)


__all__ = ["COMPONENTS", "Check", "Facts", "component_of", "component_status", "HealthReport",
           "health_report", "overall", "probe_all", "verdict", "SCHEMA"]
