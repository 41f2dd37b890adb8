"""vLLM's serve flags, classified for the namespace: the :class:`Flag` type, the flags of
every supported release (:func:`flags_for`; 0.32.0's table in
:mod:`kvpersist.config.engine_flag_table`, what later releases change in
:mod:`kvpersist.config.engine_flag_changes`, pure data), and the tables as
``docs/engine-flags.md`` carries them (pure).

``python -m kvpersist.config.engine_flags`` prints the Markdown block of
``docs/engine-flags.md``; a unit test keeps the two equal. The classes and value specs are
explained in :mod:`kvpersist.config.engine_flag_table`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

from kvpersist.config.engine_flag_changes import CHANGES
from kvpersist.config.engine_flag_table import TABLE, VLLM_VERSION
from kvpersist.system.vllm_seam import DEFAULT_VERSION, RELEASES, table_version

OWNED = "owned"
KV = "kv-affecting"
NEUTRAL = "kv-neutral"
CLASSES = (OWNED, KV, NEUTRAL)

KINDS = frozenset({"str", "int", "float", "hrint", "hrint_auto", "json", "dataclass",
                   "dict_or_str"})


@dataclass(frozen=True)
class Flag:
    """One ``dest`` of vLLM's parser: its option strings, value shape, class and reason."""

    dest: str
    #: every option string, as vLLM's parser has them (``--no-x`` included); () positional
    options: tuple[str, ...]
    #: value spec (see the module docstring)
    value: str
    cls: str
    reason: str
    #: the option strings that set a ``bool`` flag to False (``--no-X``; and for releases
    #: with ``EnableDisableAction``, ``--disable-X`` of ``--enable-X`` and the reverse)
    negative: frozenset[str] = field(default_factory=frozenset)

    @property
    def name(self) -> str:
        """The flag as documentation writes it: its first long option (or the dest)."""
        return next((o for o in self.options if o.startswith("--")), self.dest)

    @property
    def action(self) -> str:
        """``help``, ``flag``, ``bool``, ``append`` or ``store``."""
        if self.value in ("help", "flag", "bool"):
            return self.value
        return "append" if self.value.startswith("append ") else "store"

    @property
    def nargs(self) -> str | None:
        """argparse's nargs for a ``store``/``append`` flag: None, ``+`` or ``?``."""
        if self.action not in ("store", "append"):
            return None
        return self.value[-1] if self.value[-1] in "+?" else None

    @property
    def kind(self) -> str:
        """How vLLM converts one value (``str``, ``int``, ``json``...), without ``|none``."""
        spec = self.value.removeprefix("append ").rstrip("+?")
        return spec.removesuffix("|none")

    @property
    def optional(self) -> bool:
        """True when vLLM reads ``""`` and ``None`` as None."""
        return self.value.rstrip("+?").endswith("|none")


_INVERSE = {"--enable-": "--disable-", "--disable-": "--enable-"}


def _options(spec: str, value: str, style: str) -> tuple[tuple[str, ...], frozenset[str]]:
    """Option strings from the table's spelling, in the order vLLM's parser registers them,
    and the negative ones. A ``bool`` flag gets ``--no-X`` after each ``--X`` (argparse's
    BooleanOptionalAction); with ``style`` ``enable-disable`` (vLLM's EnableDisableAction) it
    also gets, after all of those, ``--disable-X`` for ``--enable-X`` and the reverse."""
    out: list[str] = []
    negative: list[str] = []
    for option in spec.split():
        out.append(option)
        if value == "bool" and option.startswith("--"):
            out.append("--no-" + option[2:])
            negative.append(out[-1])
    if value == "bool" and style == "enable-disable":
        for option in spec.split():
            for prefix, inverse in _INVERSE.items():
                if option.startswith(prefix):
                    out.append(inverse + option.removeprefix(prefix))
                    negative.append(out[-1])
    return tuple(out), frozenset(negative)


