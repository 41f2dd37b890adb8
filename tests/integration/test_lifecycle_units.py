"""Pure and small-I/O parts of the lifecycle layer: pid files, health verdicts, the recipe
hook's argv rewrite, the aesgcm key, verify's frame handling, the demo model's identity."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from kvpersist.deploy import hook
from kvpersist.l2 import frames
from kvpersist.l2.keys import store as keys
from kvpersist.l2.verify import root as verify
from kvpersist.stack import health
from kvpersist.system import procs

from ..model_dirs import plain_dir

REPO = Path(__file__).resolve().parent.parent.parent


# ----------------------------------------------------------------------------- procs
def test_read_pid_file(tmp_path: Path) -> None:
    p = tmp_path / "x.pid"
    assert procs.read_pid_file(p) is None
    for text, want in [("123\n", 123), ("  77 ", 77), ("", None), ("abc", None), ("-4", None),
                       ("0", None)]:
        p.write_text(text)
        assert procs.read_pid_file(p) == want
    procs.write_pid_file(p, 4242)
    assert p.read_text() == "4242\n"
    procs.remove_pid_file(p, pid=1)  # records another pid: kept
    assert p.exists()
    procs.remove_pid_file(p, pid=4242)
    assert not p.exists()


def test_cmdline_matches() -> None:
    argv = ["/v/bin/lmcache", "server", "--l2-adapter", '{"file_path":"/c"}']
    assert procs.cmdline_matches(argv, ["lmcache", '"file_path":"/c"'])
    assert not procs.cmdline_matches(argv, ["lmcache", '"file_path":"/d"'])
    ported = [*argv, "--port", "5555", "--http-port=8080"]
    assert procs.cmdline_matches(ported, ["lmcache"], [("--port", "5555")])
    assert procs.cmdline_matches(ported, ["lmcache"], [("--http-port", "8080")])
    assert not procs.cmdline_matches(ported, ["lmcache"], [("--port", "5556")])
    assert not procs.cmdline_matches(ported, ["lmcache"], [("--port", "555")])
    assert not procs.cmdline_matches([*argv, "--port"], ["lmcache"], [("--port", "5555")])


def test_check_pid_file_states(tmp_path: Path) -> None:
    p = tmp_path / "s.pid"
    assert procs.check_pid_file(p, ["x"]).state == "absent"
    p.write_text("garbage")
    assert procs.check_pid_file(p, ["x"]).state == "stale"
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                             "marker-xyz"])
    try:
        procs.write_pid_file(p, proc.pid)
        assert procs.check_pid_file(p, ["python", "marker-xyz"]).running
        st = procs.check_pid_file(p, ["lmcache"])
        assert st.state == "stale" and "another program" in st.reason
        res = procs.stop_process(proc.pid, timeout=5)
        assert res.how == "terminated"
    finally:
        proc.kill()
        proc.wait()
    assert procs.check_pid_file(p, ["python"]).state == "stale"


def test_stop_process_escalates_to_sigkill(tmp_path: Path) -> None:
    proc = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 30"])
    try:
        import time

        time.sleep(0.3)
        res = procs.stop_process(proc.pid, timeout=1)
        assert res.how == "killed"
    finally:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------- health
def _facts(**kw: object) -> health.Facts:
    f = health.Facts(server_healthcheck=True, run_script_code=404, root_exists=True,
                     root_mode=0o700, root_writable=True, fs_avail_bytes=10 << 30,
                     reserve_bytes=1 << 30, vllm_health=True, served_model_name="m",
                     namespace="kvp-" + "a" * 32, lmcache_port=5555,
                     server_status={"storage_manager": {"l2_adapters": [
                         {"type": "DynamicNixlStoreL2Adapter", "is_healthy": True,
                          "event_loop_alive": True, "stored_object_count": 3}]}},
                     budget={"on_disk_bytes": 1, "own_bytes": 1, "limit_bytes": 10,
                             "l2_max_capacity_bytes": 10, "within_budget": True})
    f.vllm_models = [{"id": "m", "root": "kvp-" + "a" * 32}]
    for k, v in kw.items():
        setattr(f, k, v)
    return f


@pytest.mark.parametrize("change,status", [
    ({}, "healthy"),
    ({"server_healthcheck": False}, "degraded"),  # vLLM serves without the cache
    ({"server_healthcheck": False, "vllm_health": False}, "down"),
    ({"server_healthcheck": False, "expect_vllm": False}, "down"),
    ({"vllm_health": False}, "down"),
    ({"run_script_code": 422}, "degraded"),
    ({"root_mode": 0o755}, "degraded"),
    ({"fs_avail_bytes": 1}, "degraded"),
    ({"budget": {"on_disk_bytes": 20, "own_bytes": 20, "limit_bytes": 10,
                 "l2_max_capacity_bytes": 10, "within_budget": False}}, "degraded"),
    ({"vllm_models": [{"id": "m", "root": "/models/x"}]}, "degraded"),
    ({"vllm_models": [{"id": "other", "root": "x"}]}, "down"),
    ({"vllm_kv_checked": True, "vllm_kv_port": 9999}, "degraded"),
    ({"server_listen": ["0.0.0.0:5555"], "configured_hosts": ["127.0.0.1", "127.0.0.1"]},
     "degraded"),
    # a non-loopback address the deployment does not bind: reachable without an opt-in
    ({"server_listen": ["127.0.0.1:5555", "10.0.0.5:8080"],
      "configured_hosts": ["127.0.0.1", "127.0.0.1"]}, "degraded"),
    ({"server_listen": [":::8080"], "configured_hosts": ["127.0.0.1", "0.0.0.0"]},
     "degraded"),
    ({"server_listen": ["0.0.0.0:5555", "127.0.0.1:8080", "127.0.0.1:40001"],
      "configured_hosts": ["0.0.0.0", "127.0.0.1"]}, "healthy"),
    ({"root_exists": False}, "down"),
    # something else answers /healthcheck on the admin port
    ({"http_listener_ours": False, "http_listener_pid": 42, "expect_vllm": False}, "down"),
    ({"http_listener_ours": False, "http_listener_pid": 42}, "degraded"),
    ({"server_status": None, "expect_vllm": False}, "down"),
    ({"server_status": {"ok": True}, "expect_vllm": False}, "down"),
    # the server runs, but stop could not find it
    ({"http_listener_ours": True, "http_listener_pid": 42, "server_pid_state": "absent"},
     "degraded"),
    ({"http_listener_ours": True, "http_listener_pid": 42, "server_pid_state": "running"},
     "healthy"),
])
def test_health_verdict(change: dict[str, object], status: str) -> None:
    got, checks = health.verdict(_facts(**change))
    assert got == status, checks
    assert health.EXIT[got] == {"healthy": 0, "degraded": 1, "down": 2}[status]


def test_health_shows_every_opted_in_remote_bind() -> None:
    """An opted-in non-loopback bind is not a fault (health stays 0) but never silent: each
    gets a check line naming the address, the peers and the key that allowed it."""
    binds = [{"component": "lmcache_http", "allow_key": "KVP_ALLOW_REMOTE_LMCACHE_HTTP",
              "detail": "HTTP admin on 0.0.0.0:8080 is NOT loopback"},
             {"component": "vllm", "allow_key": "KVP_ALLOW_REMOTE_VLLM",
              "detail": "vLLM on 0.0.0.0:8000 is NOT loopback"}]
    status, checks = health.verdict(_facts(remote_binds=binds))
    assert status == "healthy"
    shown = {c.name: c for c in checks if c.name.startswith("network.")}
    assert sorted(shown) == ["network.lmcache_http", "network.vllm"]
    assert all(c.status == "ok" and "NOT loopback" in c.detail for c in shown.values())
    _, checks = health.verdict(_facts(remote_binds=binds, expect_vllm=False))
    assert [c.name for c in checks if c.name.startswith("network.")] == ["network.lmcache_http"]


# ----------------------------------------------------------------------------- hook
RENDERED = {
    "namespace": "kvp-" + "b" * 32,
    "model_link": {"dir": "/s/models", "name": "kvp-" + "b" * 32, "target": "/models/x"},
    "manifest": {"deployment": {"served_model_name": "pub"}},
    "kv_transfer_config": {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"},
}


def test_hook_rewrites_exactly_the_persistence_arguments() -> None:
    ktc = json.dumps(RENDERED["kv_transfer_config"], sort_keys=True, separators=(",", ":"))
    ns = RENDERED["namespace"]
    assert hook.persist_argv(["vllm", "serve", "/models/x", "--tp", "4"], RENDERED) == [
        "vllm", "serve", ns, "--tp", "4", "--served-model-name", "pub",
        "--kv-transfer-config", ktc]
    assert hook.persist_argv(["python", "-m", "v", "--model=/models/x/",
                              "--served-model-name", "mine"], RENDERED) == [
        "python", "-m", "v", f"--model={ns}", "--served-model-name", "mine",
        "--kv-transfer-config", ktc]


@pytest.mark.parametrize("argv,msg", [
    (["vllm", "serve", "/models/other"], "KVP_MODEL_PATH"),
    (["vllm", "serve", "/models/x", "--kv-transfer-config", "{}"], "already sets"),
    (["python", "-m", "x", "--port", "1"], "cannot find the model"),
])
def test_hook_refuses(argv: list[str], msg: str) -> None:
    with pytest.raises(hook.HookError, match=msg):
        hook.persist_argv(argv, RENDERED)


def test_hook_script_without_kv_persist_changes_nothing(tmp_path: Path) -> None:
    script = f"""
