"""The shared tier's launcher: credentials go into the in-process argv or environment only."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from kvpersist.config.shared_tier import SharedSecret
from kvpersist.errors import KvpError
from kvpersist.stack.lmcache_exec import (
    SharedOff,
    _store_down,
    check_ca_file,
    exec_argv,
    inject,
    read_off_record,
    read_secret_file,
    shared_adapters,
    store_nodes,
    valkey_swaps_credentials,
    without_adapter,
)
from tests.conftest import free_port

NVME = json.dumps({"type": "nixl_store_dynamic"})
SECRET = SharedSecret("kvp", "pw-123")


def argv(shared: dict[str, object]) -> list[str]:
    return ["lmcache", "server", "--l2-adapter", NVME, "--l2-adapter", json.dumps(shared)]


def test_resp_gets_the_environment_and_an_unchanged_argv() -> None:
    a = argv({"type": "resp", "host": "h", "port": 1})
    out, env = inject(a, SECRET, valkey_swapped=True)
    assert out == a
    assert env == {"LMCACHE_RESP_USERNAME": "kvp", "LMCACHE_RESP_PASSWORD": "pw-123"}


@pytest.mark.parametrize(("swapped", "user", "password"),
                         [(False, "kvp", "pw-123"), (True, "pw-123", "kvp")])
def test_valkey_gets_json_fields(swapped: bool, user: str, password: str) -> None:
    out, env = inject(argv({"type": "valkey", "startup_nodes": "h:1"}), SECRET,
                      valkey_swapped=swapped)
    spec = json.loads(out[-1])
    assert (spec["username"], spec["password"]) == (user, password) and env == {}
    assert out[3] == NVME


def test_exactly_one_shared_adapter() -> None:
    with pytest.raises(KvpError, match="found 0"):
        inject(["lmcache", "server", "--l2-adapter", NVME], SECRET, valkey_swapped=False)


def test_the_installed_lmcache_swaps_and_is_recognised() -> None:
    import importlib.util

    spec = importlib.util.find_spec("lmcache.v1.storage_backend.valkey.worker_pool")
    assert spec is not None and spec.origin
    # LMCache 0.5.6 passes (username, password) to ServerCredentials(password, username)
    assert valkey_swaps_credentials(Path(spec.origin).read_text())
    assert not valkey_swaps_credentials("ServerCredentials(password=p, username=u)")


def test_exec_argv_holds_no_secret() -> None:
    a = exec_argv("/py", "/etc/kvp/s", ["lmcache", "server"])
    assert a == ["/py", "-m", "kvpersist.stack.lmcache_exec", "--secret-file", "/etc/kvp/s",
                 "--", "lmcache", "server"]


def test_exec_argv_names_the_ca_file() -> None:
    a = exec_argv("/py", "/etc/kvp/s", ["lmcache", "server"], tls_ca="/etc/kvp/ca.pem")
    assert a[3:8] == ["--secret-file", "/etc/kvp/s", "--tls-ca", "/etc/kvp/ca.pem", "--"]


PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def test_ca_file_must_be_a_pem_only_its_owner_can_change(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    f = tmp_path / "ca.pem"
    f.write_text(PEM)
    f.chmod(0o644)
    check_ca_file(str(f))  # readable by all is fine: a CA is no secret
    f.chmod(0o664)
    with pytest.raises(KvpError, match="writable by group or others"):
        check_ca_file(str(f))
    f.chmod(0o644)
    link = tmp_path / "l.pem"
    os.symlink(f, link)
    with pytest.raises(KvpError, match="symbolic link"):
        check_ca_file(str(link))
    with pytest.raises(KvpError, match="absolute"):
        check_ca_file("ca.pem")
    f.write_text("not a certificate\n")
    with pytest.raises(KvpError, match="no PEM certificate"):
        check_ca_file(str(f))
    with pytest.raises(KvpError, match="No such file"):
        check_ca_file(str(tmp_path / "missing.pem"))


def test_secret_file_must_be_owner_only(tmp_path: Path) -> None:
    f = tmp_path / "s"
    f.write_text("username=kvp\npassword=pw-123\n")
    f.chmod(0o640)
    with pytest.raises(KvpError, match="readable by others") as e:
        read_secret_file(str(f))
    assert "pw-123" not in str(e.value)
    f.chmod(0o600)
    assert read_secret_file(str(f)) == SECRET
    link = tmp_path / "l"
    os.symlink(f, link)
    with pytest.raises(KvpError):
        read_secret_file(str(link))
    f.write_text("password=\n")
    with pytest.raises(KvpError, match="no password"):
        read_secret_file(str(f))


def test_exec_argv_names_the_off_record() -> None:
    a = exec_argv("/py", "/etc/kvp/s", ["lmcache", "server"], off_record="/s/off.json")
    assert a[3:8] == ["--secret-file", "/etc/kvp/s", "--off-record", "/s/off.json", "--"]


def test_without_adapter_drops_the_shared_pair_only() -> None:
    a = argv({"type": "resp", "host": "h", "port": 1}) + ["--port", "5"]
    [(i, spec)] = shared_adapters(a)
    assert spec["type"] == "resp"
    assert without_adapter(a, i) == ["lmcache", "server", "--l2-adapter", NVME, "--port", "5"]


RESP_ENV = {"LMCACHE_RESP_USERNAME": "kvp", "LMCACHE_RESP_PASSWORD": "pw-123"}


def test_a_store_that_does_not_answer_starts_lmcache_without_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nobody listens on the port: the adapter and its credentials are dropped, the warning
    is printed, the record names this pid; health reads it for this pid only."""
    port = free_port()
    a = argv({"type": "resp", "host": "127.0.0.1", "port": port})
    record = tmp_path / "off.json"
    out, env = _store_down(a, {**RESP_ENV, "SSL_CERT_FILE": "/ca"}, str(record))
    assert out == ["lmcache", "server", "--l2-adapter", NVME]
    assert env == {"SSL_CERT_FILE": "/ca"}
    assert "runs without the shared tier" in capsys.readouterr().err
    assert record.stat().st_mode & 0o777 == 0o600
    off = read_off_record(str(record), os.getpid())
    assert off is not None and off.endpoint == f"127.0.0.1:{port}" and off.error
    assert abs(off.since - time.time()) < 60
    assert "restart the cache server once the store answers" in off.message()
    assert read_off_record(str(record), os.getpid() + 1) is None  # another process's
    assert read_off_record(str(record), None) is None


