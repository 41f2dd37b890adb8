#!/usr/bin/env python3
"""Production-like chat traffic against vLLM's OpenAI API: N concurrent streaming users.

    python bench/traffic.py --url http://127.0.0.1:8000 --model cpu-demo --users 8 \\
        [--seed 1] [--turns 8] [--words 150] [--new 2] [--spread 1.0] [--rounds 2] [--json F]

Each user has a long multi-turn history of their own (seeded, reproducible), all sharing one
system prompt, and greedy decoding (temperature 0). A *round* sends one request per user, all
users starting within ``--spread`` seconds of each other; the next round of a returning user
extends their conversation (the history, the question of the round before and the answer
the reference gave to it, then a new question), so a returning user's history is a prefix
of what they send. ``--new`` users join each round with a history never seen before.

Per request it records: time to first token, total time, prompt tokens, the tokens vLLM
reports as cached (``usage.prompt_tokens_details.cached_tokens``: its own prefix cache plus
the connector's external hits; vLLM must run with ``--enable-prompt-tokens-details``), the
output text, the finish reason and, when it failed, the error's class (``connect``:
nothing listens; ``reset``: the connection broke before an answer; ``http-<status>``;
``timeout``; ``stream``: an error event or a stream cut short; ``finish-<reason>``: a stream
that ended without a normal finish, e.g. ``finish-abort`` from a vLLM that stops).

Reference outputs (:func:`references`): each request sent alone with a ``cache_salt`` of its
own, so it is computed cold (no prefix cache, no LMCache hit: the salt is part of both keys)
on the same engine. The library part (:func:`make_users`, :func:`send`, :func:`storm`,
:func:`references`, :func:`compare`) is what the full-stack tests use.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvpersist.demo.chat import long_chat  # noqa: E402

Messages = list[dict[str, str]]
QUESTIONS = (
    "Summarise the whole discussion in one line.",
    "What should the operator check first?",
    "Which part of this costs the most time?",
    "List the next three steps.",
    "What did we decide about the restart order?",
    "Name one risk we have not covered yet.",
)


@dataclass(frozen=True)
class User:
    """One chat user: ``uid``, the round they first appear in, and their opening history
    (system prompt shared by all users + their own turns)."""

    uid: int
    joins: int
    history: tuple[tuple[tuple[str, str], ...], ...] = field(repr=False)

    def opening(self) -> Messages:
        return [dict(m) for m in self.history]


def user_history(uid: int, seed: int, turns: int, words: int,
                 ) -> tuple[tuple[tuple[str, str], ...], ...]:
    """The opening history of user ``uid``: the shared system prompt and ``turns`` turns of
    ``words`` words of their own (deterministic)."""
    msgs = long_chat(turns=turns, words_per_turn=words, seed=seed * 10_007 + uid)
    return tuple(tuple(sorted(m.items())) for m in msgs[:-1])


def make_users(n: int, *, seed: int = 1, turns: int = 8, words: int = 150, new: int = 0,
               rounds: int = 1) -> list[User]:
    """``n`` users present from round 0, plus ``new`` users joining each later round
    (``rounds`` rounds in all). Deterministic for the same arguments."""
    users: list[User] = []
    for r in range(rounds):
        for _ in range(n if r == 0 else new):
            uid = len(users)
            users.append(User(uid, r, user_history(uid, seed, turns, words)))
    return users


#: what a float32 deployment changes in cpu-demo's identity.env: the model and KV dtype (the
#: KV dtype is part of the namespace); --enable-prompt-tokens-details makes vLLM report the
#: cached tokens of each request
FLOAT32 = {"KVP_KV_CACHE_DTYPE": "float32", "KVP_MODEL_DTYPE": "float32"}
FLOAT32_EXTRA = "KVP_VLLM_EXTRA_ARGS=--enable-prompt-tokens-details"


def float32_config(dest: Path) -> Path:
    """A copy of configs/cpu-demo (identity.env and its chat template) in ``dest`` with the
    float32 changes; returns ``dest``. The oracle of identical outputs: vLLM's CPU build is
    deterministic in float32 across cold, prefix-cached, restored and concurrent runs, not in
    bfloat16 (docs/persistence.md)."""
    dest.mkdir(parents=True, exist_ok=True)
    src = REPO / "configs" / "cpu-demo"
    lines = []
    for line in (src / "identity.env").read_text().splitlines():
        key = line.split("=", 1)[0]
        lines.append(f"{key}={FLOAT32[key]}" if key in FLOAT32 else line)
    lines.append(FLOAT32_EXTRA)
    (dest / "identity.env").write_text("\n".join(lines) + "\n")
    (dest / "chat_template.jinja").write_text((src / "chat_template.jinja").read_text())
    return dest


def conversation(user: User, round_no: int, answers: Mapping[tuple[int, int], str]) -> Messages:
    """The messages ``user`` sends in ``round_no``: their opening, then for every earlier
    round of theirs its question and the reference answer, then this round's question.
    ``answers`` maps (uid, round) to the reference answer."""
    msgs = user.opening()
    for r in range(user.joins, round_no):
        msgs.append({"role": "user", "content": QUESTIONS[(user.uid + r) % len(QUESTIONS)]})
        msgs.append({"role": "assistant", "content": answers.get((user.uid, r), "") or "Ok."})
    msgs.append({"role": "user", "content": QUESTIONS[(user.uid + round_no) % len(QUESTIONS)]})
    return msgs


@dataclass
class Record:
    """One request's outcome."""

    uid: int
    round: int
    phase: str
    started: float = 0.0
    ttft_s: float | None = None
    total_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""
    finish_reason: str | None = None
    error_class: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error_class


