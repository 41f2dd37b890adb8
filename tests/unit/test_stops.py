"""The clean/unclean stop decision (pure), table-driven."""

from __future__ import annotations

import pytest

from kvpersist.stack.stops import CleanStop, Launched, decide, systemd_stop_was_clean

L = Launched(100, 100)


@pytest.mark.parametrize(("pid_state", "mtime", "launched", "clean", "unclean", "since"), [
    ("absent", None, None, None, False, None),            # first launch
    ("running", None, L, None, False, None),
    ("stale", 100, L, CleanStop(150, 1, "terminated"), False, None),  # systemd: clean
    ("stale", 100, L, None, True, 100),                    # kill -9
    ("absent", None, L, None, True, 100),                  # SIGKILL after the stop timeout
    ("absent", None, L, CleanStop(50, 1, "terminated"), True, 100),  # clean stop is older
    ("stale", 100, Launched(100, 40), None, True, 40),     # an unfinished check carries over
    ("stale", 70, None, None, True, 70),                   # before records existed
    ("stale", 70, None, CleanStop(80, None, "systemd"), False, None),
])
def test_decide(pid_state: str, mtime: int | None, launched: Launched | None,
                clean: CleanStop | None, unclean: bool, since: int | None) -> None:
    w = decide(pid_state=pid_state, pid_file_mtime_ns=mtime, launched=launched,
               clean_stop=clean)
    assert (w.unclean, w.since_ns) == (unclean, since)


def test_records_round_trip_and_garbage_is_no_record() -> None:
    assert Launched.from_dict(L.to_dict()) == L
    c = CleanStop(5, 7, "terminated")
    assert CleanStop.from_dict(c.to_dict()) == c
    for junk in (None, [], {"schema": "x"}, {"schema": "kvpersist.launched/1",
                                            "launched_at_ns": "1"}):
        assert Launched.from_dict(junk) is None and CleanStop.from_dict(junk) is None


def test_systemd_stop_post_environment() -> None:
    ok = {"SERVICE_RESULT": "success", "EXIT_CODE": "exited", "EXIT_STATUS": "0"}
    assert systemd_stop_was_clean(ok)
    assert not systemd_stop_was_clean({**ok, "EXIT_CODE": "killed", "EXIT_STATUS": "KILL"})
    assert not systemd_stop_was_clean({**ok, "SERVICE_RESULT": "timeout"})
    assert not systemd_stop_was_clean({})
