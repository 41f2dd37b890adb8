"""Real hosts for the deployment tests: systemd 252 as PID 1, sshd, an NVMe stand-in, each in
a network namespace the test creates (issue 41).

A host is a podman container of the host image (``scripts/build-host-image.sh``: Debian
bookworm minbase with systemd, sshd and python3; built once per machine, reused):

- **PID 1 is systemd** (``podman run --systemd=always ... /sbin/init`` with runc) with
  ``CAP_SYS_ADMIN`` and ``CAP_SYS_PTRACE`` added to podman's default capabilities (a real
  host's PID 1 has every capability). Without ``CAP_SYS_ADMIN`` systemd 252 cannot set up a
  unit's mount namespace in a container and runs the units *without* their sandbox,
  silently (``ProtectSystem=strict``, ``ProtectHome=``, ``PrivateDevices=`` ... not applied;
  it logs only for ``ProtectHostname=``); without ``CAP_SYS_PTRACE`` a unit with both
  ``PrivateUsers=yes`` and ``ProtectProc=invisible`` and a ``User=`` other than root fails
  at step USER ("Failed to set up user namespacing: No such file or directory": the helper
  that writes the new namespace's uid map no longer sees its parent in the unit's /proc).
  With both, every setting of the units applies (the tests check the cache server's sandbox
  on the running process). ``CAP_SYS_RESOURCE`` lets systemd raise a unit's
  ``LimitNOFILE=`` above the container's own limit (otherwise silently kept at podman's
  20,000), and ``/dev/shm`` gets ``shm_mb`` (podman's 64 MiB default is less than vLLM's
  engine queues need: "Insufficient space in /dev/shm ... 160 MiB required").
- **Network**: the host joins a namespace of :mod:`tests.integration._netns` (``podman run
  --network ns:/run/netns/NAME``): a veth to the bridge in the store's namespace, an address
  of the test subnet that exists only inside these namespaces, its own loopback. The
  controller (``ansible-playbook``, testinfra, ``ssh``) runs in a namespace of its own on the
  same bridge, the shared tier's ``redis-server`` in the store's namespace. Nothing uses
  podman's network.
- **SSH**: sshd with the host's own host keys (made at its first boot), root's
  ``authorized_keys`` holding one ed25519 key the test made; the controller's known_hosts
  holds each host's key, read from the host (``StrictHostKeyChecking yes``).
- **NVMe stand-in**: an ext4 image on the test machine, attached to a loop device and given to
  the host as the block device ``/dev/nvme0n1``; the host mounts it at ``/srv/nvme0`` with
  its own mount unit, as a data disk in ``/etc/fstab`` with ``nofail`` is mounted (wanted by,
  but not ordered before, ``local-fs.target``), after ``kvp-test-nvme-settle.service``
  (``NVME_SETTLE_S`` seconds: a disk that appears late at boot). The operator's disk
  preparation made ``/srv/nvme0/kvp``, the parent of the cache roots.
- **Software**: nothing large is copied. The project's venv (vLLM, LMCache, kvpersist) is
  bind-mounted read-only; its interpreter cannot stay where it is (this machine's Python
  lives under /root, which the units' ``ProtectHome=yes`` hides), so it is bind-mounted
  read-only at :data:`HOST_PYTHON` (its library found through the loader's cache) and the
  host gets a venv at the role's default path ``/opt/kvpersist/venv`` made of that
  interpreter, the project venv's ``lib`` (read-only) and its console scripts with their
  first line pointing at that venv (see :func:`compose_venv`). kvpersist is installed
  *editable* in the project's venv: its finder maps the package to a checkout path, and the
  checkout under test is bind-mounted there read-only, so the hosts run this checkout's
  kvpersist. The role is told
  the venv exists (``kvp_venv_create: false``) and still checks that pip finds kvpersist in it
  and that ``kvp-admin`` runs.

Everything is removed by :meth:`Hosts.close` (containers, loop devices, namespaces, files,
the controller's SSH connections), also after a failure: use it in a ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from ..conftest import REPO
from ..integration._netns import STORE_IP, Net, make_net
from .conftest import kvp_converge

HOST_IMAGE_SCRIPT = REPO / "scripts" / "build-host-image.sh"
#: the project's venv (vLLM, LMCache, kvpersist editable), bind-mounted read-only into hosts
VENV = Path(sys.executable).parent.parent
#: where the hosts find it: the kvp role's default kvp_venv
HOST_VENV = "/opt/kvpersist/venv"
#: where the hosts find the venv's interpreter when it is not Debian's (read-only)
HOST_PYTHON = "/opt/kvp-test-python"
#: read-only test data on every host: the generated model and the warm set
DATA = "/srv/kvp-test"
NVME_DEVICE = "/dev/nvme0n1"
NVME_MOUNT = "/srv/nvme0"
NVME_UNIT = "srv-nvme0.mount"
NVME_SETTLE_UNIT = "kvp-test-nvme-settle.service"
#: the parent of the cache roots on the NVMe (made by the operator's disk preparation)
CACHE_PARENT = f"{NVME_MOUNT}/kvp"
ANSIBLE_DIR = REPO / "ansible"

_MOUNT_UNIT = f"""[Unit]
Description=NVMe data disk (test stand-in: a loop-mounted ext4 image)
# as /etc/fstab's "nofail" makes it: wanted by local-fs.target, not ordered before it
After={NVME_SETTLE_UNIT}
Requires={NVME_SETTLE_UNIT}

