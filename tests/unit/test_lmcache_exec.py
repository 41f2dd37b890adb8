"""The shared tier's launcher: credentials go into the in-process argv or environment only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpersist.config.shared_tier import SharedSecret
from kvpersist.errors import KvpError
from kvpersist.stack.lmcache_exec import (
    check_ca_file,
    exec_argv,
    inject,
    read_secret_file,
    valkey_swaps_credentials,
)

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
