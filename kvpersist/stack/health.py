"""Health of a deployment: probes with timeouts (I/O) and a pure verdict.

``probe_all`` gathers facts — every HTTP call and the disk scan have a timeout, so it never
hangs — and ``verdict`` (pure) turns them into ``healthy`` (exit 0), ``degraded`` (1: still
serving, e.g. budget exhausted so no longer caching, or the cache server down while vLLM
serves without it) or ``down`` (2: not serving).

JSON schema ``kvpersist.health/1``: ``{schema, config, namespace, status, exit_code,
checks: [{name, status, detail}], lmcache: {...}, vllm: {...}, cache_root: {...}}`` where a
check's status is ``ok``, ``degraded``, ``down`` or ``skipped``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpersist.system import procs

SCHEMA = "kvpersist.health/1"
EXIT = {"healthy": 0, "degraded": 1, "down": 2}
_RANK = {"ok": 0, "skipped": 0, "degraded": 1, "down": 2}


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
    configured_hosts: list[str] = field(default_factory=list)
    root_exists: bool = False
    root_mode: int | None = None
    root_writable: bool = False
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
    errors: list[str] = field(default_factory=list)


def _get(url: str, timeout: float, method: str = "GET") -> tuple[int | None, Any]:
    import requests

    try:
        r = requests.request(method, url, timeout=timeout)
    except requests.RequestException as exc:
        return None, str(exc)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def _with_deadline(fn: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
    """Run ``fn`` in a daemon thread; (True, result) or (False, None) after ``timeout``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["v"] = fn()
        except Exception as exc:  # reported, never raised out of a probe
            box["e"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        return False, None
    if "e" in box:
        return True, box["e"]
    return True, box.get("v")


def probe_all(dep: Any, plan: Any, *, timeout: float = 3.0, expect_vllm: bool = True,
              scan_timeout: float = 10.0) -> Facts:
    """Probe the cache server, the cache root and vLLM of a deployment (launch plan)."""
    from kvpersist.config.values import parse_size_or_percent
    from kvpersist.stack import launch as lc

    s = dep.settings
    f = Facts(expect_vllm=expect_vllm, served_model_name=s.served_model_name,
              namespace=dep.namespace, lmcache_port=s.lmcache_port,
              configured_hosts=[s.lmcache_host, s.lmcache_http_host])
    st = lc.server_state(plan)
    f.server_pid_state, f.server_pid = st.state, st.pid
    code, _ = _get(f"{plan.server_http_url}/healthcheck", timeout)
    f.server_healthcheck = code == 200
    if f.server_healthcheck:
        code, body = _get(f"{plan.server_http_url}/status", timeout)
        f.server_status = body if code == 200 and isinstance(body, dict) else None
        # POST without a body: 404 when the endpoint is disabled; an enabled endpoint
        # answers 422 (no script given) - nothing is ever executed.
        f.run_script_code, _ = _get(f"{plan.server_http_url}/run_script", timeout, "POST")
    if st.running and st.pid:
        try:
            import psutil

            conns = psutil.Process(st.pid).net_connections(kind="inet")
            f.server_listen = sorted({f"{c.laddr.ip}:{c.laddr.port}" for c in conns
                                      if c.status == psutil.CONN_LISTEN})
        except Exception as exc:
            f.errors.append(f"listening sockets unknown: {exc}")
    root = plan.cache_root
    try:
        rst = os.stat(root)
        f.root_exists = stat.S_ISDIR(rst.st_mode)
        f.root_mode = stat.S_IMODE(rst.st_mode)
        f.root_writable = os.access(root, os.W_OK | os.X_OK)
        sv = os.statvfs(root)
        f.fs_avail_bytes = sv.f_bavail * sv.f_frsize
        rb, rp = parse_size_or_percent(s.l2_reserve)
        f.reserve_bytes = rb if rb is not None else int(sv.f_blocks * sv.f_frsize * (rp or 0))
    except OSError as exc:
        f.errors.append(f"cache root: {exc}")
    if f.root_exists:
        from kvpersist.l2.scan import measure_and_plan

        done, res = _with_deadline(lambda: measure_and_plan(dep), scan_timeout)
        if not done:
            f.budget_error = f"scan of {root} took longer than {scan_timeout:.0f} s"
        elif isinstance(res, Exception):
            f.budget_error = f"budget unknown: {res}"
        else:
            f.budget = {"on_disk_bytes": res.on_disk_bytes, "own_bytes": res.own_bytes,
                        "limit_bytes": res.limit_bytes,
                        "l2_max_capacity_bytes": res.l2_max_capacity_bytes,
                        "within_budget": res.within_budget}
    if expect_vllm:
        code, _ = _get(f"{plan.vllm_url}/health", timeout)
        f.vllm_health = code == 200
        if f.vllm_health:
            code, body = _get(f"{plan.vllm_url}/v1/models", timeout)
            if code == 200 and isinstance(body, dict):
                f.vllm_models = [{"id": m.get("id"), "root": m.get("root")}
                                 for m in body.get("data", [])]
        if plan.vllm_mode == "process":
            vst = lc.vllm_state(plan)
            if vst.running and vst.pid:
                f.vllm_kv_checked, f.vllm_kv_port = True, _kv_port_of(vst.pid)
    return f


def _kv_port_of(pid: int) -> int | None:
    """The ``lmcache.mp.port`` in a vLLM process's ``--kv-transfer-config``."""
    try:
        import psutil

        argv = psutil.Process(pid).cmdline()
    except Exception:
        return None
    for i, arg in enumerate(argv):
        raw = None
        if arg == "--kv-transfer-config" and i + 1 < len(argv):
            raw = argv[i + 1]
        elif arg.startswith("--kv-transfer-config="):
            raw = arg.split("=", 1)[1]
        if raw:
            try:
                port = json.loads(raw)["kv_connector_extra_config"]["lmcache.mp.port"]
                return int(port)
            except (ValueError, KeyError, TypeError):
                return None
    return None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def verdict(f: Facts) -> tuple[str, list[Check]]:
    """Pure: the overall status and the individual checks."""
    checks: list[Check] = []
    srv_up = f.server_healthcheck
    # ---- cache server
    if srv_up:
        checks.append(Check("lmcache.healthcheck", "ok", "/healthcheck answers 200"))
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
            allowed = set(f.configured_hosts)
            stray = [a for a in f.server_listen
                     if a.rsplit(":", 1)[0] not in allowed
                     and not (all(_loopback(h) for h in allowed)
                              and _loopback(a.rsplit(":", 1)[0]))]
            wide = [a for a in f.server_listen if a.rsplit(":", 1)[0] in ("0.0.0.0", "::")
                    and not any(h in ("0.0.0.0", "::") for h in allowed)]
            if wide:
                checks.append(Check("lmcache.listen", "degraded",
                                    f"listens on all interfaces: {', '.join(wide)}"))
            else:
                checks.append(Check("lmcache.listen", "ok",
                                    f"listens on {', '.join(f.server_listen)}"
                                    + (f" (also {', '.join(stray)})" if stray else "")))
    # ---- cache root
    if not f.root_exists:
        checks.append(Check("cache_root", "down", "cache root missing"))
    else:
        problems = []
        if f.root_mode is not None and f.root_mode & 0o007:
            problems.append(f"accessible to others (mode {f.root_mode:04o})")
        if not f.root_writable:
            problems.append("not writable")
        checks.append(Check("cache_root.permissions", "degraded" if problems else "ok",
                            "; ".join(problems) or f"mode {f.root_mode:04o}, writable"))
        if f.fs_avail_bytes is not None and f.reserve_bytes is not None:
            low = f.fs_avail_bytes <= f.reserve_bytes
            checks.append(Check("cache_root.free_space", "degraded" if low else "ok",
                                f"{f.fs_avail_bytes >> 20} MiB free, reserve "
                                f"{f.reserve_bytes >> 20} MiB"
                                + ("; writes will fail: serving, no longer caching"
                                   if low else "")))
        if f.budget is not None:
            over = not f.budget["within_budget"]
            checks.append(Check("cache_root.budget", "degraded" if over else "ok",
                                f"{f.budget['on_disk_bytes'] >> 20} MiB on disk, limit "
                                f"{f.budget['limit_bytes'] >> 20} MiB"
                                + ("; budget exhausted: serving, no longer caching"
                                   if over else "")))
        elif f.budget_error:
            checks.append(Check("cache_root.budget", "skipped", f.budget_error))
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
    worst = max((_RANK[c.status] for c in checks), default=0)
    status = {0: "healthy", 1: "degraded", 2: "down"}[worst]
    return status, checks


def health_report(dep: Any, plan: Any, *, timeout: float = 3.0, expect_vllm: bool = True,
                  wait: float = 0.0, interval: float = 2.0) -> dict[str, Any]:
    """Probe (again until healthy or ``wait`` seconds pass) and return the JSON report."""
    deadline = time.monotonic() + max(0.0, wait)
    while True:
        facts = probe_all(dep, plan, timeout=timeout, expect_vllm=expect_vllm)
        status, checks = verdict(facts)
        if status == "healthy" or time.monotonic() >= deadline:
            break
        time.sleep(interval)
    return {
        "schema": SCHEMA,
        "config": dep.name,
        "namespace": dep.namespace,
        "status": status,
        "exit_code": EXIT[status],
        "checks": [asdict(c) for c in checks],
        "lmcache": {"pid_state": facts.server_pid_state, "pid": facts.server_pid,
                    "http": plan.server_http_url, "listen": facts.server_listen,
                    "healthy": facts.server_healthcheck},
        "vllm": {"checked": expect_vllm, "url": plan.vllm_url, "healthy": facts.vllm_health,
                 "models": facts.vllm_models},
        "cache_root": {"path": plan.cache_root, "mode": (f"{facts.root_mode:04o}"
                                                         if facts.root_mode is not None
                                                         else None),
                       "avail_bytes": facts.fs_avail_bytes,
                       "reserve_bytes": facts.reserve_bytes, "budget": facts.budget},
        "errors": facts.errors,
    }


__all__ = ["Check", "Facts", "health_report", "probe_all", "verdict", "SCHEMA", "procs"]
