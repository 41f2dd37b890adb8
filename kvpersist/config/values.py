"""Values as operators write them (pure): sizes, durations and listen addresses."""

from __future__ import annotations

import ipaddress
import re

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?)(i?B?)?\s*\Z", re.IGNORECASE)
_FACTOR = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4, "P": 1024**5}
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|h|d|w)?\s*\Z", re.IGNORECASE)
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
        try:
            pct = float(s[:-1])
        except ValueError:
            raise ValueError(f"not a percentage: {text!r}") from None
        if not 0 < pct <= 100:
            raise ValueError(f"percentage must be in (0, 100]: {text!r}")
        return None, pct / 100.0
    return parse_size(s), None


def parse_duration(text: str) -> float:
    """Seconds from '90', '30m', '12h', '7d', '2w'. Raises ValueError."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30m, 12h, 7d)")
    return float(m.group(1)) * _SECONDS[(m.group(2) or "s").lower()]


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


def reach_host(host: str) -> str:
    """The address a client on the same host uses to reach a server bound to ``host``: a
    wildcard bind is reached through loopback."""
    return "127.0.0.1" if is_wildcard(host) else host


def url_host(host: str) -> str:
    """``host`` as it stands in a URL (wildcards reached through loopback, IPv6 bracketed)."""
    h = reach_host(host)
    return f"[{h}]" if ":" in h else h
