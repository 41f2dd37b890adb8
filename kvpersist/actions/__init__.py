"""Use cases of kvp-admin: each takes plain arguments and returns a result with to_dict()."""
