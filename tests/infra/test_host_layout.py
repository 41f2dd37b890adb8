"""testinfra checks of a host converged by the kvp role.

They use only testinfra's ``host`` fixture, so the same checks run against the local
converge (default) and against a real host (``--hosts ssh://... --kvp-vars FILE``).
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from typing import Any

import pytest

pytestmark = pytest.mark.deploy

UNITS = ("kvp-lmcache@.service", "kvp-vllm@.service", "kvp-health@.service",
         "kvp-health@.timer", "kvp-scrub@.service", "kvp-scrub@.timer")


def _env_file(text: str) -> dict[str, str]:
    values = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        if len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1]
        values[key] = value
    return values


def test_service_user_is_unprivileged(host, kvp_layout):
    user = host.user(kvp_layout.user)
    assert user.exists
    assert user.uid != 0
    assert user.uid < 1000, "a system account is expected"
    assert user.group == kvp_layout.group
    assert user.shell in ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false")
    assert host.group(kvp_layout.group).exists


@pytest.mark.parametrize("kind", ["cache_root", "state_dir", "log_dir"])
def test_data_dirs_are_owner_only(host, kvp_layout, kind):
    assert kvp_layout.deployments, "no deployment in kvp_deployments"
    for dep in kvp_layout.deployments:
        d = host.file(getattr(dep, kind))
        assert d.is_directory, d.path
        assert d.user == kvp_layout.user, d.path
        assert d.group == kvp_layout.group, d.path
        assert d.mode == 0o700, f"{d.path}: {oct(d.mode)}"


def test_identity_env_is_group_readable_data(host, kvp_layout):
    for dep in kvp_layout.deployments:
        cfg = host.file(dep.config_dir)
        assert cfg.is_directory and cfg.user == "root" and cfg.group == kvp_layout.group
        assert cfg.mode == 0o750
        f = host.file(dep.identity_env)
        assert f.is_file
        assert (f.user, f.group, f.mode) == ("root", kvp_layout.group, 0o640)
        text = f.content_string
        assert text.startswith("#"), "identity.env must start with the managed-file stamp"
        assert _env_file(text) == dep.env


def test_identity_env_is_accepted_by_kvp_admin(host, kvp_layout):
    for dep in kvp_layout.deployments:
        out = host.run(f"{kvp_layout.kvp_admin} identity show {dep.identity_env} --json")
        assert out.rc == 0, out.stderr
        shown = json.loads(out.stdout)
        assert json.dumps(shown).count("kvp-") >= 1  # carries the namespace
        ns = host.run(f"{kvp_layout.kvp_admin} identity namespace {dep.identity_env}")
        assert ns.rc == 0 and ns.stdout.strip().startswith("kvp-"), ns.stderr


def test_deployments_have_distinct_namespaces(host, kvp_layout):
    names = set()
    for dep in kvp_layout.deployments:
        out = host.run(f"{kvp_layout.kvp_admin} identity namespace {dep.identity_env}")
        names.add(out.stdout.strip())
    assert len(names) == len(kvp_layout.deployments)


def test_kvp_admin_runs_from_the_venv(host, kvp_layout):
    out = host.run(f"{kvp_layout.kvp_admin} --version")
    assert out.rc == 0, out.stderr
    assert "kvp-admin" in out.stdout
    assert host.run(f"{kvp_layout.kvp_admin} --help").rc == 0


def test_units_installed(host, kvp_layout):
    for unit in UNITS:
        f = host.file(f"{kvp_layout.systemd_dir}/{unit}")
        assert f.is_file, f.path
        assert (f.user, f.mode) == ("root", 0o644)
    lmcache = host.file(f"{kvp_layout.systemd_dir}/kvp-lmcache@.service").content_string
    admin = kvp_layout.kvp_admin
    cfg = kvp_layout.config_dir
    assert f"ExecStart={admin} launch {cfg}/%i/identity.env --foreground --no-vllm" in lmcache
    assert f"ExecStartPre={admin} launch {cfg}/%i/identity.env --check --no-vllm" in lmcache
    assert f"User={kvp_layout.user}\n" in lmcache
    for line in ("UMask=0077", "ProtectSystem=strict", "NoNewPrivileges=yes", "PrivateTmp=yes",
                 "CapabilityBoundingSet=\n", "SystemCallFilter=@system-service"):
        assert line in lmcache, line
    vllm = host.file(f"{kvp_layout.systemd_dir}/kvp-vllm@.service").content_string
    assert "After=network-online.target docker.service kvp-lmcache@%i.service" in vllm
    settings = [ln for ln in vllm.splitlines() if ln and not ln.startswith("#")]
    for line in settings:
        assert not line.startswith(("Requires=kvp-lmcache", "BindsTo=", "PartOf=",
                                    "Requisite=")), f"vLLM must not be bound: {line}"
    for unit in UNITS:
        text = host.file(f"{kvp_layout.systemd_dir}/{unit}").content_string
        for line in text.splitlines():
            if line.startswith("Exec"):
                # nothing deletes by itself; the one --apply is the padding scrub, which
                # only zeroes the bytes after authenticated frames (docs/padding-scrub.md)
                assert "prune" not in line, line
                assert "--apply" not in line or (
                    unit == "kvp-scrub@.service" and " scrub " in line), line


def test_units_enabled_and_timers_scheduled(host, kvp_layout):
    """Where the role manages the services (systemd is PID 1), each deployment's cache server
    (and its vLLM unit, where it has one) is enabled and running, and each timer the role
    installs is enabled, active and has a next run; where it does not (kvp_manage_services:
    false), the role enabled nothing."""
    if not kvp_layout.manage_services:
        wants = host.run(f"find {shlex.quote(kvp_layout.systemd_dir)} -path '*.wants/kvp-*'")
        assert wants.rc == 0 and wants.stdout.strip() == "", wants.stdout + wants.stderr
        return
    assert kvp_layout.timers, "the role enables the health and scrub timers by default"
    for dep in kvp_layout.deployments:
        services = [f"kvp-lmcache@{dep.name}.service"]
        if dep.vllm:
            services.append(f"kvp-vllm@{dep.name}.service")
        for unit in services:
            svc = host.service(unit)
            assert svc.is_enabled and svc.is_running, unit
        for kind in kvp_layout.timers:
            timer = f"kvp-{kind}@{dep.name}.timer"
            assert host.service(timer).is_enabled, timer
            # while the timer's service runs (it just fired) systemd shows no next elapse
            # ("infinity") until the run ends: ask again for up to a minute
            for _ in range(30):
                shown = dict(line.split("=", 1) for line in host.check_output(
                    f"systemctl show {timer} -p ActiveState -p NextElapseUSecMonotonic "
                    "-p NextElapseUSecRealtime").splitlines() if "=" in line)
                nexts = [shown.get("NextElapseUSecMonotonic", ""),
                         shown.get("NextElapseUSecRealtime", "")]
                if any(n and n not in ("infinity", "0", "n/a") for n in nexts):
                    break
                time.sleep(2)
            assert shown["ActiveState"] == "active", (timer, shown)
            assert any(n and n not in ("infinity", "0", "n/a") for n in nexts), (timer, shown)


def test_dropins_name_only_the_cache_root(host, kvp_layout):
    for dep in kvp_layout.deployments:
        f = host.file(f"{kvp_layout.systemd_dir}/kvp-lmcache@{dep.name}.service.d/"
                      "10-kvpersist.conf")
        assert f.is_file and f.mode == 0o644
        rw = [ln for ln in f.content_string.splitlines() if ln.startswith("ReadWritePaths=")]
        assert rw == [f"ReadWritePaths={dep.cache_root}"]


def test_no_prune_timer(host, kvp_layout):
    listing = host.run(f"ls {shlex.quote(kvp_layout.systemd_dir)}").stdout.split()
    assert not [u for u in listing if "prune" in u]
    health = host.file(f"{kvp_layout.systemd_dir}/kvp-health@.service").content_string
    exec_lines = [ln for ln in health.splitlines() if ln.startswith("Exec")]
    assert exec_lines and all((" health " in ln or " metrics " in ln) and "--apply" not in ln
                              and " prune " not in ln for ln in exec_lines)


def test_metrics_textfile_dir_is_writable_by_the_service_group(host, kvp_layout):
    d = host.file(kvp_layout.metrics_textfile_dir)
    assert d.is_directory and d.group == kvp_layout.group and d.mode & 0o070 == 0o070
    assert d.mode & 0o002 == 0, "never world-writable"
    health = host.file(f"{kvp_layout.systemd_dir}/kvp-health@.service").content_string
    assert f"ReadWritePaths=-{kvp_layout.metrics_textfile_dir}" in health.splitlines()


# --------------------------------------------------------------------------- live server


def _unit_settings(host, layout, name: str, unit: str = "kvp-lmcache") -> dict[str, list[str]]:
    """Settings of <unit>@name.service (unit + drop-in), %i expanded."""
    settings: dict[str, list[str]] = {}
    for path in (f"{layout.systemd_dir}/{unit}@.service",
                 f"{layout.systemd_dir}/{unit}@{name}.service.d/10-kvpersist.conf"):
        for line in host.file(path).content_string.splitlines():
            if not line or line.startswith(("#", "[")) or "=" not in line:
                continue
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value.replace("%i", name))
    return settings


@dataclass
class Server:
    """The cache server under test and how it was started."""

    dep: Any
    run_as: str
    healthy: bool
    log: str | None = None
    pre: Any = None

    def log_tail(self, host) -> str:
        return host.run(f"tail -n 40 {shlex.quote(self.log)}").stdout if self.log else ""


def _wait_http(host, layout, dep, seconds: float = 90) -> bool:
    port = dep.env.get("KVP_LMCACHE_HTTP_PORT", "8080")
    probe = (f"{layout.venv}/bin/python -c \"import urllib.request,sys;"
             f"sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:{port}/healthcheck',"
             f"timeout=2).status==200 else 1)\"")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if host.run(probe).rc == 0:
            return True
        time.sleep(1)
    return False


@pytest.fixture(scope="module")
def cache_server(host, kvp_layout):
    """A running cache server of the first deployment, started the way its unit does.

    On a host where systemd manages it (kvp_manage_services), the running unit is used.
    Otherwise (CI: systemd is not PID 1) the unit is emulated: its ExecStartPre= and then
    its ExecStart= command lines run with its UMask=, WorkingDirectory= and Environment=
    and, when that user can run the venv, its User=/Group= (the CI venv lives under a
    root-only directory, so there it runs as root); ``kvp-admin stop`` ends it afterwards.
    """
    dep = kvp_layout.deployments[0]
    if kvp_layout.manage_services:
        assert host.service(f"kvp-lmcache@{dep.name}").is_running
        yield Server(dep, kvp_layout.user, _wait_http(host, kvp_layout, dep, 30))
        return
    unit = _unit_settings(host, kvp_layout, dep.name)
    user, group = unit["User"][0], unit["Group"][0]
    env = " ".join(shlex.quote(e) for e in unit.get("Environment", []))

    def wrapper(drop: str) -> str:
        return (f"cd {shlex.quote(unit['WorkingDirectory'][0])} && umask {unit['UMask'][0]} "
                f"&& exec {drop}env -i PATH=/usr/bin:/bin {env} ")

    as_user = wrapper(f"setpriv --reuid={user} --regid={group} --clear-groups ")
    if host.run(f"sh -c {shlex.quote(as_user + kvp_layout.kvp_admin + ' --version')}").rc:
        user, as_user = "root", wrapper("")
    pre = host.run(f"sh -c {shlex.quote(as_user + unit['ExecStartPre'][0])}")
    log = f"{dep.log_dir}/unit-emulation.log"
    start = (f"setsid sh -c {shlex.quote(as_user + unit['ExecStart'][0])} "
             f"> {shlex.quote(log)} 2>&1 < /dev/null &")
    started = host.run(f"sh -c {shlex.quote(start)}")
    assert started.rc == 0, started.stderr
    try:
        yield Server(dep, user, _wait_http(host, kvp_layout, dep), log, pre)
    finally:
        stop = f"{kvp_layout.kvp_admin} stop {dep.identity_env} --no-vllm"
        host.run(f"sh -c {shlex.quote(as_user + stop)}")


def test_cache_server_listens_on_loopback_only(host, kvp_layout, cache_server):
    srv = cache_server
    assert srv.healthy, "cache server not healthy in time; log:\n" + srv.log_tail(host)
    # the generic config's ports where the deployment sets none
    ports = {srv.dep.env.get("KVP_LMCACHE_PORT", "5555"),
             srv.dep.env.get("KVP_LMCACHE_HTTP_PORT", "8080")}
    for port in ports:
        assert host.socket(f"tcp://127.0.0.1:{port}").is_listening, port
        assert not host.socket(f"tcp://0.0.0.0:{port}").is_listening, port
        assert not host.socket(f"tcp://:::{port}").is_listening, port
    for line in host.run("ss -Htln").stdout.splitlines():
        local = line.split()[3]
        if local.rsplit(":", 1)[-1] in ports:
            assert local.startswith("127.0.0.1:"), line


def test_cache_server_pid_file_in_state_dir(host, kvp_layout, cache_server):
    srv = cache_server
    assert srv.healthy, srv.log_tail(host)
    pid_file = host.file(f"{srv.dep.state_dir}/pids/{srv.dep.name}.lmcache.pid")
    assert pid_file.is_file
    assert pid_file.user == srv.run_as
    pid = int(pid_file.content_string.split()[0])
    assert host.process.get(pid=pid).user == srv.run_as
    if kvp_layout.manage_services:
        assert srv.run_as == kvp_layout.user


def test_cache_server_files_are_owner_only(host, kvp_layout, cache_server):
    srv = cache_server
    assert srv.healthy, srv.log_tail(host)
    dirs = " ".join(shlex.quote(d) for d in (srv.dep.cache_root, srv.dep.state_dir))
    # a symbolic link's own mode means nothing (the namespace's link to the weights)
    loose = host.run(f"find {dirs} ! -type l -perm /077 -print")
    assert loose.rc == 0, loose.stderr
    assert loose.stdout.strip() == "", f"group/other-accessible files:\n{loose.stdout}"
    foreign = host.run(f"find {dirs} -mindepth 1 ! -user {srv.run_as} -printf '%u %p\\n'")
    # ... but the model-link directory: whoever starts vLLM makes it, and the vLLM unit runs
    # as root (docs/deployment.md, "The vLLM unit"); root's, owner-only, and nothing else
    links = srv.dep.env.get("KVP_MODEL_LINK_DIR", f"{srv.dep.state_dir}/models")
    # ... and the canary's directory, the service user's whoever runs the server here: the
    # health unit (User=) writes the canary's record there (docs/canary.md)
    canary = f"{srv.dep.state_dir}/canary"
    others = [line for line in foreign.stdout.splitlines()
              if not (srv.dep.vllm and kvp_layout.manage_services
                      and line.split(" ", 1)[1].startswith(links)
                      and line.split(" ", 1)[0] == "root")
              and line != f"{kvp_layout.user} {canary}"]
    assert others == [], foreign.stdout


def test_health_is_zero(host, kvp_layout, cache_server):
    srv = cache_server
    assert srv.healthy, srv.log_tail(host)
    out = host.run(f"{kvp_layout.kvp_admin} health {srv.dep.identity_env} "
                   "--no-vllm --wait 60 --json")
    assert out.rc == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["status"] == "healthy"


def test_health_timer_unit_writes_the_metrics(host, kvp_layout, cache_server):
    """The health unit's metrics ExecStart=, run with its Environment= (and as its user where
    that user can run the venv), writes the deployment's and its root's textfiles, readable
    by node_exporter, with the live server healthy."""
    srv = cache_server
    unit = _unit_settings(host, kvp_layout, srv.dep.name, "kvp-health")
    [metrics_line] = [ln for ln in unit["ExecStart"] if " metrics " in ln]
    env = dict(e.split("=", 1) for e in unit.get("Environment", []))
    cmd = metrics_line.lstrip("-").replace("$KVP_HEALTH_ARGS", env.get("KVP_HEALTH_ARGS", ""))
    drop = ("" if srv.run_as == "root" else
            f"setpriv --reuid={unit['User'][0]} --regid={unit['Group'][0]} --clear-groups ")
    umask = unit["UMask"][0]
    out = host.run("sh -c " + shlex.quote(f"umask {umask} && {drop}{cmd}"))
    assert out.rc == 0, out.stdout + out.stderr
    tf = kvp_layout.metrics_textfile_dir
    dep_file = host.file(f"{tf}/kvpersist-deployment-{srv.dep.name}.prom")
    assert dep_file.is_file and dep_file.mode == 0o644
    text = dep_file.content_string
    assert f'kvpersist_deployment_health{{config="{srv.dep.name}"' in text
    health = [ln for ln in text.splitlines() if ln.startswith("kvpersist_deployment_health{")]
    assert health and health[0].endswith(" 0.0"), text
    roots = host.run(f"ls {shlex.quote(tf)}").stdout.split()
    assert [r for r in roots if r.startswith("kvpersist-root-") and r.endswith(".prom")]


def test_exec_start_pre_preflight_passes(host, kvp_layout, cache_server):
    """The unit's ExecStartPre= (preflight) passed before the server started."""
    srv = cache_server
    if srv.pre is None:  # systemd ran the unit: it is only running if ExecStartPre= passed
        assert host.service(f"kvp-lmcache@{srv.dep.name}").is_running
        return
    assert srv.pre.rc == 0, srv.pre.stdout + srv.pre.stderr


