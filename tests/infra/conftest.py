"""testinfra fixtures: the expected layout of a host converged by the kvp role.

Local (default): the session converges localhost into a temporary prefix with the real
playbook (see kvp_converge.py) and the checks run against it through testinfra's local
backend. Against a real host: give the role vars you deployed with, e.g.

    .venv/bin/python -m pytest tests/infra --hosts ssh://root@gpu-node-01 \
        --kvp-vars host_vars/gpu-node-01.yml

(the same YAML as ``ansible-playbook -e @...``; unset keys take the role's defaults).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvp_converge  # noqa: E402

# The venv's kvp-admin (run by host.run) uses this checkout's kvpersist: a no-op where the venv
# was installed from it, needed where several checkouts share one venv.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(kvp_converge.REPO), os.environ.get("PYTHONPATH", "")) if p)

ROLE_DEFAULTS = kvp_converge.ANSIBLE_DIR / "roles" / "kvp" / "defaults" / "main.yml"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvpersist")
    group.addoption("--kvp-vars", default=None,
                    help="YAML of the kvp role vars the target host was deployed with; "
                         "without it, localhost is converged into a temporary prefix")


@dataclass(frozen=True)
class Deployment:
    """Expected files and directories of one deployment on the host."""

    name: str
    cache_root: str
    config_dir: str
    identity_env: str
    state_dir: str
    log_dir: str
    env: dict[str, str]
    vllm: bool
    #: the shared tier's vaulted password ("" : no shared tier)
    shared_password: str = ""
    serde_key_b64: str = ""
    #: (namespace, base64 key) of serde_keys
    serde_keys: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Layout:
    """Expected install-wide layout (paths already carry kvp_root_prefix)."""

    user: str
    group: str
    venv: str
    kvp_admin: str
    config_dir: str
    state_dir: str
    log_dir: str
    systemd_dir: str
    scripts_dir: str
    manage_services: bool
    local_converge: bool
    deployments: tuple[Deployment, ...]
    #: node_exporter's textfile directory the health unit writes metrics into ("" : none)
    metrics_textfile_dir: str = ""
    #: the timers the role enables per deployment (kvp-<kind>@<deployment>.timer)
    timers: tuple[str, ...] = ("health", "scrub")


def layout_from_vars(given: dict[str, Any], *, local_converge: bool) -> Layout:
    """Compute the expected layout from the role defaults overlaid with ``given``."""
    defaults = yaml.safe_load(ROLE_DEFAULTS.read_text())
    v = {**defaults, **given}
    prefix = v.get("kvp_root_prefix") or ""
    venv = v["kvp_venv"] if not v.get("kvp_venv_create", True) else prefix + v["kvp_venv"]
    config_dir = prefix + v["kvp_config_dir"]
    state_dir = prefix + v["kvp_state_dir"]
    log_dir = prefix + v["kvp_log_dir"]
    deployments = []
    for d in v.get("kvp_deployments") or []:
        name = d["name"]
        env = {k: str(val) for k, val in d["env"].items()}
        env.update({
            "KVP_CACHE_ROOT": prefix + d["cache_root"],
            "KVP_STATE_DIR": f"{state_dir}/{name}",
            "KVP_LOG_DIR": f"{log_dir}/{name}",
            "KVP_SERVICE_USER": v["kvp_user"],
        })
        shared = d.get("shared_tier") or {}
        if shared:
            env.update({"KVP_SHARED_TIER": shared["url"],
                        "KVP_SHARED_TIER_SECRET_FILE": f"{state_dir}/{name}/shared-tier.secret"})
        deployments.append(Deployment(
            name=name,
            cache_root=prefix + d["cache_root"],
            config_dir=f"{config_dir}/{name}",
            identity_env=f"{config_dir}/{name}/identity.env",
            state_dir=f"{state_dir}/{name}",
            log_dir=f"{log_dir}/{name}",
            env=env,
            vllm=bool(d.get("vllm", False)),
            shared_password=str(shared.get("password", "")),
            serde_key_b64=str(d.get("serde_key_b64", "")),
            serde_keys=tuple((str(k["namespace"]), str(k["key_b64"]))
                             for k in d.get("serde_keys", [])),
        ))
    return Layout(
        user=v["kvp_user"], group=v["kvp_group"], venv=venv,
        kvp_admin=f"{venv}/bin/kvp-admin", config_dir=config_dir, state_dir=state_dir,
        log_dir=log_dir, systemd_dir=prefix + v["kvp_systemd_dir"],
        scripts_dir=prefix + v["kvp_scripts_dir"],
        manage_services=bool(v.get("kvp_manage_services", True)),
        local_converge=local_converge, deployments=tuple(deployments),
        metrics_textfile_dir=(prefix + v["kvp_metrics_textfile_dir"]
                              if v.get("kvp_metrics_textfile_dir") else ""),
        timers=tuple(kind for kind, key in (("health", "kvp_health_timer"),
                                            ("scrub", "kvp_scrub_timer"),
                                            ("prune-max-age", "kvp_max_age_prune_timer"))
                     if v.get(key)),
    )


@pytest.fixture(scope="session")
def kvp_layout(request: pytest.FixtureRequest) -> Layout:
    """The layout the target host must have."""
    path = request.config.getoption("--kvp-vars", default=None)
    if path:
        return layout_from_vars(yaml.safe_load(Path(path).read_text()) or {},
                                local_converge=False)
    hosts = request.config.getoption("hosts", default=None) or ""
    if hosts and not all(h.startswith("local://") for h in hosts.split(",")):
        pytest.fail("--hosts names another machine: give --kvp-vars FILE (the role vars it "
                    "was deployed with)")
    converged = kvp_converge.converge()
    if converged.first.returncode != 0:
        pytest.fail("the playbook run failed; see tests/deploy/test_ansible_role.py:\n"
                    + converged.first.output[-4000:])
    request.config.add_cleanup(kvp_converge.cleanup)
    return layout_from_vars(converged.vars, local_converge=True)
