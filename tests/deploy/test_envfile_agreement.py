"""identity.env is read alike by every reader, or refused by kvpersist.

* the Ansible role writes it (``identity.env.j2``) from ``kvp_deployments[].env`` after
  ``validate.yml``'s checks: whatever the role accepts, kvpersist reads back identically, and
  whatever kvpersist refuses, the role refuses first (Ansible's own templar, in a subprocess:
  importing ansible breaks torch's import later in the same process);
* systemd reads it with ``EnvironmentFile=`` (``kvp-vllm@.service``): ``systemd-analyze
  condition ConditionOSRelease=KEY=VALUE`` reads os-release with the same parser
  (``load_env_file_pairs``), so every accepted file is bind-mounted over os-release in a
  private mount namespace and each key is compared;
* a shell, should an operator ever source it: ``env -i bash -c 'set -a; . FILE; env -0'``.

The role's drop-in values (``_kvp_remote_peers``, ``_kvp_bind_addresses``,
``_kvp_shared_tier_networks``) are compared with ``kvpersist.deploy.systemd.instance_for``
the same way, and the role refuses a shared tier whose addresses instance_for cannot derive.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvpersist.config.deployment import build_deployment
from kvpersist.config.envfile import format_env, parse_env
from kvpersist.config.generic import GenericConfig
from kvpersist.config.values import forbidden_char
from kvpersist.deploy.systemd import UnitRenderError, instance_for
from kvpersist.errors import ConfigError

from ..unit.test_envfile import HOSTILE_CHARS
from ..unit.test_identity import BASE
from .unit_examples import REPO

pytestmark = pytest.mark.deploy

ROLE = REPO / "ansible" / "roles" / "kvp"

#: values an operator might give a key in kvp_deployments[].env
PLAIN_VALUES = [
    "", "plain", "a b", "  lead and trail  ", "trailing  ",
    "--trust-remote-code --gpu-memory-utilization 0.92",
    "80%", "vllm/vllm-openai:v0.32.0", "img@sha256:" + "a" * 64, 'q"uote', "back\\slash",
    "a;b", "a&b", "a|b", "<x>", "(x)", "~/x", "a:~/x", "*", "a?", "[a]", "{a,b}", "!x",
    "a#b", "# not a comment", "=x=", "ünïcødé", "日本語", "emoji 🙂", "tab-free\\t", "\\n",
    "%h%%", "'", "it's", "x'", "$", "$(id)", "`id`", "${HOME}", "$HOME",
    "a\\$b",
]
VALUES = PLAIN_VALUES + [f"a{c}b" for c in HOSTILE_CHARS if not 0xD800 <= ord(c) <= 0xDFFF]


def _ansible(code: str, payload: object) -> object:
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(payload)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


_ROLE_WRITES = r"""
import json, sys, yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

role = "ansible/roles/kvp"
tasks = yaml.safe_load(open(f"{role}/tasks/validate.yml"))
checks = next(t for t in tasks if "loop" in t and "kvp_deployments" in t["loop"])
# the task loops over indexes and names the entry kvp_entry (a failed loop item is printed in
# full, and an entry holds secrets); the vars' templates read it as item
that = checks["ansible.builtin.assert"]["that"]
forbidden = yaml.safe_load(open(f"{role}/vars/main.yml"))["_kvp_env_value_forbidden"]
template = open(f"{role}/templates/identity.env.j2").read()
out = []
for value in json.loads(sys.argv[1]):
    item = {"name": "d", "cache_root": "/nvme/d", "env": {"KVP_MODEL_ID": value}}
    t = Templar(loader=DataLoader(), variables={
        "item": item, "kvp_entry": item, "_kvp_env_value_forbidden": forbidden,
        "kvp_identity_env": item["env"], "ansible_managed": "Ansible managed"})
    ok = all(t.evaluate_conditional(trust_as_template(c)) for c in that)
    out.append({"accepted": ok, "text": t.template(trust_as_template(template))})
