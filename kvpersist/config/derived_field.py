"""One identity field as derived: its value and where it came from, or None and why not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpersist.config.identity import IDENTITY_KEYS


@dataclass(frozen=True)
class Derived:
    """One identity field: its value and where it came from, or None and why not."""

    name: str
    value: str | int | None
    source: str
    note: str = ""

    @property
    def key(self) -> str:
        return IDENTITY_KEYS[self.name]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "source": self.source,
                "note": self.note}


def unknown(name: str, why: str) -> Derived:
    """The field ``name`` left unknown, with why."""
    return Derived(name, None, "unknown", why)
