"""The warm set of a deployment (``KVP_WARMUP_FILE``): parse and validate, pure.

The warm set is a JSONL file, one JSON object a line, each the start every session shares:

* ``{"messages": [...]}`` -- a conversation in the OpenAI chat format, rendered with the
  deployment's chat template the way vLLM's ``/v1/chat/completions`` renders it. Optional
  ``"tools": [...]`` (OpenAI tool schemas) and ``"add_generation_prompt": false`` (default
  true, as for a chat request);
* ``{"prompt": "..."}`` -- a text prompt, tokenized the way ``/v1/completions`` does.

Blank lines are skipped. Anything else is an error naming its line; the errors of the file are
reported at once (:class:`~kvpersist.errors.ConfigError`, exit 2; the first 20, then where
reading stopped and how many lines were left unchecked). Each line is untrusted JSON: nested
at most 64 deep, finite numbers only. The file's digest (sha256 of its bytes) keys the
token-id cache and the pin manifest.

Also here: the token-id cache document (``kvpersist.warm-tokens/1``) and its validation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpersist.errors import ConfigError, Problem, Problems
from kvpersist.system.untrusted import UnreadableFile, parse_json

#: a warm set is the shared start of sessions, not a corpus
MAX_BYTES = 16 << 20
MAX_ENTRIES = 10_000
#: the most arrays and objects one line may hold (~64 bytes each once parsed: a 16 MiB line
#: of ``[{},{},...]`` is refused before it costs 400 MB); counted as its ``[`` and ``{``
MAX_LINE_CONTAINERS = 1_000_000
TOKENS_SCHEMA = "kvpersist.warm-tokens/1"
_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = ("messages", "tools", "add_generation_prompt")
_PROMPT_KEYS = ("prompt",)
_FIX = 'one JSON object a line: {"messages": [...]} or {"prompt": "..."} (docs/warm-restart.md)'


@dataclass(frozen=True)
class WarmEntry:
    """One line of the warm set: ``kind`` is ``messages`` or ``prompt``; ``body`` the object."""

    line: int
    kind: str
    body: Mapping[str, Any]


@dataclass(frozen=True)
class WarmSet:
    """A validated warm set: its entries in file order and the sha256 of the file's bytes."""

    source: str
    sha256: str
    entries: tuple[WarmEntry, ...]


def file_digest(data: bytes) -> str:
    """sha256 hex of the warm file's bytes."""
    return hashlib.sha256(data).hexdigest()