print(json.dumps(out))
"""


def test_what_the_role_writes_kvpersist_reads_back_identically() -> None:
    results = _ansible(_ROLE_WRITES, VALUES)
    assert isinstance(results, list)
    for value, res in zip(VALUES, results, strict=True):
        try:
            read = parse_env(res["text"], "identity.env").get("KVP_MODEL_ID")
            parsed = True
        except ConfigError:
            read, parsed = None, False
        assert res["accepted"] == parsed, (value, res)
        if parsed:
            assert read == value, (value, res["text"])


def test_the_roles_forbidden_characters_are_kvpersists() -> None:
    regex = re.compile(yaml.safe_load((ROLE / "vars/main.yml").read_text())
                       ["_kvp_env_value_forbidden"])
    for cp in range(0x110000):
        ch = chr(cp)
        expected = forbidden_char(ch) is not None or ch in "$`'"
        assert bool(regex.search(ch)) == expected, f"U+{cp:04X}"


_ROLE_NETWORK = r"""
import json, sys, yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

v = yaml.safe_load(open("ansible/roles/kvp/vars/main.yml"))
out = []
for env in json.loads(sys.argv[1]):
    t = Templar(loader=DataLoader(), variables={"item": {"name": "d", "env": env}})
    out.append([list(t.template(trust_as_template(v[k])))
                for k in ("_kvp_remote_peers", "_kvp_bind_addresses")])
print(json.dumps(out))
"""

NETWORK_CASES = [
    {},
    {"KVP_LMCACHE_HOST": "10.1.2.3", "KVP_ALLOW_REMOTE_LMCACHE": "10.1.0.0/16"},
    {"KVP_LMCACHE_HTTP_HOST": "0.0.0.0", "KVP_ALLOW_REMOTE_LMCACHE_HTTP": "10.9.0.5, 10.1.0.0/16"},
    {"KVP_LMCACHE_HOST": "::", "KVP_ALLOW_REMOTE_LMCACHE": "any",
     "KVP_LMCACHE_HTTP_HOST": "127.0.0.2"},
    {"KVP_VLLM_HOST": "2001:db8::5", "KVP_ALLOW_REMOTE_VLLM": "any", "KVP_LMCACHE_HOST": "::1"},
    {"KVP_LMCACHE_HOST": "10.1.2.3", "KVP_ALLOW_REMOTE_LMCACHE": "10.1.0.0/16,10.2.0.0/16",
     "KVP_LMCACHE_HTTP_HOST": "10.1.2.3", "KVP_ALLOW_REMOTE_LMCACHE_HTTP": "10.2.0.0/16",
     "KVP_VLLM_HOST": "10.1.2.4", "KVP_ALLOW_REMOTE_VLLM": "0.0.0.0/0"},
    {"KVP_LMCACHE_HOST": "localhost", "KVP_VLLM_HOST": "0.0.0.0", "KVP_ALLOW_REMOTE_VLLM": "any"},
]


def test_the_roles_dropin_values_are_instance_fors() -> None:
    results = _ansible(_ROLE_NETWORK, NETWORK_CASES)
    assert isinstance(results, list)
    for env, (peers, binds) in zip(NETWORK_CASES, results, strict=True):
        values = {**BASE, "KVP_CACHE_ROOT": "/nvme/d", "KVP_SERVED_MODEL_NAME": "m",
                  "KVP_MODEL_PATH": "/models/m", **env}
        inst = instance_for(build_deployment("d", "d.env", values, {}, GenericConfig()))
        assert (list(inst.remote_peers), list(inst.bind_addresses)) == (peers, binds), env


# --------------------------------------------------------------------------- systemd, bash

#: Lines kvpersist accepts, beyond what format_env writes.
ACCEPTED_LINES = [
    "# a comment with $(id), `x`, 'quotes' and a trailing space ",
    "   KVP_INDENTED=x", "KVP_TRAILING=x   ", "KVP_EMPTY=", "KVP_EMPTY_SQ=''",
    'KVP_EMPTY_DQ=""', "KVP_EQ==x=", 'KVP_DQ="a b ; & | < > ( ) ~ * ? ! { } [ ] # \' é"',
    "KVP_SQ='a\\b \"c\" # d'", "KVP_SAFE=a=b,c:d/e@f%g+h-i.j_k", 'KVP_DQ_TRAIL="x"  ',
]


def accepted_file(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """One identity.env holding every value kvpersist can write, the lines above and the
    shipped configs' keys; and what kvpersist reads from it."""
    writable = {f"KVP_V{i}": v for i, v in enumerate(VALUES)
                if not forbidden_char(v) and not set(v) & set("$`'")}
    text = format_env(writable, header="agreement corpus") + "\n".join(ACCEPTED_LINES) + "\n"
    for i, config in enumerate(sorted((REPO / "configs").glob("*/identity.env"))):
        lines = config.read_text().split("\n")
        text += "\n".join(re.sub(r"^KVP_", f"KVP_C{i}_", ln) for ln in lines)
    path = tmp_path / "identity.env"
    path.write_text(text, encoding="utf-8")
    values = parse_env(text)
    assert len(values) > len(writable) + len(ACCEPTED_LINES)
    return path, values


