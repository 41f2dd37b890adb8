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
    #: unknown because the model states a value vLLM could not use as it is (a wrong type,
    #: out of range), not because nothing states it: a check reports it as a mismatch
    malformed: bool = False

    @property
    def key(self) -> str:
        return IDENTITY_KEYS[self.name]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "source": self.source,
                "note": self.note}


def unknown(name: str, why: str, malformed: bool = False) -> Derived:
    """The field ``name`` left unknown, with why; ``malformed`` when the model states a value
    that vLLM could not use as it is."""
    return Derived(name, None, "unknown", why, malformed)