[Mount]
What={NVME_DEVICE}
Where={NVME_MOUNT}
Type=ext4
Options=nofail

[Install]
WantedBy=local-fs.target
"""

_SETTLE_UNIT = """[Unit]
Description=Wait for the NVMe disk (test stand-in: a disk that appears {settle} s after boot)
DefaultDependencies=no

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sleep {settle}
"""


def run(argv: Sequence[str], *, check: bool = True, timeout: float = 120,
        input: str | None = None, env: dict[str, str] | None = None,
        ) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                       input=input, env=env)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r


def host_image() -> tuple[str, float]:
    """The host image's reference (built now, or reused) and the seconds it took."""
    if shutil.which("podman") is None:
        raise RuntimeError("podman is missing: bash scripts/setup.sh installs it")
    t0 = time.monotonic()
    r = run(["bash", str(HOST_IMAGE_SCRIPT)], timeout=900)
    return r.stdout.split()[0], time.monotonic() - t0


def editable_checkout(venv: Path = VENV) -> str:
    """The directory the venv's editable install of kvpersist maps the package into
    (``<dir>/kvpersist``); the hosts get the checkout under test there. Raises RuntimeError
    when kvpersist is not installed editable (scripts/setup.sh installs it so)."""
    finders = sorted((venv / "lib").glob(
        "python3*/site-packages/__editable___kvpersist_*finder.py"))
    for finder in finders:
        m = re.search(r"MAPPING[^=]*=\s*(\{[^}]*\})", finder.read_text())
        if m:
            mapping = json.loads(m.group(1).replace("'", '"'))
            if "kvpersist" in mapping:
                return str(Path(mapping["kvpersist"]).parent)
    raise RuntimeError(f"kvpersist is not installed editable in {venv} (bash scripts/setup.sh)")


def interpreter_of(venv: Path = VENV) -> tuple[Path, str]:
    """The prefix of ``venv``'s base interpreter (``home`` of its pyvenv.cfg, less ``bin``)
    and its version."""
    cfg = (venv / "pyvenv.cfg").read_text()
    home = re.search(r"(?m)^home\s*=\s*(\S+)", cfg)
    version = re.search(r"(?m)^version(?:_info)?\s*=\s*(\S+)", cfg)
    if home is None or version is None:
        raise RuntimeError(f"{venv}/pyvenv.cfg names no home or version")
    return Path(home.group(1)).parent, version.group(1)


