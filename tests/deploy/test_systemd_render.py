"""kvpersist.deploy.systemd: pure rendering, validation, and the copies kept in sync."""

from __future__ import annotations

import filecmp
import re
from dataclasses import replace

import pytest

from kvpersist.deploy import systemd as sr

from .unit_examples import REPO, SYSTEMD_DIR, example_files

pytestmark = pytest.mark.deploy

ROLE_TEMPLATES = REPO / "ansible" / "roles" / "kvp" / "templates"
HARDENING = (
    "UMask=", "ProtectSystem=", "ReadWritePaths=", "ProtectHome=", "PrivateTmp=",
    "PrivateMounts=", "PrivateDevices=", "DevicePolicy=", "ProtectClock=",
    "ProtectKernelTunables=", "ProtectKernelModules=", "ProtectKernelLogs=",
    "ProtectControlGroups=", "ProtectHostname=", "ProtectProc=", "ProcSubset=",
    "RestrictSUIDSGID=", "LockPersonality=", "RestrictRealtime=", "RemoveIPC=",
    "KeyringMode=", "MemoryDenyWriteExecute=", "NoNewPrivileges=", "CapabilityBoundingSet=",
    "AmbientCapabilities=", "PrivateUsers=", "RestrictNamespaces=", "SystemCallFilter=",
    "SystemCallErrorNumber=", "SystemCallArchitectures=", "RestrictAddressFamilies=",
    "IPAddressDeny=", "IPAddressAllow=",
)


def test_committed_examples_match_the_templates():
    expected = example_files()
    on_disk = {str(p.relative_to(SYSTEMD_DIR)): p.read_text()
               for p in SYSTEMD_DIR.rglob("*") if p.is_file() and p.name != "README.md"}
    fix = "regenerate with: .venv/bin/python -m tests.deploy.unit_examples"
    assert sorted(on_disk) == sorted(expected), fix
    for rel, text in expected.items():
        assert on_disk[rel] == text, f"systemd/{rel} drifted; {fix}"


def test_role_ships_the_same_unit_templates():
    for template in sr.DEFAULT_TEMPLATE_DIR.glob("*.j2"):
        copy = ROLE_TEMPLATES / template.name
        assert copy.is_file(), f"{copy} missing: cp templates/systemd/*.j2 {ROLE_TEMPLATES}"
        assert filecmp.cmp(template, copy, shallow=False), (
            f"{copy} differs from {template}: cp templates/systemd/*.j2 {ROLE_TEMPLATES}")


def test_comment_filter_matches_ansible():
    # In a subprocess: importing ansible patches sys.intern process-wide, which later breaks
    # torch's dynamo import (vLLM) in the same pytest process.
    import json
    import subprocess
    import sys

    texts = ["Ansible managed", sr.GENERATED_STAMP]
    code = ("import json, sys\nfrom ansible.plugins.filter.core import comment\n"
            "print(json.dumps([comment(t) for t in json.loads(sys.argv[1])]))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(texts)], capture_output=True,
                         text=True, check=True).stdout
    assert [sr._comment(t) for t in texts] == json.loads(out)


def test_every_hardening_line_says_when_it_may_be_relaxed():
    text = (sr.DEFAULT_TEMPLATE_DIR / "kvp-lmcache@.service.j2").read_text()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(HARDENING):
            block = []
            j = i - 1
            while j >= 0 and (lines[j].startswith("#") or lines[j].startswith(HARDENING)):
                block.append(lines[j])
                j -= 1
            comment = " ".join(b for b in block if b.startswith("#"))
            assert re.search(r"Relax|relax|Cannot be enabled|Enable only", comment), line


def test_units_render_every_value():
    settings = sr.UnitSettings(user="svc", group="svcgrp", kvp_admin="/x/bin/kvp-admin",
                               config_dir="/cfg", state_dir="/st", log_dir="/lg",
                               stop_timeout_sec=300)
    units = sr.render_units(settings, stamp="STAMP")
    lmcache = units["kvp-lmcache@.service"]
    assert lmcache.startswith("#\n# STAMP\n#\n")
    assert "User=svc\nGroup=svcgrp\n" in lmcache
    assert "ExecStart=/x/bin/kvp-admin launch /cfg/%i/identity.env --foreground --no-vllm" \
        in lmcache
    assert "ReadWritePaths=/st/%i /lg/%i\n" in lmcache
    assert "TimeoutStopSec=300\n" in lmcache
    assert "{{" not in "".join(units.values())
    assert set(units) == set(sr.UNIT_TEMPLATES.values())
    assert not [u for u in units if "prune" in u]


def test_vllm_unit_is_ordered_but_not_bound():
    vllm = sr.render_units(sr.UnitSettings())["kvp-vllm@.service"]
    settings = [ln for ln in vllm.splitlines() if ln and not ln.startswith("#")]
    assert "After=network-online.target docker.service kvp-lmcache@%i.service" in settings
    assert not [ln for ln in settings
                if ln.startswith(("Requires=", "BindsTo=", "PartOf=", "Requisite="))
                and "kvp-lmcache" in ln]


