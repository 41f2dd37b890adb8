"""The inventory layer: what is on a cache root, who is active on it, how much each may use.

One place answers the three questions that report, budget, prune, render and launch ask:

* :func:`resolve_inventory` — which root, which deployments are configured on it (roots are
  compared by their real path, so a root reached through a symlink is the same root), which
  namespaces are active;
* :func:`open_existing` — the one opening of a root that must hold a cache: the handle
  (:class:`~kvpersist.l2.tree.RootDir`) a use case opens once, passes down, and closes with
  ``with``; :func:`snapshot` — what is on it, in one look (the scan, the manifests, the
  warm-set pins and what they hold on disk);
* :func:`measure` — one scan of the root (or nothing, for a root that does not exist yet) and
  host RAM, as plain figures;
* :func:`size_deployment` — the budget plan of one deployment from one measurement, with the
  other deployments of its root; this is the one sizing of a launch, render or budget, handed
  on to preflight.

The read-only lifecycle commands (``stop``, ``status``, ``health``) never come here: they use
:func:`kvpersist.stack.locate.locate`, which needs no scan and no budget.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvpersist.config.deployment import Deployment
from kvpersist.config.loader import list_config_names, load_deployment
from kvpersist.config.values import system_dir
from kvpersist.errors import ConfigError, KvpError, UsageError
from kvpersist.l2.budget import BudgetPlan, plan_for_deployment
from kvpersist.l2.layout import display_name
from kvpersist.l2.manifests import Manifest, manifest_dirs, read_manifests, read_manifests_at
from kvpersist.l2.pins.store import measure_pins, read_pins
from kvpersist.l2.pins.usage import PinnedUsage, PinSet
from kvpersist.l2.scan import ProgressFn, ScanResult, scan_root
from kvpersist.l2.tree import RootDir as RootDir
from kvpersist.l2.tree import open_root as open_root
from kvpersist.system import procs
from kvpersist.system.files import FsInfo, fs_info


def real_root(path: str | os.PathLike[str]) -> str:
    """The one rule for comparing cache roots: the real path (symlinks resolved once)."""
    return os.path.realpath(os.fspath(path))


@dataclass
class Inventory:
    """A cache root and the deployments configured on it (for report, budget, prune)."""

    root: str
    deployments: list[Deployment] = field(default_factory=list)
    active: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    #: why the active namespace of an unpinned deployment may be missing from ``active`` (a
    #: manifest that could not be read may be its newest); empty when it is certain
    unsure: list[str] = field(default_factory=list)

    def others(self, dep: Deployment) -> tuple[Deployment, ...]:
        """The deployments on this root other than ``dep`` (by namespace)."""
        return tuple(d for d in self.deployments if d.namespace != dep.namespace)


def resolve_inventory(
    root: str | None,
    configs: Sequence[str] = (),
    *,
    environ: Mapping[str, str] | None = None,
    discover: bool = True,
) -> Inventory:
    """Which root to look at and which namespaces are active on it.

    ``configs`` are loaded (ConfigError propagates); the root is ``root`` or their common cache
    root. With no ``configs`` and ``discover``, every config under configs/ is tried and those
    whose cache root is ``root`` count as active (a config that does not load is skipped and
    noted). Raises UsageError if neither a root nor a config is given, or the configs disagree.
    An unpinned deployment's active namespace is the newest manifest written for it; when a
    manifest cannot be read, that is not certain (``unsure`` and ``notes`` name it).
    """

    deps = [load_deployment(c, environ) for c in configs]
    notes: list[str] = []
    if root is None:
        roots = {real_root(d.settings.cache_root) for d in deps}
        if not roots:
            raise UsageError("give --root DIR or --config CONFIG")
        if len(roots) > 1:
            raise UsageError(
                f"the configs use different cache roots ({', '.join(sorted(roots))}); "
                f"give --root DIR"
            )
        root = roots.pop()
    root = real_root(root)
    if not configs and discover:
        skipped = []
        for name in list_config_names():
            try:
                deps.append(load_deployment(name, environ))
            except ConfigError:
                skipped.append(name)
        if skipped:
            notes.append(f"{len(skipped)} config(s) under configs/ did not load and were not "
                         f"considered: {', '.join(skipped)}")
    on_root = [d for d in deps if real_root(d.settings.cache_root) == root]
    for d in deps:
        if d not in on_root and configs:
            notes.append(f"config {d.name} uses another cache root ({d.settings.cache_root})")
    manifests, bad = read_manifests_at(root, manifest_dirs(on_root))
    unsure = bad if any(not d.pinned for d in on_root) else []
    notes += unsure
    active: set[str] = set()
    for d in on_root:
        if d.pinned:
            active.add(d.namespace)
            continue
        mine = [m for m in manifests.values()
                if not m.pinned and m.deployment.get("config") == d.name]
        if mine:
            active.add(max(mine, key=lambda m: m.mtime_ns).namespace)
    return Inventory(root=root, deployments=on_root, active=active, notes=notes,
                     unsure=unsure)


def other_deployments(dep: Deployment,
                      environ: Mapping[str, str] | None = None) -> tuple[Deployment, ...]:
    """The other configured deployments that share ``dep``'s cache root (for quotas).

    Other configs are context only: one that does not load, or a configs directory that cannot
    be read, never blocks this deployment (it is simply not counted).
    """
    try:
        inv = resolve_inventory(dep.settings.cache_root, environ=environ)
    except KvpError:
        return ()
    return inv.others(dep)


def host_ram_bytes() -> int:
    """Total host RAM."""
    return procs.memory_total_bytes()


@dataclass(frozen=True)
class Measurement:
    """What sizing needs from the machine: the filesystem, bytes per file-name prefix, temp
    bytes, host RAM, and the scan they come from (None when the root does not exist yet)."""

    fs: FsInfo
    on_disk: dict[str, int]
    temp_bytes: int
    host_ram_bytes: int
    scan: ScanResult | None = None


def require_root(root: str | os.PathLike[str]) -> None:
    """Check that ``root`` is an existing, readable directory and not a system directory
    (also through a symlink: see :func:`~kvpersist.config.values.system_dir`); never create
    it.

    Raises UsageError naming the root when it is missing, not a directory or a system
    directory, KvpError when this user cannot read it."""
    path = os.fspath(root)
    shown = display_name(path)
    system = system_dir(os.path.realpath(path))
    if system:
        raise UsageError(f"{shown} is (or resolves to) the system directory {system}: never a "
                         "cache root (check --root or KVP_CACHE_ROOT)")
    if not os.path.isdir(path):
        what = "not a directory" if os.path.lexists(path) else "no such directory"
        raise UsageError(f"cannot scan the cache root {shown}: {what} (check --root or "
                         "KVP_CACHE_ROOT)")
    if not os.access(path, os.R_OK | os.X_OK):
        raise KvpError(f"cannot scan the cache root {shown}: not readable by this user; run "
                       "as the cache owner")


def open_existing(root: str | os.PathLike[str], *, purpose: str = "scan") -> RootDir:
    """Open a cache root that must already hold a cache (report, prune, metrics, sizing):
    :func:`require_root`'s checks, then the one :func:`~kvpersist.l2.tree.open_root` of the
    use case. The caller closes the handle (``with open_existing(root) as handle: ...``).

    Raises UsageError naming the root when it is missing, not a directory or a system
    directory, KvpError when it cannot be read or opened; never creates it."""
    require_root(root)
    return open_root(root, purpose=purpose)


def scan(root: RootDir, *, hist: bool = False, ages: bool = False,
         progress: ProgressFn | None = None) -> ScanResult:
    """Scan the open ``root`` (``ages``: with the write-time histogram). Raises UsageError
    when it is no longer a directory, KvpError when it cannot be read."""
    try:
        return scan_root(root, progress=progress, hist=hist, ages=ages)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise UsageError(f"cannot scan {display_name(root.given or root.path)}: not an "
                         "existing directory (check --root or KVP_CACHE_ROOT)") from exc
    except OSError as exc:
        raise KvpError(f"cannot scan {display_name(root.given or root.path)}: "
                       f"{exc.strerror or exc}; run as the cache owner") from exc


@dataclass(frozen=True)
class Snapshot:
    """One look at an open cache root (report, prune, metrics): the scan; the manifests of its
    deployments (empty unless asked for); each namespace's warm-set pins (a namespace whose
    pin manifest is unreadable is held whole: :attr:`~kvpersist.l2.pins.usage.PinSet.held`) and
    what they hold on disk, measured just after the scan; the problems met reading the
    manifests and the pins (each names the file it is about); and why the pins directory
    could not be listed ("" when it could; else every namespace is held)."""

    scan: ScanResult
    manifests: Mapping[str, Manifest]
    pins: Mapping[str, PinSet]
    pinned: Mapping[str, PinnedUsage]
    manifest_problems: tuple[str, ...] = ()
    pin_problems: tuple[str, ...] = ()
    pins_unreadable_dir: str = ""


def snapshot(root: RootDir, deployments: Sequence[Deployment] = (), *,
             manifests: bool = True, hist: bool = False, pin_hist: bool = False,
             ages: bool = False, progress: ProgressFn | None = None) -> Snapshot:
    """Scan the open ``root`` once (``hist``: with the last-use histogram), read its pins and
    measure them right after (``pin_hist``: with theirs), and (``manifests``) read the
    manifests of the root and of ``deployments``. Raises UsageError/KvpError as :func:`scan`
    does; a manifest or pin manifest that cannot be read is a problem, not an error."""
    res = scan(root, hist=hist, ages=ages, progress=progress)
    read = read_pins(root)
    pinned = {ns: measure_pins(root, p, hist=pin_hist) for ns, p in read.pins.items()}
    found: dict[str, Manifest] = {}
    bad: list[str] = []
    if manifests:
        found, bad = read_manifests(root, manifest_dirs(deployments))
    return Snapshot(res, found, read.pins, pinned, tuple(bad), read.problems,
                    read.unreadable_dir)


def measurement_of(res: ScanResult, ram_bytes: int | None = None) -> Measurement:
    """The measurement one scan gives (host RAM read here unless ``ram_bytes``)."""
    assert res.fs is not None
    ram = host_ram_bytes() if ram_bytes is None else ram_bytes
    return Measurement(res.fs, res.prefix_bytes(), res.temp.bytes, ram, res)


def measure(root: str | os.PathLike[str], *, ram_bytes: int | None = None,
            progress: ProgressFn | None = None) -> Measurement:
    """Measure ``root`` once: a scan if it exists, else an empty root on the filesystem of its
    nearest existing ancestor. Raises UsageError if the root is not a directory, KvpError if
    it cannot be read."""
    if not os.path.lexists(root):
        ram = host_ram_bytes() if ram_bytes is None else ram_bytes
        return Measurement(fs_info(root), {}, 0, ram)
    with open_existing(root) as handle:
        res = scan(handle, progress=progress)
    return measurement_of(res, ram_bytes)


def plan_with(dep: Deployment, m: Measurement,
              others: Sequence[Deployment] = ()) -> BudgetPlan:
    """The budget plan of ``dep`` from measurement ``m`` (pure), with the other deployments
    of its root."""
    return plan_for_deployment(dep, fs_total_bytes=m.fs.total_bytes,
                               fs_avail_bytes=m.fs.avail_bytes, on_disk=m.on_disk,
                               temp_bytes=m.temp_bytes, host_ram_bytes=m.host_ram_bytes,
                               others=tuple(others))


@dataclass(frozen=True)
class Sizing:
    """The two figures render needs, and the plan they come from."""

    l1_size_gb: float
    l2_capacity_gb: float
    plan: BudgetPlan
    measurement: Measurement | None = None

    @property
    def reasons(self) -> tuple[str, ...]:
        return self.plan.reasons


def size_deployment(dep: Deployment, *, environ: Mapping[str, str] | None = None,
                    strict: bool = True) -> Sizing:
    """Measure ``dep``'s root once and plan its budget with the other deployments on it.

    With ``strict`` (render, launch) a plan with problems raises ConfigError (exit 2); without
    it (``kvp-admin budget``) the plan is returned for display.
    """
    m = measure(dep.settings.cache_root)
    plan = plan_with(dep, m, other_deployments(dep, environ))
    if strict:
        plan.raise_for_problems()
    return Sizing(plan.l1_size_gb, plan.l2_max_capacity_gb, plan, m)