def send(url: str, model: str, messages: Messages, *, max_tokens: int = 16,
         timeout: float = 300.0, cache_salt: str | None = None,
         record: Record | None = None) -> Record:
    """One greedy streamed chat completion; never raises for what the server does (the
    outcome is in the returned :class:`Record`)."""
    rec = record or Record(-1, -1, "")
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0.0, "seed": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    t0 = time.monotonic()
    rec.started = time.time()
    parts: list[str] = []
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, stream=True,
                           timeout=timeout) as resp:
            if resp.status_code != 200:
                rec.error_class, rec.error = f"http-{resp.status_code}", resp.text[:300]
                return rec
            for raw in resp.iter_lines():
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:]
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if not isinstance(event, dict) or "error" in event:
                    rec.error_class, rec.error = "stream", str(data[:300])
                    return rec
                usage = event.get("usage") or {}
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens")
                for choice in event.get("choices") or []:
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if rec.ttft_s is None:
                            rec.ttft_s = time.monotonic() - t0
                        parts.append(piece)
    except requests.ConnectionError as exc:
        text = str(exc)
        refused = "refused" in text or "NewConnectionError" in text
        rec.error_class, rec.error = ("connect" if refused and not parts else "reset"), \
            text[:300]
    except requests.Timeout as exc:
        rec.error_class, rec.error = "timeout", str(exc)[:300]
    except (requests.RequestException, ValueError) as exc:
        rec.error_class, rec.error = "stream", f"{type(exc).__name__}: {str(exc)[:300]}"
    rec.total_s = time.monotonic() - t0
    rec.text = "".join(parts)
    if not rec.error_class and rec.finish_reason not in ("stop", "length"):
        # a 200 whose stream ends without a normal finish (vLLM aborts the requests it
        # receives while it stops, finish_reason "abort"): an error the client must see,
        # never an answer
        rec.error_class = f"finish-{rec.finish_reason}"
        rec.error = f"stream ended with finish_reason {rec.finish_reason!r} after " \
            f"{len(rec.text)} characters"
    return rec


