"""The built-in CPU demo: a locally generated model and the `kvp-admin demo` job.

Nothing here imports torch or transformers at import time; the generator loads them
only when it is called.
"""
