"""Hostile deployment settings are configuration errors naming the key — from the file and,
with the same checks, from the environment — never an exception of another kind; the value
parsers they reach are strict; a non-loopback bind needs its opt-in and is then shown."""

from __future__ import annotations

import pytest

from kvpersist.config.deployment import build_deployment, listeners
from kvpersist.config.engine_args import extra_args_problems
from kvpersist.config.generic import GenericConfig, generic_from_dict
from kvpersist.config.settings import parse_peers
from kvpersist.config.values import (
    describe_char,
    forbidden_char,
    parse_decimal,
    parse_duration,
    parse_size,
    parse_size_or_percent,
    parse_uint,
    path_problem,
    system_dir,
)
from kvpersist.errors import ConfigError

from .hostile_inputs import HOSTILE_SETTINGS, Hostile
from .test_identity import BASE

DEPLOY = {"KVP_CACHE_ROOT": "/var/lib/kvp/test", "KVP_SERVED_MODEL_NAME": "llama",
          "KVP_MODEL_PATH": "/models/llama"}


def build(values: dict[str, str], environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return build_deployment("t", "t.env", values, environ or {}, GenericConfig(),
                            unpinned_token="0" * 32)


def _refused(values: dict[str, str], environ: dict[str, str], case: Hostile) -> None:
    with pytest.raises(ConfigError) as err:
        build(values, environ)
    blamed = [p for p in err.value.problems if case.names in p.where]
    assert blamed, err.value.problems
    assert "\0" not in str(err.value)


@pytest.mark.parametrize("case", HOSTILE_SETTINGS, ids=str)
def test_hostile_setting_in_the_file_is_a_config_error(case: Hostile) -> None:
    _refused({**BASE, **DEPLOY, case.key: case.value, **case.extra}, {}, case)


@pytest.mark.parametrize("case", [c for c in HOSTILE_SETTINGS if c.env_ok], ids=str)
def test_hostile_setting_from_the_environment_is_a_config_error(case: Hostile) -> None:
    _refused({**BASE, **DEPLOY}, {case.key: case.value, **case.extra}, case)


def test_environment_values_pass_the_file_checks_nul_included() -> None:
    """os.environ cannot hold NUL, but settings_from_env is also handed plain mappings."""
    with pytest.raises(ConfigError) as err:
        build({**BASE, **DEPLOY}, {"KVP_CACHE_ROOT": "/var/lib/kvp/a\0b"})
    assert err.value.problems[0].where == "environment KVP_CACHE_ROOT"
    assert "U+0000 (NUL)" in err.value.problems[0].message


# --------------------------------------------------------------------------- remote binds


@pytest.mark.parametrize("host_key,allow_key,component", [
    ("KVP_LMCACHE_HOST", "KVP_ALLOW_REMOTE_LMCACHE", "lmcache"),
    ("KVP_LMCACHE_HTTP_HOST", "KVP_ALLOW_REMOTE_LMCACHE_HTTP", "lmcache_http"),
    ("KVP_VLLM_HOST", "KVP_ALLOW_REMOTE_VLLM", "vllm"),
])
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "2001:db8::5"])
def test_a_non_loopback_bind_needs_its_own_opt_in(host_key: str, allow_key: str,
                                                  component: str, host: str) -> None:
    with pytest.raises(ConfigError) as err:
        build({**BASE, **DEPLOY, host_key: host})
    (problem,) = err.value.problems
    assert problem.where == f"t.env: {host_key}" and allow_key in problem.fix
    dep = build({**BASE, **DEPLOY, host_key: host,
                 allow_key: "10.1.0.0/16, 10.9.0.5 10.1.0.0/16"})
    (remote,) = [lst for lst in listeners(dep.settings) if lst.remote]
    assert (remote.component, remote.host, remote.peers) == (
        component, host, ("10.1.0.0/16", "10.9.0.5"))
    assert "NOT loopback" in remote.describe() and allow_key in remote.describe()
    # the namespace never depends on where a port binds
    assert dep.namespace == build({**BASE, **DEPLOY}).namespace


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_binds_need_no_opt_in(host: str) -> None:
    dep = build({**BASE, **DEPLOY, "KVP_LMCACHE_HOST": host, "KVP_LMCACHE_HTTP_HOST": host})
    assert not any(lst.remote for lst in listeners(dep.settings))


def test_the_environment_opt_in_is_blamed_where_it_comes_from() -> None:
    with pytest.raises(ConfigError) as err:
        build({**BASE, **DEPLOY}, {"KVP_LMCACHE_HTTP_HOST": "0.0.0.0"})
    assert err.value.problems[0].where == "environment KVP_LMCACHE_HTTP_HOST"
    dep = build({**BASE, **DEPLOY}, {"KVP_LMCACHE_HTTP_HOST": "0.0.0.0",
                                     "KVP_ALLOW_REMOTE_LMCACHE_HTTP": "any"})
    assert dep.settings.allow_remote_lmcache_http == ("any",)


