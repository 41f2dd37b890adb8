"""What ``kvp-admin forget`` is given: a conversation, a prompt or token ids (pure).

Three kinds of input file, each read as untrusted bytes by the action:

* ``--messages FILE``: a chat conversation in the OpenAI format, either a JSON array of
  ``{"role", "content"}`` messages or an object ``{"messages": [...]}`` (optional ``"tools"``,
  as in a warm-set line). It is validated exactly as a warm-set line is
  (:func:`kvpersist.config.warmset.parse_warm_set`).
* ``--prompt-file FILE``: UTF-8 text, sent as a ``/v1/completions`` prompt would be.
* ``--token-ids FILE``: a JSON array of token ids (or ``{"token_ids": [...]}``), used as
  they are.

A conversation was not sent once but turn by turn: every request of it stored the chunks of
its own prompt (and, LMCache 0.5.6's MP connector storing decode KV too, of the prompt with
the answer). :func:`conversation_requests` lists those requests: for each message that ends a
user (or tool) turn, the conversation up to it with the generation prompt (what the client
sent); for each assistant message, the conversation up to it without one (the prompt plus the
answer as the next request renders it). LMCache's chunk hashes chain over the prefix, so a
request's full chunks are the keys of exactly its prefix; the union over the requests is what
LMCache can hold of the conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpersist.config.warmset import WarmEntry, parse_warm_set
from kvpersist.errors import ConfigError, Problem
from kvpersist.system.untrusted import UnreadableFile, parse_json

#: the most bytes an input file may hold (a long conversation is far below)
MAX_BYTES = 16 << 20
#: LMCache refuses longer token sequences (``key_resolver.MAX_TOKEN_IDS``)
MAX_TOKEN_IDS = 1_000_000
KINDS = ("messages", "prompt", "token_ids")
_ENDS_A_REQUEST = ("user", "tool")


@dataclass(frozen=True)
class ForgetInput:
    """The parsed input: ``entries`` to tokenize as the deployment does (messages, prompt),
    or ``token_ids`` given as they are."""

    kind: str
    source: str
    entries: tuple[WarmEntry, ...] = ()
    token_ids: tuple[int, ...] = ()


def parse_input(kind: str, data: bytes, source: str) -> ForgetInput:
    """Parse the bytes of an input file of ``kind`` (one of :data:`KINDS`) named ``source``.

    Returns the :class:`ForgetInput` (a conversation expanded into its requests by
    :func:`conversation_requests`). Raises ConfigError (exit 2) naming the file for a file
    that is not what its kind says."""
    if kind not in KINDS:
        raise ValueError(f"unknown input kind {kind!r}")
    if len(data) > MAX_BYTES:
        raise ConfigError(Problem(source, f"is {len(data):,} bytes, more than {MAX_BYTES:,}"),
                          source)
    if kind == "prompt":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(Problem(source, f"is not UTF-8 text ({exc.reason} at byte "
                                              f"{exc.start})"), source) from None
        if not text:
            raise ConfigError(Problem(source, "is empty"), source)
        return ForgetInput(kind, source, (WarmEntry(1, "prompt", {"prompt": text}),))
    try:
        doc = parse_json(data, source, max_containers=1_000_000)
    except UnreadableFile as exc:
        raise ConfigError(Problem(source, exc.why), source) from None
    if kind == "token_ids":
        return ForgetInput(kind, source, token_ids=_token_ids(doc, source))
    return ForgetInput(kind, source, conversation_requests(_conversation(doc, source)))


def _token_ids(doc: Any, source: str) -> tuple[int, ...]:
    if isinstance(doc, dict) and set(doc) == {"token_ids"}:
        doc = doc["token_ids"]
    fix = "a JSON array of token ids, e.g. [1, 15043, 29991]"
    if not isinstance(doc, list) or not doc:
        raise ConfigError(Problem(source, "must be a non-empty JSON array of token ids", fix),
                          source)
    if len(doc) > MAX_TOKEN_IDS:
        raise ConfigError(Problem(source, f"holds {len(doc):,} token ids, more than the "
                                          f"{MAX_TOKEN_IDS:,} LMCache keys"), source)
    for i, t in enumerate(doc):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**32:
            raise ConfigError(Problem(source, f"item {i} is not a token id (an integer "
                                              f"0..2**32-1): {t!r}"[:200], fix), source)
    return tuple(doc)


def _conversation(doc: Any, source: str) -> WarmEntry:
    """The conversation as a validated warm-set entry (the warm set's own rules)."""
    if isinstance(doc, list):
        doc = {"messages": doc}
    if not isinstance(doc, dict):
        raise ConfigError(Problem(source, f"must be a JSON array of messages or an object "
                                          f"with 'messages', got {type(doc).__name__}"), source)
    line = json.dumps(doc, ensure_ascii=False).encode("utf-8")
    try:
        (entry,) = parse_warm_set(line, source).entries
    except ConfigError as exc:
        # the document is checked as one warm-set line: "<source>:1" is the file itself
        raise ConfigError([Problem(p.where.replace(f"{source}:1", source), p.message, p.fix)
                           for p in exc.problems], source) from None
    if entry.kind != "messages":
        raise ConfigError(Problem(source, "holds a prompt: use --prompt-file for a prompt"),
                          source)
    return entry


def conversation_requests(entry: WarmEntry) -> tuple[WarmEntry, ...]:
    """The requests a conversation was sent as (see the module docstring), in order, each a
    ``messages`` entry numbered from 1; identical ones once. The whole conversation as the
    file gives it is always the last (``add_generation_prompt`` as the file says, default
    true)."""
    messages = list(entry.body["messages"])
    extra = {k: v for k, v in entry.body.items() if k == "tools"}
    bodies: list[dict[str, Any]] = []
    for k, m in enumerate(messages[:-1], start=1):
        role = m.get("role")
        if role in _ENDS_A_REQUEST:
            bodies.append({"messages": messages[:k], **extra, "add_generation_prompt": True})
        elif role == "assistant":
            bodies.append({"messages": messages[:k], **extra, "add_generation_prompt": False})
    last = messages[-1].get("role")
    whole = {"messages": messages, **extra,
             "add_generation_prompt": bool(entry.body.get("add_generation_prompt",
                                                          last != "assistant"))}
    if last == "assistant":
        bodies.append({"messages": messages, **extra, "add_generation_prompt": False})
    bodies.append(whole)
    out: list[WarmEntry] = []
    seen: set[str] = set()
    for b in bodies:
        key = json.dumps(b, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(WarmEntry(len(out) + 1, "messages", b))
    return tuple(out)
