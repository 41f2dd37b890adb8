"""launch / status / health / stop against a real lmcache server (no vLLM here)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from ..conftest import REPO
from ..fullstack._stack import KVP_ADMIN, Stack, wait_until

pytestmark = pytest.mark.integration


def test_launch_status_health_refuse_stop(stack: Stack) -> None:
    info = stack.launch("--no-vllm")
    pid = info["lmcache"]["pid"]
    assert stack.pid_file.read_text().strip() == str(pid)
    assert psutil.pid_exists(pid)
    # cache root and state are owner-only; the serde key is created 0600
    assert stat.S_IMODE(stack.root.stat().st_mode) == 0o700
    rendered = stack.render()
    key = Path(rendered["l2_adapter"]["serde"]["master_key_path"])
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    manifest = json.loads(Path(info["manifest"]).read_text())
    assert manifest["namespace"] == rendered["namespace"]
    # the server process runs with umask 077 (files it creates are owner-only)
    assert Path(f"/proc/{pid}/status").read_text().split("Umask:")[1].split()[0] == "0077"

    st = stack.kvp_json("status", stack.config)
    assert st["lmcache"]["state"] == "running" and st["lmcache"]["healthy"]

    h = stack.kvp("health", stack.config, "--no-vllm", "--json")
    report = json.loads(h.stdout)
    assert h.returncode == 0, report
    assert report["status"] == "healthy"
    names = {c["name"]: c["status"] for c in report["checks"]}
    assert names["lmcache.run_script"] == "ok" and names["lmcache.l2_adapter"] == "ok"
    assert all(a.startswith("127.0.0.1:") for a in report["lmcache"]["listen"])

    # with vLLM expected but absent the deployment is down (exit 2)
    assert stack.kvp("health", stack.config).returncode == 2

    # a second launch is refused clearly, and the first server is untouched
    again = stack.kvp("launch", stack.config, "--no-vllm")
    assert again.returncode == 1
    assert "already running" in again.stderr and str(pid) in again.stderr
    assert psutil.pid_exists(pid)

    # an L2 file written before stop stays after stop
    keep = stack.root / "kvp-keepme_01000100_0_ab.bin"
    keep.write_bytes(b"x")
    stopped = stack.stop()
    server = [s for s in stopped["stopped"] if s["what"] == "lmcache server"][0]
    assert server["how"] == "terminated" and server["pid"] == pid
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not stack.pid_file.exists()
    assert keep.exists()
    assert stack.kvp("status", stack.config).returncode == 1
    down = stack.kvp("health", stack.config, "--no-vllm", "--json")
    assert down.returncode == 2 and json.loads(down.stdout)["status"] == "down"


def test_stale_pid_file_of_dead_process_is_replaced(stack: Stack) -> None:
    stack.root.mkdir(mode=0o700)
    stack.pid_file.parent.mkdir(parents=True, mode=0o700)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stack.pid_file.write_text(f"{dead.pid}\n")
    r = stack.kvp("launch", stack.config, "--no-vllm")
    assert r.returncode == 0, r.stderr
    assert "stale pid file" in r.stderr and "not running" in r.stderr
    assert int(stack.pid_file.read_text()) != dead.pid


def test_recycled_pid_is_not_trusted_nor_killed(stack: Stack) -> None:
    stack.root.mkdir(mode=0o700)
    stack.pid_file.parent.mkdir(parents=True, mode=0o700)
    other = subprocess.Popen(["sleep", "120"])
    try:
        stack.pid_file.write_text(f"{other.pid}\n")
        st = stack.kvp_json("status", stack.config, check=False)
        assert st["lmcache"]["state"] == "stale"
        assert "another program" in st["lmcache"]["reason"]
        # stop must not signal the unrelated process
        stack.stop()
        assert other.poll() is None
        # launch replaces the stale pid file and starts a real server
        stack.pid_file.write_text(f"{other.pid}\n")
        info = stack.launch("--no-vllm")
        assert info["lmcache"]["pid"] != other.pid and other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_status_json_of_a_deployment_whose_ports_collide_says_why(stack: Stack) -> None:
    """Issue 26's condition through the test helper: two listeners given one port. stdout is
    the error document and the helper's assertion carries the exit code and stderr."""
    stack.env["KVP_VLLM_PORT"] = stack.env["KVP_LMCACHE_PORT"]
    with pytest.raises(AssertionError, match=r"(?s)-> 2: an error document.*stderr:.*"
                                             r"is also KVP_LMCACHE_PORT"):
        stack.kvp_json("status", stack.config, check=False)
    doc = json.loads(stack.kvp("status", stack.config, "--json").stdout)
    assert doc["schema"] == "kvpersist.error/1" and doc["exit_code"] == 2


