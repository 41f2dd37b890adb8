"""The namespaces' serde keys: where they live and how a launch adopts, creates or keeps one."""