def test_vllm_unit_stops_vllm_through_its_api_server_only():
    """KillMode=mixed: the stop's SIGTERM goes to the main process (vLLM's API server), which
    drains and stops its engine core and worker in order; a SIGTERM sent to the worker itself
    mid-step left wrong KV in the cache (bench/orphan_repro.py --signal term-worker)."""
    vllm = sr.render_units(sr.UnitSettings())["kvp-vllm@.service"]
    settings = [ln for ln in vllm.splitlines() if ln and not ln.startswith("#")]
    assert "KillMode=mixed" in settings
    assert not [ln for ln in settings if ln.startswith("KillSignal=") and "TERM" not in ln]


def test_vllm_unit_is_active_only_after_the_warmup():
    """ExecStartPost waits for vLLM and warms up within the start timeout less 30 s, with no
    "-": a failed warm-up exits 0, a failed canary exits 3 and fails the unit (then
    Restart=always serves recomputed). The health unit runs the canary, counts warming
    (3) as a completed check, like degraded (1); only down (2) fails it; it may write the
    canary's record and nothing else of the state."""
    units = sr.render_units(sr.UnitSettings(kvp_admin="/k/kvp-admin", config_dir="/cfg",
                                            vllm_start_timeout_sec=900))
    settings = [ln for ln in units["kvp-vllm@.service"].splitlines()
                if ln and not ln.startswith("#")]
    post = [ln for ln in settings if ln.startswith("ExecStartPost=")]
    assert post == ["ExecStartPost=/k/kvp-admin launch /cfg/%i/identity.env --warmup-only "
                    "--deadline 870 --vllm-pid $MAINPID"]
    assert "TimeoutStartSec=900" in settings
    assert "Restart=always" in settings
    health = units["kvp-health@.service"].splitlines()
    assert [ln for ln in health if ln.startswith("SuccessExitStatus=")] == ["SuccessExitStatus=1 3"]
    assert [ln for ln in health if ln.startswith("ExecStart=")][-1] == \
        "ExecStart=/k/kvp-admin health /cfg/%i/identity.env --json --canary $KVP_HEALTH_ARGS"
    writable = [ln for ln in health if ln.startswith("ReadWritePaths=")]
    assert writable[0] == f"ReadWritePaths=-{sr.UnitSettings().state_dir}/%i/canary", writable
    with pytest.raises(sr.UnitRenderError, match="'vllm_start_timeout_sec'"):
        sr.render_units(sr.UnitSettings(vllm_start_timeout_sec=60))


def test_dropins_per_instance():
    gpu = sr.InstanceSettings(name="m-1", cache_root="/nvme/m-1", vllm=True, gpu_devices=True,
                              allow_networks=("10.1.0.0/16",))
    files = sr.render_instance_dropins(gpu)
    lm = files["kvp-lmcache@m-1.service.d/10-kvpersist.conf"]
    assert "ReadWritePaths=/nvme/m-1\n" in lm
    assert "PrivateDevices=no" in lm and "DeviceAllow=char-nvidia-frontend rw" in lm
    assert "IPAddressAllow=10.1.0.0/16" in lm
    assert "Environment=KVP_HEALTH_ARGS=\n" in files["kvp-health@m-1.service.d/10-kvpersist.conf"]
    assert "Nice=5" not in lm
    relaxed = sr.render_instance_dropins(replace(gpu, extra_settings=("PrivateUsers=no",)))
    assert "\nPrivateUsers=no\n" in relaxed["kvp-lmcache@m-1.service.d/10-kvpersist.conf"]
    cpu = sr.render_instance_dropins(replace(gpu, vllm=False, gpu_devices=False,
                                             allow_networks=()))
    lm = cpu["kvp-lmcache@m-1.service.d/10-kvpersist.conf"]
    assert "PrivateDevices" not in lm and "IPAddressAllow" not in lm
    assert "--no-vllm" in cpu["kvp-health@m-1.service.d/10-kvpersist.conf"]


def _deployment(**settings: str):  # type: ignore[no-untyped-def]
    from kvpersist.config.deployment import build_deployment
    from kvpersist.config.generic import GenericConfig

    from ..unit.test_identity import BASE

    values = {**BASE, "KVP_CACHE_ROOT": "/nvme/r", "KVP_SERVED_MODEL_NAME": "m",
              "KVP_MODEL_PATH": "/models/m", **settings}
    return build_deployment("r", "r.env", values, {}, GenericConfig())