def host_python(venv: Path = VENV) -> str:
    """Where a host finds ``venv``'s interpreter: Debian's ``/usr`` as it is (the image has
    it), any other prefix (a pyenv build under /root, which the units' ProtectHome=yes hides)
    bind-mounted read-only at :data:`HOST_PYTHON`."""
    prefix, _ = interpreter_of(venv)
    return "/usr" if prefix == Path("/usr") else HOST_PYTHON


def compose_venv(dest: Path, venv: Path = VENV) -> Path:
    """The host's venv, made in ``dest`` and mounted at :data:`HOST_VENV`: ``pyvenv.cfg``
    naming ``venv``'s own interpreter where the host finds it (:func:`host_python`),
    ``bin/python*`` linking to it, a copy of each console script of ``venv/bin`` whose first
    line names ``venv``'s interpreter, with that line naming :data:`HOST_VENV`'s, and an
    empty ``lib`` where ``venv/lib`` is mounted read-only. The same interpreter, not the
    image's python3.11: packages decide by the patch version (redis-py imports
    ``async_timeout`` below 3.11.3)."""
    prefix, version = interpreter_of(venv)
    minor = ".".join(version.split(".")[:2])
    exe = f"{host_python(venv)}/bin/python{minor}"
    if not (prefix / "bin" / f"python{minor}").exists():
        raise RuntimeError(f"{prefix}/bin/python{minor} not found ({venv}'s interpreter)")
    (dest / "bin").mkdir(parents=True)
    (dest / "lib").mkdir()
    (dest / "lib64").symlink_to("lib")
    (dest / "pyvenv.cfg").write_text(
        f"home = {host_python(venv)}/bin\ninclude-system-site-packages = false\n"
        f"version = {version}\n")
    (dest / "bin" / "python3").symlink_to(exe)
    (dest / "bin" / "python").symlink_to("python3")
    (dest / "bin" / f"python{minor}").symlink_to("python3")
    # the scripts name the venv by the path it was made at: ``venv`` itself, or where it
    # resolves to when ``venv`` is a link to it (a worktree's .venv linking to another's)
    shebangs = {f"#!{v}/bin/python{s}".encode() for v in (venv, venv.resolve())
                for s in ("", "3", f"{minor}")}
    for src in sorted((venv / "bin").iterdir()):
        if src.is_symlink() or not src.is_file():
            continue
        data = src.read_bytes()
        first, _, rest = data.partition(b"\n")
        if first.rstrip() not in shebangs:
            continue
        out = dest / "bin" / src.name
        out.write_bytes(f"#!{HOST_VENV}/bin/python\n".encode() + rest)
        out.chmod(0o755)
    for d in (dest, dest / "bin", dest / "lib"):
        d.chmod(0o755)
    return dest