def storm(url: str, model: str, requests_: Sequence[tuple[int, int, Messages]], *,
          phase: str, spread_s: float = 1.0, seed: int = 0, max_tokens: int = 16,
          timeout: float = 300.0, retry_until: float = 0.0) -> list[Record]:
    """Send every (uid, round, messages) at once: one thread each, each starting at a
    seeded random offset within ``spread_s`` of a common start. With ``retry_until`` (a
    ``time.monotonic()`` deadline), a request that failed (refused because nothing listens,
    cut by a stopping server, answered with an error: the restart window) is sent again
    every 0.5 s until then, as a client would; every failed try is kept in the records."""
    rng = random.Random(seed)
    offsets = [rng.uniform(0, spread_s) for _ in requests_]
    out: list[list[Record]] = [[] for _ in requests_]
    start = time.monotonic() + 0.05

    def one(i: int) -> None:
        uid, rnd, msgs = requests_[i]
        time.sleep(max(0.0, start + offsets[i] - time.monotonic()))
        while True:
            rec = send(url, model, msgs, max_tokens=max_tokens, timeout=timeout,
                       record=Record(uid, rnd, phase))
            out[i].append(rec)
            if rec.ok or time.monotonic() > retry_until:
                return
            time.sleep(0.5)

    threads = [threading.Thread(target=one, args=(i,), daemon=True)
               for i in range(len(requests_))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 60)
    return [r for recs in out for r in recs]


def references(url: str, model: str, requests_: Iterable[tuple[int, int, Messages]], *,
               max_tokens: int = 16, timeout: float = 300.0) -> dict[tuple[int, int], str]:
    """The reference output of each (uid, round): sent alone, one after the other, each with
    a fresh ``cache_salt`` (a cold prefill: nothing cached under that salt anywhere)."""
    out: dict[tuple[int, int], str] = {}
    for uid, rnd, msgs in requests_:
        rec = send(url, model, msgs, max_tokens=max_tokens, timeout=timeout,
                   cache_salt=f"ref-{uuid.uuid4().hex}")
        if not rec.ok:
            raise RuntimeError(f"reference of user {uid} round {rnd} failed: "
                               f"{rec.error_class}: {rec.error}")
        out[(uid, rnd)] = rec.text
    return out


def compare(records: Iterable[Record], refs: Mapping[tuple[int, int], str]) -> list[str]:
    """Every successful record whose text differs from its reference (one line each)."""
    return [f"user {r.uid} round {r.round} ({r.phase}): {r.text!r} != {refs[(r.uid, r.round)]!r}"
            for r in records if r.ok and r.text != refs.get((r.uid, r.round))]


def summary(records: Sequence[Record]) -> dict[str, Any]:
    """Counts and TTFT percentiles of ``records`` (successful requests only for times)."""
    ok = [r for r in records if r.ok]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)

    def pct(p: float) -> float | None:
        if not ttfts:
            return None
        return round(ttfts[min(len(ttfts) - 1, int(p * (len(ttfts) - 1) + 0.5))], 4)

    return {"requests": len(records), "ok": len(ok),
            "errors": dict(Counter(r.error_class for r in records if not r.ok)),
            "ttft_p50_s": pct(0.5), "ttft_p95_s": pct(0.95),
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
            "cached_tokens": sum(r.cached_tokens or 0 for r in ok)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--new", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--words", type=int, default=150)
    ap.add_argument("--spread", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    users = make_users(args.users, seed=args.seed, turns=args.turns, words=args.words,
                       new=args.new, rounds=args.rounds)
    refs: dict[tuple[int, int], str] = {}
    records: list[Record] = []
    for rnd in range(args.rounds):
        batch = [(u.uid, rnd, conversation(u, rnd, refs)) for u in users if u.joins <= rnd]
        refs.update(references(args.url, args.model, batch, max_tokens=args.max_tokens))
        records += storm(args.url, args.model, batch, phase=f"round{rnd}",
                         spread_s=args.spread, seed=args.seed + rnd,
                         max_tokens=args.max_tokens)
    wrong = compare(records, refs)
    doc = {"summary": summary(records), "wrong_outputs": wrong,
           "records": [asdict(r) for r in records]}
    print(json.dumps(doc["summary"], indent=2))
    for line in wrong:
        print("WRONG:", line)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