def test_dropins_follow_the_deployments_binds():
    """IPAddressDeny=any/IPAddressAllow=localhost stays for a loopback deployment; a remote
    bind (refused without its KVP_ALLOW_REMOTE_* key) allows its peers and, for a specific
    address, that address in both the server's and the health check's unit."""
    loop = sr.render_instance_dropins(sr.instance_for(_deployment()))
    assert not [t for t in loop.values() if "IPAddressAllow" in t]
    dep = _deployment(KVP_LMCACHE_HOST="10.1.2.3", KVP_ALLOW_REMOTE_LMCACHE="10.1.0.0/16",
                      KVP_LMCACHE_HTTP_HOST="0.0.0.0",
                      KVP_ALLOW_REMOTE_LMCACHE_HTTP="10.9.0.5, 10.1.0.0/16",
                      KVP_VLLM_HOST="0.0.0.0", KVP_ALLOW_REMOTE_VLLM="any")
    inst = sr.instance_for(dep, vllm=True, allow_networks=("192.168.0.0/24",))
    assert inst.remote_peers == ("10.1.0.0/16", "10.9.0.5")  # vLLM's peers: not this unit's
    assert inst.bind_addresses == ("10.1.2.3",)  # wildcards are reached through loopback
    files = sr.render_instance_dropins(inst)
    lm = files["kvp-lmcache@r.service.d/10-kvpersist.conf"].splitlines()
    assert [ln for ln in lm if ln.startswith("IPAddress")] == [
        "IPAddressAllow=192.168.0.0/24", "IPAddressAllow=10.1.0.0/16 10.9.0.5",
        "IPAddressAllow=10.1.2.3"]
    health = files["kvp-health@r.service.d/10-kvpersist.conf"].splitlines()
    assert [ln for ln in health if ln.startswith("IPAddress")] == ["IPAddressAllow=10.1.2.3"]
    anyone = sr.instance_for(_deployment(KVP_LMCACHE_HTTP_HOST="::",
                                         KVP_ALLOW_REMOTE_LMCACHE_HTTP="any"))
    lm_any = sr.render_instance_dropins(anyone)["kvp-lmcache@r.service.d/10-kvpersist.conf"]
    assert "\nIPAddressAllow=any\n" in lm_any



def test_dropins_allow_the_shared_tiers_store_in_both_units():
    """The units deny every address but localhost: a deployment with a shared tier on
    another host allows the store's nodes in the cache server's unit (it stores and loads
    chunks there) and the health check's (it probes the store, refreshes the fleet
    record); a cluster or a host name needs the addresses given, or rendering fails."""
    tier = {"KVP_SHARED_TIER_SECRET_FILE": "/etc/kvp/r.secret"}
    inst = sr.instance_for(_deployment(KVP_SHARED_TIER="valkey://10.0.5.11:6379", **tier))
    assert inst.shared_tier_networks == ("10.0.5.11",)
    files = sr.render_instance_dropins(inst)
    for unit in ("kvp-lmcache@r", "kvp-health@r"):
        lines = files[f"{unit}.service.d/10-kvpersist.conf"].splitlines()
        assert [ln for ln in lines if ln.startswith("IPAddress")] == [
            "IPAddressAllow=10.0.5.11"], unit
    cluster = _deployment(KVP_SHARED_TIER="valkey://10.0.5.11:6379,10.0.5.12:6379?cluster=1",
                          **tier)
    with pytest.raises(sr.UnitRenderError, match="cluster's nodes are discovered"):
        sr.instance_for(cluster)
    given = sr.instance_for(cluster, shared_tier_networks=("10.0.5.0/24", "10.0.5.0/24"))
    assert given.shared_tier_networks == ("10.0.5.0/24",)
    named = _deployment(KVP_SHARED_TIER="valkey://redis.internal:6379", **tier)
    with pytest.raises(sr.UnitRenderError, match="redis.internal is a host name"):
        sr.instance_for(named)
    assert sr.instance_for(_deployment()).shared_tier_networks == ()

def test_invalid_values_are_all_reported():
    bad = sr.UnitSettings(user="Root!", kvp_admin="bin/kvp-admin", config_dir="/a b",
                          stop_timeout_sec=0)
    with pytest.raises(sr.UnitRenderError) as err:
        sr.render_units(bad)
    message = str(err.value)
    for field in ("'user'", "'kvp_admin'", "'config_dir'", "'stop_timeout_sec'"):
        assert f"At {field}" in message
    with pytest.raises(sr.UnitRenderError) as err:
        sr.render_instance_dropins(sr.InstanceSettings(
            name="../x", cache_root="relative", allow_networks=("a b",),
            extra_settings=("PrivateUsers=no\n[Install]",), remote_peers=("10.0.0.0/8\nX=1",),
            bind_addresses=("fe80::1%eth0",)))
    for field in ("'name'", "'cache_root'", "'allow_networks[0]'", "'extra_settings[0]'",
                  "'remote_peers[0]'", "'bind_addresses[0]'"):
        assert f"At {field}" in str(err.value)


def test_unknown_template_value_is_an_error(tmp_path):
    (tmp_path / "kvp-lmcache@.service.j2").write_text("{{ kvp_unit.nope }}\n")
    with pytest.raises(sr.UnitRenderError, match="nope"):
        sr.render_units(sr.UnitSettings(), template_dir=tmp_path)
