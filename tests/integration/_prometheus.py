"""Start a real Prometheus and a real node_exporter (Debian's packages) for tests.

Usage::

    with monitoring(tmp_path / "mon", lmcache=[stack.http], rules=short_for_rules(...)) as mon:
        run kvp-admin metrics ... --textfile mon.textfile_dir
        mon.wait_value('kvpersist_namespace_bytes{namespace="..."}', lambda v: v > 0)

node_exporter serves only its textfile collector (the directory ``kvp-admin metrics
--textfile`` writes into); Prometheus scrapes it and each LMCache server's ``/metrics`` every
second and evaluates the rule file every second. Both listen on free loopback ports, keep their
data in the given temp directory, and are stopped (SIGTERM, then SIGKILL, by pid) on exit.
Nothing is mocked; a missing binary fails the test with the package to install.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from ..conftest import REPO, free_port

#: the rule file of monitoring/ (alerts and recording rules on kvpersist's and LMCache's metrics)
RULES = REPO / "monitoring" / "kvpersist-rules.yml"
#: scrape and rule evaluation interval of the test Prometheus
INTERVAL = "1s"


def binary(name: str, package: str) -> str:
    """The path of ``name``; fails the test (no skip) when it is not installed."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: scripts/setup.sh installs it "
                    f"(apt-get install {package})", pytrace=False)
    return path


def short_for_rules(dest: Path, for_: str = "2s", src: Path = RULES) -> Path:
    """A copy of the rule file at ``dest`` with every ``for:`` shortened to ``for_`` (alerts
    fire within seconds instead of minutes); the rules themselves are unchanged."""
    if not src.is_file():
        pytest.fail(f"{src.relative_to(REPO)} is missing (the alert and recording rules "
                    "this test runs in Prometheus)", pytrace=False)
    doc = yaml.safe_load(src.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = for_
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


def _stop(proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, what: str,
                timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready at {url} after {timeout} s:\n{_tail(log)}")


@dataclass
class Monitoring:
    """A running node_exporter (textfile collector) and Prometheus scraping it."""

    textfile_dir: Path
    node_url: str
    prom_url: str
    prom_log: Path
    node_log: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) ``expr`` evaluates to now."""
        r = requests.get(f"{self.prom_url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {body}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def values(self, expr: str) -> list[float]:
        return [float(s["value"][1]) for s in self.query(expr)]

    def wait_for(self, expr: str, pred: Callable[[list[dict[str, Any]]], bool],
                 timeout: float = 20, what: str = "") -> list[dict[str, Any]]:
        """Poll ``expr`` until ``pred(result)`` holds; its result then. Fails with the last
        result and the configured targets' health otherwise."""
        deadline = time.monotonic() + timeout
        result = self.query(expr)
        while not pred(result):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{what or expr}: not met after {timeout} s; last result of {expr!r}: "
                    f"{result}\ntargets: {self.targets()}\nprometheus log:\n"
                    f"{_tail(self.prom_log, 1500)}")
            time.sleep(0.25)
            result = self.query(expr)
        return result

    def wait_value(self, expr: str, pred: Callable[[float], bool], timeout: float = 20,
                   what: str = "") -> float:
        """Poll until ``expr`` returns exactly one sample whose value satisfies ``pred``."""
        res = self.wait_for(expr, lambda r: len(r) == 1 and pred(float(r[0]["value"][1])),
                            timeout, what)
        return float(res[0]["value"][1])

    def targets(self) -> list[tuple[str, str, str]]:
        """(job, health, last error) of each active scrape target."""
        try:
            body = requests.get(f"{self.prom_url}/api/v1/targets", timeout=5).json()
        except (requests.RequestException, ValueError) as e:
            return [("?", "?", str(e))]
        return [(t["labels"].get("job", ""), t["health"], t.get("lastError", ""))
                for t in body["data"]["activeTargets"]]

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule (recording and alerting) as /api/v1/rules reports it."""
        body = requests.get(f"{self.prom_url}/api/v1/rules", timeout=5).json()
        return [r for g in body["data"]["groups"] for r in g["rules"]]

    def alert_rule(self, alertname: str) -> dict[str, Any]:
        """The alerting rule ``alertname`` as /api/v1/rules reports it (state, health,
        lastEvaluation as a Unix timestamp in ``last_evaluation_s``)."""
        body = requests.get(f"{self.prom_url}/api/v1/rules", params={"type": "alert"},
                            timeout=5).json()
        for group in body["data"]["groups"]:
            for rule in group["rules"]:
                if rule["name"] == alertname:
                    ts = re.sub(r"(\.\d{6})\d+", r"\1", rule["lastEvaluation"])
                    ts = ts.replace("Z", "+00:00")
                    return dict(rule, last_evaluation_s=datetime.fromisoformat(ts).timestamp())
        raise AssertionError(f"no alerting rule {alertname} loaded: {body}")

    def firing(self, alertname: str) -> list[dict[str, str]]:
        """Label sets of the firing instances of ``alertname`` (from the ALERTS series)."""
        return [s["metric"] for s in
                self.query(f'ALERTS{{alertname="{alertname}",alertstate="firing"}}')]


@contextlib.contextmanager
def monitoring(workdir: Path, *, lmcache: Sequence[str] = (), rules: Path | None = None,
               ) -> Iterator[Monitoring]:
    """Start node_exporter (textfile collector only) and Prometheus in ``workdir``; scrape
    node_exporter as job ``node`` and the LMCache servers at the ``lmcache`` base URLs
    (``http://127.0.0.1:PORT``, their ``/metrics``) as job ``lmcache``; load ``rules``.
    Both are stopped on exit."""
    node_bin = binary("prometheus-node-exporter", "prometheus-node-exporter")
    prom_bin = binary("prometheus", "prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    textfile_dir = workdir / "textfile"
    textfile_dir.mkdir(exist_ok=True)
    node_port, prom_port = free_port(), free_port()
    while prom_port == node_port:
        prom_port = free_port()
    config: dict[str, Any] = {
        "global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL,
                   "scrape_timeout": INTERVAL},
        "scrape_configs": [
            {"job_name": "node",
             "static_configs": [{"targets": [f"127.0.0.1:{node_port}"]}]},
        ],
    }
    if lmcache:
        config["scrape_configs"].append(
            {"job_name": "lmcache",
             "static_configs": [{"targets": [u.split("://", 1)[-1] for u in lmcache]}]})
    if rules is not None:
        config["rule_files"] = [str(rules)]
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))

    procs: list[subprocess.Popen[bytes]] = []
    node_log, prom_log = workdir / "node_exporter.log", workdir / "prometheus.log"
    try:
        with node_log.open("ab") as log:
            procs.append(subprocess.Popen(
                [node_bin, f"--web.listen-address=127.0.0.1:{node_port}",
                 "--collector.disable-defaults", "--collector.textfile",
                 f"--collector.textfile.directory={textfile_dir}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        with prom_log.open("ab") as log:
            procs.append(subprocess.Popen(
                [prom_bin, f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        node_url, prom_url = f"http://127.0.0.1:{node_port}", f"http://127.0.0.1:{prom_port}"
        _wait_ready(f"{node_url}/metrics", procs[0], node_log, "node_exporter")
        _wait_ready(f"{prom_url}/-/ready", procs[1], prom_log, "prometheus")
        yield Monitoring(textfile_dir, node_url, prom_url, prom_log, node_log)
    finally:
        for p in reversed(procs):
            _stop(p)