def test_pid_recycled_after_the_pid_file_was_written(stack: Stack) -> None:
    """A process younger than the pid file cannot be the one the file recorded."""
    stack.root.mkdir(mode=0o700)
    stack.pid_file.parent.mkdir(parents=True, mode=0o700)
    stack.pid_file.write_text("1\n")  # placeholder, rewritten below with an old mtime
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                              "lmcache", "--l2-adapter", f'"file_path":"{stack.root}"'])
    try:
        stack.pid_file.write_text(f"{other.pid}\n")
        old = time.time() - 3600
        os.utime(stack.pid_file, (old, old))
        st = stack.kvp_json("status", stack.config, check=False)
        assert st["lmcache"]["state"] == "stale" and "recycled" in st["lmcache"]["reason"]
    finally:
        other.kill()
        other.wait()


def test_preflight_reports_every_problem(stack: Stack) -> None:
    stack.root.mkdir(mode=0o755)
    busy_port = int(stack.env["KVP_LMCACHE_HTTP_PORT"])
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", busy_port))
        s.listen(1)
        r = stack.kvp("launch", stack.config, "--no-vllm")
    assert r.returncode == 2, r.stderr
    assert "accessible to others" in r.stderr
    assert f"127.0.0.1:{busy_port} is already in use" in r.stderr
    assert not stack.pid_file.exists()


def test_foreground_execs_the_server_with_its_own_pid(stack: Stack) -> None:
    log = (stack.tmp / "fg.log").open("wb")
    proc = subprocess.Popen([*KVP_ADMIN, "launch", stack.config, "--foreground"],
                            env=stack.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: _ok(f"{stack.http}/healthcheck"), 90), \
            (stack.tmp / "fg.log").read_text()[-2000:]
        assert stack.pid_file.read_text().strip() == str(proc.pid)
        cmd = psutil.Process(proc.pid).cmdline()
        assert any(a.endswith("lmcache") for a in cmd[:2]) and "server" in cmd
        st = stack.kvp_json("status", stack.config)
        assert st["lmcache"]["state"] == "running" and st["lmcache"]["pid"] == proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.RequestException:
        return False


def test_stop_status_health_work_when_the_budget_became_invalid(stack: Stack) -> None:
    """An operator can always stop a deployment: stop/status/health locate it from its
    settings and never size it, so an L1 that no longer fits in RAM does not block them."""
    pid = stack.launch("--no-vllm")["lmcache"]["pid"]
    stack.env["KVP_L1_SIZE_GB"] = "100000"
    refused = stack.kvp("render", stack.config)
    assert refused.returncode == 2 and "L1" in refused.stderr  # the budget really is invalid
    st = stack.kvp_json("status", stack.config)
    assert st["lmcache"]["state"] == "running" and st["lmcache"]["pid"] == pid
    h = stack.kvp("health", stack.config, "--no-vllm", "--json")
    assert h.returncode == 0, h.stdout + h.stderr
    out = stack.kvp_json("stop", stack.config)
    assert [s["how"] for s in out["stopped"]] == ["not-running", "terminated"]
    assert wait_until(lambda: not psutil.pid_exists(pid), 10)


