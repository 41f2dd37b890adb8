"""Cache roots and names under them that are not UTF-8 or hold control characters, read by
every command that prints a root or a path from the disk (``report``, ``prune --list``,
``metrics``, ``verify``, ``health``, ``status``, ``launch --check``).

Each command runs under the bounds of tests/hostile.py (its stdout and stderr encode with
``backslashreplace``, so a path printed as it is would show as ``\\udcff``: the tests fail on
that, as on a raw escape character). The roots given with ``--root`` are
``bad-\\xff/root`` and ``a\\nb\\x1b[2J/root``; a config's root comes from the environment
(``KVP_CACHE_ROOT``: one that is not UTF-8 is refused as a configuration error, exit 2).
Under each root: a foreign file ``x\\xff.bin``, a foreign directory ``d\\xff`` holding one, a
name like a chunk of cpu-demo's namespace whose salt holds ``\\xff`` (foreign: LMCache cannot
have written it, issue 40), a chunk whose salt holds a newline, and an operator's
``notes\\xff.tmp.keep``.

What it shows: no traceback, no ``UnicodeEncodeError``; every ``--json`` output is one JSON
document in ASCII whose names are the names on disk (bytes that are not UTF-8 as PEP 383's
``\\udcXX`` escapes: ``os.fsencode`` gives them back, docs/inventory.md); the text output
is printable and escaped by kvpersist; the metrics' ``root``
label is the escaped path (what ``report`` shows) and the exposition passes
``promtool check metrics``; the textfile of a root is named by the digest of its path's
bytes. Two runs in real processes with a strict UTF-8 stdout prove the same without the
harness's fallback encoder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpersist.actions.metrics import textfile_name_for_root
from kvpersist.l2.layout import ChunkName, display_name

from ..cli import kvp
from ..conftest import clean_env, free_port
from ..hostile import HostileRunner, Outcome, assert_all_bounded

NS = "kvp-8a8877c212dbb9f802c2eb354e22b53a"  # configs/cpu-demo
CHUNK = ChunkName(NS, 0x01000100, 0, "ab" * 32).filename().encode()
#: what lies under each root (bytes), and what it is
NAMES: dict[bytes, str] = {
    b"x\xff.bin": "foreign",
    b"d\xff/inner\xff": "foreign",
    CHUNK[:-4] + b"@s\xfft.bin": "foreign",
    CHUNK[:-4].replace(b"abab", b"cdcd", 1) + b"@s\nt.bin": "chunk",
    b"notes\xff.tmp.keep": "foreign",
}
ROOTS = [b"bad-\xff/root", b"a\nb\x1b[2J/root"]


def _fill(root: bytes) -> None:
    os.makedirs(root, mode=0o700)
    for name, _ in NAMES.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"z" * 4096)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], str]:
    """The hostile roots (as str, surrogate-escaped as Python holds such paths) and a clean
    root with the same hostile names under it (for configs)."""
    top = os.fsencode(tmp_path_factory.mktemp("hostile-paths"))
    roots = [os.path.join(top, r) for r in ROOTS]
    clean = os.path.join(top, b"clean", b"root")
    for r in [*roots, clean]:
        _fill(r)
    return [os.fsdecode(r) for r in roots], os.fsdecode(clean)


@pytest.fixture(scope="module")
def runner() -> Iterator[HostileRunner]:
    with HostileRunner() as h:
        yield h


def demo_env(root: str) -> dict[str, str]:
    env = clean_env()
    env.update({"KVP_CACHE_ROOT": root, "KVP_LMCACHE_PORT": str(free_port()),
                "KVP_LMCACHE_HTTP_PORT": str(free_port()), "KVP_VLLM_PORT": str(free_port()),
                "KVP_L2_SERDE": "none", "KVP_L2_BUDGET": "1M", "KVP_L2_RESERVE": "0"})
    return env


def escaped_by_kvpersist(o: Outcome) -> None:
    """What the command printed as text was escaped by kvpersist, not by the stream's
    fallback (a lone surrogate would show as ``\\udcXX``), and carries no raw control
    character; a ``--json`` document is ASCII (its escapes are JSON's own)."""
    is_json = "--json" in o.argv and o.code in (0, 1, 2)
    for stream in (o.stderr,) if is_json else (o.stdout, o.stderr):
        assert "\\udc" not in stream, (o.argv, stream[-2000:])
        assert "\x1b" not in stream and all(line.isprintable() for line in
                                            stream.splitlines()), (o.argv, stream[-2000:])
    if is_json:
        assert o.stdout.isascii(), o.argv
        json.loads(o.stdout)


def promtool_accepts(text: str) -> None:
    exe = shutil.which("promtool")
    assert exe, "promtool (Debian package prometheus) is installed by scripts/setup.sh"
    chk = subprocess.run([exe, "check", "metrics"], input=text, text=True,
                         capture_output=True, timeout=60)
    assert chk.returncode == 0, chk.stdout + chk.stderr


def test_roots_given_with_root(tree: tuple[list[str], str], runner: HostileRunner,
                               tmp_path: Path) -> None:
    roots, _ = tree
    outcomes: list[Outcome] = []
    for root in roots:
        for argv in (["report"], ["report", "--json"],
                     ["prune", "--namespace", NS, "--list"],
                     ["prune", "--namespace", NS, "--list", "--json"],
                     ["prune", "--temp-older-than", "0s", "--list"],
                     ["metrics", "--no-vllm"]):
            outcomes.append(runner.run(*argv, "--root", root))
        doc = json.loads(outcomes[-5].stdout)
        # the root as it is: os.fsencode gives the bytes back (PEP 383)
        assert doc["root"] == root and doc["chunk_files"] == 1, doc
        assert os.fsencode(doc["root"]) == os.fsencode(root)
        assert doc["foreign"]["files"] == 4 and doc["lmcache_deletes_at_stop"]["files"] == 1
        pruned = json.loads(outcomes[-3].stdout)
        assert pruned["planned"]["files"] == 1 and pruned["root"] == root
        assert [os.fsencode(f) for f in pruned["files"]] == [
            CHUNK[:-4].replace(b"abab", b"cdcd", 1) + b"@s\nt.bin"]  # a newline is a newline
        exposition = outcomes[-1].stdout
        labels = {s.labels.get("root") for fam in text_string_to_metric_families(exposition)
                  for s in fam.samples if "root" in s.labels}
        assert labels == {display_name(root)}, labels
        promtool_accepts(exposition)

        textfiles = os.path.join(os.fsencode(tmp_path), b"prom-\xff")
        os.mkdir(textfiles)
        written = runner.run("metrics", "--no-vllm", "--root", root, "--textfile",
                             os.fsdecode(textfiles))
        outcomes.append(written)
        name = textfile_name_for_root(os.path.realpath(os.fsencode(root)))
        assert name == textfile_name_for_root(os.path.realpath(root))
        with open(os.path.join(textfiles, name.encode()), encoding="utf-8") as f:
            promtool_accepts(f.read())
        assert "wrote " in written.stderr and "prom-\\xff" in written.stderr
        shutil.rmtree(textfiles)
    missing = roots[0] + "\udcfe-missing"
    outcomes += [runner.run("report", "--root", missing, "--json"),
                 runner.run("metrics", "--no-vllm", "--root", missing)]
    assert outcomes[-1].code == 2 and "\\xfe-missing" in outcomes[-1].stderr
    assert_all_bounded(outcomes, allowed=(0, 2))
    for o in outcomes:
        escaped_by_kvpersist(o)
    assert len(outcomes) == 2 * 7 + 2


CONFIG_COMMANDS: list[list[str]] = [
    ["verify", "cpu-demo"], ["verify", "cpu-demo", "--json"],
    ["health", "cpu-demo", "--no-vllm"], ["health", "cpu-demo", "--no-vllm", "--json"],
    ["status", "cpu-demo"], ["status", "cpu-demo", "--json"],
    ["metrics", "cpu-demo", "--no-vllm", "--timeout", "1"],
    ["report", "--config", "cpu-demo"], ["report", "--config", "cpu-demo", "--json"],
    ["prune", "--config", "cpu-demo", "--namespace", NS, "--force", "--list"],
    ["launch", "cpu-demo", "--check", "--no-vllm"],
]


def test_names_under_a_configs_root(tree: tuple[list[str], str],
                                    runner: HostileRunner) -> None:
    roots, clean = tree
    outcomes = [runner.run(*argv, env=demo_env(clean)) for argv in CONFIG_COMMANDS]
    # a config's root that is not UTF-8 (from the environment) is a configuration error
    refused = [runner.run(*argv, env=demo_env(roots[0])) for argv in CONFIG_COMMANDS]
    assert_all_bounded(outcomes, allowed=(0, 1, 2, 3))
    assert_all_bounded(refused, allowed=(2,))
    for o in outcomes + refused:
        escaped_by_kvpersist(o)
    assert all("KVP_CACHE_ROOT" in o.stderr for o in refused)
    exposition = outcomes[6].stdout
    promtool_accepts(exposition)
    assert f'root="{clean}"' in exposition
    verify = json.loads(outcomes[1].stdout)
    assert verify["files"] == 1 and verify["root"] == clean, verify
    assert len(outcomes) + len(refused) == 2 * len(CONFIG_COMMANDS)


def test_a_strict_utf8_stdout_never_raises(tree: tuple[list[str], str]) -> None:
    """Without the harness's fallback encoder: a real process whose stdout refuses what is
    not UTF-8 (PYTHONIOENCODING=utf-8:strict); its output decodes as strict UTF-8."""
    roots, _ = tree
    env = {**clean_env(), "PYTHONIOENCODING": "utf-8:strict"}
    r = kvp("report", "--root", roots[0], env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert f"L2 cache root {display_name(roots[0])}\n" in r.stdout
    m = kvp("metrics", "--no-vllm", "--root", roots[1], env=env)
    assert m.returncode == 0 and "Traceback" not in m.stderr, m.stderr
    assert {s.labels["root"] for fam in text_string_to_metric_families(m.stdout)
            for s in fam.samples if "root" in s.labels} == {display_name(roots[1])}
