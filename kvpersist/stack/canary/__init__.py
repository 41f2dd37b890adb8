"""The canary: a known-answer probe of the cache path (docs/canary.md)."""