def parse_warm_set(data: bytes, source: str) -> WarmSet:
    """Validate the bytes of a warm-set file named ``source`` (for messages).

    Returns the :class:`WarmSet`; raises ConfigError for a file that is too big, not UTF-8,
    empty or holding more than :data:`MAX_ENTRIES` entries, or listing its bad lines
    (``<source>:<line>``). Each line is parsed as untrusted JSON
    (:func:`~kvpersist.system.untrusted.parse_json`: nested at most 64 deep, finite numbers
    only, at most :data:`MAX_LINE_CONTAINERS` arrays and objects), so no line costs more than
    its share of memory. The first :data:`~kvpersist.errors.MAX_PROBLEMS` bad lines are
    listed; at the next one reading stops, and the last problem counts the lines left
    unchecked: a file of a million bad lines costs the time and output of 21."""
    if len(data) > MAX_BYTES:
        raise ConfigError(Problem(source, f"is {len(data):,} bytes, more than {MAX_BYTES:,}",
                                  "a warm set holds the shared starts of sessions, not a "
                                  "corpus: keep it small"), source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(Problem(source, f"is not UTF-8 text ({exc.reason} at byte "
                                          f"{exc.start})", _FIX), source) from None
    problems = Problems()
    entries: list[WarmEntry] = []
    for number, line, after in _lines(text):
        if not line or line.isspace():
            continue
        where = f"{source}:{number}"
        try:
            obj = parse_json(line, where, max_containers=MAX_LINE_CONTAINERS)
        except UnreadableFile as exc:
            # the line is parsed alone: its "line 1" is the file's line ``number``
            why = exc.why.replace("(line 1 column ", "(column ")
        else:
            entry, why = _entry(number, obj)
            if entry is not None:
                entries.append(entry)
        if why:
            problems.add(Problem(where, why, _FIX))
        if problems.more:
            left = _lines_from(text, after)
            raise ConfigError([*problems.kept, Problem(
                where, f"is bad too; reading stopped there ({left:,} more line(s) not "
                "checked)", f"fix the first {problems.limit} bad lines, then check again")],
                source)
        if len(entries) > MAX_ENTRIES:
            problems.add(Problem(source, f"holds more than {MAX_ENTRIES:,} entries (reading "
                                 f"stopped at line {number:,})", "keep the warm set small"))
            break
    if not problems and not entries:
        problems.add(Problem(source, "holds no entry", _FIX))
    if problems:
        raise ConfigError(problems, source)
    return WarmSet(source, file_digest(data), tuple(entries))


def _lines(text: str) -> Iterator[tuple[int, str, int]]:
    """``(number, line, where the next line starts)`` of ``text`` split at newlines, one at
    a time: a list of eight million lines would cost half a gigabyte."""
    pos, number, size = 0, 0, len(text)
    while pos <= size:
        end = text.find("\n", pos)
        if end < 0:
            end = size
        number += 1
        yield number, text[pos:end], end + 1
        pos = end + 1


def _lines_from(text: str, pos: int) -> int:
    """How many lines ``text`` holds from ``pos`` on (counted in C)."""
    return 0 if pos >= len(text) else text.count("\n", pos) + (not text.endswith("\n"))


def _entry(line: int, obj: Any) -> tuple[WarmEntry | None, str]:
    if not isinstance(obj, dict):
        return None, f"must be a JSON object, got {type(obj).__name__}"
    if ("messages" in obj) == ("prompt" in obj):
        return None, "needs exactly one of 'messages' and 'prompt'"
    if "prompt" in obj:
        extra = sorted(set(obj) - set(_PROMPT_KEYS))
        if extra:
            return None, f"unknown key(s) beside 'prompt': {', '.join(extra)}"
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            return None, "'prompt' must be a non-empty string"
        return WarmEntry(line, "prompt", {"prompt": prompt}), ""
    extra = sorted(set(obj) - set(_MESSAGE_KEYS))
    if extra:
        return None, (f"unknown key(s): {', '.join(extra)} (beside 'messages' only "
                      f"'tools' and 'add_generation_prompt')")
    why = _messages_problem(obj["messages"])
    if not why and "tools" in obj and not (
            isinstance(obj["tools"], list) and all(isinstance(t, dict) for t in obj["tools"])):
        why = "'tools' must be a list of OpenAI tool objects"
    if not why and not isinstance(obj.get("add_generation_prompt", True), bool):
        why = "'add_generation_prompt' must be true or false"
    return (None, why) if why else (WarmEntry(line, "messages", obj), "")


def _messages_problem(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {\"role\", \"content\"} objects"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}] must be an object"
        role = m.get("role")
        if role not in _ROLES:
            return f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}"
        content = m.get("content")
        if not isinstance(content, (str, list)) and not (content is None and role in (
                "assistant",)):
            return f"messages[{i}].content must be a string or a list of content parts"
    return ""


# --------------------------------------------------------------------------- token-id cache


def tokens_cache_name(namespace: str, warm_sha256: str) -> str:
    """File name of the token-id cache of ``namespace`` for a warm file's digest."""
    return f"{namespace}.{warm_sha256}.json"


def tokens_document(namespace: str, warm_sha256: str, template_sha256: str,
                    token_ids: Sequence[Sequence[int]], lines: Sequence[int]) -> dict[str, Any]:
    """The cached token ids of a warm set (one list per entry, in file order)."""
    return {"schema": TOKENS_SCHEMA, "namespace": namespace, "warm_file_sha256": warm_sha256,
            "template_sha256": template_sha256,
            "entries": [{"line": n, "token_ids": list(ids)}
                        for n, ids in zip(lines, token_ids, strict=True)]}


def parse_tokens_document(doc: Any, namespace: str, warm_sha256: str,
                          template_sha256: str) -> list[list[int]] | None:
    """The token ids of a cached document if it is ours and for exactly this namespace, warm
    file and template digest; None otherwise (then the ids are computed again)."""
    if (not isinstance(doc, dict) or doc.get("schema") != TOKENS_SCHEMA
            or doc.get("namespace") != namespace or doc.get("warm_file_sha256") != warm_sha256
            or doc.get("template_sha256") != template_sha256
            or not isinstance(doc.get("entries"), list)):
        return None
    out: list[list[int]] = []
    for e in doc["entries"]:
        ids = e.get("token_ids") if isinstance(e, dict) else None
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in ids):
            return None
        out.append(ids)
    return out
