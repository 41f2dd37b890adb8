"""``kvp-admin forget``'s parts that talk to the running deployment: the input read as vLLM
reads it, its chunk keys, the server's L1.
"""
