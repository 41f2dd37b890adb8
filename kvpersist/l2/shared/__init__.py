"""The shared tier (Redis/Valkey through LMCache's adapters): the store client, the key scheme,
the credentials.
"""
