"""Use case: kvpersist's facts as Prometheus metrics (``kvp-admin metrics``).

One scan per cache root (the scan ``report`` runs) gives the per-namespace and per-root figures,
the recorded ``verify``/``prune`` runs give their times and results, one health probe per
deployment gives the state of each component, and one measurement per shared-tier store (the
probe of ``health`` and the scan of ``report --tier shared``, however many deployments point at
it) gives the store's figures. The families are built with ``prometheus_client`` (its metric
families, registry and text exposition); names and labels are documented in
docs/observability.md. :func:`root_families`, :func:`store_families` and
:func:`health_families` are pure; :func:`collect` does the I/O.

With ``--textfile`` the exposition is split into one file per cache root, one per shared-tier
store and one per deployment, so that two deployments sharing a root or a store (each with its
own timer) never export the same series twice: node_exporter rejects a series that two files
both carry.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from kvpersist.config.deployment import Deployment
from kvpersist.config.loader import load_deployment
from kvpersist.config.shared_tier import SharedTier
from kvpersist.errors import KvpError, UsageError
from kvpersist.l2.inventory import open_existing, real_root, resolve_inventory
from kvpersist.l2.layout import display_name
from kvpersist.l2.report import report_on
from kvpersist.l2.runs import read_runs
from kvpersist.l2.scan import ProgressFn, ScanResult
from kvpersist.l2.shared.credentials import read_secret_file
from kvpersist.l2.shared.store import StoreMeasurement, measure
from kvpersist.stack.health import (
    COMPONENTS,
    EXIT,
    HealthReport,
    component_status,
    health_report,
)
from kvpersist.stack.locate import locate
from kvpersist.system.files import open_textfile_dir, service_uids, write_textfile_at
from kvpersist.system.untrusted import show_path

PREFIX = "kvpersist_"
_HEALTH_VALUE = {"ok": 0, "degraded": 1, "down": 2, "warming": 3}
_CANARY_VALUE = {"passed": 0, "unknown": 1, "failed": 2}


def _epoch(stamp: Any) -> float | None:
    """``2026-12-06T04:30:00Z`` -> seconds since the epoch (None for anything else)."""
    from datetime import UTC, datetime

    if not isinstance(stamp, str):
        return None
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None
INFO_LABELS = ("model_id", "model_revision", "kv_cache_dtype", "tensor_parallel_size",
               "served_model_name", "config")


@dataclass
class RootFacts:
    """What one cache root holds: the report document, the scan behind it (for the exact
    nanosecond times the document rounds to seconds) and its recorded runs."""

    doc: dict[str, Any]
    scan: ScanResult
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per active namespace, info labels from its deployment (used when no manifest has them)
    deployment_info: dict[str, dict[str, str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def root(self) -> str:
        """The root as shown (escaped, the report's ``root``): the value of its labels."""
        return str(self.doc["root"])

    @property
    def path(self) -> str:
        """The root's real path, as the OS gave it (may hold bytes that are not UTF-8)."""
        return self.scan.root


def _labels(labels: dict[str, str]) -> list[str]:
    """Label values safe to expose: a path may hold bytes that are not UTF-8 or control
    characters (the exposition is UTF-8 text, one sample per line), so every value is shown
    escaped as ``report`` shows it (:func:`~kvpersist.l2.layout.display_name`)."""
    return [display_name(v) for v in labels.values()]


@dataclass
class Exposition:
    """Metric families by name, filled by :func:`root_families` / :func:`health_families`;
    every label value escaped (:func:`_labels`)."""

    families: dict[str, GaugeMetricFamily | InfoMetricFamily | CounterMetricFamily] = field(
        default_factory=dict)

    def gauge(self, name: str, doc: str, labels: dict[str, str], value: float | None,
              unit: str = "") -> None:
        """Add one sample (None: none) to gauge family ``name`` (created on first use)."""
        full = PREFIX + name
        fam = self.families.get(full)
        if not isinstance(fam, GaugeMetricFamily):
            fam = self.families[full] = GaugeMetricFamily(full, doc, labels=list(labels),
                                                          unit=unit)
        if value is not None:
            fam.add_metric(_labels(labels), float(value))

    def counter(self, name: str, doc: str, labels: dict[str, str], value: float) -> None:
        """Add one sample to counter family ``name`` (exposed as ``name_total``)."""
        full = PREFIX + name
        fam = self.families.get(full)
        if not isinstance(fam, CounterMetricFamily):
            fam = self.families[full] = CounterMetricFamily(full, doc, labels=list(labels))
        fam.add_metric(_labels(labels), float(value))

    def info(self, name: str, doc: str, labels: dict[str, str], info: dict[str, str]) -> None:
        full = PREFIX + name
        fam = self.families.get(full)
        if not isinstance(fam, InfoMetricFamily):
            fam = self.families[full] = InfoMetricFamily(full, doc, labels=list(labels))
        fam.add_metric(_labels(labels), {k: display_name(v) for k, v in info.items()})

    def registry(self) -> CollectorRegistry:
        """A registry that exposes these families (and nothing else)."""
        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Fixed(list(self.families.values())))
        return reg


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def _seconds(ns: int | None) -> float | None:
    return None if not ns else ns / 1e9


