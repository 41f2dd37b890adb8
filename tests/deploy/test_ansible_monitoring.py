"""The role's optional monitoring files: off by default; when asked, the rule file (checked
by the real promtool first) and the dashboard land in the given directories, a second run
changes nothing, and a rule file promtool refuses is never installed."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from .conftest import kvp_converge

pytestmark = pytest.mark.deploy

MONITORING = kvp_converge.REPO / "monitoring"
RULES_DIR = "/etc/prometheus/rules.d"
DASHBOARDS_DIR = "/srv/grafana/dashboards"
#: what a monitoring-only host runs (the role's other tasks are covered by the session's
#: converge, which installs none of these files)
ONLY_MONITORING = ("--tags", "kvp_monitoring")


def test_off_by_default(converged: kvp_converge.Converged) -> None:
    assert converged.first.returncode == 0, converged.first.output[-6000:]
    assert not (converged.prefix / "etc" / "prometheus").exists()
    assert not (converged.prefix / "var" / "lib" / "grafana").exists()


@pytest.fixture(scope="module")
def base(converged: kvp_converge.Converged) -> Iterator[Path]:
    # after the session's converge, which created the service account: these runs leave the
    # account alone (its home is the session prefix's state dir; a second prefix would move
    # it and make the session's idempotence checks see a change)
    assert converged.first.returncode == 0, converged.first.output[-6000:]
    path = kvp_converge.make_base("kvp-monitoring-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def monitoring_vars(base: Path, **extra: object) -> Path:
    data = kvp_converge.ci_vars(base, base)
    data["kvp_deployments"] = []  # the monitoring files need no deployment
    data["kvp_create_user"] = False  # the session's converge owns the service account
    data.update({"kvp_install_alert_rules": True, "kvp_prometheus_rules_dir": RULES_DIR,
                 "kvp_install_dashboard": True, "kvp_grafana_dashboards_dir": DASHBOARDS_DIR,
                 "kvp_promtool": shutil.which("promtool") or "/usr/bin/promtool", **extra})
    path = base / f"vars-{len(list(base.glob('vars-*.yml')))}.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_rules_and_dashboard_installed_then_unchanged(base: Path) -> None:
    vars_file = monitoring_vars(base)
    first = kvp_converge.run_playbook(base, vars_file, *ONLY_MONITORING)
    assert first.returncode == 0, first.output[-6000:]
    prefix = base / "root"
    rules = prefix / RULES_DIR.lstrip("/") / "kvpersist-rules.yml"
    dashboard = prefix / DASHBOARDS_DIR.lstrip("/") / "kvpersist-dashboard.json"
    assert rules.read_bytes() == (MONITORING / "kvpersist-rules.yml").read_bytes()
    assert dashboard.read_bytes() == (
        MONITORING / "grafana" / "kvpersist-dashboard.json").read_bytes()
    for path in (rules, dashboard):
        assert oct(path.stat().st_mode & 0o777) == oct(0o644)
        assert path.stat().st_uid == 0
    second = kvp_converge.run_playbook(base, vars_file, *ONLY_MONITORING)
    assert second.returncode == 0, second.output[-6000:]
    assert second.recap.get("changed") == 0, second.output[-6000:]


def test_rule_file_promtool_refuses_is_not_installed(base: Path) -> None:
    source = base / "bad-monitoring"
    (source / "grafana").mkdir(parents=True)
    shutil.copy(MONITORING / "grafana" / "kvpersist-dashboard.json", source / "grafana")
    (source / "kvpersist-rules.yml").write_text(
        "groups:\n  - name: broken\n    rules:\n      - alert: Broken\n"
        "        expr: sum by (root (kvpersist_l2_used_bytes)\n")
    dest = base / "root-bad"
    run = kvp_converge.run_playbook(base, monitoring_vars(
        base, kvp_monitoring_source=str(source), kvp_root_prefix=str(dest)), *ONLY_MONITORING)
    assert run.returncode != 0
    assert "failed to validate" in run.output, run.output[-4000:]
    assert not (dest / RULES_DIR.lstrip("/") / "kvpersist-rules.yml").exists()
