"""The deployment the real-host tests deploy (tests/deploy/test_hosts_*.py): the tiny demo model
served in float32 (a cold answer and one from the cache are the same text: docs/persistence.md),
its warm set, the role's variables for hosts made by :mod:`tests.deploy._hosts`, and the
namespace of an identity (computed by this checkout's ``kvp-admin``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvpersist.demo.chat import long_chat
from kvpersist.demo.model import generate_model

from ..conftest import REPO, clean_env
from . import _hosts

sys.path.insert(0, str(REPO / "tests" / "infra"))
import kvp_converge  # noqa: E402

#: the returning user: the warm set holds the opening, the request adds the last question
CHAT = long_chat(turns=8, words_per_turn=150, seed=2525)
CHUNK = 256
HITS = "vllm:external_prefix_cache_hits_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
SERVED = "cpu-demo"


def make_data(base: Path) -> tuple[Path, str]:
    """The hosts' read-only data under ``base`` (world-readable: the service user reads the
    tokenizer and the warm set): the generated tiny model and the warm set. Returns the
    directory and the model's path as the hosts see it (under :data:`_hosts.DATA`)."""
    base.mkdir(parents=True, exist_ok=True)
    model = generate_model("tiny", base / "models" / "tiny")
    (base / "warm.jsonl").write_text(json.dumps({"messages": CHAT[:-1]}) + "\n")
    for root, dirs, files in os.walk(base):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    base.chmod(0o755)
    return base, f"{_hosts.DATA}/{model.relative_to(base)}"


def demo_env(model: str, engine_args: str = "--enforce-eager", **extra: Any) -> dict[str, Any]:
    """identity.env keys of the float32 demo deployment (the role adds the paths)."""
    env: dict[str, Any] = dict(kvp_converge._IDENTITY)
    env.update({
        "KVP_KV_CACHE_DTYPE": "float32", "KVP_MODEL_DTYPE": "float32",
        "KVP_ENGINE_ARGS": engine_args, "KVP_MODEL_PATH": model,
        "KVP_SERVED_MODEL_NAME": SERVED, "KVP_DEVICE": "cpu", "KVP_L1_SIZE_GB": 1,
        "KVP_L2_BUDGET": "512M", "KVP_L2_RESERVE": "1M",
        "KVP_WARMUP_FILE": f"{_hosts.DATA}/warm.jsonl", "KVP_WARMUP_WAIT": 120,
        "KVP_VLLM_EXTRA_ARGS": "--max-num-seqs 8"})
    env.update(extra)
    return env


def group_vars(**extra: Any) -> dict[str, Any]:
    """The kvp role's variables for hosts of :mod:`tests.deploy._hosts`: the venv is there
    already (bind-mounted; the role checks that pip finds kvpersist in it, offline, and that
    kvp-admin runs), the launcher scripts come from this checkout; everything else is the
    role's defaults (paths, service user ``kvpersist``, units, timers)."""
    return {"kvp_venv": _hosts.HOST_VENV, "kvp_venv_create": False,
            "kvp_package_spec": "kvpersist", "kvp_install_lmcache": False,
            "kvp_pip_environment": {"PIP_NO_INDEX": "1", "PIP_NO_DEPS": "1"},
            "kvp_scripts_source": str(REPO / "scripts"), **extra}


def namespace_of(env: dict[str, Any], workdir: Path) -> str:
    """The namespace of the identity in ``env`` (the identity alone decides it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "identity.env"
    lines = [f"{k}='{v}'" for k, v in env.items()]
    lines.append(f"KVP_CACHE_ROOT={workdir / 'root'}")
    cfg.write_text("\n".join(lines) + "\n")
    r = subprocess.run([sys.executable, "-m", "kvpersist.cli", "identity", "namespace", str(cfg)],
                       capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"identity namespace: {r.stderr}")
    return r.stdout.strip()