source {REPO}/scripts/kv-persist-hook.sh
CMD=(vllm serve '/m/a b' --x "q'uote" '')
kvp_persist_apply CMD
printf '%s\\0' "${{CMD[@]}}"
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, check=True,
                         env={"PATH": os.environ["PATH"]})
    assert out.stdout == b"vllm\0serve\0/m/a b\0--x\0q'uote\0\0"


# ----------------------------------------------------------------------------- keys
def test_key_created_owner_only_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "state" / "keys" / "k"
    a = keys.ensure_key(path)
    assert a.created and len(path.read_bytes()) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    b = keys.ensure_key(path)
    assert not b.created and b.fingerprint == a.fingerprint
    assert path.read_bytes().hex() not in a.fingerprint
    path.chmod(0o644)
    with pytest.raises(keys.KeyError_, match="chmod 600"):
        keys.ensure_key(path)


# ----------------------------------------------------------------------------- verify
def test_frame_authentication_roundtrip() -> None:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    master = os.urandom(32)
    dek = frames._derive(master, "", 16)
    plain = os.urandom(5000)
    iv = os.urandom(12)
    frame = bytes([1]) + iv + AESGCM(dek).encrypt(iv, plain, None)
    blob = frame + b"\0" * (-len(frame) % 4096)
    assert frames.authenticate(blob, dek, None) == 5000
    assert frames.authenticate(blob, dek, 5000) == 5000
    bad = bytearray(blob)
    bad[100] ^= 1
    assert frames.authenticate(bytes(bad), dek, None) is None
    assert frames.authenticate(blob, frames._derive(os.urandom(32), "", 16), None) is None
    assert verify.expected_sizes({("p", 1): [5, 5, 3]}) == {("p", 1): 5}


