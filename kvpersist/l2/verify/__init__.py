"""``kvp-admin verify``: every chunk file authenticated (its order, its rules, the walk of a
root).
"""