def rows_for(version: str) -> dict[str, tuple[str, str, str, str, str]]:
    """dest -> table row of every flag of supported release ``version`` (0.32.0's table with
    each later release's changes applied in order). Raises KeyError for another version."""
    if version not in RELEASES:
        raise KeyError(version)
    releases = list(RELEASES)
    assert releases[0] == VLLM_VERSION, "the table describes the oldest release"
    rows = {row[0]: row for row in TABLE}
    for v in releases[1:releases.index(version) + 1]:
        added, changed, removed = CHANGES[v]
        for dest in removed:
            del rows[dest]
        for dest, spec in changed.items():
            d, options, _, cls, reason = rows[dest]
            rows[dest] = (d, options, spec, cls, reason)
        for row in added:
            rows[row[0]] = row
    return rows


@cache
def flags_for(version: str | None = None) -> dict[str, Flag]:
    """dest -> flag, every flag of the release whose table reads ``version``
    (:func:`kvpersist.system.vllm_seam.table_version`: its own when supported, else the
    newest)."""
    v = table_version(version) if version is not None else DEFAULT_VERSION
    style = RELEASES[v].bool_style
    out: dict[str, Flag] = {}
    for dest, options, value, cls, reason in rows_for(v).values():
        opts, negative = _options(options, value, style)
        out[dest] = Flag(dest, opts, value, cls, reason, negative)
    return out


#: dest -> flag of 0.32.0 (:data:`kvpersist.system.vllm_seam.DEFAULT_VERSION`)
FLAGS: dict[str, Flag] = flags_for(DEFAULT_VERSION)


def by_class(cls: str, version: str | None = None) -> list[Flag]:
    """The flags of one class of a release (default 0.32.0), by name."""
    return sorted((f for f in flags_for(version).values() if f.cls == cls),
                  key=lambda f: f.name)


_TITLES = {
    OWNED: "Owned by kvpersist (refused in both keys)",
    KV: "KV-affecting (only in `KVP_ENGINE_ARGS`: they enter the namespace)",
    NEUTRAL: "KV-neutral (allowed in `KVP_VLLM_EXTRA_ARGS`)",
}


def _counts(version: str) -> str:
    flags = flags_for(version)
    by = ", ".join(f"{sum(f.cls == c for f in flags.values())} {c}" for c in CLASSES)
    return f"{len(flags)} flags ({by})"


def markdown() -> str:
    """The flag tables as the Markdown block of ``docs/engine-flags.md``: the oldest
    supported release in full, then what each later release changes."""
    lines = [f"vLLM {VLLM_VERSION}: {_counts(VLLM_VERSION)}.", ""]
    for cls in CLASSES:
        lines += [f"### {_TITLES[cls]}", "", "| flag | dest | why |", "|---|---|---|"]
        for f in by_class(cls, VLLM_VERSION):
            spelled = " ".join(f"`{o}`" for o in f.options) or "(positional)"
            lines.append(f"| {spelled} | `{f.dest}` | {f.reason} |")
        lines.append("")
    releases = list(RELEASES)
    for before, version in zip(releases, releases[1:], strict=False):
        old, new = flags_for(before), flags_for(version)
        added, changed, removed = CHANGES[version]
        lines += [f"### vLLM {version}: what changes from {before}", "",
                  f"{_counts(version)}."]
        if added:
            lines += ["", "New flags:", "", "| flag | dest | class | why |", "|---|---|---|---|"]
            for row in sorted(added):
                f = new[row[0]]
                spelled = " ".join(f"`{o}`" for o in f.options)
                lines.append(f"| {spelled} | `{f.dest}` | {f.cls} | {f.reason} |")
        if changed:
            lines += ["", "Values read differently: " + ", ".join(
                f"`{new[d].name}` ({old[d].value} → {spec})"
                for d, spec in sorted(changed.items())) + "."]
        if removed:
            lines += ["", "Gone: " + ", ".join(f"`{old[d].name}`" for d in sorted(removed)) + "."]
        respelled = sorted((f for d, f in new.items()
                            if d in old and set(f.options) - set(old[d].options)),
                           key=lambda f: f.name)
        if respelled:
            for cls in CLASSES:
                these = [f for f in respelled if f.cls == cls]
                if these:
                    lines += ["", f"New spellings, {cls} ({len(these)}): " + ", ".join(
                        "`" + "` `".join(sorted(set(f.options) - set(old[f.dest].options))) + "`"
                        for f in these) + "."]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
