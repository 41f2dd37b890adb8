"""Values as operators write them (pure): sizes, durations, numbers, paths, listen
addresses, and the characters no configuration value may hold."""

from __future__ import annotations

import ipaddress
import posixpath
import re
import unicodedata

# re.ASCII: with IGNORECASE alone, U+212A KELVIN SIGN would match "k" and U+017F LONG S "s".
# At most 15 integer digits: the value stays finite as a float.
_NUMBER = r"([0-9]{1,15}(?:\.[0-9]{1,9})?)"
_SIZE = re.compile(r"\s*" + _NUMBER + r"\s*([KMGTP]?)(i?B?)?\s*\Z", re.IGNORECASE | re.ASCII)
_FACTOR = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4, "P": 1024**5}
#: a duration is written as one token: no space inside or around it ("30 d" and "30d\n" are
#: refused: a value that is not what it looks like is an error, issue 40)
_DURATION = re.compile(_NUMBER + r"(s|m|h|d|w)?\Z", re.IGNORECASE | re.ASCII)
#: the longest duration any option or setting takes: 100 years
MAX_DURATION_S = 100 * 365.25 * 86400
#: the longest any command waits for anything, and the longest warm-up: a day
MAX_WAIT_S = 86400.0
_PERCENT = re.compile(r"\s*([0-9]{1,3}(?:\.[0-9]{1,9})?)\s*%\s*\Z", re.ASCII)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

GIB = 1024**3


def parse_size(text: str) -> int:
    """Bytes from '123', '64G', '1.5TiB', '500M' (binary units). Raises ValueError."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 500G, 1.5T or a byte count)")
    return int(float(m.group(1)) * _FACTOR[m.group(2).upper()])


def parse_size_or_percent(text: str) -> tuple[int | None, float | None]:
    """('80%') -> (None, 0.8); ('500G') -> (bytes, None). Raises ValueError."""
    s = str(text).strip()
    if s.endswith("%"):
        m = _PERCENT.match(s)
        if not m:
            raise ValueError(f"not a percentage: {text!r} (use e.g. 80%)")
        pct = float(m.group(1))
        if not 0 < pct <= 100:
            raise ValueError(f"percentage must be in (0, 100]: {text!r}")
        return None, pct / 100.0
    return parse_size(s), None


def parse_duration(text: str) -> float:
    """Seconds from '90', '30m', '12h', '7d', '2w' (one token, no space; at most
    :data:`MAX_DURATION_S`). Raises ValueError."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30m, 12h, 7d, with no space)")
    seconds = float(m.group(1)) * _SECONDS[(m.group(2) or "s").lower()]
    if seconds > MAX_DURATION_S:
        raise ValueError(f"{text!r} is longer than 100 years")
    return seconds


def parse_max_age(value: str) -> tuple[float, str]:
    """Seconds of a ``KVP_L2_MAX_AGE`` / ``--older-than`` value (``30d``, ``12h``, ``90m``,
    ``2w``; empty: 0, no maximum) and an error message. A bare number is refused: written
    alone, ``30`` would be 30 seconds to the parser and 30 days to a reader."""
    if value == "":
        return 0.0, ""
    if value[-1:].isdigit():
        return 0.0, (f"give a unit: {value}d for days, {value}h for hours, {value}m for "
                     f"minutes (got {value!r})")
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        return 0.0, str(exc)
    if seconds < 60:
        return 0.0, f"must be at least a minute (e.g. 30d, 12h, 90m), got {value!r}"
    return seconds, ""