def test_shared_tier_secrets_are_owner_only_files(host, kvp_layout):
    """The vaulted shared-tier password and fleet serde key land only in files of the service
    user, mode 0600; identity.env names the tier and the secret file, never the password."""
    import base64

    shared = [d for d in kvp_layout.deployments if d.shared_password]
    assert shared or not kvp_layout.local_converge
    for dep in shared:
        secret = host.file(dep.env["KVP_SHARED_TIER_SECRET_FILE"])
        assert (secret.user, secret.group, secret.mode) == (kvp_layout.user, kvp_layout.group,
                                                            0o600)
        assert f"password={dep.shared_password}\n" in secret.content_string
        assert dep.shared_password not in host.file(dep.identity_env).content_string
        if dep.serde_key_b64:
            key = host.file(f"{dep.state_dir}/keys/l2-master.key")
            assert (key.user, key.mode) == (kvp_layout.user, 0o600)
            assert key.content == base64.b64decode(dep.serde_key_b64)
        for ns, b64 in dep.serde_keys:  # per-namespace keys (docs/keys-and-shred.md)
            kdir = host.file(f"{dep.state_dir}/keys/{ns}")
            assert (kdir.user, kdir.mode) == (kvp_layout.user, 0o700)
            key = host.file(f"{dep.state_dir}/keys/{ns}/l2-master.key")
            assert (key.user, key.mode) == (kvp_layout.user, 0o600)
            assert key.content == base64.b64decode(b64)
