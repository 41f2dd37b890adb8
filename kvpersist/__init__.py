"""kvpersist: make vLLM's KV cache survive restarts on local NVMe, around stock LMCache."""

__version__ = "0.1.0"