def root_families(exp: Exposition, facts: RootFacts, now_s: float) -> None:
    """The per-root and per-namespace series of one root (pure)."""
    doc, scan = facts.doc, facts.scan
    r = {"root": facts.root}
    for row in doc["namespaces"]:
        usage = scan.prefixes.get(row["prefix"])  # None: an active namespace without files
        oldest, newest = (usage.oldest_mtime_ns, usage.newest_mtime_ns) if usage else (0, 0)
        ns = row["namespace"] or row["prefix"]
        lab = {**r, "namespace": ns}
        man = row["manifest"] or {}
        dep = facts.deployment_info.get(ns, {})
        info = {k: str(man.get(k) if man.get(k) is not None else dep.get(k, ""))
                for k in INFO_LABELS}
        if not info["tensor_parallel_size"] and row["tp_sizes"]:
            info["tensor_parallel_size"] = ",".join(str(t) for t in row["tp_sizes"])
        exp.info("namespace", "A namespace on the cache root: what it caches (join on "
                 "namespace; LMCache's model_name).", lab, info)
        exp.gauge("namespace_bytes", "Apparent bytes of the namespace's chunk files.", lab,
                  row["bytes"])
        exp.gauge("namespace_allocated_bytes", "Bytes allocated on disk for the namespace's "
                  "chunk files.", lab, row["allocated_bytes"])
        exp.gauge("namespace_files", "Chunk files of the namespace.", lab, row["files"])
        exp.gauge("namespace_oldest_chunk_timestamp_seconds", "Modification time of the "
                  "namespace's oldest chunk file.", lab, _seconds(oldest))
        exp.gauge("namespace_newest_chunk_timestamp_seconds", "Modification time of the "
                  "namespace's newest chunk file.", lab, _seconds(newest))
        exp.gauge("namespace_active", "1 when a deployment configured on this host uses the "
                  "namespace.", lab, 1 if row["active"] else 0)
        past = row.get("past_max_age")
        exp.gauge("l2_past_max_age_files", "Chunk files of the namespace written longer ago "
                  "than KVP_L2_MAX_AGE, warm-set pins left out (what prune --max-age "
                  "deletes; to the hour; absent without a maximum age).", lab,
                  past["files"] if past else None)
        exp.gauge("l2_past_max_age_bytes", "Bytes of those files.", lab,
                  past["bytes"] if past else None)
    fs = doc["filesystem"]
    exp.gauge("filesystem_size_bytes", "Size of the filesystem holding the cache root.", r,
              fs["total_bytes"])
    exp.gauge("filesystem_avail_bytes", "Bytes of that filesystem available to unprivileged "
              "writers.", r, fs["avail_bytes"])
    exp.gauge("filesystem_readonly", "1 when that filesystem is mounted read-only (every "
              "L2 write fails).", r, 1 if fs.get("read_only") else 0)
    exp.gauge("l2_budget_bytes", "L2 budget of the root's deployment.", r, doc["budget_bytes"])
    exp.gauge("l2_max_age_seconds", "The root's maximum age (the shortest KVP_L2_MAX_AGE of "
              "its deployments; absent: none).", r, doc.get("max_age_s"))
    exp.gauge("l2_reserve_bytes", "Free space the budget keeps for everything else.", r,
              doc["reserve_bytes"])
    exp.gauge("l2_limit_bytes", "What chunks may use: the budget less what the reserve "
              "takes.", r, doc["limit_bytes"])
    temp = doc["temp"]
    exp.gauge("l2_used_bytes", "Chunk and temp bytes on the cache root.", r,
              doc["chunk_bytes"] + temp["bytes"])
    exp.gauge("temp_files", "Temp files (in-flight or interrupted writes).", r, temp["files"])
    exp.gauge("temp_bytes", "Bytes of temp files.", r, temp["bytes"])
    exp.gauge("temp_oldest_timestamp_seconds", "Modification time of the oldest temp file "
              "(0: none).", r, _seconds(scan.temp.oldest_mtime_ns) or 0)
    foreign = doc["foreign"]
    exp.gauge("foreign_files", "Files kvpersist cannot parse (never touched).", r,
              foreign["files"])
    exp.gauge("foreign_bytes", "Bytes of foreign files.", r, foreign["bytes"])
    quar = doc["quarantine"]
    exp.gauge("quarantined_files", "Files verify --apply moved into .kvpersist/quarantine/.",
              r, quar["files"])
    exp.gauge("quarantined_bytes", "Bytes of quarantined files.", r, quar["bytes"])
    exp.gauge("scan_duration_seconds", "How long the scan behind these figures took.", r,
              doc["duration_s"])
    exp.gauge("scan_entries", "Directory entries the scan looked at.", r, doc["entries"])
    exp.gauge("scan_errors", "Entries the scan could not read.", r, len(doc["errors"]))
    verify = facts.runs.get("verify")
    exp.gauge("last_verify_timestamp_seconds", "When kvp-admin verify last finished on the "
              "root.", r, _seconds(verify["finished_ns"]) if verify else None)
    exp.gauge("last_verify_success", "1: the last verify left no findings, 0: it did.", r,
              (1 if verify["ok"] else 0) if verify else None)
    exp.gauge("last_verify_findings", "Findings of the last verify.", r,
              int(verify["counts"].get("findings", 0)) if verify else None)
    exp.gauge("last_verify_moved", "Findings of the last verify that are a frame recorded "
              "under another chunk's name (moved).", r,
              int(verify["counts"].get("moved", 0)) if verify else None)
    prune = facts.runs.get("prune")
    exp.gauge("last_prune_timestamp_seconds", "When kvp-admin prune --apply last finished on "
              "the root.", r, _seconds(prune["finished_ns"]) if prune else None)
    exp.gauge("last_prune_success", "1: the last prune deleted every selected file without "
              "errors, 0: errors.", r, (1 if prune["ok"] else 0) if prune else None)
    exp.gauge("last_prune_deleted_bytes", "Bytes the last prune deleted.", r,
              int(prune["counts"].get("deleted_bytes", 0)) if prune else None)
    exp.gauge("metrics_timestamp_seconds", "When these series were measured.",
              {"root": facts.root, "config": "", "store": ""}, now_s)


