"""Strict parser for ``identity.env`` files (pure).

The file is data, never shell. Three programs read it — kvpersist, systemd
(``EnvironmentFile=`` in ``kvp-vllm@.service``) and, should an operator ever source it, a
shell — so it accepts only the subset of syntax that all three read the same way, and
refuses everything else with a message that names the line:

* lines are separated by ``\\n`` only; a line is blank, a comment (``#`` after optional
  spaces, not ending in ``\\``: systemd before v254 continues such a comment onto the next
  line), or ``KEY=VALUE`` with an ASCII key and no space around ``=``;
* VALUE is empty, or unquoted from the safe set ``A-Z a-z 0-9 _ . , : / @ % + = -``, or one
  pair of single quotes around anything but ``'``, or one pair of double quotes around
  anything but ``"`` and ``\\``; nothing may follow the closing quote but spaces;
* ``$`` and backticks are refused in every value, quoted or not (a shell expands them,
  systemd does not); so are control characters (C0, DEL, C1 — tab, vertical tab, form
  feed, CR, NUL…), Unicode format characters (bidi controls, zero-width, BOM), line and
  paragraph separators and any space other than U+0020, anywhere in the file;
* no ``export`` prefix (systemd drops such lines), no inline comments, no duplicated keys.

No variable expansion, no command substitution, no line continuation, no escapes.
"""

from __future__ import annotations

import re

from kvpersist.config.values import describe_char, forbidden_char
from kvpersist.errors import ConfigError, Problem, Problems

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: Characters an unquoted value may hold (what a shell, systemd and kvpersist read alike).
UNQUOTED = re.compile(r"[A-Za-z0-9_.,:/@%+=-]*\Z")
#: Characters no value may hold, quoted or not: a shell would expand them.
SHELL_EXPANSION = "$`"

_QUOTE_FIX = "quote the whole value with one pair of ' (nothing after the closing quote)"




def parse_env(text: str, source: str = "identity.env") -> dict[str, str]:
    """Parse env-file ``text`` into an ordered dict of key -> value. ``text`` must be the
    file's bytes decoded as they are (not read in universal-newline mode: a CR must reach
    the parser, which refuses it).

    Raises :class:`ConfigError` listing every malformed line and every duplicated key (the
    first :data:`~kvpersist.errors.MAX_PROBLEMS`, then how many more).
    """
    values: dict[str, str] = {}
    problems = Problems()
    for number, raw in enumerate(text.split("\n"), start=1):
        where = f"{source}:{number}"
        bad = forbidden_char(raw)
        if bad is not None:
            problems.add(Problem(where, f"contains {describe_char(bad)}", _char_fix(bad)))
            continue
        line = raw.strip(" ")
        if not line:
            continue
        if line.startswith("#"):
            if line.endswith("\\"):
                problems.add(Problem(where, "a comment ends with a backslash",
                                     "remove it: systemd would read the next line as part "
                                     "of the comment"))
            continue
        parsed = _parse_assignment(line, where)
        if isinstance(parsed, Problem):
            problems.add(parsed)
            continue
        key, value = parsed
        if key in values:
            problems.add(Problem(where, f"{key} is set twice", "keep one line per key"))
            continue
        values[key] = value
    if problems:
        raise ConfigError(problems, source)
    return values


def _parse_assignment(line: str, where: str) -> tuple[str, str] | Problem:
    """(key, value) of one non-comment line, or the Problem with it."""
    if line.startswith("export ") or line == "export":
        return Problem(where, "`export` is not allowed",
                       "write KEY=VALUE: systemd's EnvironmentFile= ignores `export` lines")
    key, sep, value = line.partition("=")
    if not sep or not _KEY.match(key.rstrip(" ")):
        return Problem(where, f"not a KEY=VALUE line: {line!r}",
                       "write KEY=VALUE; the file is not run by a shell")
    if key != key.rstrip(" ") or value.startswith(" "):
        return Problem(where, f"{key.strip()}: space around '='",
                       "write KEY=VALUE without spaces around '=' (a shell would run a "
                       "command)")
    if any(ch in value for ch in SHELL_EXPANSION):
        return Problem(where, f"{key}: contains $ or a backtick (quoted or not)",
                       "remove it: values are never expanded, and a shell would expand it")
    parsed = _parse_value(value.rstrip(" "))
    if parsed is None:
        return Problem(where, f"{key}: unquoted value with characters outside "
                       "A-Z a-z 0-9 _ . , : / @ % + = -", _QUOTE_FIX)
    if isinstance(parsed, tuple):
        return Problem(where, f"{key}: {parsed[0]}", parsed[1])
    return key, parsed


def _parse_value(value: str) -> str | tuple[str, str] | None:
    """The value of ``value`` (already free of trailing spaces); None if unquoted but not
    from the safe set; (message, fix) if its quoting is malformed."""
    if not value:
        return ""
    quote = value[0]
    if quote not in "\"'":
        return value if UNQUOTED.match(value) else None
    end = value.find(quote, 1)
    if end == -1:
        return ("unterminated quote", _QUOTE_FIX)
    if end != len(value) - 1:
        return ("text after the closing quote (a comment or a second quoted part)",
                "put comments on their own line; quote the whole value once")
    inner = value[1:end]
    if quote == '"' and "\\" in inner:
        return ("backslash inside double quotes",
                "use single quotes: systemd and a shell would unescape it")
    return inner


def _char_fix(ch: str) -> str:
    if ch == "\r":
        return "save the file with Unix line endings (\\n), e.g. dos2unix"
    if ch == "\t":
        return "replace the tab with spaces"
    return "remove it; systemd, a shell and kvpersist would not read the line alike"


def value_problem(value: str) -> str:
    """Why ``value`` may not be a configuration value at all (from a file or the
    environment), or '' if it may: no $ or backtick, no control or invisible characters."""
    bad = forbidden_char(value)
    if bad is not None:
        return f"contains {describe_char(bad)}"
    if any(ch in value for ch in SHELL_EXPANSION):
        return "contains $ or a backtick (values are never expanded)"
    return ""


def format_env(values: dict[str, str], header: str = "") -> str:
    """Render ``values`` as env-file text that :func:`parse_env` reads back unchanged (and
    systemd and a shell read alike). Raises ValueError for a value that no such file can
    hold (a ``'``, ``$``, backtick or control character)."""
    lines = [f"# {h}".rstrip(" ") if h else "#" for h in header.split("\n")] if header else []
    for key, value in values.items():
        if not _KEY.match(key):
            raise ValueError(f"{key!r} is not an env key")
        problem = value_problem(value) or ("contains '" if "'" in value else "")
        if UNQUOTED.match(value):
            lines.append(f"{key}={value}")
        elif problem:
            raise ValueError(f"{key}: {problem}: cannot be written to an env file")
        else:
            lines.append(f"{key}='{value}'")
    text = "\n".join(lines) + "\n"
    bad = forbidden_char(text.replace("\n", ""))
    if bad is not None:
        raise ValueError(f"the header contains {describe_char(bad)}")
    return text
