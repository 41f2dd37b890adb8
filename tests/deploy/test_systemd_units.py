"""Gates on the systemd units: ``systemd-analyze verify`` clean on every unit and drop-in,
``systemd-analyze security --offline=true`` exposure <= 3.0 for the cache server.

Checked twice: the units rendered by kvpersist.deploy.systemd (the templates that also
produce systemd/ and the Ansible role's files) and the units the playbook installed into
the converged prefix. ``verify`` checks that every Exec binary exists, so the rendered set
points at stand-in executables.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpersist.deploy.systemd import (
    InstanceSettings,
    UnitSettings,
    render_instance_dropins,
    render_units,
)

from .conftest import MAX_EXPOSURE, exposure, verify
from .unit_examples import EXAMPLE_INSTANCES, example_files

pytestmark = pytest.mark.deploy

#: a deployment that binds non-loopback addresses with its opt-ins (see instance_for): the
#: drop-ins then carry IPAddressAllow= lines for its peers and its own bind addresses
REMOTE_INSTANCE = InstanceSettings(name="remote-bind", cache_root="/mnt/nvme1/kvp/remote",
                                   vllm=True, remote_peers=("10.1.0.0/16", "fd00::/8"),
                                   bind_addresses=("10.1.2.3",))
INSTANCES = [i.name for i in EXAMPLE_INSTANCES] + [REMOTE_INSTANCE.name]
UNIT_NAMES = ["kvp-lmcache@{}.service", "kvp-vllm@{}.service", "kvp-health@{}.service",
              "kvp-health@{}.timer", "kvp-scrub@{}.service", "kvp-scrub@{}.timer"]
#: the opt-in units (render_units(opt_in=True)); the role installs them only when asked
OPT_IN_UNIT_NAMES = ["kvp-prune-max-age@{}.service", "kvp-prune-max-age@{}.timer"]


@pytest.fixture(scope="module")
def rendered_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example units rendered with stand-in executables, ready for systemd-analyze."""
    base = tmp_path_factory.mktemp("units")
    bin_dir = base / "bin"
    bin_dir.mkdir()
    for name in ("kvp-admin", "docker", "run-vllm-with-persist.sh"):
        exe = bin_dir / name
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(0o755)
    settings = UnitSettings(kvp_admin=str(bin_dir / "kvp-admin"), docker=str(bin_dir / "docker"),
                            scripts_dir=str(bin_dir))
    unit_dir = base / "system"
    files = dict(render_units(settings, opt_in=True))
    for instance in (*EXAMPLE_INSTANCES, REMOTE_INSTANCE):
        files.update(render_instance_dropins(instance, opt_in=True))
    for rel, text in files.items():
        path = unit_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return unit_dir


@pytest.mark.parametrize("instance", INSTANCES)
@pytest.mark.parametrize("unit", UNIT_NAMES + OPT_IN_UNIT_NAMES)
def test_rendered_units_verify_clean(rendered_dir, unit, instance):
    proc = verify(unit.format(instance), rendered_dir)
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout + proc.stderr).strip() == "", proc.stdout + proc.stderr


@pytest.mark.parametrize("instance", INSTANCES)
@pytest.mark.parametrize("unit", ["kvp-lmcache", "kvp-health", "kvp-scrub",
                                  "kvp-prune-max-age"])
def test_unit_exposure_at_most_3(rendered_dir, unit, instance, record_property):
    """The cache server, the health unit (which writes the metrics textfiles) and the
    padding scrub (which writes into the cache root)."""
    level, report = exposure(f"{unit}@{instance}.service", rendered_dir)
    record_property(f"exposure_{unit}_{instance}", level)
    print(f"{unit}@{instance}.service exposure {level}")
    assert level <= MAX_EXPOSURE, report


def test_exposure_of_committed_examples_matches(tmp_path):
    """systemd/ as committed (no stand-ins): the security score needs no executables."""
    for rel, text in example_files().items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for instance in EXAMPLE_INSTANCES:
        level, report = exposure(f"kvp-lmcache@{instance.name}.service", tmp_path)
        assert level <= MAX_EXPOSURE, report


def test_broken_unit_is_caught(tmp_path):
    """The gate is real: an unknown directive and a missing binary are reported."""
    (tmp_path / "kvp-broken@.service").write_text(
        "[Service]\nExecStart=/nonexistent/kvp-admin x\nBogusSetting=1\n")
    proc = verify("kvp-broken@x.service", tmp_path)
    out = proc.stdout + proc.stderr
    assert "BogusSetting" in out and "/nonexistent/kvp-admin" in out


def test_installed_units_verify_clean(converged):
    assert converged.first.returncode == 0, converged.first.output[-4000:]
    unit_dir = converged.prefix / "etc/systemd/system"
    for dep in converged.vars["kvp_deployments"]:
        for unit in UNIT_NAMES:
            proc = verify(unit.format(dep["name"]), unit_dir)
            assert proc.returncode == 0, proc.stderr
            assert (proc.stdout + proc.stderr).strip() == "", proc.stdout + proc.stderr


def test_installed_cache_server_exposure(converged):
    assert converged.first.returncode == 0, converged.first.output[-4000:]
    unit_dir = converged.prefix / "etc/systemd/system"
    for dep in converged.vars["kvp_deployments"]:
        level, report = exposure(f"kvp-lmcache@{dep['name']}.service", unit_dir)
        assert level <= MAX_EXPOSURE, report


def test_role_and_python_render_the_same_bytes(converged):
    """The role's template module and kvpersist.deploy.systemd produce identical files from
    the same values (same templates, same `comment` filter, same whitespace control)."""
    assert converged.first.returncode == 0, converged.first.output[-4000:]
    v = converged.vars
    prefix = v["kvp_root_prefix"]
    settings = UnitSettings(
        user=v["kvp_user"], group=v["kvp_group"], kvp_admin=f"{v['kvp_venv']}/bin/kvp-admin",
        config_dir=f"{prefix}/etc/kvpersist", state_dir=f"{prefix}/var/lib/kvpersist",
        log_dir=f"{prefix}/var/log/kvpersist", scripts_dir=f"{prefix}/opt/kvpersist/scripts",
        docker=v["kvp_docker_bin"],
        metrics_textfile_dir=f"{prefix}/var/lib/prometheus/node-exporter")
    expected = dict(render_units(settings, stamp="Ansible managed"))
    for dep in v["kvp_deployments"]:
        expected.update(render_instance_dropins(InstanceSettings(
            name=dep["name"], cache_root=prefix + dep["cache_root"],
            vllm=bool(dep.get("vllm", False)), gpu_devices=bool(dep.get("gpu_devices", False)),
            allow_networks=tuple(dep.get("allow_networks", ())),
            extra_settings=tuple(dep.get("extra_settings", ()))), stamp="Ansible managed"))
    unit_dir = converged.prefix / "etc/systemd/system"
    for rel, text in expected.items():
        assert (unit_dir / rel).read_text() == text, rel