def test_health_holds_its_deadline_on_a_million_file_root(stack: Stack) -> None:
    """health never scans the cache root: on a root of 1,000,000 files it answers within
    its probes' timeouts, and reports the budget recorded at launch."""
    stack.launch("--no-vllm")
    ns = "kvp-00000000000000000000000000000001"
    dfd = os.open(stack.root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(1_000_000):
            os.close(os.open(f"{ns}_01000100_0_{i:016x}.bin", os.O_CREAT | os.O_WRONLY, 0o600,
                             dir_fd=dfd))
    finally:
        os.close(dfd)
    t0 = time.monotonic()
    h = stack.kvp("health", stack.config, "--no-vllm", "--json", "--timeout", "2")
    elapsed = time.monotonic() - t0
    report = json.loads(h.stdout)
    assert h.returncode == 0, report
    budget = [c for c in report["checks"] if c["name"] == "cache_root.budget"]
    assert budget and budget[0]["status"] == "ok" and "at launch" in budget[0]["detail"]
    # 4 HTTP probes of at most 2 s each bound it; a scan of 1M files alone took longer
    assert elapsed < 10, f"health took {elapsed:.1f} s on a 1M-file root"
    stack.stop()


def _second_deployment(stack: Stack, name: str = "other") -> Stack:
    """Another deployment (other namespace, other ports) on the same cache root."""
    cfg = stack.tmp / name / "identity.env"
    cfg.parent.mkdir()
    cfg.write_text((REPO / "configs/cpu-demo/identity.env").read_text()
                   .replace("KVP_MAX_MODEL_LEN=4096", "KVP_MAX_MODEL_LEN=2048"))
    other = Stack(stack.tmp, config=str(cfg.parent))
    other.root = stack.root
    other.env["KVP_CACHE_ROOT"] = str(stack.root)
    return other


def test_two_deployments_on_one_root_never_touch_each_other(stack: Stack) -> None:
    """Each deployment has its own pid file: B launches beside A, and stopping B leaves A."""
    b = _second_deployment(stack)
    try:
        pid_a = stack.launch("--no-vllm")["lmcache"]["pid"]
        info_b = b.launch("--no-vllm")
        pid_b = info_b["lmcache"]["pid"]
        assert pid_a != pid_b and info_b["namespace"] != stack.render()["namespace"]
        assert stack.pid_file != b.pid_file and b.pid_file.read_text().strip() == str(pid_b)
        assert b.kvp_json("status", b.config)["lmcache"]["pid"] == pid_b
        assert stack.kvp_json("status", stack.config)["lmcache"]["pid"] == pid_a
        out = b.stop()
        assert [s["pid"] for s in out["stopped"] if s["how"] == "terminated"] == [pid_b]
        assert wait_until(lambda: not psutil.pid_exists(pid_b), 10)
        assert psutil.pid_exists(pid_a)
        assert stack.kvp("health", stack.config, "--no-vllm").returncode == 0
    finally:
        b.cleanup()


def test_a_server_started_by_0_1_is_found_through_its_legacy_pid_file(stack: Stack) -> None:
    """0.1 kept the pid in <cache root>/lmcache-server.pid, shared by every deployment of the
    root: after an upgrade it still stops its own server, and only the one on its port."""
    b = _second_deployment(stack)
    try:
        pid_a = stack.launch("--no-vllm")["lmcache"]["pid"]
        legacy = stack.root / "lmcache-server.pid"
        stack.pid_file.rename(legacy)  # as 0.1 left it
        st = stack.kvp_json("status", stack.config)
        assert st["lmcache"]["state"] == "running" and st["lmcache"]["pid"] == pid_a
        # B (another port) must not take A's server for its own
        assert b.kvp_json("status", b.config, check=False)["lmcache"]["state"] == "absent"
        assert [s["how"] for s in b.stop()["stopped"]] == ["not-running", "not-running"]
        assert psutil.pid_exists(pid_a)
        out = stack.stop()
        assert out["stopped"][-1]["pid"] == pid_a and out["stopped"][-1]["how"] == "terminated"
        assert not legacy.exists()
    finally:
        b.cleanup()


IMPOSTOR = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"ok": True}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    do_POST = do_GET
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_health_is_not_fooled_by_another_server_on_the_admin_port(stack: Stack) -> None:
    """A plain HTTP server answering /healthcheck on the admin port while the cache server is
    down: the deployment is down (exit 2), and health names what answers there."""
    stack.root.mkdir(mode=0o700)
    port = stack.env["KVP_LMCACHE_HTTP_PORT"]
    fake = subprocess.Popen([sys.executable, "-c", IMPOSTOR, port])
    try:
        assert wait_until(lambda: _ok(f"{stack.http}/healthcheck"), 10)
        h = stack.kvp("health", stack.config, "--no-vllm", "--json")
        report = json.loads(h.stdout)
        assert h.returncode == 2 and report["status"] == "down", report
        check = [c for c in report["checks"] if c["name"] == "lmcache.healthcheck"][0]
        assert check["status"] == "down" and f"pid {fake.pid}" in check["detail"], check
    finally:
        fake.kill()
        fake.wait()


def test_health_reports_a_running_server_whose_pid_file_is_gone(stack: Stack) -> None:
    pid = stack.launch("--no-vllm")["lmcache"]["pid"]
    stack.pid_file.unlink()
    h = stack.kvp("health", stack.config, "--no-vllm", "--json")
    report = json.loads(h.stdout)
    assert h.returncode == 1 and report["status"] == "degraded", report
    check = [c for c in report["checks"] if c["name"] == "lmcache.pid_file"][0]
    assert check["status"] == "degraded" and f"pid {pid}" in check["detail"]
    os.kill(pid, 15)
    assert wait_until(lambda: not psutil.pid_exists(pid), 30)


