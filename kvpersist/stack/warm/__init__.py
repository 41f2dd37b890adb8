"""The warm-up: which chunks a warm set names, loading them before ready (prefetch into L1,
compute what is missing, load into vLLM), the prime, and the launch's readiness step.
"""