@dataclass
class StoreFacts:
    """One shared-tier store as measured (``measured`` None: no deployment's credentials could
    be read, so it was not contacted), and the namespaces of the deployments using it."""

    store: str
    measured: StoreMeasurement | None
    active: frozenset[str] = frozenset()
    error: str = ""

    @property
    def complete(self) -> bool:
        """Every figure measured (the store up and scanned)."""
        return self.measured is not None and self.measured.usage is not None


def store_families(exp: Exposition, facts: StoreFacts, now_s: float) -> None:
    """The series of one shared-tier store (pure). A store that is down exports ``up`` 0 and
    its timestamp; the figures it could not give are absent."""
    s = {"store": facts.store}
    m = facts.measured
    probe = m.probe if m is not None else None
    exp.gauge("shared_tier_up", "1 when every primary of the shared-tier store answers PING "
              "with the deployments' credentials.", s, 1 if probe and probe.up else 0)
    exp.gauge("shared_tier_reachable", "1 when the store answers at all (0 with up 0: down; 1 "
              "with up 0: it refuses the credentials; absent: the credentials were not "
              "readable).", s, None if probe is None else (1 if probe.reachable else 0))
    exp.gauge("shared_tier_probe_latency_seconds", "PING round trip of the slowest primary.",
              s, probe.latency_ms / 1000 if probe and probe.up and probe.latency_ms is not None
              else None)
    for node in probe.nodes if probe else ():
        n = {**s, "node": node.node}
        exp.info("shared_tier_node", "A primary node of the store and its eviction policy.",
                 n, {"maxmemory_policy": node.policy})
        exp.gauge("shared_tier_used_memory_bytes", "Memory the node uses (INFO memory "
                  "used_memory).", n, node.used_memory_bytes)
        exp.gauge("shared_tier_maxmemory_bytes", "The node's maxmemory (0: unlimited).", n,
                  node.maxmemory_bytes)
        exp.counter("shared_tier_evicted_keys", "Keys the node evicted since it started (INFO "
                    "stats evicted_keys).", n, node.evicted_keys)
    usage = m.usage if m is not None else None
    if usage is not None:
        found = {ns: (0, 0) for ns in sorted(facts.active)}
        found.update((ns, (kb[0], kb[1])) for ns, kb in usage.namespaces.items())
        for ns, (keys, size) in sorted(found.items()):
            lab = {**s, "namespace": ns}
            exp.gauge("shared_tier_namespace_keys", "Chunk keys of the namespace on the "
                      "shared tier.", lab, keys)
            exp.gauge("shared_tier_namespace_bytes", "Value bytes of the namespace's chunk keys "
                      "on the shared tier.", lab, size)
        exp.gauge("shared_tier_other_keys", "Keys on the store that are not chunk keys (never "
                  "touched).", s, usage.other_keys + usage.fleet_keys)
        exp.gauge("shared_tier_scan_duration_seconds", "How long the scan of the store took.",
                  s, m.scan_seconds if m is not None else None)
    exp.gauge("metrics_timestamp_seconds", "When these series were measured.",
              {"root": "", "config": "", "store": facts.store}, now_s)