def _condition(key: str, value: str) -> str:
    """``ConditionOSRelease="KEY=VALUE"``: quoted and %-escaped for systemd-analyze."""
    pair = f"{key}={value}".replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'ConditionOSRelease="{pair}"'


_SYSTEMD_READS = r"""
set -u
mount --bind "$1" "$2" || exit 97
shift 2
for c in "$@"; do systemd-analyze condition "$c" >/dev/null 2>&1; printf '%s\n' "$?"; done
"""


def systemd_reads(path: Path, pairs: list[tuple[str, str]]) -> list[bool]:
    """For each (key, value): does systemd's env-file parser read ``key`` as ``value`` in
    ``path``?"""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("this test runs as root with unshare (util-linux) to bind-mount a file "
                    "over os-release in a private mount namespace")
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing: apt-get install systemd")
    target = os.path.realpath("/etc/os-release")
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           _SYSTEMD_READS, "sh", str(path), target,
                           *[_condition(k, v) for k, v in pairs]],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 97, f"cannot bind-mount over {target}: {proc.stderr}"
    codes = proc.stdout.split()
    assert len(codes) == len(pairs), proc.stdout + proc.stderr
    return [c == "0" for c in codes]


def test_systemd_reads_every_accepted_file_as_kvpersist_does(tmp_path: Path) -> None:
    path, values = accepted_file(tmp_path)
    # A condition cannot express an empty value or leading spaces (systemd-analyze strips
    # them from the expected value); systemd's parser keeps both inside quotes, and bash
    # is compared on those below.
    pairs = [(k, v) for k, v in values.items() if v != "" and not v.startswith(" ")]
    wrong = [k for (k, _), same in zip(pairs, systemd_reads(path, pairs), strict=True)
             if not same]
    assert not wrong, [(k, values[k]) for k in wrong]
    # the oracle is real: a value kvpersist does not read is not matched either
    assert systemd_reads(path, [(pairs[0][0], pairs[0][1] + "x")]) == [False]


def test_systemd_sees_one_key_where_splitlines_saw_two(tmp_path: Path) -> None:
    """The issue's example: str.splitlines() split at VT; systemd (and a shell) read one key
    with a VT inside. kvpersist now refuses the line instead of reading it either way."""
    path = tmp_path / "vt.env"
    path.write_text("KVP_L1_SIZE_GB=1\vKVP_L2_QUOTA=10%\n")
    assert systemd_reads(path, [("KVP_L1_SIZE_GB", "1\vKVP_L2_QUOTA=10%"),
                                ("KVP_L2_QUOTA", "10%")]) == [True, False]
    with pytest.raises(ConfigError):
        parse_env(path.read_text())


