"""The error root holds: every command, given missing, unreadable or wrong-type paths, exits 1
or 2 with a one-line reason and never a traceback; a command that reads a root never creates
it; and every exception type of kvpersist derives from KvpError."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

import kvpersist
from kvpersist.errors import KvpError

from ..cli import kvp
from ..conftest import REPO, clean_env, free_port

NS = "kvp-0123456789abcdef0123456789abcdef"
NOBODY = 65534
#: runs a command as uid/gid 65534 (no supplementary groups)
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def relocated_env(root: Path, **extra: str) -> dict[str, str]:
    env = clean_env()
    env.update({"KVP_CACHE_ROOT": str(root), "KVP_LMCACHE_PORT": str(free_port()),
                "KVP_LMCACHE_HTTP_PORT": str(free_port()), "KVP_VLLM_PORT": str(free_port()),
                **extra})
    return env


def assert_clean_failure(res: subprocess.CompletedProcess[str], codes: tuple[int, ...] = (1, 2),
                         ) -> None:
    assert res.returncode in codes, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr
    assert res.stderr.strip(), "a failure must say why"


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, Path]:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    (locked / "x").write_text("x")
    return {"missing": tmp_path / "no" / "such", "file": a_file, "locked": locked,
            "tmp": tmp_path}


# (name, argv builder) for commands that take --root
ROOT_CASES: list[tuple[str, Callable[[str], list[str]]]] = [
    ("report", lambda r: ["report", "--root", r]),
    ("report-json", lambda r: ["report", "--root", r, "--json"]),
    ("prune-dry", lambda r: ["prune", "--root", r, "--namespace", NS]),
    ("prune-apply", lambda r: ["prune", "--root", r, "--namespace", NS, "--apply"]),
    ("prune-temp", lambda r: ["prune", "--root", r, "--temp-older-than", "1h"]),
    ("prune-stale", lambda r: ["prune", "--root", r, "--stale", "--config", "cpu-demo"]),
    ("metrics", lambda r: ["metrics", "--root", r]),
]


@pytest.mark.parametrize("kind", ["missing", "file"])
@pytest.mark.parametrize(("name", "argv"), ROOT_CASES, ids=[c[0] for c in ROOT_CASES])
def test_root_commands_on_bad_roots(paths: dict[str, Path], kind: str, name: str,
                                    argv: Callable[[str], list[str]]) -> None:
    root = paths[kind]
    res = kvp(*argv(str(root)))
    assert_clean_failure(res)
    assert not paths["missing"].exists(), "a command that reads a root never creates it"
    assert not (paths["tmp"] / "no").exists()


@pytest.mark.parametrize(("name", "argv"), ROOT_CASES, ids=[c[0] for c in ROOT_CASES])
def test_root_commands_on_an_unreadable_root(paths: dict[str, Path], name: str,
                                             argv: Callable[[str], list[str]]) -> None:
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.fail("this test runs as root with setpriv (util-linux) to act as another user")
    res = kvp(*argv(str(paths["locked"])), wrapper=AS_NOBODY)
    assert_clean_failure(res)


CONFIG_COMMANDS: list[list[str]] = [
    ["render", "cpu-demo"], ["render", "cpu-demo", "--json"], ["budget", "cpu-demo"],
    ["launch", "cpu-demo", "--check"], ["launch", "cpu-demo", "--check", "--no-vllm"],
    ["verify", "cpu-demo"], ["report", "--config", "cpu-demo"],
    ["metrics", "cpu-demo", "--no-vllm", "--timeout", "0.5"],
]


@pytest.mark.parametrize("argv", CONFIG_COMMANDS, ids=lambda a: "-".join(a))
def test_config_commands_with_a_cache_root_that_is_a_file(paths: dict[str, Path],
                                                          argv: list[str]) -> None:
    res = kvp(*argv, env=relocated_env(paths["file"]))
    assert_clean_failure(res)


@pytest.mark.parametrize("argv", [["verify", "cpu-demo"], ["report", "--config", "cpu-demo"],
                                  ["metrics", "cpu-demo", "--no-vllm", "--timeout", "0.5"]],
                         ids=lambda a: "-".join(a))
def test_read_commands_with_a_missing_cache_root(paths: dict[str, Path],
                                                 argv: list[str]) -> None:
    res = kvp(*argv, env=relocated_env(paths["missing"]))
    assert_clean_failure(res)
    assert not paths["missing"].exists()


def test_verify_with_an_unreadable_key(paths: dict[str, Path]) -> None:
    root = paths["tmp"] / "cache"
    root.mkdir(mode=0o700)
    key_dir = paths["tmp"] / "keys"
    key_dir.mkdir()
    (key_dir / "k").mkdir()  # a directory where the key file should be
    res = kvp("verify", "cpu-demo",
              env=relocated_env(root, KVP_SERDE_KEY_FILE=str(key_dir / "k")))
    assert_clean_failure(res)


@pytest.mark.parametrize("what", ["status", "health", "stop"])
def test_lifecycle_commands_with_a_pid_file_that_is_a_directory(paths: dict[str, Path],
                                                                 what: str) -> None:
    root = paths["tmp"] / "cache"
    root.mkdir(mode=0o700)
    (root / "lmcache-server.pid").mkdir()  # where 0.1 kept it (still read)
    (paths["tmp"] / ".kvpersist" / "cache" / "pids" / "cpu-demo.lmcache.pid").mkdir(
        parents=True)
    res = kvp(what, "cpu-demo", "--json", env=relocated_env(root))
    assert res.returncode in (1, 2), res.stderr
    assert "Traceback" not in res.stderr


def test_render_out_is_a_file(paths: dict[str, Path]) -> None:
    root = paths["tmp"] / "cache"
    root.mkdir(mode=0o700)
    res = kvp("render", "cpu-demo", "--out", str(paths["file"]), env=relocated_env(root))
    assert_clean_failure(res)


@pytest.mark.parametrize("argv", [
    ["identity", "show", "/no/such/identity.env"],
    ["identity", "namespace", "/no/such/dir"],
    ["identity", "template-sha", "/no/such/template.jinja"],
    ["identity", "diff", "cpu-demo", "/no/such"],
    ["render", "/no/such/identity.env"],
    ["budget", "/no/such"],
    ["status", "/no/such"],
    ["health", "/no/such"],
    ["stop", "/no/such"],
    ["verify", "/no/such"],
    ["launch", "/no/such", "--check"],
], ids=lambda a: "-".join(a))
def test_missing_config_paths(argv: list[str]) -> None:
    assert_clean_failure(kvp(*argv))


def test_template_sha_of_a_directory(paths: dict[str, Path]) -> None:
    assert_clean_failure(kvp("identity", "template-sha", str(paths["tmp"])))


def test_unreadable_identity_file(paths: dict[str, Path]) -> None:
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.fail("this test runs as root with setpriv (util-linux) to act as another user")
    d = paths["locked"] / "dep"
    d.mkdir()
    (d / "identity.env").write_text((REPO / "configs/cpu-demo/identity.env").read_text())
    os.chmod(paths["tmp"], 0o755)
    res = kvp("identity", "show", str(d / "identity.env"), wrapper=AS_NOBODY)
    assert_clean_failure(res)


def test_every_exception_type_derives_from_kvp_error() -> None:
    found = []
    for mod in pkgutil.walk_packages(kvpersist.__path__, "kvpersist."):
        if mod.name.startswith("kvpersist.demo"):
            continue  # the demo imports torch; its errors are KvpError too (checked below)
        module = importlib.import_module(mod.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == module.__name__ and issubclass(obj, BaseException):
                found.append(obj)
                assert issubclass(obj, KvpError), f"{obj.__module__}.{obj.__name__}"
    assert len(found) >= 8, found
