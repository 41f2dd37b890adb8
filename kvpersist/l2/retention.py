"""What to delete, in which order, and why (pure; it never deletes).

Input is the scanner's aggregate view: per file-name prefix the files, bytes and a histogram of
last use (hour buckets of ``max(mtime, atime)``), and the same for temp files. Output is a
:class:`RetentionPlan`: a list of :class:`Selection` objects, each "the files of prefix P (or the
temp files) whose last use is before T" with the files and bytes that frees and the reason.
:mod:`kvpersist.l2.prune` turns selections into file names and deletes them.

Order for a byte target (``plan_retention``):

1. temp files left over by crashes (older than a minimum age; in-flight ones are younger),
2. unpinned namespaces (``kvp-unpinned-*``) no active deployment uses, least recently used first,
3. stale pinned namespaces, least recently used first; the last one only as far as needed,
   oldest files first,
4. the active namespace(s), only when explicitly allowed, least recently used files first.

Prefixes that are not kvpersist namespaces (``test-model``, ``--a--b``) are never chosen for a
byte target: they are removed only when named explicitly.

A maximum age (``plan_explicit(older_than_s=...)``, :func:`age_selections`) selects, in every
kvpersist namespace, the files *written* before a cutoff (mtime; atime is never used, since
``relatime`` makes it unreliable): docs/max-age.md.

A namespace's warm-set pins (:mod:`kvpersist.l2.pins.usage`) are never chosen: the caller passes
each prefix's usage less its pinned files (:func:`kvpersist.l2.pins.usage.without_pins`), and the
executor skips pinned files for every selection but one named on the command line
(``Selection.named``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpersist.config.values import format_size
from kvpersist.errors import UsageError
from kvpersist.l2.layout import is_namespace, is_pinned_namespace

#: Width of a histogram bucket; must equal kvpersist.l2.usage.HIST_BUCKET_NS.
BUCKET_NS = 3600 * 10**9
#: Temp files younger than this may still be in flight.
DEFAULT_TEMP_MIN_AGE_S = 3600.0

TEMP = "temp"
UNPINNED = "unpinned"
STALE = "stale"
OTHER = "other"
ACTIVE = "active"


class UsageView(Protocol):
    """What retention needs to know about a group of files (see kvpersist.l2.usage.Usage)."""

    @property
    def files(self) -> int: ...

    @property
    def bytes(self) -> int: ...

    @property
    def use_hist(self) -> dict[int, list[int]]: ...

    @property
    def last_use_ns(self) -> int: ...


def category(prefix: str, active: Iterable[str]) -> str:
    """``active``, ``unpinned``, ``stale`` (a pinned namespace nobody uses) or ``other``."""
    if prefix in set(active):
        return ACTIVE
    if is_pinned_namespace(prefix):
        return STALE
    if is_namespace(prefix):
        return UNPINNED
    return OTHER


@dataclass(frozen=True)
class Selection:
    """Files to delete: of ``prefix`` (None = temp files), last used before ``before_ns``
    (None = all of them). ``files``/``bytes`` are what the scan saw."""

    kind: str
    prefix: str | None
    before_ns: int | None
    files: int
    bytes: int
    reason: str
    #: named on the command line (``--namespace``): the only selection that may delete a
    #: namespace's warm-set pins (kvpersist.l2.pins.usage); every other one leaves them
    named: bool = False
    #: ``before_ns`` is compared with when the file was written (its mtime: a maximum age,
    #: docs/max-age.md), not with its last use
    by_written: bool = False

    def matches(self, prefix: str | None, last_use_ns: int,
                written_ns: int | None = None) -> bool:
        """True if a file of ``prefix`` (None for temp) last used at ``last_use_ns`` and
        written at ``written_ns`` (its mtime; needed by a ``by_written`` selection) is in."""
        if prefix != self.prefix:
            return False
        if self.before_ns is None:
            return True
        if self.by_written:
            return written_ns is not None and written_ns < self.before_ns
        return last_use_ns < self.before_ns

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "prefix": self.prefix,
            "namespace": self.prefix if self.prefix and is_namespace(self.prefix) else None,
            "before_ns": self.before_ns,
            "files": self.files,
            "bytes": self.bytes,
            "reason": self.reason,
            "named": self.named,
            "by": "written" if self.by_written else "last_use",
        }


@dataclass(frozen=True)
class RetentionPlan:
    """Selections in deletion order, with what they free and what was left alone."""

    selections: tuple[Selection, ...]
    goal_bytes: int | None
    notes: tuple[str, ...] = field(default=())

    @property
    def files(self) -> int:
        return sum(s.files for s in self.selections)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.selections)

    @property
    def satisfied(self) -> bool:
        return self.goal_bytes is None or self.bytes >= self.goal_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "goal_bytes": self.goal_bytes,
            "files": self.files,
            "bytes": self.bytes,
            "satisfied": self.satisfied,
            "selections": [s.to_dict() for s in self.selections],
            "notes": list(self.notes),
        }


def _hist_before(hist: Mapping[int, list[int]], before_ns: int) -> tuple[int, int]:
    """(files, bytes) in buckets that end at or before ``before_ns`` (bucket-aligned)."""
    limit = before_ns // BUCKET_NS
    files = nbytes = 0
    for b, (f, n) in hist.items():
        if b < limit:
            files += f
            nbytes += n
    return files, nbytes


def _cutoff_for(hist: Mapping[int, list[int]], need: int) -> int:
    """The smallest bucket boundary T such that files used before T hold >= ``need`` bytes
    (or all files, if they hold less)."""
    acc = 0
    for b in sorted(hist):
        acc += hist[b][1]
        if acc >= need:
            return (b + 1) * BUCKET_NS
    return (max(hist) + 1) * BUCKET_NS if hist else 0


def temp_selection(temp: UsageView, now_ns: int, older_than_s: float,
                   align: bool = True) -> Selection | None:
    """Temp files last touched more than ``older_than_s`` ago. With ``align`` the cutoff is
    rounded down to a histogram bucket, so the plan's numbers are exact for the scan it came
    from; without, files and bytes count only whole buckets before the cutoff (a lower bound;
    the prune dry-run counts exactly)."""
    before = now_ns - int(older_than_s * 1e9)
    if align:
        before = before // BUCKET_NS * BUCKET_NS
    files, nbytes = _hist_before(temp.use_hist, before)
    if not temp.files:
        return None
    return Selection(
        TEMP, None, before, files, nbytes,
        f"temp files untouched for over {older_than_s:g} s (left by an interrupted write)",
    )


def plan_retention(
    prefixes: Mapping[str, UsageView],
    temp: UsageView,
    *,
    active: Iterable[str],
    need_bytes: int,
    now_ns: int,
    allow_active: bool = False,
    temp_min_age_s: float = DEFAULT_TEMP_MIN_AGE_S,
) -> RetentionPlan:
    """Order deletions to free at least ``need_bytes`` (see the module docstring).

    Returns a plan that may fall short of the goal (``satisfied`` is then False and ``notes``
    say what was left alone). Raises nothing.
    """
    active_set = set(active)
    sels: list[Selection] = []
    notes: list[str] = []
    remaining = need_bytes
    if remaining <= 0:
        return RetentionPlan((), need_bytes, ("nothing to free",))

    t = temp_selection(temp, now_ns, temp_min_age_s)
    if t is not None and t.bytes:
        sels.append(t)
        remaining -= t.bytes

    by_cat: dict[str, list[tuple[str, UsageView]]] = {UNPINNED: [], STALE: [], OTHER: [],
                                                      ACTIVE: []}
    for p, u in prefixes.items():
        if u.files:
            by_cat[category(p, active_set)].append((p, u))

    for cat, why in ((UNPINNED, "unpinned namespace no active deployment uses"),
                     (STALE, "stale namespace: no configured deployment uses it")):
        for p, u in sorted(by_cat[cat], key=lambda pu: (pu[1].last_use_ns, pu[0])):
            if remaining <= 0:
                break
            if u.bytes <= remaining or not u.use_hist:
                sels.append(Selection(cat, p, None, u.files, u.bytes,
                                      f"{why} (least recently used first)"))
                remaining -= u.bytes
            else:
                before = _cutoff_for(u.use_hist, remaining)
                f, n = _hist_before(u.use_hist, before)
                sels.append(Selection(cat, p, before, f, n,
                                      f"{why}; only its least recently used files"))
                remaining -= n

    if by_cat[OTHER]:
        notes.append(
            "not considered (not kvpersist namespaces; name them with --namespace): "
            + ", ".join(sorted(p for p, _ in by_cat[OTHER]))
        )
    if remaining > 0 and by_cat[ACTIVE]:
        if not allow_active:
            notes.append(
                f"{format_size(remaining)} more would have to come from the active "
                f"namespace(s) {', '.join(sorted(p for p, _ in by_cat[ACTIVE]))}; "
                f"pass --force to allow that"
            )
        else:
            merged: dict[int, list[int]] = {}
            for _, u in by_cat[ACTIVE]:
                for b, (f, n) in u.use_hist.items():
                    h = merged.setdefault(b, [0, 0])
                    h[0] += f
                    h[1] += n
            before = _cutoff_for(merged, remaining)
            for p, u in sorted(by_cat[ACTIVE]):
                f, n = _hist_before(u.use_hist, before)
                if f:
                    sels.append(Selection(ACTIVE, p, before, f, n,
                                          "active namespace (forced): least recently used "
                                          "files first"))
                    remaining -= n
    if remaining > 0:
        notes.append(f"the plan falls {format_size(remaining)} short of the goal")
    return RetentionPlan(tuple(sels), need_bytes, tuple(notes))


def format_age(seconds: float) -> str:
    """``30d``, ``12h``, ``90m``, ``45s``: the largest whole unit (pure)."""
    for unit, n in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{int(seconds // n)}{unit}"
    return f"{seconds:g}s"


def age_selections(prefixes: Mapping[str, UsageView], *, active: Iterable[str], now_ns: int,
                   older_than_s: float, skip: Iterable[str | None] = ()) -> list[Selection]:
    """A maximum age: one selection per kvpersist namespace with files (the active ones
    too: what goes is recomputed on the next miss), "its files written more than
    ``older_than_s`` ago" (by mtime, never atime; docs/max-age.md). ``files``/``bytes`` are
    left at 0: the executor counts them, file by file. Prefixes in ``skip`` (already selected
    whole) and prefixes that are not namespaces are left out (pure)."""
    active_set, skipped = set(active), set(skip)
    before = now_ns - int(older_than_s * 1e9)
    age = format_age(older_than_s)
    return [Selection(category(p, active_set), p, before, 0, 0,
                      f"maximum age {age}", by_written=True)
            for p, u in sorted(prefixes.items())
            if u.files and p not in skipped and is_namespace(p)]


def plan_explicit(
    prefixes: Mapping[str, UsageView],
    temp: UsageView,
    *,
    active: Iterable[str],
    now_ns: int,
    namespaces: Iterable[str] = (),
    stale: bool = False,
    unpinned: bool = False,
    temp_older_than_s: float | None = None,
    older_than_s: float | None = None,
    force: bool = False,
) -> RetentionPlan:
    """Selections for explicit targets: whole prefixes named in ``namespaces``, all stale
    pinned namespaces, all unpinned namespaces nobody uses, temp files older than a duration,
    and (``older_than_s``) every namespace's files written longer ago than that
    (:func:`age_selections`).

    Raises UsageError when a named prefix is active and ``force`` is not set.
    """
    active_set = set(active)
    sels: dict[str | None, Selection] = {}
    notes: list[str] = []
    for ns in namespaces:
        if ns in active_set and not force:
            raise UsageError(
                f"{ns} is the namespace of an active deployment; refusing without --force"
            )
        u = prefixes.get(ns)
        cat = category(ns, active_set)
        if u is None or not u.files:
            # kept as an empty selection: the executor may still remove an orphan manifest
            notes.append(f"{ns}: no files")
            sels[ns] = Selection(cat, ns, None, 0, 0, f"named on the command line ({cat})",
                                 named=True)
            continue
        sels[ns] = Selection(cat, ns, None, u.files, u.bytes, f"named on the command line ({cat})",
                             named=True)
    for p, u in sorted(prefixes.items(), key=lambda pu: (pu[1].last_use_ns, pu[0])):
        cat = category(p, active_set)
        if p in sels or not u.files:
            continue
        if (stale and cat == STALE) or (unpinned and cat == UNPINNED):
            why = "stale namespace: no configured deployment uses it" if cat == STALE else (
                "unpinned namespace no active deployment uses")
            sels[p] = Selection(cat, p, None, u.files, u.bytes, why)
    if temp_older_than_s is not None:
        t = temp_selection(temp, now_ns, temp_older_than_s, align=False)
        if t is not None:
            sels[None] = t
    aged: list[Selection] = []
    if older_than_s is not None:
        aged = age_selections(prefixes, active=active_set, now_ns=now_ns,
                              older_than_s=older_than_s, skip=sels)
        others = sorted(p for p, u in prefixes.items()
                        if u.files and p not in sels and not is_namespace(p))
        if others:
            notes.append("maximum age: not applied to prefixes that are not kvpersist "
                         "namespaces (name them with --namespace): " + ", ".join(others))
    return RetentionPlan((*sels.values(), *aged), None, tuple(notes))


def select_named(
    *,
    active: Iterable[str],
    now_ns: int,
    namespaces: Iterable[str] = (),
    temp_older_than_s: float | None = None,
    force: bool = False,
) -> RetentionPlan:
    """Selections for targets that need no scan: whole prefixes by name, and temp files older
    than a duration. Files and bytes are left at 0 (the executor counts them).

    Raises UsageError when a named prefix is active and ``force`` is not set.
    """
    active_set = set(active)
    sels: list[Selection] = []
    for ns in dict.fromkeys(namespaces):
        if ns in active_set and not force:
            raise UsageError(
                f"{ns} is the namespace of an active deployment; refusing without --force"
            )
        cat = category(ns, active_set)
        sels.append(Selection(cat, ns, None, 0, 0, f"named on the command line ({cat})",
                              named=True))
    if temp_older_than_s is not None:
        sels.append(Selection(
            TEMP, None, now_ns - int(temp_older_than_s * 1e9), 0, 0,
            f"temp files untouched for over {temp_older_than_s:g} s (interrupted writes)",
        ))
    return RetentionPlan(tuple(sels), None)
