"""The strict identity.env parser: data, never shell, read the same way by kvpersist, systemd
(EnvironmentFile=) and a shell, or refused. tests/deploy/test_envfile_agreement.py checks the
agreement against the real readers (systemd, bash, Ansible's template)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvpersist.config.envfile import format_env, parse_env, value_problem
from kvpersist.config.loader import MAX_CONFIG_BYTES, load_deployment, read_text
from kvpersist.errors import MAX_PROBLEMS, ConfigError

from ..cli import kvp
from ..conftest import REPO

DEMO = REPO / "configs" / "cpu-demo"


def test_comments_blank_lines_and_quotes() -> None:
    text = """
# a comment
KVP_A=plain
KVP_B="double quoted value"
KVP_C='single # not a comment'
   KVP_D=indented
KVP_E=trailing-spaces-dropped   \n\
KVP_F=
KVP_G=''
KVP_H='x"y\\z;&|<>()~*?!{}[]#'
KVP_I="ünïcødé ok"
KVP_J=a=b,c:d/e@f%g+h-i.j_k
"""
    assert parse_env(text) == {
        "KVP_A": "plain", "KVP_B": "double quoted value", "KVP_C": "single # not a comment",
        "KVP_D": "indented", "KVP_E": "trailing-spaces-dropped", "KVP_F": "", "KVP_G": "",
        "KVP_H": 'x"y\\z;&|<>()~*?!{}[]#', "KVP_I": "ünïcødé ok",
        "KVP_J": "a=b,c:d/e@f%g+h-i.j_k",
    }


#: Whole lines that are refused: shell constructs, quoting systemd and a shell read
#: differently, and lines that would not be one key to every reader.
HOSTILE_LINES = [
    # command substitution and expansion, unquoted and quoted (the README: errors)
    "KVP_A=$(rm -rf /)", "KVP_A=`id`", "KVP_A=${HOME}", "KVP_A=$HOME",
    'KVP_MODEL_ID="$(id)"', "KVP_MODEL_ID='$(id)'", 'KVP_A="`id`"', "KVP_A='`id`'",
    'KVP_A="${HOME}"', "KVP_A='${HOME}'", 'KVP_A="a$b"', "KVP_A='price $5'",
    "KVP_A='$((1+1))'", 'KVP_A="$[1]"',
    # quoting
    "KVP_A=\"unterminated", "KVP_A='unterminated", "KVP_A='a' trailing", "KVP_A='a'b",
    "KVP_A='a''b'", "KVP_A=\"a\"'b'", "KVP_A='x' # comment", 'KVP_A="x" # comment',
    'KVP_A="a\\\\b"', 'KVP_A="a\\"b"', 'KVP_A="a\\nb"',
    # unquoted values outside the safe set (a shell splits, expands or runs them)
    "KVP_A=a\\", "KVP_A=a b", "KVP_E=value # trailing comment", "KVP_A=a;id", "KVP_A=a&",
    "KVP_A=a|b", "KVP_A=<x", "KVP_A=>x", "KVP_A=(x)", "KVP_A=~/x", "KVP_A=a:~/x",
    "KVP_A=*", "KVP_A=a?", "KVP_A=[a]", "KVP_A={a,b}", "KVP_A=!x", "KVP_A=a#b",
    "KVP_A=a\"b", "KVP_A=a'b", "KVP_A=ünï",
    # not KEY=VALUE, or not the same key for every reader
    "not a line", "1KVP=x", "KVP-A=x", "=x", "KVP_A", "export KVP_A=x", "export",
    "KVP_A =x", "KVP_A= x", "KVP_A = x", "; systemd comment", "KVP_Ä=x",
    # a comment ending in a backslash: systemd < 254 continues it onto the next line
    "# continued \\",
]

#: Characters refused anywhere in a line (inside quotes too): C0 controls, DEL, C1 (NEL),
#: Unicode format characters (bidi, zero-width, BOM), line and paragraph separators, and
#: spaces other than U+0020.
HOSTILE_CHARS = [
    "\0", "\x01", "\t", "\v", "\f", "\r", "\x1b", "\x1c", "\x1d", "\x1e", "\x1f", "\x7f",
    "\x80", "\x85", "\x9f", "\u2028", "\u2029", "\u200b", "\u200e", "\u202e", "\u2066",
    "\ufeff", "\u00a0", "\u2003", "\u3000", "\u00ad", "\udcff",
]
CHAR_PLACES = [
    "KVP_L1_SIZE_GB=1{c}KVP_L2_QUOTA=10%",   # the VT example of the issue
    "KVP_A='a{c}b'", 'KVP_A="a{c}b"', "KVP_A=a{c}", "{c}KVP_A=a", "KVP_A{c}=a",
    "# comment {c} here",
]


@pytest.mark.parametrize("line", HOSTILE_LINES)
def test_hostile_lines_are_errors_naming_the_line(line: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_env(f"KVP_OK=1\n{line}\n", "f.env")
    assert [p.where for p in err.value.problems] == ["f.env:2"], err.value.problems


@pytest.mark.parametrize("place", CHAR_PLACES)
@pytest.mark.parametrize("char", HOSTILE_CHARS, ids=lambda c: f"U+{ord(c):04X}")
def test_hostile_characters_are_errors_anywhere(char: str, place: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_env(f"KVP_OK=1\n{place.format(c=char)}\nKVP_LAST=2\n", "f.env")
    (problem,) = err.value.problems
    assert problem.where == "f.env:2"
    assert f"U+{ord(char):04X}" in problem.message
    assert char not in str(err.value)  # named, never echoed raw


def test_lines_end_at_newline_only() -> None:
    """str.splitlines() would make two keys of the VT example; every other reader sees one
    line, so the whole line is refused rather than read as two keys."""
    with pytest.raises(ConfigError) as err:
        parse_env("KVP_L1_SIZE_GB=1\vKVP_L2_QUOTA=10%\n")
    assert "U+000B (VT)" in err.value.problems[0].message
    with pytest.raises(ConfigError) as err:
        parse_env("KVP_A=1\r\nKVP_B=2\r\n")
    assert "dos2unix" in err.value.problems[0].fix
    assert [p.where for p in err.value.problems] == ["identity.env:1", "identity.env:2"]


def test_every_bad_line_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        parse_env("bad one\nKVP_A=1\nKVP_A=2\nalso bad\nKVP_B='$(x)'\n", "f.env")
    wheres = [p.where for p in err.value.problems]
    assert wheres == ["f.env:1", "f.env:3", "f.env:4", "f.env:5"]
    assert "set twice" in err.value.problems[1].message


def test_format_round_trips() -> None:
    values = {"KVP_A": "x y", "KVP_B": "--flag=1 --other", "KVP_C": "/a/b", "KVP_D": "",
              "KVP_E": 'q"uo\\te', "KVP_F": "ünï"}
    assert parse_env(format_env(values, header="generated\nby a test")) == values


@pytest.mark.parametrize("value", ["it's", "$(id)", "a`b", "a\nb", "a\0b", "a\u2028b"])
def test_format_refuses_values_no_env_file_can_hold(value: str) -> None:
    with pytest.raises(ValueError):
        format_env({"KVP_A": value})


@pytest.mark.parametrize("value", ["a\0b", "a\x1bb", "a\u2028b", "a\u00a0b", "$(id)", "`x`"])
def test_value_problem_for_environment_values(value: str) -> None:
    assert value_problem(value)


def test_value_problem_accepts_plain_values() -> None:
    assert value_problem("/var/lib/kvp cache/ünï") == ""


# --------------------------------------------------------------------------- real files
def _demo_copy(tmp_path: Path, text: str) -> Path:
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "chat_template.jinja").write_bytes((DEMO / "chat_template.jinja").read_bytes())
    (d / "identity.env").write_bytes(text.encode())
    return d


def test_a_crlf_identity_file_is_refused_naming_the_line_and_dos2unix(tmp_path: Path) -> None:
    """Finding: the loader read in universal-newline mode, so a CRLF file loaded (the same
    namespace as the LF one) although README says CRLF is refused."""
    demo = (DEMO / "identity.env").read_text()
    d = _demo_copy(tmp_path, demo.replace("\n", "\r\n"))
    for args in (["budget", str(d), "--json"], ["render", str(d)], ["identity", "show", str(d)]):
        r = kvp(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        assert f"{d / 'identity.env'}:1" in r.stderr and "U+000D (CR)" in r.stderr, r.stderr
        assert "dos2unix" in r.stderr
    assert r.stderr.count("U+000D") <= MAX_PROBLEMS  # a long file: the first lines, a count
    assert "more problem(s) of the same input, not listed" in r.stderr
    with pytest.raises(ConfigError) as err:
        load_deployment(str(d))
    assert "\r" not in str(err.value)


def test_a_lone_cr_is_one_value_for_bash_and_refused_here(tmp_path: Path) -> None:
    """``KVP_L1_SIZE_GB=1\\rKVP_L2_QUOTA=10%``: bash (and systemd) read one line, one key,
    whose value holds a CR; universal newlines made it two keys here (the quota applied).
    Now the line is refused."""
    line = "KVP_L1_SIZE_GB=1\rKVP_L2_QUOTA=10%"
    lines = (DEMO / "identity.env").read_text().split("\n")
    number = lines.index("KVP_L1_SIZE_GB=1") + 1
    lines[number - 1] = line
    d = _demo_copy(tmp_path, "\n".join(lines))
    one = tmp_path / "one.env"
    one.write_bytes((line + "\n").encode())
    bash = subprocess.run(["bash", "-c", f'. "{one}"; printf "%s|%s" "$KVP_L1_SIZE_GB" '
                           '"${KVP_L2_QUOTA-unset}"'], capture_output=True, timeout=30)
    assert bash.stdout == b"1\rKVP_L2_QUOTA=10%|unset"
    r = kvp("budget", str(d), "--json")
    assert r.returncode == 2, (r.stdout, r.stderr)
    # --json: the error document, not the budget (the CR line read as two keys)
    doc = json.loads(r.stdout)
    assert doc["schema"] == "kvpersist.error/1" and "budget" not in doc, doc
    assert f"identity.env:{number}" in r.stderr and "dos2unix" in r.stderr
    assert "Traceback" not in r.stderr and "\r" not in r.stderr


def test_the_loader_reads_a_regular_file_bounded_strict_utf8(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.env"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):  # never blocks
        read_text(fifo, "the identity file")
    with pytest.raises(ConfigError, match="not a regular file"):
        read_text(tmp_path, "the identity file")
    big = tmp_path / "big.env"
    big.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match="larger than"):
        read_text(big, "the identity file")
    latin = tmp_path / "latin.env"
    latin.write_bytes(b"KVP_A='caf\xe9'\n")
    with pytest.raises(ConfigError, match="cannot read the identity file"):
        read_text(latin, "the identity file")
    crlf = tmp_path / "crlf.env"
    crlf.write_bytes(b"A=1\r\nB=2\rC=3\n")
    assert read_text(crlf, "x") == "A=1\r\nB=2\rC=3\n"  # no newline translation


def test_a_config_that_is_a_fifo_or_a_link_to_a_device_is_named_never_opened(
        tmp_path: Path) -> None:
    """Hardening: an identity.env that is a FIFO or a link to /dev/zero is refused naming it
    (exit 2), never opened (a FIFO would block, /dev/zero would fill the memory)."""
    fifo_dir, zero_dir = tmp_path / "fifo", tmp_path / "zero"
    fifo_dir.mkdir()
    zero_dir.mkdir()
    os.mkfifo(fifo_dir / "identity.env")
    (zero_dir / "identity.env").symlink_to("/dev/zero")
    for d in (fifo_dir, zero_dir):
        for config in (str(d), str(d / "identity.env")):
            r = kvp("render", config, timeout=30)
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
            assert f"{d / 'identity.env'}': is not a regular file" in r.stderr, r.stderr
