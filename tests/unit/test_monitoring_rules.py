"""monitoring/: the Prometheus rules pass promtool (syntax and their unit tests in
monitoring/tests/), select only documented kvpersist metrics, and ``kvp-admin metrics``
writes an exposition that ``promtool check metrics`` accepts. Real promtool, no server."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ..cli import kvp
from ..conftest import REPO
from ..promql_names import documented_names, metric_names

RULES = REPO / "monitoring" / "kvpersist-rules.yml"
RULE_TESTS = sorted((REPO / "monitoring" / "tests").glob("*.yml"))
DOC = REPO / "docs" / "observability.md"
NAMESPACE = "kvp-0123456789abcdef0123456789abcdef"


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: bash scripts/setup.sh installs the prometheus package"
    return subprocess.run([exe, *args], input=stdin, capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def rules() -> list[dict[str, str]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_promtool_check_rules() -> None:
    cp = promtool("check", "rules", str(RULES))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert f"SUCCESS: {len(rules())} rules found" in cp.stdout


def test_promtool_test_rules() -> None:
    assert RULE_TESTS, "no promtool unit tests under monitoring/tests/"
    cp = promtool("test", "rules", *map(str, RULE_TESTS))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert cp.stdout.count("SUCCESS") == len(RULE_TESTS), cp.stdout


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    tested: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                if check.get("exp_alerts"):
                    tested.add(check["alertname"])
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts - tested == set()


def test_every_alert_is_documented_with_severity_and_summary() -> None:
    doc = DOC.read_text()
    for rule in rules():
        if "alert" in rule:
            assert f"`{rule['alert']}`" in doc, rule["alert"]
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}
            assert rule["annotations"]["summary"]


def test_rules_select_only_documented_kvpersist_metrics() -> None:
    documented = documented_names(DOC)
    recorded = {r["record"] for r in rules() if "record" in r}
    used = set().union(*(metric_names(r["expr"]) for r in rules())) - recorded
    kvp = {n for n in used if n.startswith("kvpersist_")}
    assert kvp and kvp <= documented, kvp - documented
    # the others come from LMCache, node_exporter and the client libraries' process metrics
    # (tests/integration/test_monitoring_stack.py checks them against real expositions)
    others = used - kvp
    assert all(n.startswith(("lmcache_mp_", "node_textfile_", "process_")) for n in others), others


@pytest.fixture
def sample_root(tmp_path: Path) -> Path:
    """A cache root with two chunk files, a temp file and a foreign file."""
    root = tmp_path / "cache"
    root.mkdir()
    for h in ("a" * 64, "b" * 64):
        (root / f"{NAMESPACE}_01000100_0_{h}.bin").write_bytes(b"\0" * 4096)
    (root / f"{NAMESPACE}_01000100_0_{'c' * 64}.bin.tmp.{'d' * 32}").write_bytes(b"\0" * 100)
    (root / "notes.txt").write_text("not a chunk\n")
    return root


def test_kvp_admin_metrics_exposition_passes_promtool_check_metrics(sample_root: Path) -> None:
    cp = kvp("metrics", "--root", str(sample_root))
    assert cp.returncode == 0, cp.stderr
    text = cp.stdout
    assert f'kvpersist_namespace_files{{namespace="{NAMESPACE}"' in text
    assert "kvpersist_temp_files{" in text
    check = promtool("check", "metrics", stdin=text)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout + check.stderr == ""
