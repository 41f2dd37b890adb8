"""What a model directory says, already read (pure data).

:mod:`kvpersist.config.modeldir` reads a directory into a :class:`ModelFacts`; the rules that
turn facts into identity fields (:mod:`kvpersist.config.derive` and the ``model_*`` modules
beside it) never read files themselves.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

HEX40 = re.compile(r"[0-9a-f]{40}\Z")

#: the largest integer kvpersist takes from a model's config as a count or a length (no
#: real model comes near it: a larger one is a broken or hostile file)
MAX_CONFIG_INT = 2**31
#: how much of a config value a message quotes
SHOWN_CHARS = 60


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
    config) and the prefix naming its keys in messages. A ``text_config`` that is not an
    object is no config at all: check :func:`bad_text_config` first."""
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        return nested, "text_config."
    return config, ""


def bad_text_config(config: Mapping[str, Any], where: str) -> str:
    """Why ``config``'s ``text_config`` cannot be read ('' when it is an object or absent):
    transformers would not build the language model's config from anything else, so no
    field is taken from the outer config instead."""
    nested = config.get("text_config")
    if nested is None or isinstance(nested, Mapping):
        return ""
    return f"{where}: text_config is {shown(nested)}, not an object"


def quoted(value: Any) -> str:
    """A config value as JSON writes it, at most :data:`SHOWN_CHARS` characters of it."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):  # an integer past Python's digit limit
        text = "a number too long to print"
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…"


def shown(value: Any) -> str:
    """:func:`quoted` with the value's JSON type: ``"2" (a string)``, ``2.5 (a number)``,
    ``true (a boolean)``."""
    return f"{quoted(value)} ({json_type(value)})"


def json_type(value: Any) -> str:
    """The JSON type of a parsed value, with its article: 'a string', 'an integer'..."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return "null" if value is None else type(value).__name__


def config_int(cfg: Mapping[str, Any], key: str, where: str,
               prefix: str = "") -> tuple[int | None, str]:
    """``cfg[key]`` as a positive integer: (value, ''); (None, '') when it is absent or
    null; (None, why) when it is present but not an integer from 1 to
    :data:`MAX_CONFIG_INT` (a string, a float, a boolean, zero or less, absurdly large),
    which no rule may replace by another key's value: vLLM would use it as it is, or fail."""
    value = cfg.get(key)
    if value is None:
        return None, ""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_CONFIG_INT:
        return None, f"{where}: {prefix}{key} is {shown(value)}, not a positive integer" + (
            f" of at most {MAX_CONFIG_INT:,}" if isinstance(value, int)
            and not isinstance(value, bool) and value > 0 else "")
    return value, ""
