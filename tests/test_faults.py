"""Fault injection: schedule parsing, seeded random failures, and kill-once semantics (one real SIGKILL)."""

from __future__ import annotations

import signal
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.faults import FaultEvent, FaultSchedule
from swarmtest.clock import FakeClock
from swarmtest.faults import FaultInjector, random_failures


class FakeKill:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, pid: int, sig: int) -> None:
        self.calls.append((pid, sig))


# ---- schedules -------------------------------------------------------------------------------------------


def test_parse_steps_and_times_with_units():
    schedule = FaultSchedule.parse(" stage2-a@step=40, stage2-b@step=40,trainer1@t=30s,x@t=1.5m,y@t=2h,z@t=7")
    assert schedule.events == (
        FaultEvent(peer="stage2-a", step=40),
        FaultEvent(peer="stage2-b", step=40),
        FaultEvent(peer="trainer1", at_s=30.0),
        FaultEvent(peer="x", at_s=90.0),
        FaultEvent(peer="y", at_s=7200.0),
        FaultEvent(peer="z", at_s=7.0),
    )
    assert FaultSchedule.parse("") == FaultSchedule.parse("  ") == FaultSchedule()
    assert schedule == FaultSchedule([FaultEvent(peer="stage2-a", step=40)] + list(schedule.events[1:]))  # programmatic


@pytest.mark.parametrize(
    "spec, message",
    [
        ("stage2-a", r"bad fault 'stage2-a': expected PEER@step=N or PEER@t=SECONDS"),
        ("a@step=-1", r"bad fault 'a@step=-1'"),
        ("a@step=4.5", r"bad fault 'a@step=4.5'"),
        ("a@t=30x", r"bad fault 'a@t=30x'"),
        ("a@t=1.2.3", r"bad fault 'a@t=1.2.3'"),
        ("a@step=1,,b@step=2", r"bad fault ''"),
        ("a b@step=1", r"peer name 'a b'"),
        ("@step=1", r"bad fault '@step=1'"),
    ],
)
def test_parse_errors_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        FaultSchedule.parse(spec)


def test_an_event_has_exactly_one_trigger():
    with pytest.raises(ValueError, match="exactly one of step or at_s"):
        FaultEvent(peer="a", step=3, at_s=1.0)
    with pytest.raises(ValueError, match="exactly one of step or at_s"):
        FaultEvent(peer="a")
    with pytest.raises(ValueError, match="at_s must be finite"):
        FaultEvent(peer="a", at_s=float("inf"))


def test_due_by_step_or_by_time():
    schedule = FaultSchedule.parse("a@step=40,b@t=30s")
    assert not schedule.due("a", step=39) and schedule.due("a", step=40) and schedule.due("a", step=41)
    assert not schedule.due("a", elapsed_s=1e6)  # a step event needs the step
    assert not schedule.due("b", elapsed_s=29.9) and schedule.due("b", elapsed_s=30.0)
    assert not schedule.due("c", step=10**6, elapsed_s=1e6)


@settings(deadline=None, max_examples=100)
@given(
    st.lists(
        st.builds(
            FaultEvent,
            peer=st.from_regex(r"[a-z0-9_.:-]{1,8}", fullmatch=True),
            at_s=st.floats(0, 1e7, allow_nan=False),
        ),
        max_size=5,
    ),
    st.lists(st.tuples(st.from_regex(r"[A-Z0-9-]{1,8}", fullmatch=True), st.integers(0, 10**9)), max_size=5),
)
def test_a_schedule_prints_as_a_spec_that_parses_back(timed, stepped):
    schedule = FaultSchedule(timed + [FaultEvent(peer=p, step=s) for p, s in stepped])
    assert FaultSchedule.parse(str(schedule)) == schedule


# ---- random failures ----------------------------------------------------------------------------------------


def test_random_failures_are_reproducible_per_seed_and_per_peer():
    peers = [f"peer{i}" for i in range(50)]
    first = random_failures(peers, rate_per_hour=2.0, duration_s=3600, seed=7)
    assert first == random_failures(reversed(peers), rate_per_hour=2.0, duration_s=3600, seed=7)
    assert first != random_failures(peers, rate_per_hour=2.0, duration_s=3600, seed=8)
    fewer = random_failures(peers[:10], rate_per_hour=2.0, duration_s=3600, seed=7)
    assert set(fewer.events) == {e for e in first.events if e.peer in peers[:10]}  # other peers change nothing
    assert all(0 <= e.at_s <= 3600 and e.step is None for e in first.events)
    assert len({e.peer for e in first.events}) == len(first.events)  # each peer fails at most once
    assert FaultSchedule.parse(str(first)) == first


def test_random_failure_rate_matches_the_exponential_law():
    peers = [f"p{i}" for i in range(2000)]
    failed = len(random_failures(peers, rate_per_hour=0.1, duration_s=3600, seed=0).events) / len(peers)
    assert 0.08 < failed < 0.11  # 1 − e^{−0.1} ≈ 0.095
    assert random_failures(peers, rate_per_hour=0.0, duration_s=3600, seed=0).events == ()
    with pytest.raises(ValueError, match="rate_per_hour"):
        random_failures(peers, rate_per_hour=-1.0, duration_s=10, seed=0)


# ---- the injector -----------------------------------------------------------------------------------------


def test_each_due_peer_is_killed_exactly_once():
    clock, kill = FakeClock(100.0), FakeKill()
    schedule = FaultSchedule.parse("a@step=40,a@t=5s,b@step=40,c@t=30s")
    injector = FaultInjector(schedule, {"a": 11, "b": 12, "c": 13, "d": 14}, clock, kill=kill)
    assert injector.poll({"a": 39, "b": 39}) == []
    assert injector.poll({"a": 40, "b": 39}) == ["a"]
    clock.now += 10  # a's time event is due too, but a is already gone
    assert injector.poll({"a": 41, "b": 40}) == ["b"]
    clock.now += 20
    assert injector.poll() == ["c"]
    assert injector.poll({"a": 99, "b": 99}) == []
    assert kill.calls == [(11, signal.SIGKILL), (12, signal.SIGKILL), (13, signal.SIGKILL)]


def test_a_schedule_naming_an_unknown_peer_is_rejected():
    with pytest.raises(ValueError, match=r"no process: \['ghost'\]"):
        FaultInjector(FaultSchedule.parse("ghost@step=1"), {"a": 1}, FakeClock(100.0), kill=FakeKill())


def test_a_process_that_is_already_gone_is_not_reported():
    def gone(pid: int, sig: int) -> None:
        raise ProcessLookupError(pid)

    injector = FaultInjector(FaultSchedule.parse("a@step=1"), {"a": 11}, FakeClock(100.0), kill=gone)
    assert injector.poll({"a": 1}) == [] and injector.poll({"a": 2}) == []


def test_kills_a_real_subprocess():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        injector = FaultInjector(FaultSchedule.parse("sleeper@step=3"), {"sleeper": proc})
        assert injector.poll({"sleeper": 2}) == [] and proc.poll() is None
        assert injector.poll({"sleeper": 3}) == ["sleeper"]
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert injector.poll({"sleeper": 4}) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