@pytest.mark.parametrize("value,peers", [
    ("", ()), ("any", ("any",)), ("10.0.0.0/8", ("10.0.0.0/8",)),
    ("10.0.0.5,10.0.0.6", ("10.0.0.5", "10.0.0.6")),
    ("2001:db8::/32 ::1", ("2001:db8::/32", "::1")),
])
def test_parse_peers(value: str, peers: tuple[str, ...]) -> None:
    assert parse_peers(value) == (peers, "")


def test_generic_config_hosts_are_checked() -> None:
    with pytest.raises(ConfigError) as err:
        generic_from_dict({"server": {"host": "0.0.0.0 $(id)", "http_host": "::ffff:1.2.3.4"},
                           "l1": {"size_gb": "inf"}})
    assert sorted(p.where for p in err.value.problems) == ["l1.size_gb", "server.host",
                                                          "server.http_host"]


# --------------------------------------------------------------------------- owned vLLM flags


@pytest.mark.parametrize("args,needle", [
    ("--host 0.0.0.0", "--host"), ("--hos 0.0.0.0", "--host"), ("--host=0.0.0.0", "--host"),
    ("--kv_transfer_config {}", "--kv-transfer-config"),
    ("--kv-transfer-config.kv_connector X", "--kv-transfer-config"),
    ("--kv-transfer-c {}", "--kv-transfer-config"),
    ("--served_model_name x", "--served-model-name"),
    ("-tp 2", "--tensor-parallel-size"), ("-tp=2", "--tensor-parallel-size"),
    ("-t 2", "--tensor-parallel-size"), ("--config x.yaml", "--config"),
    ("-tp4", "unrecognized arguments: -tp4"), ("--max-model 9", "--max-model-len"),
])
def test_owned_flags_are_read_as_vllms_parser_reads_them(args: str, needle: str) -> None:
    problems = extra_args_problems(args.split())
    assert problems and needle in problems[0], problems


@pytest.mark.parametrize("args", ["--gpu-memory-utilization 0.92", "--max-num-seqs 4",
                                  "--max_num_seqs=4 --disable-log-stats", "--api-key k"])
def test_kv_neutral_flags_pass(args: str) -> None:
    assert extra_args_problems(args.split()) == []


# --------------------------------------------------------------------------- value parsers


@pytest.mark.parametrize("text", ["²", "١٢", "１２", "1_0", " 7", "7 ", "-1", "+1", "0x1", "",
                                  "9" * 5000, "1e3", "٣"])
def test_parse_uint_is_ascii_only(text: str) -> None:
    assert parse_uint(text, 9) is None


def test_parse_uint_accepts_plain_digits() -> None:
    assert parse_uint("0042", 5) == 42 and parse_uint("123456", 5) is None


@pytest.mark.parametrize("text", ["nan", "inf", "-1", "1e3", "1_0", "١", "９", "+1", "0x1",
                                  "", ".", "1..2"])
def test_parse_decimal_is_strict(text: str) -> None:
    assert parse_decimal(text) is None


@pytest.mark.parametrize("fn,text", [
    (parse_size, "1\u212a"), (parse_size, "9" * 400), (parse_size, "1e400"),
    (parse_size, "١G"), (parse_duration, "1\u017f"), (parse_duration, "9" * 400),
    (parse_size_or_percent, "nan%"), (parse_size_or_percent, "inf%"),
    (parse_size_or_percent, "١٠%"), (parse_size_or_percent, "1e2%"),
    (parse_size_or_percent, "9" * 400 + "%"), (parse_size_or_percent, "1\u212a"),
])
def test_value_parsers_raise_value_error_only(fn, text: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        fn(text)


def test_value_parsers_accept_what_they_document() -> None:
    assert parse_size("1.5TiB") == int(1.5 * 1024**4) and parse_size("500m") == 500 << 20
    assert parse_duration("7d") == 7 * 86400
    assert parse_size_or_percent("80%") == (None, 0.8)


@pytest.mark.parametrize("path,system", [
    ("/", "/"), ("//", "/"), ("/./", "/"), ("/tmp/", "/tmp"), ("/proc/1", "/proc"),
    ("/etc/kvp", "/etc"), ("/var/lib", "/var/lib"), ("/var/lib/kvp", ""), ("/tmp/x", ""),
    ("/home/a/kvp", ""), ("/mnt/nvme0/kvp", ""), ("/dev/shm/x", "/dev"), ("/srv/kvp", ""),
    ("/usrx", ""), ("/run/kvp", "/run"),
])
def test_system_dir(path: str, system: str) -> None:
    assert system_dir(path) == system


def test_path_problem() -> None:
    assert path_problem("/a/" + "b" * 255) == ""
    assert "component" in path_problem("/a/" + "b" * 256)
    assert "component" in path_problem("/a/" + "é" * 128)  # 256 bytes in UTF-8
    assert "bytes long" in path_problem("/" + "a/" * 1100)
    assert ".." in path_problem("/a/../b")


def test_forbidden_characters_are_named_not_printed() -> None:
    for ch in ("\0", "\v", "\x85", "\u2028", "\u202e", "\ufeff", "\u00a0", "\udcff"):
        assert forbidden_char(f"a{ch}") == ch
        assert describe_char(ch).startswith(f"U+{ord(ch):04X} (")
        assert ch not in describe_char(ch)
    assert forbidden_char("plain ünïcödé text, 64G, 80% /a/b") is None
