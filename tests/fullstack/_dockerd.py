"""A private docker daemon for one test module, started without systemd.

``private_dockerd()`` starts Debian's ``dockerd`` (``docker.io``, ``scripts/setup.sh``) on a
temp directory of its own: data root, exec root, unix socket, pid file, an empty config file
(the host's ``/etc/docker/daemon.json`` is not read), its own containerd namespaces and cgroup
parent, no bridge and no iptables rules (containers use ``--network host``, as the rendered
argv does; no traffic leaves loopback). The docker client is pointed at it through
``DOCKER_HOST`` (and ``DOCKER_CONFIG``, a fresh client config) in :attr:`Dockerd.env`.

On the way out, whatever happened: its containers are removed, the daemon is stopped
(SIGTERM, then SIGKILL of what still names the temp directory), the mounts it left under the
temp directory are unmounted, its cgroups and the run directories it created are removed,
then the temp directory itself.

Settings that work on these hosts (Debian bookworm, cgroup v1 hybrid layout, no systemd as
PID 1): docker.io 20.10 with the ``cgroupfs`` cgroup driver, ``overlay2`` storage and the
default ``runc`` runtime; no default ulimits are set (podman needed ``default_ulimits = []``,
dockerd sets none unless told to).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

#: directories outside its temp directory that dockerd and its containerd create by
#: themselves (plugin discovery, shim sockets, dockerd 20.10's trust key without
#: ``deprecated-key-path``): removed at the end when they did not exist before and are empty
RUN_DIRS = ("/run/docker/plugins", "/run/docker", "/run/containerd/s", "/run/containerd")


class DockerdError(RuntimeError):
    """The private dockerd could not be started (the message says why, with its log)."""


def dockerd_flags(tmp: Path, tag: str) -> list[str]:
    """The daemon's argv after ``dockerd`` (everything under ``tmp``; ``tag`` names its
    containerd namespaces and its cgroup parent)."""
    return [
        "--config-file", str(tmp / "daemon.json"),
        "--data-root", str(tmp / "data"),
        "--exec-root", str(tmp / "exec"),
        "--host", f"unix://{tmp / 'docker.sock'}",
        "--pidfile", str(tmp / "docker.pid"),
        "--containerd-namespace", tag,
        "--containerd-plugins-namespace", f"{tag}-plugins",
        "--cgroup-parent", f"/{tag}",
        "--exec-opt", "native.cgroupdriver=cgroupfs",
        "--storage-driver", "overlay2",
        "--bridge", "none",
        "--iptables=false",
        "--ip6tables=false",
        "--ip-masq=false",
        "--userland-proxy=false",
        "--log-level", "warn",
    ]


@dataclass
class Dockerd:
    tmp: Path
    tag: str
    proc: subprocess.Popen[bytes]
    #: os.environ plus DOCKER_HOST and DOCKER_CONFIG: what a docker client needs
    env: dict[str, str]
    argv: list[str] = field(default_factory=list)
    seconds_to_ready: float = 0.0

    @property
    def log(self) -> Path:
        return self.tmp / "dockerd.log"

    @property
    def client_env(self) -> dict[str, str]:
        """Only the variables that point a docker client at this daemon."""
        return {k: self.env[k] for k in ("DOCKER_HOST", "DOCKER_CONFIG")}

    def docker(self, *args: str, timeout: float = 120,
               **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["docker", *args], capture_output=True, text=True,
                              timeout=timeout, env=self.env, **kw)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def load_from_podman(self, ref: str, timeout: float = 600) -> str:
        """``podman save --format docker-archive REF | docker load``: the image as podman
        has it, config included, so its id is podman's. Returns docker's id of ``ref``."""
        with tempfile.TemporaryFile(dir=self.tmp) as err:
            save = subprocess.Popen(["podman", "save", "--format", "docker-archive", ref],
                                    stdout=subprocess.PIPE, stderr=err)
            assert save.stdout is not None
            try:
                load = subprocess.run(["docker", "load"], stdin=save.stdout,
                                      capture_output=True, text=True, timeout=timeout,
                                      env=self.env)
            finally:
                save.stdout.close()
                saved = save.wait(timeout=timeout)
            err.seek(0)
            why = err.read().decode(errors="replace")
        if saved != 0 or load.returncode != 0:
            raise DockerdError(f"podman save {ref} | docker load failed ({saved}, "
                               f"{load.returncode}): {why}{load.stderr}")
        r = self.docker("image", "inspect", "--format", "{{.Id}}", ref)
        if r.returncode != 0:
            raise DockerdError(f"docker image inspect {ref} after the load: {r.stderr}")
        return r.stdout.strip()


def _dockerd_exe() -> str:
    exe = shutil.which("dockerd") or shutil.which("dockerd", path="/usr/sbin:/sbin")
    if exe is None or shutil.which("docker") is None:
        raise DockerdError("dockerd and a docker client are needed (Debian's docker.io): run "
                           "scripts/setup.sh")
    if os.geteuid() != 0:
        raise DockerdError("a private dockerd needs root here")
    return exe


def _daemon_config(exe: str, tmp: Path) -> dict[str, Any]:
    """An otherwise empty daemon config; for dockerd before 23, its trust key in ``tmp``
    (it would write /etc/docker/key.json; later versions have no such key, and refuse it)."""
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    m = re.search(r"version (\d+)\.", out.stdout)
    if m and int(m.group(1)) < 23:
        return {"deprecated-key-path": str(tmp / "key.json")}
    return {}


@contextlib.contextmanager
def private_dockerd(ready_timeout: float = 90.0) -> Iterator[Dockerd]:
    """A running private dockerd (see the module's docstring); raises DockerdError, with
    the daemon's log, when it does not answer within ``ready_timeout`` seconds."""
    exe = _dockerd_exe()
    existed = {d: os.path.lexists(d) for d in (*RUN_DIRS, "/etc/docker")}
    tag = f"kvp-dockerd-{secrets.token_hex(4)}"
    # short: unix socket paths (docker.sock, containerd's) must stay under 108 bytes
    tmp = Path(tempfile.mkdtemp(prefix="kvp-dockerd.", dir="/tmp"))
    d: Dockerd | None = None
    body_ok = False
    try:
        (tmp / "client").mkdir()
        (tmp / "daemon.json").write_text(json.dumps(_daemon_config(exe, tmp)))
        argv = [exe, *dockerd_flags(tmp, tag)]
        env = dict(os.environ, DOCKER_HOST=f"unix://{tmp / 'docker.sock'}",
                   DOCKER_CONFIG=str(tmp / "client"))
        env.pop("DOCKER_CONTEXT", None)
        start = time.monotonic()
        with (tmp / "dockerd.log").open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        d = Dockerd(tmp, tag, proc, env, argv)
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise DockerdError(f"dockerd exited ({proc.returncode}):\n{d.log_tail()}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                if d.docker("version", timeout=10).returncode == 0:
                    break
            if time.monotonic() > deadline:
                raise DockerdError(f"dockerd did not answer in {ready_timeout:.0f} s:\n"
                                   f"{d.log_tail()}")
            time.sleep(0.5)
        d.seconds_to_ready = round(time.monotonic() - start, 1)
        yield d
        body_ok = True
    finally:
        problems = _teardown(d, tmp, tag, existed)
        # a teardown that leaves something behind fails loudly, after everything was tried
        # (but never hides the error that ended the body)
        if problems and body_ok:
            raise DockerdError("private dockerd teardown: " + "; ".join(problems))
        if problems:
            print(f"private dockerd teardown: {'; '.join(problems)}")


def _teardown(d: Dockerd | None, tmp: Path, tag: str, existed: dict[str, bool]) -> list[str]:
    problems: list[str] = []
    pids: list[int] = []
    if d is not None and d.proc.poll() is None:
        # its containers first (all of them are this test's); their processes are killed by
        # pid only when the removal fails
        with contextlib.suppress(subprocess.TimeoutExpired):
            ids = d.docker("ps", "-aq", "--no-trunc", timeout=30).stdout.split()
            running = []
            for cid in ids:
                r = d.docker("inspect", "--format", "{{.State.Pid}}", cid, timeout=30)
                with contextlib.suppress(ValueError):
                    if int(r.stdout.strip() or 0) > 0:
                        running.append(int(r.stdout.strip()))
            if ids:
                r = d.docker("rm", "-f", *ids, timeout=120)
                if r.returncode != 0:
                    problems.append(f"docker rm -f: {r.stderr.strip()}")
                    pids = running
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            problems.append("dockerd did not stop on SIGTERM in 45 s: killed")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(d.proc.pid, signal.SIGKILL)
            d.proc.wait(timeout=30)
    # what still names the temp directory (containerd, its shims) and the containers' own
    # processes, by pid
    marker = str(tmp)
    left: list[psutil.Process] = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if p.pid != os.getpid() and marker in " ".join(p.info["cmdline"] or []):
                left.append(p)
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            left.append(psutil.Process(pid))
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=10)
    if left:
        problems.append(f"killed leftover processes {[p.pid for p in left]}")
    # mounts under the temp directory (exec/netns/default, overlay2 layers): deepest first
    for mnt in sorted(_mounts_under(tmp), key=len, reverse=True):
        r = subprocess.run(["umount", mnt], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=60)
    still = _mounts_under(tmp)
    if still:
        # never recurse into a mount: it could be a bind mount of something else
        problems.append(f"mounts left under {tmp}, not removed: {still}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
        if tmp.exists():
            problems.append(f"{tmp} could not be removed")
    for cg in Path("/sys/fs/cgroup").glob(f"*/{tag}"):
        for sub in sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            cg.rmdir()
        if cg.exists():
            problems.append(f"cgroup {cg} left")
    for path in RUN_DIRS:
        if not existed[path]:
            with contextlib.suppress(OSError):
                os.rmdir(path)
    if not existed["/etc/docker"] and os.path.isdir("/etc/docker"):
        with contextlib.suppress(OSError):
            os.rmdir("/etc/docker")  # only if empty: something else may have put files there
    return problems


def _mounts_under(tmp: Path) -> list[str]:
    prefix = str(tmp) + "/"
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mnt = line.split()[4].replace("\\040", " ")
            if mnt.startswith(prefix) or mnt == str(tmp):
                out.append(mnt)
    return out
