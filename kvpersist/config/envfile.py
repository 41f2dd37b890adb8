"""Strict parser for ``identity.env`` files (pure).

The file is data, never shell: ``KEY=VALUE`` lines, ``#`` comments, blank lines, an
optional ``export`` prefix, and values optionally wrapped in one pair of single or double
quotes. No variable expansion, no command substitution, no line continuation. Anything
else is an error that names the line.
"""

from __future__ import annotations

import re

from kvpersist.errors import ConfigError, Problem

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def parse_env(text: str, source: str = "identity.env") -> dict[str, str]:
    """Parse env-file ``text`` into an ordered dict of key -> value.

    Raises :class:`ConfigError` listing every malformed line and every duplicated key.
    """
    values: dict[str, str] = {}
    problems: list[Problem] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            problems.append(Problem(where, f"not a KEY=VALUE line: {raw!r}",
                                    "write KEY=VALUE; the file is not run by a shell"))
            continue
        parsed = _parse_value(value.strip())
        if parsed is None:
            problems.append(Problem(where, f"{key}: unbalanced or unsupported quoting",
                                    "quote the whole value with one pair of ' or \""))
            continue
        if key in values:
            problems.append(Problem(where, f"{key} is set twice", "keep one line per key"))
            continue
        values[key] = parsed
    if problems:
        raise ConfigError(problems, source)
    return values


def _parse_value(value: str) -> str | None:
    """Return the unquoted value, or None if its quoting is malformed."""
    if not value:
        return ""
    if value[0] in "\"'":
        quote = value[0]
        end = value.find(quote, 1)
        if end == -1:
            return None
        rest = value[end + 1 :].strip()
        if rest and not rest.startswith("#"):
            return None
        inner = value[1:end]
        return inner
    # Unquoted: an inline comment needs whitespace before '#'.
    value = re.split(r"\s+#", value, maxsplit=1)[0].rstrip()
    if any(ch in value for ch in "\"'`$\\"):
        return None
    return value


def format_env(values: dict[str, str], header: str = "") -> str:
    """Render ``values`` as env-file text that :func:`parse_env` reads back unchanged."""
    lines = [f"# {h}" if h else "#" for h in header.splitlines()] if header else []
    for key, value in values.items():
        if re.fullmatch(r"[A-Za-z0-9_.,:/@%+=-]*", value):
            lines.append(f"{key}={value}")
        else:
            lines.append(f"{key}='{value}'")
    return "\n".join(lines) + "\n"
