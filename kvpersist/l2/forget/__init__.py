"""``kvp-admin forget`` on the tiers: the plan of a conversation's chunks, its files on the
NVMe, its keys on the shared tier.
"""
