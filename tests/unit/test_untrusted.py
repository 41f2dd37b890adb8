"""The one reader of untrusted files (kvpersist/system/untrusted.py) and the bounded problem
list: every hostile file is an UnreadableFile naming it, never a hang, a traceback type of
its own or a guessed value."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.errors import MAX_PROBLEM_CHARS, MAX_PROBLEMS, ConfigError, Problem, Problems
from kvpersist.system import untrusted
from kvpersist.system.untrusted import UnreadableFile, parse_json, read_bytes, read_json


def test_a_fifo_a_device_and_a_directory_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(UnreadableFile, match="a FIFO"):
        read_bytes(fifo, max_bytes=100)
    with pytest.raises(UnreadableFile, match="a character device"):
        read_bytes("/dev/zero", max_bytes=100)
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(UnreadableFile, match="a character device"):
        read_json(link, max_bytes=100)
    with pytest.raises(UnreadableFile, match="a directory"):
        read_bytes(tmp_path, max_bytes=100)


def test_a_symlink_is_refused_where_none_is_expected(tmp_path: Path) -> None:
    (tmp_path / "real").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert read_json(tmp_path / "link", max_bytes=10) == {}
    with pytest.raises(UnreadableFile, match="symbolic link"):
        read_json(tmp_path / "link", max_bytes=10, follow=False)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert read_bytes("real", max_bytes=10, dir_fd=dfd, follow=False) == b"{}"
        with pytest.raises(UnreadableFile, match="symbolic link"):
            read_bytes("link", max_bytes=10, dir_fd=dfd, follow=False)
    finally:
        os.close(dfd)


def test_absent_is_file_not_found_and_the_cap_is_exact(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_bytes(tmp_path / "none", max_bytes=10)
    (tmp_path / "ten").write_bytes(b"x" * 10)
    assert read_bytes(tmp_path / "ten", max_bytes=10) == b"x" * 10
    with pytest.raises(UnreadableFile, match="larger than the 9 bytes"):
        read_bytes(tmp_path / "ten", max_bytes=9)


@pytest.mark.parametrize(("text", "why"), [
    ("[" * 100_000, "nested deeper"),
    ("[" * 65 + "]" * 65, "nested 65 levels"),
    ('{"a":' * 200 + "1" + "}" * 200, "nested 200 levels"),
    ("NaN", "NaN"), ("[Infinity]", "Infinity"), ("-Infinity", "Infinity"),
    ('{"head_dim": 1e309}', "out of range"), ("9" * 5000, "4300"),
    ("{", "not valid JSON"), ("", "not valid JSON"), ('"\\ud800"x', "not valid JSON"),
])
def test_hostile_json_is_refused_naming_the_file(text: str, why: str) -> None:
    with pytest.raises(UnreadableFile, match=why) as err:
        parse_json(text, "/m/config.json")
    assert err.value.path == "/m/config.json"
    assert err.value.exit_code == 2


def test_json_within_the_bounds_is_read_as_it_is() -> None:
    assert parse_json('{"a": [1, 2.5, "[[[", {"b": null}]}', "x") == {
        "a": [1, 2.5, "[[[", {"b": None}]}
    assert untrusted.json_depth(parse_json("[" * 64 + "]" * 64, "x")) == 64
    assert parse_json(b'{"x": 10000000000000000000000}', "x") == {"x": 10**22}
    with pytest.raises(UnreadableFile, match="not UTF-8 text"):
        parse_json(b'{"x": "\xff"}', "x")


def test_the_depth_is_measured_in_memory_of_the_depth_not_the_width() -> None:
    assert [untrusted.json_depth(d) for d in (1, [], {}, [[], [[]], {"a": [{}]}])] == [
        0, 1, 1, 4]
    wide = [{} for _ in range(1_000_000)]  # one iterator a level, not one entry an element
    assert untrusted.json_depth([wide, [[[]]]]) == 4


def test_a_bound_on_arrays_and_objects_is_checked_before_parsing() -> None:
    assert parse_json("[{}, {}]", "x", max_containers=3) == [{}, {}]
    with pytest.raises(UnreadableFile, match="holds 4 '\\[' and '\\{'"):
        parse_json("[{}, {}, {}]", "x", max_containers=3)
    # an upper bound: brackets inside strings count too (a documented, cheap over-count)
    with pytest.raises(UnreadableFile, match="more than the 1 arrays"):
        parse_json('["[["]', "x", max_containers=1)
    assert parse_json("[" * 64 + "]" * 64, "x") is not None  # no bound unless asked


def test_the_tail_of_a_log_is_read_from_its_end_only(tmp_path: Path) -> None:
    log = tmp_path / "big.log"
    with open(log, "wb") as f:
        f.truncate(1 << 30)  # sparse: reading it whole would take a gigabyte
        f.seek(0, os.SEEK_END)
        f.write(b"last line\n")
    assert untrusted.read_tail(log, max_bytes=10) == b"last line\n"
    (tmp_path / "short.log").write_bytes(b"a\nb\n")
    assert untrusted.read_tail(tmp_path / "short.log", max_bytes=100) == b"a\nb\n"
    os.mkfifo(tmp_path / "fifo.log")
    with pytest.raises(UnreadableFile, match="a FIFO"):
        untrusted.read_tail(tmp_path / "fifo.log", max_bytes=100)
    (tmp_path / "link.log").symlink_to("/dev/zero")
    with pytest.raises(UnreadableFile, match="symbolic link"):
        untrusted.read_tail(tmp_path / "link.log", max_bytes=100, follow=False)
    with pytest.raises(UnreadableFile, match="a character device"):
        untrusted.read_tail(tmp_path / "link.log", max_bytes=100)
    with pytest.raises(FileNotFoundError):
        untrusted.read_tail(tmp_path / "none.log", max_bytes=100)


def test_a_non_object_is_refused_where_an_object_is_expected(tmp_path: Path) -> None:
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(UnreadableFile, match="a JSON list, not an object"):
        untrusted.read_json_object(tmp_path / "list.json", max_bytes=10)


def test_a_path_of_any_bytes_is_shown_escaped() -> None:
    assert untrusted.show_path(b"/tmp/bad-\xff/a\nb") == "/tmp/bad-\\xff/a\\nb"
    assert untrusted.show_path("/a/\u2028/b") == "/a/\\u2028/b"


def test_the_problem_list_keeps_the_first_ones_and_counts_the_rest() -> None:
    bounded = Problems()
    for i in range(1_000_000):
        bounded.add(Problem(f"f:{i}", "bad"))
    assert len(bounded) == 1_000_000 and len(bounded.kept) == MAX_PROBLEMS
    err = ConfigError(bounded, "f")
    assert len(err.problems) == MAX_PROBLEMS + 1
    assert "999,980 more problem(s)" in str(err)
    # a plain list is bounded the same way
    err = ConfigError([Problem(f"f:{i}", "bad") for i in range(100)], "f")
    assert len(err.problems) == MAX_PROBLEMS + 1 and "80 more" in str(err)


def test_one_problem_never_quotes_a_megabyte() -> None:
    p = Problem("w" * 10**6, "m" * 10**6, "f" * 10**6)
    assert len(str(p)) < 4 * MAX_PROBLEM_CHARS
    assert "999,000 more characters" in p.message


def test_reading_dev_zero_stays_bounded_under_rlimit_as(tmp_path: Path) -> None:
    """In a child limited to 256 MiB of address space: the reader refuses /dev/zero (a
    device) and a 300 MB sparse file (the cap) without allocating either."""
    sparse = tmp_path / "sparse.json"
    with open(sparse, "wb") as f:
        f.truncate(300 << 20)
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (256 << 20, 256 << 20))\n"
            "from kvpersist.system.untrusted import read_json, UnreadableFile\n"
            "for p in ('/dev/zero', sys.argv[1]):\n"
            "    try:\n"
            "        read_json(p, max_bytes=64 << 20)\n"
            "    except UnreadableFile as e:\n"
            "        print(e.why)\n")
    r = subprocess.run([sys.executable, "-c", code, str(sparse)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "a character device" in r.stdout and "larger than" in r.stdout
    assert resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY  # ours intact