def test_a_store_that_answers_keeps_the_adapter_and_clears_an_old_record(
        tmp_path: Path) -> None:
    record = tmp_path / "off.json"
    record.write_text(json.dumps(SharedOff(1, 0.0, "resp", "h:1", "refused").to_dict()))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        a = argv({"type": "resp", "host": "127.0.0.1", "port": listener.getsockname()[1]})
        assert _store_down(a, dict(RESP_ENV), str(record)) == (a, RESP_ENV)
    assert not record.exists()


def test_a_valkey_store_is_checked_too(tmp_path: Path) -> None:
    """glide's adapter would abort the server's start: dropped the same way, and kept when
    a node answers."""
    a = argv({"type": "valkey", "startup_nodes": f"127.0.0.1:{free_port()}"})
    out, env = _store_down(a, {}, str(tmp_path / "off.json"))
    assert out == ["lmcache", "server", "--l2-adapter", NVME] and env == {}
    off = read_off_record(str(tmp_path / "off.json"), os.getpid())
    assert off is not None and off.adapter == "valkey" and "abort" in off.message()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        seeds = f"127.0.0.1:{free_port()},127.0.0.1:{port}"
        cluster = argv({"type": "valkey", "startup_nodes": seeds, "cluster_mode": True})
        assert _store_down(cluster, {}, str(tmp_path / "off.json")) == (cluster, {})
        # standalone: glide uses the first node only, and nobody listens there
        alone = argv({"type": "valkey", "startup_nodes": seeds, "cluster_mode": False})
        assert _store_down(alone, {}, str(tmp_path / "off.json"))[0] != alone


@pytest.mark.parametrize(("spec", "nodes"), [
    ({"type": "resp", "host": "h", "port": 1}, [("h", 1)]),
    ({"type": "resp", "host": "h"}, []),
    ({"type": "valkey", "startup_nodes": "a:1, b:2"}, [("a", 1)]),
    ({"type": "valkey", "startup_nodes": "a:1,[::1]:2", "cluster_mode": True},
     [("a", 1), ("::1", 2)]),
    ({"type": "valkey", "startup_nodes": "a,b:x"}, []),
])
def test_store_nodes(spec: dict[str, object], nodes: list[tuple[str, int]]) -> None:
    assert store_nodes(spec) == nodes


@pytest.mark.parametrize("doc", ['{"pid": "1", "since": 0}', '{"pid": 1}', "[1]", "{",
                                 '{"pid": true, "since": 0}'])
def test_an_unreadable_record_is_no_record(tmp_path: Path, doc: str) -> None:
    (tmp_path / "off.json").write_text(doc)
    assert read_off_record(str(tmp_path / "off.json"), 1) is None