def test_lmcache_clean_stop_never_reaches_kvpersist_state(stack: Stack) -> None:
    """Stock LMCache 0.5.6 deletes, when it stops cleanly, every entry that is no directory
    and whose name contains '.tmp.', anywhere under the cache root (``os.walk``). A launch
    refuses while files that are not LMCache's would be lost that way, naming them, unless
    the operator opts in; with the opt-in this test watches the real server delete exactly
    the files the refusal named, and leave a symlink to a directory. kvpersist keeps its
    state beside the root and names nothing it writes under the root that way (the
    quarantine renames '.tmp.'); LMCache's own leftover temp files never block a launch."""
    ns = stack.render()["namespace"]
    stack.root.mkdir(mode=0o700)
    planted = [stack.root / "notes.tmp.keep", stack.root / "sub" / "draft.tmp.1",
               stack.root / ".kvpersist" / "pins" / "x.tmp.y", stack.root / "fifo.tmp.f",
               stack.root / "link.tmp.broken"]
    for p in planted[:3]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("operator's file\n")
    os.mkfifo(planted[3], 0o600)
    planted[4].symlink_to("/nonexistent")
    (stack.root / "dirlink.tmp.d").symlink_to(stack.root / "sub")  # a directory to os.walk
    stale_temp = stack.root / f"{ns}_01000100_0_{'ab' * 8}.bin.tmp.{'cd' * 16}"
    stale_temp.write_bytes(b"\0" * 4096)  # an interrupted write, as LMCache leaves one

    check = stack.kvp("launch", stack.config, "--check", "--no-vllm")
    assert check.returncode == 2, check.stderr
    assert "5 file(s) under the cache root" in check.stderr, check.stderr
    assert all(str(p.relative_to(stack.root)) in check.stderr for p in planted)
    assert stale_temp.name not in check.stderr and "dirlink" not in check.stderr
    refused = stack.kvp("launch", stack.config, "--no-vllm")
    assert refused.returncode == 2 and "--allow-lmcache-tmp-cleanup" in refused.stderr
    assert not stack.pid_file.exists()  # nothing started
    report = json.loads(stack.kvp("report", "--root", str(stack.root), "--json").stdout)
    assert report["lmcache_deletes_at_stop"]["files"] == 5

    info = stack.launch("--no-vllm", "--allow-lmcache-tmp-cleanup")
    assert any("the next clean stop deletes them" in n for n in info["notes"]), info["notes"]
    verify = stack.kvp("verify", stack.config, "--apply", "--temp-age", "0", "--json")
    assert json.loads(verify.stdout)["quarantined"], verify.stdout + verify.stderr
    state = sorted(p.relative_to(stack.state_dir) for p in stack.state_dir.rglob("*"))
    quarantine = sorted((stack.root / ".kvpersist" / "quarantine").iterdir())
    assert len(quarantine) == 1 and ".tmp." not in quarantine[0].name
    assert not stack.state_dir.is_relative_to(stack.root)

    stack.stop()  # a clean stop: LMCache's clean-up runs
    assert not any(os.path.lexists(p) for p in planted), "LMCache deleted what launch named"
    assert (stack.root / "dirlink.tmp.d").is_symlink()
    assert sorted((stack.root / ".kvpersist" / "quarantine").iterdir()) == quarantine
    after = sorted(p.relative_to(stack.state_dir) for p in stack.state_dir.rglob("*"))
    assert [p for p in state if "pids" not in p.parts] == [p for p in after
                                                           if "pids" not in p.parts]
    assert Path(f"keys/{ns}/l2-master.key") in after and Path(f"manifests/{ns}.json") in after

    # LMCache's own leftover temp files alone (normal after a kill -9) never block a launch
    stale_temp.write_bytes(b"\0" * 4096)
    (stack.root / "dirlink.tmp.d").unlink()
    again = stack.kvp("launch", stack.config, "--check", "--no-vllm")
    assert again.returncode == 0 and "'.tmp.'" not in again.stderr, again.stderr


def test_a_0_1_state_dir_inside_the_cache_root_is_kept(stack: Stack) -> None:
    """A root where kvpersist 0.1 kept its state (no KVP_STATE_DIR): the same key and
    manifests are used (a new key would turn every chunk into a miss), with a note."""
    legacy = stack.root / ".kvpersist"
    (legacy / "keys").mkdir(parents=True)
    os.chmod(stack.root, 0o700)
    key = legacy / "keys" / "l2-master.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    rendered = stack.render()
    # the namespace's own key under the legacy state dir (launch adopts the root key there)
    assert rendered["l2_adapter"]["serde"]["master_key_path"] == str(
        legacy / "keys" / rendered["namespace"] / "l2-master.key")
    check = stack.kvp("launch", stack.config, "--check", "--no-vllm")
    assert check.returncode == 0 and "where kvpersist 0.1 kept it" in check.stderr
