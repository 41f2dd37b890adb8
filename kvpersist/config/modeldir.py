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

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpersist.config.model_facts import HEX40, DownloadRecord, ModelFacts
from kvpersist.errors import ConfigError, Problem

#: where a --local-dir download keeps its records, relative to the directory
DOWNLOAD_RECORDS = (".cache", "huggingface", "download")
#: the largest metadata file read (config.json and tokenizer_config.json are far smaller)
MAX_JSON_BYTES = 64 << 20

_FIX = "point KVP_MODEL_PATH (or MODEL_DIR) at a model directory holding config.json"


def read_model_dir(path: str) -> ModelFacts:
    """Read the facts of the model directory ``path``. Raises ConfigError listing every
    problem (not a directory, no or unreadable config.json, a file that is not valid
    JSON)."""
    problems: list[Problem] = []
    root = Path(path)
    if not root.is_dir():
        why = "does not exist" if not os.path.lexists(path) else "is not a directory"
        raise ConfigError(Problem(path, why, _FIX))
    config = _json(root / "config.json", problems, required=True)
    tokenizer_config = _json(root / "tokenizer_config.json", problems)
    chat_json = _json(root / "chat_template.json", problems)
    processor = _json(root / "processor_config.json", problems)
    quant = _json(root / "hf_quant_config.json", problems)
    jinja = _text(root / "chat_template.jinja", problems)
    extra: dict[str, str] = {}
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        try:
            names = sorted(p for p in extra_dir.iterdir() if p.name.endswith(".jinja"))
        except OSError as exc:
            problems.append(Problem(str(extra_dir), f"cannot list: {exc.strerror or exc}"))
            names = []
        for p in names:
            text = _text(p, problems)
            if text is not None:
                extra[p.name.removesuffix(".jinja")] = text
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


def _read(path: Path, problems: list[Problem], required: bool) -> str | None:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            problems.append(Problem(str(path), f"is larger than {MAX_JSON_BYTES >> 20} MiB"))
            return None
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            problems.append(Problem(str(path), "not found: this is not a model directory",
                                    _FIX))
        return None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        problems.append(Problem(str(path), f"cannot read: {why}",
                                "check that this user may read the weights directory"))
        return None


def _json(path: Path, problems: list[Problem], required: bool = False) -> dict[str, Any] | None:
    text = _read(path, problems, required)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        problems.append(Problem(str(path), f"not valid JSON: {exc}"))
        return None
    if not isinstance(data, dict):
        problems.append(Problem(str(path), "is not a JSON object"))
        return None
    return data


def _text(path: Path, problems: list[Problem]) -> str | None:
    return _read(path, problems, required=False)


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
    without records gives ((), ())."""
    base = root.joinpath(*DOWNLOAD_RECORDS)
    if not base.is_dir():
        return (), ()
    records: list[DownloadRecord] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames.sort()
        for name in sorted(filenames):
            if not name.endswith(".metadata"):
                continue
            meta = Path(dirpath) / name
            rel = meta.relative_to(base).as_posix().removesuffix(".metadata")
            target = root / rel
            if not target.is_file():
                continue  # a record of a file no longer here: nothing loads it
            records.append(_record(meta, target, rel))
    recorded = {r.filename for r in records}
    unrecorded = [f for f in _files(root) if f not in recorded]
    return tuple(records), tuple(unrecorded)


def _record(meta: Path, target: Path, rel: str) -> DownloadRecord:
    """One record: ``commit\\netag\\ntimestamp\\n`` (huggingface_hub's format). A record that
    cannot be read, or older than its file's last change, is not fresh."""
    try:
        lines = meta.read_text(encoding="utf-8").split("\n")
        commit, timestamp = lines[0].strip(), float(lines[2].strip())
        fresh = target.stat().st_mtime - 1 <= timestamp
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        return DownloadRecord(rel, "", False)
    return DownloadRecord(rel, commit, fresh)


def _files(root: Path) -> list[str]:
    """Every regular file under ``root`` (relative, '/'-separated), hidden names excluded
    (the download records live in ``.cache/``)."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if not name.startswith("."):
                p = Path(dirpath) / name
                if p.is_file():
                    out.append(p.relative_to(root).as_posix())
    return sorted(out)


def facts_summary(m: ModelFacts) -> Mapping[str, Any]:
    """The layout facts of ``m`` as plain data (for --json output)."""
    return {"path": m.path, "hub_repo_id": m.hub_repo_id or None,
            "hub_revision": m.hub_revision or None, "hub_snapshot": m.hub_snapshot or None,
            "download_records": len(m.records), "files_without_record": list(m.unrecorded)}
