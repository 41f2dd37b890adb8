"""Which repository and commit a model directory holds, as its layout records it (pure).

A hub cache snapshot (``models--ORG--NAME/snapshots/<commit>/``) names both; a
``--local-dir`` download records the commit of each file, never the repository id. Nothing is
guessed: a mixed, changed or unrecorded directory has no revision, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpersist.config.model_facts import HEX40, ModelFacts


@dataclass(frozen=True)
class Origin:
    """Which repository and commit the directory holds, as far as its layout records it."""

    repo_id: str
    revision: str
    source: str
    #: why the repository id is not known ('' when known)
    why_no_id: str
    #: why the revision is not known ('' when known)
    why_no_revision: str
    #: every commit the layout names (several: a mixed directory)
    revisions: tuple[str, ...] = ()
    #: the layout records something (a hub snapshot or download records)
    recorded: bool = False


NO_LAYOUT = ("MODEL_DIR is neither a hub cache snapshot (models--ORG--NAME/snapshots/<commit>/) "
             "nor a --local-dir download (.cache/huggingface/download/*.metadata)")


def origin(m: ModelFacts) -> Origin:
    """The repository id and revision recorded by the directory's layout; never guessed."""
    if m.hub_repo_id:
        src = f"the hub cache snapshot {m.hub_snapshot}"
        return Origin(m.hub_repo_id, m.hub_revision, src, "", "", (m.hub_revision,), True)
    if not m.records:
        return Origin("", "", "", NO_LAYOUT, NO_LAYOUT)
    no_id = "a --local-dir download records the commit of each file, not the repository id"
    commits = tuple(sorted({r.commit_hash for r in m.records if r.fresh}))
    src = f"the download records in {m.file('.cache/huggingface/download/')}"
    stale = [r.filename for r in m.records if not r.fresh]
    why = ""
    if len(commits) > 1:
        why = f"the files come from several revisions ({_few(commits)})"
    elif stale:
        why = (f"{len(stale)} file(s) changed after download or have a bad record "
               f"({_few(stale)}): their recorded commit no longer describes them")
    elif m.unrecorded:
        why = (f"{len(m.unrecorded)} file(s) have no download record ({_few(m.unrecorded)}): "
               "they did not come from that download")
    elif not commits or not HEX40.match(commits[0]):
        why = "the download records hold no 40-hex commit hash"
    if why:
        return Origin("", "", src, no_id, why, commits, True)
    return Origin("", commits[0], src, no_id, "", commits, True)


def _few(names: list[str] | tuple[str, ...], n: int = 4) -> str:
    """The first ``n`` of ``names`` (each cut to 200 characters), and how many more."""
    shown = ", ".join(x if len(x) <= 200 else x[:200] + "…" for x in sorted(names)[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")