# ----------------------------------------------------------------------------- demo model
def test_demo_identity_matches_the_shipped_config() -> None:
    from kvpersist.demo.model import CHAT_TEMPLATE, SPECS, identity_env_values

    tpl = (REPO / "configs" / "cpu-demo" / "chat_template.jinja").read_text().rstrip("\n")
    assert tpl == CHAT_TEMPLATE
    env = dict(line.split("=", 1) for line in
               (REPO / "configs" / "cpu-demo" / "identity.env").read_text().splitlines()
               if line and not line.startswith("#"))
    mine = identity_env_values("tiny")
    assert mine == {k: v for k, v in env.items() if k in mine}
    assert len(mine) == 14
    assert 170e6 < SPECS["bench"].param_count() < 200e6


def test_run_vllm_with_persist_script_execs_rendered_args(tmp_path: Path) -> None:
    """The launcher script asks `kvp-admin render --json` (never sources identity.env), links
    the namespace to the weights and execs vLLM there with the rendered arguments."""
    import sys

    real = sys.executable
    fake = tmp_path / "python"
    out = tmp_path / "exec.txt"
    fake.write_text(f"""#!/bin/bash
if [ "$1" = "-m" ]; then printf '%s\\0' "$PWD" "$@" > {out}; exit 0; fi
exec {real} "$@"
""")
    fake.chmod(0o755)
    admin = tmp_path / "kvp-admin"
    admin.write_text(f"#!/bin/bash\nexec {real} -m kvpersist.cli \"$@\"\n")
    admin.chmod(0o755)
    model = plain_dir(tmp_path / "weights")  # the demo model's config and template
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env.update(KVP_CACHE_ROOT=str(tmp_path / "cache"), KVP_MODEL_PATH=str(model),
               KVP_ADMIN=str(admin), KVP_PYTHON=str(fake), PYTHONPATH=str(REPO),
               KVP_WARMUP="0")  # the readiness step: the next test
    subprocess.run(["bash", str(REPO / "scripts" / "run-vllm-with-persist.sh"), "cpu-demo",
                    "--extra"], env=env, check=True, cwd=tmp_path, capture_output=True)
    got = out.read_bytes().split(b"\0")[:-1]
    rendered = json.loads(subprocess.run([real, "-m", "kvpersist.cli", "render", "cpu-demo",
                                          "--json"], env=env, check=True, cwd=REPO,
                                         capture_output=True).stdout)
    cwd, argv = got[0].decode(), [a.decode() for a in got[1:]]
    assert cwd == rendered["model_link"]["dir"]
    assert argv == ["-m", "vllm.entrypoints.openai.api_server", *rendered["vllm_argv"],
                    "--extra"]
    link = Path(cwd) / rendered["namespace"]
    assert link.is_symlink() and link.resolve() == model.resolve()


