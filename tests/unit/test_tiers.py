"""``--tier local|shared|all``: which tier a request may take, and how the documents merge
(kvpersist.actions.tiers; the use cases themselves run against real servers in
tests/integration/test_shared_tier.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpersist.actions.prune import PruneRequest
from kvpersist.actions.tiers import TIERS, TierPrune, TierReport, check_tier_request
from kvpersist.errors import UsageError


@pytest.mark.parametrize("req,list_paths", [
    (PruneRequest(stale=True), False), (PruneRequest(unpinned=True), False),
    (PruneRequest(temp_older_than_s=0.0), False), (PruneRequest(to_budget=True), False),
    (PruneRequest(namespaces=("ns",)), True),
])
@pytest.mark.parametrize("tier", ["shared", "all"])
def test_shared_tiers_select_by_namespace_only(tier: str, req: PruneRequest,
                                               list_paths: bool) -> None:
    with pytest.raises(UsageError, match="selects by --namespace only"):
        check_tier_request(tier, req, list_paths=list_paths)
    check_tier_request("local", req, list_paths=list_paths)


def test_tiers() -> None:
    assert TIERS == ("local", "shared", "all")
    for tier in TIERS:
        check_tier_request(tier, PruneRequest(namespaces=("ns",), force=True))
    with pytest.raises(UsageError, match="--tier 'both'"):
        check_tier_request("both", PruneRequest(namespaces=("ns",)))


class _Local:
    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc

    def to_dict(self) -> dict[str, Any]:
        return self.doc


def test_documents_merge_as_the_commands_print_them() -> None:
    local, shared = {"schema": "kvpersist.report/1"}, {"schema": "kvpersist.shared-report/1"}
    assert TierReport("local", _Local(local)).to_dict() == local  # type: ignore[arg-type]
    assert TierReport("shared", None, shared).to_dict() == shared
    assert TierReport("all", _Local(local), shared).to_dict() == {  # type: ignore[arg-type]
        **local, "shared": shared}
    assert TierPrune("shared", None, shared).to_dict() == shared
    assert TierPrune("shared", None, shared).exit_code == 0
