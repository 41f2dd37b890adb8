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

The requests are built in time and memory linear in the conversation (each is a view: a
prefix length and whether it ends with the generation prompt; its messages are sliced only
when it is tokenized), and a conversation of more than :data:`MAX_MESSAGES` messages is
refused (exit 2): each request is rendered and tokenized whole, so the work grows with the
square of the turns (issue 40: 8,000 turns took 52 s and 1.5 GB, 40,000 ended in
``MemoryError``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

from kvpersist.config.warmset import WarmEntry, parse_warm_set
from kvpersist.errors import ConfigError, Problem
from kvpersist.system.untrusted import UnreadableFile, parse_json

#: the most bytes an input file may hold (a long conversation is far below)
MAX_BYTES = 16 << 20
#: LMCache refuses longer token sequences (``key_resolver.MAX_TOKEN_IDS``)
MAX_TOKEN_IDS = 1_000_000
#: the most messages a conversation may hold: each user, tool and assistant message is a
#: request rendered and tokenized whole, so the work grows with the square of this
MAX_MESSAGES = 2048
KINDS = ("messages", "prompt", "token_ids")
_ENDS_A_REQUEST = ("user", "tool")


@dataclass(frozen=True)
class ForgetInput:
    """The parsed input: ``entries`` to tokenize as the deployment does (messages, prompt),
    or ``token_ids`` given as they are."""

    kind: str
    source: str
    entries: Sequence[WarmEntry] = ()
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
    return ForgetInput(kind, source, conversation_requests(
        _conversation(_bounded_conversation(doc, source), source)))


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


def _bounded_conversation(doc: Any, source: str) -> Any:
    """``doc`` if its conversation has at most :data:`MAX_MESSAGES` messages (checked before
    anything is built from it); raises ConfigError (exit 2) naming the file otherwise."""
    messages = doc.get("messages") if isinstance(doc, dict) else doc
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise ConfigError(Problem(source, f"holds {len(messages):,} messages, more than the "
                                          f"{MAX_MESSAGES:,} a conversation may have here "
                                          "(each of its turns is a request tokenized whole)",
                                  "see docs/forget.md, 'Limits': prune --namespace, shred "
                                  "or KVP_L2_MAX_AGE remove what no single forget can"),
                          source)
    return doc


class Requests(Sequence[WarmEntry]):
    """The requests of one conversation, each made on access from ``(prefix length, with the
    generation prompt)``: memory linear in the conversation, however many turns it has."""

    def __init__(self, messages: Sequence[Mapping[str, Any]], extra: Mapping[str, Any],
                 views: Sequence[tuple[int, bool]]) -> None:
        self._messages, self._extra, self._views = messages, dict(extra), tuple(views)

    def __len__(self) -> int:
        return len(self._views)

    @overload
    def __getitem__(self, i: int) -> WarmEntry: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[WarmEntry]: ...

    def __getitem__(self, i: int | slice) -> WarmEntry | Sequence[WarmEntry]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        k, prompt = self._views[i]
        line = range(len(self))[i] + 1
        return WarmEntry(line, "messages", {"messages": list(self._messages[:k]), **self._extra,
                                            "add_generation_prompt": prompt})

    def __iter__(self) -> Iterator[WarmEntry]:
        return (self[i] for i in range(len(self)))

    def views(self) -> tuple[tuple[int, bool], ...]:
        """(messages, with the generation prompt) of each request, in order."""
        return self._views


def conversation_requests(entry: WarmEntry) -> Requests:
    """The requests a conversation was sent as (see the module docstring), in order, each a
    ``messages`` entry numbered from 1; identical ones once. The whole conversation as the
    file gives it is always the last (``add_generation_prompt`` as the file says, default
    true). Linear in the conversation: no request is built before it is used."""
    messages = list(entry.body["messages"])
    extra = {k: v for k, v in entry.body.items() if k == "tools"}
    views: list[tuple[int, bool]] = []
    for k, m in enumerate(messages[:-1], start=1):
        role = m.get("role")
        if role in _ENDS_A_REQUEST:
            views.append((k, True))
        elif role == "assistant":
            views.append((k, False))
    last = messages[-1].get("role")
    if last == "assistant":
        views.append((len(messages), False))
    views.append((len(messages), bool(entry.body.get("add_generation_prompt",
                                                       last != "assistant"))))
    # two requests are the same body exactly when they have the same prefix and prompt
    return Requests(messages, extra, list(dict.fromkeys(views)))
