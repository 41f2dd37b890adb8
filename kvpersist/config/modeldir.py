"""Read what a model directory says about itself (the I/O edge of identity derivation).

:func:`read_model_dir` reads ``config.json``, the tokenizer and processor files that hold a
chat template, a quantization config, and the download layout — a Hugging Face hub cache
snapshot (``models--ORG--NAME/snapshots/<commit>/``, recognised with ``huggingface_hub``'s
own cache-layout code) or a ``--local-dir`` download's records
(``.cache/huggingface/download/<file>.metadata``) — into a plain
:class:`~kvpersist.config.model_facts.ModelFacts`. Nothing here interprets them; nothing is
written (huggingface_hub's own record reader creates lock files and deletes records it
cannot parse, so the three-line record format is read here, read-only).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpersist.config.model_facts import HEX40, DownloadRecord, ModelFacts, json_type
from kvpersist.errors import ConfigError, Problem, Problems
from kvpersist.system.untrusted import (
    MAX_MODEL_JSON_BYTES,
    MAX_RECORD_BYTES,
    MAX_TEMPLATE_BYTES,
    UnreadableFile,
    decode,
    parse_json,
    read_bytes,
    show_path,
)

#: where a --local-dir download keeps its records, relative to the directory
DOWNLOAD_RECORDS = (".cache", "huggingface", "download")
#: the most files additional_chat_templates/ may hold (transformers loads every one)
MAX_TEMPLATES = 256
#: the bounds of a walk over a model directory: entries in all, and directory depth
MAX_WALK_ENTRIES = 100_000
MAX_WALK_DEPTH = 256

_FIX = "point KVP_MODEL_PATH (or MODEL_DIR) at a model directory holding config.json"
_READ_FIX = "make it the file the model was published with, readable by this user"


def read_model_dir(path: str) -> ModelFacts:
    """Read the facts of the model directory ``path``.

    Every file is read through :mod:`kvpersist.system.untrusted` (a FIFO, a device, a
    directory, a file past its cap, bad UTF-8, JSON nested too deep or holding a number out
    of range are refused, never waited on or guessed at); links are followed (a hub snapshot
    is links). Raises ConfigError listing every problem at once (not a directory, no
    config.json, a file that cannot be used as what it should be, a download tree past
    :data:`MAX_WALK_ENTRIES` entries or :data:`MAX_WALK_DEPTH` levels)."""
    problems = Problems()
    root = Path(path)
    if not root.is_dir():
        why = "does not exist" if not os.path.lexists(path) else "is not a directory"
        raise ConfigError(Problem(path, why, _FIX))
    config = _json(root / "config.json", problems, required=True)
    tokenizer_config = _json(root / "tokenizer_config.json", problems)
    chat_json = _json(root / "chat_template.json", problems)
    processor = _json(root / "processor_config.json", problems)
    quant = _json(root / "hf_quant_config.json", problems)
    jinja = _template(root / "chat_template.jinja", problems)
    extra = _extra_templates(root / "additional_chat_templates", problems)
    if problems:
        raise ConfigError(problems, path)
    assert config is not None
    repo_id, revision, snapshot = hub_snapshot(path)
    records, unrecorded = (((), ()) if repo_id else download_records(root))
    return ModelFacts(
        path=path, config=config, tokenizer_config=tokenizer_config, chat_template_jinja=jinja,
        chat_template_json=chat_json, additional_templates=extra, processor_config=processor,
        has_preprocessor_config=(root / "preprocessor_config.json").is_file(),
        hf_quant_config=quant, hub_repo_id=repo_id, hub_revision=revision,
        hub_snapshot=snapshot, records=records, unrecorded=unrecorded)


def _read(path: Path, problems: Problems, required: bool, max_bytes: int) -> bytes | None:
    """The bytes of ``path`` (None: absent, or a problem was added)."""
    try:
        return read_bytes(path, max_bytes=max_bytes, fix=_READ_FIX)
    except FileNotFoundError:
        if required:
            problems.add(Problem(show_path(path), "not found: this is not a model directory",
                                 _FIX))
        return None
    except UnreadableFile as exc:
        problems.add(exc.problem())
        return None


def _json(path: Path, problems: Problems, required: bool = False) -> dict[str, Any] | None:
    data = _read(path, problems, required, MAX_MODEL_JSON_BYTES)
    if data is None:
        return None
    try:
        doc = parse_json(data, show_path(path), fix=_READ_FIX)
    except UnreadableFile as exc:
        problems.add(exc.problem())
        return None
    if not isinstance(doc, dict):
        problems.add(Problem(show_path(path), f"is not a JSON object: it is {json_type(doc)}",
                             _READ_FIX))
        return None
    return doc


def _template(path: Path, problems: Problems) -> str | None:
    """A chat template file as text, its line ends read as transformers reads them (Python's
    text mode: ``\\r\\n`` and ``\\r`` are ``\\n``)."""
    data = _read(path, problems, False, MAX_TEMPLATE_BYTES)
    if data is None:
        return None
    try:
        text = decode(data, show_path(path), _READ_FIX)
    except UnreadableFile as exc:
        problems.add(exc.problem())
        return None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _extra_templates(extra_dir: Path, problems: Problems) -> dict[str, str]:
    """additional_chat_templates/<name>.jinja: name -> template (at most
    :data:`MAX_TEMPLATES` of them)."""
    if not extra_dir.is_dir():
        return {}
    try:
        with os.scandir(extra_dir) as it:
            names = []
            for entry in it:
                if entry.name.endswith(".jinja"):
                    names.append(entry.name)
                    if len(names) > MAX_TEMPLATES:
                        problems.add(Problem(show_path(extra_dir), f"holds more than "
                                             f"{MAX_TEMPLATES} templates", _READ_FIX))
                        return {}
    except OSError as exc:
        problems.add(Problem(show_path(extra_dir), f"cannot list: {exc.strerror or exc}"))
        return {}
    extra: dict[str, str] = {}
    for name in sorted(names):
        text = _template(extra_dir / name, problems)
        if text is not None:
            extra[name.removesuffix(".jinja")] = text
    return extra


def hub_snapshot(path: str) -> tuple[str, str, str]:
    """(repository id, revision, snapshot directory) when ``path`` is (a link to) a snapshot
    of a hub cache, else ('', '', '').

    The directory name is parsed with huggingface_hub's separator and accepted only when
    huggingface_hub's own code maps the repository id back to the same folder and resolves
    ``config.json`` at that revision to this very directory.
    """
    snapshot = Path(os.path.realpath(path))
    revision = snapshot.name
    if snapshot.parent.name != "snapshots" or not HEX40.match(revision):
        return "", "", ""
    repo_dir = snapshot.parent.parent
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.file_download import repo_folder_name

    prefix = "models" + constants.REPO_ID_SEPARATOR
    if not repo_dir.name.startswith(prefix):
        return "", "", ""
    repo_id = repo_dir.name[len(prefix):].replace(constants.REPO_ID_SEPARATOR, "/")
    try:
        if repo_folder_name(repo_id=repo_id, repo_type="model") != repo_dir.name:
            return "", "", ""
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(repo_dir.parent),
                                       revision=revision, repo_type="model")
    except Exception:  # an id huggingface_hub refuses (its validation error): not a snapshot
        return "", "", ""
    if not isinstance(found, str) or os.path.dirname(found) != str(snapshot):
        return "", "", ""
    return repo_id, revision, str(snapshot)


def download_records(root: Path) -> tuple[tuple[DownloadRecord, ...], tuple[str, ...]]:
    """The records of a ``--local-dir`` download under ``root`` (one per file: its commit
    hash, and whether the file is unchanged since), and the files that have none. A directory
    without records gives ((), ()). Names are as :func:`~kvpersist.system.untrusted.
    show_path` prints them. Raises ConfigError for a tree past the walk's bounds."""
    base = root.joinpath(*DOWNLOAD_RECORDS)
    if not base.is_dir():
        return (), ()
    records: list[DownloadRecord] = []
    for rel in walk_files(base):
        if not rel.endswith(".metadata"):
            continue
        name = rel.removesuffix(".metadata")
        target = root / name
        if not target.is_file():
            continue  # a record of a file no longer here: nothing loads it
        records.append(_record(base / rel, target, show_path(name)))
    recorded = {r.filename for r in records}
    unrecorded = [f for f in (show_path(n) for n in walk_files(root, skip_hidden=True))
                  if f not in recorded]
    return tuple(records), tuple(sorted(unrecorded))