def health_families(exp: Exposition, rep: HealthReport, now_s: float,
                    store: tuple[str, str] | None = None) -> None:
    """The per-deployment health series (pure); ``store``: the (store, adapter) of the
    deployment's shared tier, None without one."""
    lab = {"config": rep.config, "namespace": rep.namespace}
    exp.gauge("deployment_health", "0 healthy, 1 degraded, 2 down, 3 warming (the exit code "
              "of kvp-admin health).", lab, EXIT[rep.status])
    comps = component_status(rep.checks)
    for comp in COMPONENTS:
        st = comps.get(comp)
        exp.gauge("component_health", "Per component: 0 ok, 1 degraded, 2 down, 3 warming "
                  "(absent when not checked).", {**lab, "component": comp},
                  _HEALTH_VALUE.get(st or ""))
    exp.gauge("cache_server_up", "1 when the deployment's cache server answers /healthcheck.",
              lab, 1 if rep.facts.server_healthcheck else 0)
    shared = rep.facts.shared_tier
    exp.gauge("cache_server_shared_tier", "1 when the cache server runs with the deployment's "
              "shared tier, 0 when it started without it (the store did not answer at its "
              "start: restart it once the store answers); absent without a shared tier or a "
              "serving cache server.", lab, None if shared is None or not
              rep.facts.server_healthcheck else 0 if shared.get("off_since_start") else 1)
    exp.gauge("vllm_up", "1 when vLLM answers /health (absent when not checked).", lab,
              (1 if rep.facts.vllm_health else 0) if rep.facts.expect_vllm else None)
    canary = rep.facts.canary
    if canary is not None:
        last = canary.get("last") or {}
        state = "failed" if canary.get("state") == "failed" else last.get("state")
        exp.gauge("canary_state", "The namespace's known-answer canary: 0 passed, 1 unknown "
                  "(its last run could not compare), 2 failed (vLLM serves without the cache "
                  "until `kvp-admin canary reset`); absent before a first run.", lab,
                  _CANARY_VALUE.get(str(state)))
        exp.gauge("canary_last_pass_timestamp_seconds", "When the canary last passed.", lab,
                  _epoch(canary.get("last_passed_at")))
        diff = (last.get("verdict") or {}).get("max_diff")
        exp.gauge("canary_max_logprob_diff", "The largest logprob difference from the "
                  "reference in the canary's last run (nats; absent when it compared "
                  "nothing).", lab, diff if isinstance(diff, (int, float)) else None)
    if store is not None:
        exp.info("deployment_shared_tier", "The shared-tier store the deployment uses (join on "
                 "store).", lab, {"store": store[0], "adapter": store[1]})
    exp.gauge("metrics_timestamp_seconds", "When these series were measured.",
              {"root": "", "config": rep.config, "store": ""}, now_s)