@dataclass
class Host:
    """One host: its container, namespace and address, its NVMe's loop device."""

    name: str
    container: str
    ns: str
    addr: str
    loop: str = ""

    @property
    def wrap(self) -> tuple[str, ...]:
        """What runs a command in the host's network namespace, on the test machine (a
        client of the host's loopback listeners)."""
        return ("ip", "netns", "exec", self.ns)

    def exec(self, *argv: str, check: bool = True, timeout: float = 120,
             input: str | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` on the host as root (``podman exec``)."""
        return run(["podman", "exec", "-i", self.container, *argv], check=check,
                   timeout=timeout, input=input)

    def sh(self, script: str, *, check: bool = True,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.exec("sh", "-c", script, check=check, timeout=timeout)

    def write(self, path: str, text: str, mode: str = "0644") -> None:
        self.exec("sh", "-c", f'umask 022 && cat > "$1" && chmod {mode} "$1"', "sh", path,
                  input=text)

    def systemctl(self, *args: str, check: bool = True,
                  timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return self.exec("systemctl", "--no-pager", *args, check=check, timeout=timeout)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, *args: str, timeout: float = 60) -> str:
        return self.exec("journalctl", "--no-pager", *args, check=False, timeout=timeout).stdout

    def journal_json(self, *args: str) -> list[dict[str, Any]]:
        out = self.journal("-o", "json", *args)
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    def init_pid(self) -> int:
        """The machine's pid of the host's PID 1 (systemd)."""
        r = run(["podman", "inspect", "--format", "{{.State.Pid}}", self.container])
        return int(r.stdout.strip())

    def machine_pid(self, pid: int) -> int:
        """The test machine's pid of the host's process ``pid`` (its pid in the host)."""
        want = os.readlink(f"/proc/{self.init_pid()}/ns/pid")
        for p in psutil.process_iter():
            with contextlib.suppress(OSError, psutil.Error):
                if os.readlink(f"/proc/{p.pid}/ns/pid") != want:
                    continue
                for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                    if line.startswith("NSpid:") and int(line.split()[-1]) == pid:
                        return p.pid
        raise RuntimeError(f"{self.name}: no process {pid}")

    def wait_running(self, timeout: float = 120) -> str:
        """Wait until systemd finished booting; its state (``running``; ``degraded`` names
        the failed units)."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            # before systemd listens on its socket, systemctl fails at once (no state)
            r = self.exec("timeout", str(int(max(1, deadline - time.monotonic()))), "systemctl",
                          "is-system-running", "--wait", check=False, timeout=timeout + 10)
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                break
            time.sleep(0.5)
        if state not in ("running", "degraded"):
            raise RuntimeError(f"{self.name}: systemd is {state!r} after {timeout} s: "
                               + self.systemctl("--failed", check=False).stdout)
        return state


@dataclass
class Hosts:
    """The hosts of one test module, their network, the controller and the shared files."""

    base: Path
    net: Net
    image: str
    hosts: dict[str, Host] = field(default_factory=dict)
    #: seconds each step took (printed by the modules, docs/deployment.md)
    timings: dict[str, float] = field(default_factory=dict)

    # -- files on the test machine
    @property
    def ssh_dir(self) -> Path:
        return self.base / "ssh"

    @property
    def ssh_config(self) -> Path:
        return self.ssh_dir / "config"

    @property
    def ctl(self) -> tuple[str, ...]:
        """What runs a command on the controller (its network namespace)."""
        return self.net.hosts["ctl"].wrap

    # -- the controller
    def ssh(self, host: str, command: str, *, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``command`` on ``host`` over SSH from the controller, as root."""
        return run([*self.ctl, "ssh", "-F", str(self.ssh_config), self.hosts[host].addr,
                    command], check=check, timeout=timeout)

    def ansible_env(self) -> dict[str, str]:
        return {**kvp_converge.ansible_env(self.base),
                "ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.base / "ansible-cp")}

    def inventory(self, host_vars: dict[str, dict[str, Any]], group_vars: dict[str, Any],
                  name: str = "inventory.yml") -> Path:
        """An inventory of ``host_vars``' hosts (group ``kvpersist``), reached over SSH at
        their addresses, with ``group_vars``; written 0600 (it may hold the store's
        password, as a vault would)."""
        hosts = {h: {"ansible_host": self.hosts[h].addr, **v} for h, v in host_vars.items()}
        doc = {"kvpersist": {"hosts": hosts, "vars": {
            "ansible_connection": "ssh", "ansible_user": "root",
            "ansible_ssh_common_args": f"-F {self.ssh_config}",
            "ansible_python_interpreter": "/usr/bin/python3",
            "ansible_become_method": "su", **group_vars}}}
        path = self.base / name
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        path.chmod(0o600)
        return path

    def playbook(self, playbook: Path, inventory: Path, *extra: str,
                 timeout: float = 1800) -> PlaybookRun:
        """``ansible-playbook -i INVENTORY PLAYBOOK EXTRA...`` on the controller, as an
        operator runs it (the ssh connection to every host)."""
        argv = [*self.ctl, str(VENV / "bin" / "ansible-playbook"), "-i", str(inventory),
                str(playbook), *extra]
        t0 = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=self.ansible_env(), cwd=str(REPO))
        return PlaybookRun(argv, proc.returncode, proc.stdout + proc.stderr,
                           time.monotonic() - t0)

    def testinfra(self, kvp_vars: Path, hosts: Iterable[str], *extra: str,
                  timeout: float = 900) -> subprocess.CompletedProcess[str]:
        """The testinfra checks of tests/infra against ``hosts`` through testinfra's
        ``ssh://`` backend, run on the controller exactly as docs/deployment.md tells an
        operator to check a real host (``--hosts ssh://root@HOST --kvp-vars FILE``)."""
        spec = ",".join(f"ssh://root@{self.hosts[h].addr}" for h in hosts)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
        env["PYTHONPATH"] = str(REPO)
        argv = [*self.ctl, sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                "--no-header", "-rA", str(REPO / "tests" / "infra"), f"--hosts={spec}",
                f"--ssh-config={self.ssh_config}", f"--kvp-vars={kvp_vars}",
                f"--basetemp={self.base / 'testinfra-tmp'}", *extra]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=str(REPO))

    def journals(self, lines: int = 40) -> str:
        """The last lines of every kvpersist unit's journal on every host (for a failure's
        message)."""
        out = []
        for h in self.hosts.values():
            out.append(f"--- {h.name}: " + h.systemctl("list-units", "kvp-*", "--all",
                                                       "--plain", check=False).stdout)
            out.append(h.journal("-u", "kvp-*", "-n", str(lines)))
        return "\n".join(out)

    # -- the end
    def close(self) -> None:
        """Remove the containers, loop devices, namespaces and files; stop what was started
        here (by pid: the controller's SSH connections)."""
        for h in self.hosts.values():
            run(["podman", "rm", "--force", "--time", "0", h.container], check=False,
                timeout=180)
        for h in self.hosts.values():
            if h.loop:
                run(["losetup", "--detach", h.loop], check=False)
        for p in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(str(self.base) in a for a in p.info["cmdline"] or []):
                    p.kill()
        self.net.close()
        shutil.rmtree(self.base, ignore_errors=True)


@dataclass
class PlaybookRun:
    argv: list[str]
    returncode: int
    output: str
    seconds: float

    def recap(self) -> dict[str, dict[str, int]]:
        """PLAY RECAP counts per host."""
        out = {}
        for host, counts in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", self.output, re.M):
            out[host] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counts)}
        return out


def _prepare(h: Host, settle_s: int) -> None:
    """The host's first boot: the interpreter's shared library in the loader's cache (its
    RUNPATH names the path it was built at), the NVMe mount (after the settle unit) and the
    operator's disk preparation (``/srv/nvme0/kvp``)."""
    h.wait_running()
    if host_python() != "/usr":
        h.write("/etc/ld.so.conf.d/kvp-test-python.conf", f"{HOST_PYTHON}/lib\n")
        h.exec("ldconfig")
    h.write(f"/etc/systemd/system/{NVME_SETTLE_UNIT}", _SETTLE_UNIT.format(settle=settle_s))
    h.write(f"/etc/systemd/system/{NVME_UNIT}", _MOUNT_UNIT)
    h.sh(f"mkdir -p {NVME_MOUNT} && systemctl daemon-reload && "
         f"systemctl enable --now {NVME_UNIT} && mkdir -p -m 0755 {CACHE_PARENT}")
    h.systemctl("is-active", "ssh.service")


def start_hosts(names: Sequence[str], *, data: Path, nvme_mb: int = 1024,
                shm_mb: int = 2048, settle_s: int = 0, prefix: str = "kvp-hosts-") -> Hosts:
    """Start a host per name in ``names`` (each its own namespace on one bridge, with the
    controller's namespace ``ctl`` and the store's), with ``data`` (the model, the warm
    set) read-only at :data:`DATA` on each. Returns once every host finished booting and its
    sshd answers the controller with the key the test made. On a failure everything made
    so far is removed and the error raised."""
    for tool in ("ip", "losetup", "mkfs.ext4", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise RuntimeError(f"{tool} is missing: bash scripts/setup.sh installs it")
    image, build_s = host_image()
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    base.chmod(0o755)
    net = make_net("ctl", *names)
    hosts = Hosts(base, net, image)
    hosts.timings["host_image_s"] = round(build_s, 1)
    try:
        t0 = time.monotonic()
        checkout = editable_checkout()
        venv = compose_venv(base / "venv")
        prefix, _ = interpreter_of()
        python_mount = ([] if host_python() == "/usr" else
                        ["--volume", f"{prefix}:{HOST_PYTHON}:ro"])
        hosts.ssh_dir.mkdir(mode=0o700)
        key = hosts.ssh_dir / "id_ed25519"
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kvp-test-controller",
             "-f", str(key)])
        auth = hosts.ssh_dir / "authorized_keys"
        auth.write_text(Path(f"{key}.pub").read_text())
        auth.chmod(0o644)
        known = hosts.ssh_dir / "known_hosts"
        hosts.ssh_config.write_text(
            f"Host *\n  User root\n  IdentityFile {key}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {known}\n  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 10\n"
            "  LogLevel ERROR\n")
        for name in names:
            nh = net.hosts[name]
            img = base / f"nvme-{name}.img"
            with img.open("wb") as f:
                f.truncate(nvme_mb * 1024 * 1024)
            run(["mkfs.ext4", "-q", "-F", "-L", f"nvme-{name}", str(img)])
            h = Host(name, f"kvp-host-{net.token}-{name}", nh.ns, nh.addr)
            h.loop = run(["losetup", "--find", "--show", str(img)]).stdout.strip()
            hosts.hosts[name] = h
            run(["podman", "run", "--detach", "--name", h.container, "--hostname", name,
                 "--runtime", "runc", "--systemd=always",
                 "--cap-add", "SYS_ADMIN,SYS_PTRACE,SYS_RESOURCE",
                 "--shm-size", f"{shm_mb}m",
                 "--network", f"ns:/run/netns/{h.ns}",
                 "--device", f"{h.loop}:{NVME_DEVICE}",
                 "--volume", f"{venv}:{HOST_VENV}:ro",
                 "--volume", f"{VENV / 'lib'}:{HOST_VENV}/lib:ro",
                 *python_mount,
                 "--volume", f"{REPO}:{checkout}:ro",
                 "--volume", f"{data}:{DATA}:ro",
                 "--volume", f"{auth}:/root/.ssh/authorized_keys:ro",
                 image, "/sbin/init"], timeout=180)
        with ThreadPoolExecutor(len(names)) as ex:
            list(ex.map(lambda h: _prepare(h, settle_s), hosts.hosts.values()))
        lines = []
        for h in hosts.hosts.values():
            pub = h.exec("cat", "/etc/ssh/ssh_host_ed25519_key.pub").stdout.split()
            lines.append(f"{h.addr} {pub[0]} {pub[1]}\n")
        known.write_text("".join(lines))
        for name in names:
            r = hosts.ssh(name, "hostname")
            if r.stdout.strip() != name:
                raise RuntimeError(f"ssh to {name} reached {r.stdout.strip()!r}")
        hosts.timings["hosts_start_s"] = round(time.monotonic() - t0, 1)
    except BaseException:
        hosts.close()
        raise
    return hosts


@dataclass
class Delivery:
    """One signal a watched process received, as strace saw it."""

    process: str
    signal: str
    #: who sent it: "systemd (PID 1)", another watched process's label, "pid N" otherwise
    sender: str
    #: the process died of it (strace: "+++ killed by SIG... +++")
    fatal: bool = False


@dataclass
class SignalWatch:
    """The signals the processes of some units receive, observed: ``strace -f -e trace=none
    -e signal=all`` on the test machine, attached to each of their processes (found by their
    cgroup in the host, mapped to the machine's pids); the sender comes from the signal's
    ``si_pid``. strace stops the traced threads at every system call (trace=none still does):
    attach just before the action and :meth:`finish` right after it."""

    host: Host
    #: machine pid -> label ("kvp-vllm@demo.service: python3 ... (main)")
    labels: dict[int, str]
    out: Path
    proc: subprocess.Popen[str] | None = None
    #: the host's pid -> label (senders: si_pid is in the host's pid namespace)
    inner: dict[int, str] = field(default_factory=dict)
    #: thread id -> process (machine pids), as at attach
    tids: dict[int, int] = field(default_factory=dict)

    @classmethod
    def start(cls, host: Host, units: Sequence[str], out: Path) -> SignalWatch:
        labels: dict[int, str] = {}
        #: the host's pid (what a signal's si_pid names) -> label; 1 is the host's systemd
        inner: dict[int, str] = {1: "systemd (PID 1)"}
        #: thread id (machine) -> its process (machine pid), known at attach
        tids: dict[int, int] = {}
        for unit in units:
            main = int(host.show(unit, "MainPID")["MainPID"])
            listing = host.sh(f"grep -l '/{unit}$' /proc/[0-9]*/cgroup || true").stdout
            for path in listing.split():
                pid = int(path.split("/")[2])
                comm = host.exec("cat", f"/proc/{pid}/comm", check=False).stdout.strip()
                if not comm:
                    continue
                role = " (main)" if pid == main else ""
                labels[host.machine_pid(pid)] = inner[pid] = f"{unit}: {comm}{role}"
        argv = ["strace", "-f", "-qq", "-tt", "-e", "trace=none", "-e", "signal=all",
                "-o", str(out)]
        for pid in labels:
            for task in Path(f"/proc/{pid}/task").iterdir():
                argv += ["-p", task.name]
                tids[int(task.name)] = pid
        w = cls(host, labels, out, inner=inner, tids=tids)
        w.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)
        time.sleep(1.0)  # attached (it prints nothing until a signal comes)
        if w.proc.poll() is not None:
            raise RuntimeError(f"strace: {w.proc.stderr.read() if w.proc.stderr else ''}")
        return w

    def finish(self) -> list[Delivery]:
        """Detach; every signal seen, in order (SIGCHLD left out: children ending)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        tgid: dict[int, int] = dict(self.tids)
        for pid in self.labels:
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    tgid[int(task.name)] = pid
        init = self.host.init_pid()
        out: list[Delivery] = []
        text = self.out.read_text() if self.out.exists() else ""
        for line in text.splitlines():
            m = re.match(r"(\d+)\s+\S+\s+--- (SIG\w+) \{[^}]*?si_pid=(\d+)", line)
            k = re.match(r"(\d+)\s+\S+\s+\+\+\+ killed by (SIG\w+)", line)
            if m and m.group(2) != "SIGCHLD":
                tid, sig, sender = int(m.group(1)), m.group(2), int(m.group(3))
                who = ("systemd (PID 1)" if sender == init else
                       self.inner.get(sender, f"pid {sender}"))
                out.append(Delivery(self._label(tid, tgid), sig, who))
            elif k:
                out.append(Delivery(self._label(int(k.group(1)), tgid), k.group(2), "",
                                    fatal=True))
        return out

    def _label(self, tid: int, tgid: dict[int, int]) -> str:
        return self.labels.get(tgid.get(tid, tid), f"thread or child {tid}")

    def raw(self) -> str:
        return self.out.read_text() if self.out.exists() else ""


def reboot(h: Host, timeout: float = 180) -> float:
    """``podman restart`` of the host (its systemd stops every unit, then boots again);
    the seconds until it finished booting."""
    t0 = time.monotonic()
    run(["podman", "restart", "--time", "150", h.container], timeout=timeout)
    h.wait_running(timeout)
    return time.monotonic() - t0


__all__ = ["CACHE_PARENT", "DATA", "HOST_VENV", "NVME_MOUNT", "NVME_UNIT", "STORE_IP", "Host",
           "Hosts", "PlaybookRun", "reboot", "start_hosts"]
