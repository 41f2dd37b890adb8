"""The role's opt-in maximum-age prune timer: absent by default (the session's converge),
installed with ``kvp_max_age_prune_timer: true`` (the units the Python renderer writes,
clean under ``systemd-analyze verify``), a second run changes nothing, and turning it off
again removes every file of it. Real ansible-playbook runs (``--tags kvp_max_age_prune``)
into a temporary prefix."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvpersist.deploy.systemd import (
    InstanceSettings,
    UnitSettings,
    render_instance_dropins,
    render_units,
)

from .conftest import kvp_converge, verify

pytestmark = pytest.mark.deploy

ONLY = ("--tags", "kvp_max_age_prune")
UNITS = ("kvp-prune-max-age@.service", "kvp-prune-max-age@.timer")


def test_absent_by_default(converged: kvp_converge.Converged) -> None:
    assert converged.first.returncode == 0, converged.first.output[-6000:]
    unit_dir = converged.prefix / "etc/systemd/system"
    assert unit_dir.is_dir() and not list(unit_dir.glob("kvp-prune-max-age@*"))


@pytest.fixture(scope="module")
def base(converged: kvp_converge.Converged) -> Iterator[Path]:
    assert converged.first.returncode == 0, converged.first.output[-6000:]
    path = kvp_converge.make_base("kvp-max-age-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def vars_file(base: Path, enabled: bool) -> Path:
    data = kvp_converge.ci_vars(base, base)
    data["kvp_create_user"] = False  # the session's converge owns the service account
    data["kvp_max_age_prune_timer"] = enabled
    for dep in data["kvp_deployments"]:
        dep["env"]["KVP_L2_MAX_AGE"] = "30d"
    path = base / f"vars-{enabled}.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_opt_in_installs_then_unchanged_then_opt_out_removes(base: Path) -> None:
    unit_dir = base / "root" / "etc/systemd/system"
    unit_dir.mkdir(parents=True)
    on = vars_file(base, True)
    first = kvp_converge.run_playbook(base, on, *ONLY)
    assert first.returncode == 0, first.output[-6000:]
    data = yaml.safe_load(on.read_text())
    prefix = data["kvp_root_prefix"]
    settings = UnitSettings(user=data["kvp_user"], group=data["kvp_group"],
                            kvp_admin=f"{data['kvp_venv']}/bin/kvp-admin",
                            config_dir=f"{prefix}/etc/kvpersist",
                            state_dir=f"{prefix}/var/lib/kvpersist",
                            log_dir=f"{prefix}/var/log/kvpersist",
                            scripts_dir=f"{prefix}/opt/kvpersist/scripts",
                            docker=data["kvp_docker_bin"],
                            metrics_textfile_dir=f"{prefix}/var/lib/prometheus/node-exporter")
    expected = {k: v for k, v in render_units(settings, stamp="Ansible managed",
                                              opt_in=True).items() if k in UNITS}
    for dep in data["kvp_deployments"]:
        expected.update({k: v for k, v in render_instance_dropins(InstanceSettings(
            name=dep["name"], cache_root=prefix + dep["cache_root"]), stamp="Ansible managed",
            opt_in=True).items() if k.startswith("kvp-prune-max-age@")})
    assert len(expected) == 4
    for rel, text in expected.items():
        assert (unit_dir / rel).read_text() == text, rel
    service = (unit_dir / UNITS[0]).read_text()
    assert " prune --config " in service and "--max-age --apply" in service
    # the opt-in unit verifies clean with its drop-in (the unit's ExecStart needs kvp-admin
    # and the drop-in's ReadWritePaths the cache root: both exist in the prefix)
    for dep in data["kvp_deployments"]:
        for unit in ("kvp-prune-max-age@{}.service", "kvp-prune-max-age@{}.timer"):
            proc = verify(unit.format(dep["name"]), unit_dir)
            assert proc.returncode == 0, proc.stderr
            assert (proc.stdout + proc.stderr).strip() == "", proc.stdout + proc.stderr

    second = kvp_converge.run_playbook(base, on, *ONLY)
    assert second.returncode == 0 and second.recap.get("changed") == 0, second.output[-6000:]

    off = kvp_converge.run_playbook(base, vars_file(base, False), *ONLY)
    assert off.returncode == 0, off.output[-6000:]
    assert not list(unit_dir.glob("kvp-prune-max-age@*"))
