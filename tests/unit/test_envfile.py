"""The strict identity.env parser: data, never shell."""

from __future__ import annotations

import pytest

from kvpersist.config.envfile import format_env, parse_env
from kvpersist.errors import ConfigError


def test_comments_blank_lines_quotes_and_export() -> None:
    text = """
# a comment
KVP_A=plain
KVP_B="double quoted value"
KVP_C='single # not a comment'
export KVP_D=exported
KVP_E=value # trailing comment
KVP_F=
"""
    assert parse_env(text) == {
        "KVP_A": "plain", "KVP_B": "double quoted value", "KVP_C": "single # not a comment",
        "KVP_D": "exported", "KVP_E": "value", "KVP_F": "",
    }


@pytest.mark.parametrize("line", [
    "KVP_A=$(rm -rf /)",
    "KVP_A=`id`",
    "KVP_A=${HOME}",
    "KVP_A=\"unterminated",
    "KVP_A='a' trailing",
    "not a line",
    "1KVP=x",
    "KVP_A=a\\",
])
def test_shell_constructs_are_errors_not_executed(line: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_env(line, "f.env")
    assert err.value.problems[0].where == "f.env:1"


def test_every_bad_line_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        parse_env("bad one\nKVP_A=1\nKVP_A=2\nalso bad\n", "f.env")
    wheres = [p.where for p in err.value.problems]
    assert wheres == ["f.env:1", "f.env:3", "f.env:4"]
    assert "set twice" in err.value.problems[1].message


def test_format_round_trips() -> None:
    values = {"KVP_A": "x y", "KVP_B": "--flag=1 --other", "KVP_C": "/a/b", "KVP_D": ""}
    assert parse_env(format_env(values, header="generated")) == values
