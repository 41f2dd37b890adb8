"""config/shared_tier.py and the shared tier in the rendered config (pure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpersist.config.shared_tier import (
    ACL_CLUSTER_RULES,
    ACL_RULES,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    adapter_json,
    parse_secret,
    parse_shared_tier,
)
from kvpersist.errors import ConfigError
from kvpersist.stack.render import render

from .test_render import TEMPLATES, dep

SECRET = {"KVP_SHARED_TIER_SECRET_FILE": "/etc/kvp/shared.secret"}


def test_empty_means_no_tier() -> None:
    assert parse_shared_tier("") == (None, "")
    assert parse_shared_tier("  ") == (None, "")


def test_a_standalone_store_on_the_loopback_takes_resp() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "localhost"):
        tier, problem = parse_shared_tier(f"valkey://{host}:6379")
        assert problem == "" and tier is not None
        assert tier.nodes == ((host, 6379),) and tier.adapter == "resp"
        assert (tier.cluster, tier.tls, tier.db, tier.workers) == (False, False, 0, 8)
        assert adapter_json(tier, None) == {"type": "resp", "host": host, "port": 6379,
                                            "num_workers": 8}
        # resp has no timeouts: none is shown
        assert (tier.to_dict()["timeout_s"], tier.to_dict()["connect_timeout_s"]) == (None,
                                                                                     None)


def test_a_store_across_the_network_takes_valkey_with_bounded_timeouts() -> None:
    """resp sets no socket timeout: a partition blocks its lookups until TCP gives up, so a
    store on another host gets the valkey adapter and kvpersist's timeouts."""
    tier, problem = parse_shared_tier("valkey://10.0.0.5:6379")
    assert problem == "" and tier is not None and tier.adapter == "valkey"
    js = adapter_json(tier, None)
    assert (js["request_timeout"], js["connection_timeout"]) == (DEFAULT_TIMEOUT_S,
                                                                 DEFAULT_CONNECT_TIMEOUT_S)
    assert tier.to_dict()["timeout_s"] == DEFAULT_TIMEOUT_S
    # an operator may still ask for resp by name (its limits are documented)
    tier, problem = parse_shared_tier("valkey://10.0.0.5:6379?adapter=resp")
    assert problem == "" and tier is not None and tier.adapter == "resp"


@pytest.mark.parametrize(("query", "timeout", "connect"), [
    ("timeout=0.5", 0.5, DEFAULT_CONNECT_TIMEOUT_S),
    ("connect_timeout=2.25", DEFAULT_TIMEOUT_S, 2.25),
    ("timeout=60&connect_timeout=0.1", 60.0, 0.1),
    ("connect_timeout=1", DEFAULT_TIMEOUT_S, 1.0),
    ("timeout=5&connect_timeout=10", 5.0, 10.0),  # LMCache's own defaults
])
def test_timeouts_reach_the_valkey_adapter(query: str, timeout: float, connect: float) -> None:
    tier, problem = parse_shared_tier(f"valkey://127.0.0.1:6379?{query}")
    assert problem == "" and tier is not None
    assert tier.adapter == "valkey"  # a timeout asked for takes valkey even on the loopback
    js = adapter_json(tier, None)
    assert (js["request_timeout"], js["connection_timeout"]) == (timeout, connect)
    assert (tier.timeout, tier.connect_timeout) == (timeout, connect)


@pytest.mark.parametrize("url", [
    "valkey://a:1,b:2,c:3?cluster=1&workers=4",
    "redis://kv.example:6380?tls=1",
    "valkey://kv:6379?db=3",
    "valkey://kv:6379?adapter=valkey",
])
def test_cluster_tls_db_take_valkey(url: str) -> None:
    tier, problem = parse_shared_tier(url)
    assert problem == "" and tier is not None and tier.adapter == "valkey"
    js = adapter_json(tier, {"type": "aesgcm"})
    assert js["type"] == "valkey" and js["startup_nodes"] == tier.endpoint
    assert js["cluster_mode"] is tier.cluster and js["tls_enable"] is tier.tls
    assert ("database_id" in js) is (not tier.cluster)
    assert js["serde"] == {"type": "aesgcm"}
    assert "password" not in js and "username" not in js


