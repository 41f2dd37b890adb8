"""Click commands of ``kvp-admin``; each module holds one concern."""