def format_size(n: float) -> str:
    """Human size with binary units: 0 B, 1023 B, 1.0 KiB, 4.0 MiB, 1.5 TiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"  # pragma: no cover


#: Addresses that bind every interface.
WILDCARD_HOSTS = ("0.0.0.0", "::")
#: Names of the loopback interface an operator may write instead of an address.
LOOPBACK_NAMES = ("localhost",)


def is_wildcard(host: str) -> bool:
    """True for an address that binds every interface (``0.0.0.0``, ``::``)."""
    return host in WILDCARD_HOSTS


def is_loopback(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1) or ``localhost``."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_problem(value: str) -> str:
    """Why ``value`` is not a listen address kvpersist accepts, or ''."""
    if value == "localhost":
        return ""
    if is_scoped(value):
        return f"must be an IP address without a zone, got {value!r}"
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        return f"must be an IP address (e.g. 127.0.0.1), got {value!r}"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return f"write the IPv4 address {address.ipv4_mapped}, not {value!r}"
    if str(address) != value:
        # one spelling per address: the loopback rule, systemd's IPAddressAllow= and the
        # Ansible role compare addresses as text
        return f"write the address in its canonical form {address}, not {value!r}"
    return ""


def reach_host(host: str) -> str:
    """The address a client on the same host uses to reach a server bound to ``host``: a
    wildcard bind is reached through loopback."""
    return "127.0.0.1" if is_wildcard(host) else host


def url_host(host: str) -> str:
    """``host`` as it stands in a URL (wildcards reached through loopback, IPv6 bracketed)."""
    h = reach_host(host)
    return f"[{h}]" if ":" in h else h


def is_scoped(host: str) -> bool:
    """True for an IPv6 address with a zone (``fe80::1%eth0``)."""
    return "%" in host


# --------------------------------------------------------------------------- numbers


def parse_uint(text: str, max_digits: int) -> int | None:
    """The integer written in ASCII digits (at most ``max_digits``), or None.

    Strict where ``str.isdigit``/``int`` are not: ``²`` is a digit to ``isdigit`` but not
    to ``int``, ``int`` also reads ``١٢`` (Arabic-Indic), ``1_0`` and `` 7``."""
    if not 0 < len(text) <= max_digits or not text.isascii() or not text.isdigit():
        return None
    return int(text)


_DECIMAL = re.compile(r"(?:[0-9]{1,9}(?:\.[0-9]{0,9})?|\.[0-9]{1,9})\Z", re.ASCII)


def parse_decimal(text: str) -> float | None:
    """A plain decimal number (``64``, ``1.5``, ``.5``) or None: no exponent, sign,
    ``inf``/``nan``, underscores or non-ASCII digits, all of which ``float`` accepts."""
    return float(text) if _DECIMAL.match(text) else None


# --------------------------------------------------------------------------- characters

#: Unicode categories no configuration value may hold: control characters (C0 — NUL, tab,
#: LF, VT, FF, CR… — DEL and C1, NEL among them), format characters (bidi overrides,
#: zero-width characters, the BOM), surrogates (undecodable bytes from the environment),
#: line and paragraph separators. Python's ``str.splitlines`` breaks lines at VT, FF, the
#: C0 separators, NEL, U+2028 and U+2029; systemd and a shell do not.
FORBIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_CHAR_NAMES = {"\0": "NUL", "\t": "TAB", "\n": "LF", "\v": "VT", "\f": "FF", "\r": "CR",
               "\x1b": "ESC", "\x7f": "DEL", "\x85": "NEL"}


def forbidden_char(text: str) -> str | None:
    """The first character of ``text`` that no configuration value may hold, or None.

    Forbidden: :data:`FORBIDDEN_CATEGORIES` and every space but U+0020 (NBSP and friends
    are whitespace to Python but not to systemd or a shell)."""
    for ch in text:
        if ch.isascii() and (" " <= ch <= "~"):
            continue
        cat = unicodedata.category(ch)
        if cat in FORBIDDEN_CATEGORIES or (cat == "Zs" and ch != " "):
            return ch
    return None


def describe_char(ch: str) -> str:
    """``U+000B (VT)``: a character named safely (never the character itself)."""
    name = _CHAR_NAMES.get(ch) or unicodedata.name(ch, "") or "a control character"
    return f"U+{ord(ch):04X} ({name})"


# --------------------------------------------------------------------------- paths

#: Longest file-name component (Linux NAME_MAX, in bytes).
NAME_MAX = 255
#: Longest configured path, in bytes: well under PATH_MAX (4096), leaving room for what
#: kvpersist appends (``/.kvpersist/manifests/<namespace>.json`` and the like).
PATH_LIMIT = 2048

#: Never a cache root, state, log or model-link directory: these directories themselves...
SYSTEM_DIRS = ("/", "/home", "/root", "/tmp", "/var", "/var/tmp", "/var/lib", "/var/cache",
               "/var/log", "/var/spool", "/var/mail", "/mnt", "/media", "/opt", "/srv")
#: ...and these together with everything below them (kernel and runtime filesystems,
#: configuration and the installed system).
SYSTEM_TREES = ("/proc", "/sys", "/dev", "/run", "/var/run", "/var/lock", "/etc", "/usr",
                "/bin", "/sbin", "/boot", "/lib", "/lib32", "/lib64", "/libx32")


def path_problem(path: str) -> str:
    """Why ``path`` cannot name a file kvpersist uses, or '': a component longer than
    NAME_MAX bytes (ENAMETOOLONG), the whole longer than PATH_LIMIT bytes, a ``..``
    component (the path would not say where it leads)."""
    raw = path.encode("utf-8", "surrogateescape")
    if len(raw) > PATH_LIMIT:
        return f"is {len(raw)} bytes long (at most {PATH_LIMIT})"
    for part in raw.split(b"/"):
        if len(part) > NAME_MAX:
            return (f"has a component of {len(part)} bytes (at most {NAME_MAX}): "
                    f"{part[:24].decode('utf-8', 'replace')}…")
        if part == b"..":
            return "has a '..' component"
    return ""


def system_dir(path: str) -> str:
    """The system directory (:data:`SYSTEM_DIRS`, :data:`SYSTEM_TREES`) that the absolute
    ``path`` is or lies under, or '' (pure: ``.`` and repeated slashes are normalised,
    symlinks are not resolved)."""
    p = "/" + posixpath.normpath(path).lstrip("/")
    if p in SYSTEM_DIRS:
        return p
    for tree in SYSTEM_TREES:
        if p == tree or p.startswith(tree + "/"):
            return tree
    return ""