@dataclass
class MetricsOutcome:
    """Everything ``kvp-admin metrics`` measured, as expositions."""

    roots: list[RootFacts]
    health: list[HealthReport]
    measured_at: float
    notes: list[str] = field(default_factory=list)
    #: cache roots and shared-tier stores that could not be measured (a root missing or not a
    #: directory, a store down); their deployments' health series, and a store's up 0, are
    #: still there
    unmeasured: list[str] = field(default_factory=list)
    stores: list[StoreFacts] = field(default_factory=list)
    #: config name -> (store, adapter) of its shared tier
    deployment_stores: dict[str, tuple[str, str]] = field(default_factory=dict)

    def whole(self) -> Exposition:
        """One exposition of everything (stdout)."""
        exp = Exposition()
        for rf in self.roots:
            root_families(exp, rf, self.measured_at)
        for sf in self.stores:
            store_families(exp, sf, self.measured_at)
        for rep in self.health:
            health_families(exp, rep, self.measured_at, self.deployment_stores.get(rep.config))
        return exp

    def files(self) -> Iterator[tuple[str, Exposition]]:
        """(file name, exposition) per root, per store and per deployment, for the textfile
        collector."""
        for rf in self.roots:
            exp = Exposition()
            root_families(exp, rf, self.measured_at)
            yield textfile_name_for_root(rf.path), exp
        for sf in self.stores:
            exp = Exposition()
            store_families(exp, sf, self.measured_at)
            yield textfile_name_for_store(sf.store), exp
        for rep in self.health:
            exp = Exposition()
            health_families(exp, rep, self.measured_at, self.deployment_stores.get(rep.config))
            yield f"kvpersist-deployment-{rep.config}.prom", exp


def textfile_name_for_root(root: str | bytes) -> str:
    """``kvpersist-root-<12 hex of the digest of the root's path>.prom`` (pure): one file per
    root, whichever deployment's timer writes it. The digest is of the path's bytes as the
    OS holds them (``os.fsencode``: a path that is not UTF-8 has a name too, and two roots
    that differ only in such bytes have two)."""
    return f"kvpersist-root-{hashlib.sha256(os.fsencode(root)).hexdigest()[:12]}.prom"


def textfile_name_for_store(store: str) -> str:
    """``kvpersist-store-<12 hex of the store label's digest>.prom`` (pure): one file per
    shared-tier store, whichever deployment's timer writes it."""
    return f"kvpersist-store-{hashlib.sha256(store.encode()).hexdigest()[:12]}.prom"