def test_tls_ca_is_kept_and_never_in_the_adapter_json() -> None:
    tier, problem = parse_shared_tier("valkey://kv:6380?tls=1&tls_ca=/etc/kvp/store-ca.pem")
    assert problem == "" and tier is not None
    assert (tier.adapter, tier.tls, tier.tls_ca) == ("valkey", True, "/etc/kvp/store-ca.pem")
    assert tier.to_dict()["tls_ca"] == "/etc/kvp/store-ca.pem"
    # LMCache 0.5.6's valkey adapter has no CA field: the launcher hands it over instead
    assert "/etc/kvp/store-ca.pem" not in json.dumps(adapter_json(tier, None))
    plain, _ = parse_shared_tier("valkey://kv:6380?tls=1")
    assert plain is not None and plain.tls_ca == ""  # the system trust store


@pytest.mark.parametrize(("url", "words"), [
    ("http://kv:6379", "valkey://"),
    ("valkey://user:pw@kv:6379", "credentials"),
    ("valkey://kv", "host:port"),
    ("valkey://kv:0", "1-65535"),
    ("valkey://kv:6379/0", "path"),
    ("valkey://kv:6379?cluster=yes", "cluster must be 0 or 1"),
    ("valkey://kv:6379?tls=2", "tls must be"),
    ("valkey://kv:6379?db=x", "db must be"),
    ("valkey://kv:6379?workers=0", "workers"),
    ("valkey://kv:6379?colour=red", "unknown option"),
    ("valkey://kv:6379?db=1&db=2", "twice"),
    ("valkey://a:1,b:2", "cluster=1"),
    ("valkey://a:1?cluster=1&db=2", "db must be 0"),
    ("valkey://a:1?tls=1&adapter=resp", "adapter=resp"),
    ("valkey://a:1?adapter=s3", "adapter must be"),
    ("valkey://a:1?tls_ca=/etc/kvp/ca.pem", "tls_ca needs tls=1"),
    ("valkey://a:1?tls=1&tls_ca=ca.pem", "absolute path"),
    ("valkey://a:1?tls=1&tls_ca=/etc/../tmp/ca.pem", "absolute path"),
    ("valkey://a:1?timeout=0", "timeout must be a number of seconds from 0.1 to 60"),
    ("valkey://a:1?timeout=0.05", "from 0.1 to 60"),
    ("valkey://a:1?timeout=61", "from 0.1 to 60"),
    ("valkey://a:1?timeout=1e1", "timeout must be"),
    ("valkey://a:1?timeout=-1", "timeout must be"),
    ("valkey://a:1?timeout=", "timeout must be"),
    ("valkey://a:1?timeout=nan", "timeout must be"),
    ("valkey://a:1?connect_timeout=0.0001", "connect_timeout must be"),
    ("valkey://a:1?timeout=1&timeout=2", "twice"),
    ("valkey://127.0.0.1:1?adapter=resp&timeout=2", "resp adapter has no timeouts"),
    ("valkey://127.0.0.1:1?adapter=resp&connect_timeout=2", "need adapter=valkey"),
])
def test_bad_urls_say_why(url: str, words: str) -> None:
    tier, problem = parse_shared_tier(url)
    assert tier is None and words in problem


def test_secret_file_parse_never_echoes_the_password() -> None:
    s, problem = parse_secret("# shared tier\nusername=kvp\npassword= p=w#x \n")
    assert problem == "" and s is not None
    assert (s.username, s.password) == ("kvp", " p=w#x ")
    assert "p=w" not in repr(s)
    s, _ = parse_secret("password=only\n")
    assert s is not None and s.username == "default"
    for bad, words in (("username=kvp\n", "no password"), ("pw=x\n", "line 1"),
                       ("password=a\npassword=b\n", "twice"),
                       ("username=a b\npassword=x\n", "username")):
        s, problem = parse_secret(bad)
        assert s is None and words in problem and "x\n" not in problem