def test_run_vllm_with_persist_script_starts_the_readiness_step(tmp_path: Path) -> None:
    """Right before the exec the script starts `kvp-admin launch CONFIG --warmup-only`
    detached (its output in the warm-up log): here vLLM never comes (the exec'd "python"
    exits at once), so within its 1 s deadline the step gives up without a warm-up. With
    KVP_WARMUP=0 (the systemd unit, whose ExecStartPost runs the step) it starts nothing."""
    import sys

    from kvpersist.config.loader import load_deployment
    from kvpersist.stack.locate import locate

    real = sys.executable
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
if [ "$1" = "-m" ]; then exit 0; fi
exec {real} "$@"
""")
    fake.chmod(0o755)
    admin = tmp_path / "kvp-admin"
    admin.write_text(f"#!/bin/bash\nexec {real} -m kvpersist.cli \"$@\"\n")
    admin.chmod(0o755)
    model = plain_dir(tmp_path / "weights")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env.update(KVP_CACHE_ROOT=str(tmp_path / "cache"), KVP_MODEL_PATH=str(model),
               KVP_ADMIN=str(admin), KVP_PYTHON=str(fake), PYTHONPATH=str(REPO),
               KVP_VLLM_PORT=str(procs.free_port()), KVP_READY_DEADLINE="1",
               KVP_WARMUP_FILE=str(tmp_path / "warm.jsonl"))
    (tmp_path / "warm.jsonl").write_text('{"prompt": "You are a helpful assistant."}\n')
    log = Path(locate(load_deployment("cpu-demo", env, allow_unpinned=True)).warmup_log)
    log.parent.mkdir(parents=True, mode=0o700)
    for warmup, expect_step in (("0", False), ("1", True)):
        run_env = dict(env, KVP_WARMUP=warmup)
        subprocess.run(["bash", str(REPO / "scripts" / "run-vllm-with-persist.sh"),
                        "cpu-demo"], env=run_env, check=True, cwd=tmp_path,
                       capture_output=True, timeout=120)
        deadline = time.monotonic() + (60 if expect_step else 5)
        while time.monotonic() < deadline and "no warm-up" not in _text(log):
            time.sleep(0.2)
        assert ("vLLM did not serve the namespace within 1 s: no warm-up" in _text(log)) \
            == expect_step, _text(log)
    assert "waiting for vLLM" in _text(log)


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""