def _record(meta: Path, target: Path, rel: str) -> DownloadRecord:
    """One record: ``commit\\netag\\ntimestamp\\n`` (huggingface_hub's format). A bad record
    (not a regular file, past :data:`MAX_RECORD_BYTES`, not UTF-8, too few lines, a commit
    that is not 40 hex digits, a timestamp that is not a finite number), or one older than
    its file's last change, is not fresh."""
    try:
        text = decode(read_bytes(meta, max_bytes=MAX_RECORD_BYTES), show_path(meta))
        lines = text.split("\n")
        commit, timestamp = lines[0].strip(), float(lines[2].strip())
        if not HEX40.match(commit) or not math.isfinite(timestamp):
            return DownloadRecord(rel, "", False)
        fresh = target.stat().st_mtime - 1 <= timestamp
    except (OSError, UnreadableFile, ValueError, IndexError):
        return DownloadRecord(rel, "", False)
    return DownloadRecord(rel, commit, fresh)


def walk_files(top: Path, *, skip_hidden: bool = False, max_entries: int = MAX_WALK_ENTRIES,
               max_depth: int = MAX_WALK_DEPTH) -> list[str]:
    """Every regular file (or link to one) under ``top``, relative and '/'-separated,
    sorted; names starting with a dot skipped (and not entered) with ``skip_hidden``.

    Iterative (no recursion, whatever the depth); a link to a directory is never entered
    (no loops). Raises ConfigError naming ``top`` when it holds more than ``max_entries``
    entries or directories nested more than ``max_depth`` deep, or naming a directory that
    cannot be listed."""
    out: list[str] = []
    seen = 0
    fix = "point KVP_MODEL_PATH (or MODEL_DIR) at the model's own directory"
    stack: list[tuple[str, int]] = [("", 0)]
    while stack:
        rel, depth = stack.pop()
        here = top / rel if rel else top
        try:
            with os.scandir(here) as it:
                for entry in it:
                    seen += 1
                    if seen > max_entries:
                        raise ConfigError(Problem(show_path(top), f"holds more than "
                                                  f"{max_entries:,} entries: not a model "
                                                  "directory kvpersist reads", fix))
                    if skip_hidden and entry.name.startswith("."):
                        continue
                    name = f"{rel}/{entry.name}" if rel else entry.name
                    if entry.is_dir(follow_symlinks=False):
                        if depth + 1 > max_depth:
                            raise ConfigError(Problem(show_path(top), "holds directories "
                                                      f"nested more than {max_depth} deep: "
                                                      "not a model directory kvpersist reads",
                                                      fix))
                        stack.append((name, depth + 1))
                    elif entry.is_file():
                        out.append(name)
        except OSError as exc:
            raise ConfigError(Problem(show_path(here), f"cannot list: {exc.strerror or exc}",
                                      "check that this user may read the weights "
                                      "directory")) from None
    return sorted(out)


def facts_summary(m: ModelFacts) -> Mapping[str, Any]:
    """The layout facts of ``m`` as plain data (for --json output)."""
    return {"path": m.path, "hub_repo_id": m.hub_repo_id or None,
            "hub_revision": m.hub_revision or None, "hub_snapshot": m.hub_snapshot or None,
            "download_records": len(m.records), "files_without_record": list(m.unrecorded)}
