"""kvpersist: make vLLM's KV cache survive restarts on local NVMe, around stock LMCache."""

#: The one place the version is written: pyproject.toml reads it (dynamic version) and
#: CHANGELOG.md has an entry for it.
__version__ = "0.2.0"
