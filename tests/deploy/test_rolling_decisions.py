"""ansible/rolling.yml's decisions, fast: which host it rolls, skips, stops and gates.

Two hosts of one inventory, each the local connection into its own prefix, converged by the
real role; ``kvp-admin`` is a stand-in (a shell script in a stand-in venv) that logs every
call under the host's prefix and answers ``health`` with what the test queued for that host.
No process is started or stopped: the deployments themselves, over SSH on real hosts, are
tests/deploy/test_hosts_fleet.py's. What is pinned here is the playbook's own logic: a
resumed roll (``kvp_roll_skip_ready``) leaves a host rolled to the same variables alone, says
why it rolls a host again, and a host that fails its gate stops the roll.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import kvp_converge

pytestmark = pytest.mark.deploy

ROLLING = kvp_converge.ANSIBLE_DIR / "rolling.yml"
HOSTS = ("h1", "h2")
NAME = "roll"
NS = "kvp-" + "a" * 32

#: kvp-admin, stand-in: the host is the prefix of the config path it is given
_KVP_ADMIN = r"""#!/bin/sh
cfg=
for a in "$@"; do
  case "$a" in
    --config=*) cfg=${a#--config=} ;;
    */etc/kvpersist/*/identity.env) cfg=$a ;;
  esac
done
if [ "$1" = --version ]; then echo "kvp-admin 0.2.0 (stand-in)"; exit 0; fi
prefix=${cfg%%/etc/kvpersist/*}
echo "$*" >> "$prefix/calls.log"
case "$1" in
  identity) echo "__NS__" ;;
  stop) echo '{"stopped": ["vllm", "server"]}' ;;
  launch) echo '{"namespace": "__NS__"}' ;;
  report) echo '{"namespaces": []}' ;;
  prune) echo '{"pruned": []}' ;;
  health)
    # each call answers the next queued line (the last one stays; healthy when none): the
    # statuses its probes see, in order; with --wait it probes on until healthy or the last
    line=healthy
    if [ -s "$prefix/health" ]; then
      line=$(head -n 1 "$prefix/health")
      [ "$(wc -l < "$prefix/health")" -gt 1 ] && sed -i 1d "$prefix/health"
    fi
    status=
    for s in $line; do
      status=$s
      case " $* " in *" --wait "*) [ "$s" = healthy ] && break ;; *) break ;; esac
    done
    case "$status" in healthy) rc=0 ;; degraded) rc=1 ;; down) rc=2 ;; *) rc=3 ;; esac
    printf '{"status": "%s", "namespace": "__NS__", "checks": [{"name": "stand_in",' "$status"
    printf ' "status": "%s", "detail": "queued by the test"}]}\n' \
      "$([ "$status" = healthy ] && echo ok || echo "$status")"
    exit "$rc" ;;
esac
exit 0
"""


@dataclass
class Roll:
    base: Path
    venv: Path

    def prefix(self, host: str) -> Path:
        return self.base / host

    def calls(self, host: str) -> list[str]:
        log = self.prefix(host) / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def queue_health(self, host: str, *calls: str) -> None:
        """What the next ``health`` calls on ``host`` answer: per call, the statuses its
        probes see in order ("down warming healthy"); the last call's answer stays."""
        (self.prefix(host) / "health").write_text("".join(f"{c}\n" for c in calls))

    def forget_calls(self) -> None:
        for h in HOSTS:
            (self.prefix(h) / "calls.log").unlink(missing_ok=True)
            (self.prefix(h) / "health").unlink(missing_ok=True)

    def inventory(self, **engine_args: str) -> Path:
        hosts: dict[str, Any] = {}
        for h in HOSTS:
            env = dict(kvp_converge._IDENTITY, KVP_L1_SIZE_GB=1, KVP_L2_BUDGET="1G",
                       KVP_DEVICE="cpu", KVP_MODEL_PATH="/srv/models/demo",
                       KVP_ENGINE_ARGS=engine_args.get(h, "--enforce-eager"))
            hosts[h] = {"kvp_root_prefix": str(self.prefix(h)), "kvp_deployments": [
                {"name": NAME, "cache_root": "/srv/nvme0/kvp/roll", "vllm": True,
                 "env": env}]}
        doc = {"kvpersist": {"hosts": hosts, "vars": {
            "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "ansible_become_method": "su",
            "kvp_user": "root", "kvp_group": "root", "kvp_create_user": False,
            "kvp_venv": str(self.venv), "kvp_venv_create": False,
            "kvp_install_package": False, "kvp_validate_identity": False,
            "kvp_manage_services": False, "kvp_create_cache_parents": True,
            "kvp_metrics_textfile_dir": "", "kvp_roll_via": "kvp-admin",
            "kvp_roll_ready_wait_seconds": 5}}}
        path = self.base / "inventory.yml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def playbook(self, *extra: str) -> kvp_converge.PlaybookRun:
        argv = [str(kvp_converge.VENV / "bin" / "ansible-playbook"), "-i",
                str(self.base / "inventory.yml"), str(ROLLING), *extra]
        proc = subprocess.run(argv, capture_output=True, text=True,
                              env=kvp_converge.ansible_env(self.base), timeout=600,
                              cwd=str(kvp_converge.REPO))
        return kvp_converge.PlaybookRun(argv, proc.returncode, proc.stdout + proc.stderr)


def recap(run: kvp_converge.PlaybookRun) -> dict[str, dict[str, int]]:
    out = {}
    for host, counts in re.findall(r"^(\w+)\s+:\s+(ok=.*)$", run.output, re.M):
        out[host] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counts)}
    return out


def rolled(calls: list[str]) -> bool:
    """The host was stopped and launched (rolled), from its stand-in's log."""
    return any(c.startswith("stop ") for c in calls) and any(c.startswith("launch ")
                                                             for c in calls)


def said_why(run: kvp_converge.PlaybookRun, host: str) -> str:
    """The reason the play gave for rolling ``host`` again ('' when it gave none)."""
    m = re.search(r"TASK \[Say why the host is rolled again[^\n]*\n(?:(?!\nTASK ).)*?"
                  rf"ok: \[{host}\] => \{{\s*\"msg\": \"([^\n]*)\"", run.output, re.S)
    return m.group(1) if m else ""


@pytest.fixture(scope="module")
def roll() -> Iterator[Roll]:
    base = kvp_converge.make_base("kvp-roll-decisions-")
    venv = base / "venv"
    (venv / "bin").mkdir(parents=True)
    script = venv / "bin" / "kvp-admin"
    script.write_text(_KVP_ADMIN.replace("__NS__", NS))
    script.chmod(0o755)
    for h in HOSTS:
        (base / h).mkdir()
    try:
        yield Roll(base, venv)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_roll_stops_converges_launches_and_gates_each_host(roll: Roll) -> None:
    roll.inventory()
    run = roll.playbook()
    assert run.returncode == 0, run.output[-6000:]
    for h in HOSTS:
        calls = roll.calls(h)
        assert rolled(calls), (h, calls)
        assert any(c.startswith("health ") and "--wait" in c for c in calls), calls
        marker = roll.prefix(h) / "var" / "lib" / "kvpersist" / "roll.json"
        assert set(json.loads(marker.read_text())) == {"fingerprint"}
    assert "is stale" not in run.output and "no stale namespace" in run.output


def test_a_resumed_roll_leaves_hosts_rolled_to_these_variables_alone(roll: Roll) -> None:
    roll.forget_calls()
    run = roll.playbook("-e", "kvp_roll_skip_ready=true")
    assert run.returncode == 0, run.output[-6000:]
    for h in HOSTS:
        calls = roll.calls(h)
        assert not rolled(calls), (h, calls)
        assert [c.split()[0] for c in calls if not c.startswith("report ")] == ["health"], calls
        assert said_why(run, h) == "", run.output[-4000:]
    assert all(c["failed"] == 0 for c in recap(run).values())


def test_a_resumed_roll_waits_for_a_rolled_host_and_leaves_it_alone(roll: Roll) -> None:
    """A rolled host whose first probe is not healthy (a probe that missed on a loaded host,
    a warm-up still loading) is probed again until healthy, then left alone. When the check
    was one probe, a resumed roll on a loaded machine once restarted a host that already
    ran the new version."""
    roll.forget_calls()
    roll.queue_health("h1", "down warming healthy")
    run = roll.playbook("-e", "kvp_roll_skip_ready=true", "-e", "kvp_roll_skip_wait_seconds=7")
    assert run.returncode == 0, run.output[-6000:]
    calls = roll.calls("h1")
    assert not rolled(calls), calls
    assert [c for c in calls if c.startswith("health ")] == [
        f"health {roll.prefix('h1')}/etc/kvpersist/{NAME}/identity.env --wait 7 --json"], calls
    assert said_why(run, "h1") == ""


def test_a_resumed_roll_rolls_a_rolled_host_that_stays_unhealthy_and_says_why(
        roll: Roll) -> None:
    roll.forget_calls()
    roll.queue_health("h1", "degraded degraded", "healthy")
    run = roll.playbook("-e", "kvp_roll_skip_ready=true", "-e", "kvp_roll_skip_wait_seconds=7")
    assert run.returncode == 0, run.output[-6000:]
    assert rolled(roll.calls("h1")), roll.calls("h1")
    assert not rolled(roll.calls("h2")), roll.calls("h2")
    assert said_why(run, "h1") == ("rolled to these variables, but not healthy: roll: degraded "
                                   "[stand_in degraded: queued by the test];"), run.output[-4000:]


def test_a_resumed_roll_rolls_a_host_rolled_to_other_variables_and_says_so(roll: Roll) -> None:
    roll.forget_calls()
    roll.inventory(h2="--enforce-eager --hf-overrides.rope_theta=20000")
    run = roll.playbook("-e", "kvp_roll_skip_ready=true")
    assert run.returncode == 0, run.output[-6000:]
    assert not rolled(roll.calls("h1")), roll.calls("h1")
    assert rolled(roll.calls("h2")), roll.calls("h2")
    assert said_why(run, "h2") == "it was rolled to other variables", run.output[-4000:]


def test_a_host_that_fails_its_gate_stops_the_roll(roll: Roll) -> None:
    roll.forget_calls()
    roll.inventory(h1="--enforce-eager --hf-overrides.rope_theta=30000",
                   h2="--enforce-eager --hf-overrides.rope_theta=30000")
    roll.queue_health("h1", "degraded")
    run = roll.playbook()
    counts = recap(run)
    assert run.returncode != 0, run.output[-4000:]
    assert counts["h1"]["failed"] == 1, counts
    assert roll.calls("h2") == [], roll.calls("h2")  # never touched
    assert "is stale" not in run.output
