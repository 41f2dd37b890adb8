"""Gates on the Ansible content: ansible-lint (production profile) clean, a real
ansible-playbook run against localhost into a temporary prefix, a second run with
changed=0, --check --diff, handlers only on change, and variable validation."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess

import pytest
import yaml

from .conftest import kvp_converge

pytestmark = pytest.mark.deploy


def test_ansible_lint_production_profile_clean():
    env = dict(os.environ, ANSIBLE_CONFIG=str(kvp_converge.ANSIBLE_DIR / "ansible.cfg"),
               PATH=f"{kvp_converge.VENV / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
               NO_COLOR="1")
    proc = subprocess.run(
        [str(kvp_converge.VENV / "bin" / "ansible-lint"), "--profile", "production",
         "--offline", "--nocolor", "ansible/"],
        capture_output=True, text=True, cwd=str(kvp_converge.REPO), env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Profile 'production' was required, and it passed" in out, out
    assert "0 failure(s), 0 warning(s)" in out, out


def test_first_run_converges(converged):
    run = converged.first
    assert run.returncode == 0, run.output[-6000:]
    assert run.recap.get("failed") == 0 and run.recap.get("unreachable") == 0
    assert run.recap.get("changed", 0) > 0
    # Handlers were notified by the changes (and skipped: services are not managed here).
    assert "Kvp restart changed deployments" in run.handlers_run()
    assert sorted(run.handler_items("Kvp restart changed deployments")) == sorted(
        d["name"] for d in converged.vars["kvp_deployments"])
    # the vaulted shared-tier password and serde key never reach the play's output
    assert kvp_converge.CI_SHARED_PASSWORD not in run.output
    assert kvp_converge.CI_SERDE_KEY_B64 not in run.output
    assert kvp_converge.CI_NAMESPACE_KEY_B64 not in run.output


def test_second_run_changes_nothing(converged):
    run = converged.second
    assert run.returncode == 0, run.output[-6000:]
    assert run.recap.get("changed") == 0, run.output[-6000:]
    assert run.handlers_run() == [], "no handler may run without a change"


def test_check_diff_on_converged_host_changes_nothing(converged):
    run = kvp_converge.run_playbook(converged.base, converged.vars_file, "--check", "--diff")
    assert run.returncode == 0, run.output[-6000:]
    assert run.recap.get("changed") == 0, run.output[-6000:]


def test_check_diff_on_fresh_host_writes_nothing():
    base = kvp_converge.make_base("kvp-check-")
    try:
        stand_in = base / "bin"
        data = kvp_converge.ci_vars(base, stand_in)
        data["kvp_deployments"] = data["kvp_deployments"][:1]  # one is enough here
        vars_file = base / "vars.yml"
        vars_file.write_text(yaml.safe_dump(data))
        run = kvp_converge.run_playbook(base, vars_file, "--check", "--diff")
        assert run.returncode == 0, run.output[-6000:]
        assert run.recap.get("changed", 0) > 0
        assert "KVP_CACHE_ROOT=" in run.output, "--diff shows the identity.env to be written"
        assert not (base / "root").exists(), "--check must not create anything"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_identity_change_restarts_only_that_deployment_and_keeps_cache_data(converged):
    """One deployment's identity.env changes: only it is restarted, and a converge over a
    cache root holding chunk files leaves them untouched (the role never prunes). The new
    vars become the converged state (the testinfra checks read them afterwards)."""
    first = converged.vars["kvp_deployments"][0]
    root = converged.prefix / first["cache_root"].lstrip("/")
    chunk = root / "kvp-0123456789abcdef0123456789abcdef_01000100_0_deadbeef.bin"
    chunk.write_bytes(b"x" * 64)
    chunk.chmod(0o600)
    data = copy.deepcopy(converged.vars)
    changed = data["kvp_deployments"][1]
    changed["env"]["KVP_L1_SIZE_GB"] = 2
    vars_file = converged.write_vars("vars-changed.yml", data)
    try:
        run = kvp_converge.run_playbook(converged.base, vars_file, "--diff")
        assert run.returncode == 0, run.output[-6000:]
        assert run.recap.get("changed") == 1, run.output[-6000:]
        assert run.handler_items("Kvp restart changed deployments") == [changed["name"]]
        assert run.handler_items("Kvp restart changed vLLM units") == [changed["name"]]
        assert run.handler_items("Kvp restart all cache servers") == []
        assert "-KVP_L1_SIZE_GB=1" in run.output and "+KVP_L1_SIZE_GB=2" in run.output
        assert chunk.read_bytes() == b"x" * 64
        assert oct(chunk.stat().st_mode & 0o777) == oct(0o600)
    finally:
        chunk.unlink()
        converged.vars, converged.vars_file = data, vars_file


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d["kvp_deployments"][0]["env"].update(KVP_CACHE_ROOT="/elsewhere"),
     "At 'kvp_deployments[0]'"),
    (lambda d: d["kvp_deployments"][1].update(name="bad name"), "At 'kvp_deployments[1]'"),
    (lambda d: d["kvp_deployments"][1].update(name=d["kvp_deployments"][0]["name"]),
     "share a name"),
    (lambda d: d["kvp_deployments"][1].update(extra_settings=["PrivateUsers=no\n[Install]"]),
     "At 'kvp_deployments[1]'"),
])
def test_invalid_deployments_are_refused(converged, mutate, message):
    data = copy.deepcopy(converged.vars)
    mutate(data)
    run = kvp_converge.run_playbook(converged.base, converged.write_vars("vars-bad.yml", data))
    assert run.returncode != 0
    assert message in run.output, run.output[-4000:]
    assert run.recap.get("changed") == 0
    # a failed loop item is printed in full: never an entry with its vaulted secrets
    for secret in (kvp_converge.CI_SHARED_PASSWORD, kvp_converge.CI_SERDE_KEY_B64,
                   kvp_converge.CI_NAMESPACE_KEY_B64):
        assert secret not in run.output
