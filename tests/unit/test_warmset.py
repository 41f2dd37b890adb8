"""The warm set (KVP_WARMUP_FILE): parsing, the token-id cache document, and what
``kvp-admin warmup`` does before it needs vLLM or a server (bad input: exit 2, nothing
written; no warm set: exit 0)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.config.warmset import (
    parse_tokens_document,
    parse_warm_set,
    tokens_document,
)
from kvpersist.errors import ConfigError

from ..cli import kvp
from ..conftest import REPO, clean_env, free_port
from .test_cli_startup import HEAVY, WRAPPER, matching

GOOD = (
    '{"messages": [{"role": "system", "content": "You are terse."}, '
    '{"role": "user", "content": "Hi"}], "add_generation_prompt": false}\n'
    "\n"
    '{"prompt": "A shared document."}\n'
    '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
    '"function": {"name": "f", "parameters": {}}}]}\n'
)


def test_a_good_warm_set_keeps_its_lines_and_digest() -> None:
    data = GOOD.encode()
    ws = parse_warm_set(data, "/w.jsonl")
    assert [(e.line, e.kind) for e in ws.entries] == [(1, "messages"), (3, "prompt"),
                                                      (4, "messages")]
    assert ws.sha256 == hashlib.sha256(data).hexdigest()
    assert ws.entries[0].body["add_generation_prompt"] is False


BAD_LINES = [
    ("not json", "not valid JSON"),
    ('["a list"]', "must be a JSON object"),
    ('{"prompt": "x", "messages": []}', "exactly one of"),
    ("{}", "exactly one of"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"prompt": "x", "model": "m"}', "unknown key"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "role must be one of"),
    ('{"messages": [{"role": "user", "content": 3}]}', "content must be"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}', "'tools'"),
    ('{"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"}',
     "true or false"),
    ('{"messages": [{"role": "user", "content": "x"}], "temperature": 0}', "unknown key"),
]


@pytest.mark.parametrize(("line", "why"), BAD_LINES)
def test_each_bad_line_is_named(line: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_warm_set((GOOD + line + "\n").encode(), "/w.jsonl")
    (problem,) = err.value.problems
    assert problem.where == "/w.jsonl:5" and why in problem.message


def test_every_bad_line_is_reported_at_once() -> None:
    text = "nope\n" + GOOD + "{}\n\n[1]\n"
    with pytest.raises(ConfigError) as err:
        parse_warm_set(text.encode(), "/w.jsonl")
    assert [p.where for p in err.value.problems] == ["/w.jsonl:1", "/w.jsonl:6", "/w.jsonl:8"]


@pytest.mark.parametrize(("data", "why"), [
    (b"", "holds no entry"),
    (b"\n \n", "holds no entry"),
    (b'{"prompt": "\xff"}\n', "not UTF-8"),
])
def test_files_that_are_not_warm_sets(data: bytes, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_warm_set(data, "/w.jsonl")
    assert why in str(err.value)


def test_the_token_cache_is_used_only_for_its_own_keys() -> None:
    doc = tokens_document("kvp-" + "a" * 32, "1" * 64, "2" * 64, [[1, 2, 3], []], [1, 3])
    doc = json.loads(json.dumps(doc))
    assert parse_tokens_document(doc, "kvp-" + "a" * 32, "1" * 64, "2" * 64) == [[1, 2, 3], []]
    for args in (("kvp-" + "b" * 32, "1" * 64, "2" * 64), ("kvp-" + "a" * 32, "3" * 64, "2" * 64),
                 ("kvp-" + "a" * 32, "1" * 64, "4" * 64)):
        assert parse_tokens_document(doc, *args) is None
    doc["entries"][0]["token_ids"] = [1, -2]
    assert parse_tokens_document(doc, "kvp-" + "a" * 32, "1" * 64, "2" * 64) is None


# ----------------------------------------------------------------------------- the command


def run_warmup(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = dict(clean_env(), KVP_CACHE_ROOT=str(tmp_path / "cache"),
                KVP_LMCACHE_PORT=str(free_port()), KVP_LMCACHE_HTTP_PORT=str(free_port()),
                KVP_VLLM_PORT=str(free_port()), KVP_MODEL_PATH=str(tmp_path / "model"))
    return kvp("warmup", "cpu-demo", "--wait", "1", *([] if "json" not in env else ["--json"]),
               env={**base, **{k: v for k, v in env.items() if k != "json"}})


def written(tmp_path: Path) -> list[str]:
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                  if p.is_file() and p.name != "warm.jsonl")


def test_bad_lines_exit_2_with_line_numbers_and_nothing_written(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    wf = tmp_path / "warm.jsonl"
    wf.write_text(GOOD + "{}\n" + '{"prompt": 1}\n')
    r = run_warmup(tmp_path, KVP_WARMUP_FILE=str(wf))
    assert r.returncode == 2, r.stderr
    assert f"{wf}:5" in r.stderr and f"{wf}:6" in r.stderr
    assert "Traceback" not in r.stderr
    assert written(tmp_path) == []


def test_a_missing_warm_file_is_bad_input(tmp_path: Path) -> None:
    r = run_warmup(tmp_path, KVP_WARMUP_FILE=str(tmp_path / "nope.jsonl"))
    assert r.returncode == 2 and "cannot be read" in r.stderr
    assert written(tmp_path) == []


def test_a_relative_warm_file_is_a_config_error(tmp_path: Path) -> None:
    r = run_warmup(tmp_path, KVP_WARMUP_FILE="warm.jsonl")
    assert r.returncode == 2 and "KVP_WARMUP_FILE" in r.stderr and "absolute" in r.stderr


def test_no_warm_set_is_not_an_error(tmp_path: Path) -> None:
    r = run_warmup(tmp_path, json="1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["state"] == "none" and out["warm_set"] is False
    (state,) = tmp_path.rglob("warmup.json")
    doc = json.loads(state.read_text())
    assert doc["state"] == "done" and doc["warm_set"] is False and doc["error"] is None
    assert set(doc) >= {"state", "namespace", "started", "finished", "requested_chunks",
                        "found_chunks", "bytes", "seconds", "error"}
    assert state.stat().st_mode & 0o777 == 0o600
    r = run_warmup(tmp_path)
    assert r.returncode == 0 and "no warm set" in r.stdout


def test_an_unpinned_namespace_has_nothing_to_warm(tmp_path: Path) -> None:
    wf = tmp_path / "warm.jsonl"
    wf.write_text(GOOD)
    ident = tmp_path / "cfg" / "identity.env"
    ident.parent.mkdir()
    text = (REPO / "configs" / "cpu-demo" / "identity.env").read_text()
    ident.write_text(text.replace("KVP_MODEL_REVISION=", "# KVP_MODEL_REVISION=") +
                     "KVP_ALLOW_UNPINNED=true\n")
    base = dict(clean_env(), KVP_CACHE_ROOT=str(tmp_path / "cache"),
                KVP_WARMUP_FILE=str(wf), KVP_MODEL_PATH=str(tmp_path / "model"))
    r = kvp("warmup", str(ident), env=base)
    assert r.returncode == 2 and "unpinned" in r.stderr, r.stderr
    assert written(tmp_path) == ["cfg/identity.env"]


def cached_and_pinned(tmp_path: Path) -> tuple[dict[str, str], str]:
    """A one-line warm set whose token ids are cached and whose pins are recorded (so a
    warm-up needs neither vLLM nor LMCache), and a cache server port nobody listens on:
    the environment and the state dir."""
    from kvpersist.config.loader import load_deployment
    from kvpersist.config.warmset import file_digest, tokens_cache_name
    from kvpersist.l2.layout import ChunkName
    from kvpersist.l2.pins.store import write_pins
    from kvpersist.l2.pins.usage import pin_document
    from kvpersist.l2.tree import open_root
    from kvpersist.system.files import atomic_write_json

    (tmp_path / "cache").mkdir()
    wf = tmp_path / "warm.jsonl"
    wf.write_text('{"prompt": "x"}\n')
    env = {"KVP_CACHE_ROOT": str(tmp_path / "cache"), "KVP_WARMUP_FILE": str(wf),
           "KVP_LMCACHE_HTTP_PORT": str(free_port()), "KVP_MODEL_PATH": str(tmp_path / "m")}
    dep = load_deployment("cpu-demo", environ=env)
    assert dep.identity is not None
    sha = file_digest(wf.read_bytes())
    atomic_write_json(Path(dep.settings.state_dir) / "warmup" / tokens_cache_name(
        dep.namespace, sha), tokens_document(dep.namespace, sha,
                                             dep.identity.chat_template_sha256,
                                             [list(range(300))], [1]))
    with open_root(tmp_path / "cache", purpose="write the pins of") as root:
        write_pins(root, pin_document(
            dep.namespace, sha, [ChunkName(dep.namespace, 0x01000100, 0, "ab" * 32).filename()],
            world_size=1, chunk_size=256, hash_algorithm="blake3", shard_dirs=False,
            chunks=1, created_ns=1))
    return env, dep.settings.state_dir


def test_a_server_that_does_not_answer_fails_the_warm_up_with_exit_1(tmp_path: Path) -> None:
    """With the token ids cached and the pins recorded, a warm-up needs neither vLLM nor
    LMCache: this runs without them, against a port nobody listens on."""
    env, state_dir = cached_and_pinned(tmp_path)
    r = subprocess.run([sys.executable, "-c", WRAPPER, "warmup", "cpu-demo", "--wait", "2",
                        "--json"], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**clean_env(), **env})
    data = json.loads(r.stdout.split("\nMODULES=")[-1])
    assert data["code"] == 1, r.stderr
    assert matching(data["modules"], HEAVY) == []
    out = json.loads(r.stdout.split("\nMODULES=")[0])
    assert out["tokens_cached"] and out["pins"]["reused"]
    assert out["state"] == "failed" and "does not answer" in out["error"]
    assert (out["requested_chunks"], out["found_chunks"]) == (1, 0)
    state = json.loads((Path(state_dir) / "warmup.json").read_text())
    assert state["state"] == "failed" and state["error"] == out["error"]


# ----------------------------------------------------------------------------- the launch's child


def run_child(env: dict[str, str], handoff_dir: Path) -> subprocess.CompletedProcess[str]:
    """The warm-up a launch starts (``readiness.warmup_argv``), with ``env``, handed the
    rendered arguments as a launch hands them."""
    from kvpersist.config.loader import load_deployment
    from kvpersist.stack.warm.handoff import write_handoff
    from kvpersist.stack.warm.readiness import warmup_argv
    from kvpersist.stack.warm.run import render_handoff

    handoff_dir.mkdir(parents=True, exist_ok=True)
    handoff = handoff_dir / "warmup-handoff.json"
    write_handoff(str(handoff), render_handoff(load_deployment("cpu-demo", env,
                                                               allow_unpinned=True)))
    return subprocess.run(warmup_argv("cpu-demo", 1.0, str(handoff)), capture_output=True,
                          text=True, cwd=REPO, timeout=120, env=env)


def test_the_launch_child_keeps_the_commands_contract(tmp_path: Path) -> None:
    """``python -m kvpersist.cli warmup CONFIG --wait S --json --rendered FILE``: the JSON of
    ``kvp-admin warmup --json`` on stdout, exit 0 without a warm set, 2 for bad input (the
    message on stderr, nothing written), 1 for a warm-up that failed."""
    base = dict(clean_env(), KVP_CACHE_ROOT=str(tmp_path / "cache"),
                KVP_LMCACHE_PORT=str(free_port()), KVP_LMCACHE_HTTP_PORT=str(free_port()),
                KVP_VLLM_PORT=str(free_port()), KVP_MODEL_PATH=str(tmp_path / "model"))
    (tmp_path / "cache").mkdir()
    wf = tmp_path / "warm.jsonl"
    wf.write_text(GOOD + "{}\n")
    elsewhere = tmp_path.parent / f"{tmp_path.name}-handoff"  # not among the files written
    r = run_child(dict(base, KVP_WARMUP_FILE=str(wf)), elsewhere / "1")
    assert r.returncode == 2 and f"{wf}:5" in r.stderr, r.stderr
    err = json.loads(r.stdout)  # kvp-admin's --json: one error document
    assert err["schema"] == "kvpersist.error/1" and err["exit_code"] == 2
    assert r.stderr.startswith("kvp-admin: ") and "Traceback" not in r.stderr
    assert written(tmp_path) == []
    r = run_child(base, elsewhere / "2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["state"] == "none" and out["warm_set"] is False
    by_hand = run_warmup(tmp_path, json="1")
    assert by_hand.returncode == 0 and set(json.loads(by_hand.stdout)) == set(out)

    (tmp_path / "failed").mkdir()
    env, state_dir = cached_and_pinned(tmp_path / "failed")
    r = run_child({**clean_env(), **env}, elsewhere / "3")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens_cached"] and out["pins"]["reused"]
    assert out["state"] == "failed" and "does not answer" in out["error"]
    state = json.loads((Path(state_dir) / "warmup.json").read_text())
    assert state["state"] == "failed" and state["error"] == out["error"]
