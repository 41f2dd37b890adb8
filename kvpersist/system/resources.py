"""Where the shipped templates and configs live (paths only; no reading here).

Search order: ``$KVP_HOME`` (a directory holding ``templates/`` and ``configs/``), the
source checkout this package was imported from, then ``<sys.prefix>/share/kvpersist``
(where a wheel installs them).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: the top of a source checkout (``kvpersist/system/resources.py`` is two levels below it)
_CHECKOUT_DIR = Path(__file__).resolve().parents[2]


def home() -> Path:
    """The directory holding ``templates/`` and ``configs/``."""
    candidates = []
    if os.environ.get("KVP_HOME"):
        candidates.append(Path(os.environ["KVP_HOME"]))
    candidates += [_CHECKOUT_DIR, Path(sys.prefix) / "share" / "kvpersist"]
    for candidate in candidates:
        if (candidate / "templates").is_dir() and (candidate / "configs").is_dir():
            return candidate
    return candidates[0]


def templates_dir() -> Path:
    return home() / "templates"


def configs_dir() -> Path:
    """Deployment configs; ``$KVP_CONFIG_DIR`` overrides (e.g. /etc/kvpersist/configs)."""
    if os.environ.get("KVP_CONFIG_DIR"):
        return Path(os.environ["KVP_CONFIG_DIR"])
    return home() / "configs"