def bash_reads(path: Path) -> dict[str, str]:
    out = subprocess.run(["env", "-i", "bash", "-c", 'set -a; . "$1"; env -0', "bash",
                          str(path)], capture_output=True, check=True, timeout=60).stdout
    pairs = (item.decode("utf-8").split("=", 1) for item in out.split(b"\0") if item)
    return {k: v for k, v in pairs if k.startswith("KVP_")}


def test_bash_reads_every_accepted_file_as_kvpersist_does(tmp_path: Path) -> None:
    path, values = accepted_file(tmp_path)
    assert bash_reads(path) == values


_ROLE_SHARED = r"""
import json, sys, yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

role = "ansible/roles/kvp"
v = yaml.safe_load(open(f"{role}/vars/main.yml"))
tasks = yaml.safe_load(open(f"{role}/tasks/validate.yml"))
checks = next(t for t in tasks if "loop" in t and "kvp_deployments" in t["loop"])
# the task loops over indexes and names the entry kvp_entry (a failed loop item is printed in
# full, and an entry holds secrets); the vars' templates read it as item
that = [c for c in checks["ansible.builtin.assert"]["that"] if "shared_tier" in c]
out = []
for tier in json.loads(sys.argv[1]):
    item = {"name": "d", "cache_root": "/nvme/d", "env": {}, "shared_tier": tier}
    t = Templar(loader=DataLoader(), variables={"item": item, "kvp_entry": item})
    ok = all(t.evaluate_conditional(trust_as_template(c)) for c in that)
    nets = list(t.template(trust_as_template(v["_kvp_shared_tier_networks"]))) if ok else None
    out.append([ok, nets])
print(json.dumps(out))
"""

SHARED_CASES = [
    {"url": "valkey://10.0.5.11:6379"},
    {"url": "redis://10.0.5.12:6380?workers=4&db=2"},
    {"url": "valkey://10.0.5.13:6379?tls=1"},
    {"url": "valkey://127.0.0.1:6379"},
    {"url": "valkey://localhost:6379"},
    {"url": "valkey://10.0.5.11:6379?cluster=1"},
    {"url": "valkey://10.0.5.11:6379?cluster=1", "networks": ["10.0.5.0/24"]},
    {"url": "valkey://redis.internal:6379"},
    {"url": "valkey://redis.internal:6379", "networks": ["10.0.5.9", "10.0.6.0/24"]},
]


def test_the_roles_shared_tier_networks_are_instance_fors() -> None:
    """Both units deny every address but localhost: the store's nodes must be allowed. The
    role derives them as instance_for does, and refuses (validate.yml) exactly the tiers
    instance_for cannot derive them for: a cluster or a host name without ``networks``."""
    results = _ansible(_ROLE_SHARED, [{**c, "password": "pw"} for c in SHARED_CASES])
    assert isinstance(results, list)
    for case, (accepted, nets) in zip(SHARED_CASES, results, strict=True):
        values = {**BASE, "KVP_CACHE_ROOT": "/nvme/d", "KVP_SERVED_MODEL_NAME": "m",
                  "KVP_MODEL_PATH": "/models/m", "KVP_SHARED_TIER": case["url"],
                  "KVP_SHARED_TIER_SECRET_FILE": "/etc/kvp/d.secret"}
        dep = build_deployment("d", "d.env", values, {}, GenericConfig())
        try:
            inst = instance_for(dep, shared_tier_networks=tuple(case.get("networks", ())))
        except UnitRenderError as exc:
            assert not accepted, (case, nets)
            assert "shared_tier_networks" in str(exc)
            continue
        assert accepted, case
        assert nets == list(inst.shared_tier_networks), case
    assert [ok for ok, _ in results] == [True, True, True, True, True, False, True, False,
                                         True]