def test_render_adds_the_shared_tier_after_the_nvme() -> None:
    d = dep({"KVP_SHARED_TIER": "valkey://127.0.0.1:6379?workers=4", **SECRET})
    r = render(d, TEMPLATES, l1_size_gb=64, l2_capacity_gb=100)
    argv = r.lmcache_server_argv
    idx = [i for i, a in enumerate(argv) if a == "--l2-adapter"]
    assert len(idx) == 2
    first, second = (json.loads(argv[i + 1]) for i in idx)
    assert first["type"] == "nixl_store_dynamic"
    assert second == r.shared_l2_adapter and second["type"] == "resp"
    assert second["serde"] == first["serde"]  # aesgcm on the shared tier too
    assert argv[argv.index("--l2-store-policy") + 1] == "default"
    assert argv[argv.index("--l2-prefetch-policy") + 1] == "retain"
    shown = r.as_json()["shared_tier"]
    assert shown["endpoint"] == "127.0.0.1:6379" and shown["key_pattern"] == f"{d.namespace}@*"
    assert "redacted" in shown["credentials"]


def test_no_shared_tier_renders_one_adapter() -> None:
    r = render(dep(), TEMPLATES, l1_size_gb=64, l2_capacity_gb=100)
    assert r.lmcache_server_argv.count("--l2-adapter") == 1
    assert "--l2-store-policy" not in r.lmcache_server_argv
    assert r.shared_tier is None and r.shared_l2_adapter is None


def test_tier_and_secret_file_go_together() -> None:
    with pytest.raises(ConfigError) as e:
        dep({"KVP_SHARED_TIER": "valkey://kv:6379"})
    assert "KVP_SHARED_TIER_SECRET_FILE" in str(e.value)
    with pytest.raises(ConfigError) as e:
        dep(SECRET)
    assert "KVP_SHARED_TIER is empty" in str(e.value)
    with pytest.raises(ConfigError) as e:
        dep({"KVP_SHARED_TIER": "valkey://u:p@kv:6379", **SECRET})
    assert "credentials" in str(e.value) and "u:p" not in str(e.value)


@pytest.mark.parametrize(("query", "option"), [
    ("timeout=0", "timeout"), ("timeout=abc", "timeout"), ("timeout=120", "timeout"),
    ("connect_timeout=-3", "connect_timeout"), ("connect_timeout=1e3", "connect_timeout"),
    ("adapter=resp&timeout=2", "timeout"),
])
def test_bad_timeouts_are_a_config_error_naming_the_key_and_the_option(query: str,
                                                                      option: str) -> None:
    with pytest.raises(ConfigError) as e:
        dep({"KVP_SHARED_TIER": f"valkey://10.0.0.5:6379?{query}", **SECRET})
    assert e.value.exit_code == 2 and len(e.value.problems) == 1
    text = str(e.value.problems[0])
    assert "KVP_SHARED_TIER" in text and option in text, text


@pytest.mark.parametrize(("url", "store"), [
    ("valkey://10.0.0.5:6379", "10.0.0.5:6379"),
    ("redis://10.0.0.5:6379?adapter=valkey&workers=2", "10.0.0.5:6379"),
    ("valkey://kv:6379?db=3", "kv:6379/3"),
    # a cluster's seeds in any order are one store
    ("valkey://c:3,a:1,b:2?cluster=1", "a:1,b:2,c:3"),
    ("valkey://b:2,c:3,a:1?cluster=1&tls=1", "a:1,b:2,c:3"),
])
def test_store_id_is_the_sorted_endpoint_and_db(url: str, store: str) -> None:
    tier, problem = parse_shared_tier(url)
    assert problem == "" and tier is not None
    assert tier.store_id == store


def test_the_documented_acl_is_the_tested_one(repo: Path) -> None:
    """docs/fleet.md recommends exactly the rules the integration tests give their user."""
    text = (repo / "docs" / "fleet.md").read_text()
    assert f"ACL SETUSER kvp-fleet on >PASSWORD {ACL_RULES}\n" in text
    assert f"`{ACL_CLUSTER_RULES}`" in text
    assert "+@all" not in ACL_RULES and "~*" not in ACL_RULES.split()
