"""What a model directory says, already read (pure data).

:mod:`kvpersist.config.modeldir` reads a directory into a :class:`ModelFacts`; the rules that
turn facts into identity fields (:mod:`kvpersist.config.derive` and the ``model_*`` modules
beside it) never read files themselves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

HEX40 = re.compile(r"[0-9a-f]{40}\Z")


@dataclass(frozen=True)
class DownloadRecord:
    """One ``.cache/huggingface/download/<file>.metadata`` of a ``--local-dir`` download."""

    filename: str
    commit_hash: str
    #: False when the file changed after the record was written (huggingface_hub's rule:
    #: its mtime is more than a second after the record's timestamp) or the record is bad
    fresh: bool


@dataclass(frozen=True)
class ModelFacts:
    """What a model directory says, already read (see :mod:`kvpersist.config.modeldir`)."""

    path: str
    config: Mapping[str, Any]
    tokenizer_config: Mapping[str, Any] | None = None
    chat_template_jinja: str | None = None
    chat_template_json: Mapping[str, Any] | None = None
    #: additional_chat_templates/<name>.jinja: name -> template
    additional_templates: Mapping[str, str] = field(default_factory=dict)
    processor_config: Mapping[str, Any] | None = None
    has_preprocessor_config: bool = False
    hf_quant_config: Mapping[str, Any] | None = None
    #: set when the directory is a hub cache snapshot (models--ORG--NAME/snapshots/<sha>)
    hub_repo_id: str = ""
    hub_revision: str = ""
    hub_snapshot: str = ""
    #: --local-dir download records, and the files (relative) that have none
    records: tuple[DownloadRecord, ...] = ()
    unrecorded: tuple[str, ...] = ()

    def file(self, name: str) -> str:
        """``name`` inside the directory, for messages."""
        return f"{self.path.rstrip('/')}/{name}"


def text_config(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The language model's config (``text_config`` of a multimodal model, else the whole
    config) and the prefix naming its keys in messages."""
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        return nested, "text_config."
    return config, ""
