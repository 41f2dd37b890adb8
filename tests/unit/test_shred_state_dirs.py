"""Which state dirs ``shred`` writes its tombstones into (kvpersist/actions/shred.py).

The cache root's own metadata directory (``<root>/.kvpersist``: pins, the prune lock, the
run records) is not a state dir. A tombstone written there (``keys/<ns>/shredded.json``) made
the loader take it for kvpersist 0.1's state and move every deployment of the root onto it:
the next launch then lost track of the running vLLM's pid file (found with real vLLM in
tests/fullstack/test_readiness_e2e.py).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

from kvpersist.actions.shred import state_dirs
from kvpersist.l2.inventory import Inventory


def _inv(root: Path, *state: Path) -> Inventory:
    deps = [SimpleNamespace(settings=SimpleNamespace(state_dir=str(s))) for s in state]
    return cast(Inventory, SimpleNamespace(root=str(root), deployments=deps))


def test_the_roots_metadata_dir_is_not_a_state_dir(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    (root / ".kvpersist" / "pins").mkdir(parents=True)
    (root / ".kvpersist" / "prune.lock").write_text("")
    state = tmp_path / "state"
    state.mkdir()
    assert state_dirs(_inv(root, state)) == [str(state)]


def test_a_deployment_never_launched_has_no_state_dir_to_tombstone(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    never = tmp_path / "never-launched"
    assert state_dirs(_inv(root, never)) == []
    assert not never.exists()


def test_the_default_beside_the_root_and_a_legacy_state_inside_it_are(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    beside = tmp_path / ".kvpersist" / "cache"
    beside.mkdir(parents=True)
    (root / ".kvpersist" / "keys").mkdir(parents=True)  # kvpersist 0.1's state
    assert state_dirs(_inv(root)) == sorted([str(beside), str(root / ".kvpersist")])
