"""vLLM's serve flags, classified for the namespace: the :class:`Flag` type, the flags of the
table in :mod:`kvpersist.config.engine_flag_table` (pure data) as :data:`FLAGS`, and the
table as ``docs/engine-flags.md`` carries it (pure).

``python -m kvpersist.config.engine_flags`` prints the Markdown block of
``docs/engine-flags.md``; a unit test keeps the two equal. The classes and value specs are
explained in :mod:`kvpersist.config.engine_flag_table`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpersist.config.engine_flag_table import TABLE, VLLM_VERSION

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


def _options(spec: str, value: str) -> tuple[str, ...]:
    """Option strings from the table's spelling; a ``bool`` flag gets ``--no-X`` after each
    ``--X`` as argparse's BooleanOptionalAction adds them."""
    out: list[str] = []
    for option in spec.split():
        out.append(option)
        if value == "bool" and option.startswith("--"):
            out.append("--no-" + option[2:])
    return tuple(out)


#: dest -> flag, every row of the table
FLAGS: dict[str, Flag] = {dest: Flag(dest, _options(options, value), value, cls, reason)
                          for dest, options, value, cls, reason in TABLE}


def by_class(cls: str) -> list[Flag]:
    """The flags of one class, by name."""
    return sorted((f for f in FLAGS.values() if f.cls == cls), key=lambda f: f.name)


_TITLES = {
    OWNED: "Owned by kvpersist (refused in both keys)",
    KV: "KV-affecting (only in `KVP_ENGINE_ARGS`: they enter the namespace)",
    NEUTRAL: "KV-neutral (allowed in `KVP_VLLM_EXTRA_ARGS`)",
}


def markdown() -> str:
    """The flag table as the Markdown block of ``docs/engine-flags.md``."""
    counts = ", ".join(f"{len(by_class(c))} {c}" for c in CLASSES)
    lines = [f"vLLM {VLLM_VERSION}: {len(FLAGS)} flags ({counts}).", ""]
    for cls in CLASSES:
        lines += [f"### {_TITLES[cls]}", "", "| flag | dest | why |", "|---|---|---|"]
        for f in by_class(cls):
            spelled = " ".join(f"`{o}`" for o in f.options) or "(positional)"
            lines.append(f"| {spelled} | `{f.dest}` | {f.reason} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
