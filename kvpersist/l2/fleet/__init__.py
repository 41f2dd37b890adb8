"""The fleet records on the shared tier: their format, the store's index, this host's record,
and ``fleet status``.
"""