def collect(root: str | None, configs: Sequence[str], *, timeout: float = 3.0,
            expect_vllm: bool = True, progress: ProgressFn | None = None) -> MetricsOutcome:
    """Scan each cache root once (``root``, or the configs' roots), measure each shared-tier
    store once (the configs' tiers) and probe each config.

    Raises UsageError without a root or a config, ConfigError for a config that does not load,
    KvpError for a root that cannot be read."""

    measured = time.time()
    deps = [(c, load_deployment(c, allow_unpinned=True)) for c in configs]
    groups: dict[str, list[tuple[str, Deployment]]] = {}
    if root is not None:
        given = real_root(root)
        groups[given] = [(c, d) for c, d in deps if real_root(d.settings.cache_root) == given]
    else:
        if not deps:
            raise UsageError("give --root DIR or a CONFIG")
        for c, d in deps:
            groups.setdefault(real_root(d.settings.cache_root), []).append((c, d))
    roots: list[RootFacts] = []
    notes: list[str] = []
    failed: list[str] = []
    for path, mine in groups.items():
        try:
            inv = resolve_inventory(path, [c for c, _ in mine])
            # one opening of the root: the report's scan and the recorded runs
            with open_existing(inv.root) as handle:
                rep = report_on(handle, inv, progress=progress)
                runs, problems = read_runs(handle)
        except UsageError as exc:
            if root is not None:
                raise
            # a deployment whose root is missing still gets its health series (cache_root down)
            failed.append(str(exc))
            continue
        info = {d.namespace: _deployment_info(d) for _, d in mine}
        roots.append(RootFacts(rep.to_dict(), rep.scan, runs, info, problems))
        notes.extend(problems)
    stores = [measure_store(store, mine, timeout) for store, mine in _stores_of(deps).items()]
    failed += [f"shared tier {sf.store}: {sf.error} (exported kvpersist_shared_tier_up "
               f"{1 if sf.measured and sf.measured.probe.up else 0})"
               for sf in stores if not sf.complete]
    reports = [health_report(d, locate(d), timeout=timeout, expect_vllm=expect_vllm)
               for _, d in deps]
    return MetricsOutcome(roots, reports, measured, notes, failed, stores,
                          {d.name: (tier.store_id, tier.adapter)
                           for mine in _stores_of(deps).values() for d, tier in mine})


def _stores_of(deps: Sequence[tuple[str, Deployment]],
               ) -> dict[str, list[tuple[Deployment, SharedTier]]]:
    """The deployments with a shared tier, by store (in the configs' order)."""

    out: dict[str, list[tuple[Deployment, SharedTier]]] = {}
    for _, dep in deps:
        tier = dep.shared
        if tier is not None:
            out.setdefault(tier.store_id, []).append((dep, tier))
    return out


def measure_store(store: str, mine: Sequence[tuple[Deployment, SharedTier]],
                  timeout: float) -> StoreFacts:
    """Measure one store once, with the credentials of the first of its deployments whose
    secret file can be read (the others' are tried in turn). Never raises."""

    active = frozenset(dep.namespace for dep, _ in mine)
    problems = []
    for dep, tier in mine:
        try:
            secret = read_secret_file(dep.settings.shared_tier_secret_file,
                                      also=service_uids(dep.settings.service_user))
        except KvpError as exc:
            problems.append(str(exc))
            continue
        found = measure(tier, secret, timeout)
        return StoreFacts(store, found, active, found.error)
    return StoreFacts(store, None, active, "; ".join(problems))


def _deployment_info(dep: Deployment) -> dict[str, str]:
    ident = dep.identity
    out = {"served_model_name": dep.settings.served_model_name, "config": dep.name}
    if ident is not None:
        out.update(model_id=ident.model_id, model_revision=ident.model_revision,
                   kv_cache_dtype=ident.kv_cache_dtype,
                   tensor_parallel_size=str(ident.tensor_parallel_size))
    return out


def write_textfiles(outcome: MetricsOutcome, directory: str) -> list[str]:
    """Write each root's and each deployment's exposition into ``directory`` (atomically,
    readable by node_exporter, relative to the directory opened once: never through a
    symbolic link); the paths written. Raises UsageError (exit 2) when ``directory`` is a
    symbolic link or not a directory, KvpError if a file cannot be written."""
    written = []
    dfd = open_textfile_dir(directory)
    try:
        for name, exp in outcome.files():
            path = os.path.join(directory, name)
            write_textfile_at(dfd, name, exp.registry(), shown=show_path(path))
            written.append(path)
    finally:
        os.close(dfd)
    return written
