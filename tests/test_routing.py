"""Routing: SkipPipe path sampling and SWARM's weighted round-robin over replicas (pure, deterministic)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.config import PathConfig
from swarm.errors import ConfigError
from swarm.pipeline.routing import (
    NoLiveReplica,
    Router,
    StageBalancer,
    is_valid_path,
    path_length,
    sample_path,
)
from swarmtest.clock import FakeClock


def make_balancer(peers: list[str], seed: int = 0) -> tuple[StageBalancer, FakeClock]:
    clock = FakeClock()
    balancer = StageBalancer(random.Random(seed), clock)
    balancer.update_peers(peers)
    return balancer, clock


def picks(balancer: StageBalancer, n: int, **kwargs) -> list[str]:
    return [balancer.choose(**kwargs) for _ in range(n)]


# ---- paths ----------------------------------------------------------------------------------------


@settings(deadline=None, max_examples=200)
@given(
    num_stages=st.integers(1, 12),
    skip_ratio=st.floats(0.0, 0.95),
    max_swaps=st.integers(0, 4),
    swap_prob=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_sampled_paths_visit_the_right_stages_with_disjoint_adjacent_swaps(
    num_stages, skip_ratio, max_swaps, swap_prob, seed
):
    cfg = PathConfig(skip_ratio=skip_ratio, max_swaps=max_swaps, swap_prob=swap_prob)
    path = sample_path(num_stages, cfg, random.Random(seed))
    assert len(path) == max(1, round((1 - skip_ratio) * num_stages)) == path_length(num_stages, cfg)
    assert len(set(path)) == len(path) and all(1 <= s <= num_stages for s in path)
    order = sorted(path)
    moved = [i for i in range(len(path)) if path[i] != order[i]]
    pairs = list(zip(moved[::2], moved[1::2]))
    assert len(moved) % 2 == 0 and len(pairs) <= max_swaps
    for i, j in pairs:  # each displaced pair is an adjacent transposition
        assert j == i + 1 and (path[i], path[j]) == (order[j], order[i])
    assert is_valid_path(path, num_stages, cfg)


@settings(deadline=None, max_examples=100)
@given(num_stages=st.integers(1, 10), max_swaps=st.integers(0, 3), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_dropping_stages_keeps_a_path_valid(num_stages, max_swaps, seed, data):
    cfg = PathConfig(max_swaps=max_swaps, swap_prob=1.0)
    path = sample_path(num_stages, cfg, random.Random(seed))
    kept = [s for s in path if data.draw(st.booleans())]
    assert is_valid_path(kept, num_stages, cfg)


@pytest.mark.parametrize("num_stages", [1, 2, 5, 8])
def test_no_skips_no_swaps_is_the_plain_pipeline(num_stages):
    rng = random.Random(0)
    for _ in range(20):
        assert sample_path(num_stages, PathConfig(max_swaps=3, swap_prob=0.0), rng) == list(range(1, num_stages + 1))
        assert sample_path(num_stages, PathConfig(), rng) == list(range(1, num_stages + 1))


def test_one_swap_reaches_every_adjacent_pair_including_checkfree_plus_ends():
    rng, cfg = random.Random(0), PathConfig(max_swaps=1)
    seen = Counter(tuple(sample_path(4, cfg, rng)) for _ in range(2000))
    assert set(seen) == {(1, 2, 3, 4), (2, 1, 3, 4), (1, 3, 2, 4), (1, 2, 4, 3)}
    assert seen[(1, 2, 3, 4)] == pytest.approx(1000, rel=0.1)  # swap_prob = 0.5
    for swapped in [(2, 1, 3, 4), (1, 2, 4, 3)]:  # (1,2) and (S−1,S): each ≈ 0.5/3 of paths
        assert seen[swapped] == pytest.approx(2000 / 6, rel=0.2)


def test_two_swaps_can_swap_both_ends_but_never_move_a_stage_twice():
    rng, cfg = random.Random(0), PathConfig(max_swaps=2, swap_prob=1.0)
    seen = {tuple(sample_path(4, cfg, rng)) for _ in range(500)}
    assert (2, 1, 4, 3) in seen
    assert all(is_valid_path(p, 4, cfg) for p in seen) and (2, 3, 1, 4) not in seen


def test_skipped_stages_are_chosen_uniformly():
    rng, cfg = random.Random(0), PathConfig(skip_ratio=0.5)
    visits = Counter(s for _ in range(3000) for s in sample_path(6, cfg, rng))
    assert sorted(visits) == [1, 2, 3, 4, 5, 6]
    assert all(count == pytest.approx(1500, rel=0.1) for count in visits.values())


@pytest.mark.parametrize(
    "path, valid",
    [
        ([1, 2, 3, 4], True),
        ([2, 1, 3, 4], True),
        ([1, 3], True),  # stages dropped (no live replica)
        ([2, 1, 4, 3], False),  # two swaps, one allowed
        ([3, 1, 2, 4], False),  # stage 3 moved two places
        ([2, 3, 1, 4], False),
        ([1, 1, 2], False),
        ([0, 1, 2], False),
        ([1, 2, 5], False),
        ([1, 2, 3, 4, 5], False),
    ],
)
def test_is_valid_path(path, valid):
    assert is_valid_path(path, 4, PathConfig(max_swaps=1)) is valid


def test_is_valid_path_respects_the_skip_ratio():
    cfg = PathConfig(skip_ratio=0.5)
    assert is_valid_path([1, 3], 4, cfg) and not is_valid_path([1, 2, 3], 4, cfg)


@pytest.mark.parametrize(
    "kwargs", [dict(skip_ratio=1.0), dict(skip_ratio=-0.1), dict(max_swaps=-1), dict(swap_prob=1.5)]
)
def test_path_config_rejects_bad_values(kwargs):
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        PathConfig(**kwargs)


# ---- replica balancing -----------------------------------------------------------------------------


def test_load_follows_measured_throughput():
    balancer, _ = make_balancer(["fast", "slow"])
    speed = {"fast": 3.0, "slow": 1.0}  # samples/s
    counts = Counter()
    for _ in range(4000):
        peer = balancer.choose(task_size=8)
        balancer.report_success(peer, samples=8, seconds=8 / speed[peer])
        counts[peer] += 1
    assert counts["fast"] / counts["slow"] == pytest.approx(3.0, rel=0.05)


def test_throughput_skips_the_warm_up_averages_in_log_space_and_unmeasured_peers_get_the_median():
    balancer, _ = make_balancer(["a", "b", "c", "new"])
    assert balancer.samples_per_sec("a") == 1.0  # nothing measured yet: the default prior
    balancer.report_success("a", samples=10, seconds=60)  # the first call: dial and warm-up, not throughput
    assert balancer.samples_per_sec("a") == 1.0
    balancer.report_success("a", samples=10, seconds=2)
    assert balancer.samples_per_sec("a") == pytest.approx(5.0)  # the first measurement of the stage: as it is
    balancer.report_success("a", samples=10, seconds=1)
    assert balancer.samples_per_sec("a") == pytest.approx(math.sqrt(5 * 10))  # geometric mean of 5 and 10
    for _ in range(100):
        balancer.report_success("a", samples=10, seconds=1)
    assert balancer.samples_per_sec("a") == pytest.approx(10.0, rel=1e-3)  # an EMA by then: the old samples fade
    balancer.report_success("b", samples=1, seconds=1)  # warm-up
    balancer.report_success("b", samples=40, seconds=1)
    assert balancer.samples_per_sec("b") == pytest.approx(
        math.sqrt(10 * 40), rel=1e-3
    )  # starts from the stage's median, a's
    balancer.report_success("c", samples=1, seconds=1)
    balancer.report_success("c", samples=30, seconds=1)
    rates = [balancer.samples_per_sec(peer) for peer in "abc"]
    assert balancer.samples_per_sec("new") == pytest.approx(sorted(rates)[1])  # median of a, b, c


def test_replicas_whose_first_calls_were_slow_still_share_the_load_evenly():
    # `swarmloco local --peers 4 --stages 2`: the first stage-1 server's first call timed the dial and warm-up and
    # one more call was slow; it then served 4 of 100 microbatches (its rate, measured ~20× low, was rarely re-measured)
    balancer, _ = make_balancer(["a", "b"])
    slow_calls = {"a": [3.0, 1.0], "b": [0.5]}  # seconds of each replica's first calls; then 0.05 s for 16 samples
    counts = Counter()
    for _ in range(100):
        peer = balancer.choose(task_size=16)
        seconds = slow_calls[peer].pop(0) if slow_calls[peer] else 0.05
        balancer.report_success(peer, samples=16, seconds=seconds)
        counts[peer] += 1
    assert min(counts.values()) >= 40, counts


def test_a_replica_busy_with_other_trainers_work_gets_less_until_its_queue_drains():
    balancer, clock = make_balancer(["a", "b"])
    for peer in ("a", "b", "a", "b"):  # warm-up, then 16 samples in 0.1 s each: equally fast
        balancer.report_success(peer, samples=16, seconds=0.1)
    picks(balancer, 10)
    balancer.update_queues({"a": 20, "b": 0}, task_size=16)  # a announces 20 requests of other trainers
    busy = Counter(picks(balancer, 20, task_size=16))
    assert busy["b"] == 20, busy  # 20 queued requests are 2 s of work: b's next 20 picks cost it as much
    balancer.update_queues({"a": 0, "b": 0}, task_size=16)  # drained: the backlog leaves a's key again
    drained = Counter(picks(balancer, 40, task_size=16))
    assert drained["a"] >= 25, drained  # a catches up on the picks b took meanwhile
    balancer.update_queues({"a": 50, "b": 0}, task_size=16)
    # banned with a backlog of 5 s in its key, then readmitted at the heap's minimum
    balancer.report_failure("a", "unreachable: test")
    clock.now += 60
    assert "a" in balancer.live_peers()  # readmitted
    balancer.update_queues({"a": 0, "b": 0}, task_size=16)  # the backlog its new key never had is not taken off
    after = Counter(picks(balancer, 20, task_size=16))
    assert after["a"] <= 12, after


def test_new_peer_is_tried_soon():
    balancer, _ = make_balancer(["a", "b"])
    picks(balancer, 100)
    balancer.update_peers(["a", "b", "c"])
    after = picks(balancer, 30)
    assert "c" in after[:2]
    assert after.count("c") <= 12  # entered at the minimum, not at zero: it gets its share, not a flood


def test_vanished_peer_is_never_chosen():
    balancer, _ = make_balancer(["a", "b", "c"])
    picks(balancer, 10)
    balancer.update_peers(["a", "c"])
    assert set(picks(balancer, 50)) == {"a", "c"}
    balancer.report_success("b", samples=1, seconds=1)  # a late report about a forgotten peer is ignored
    balancer.report_failure("b", "unreachable: test")
    assert set(picks(balancer, 50)) == {"a", "c"}


def test_failure_bans_with_doubling_backoff_reset_by_success():
    balancer, clock = make_balancer(["a", "b"])
    for ban_s in [15.0, 30.0, 60.0]:
        banned_at = clock.now
        balancer.report_failure("a", "unreachable: test")
        balancer.report_failure("a", "unreachable: test")  # a second in-flight RPC failing does not double the ban
        clock.now = banned_at + ban_s - 0.1
        assert "a" not in picks(balancer, 20) and balancer.live_peers() == ["b"]
        clock.now = banned_at + ban_s
        assert "a" in picks(balancer, 2)  # back at the heap's minimum: retried at once
    balancer.report_success("a", samples=1, seconds=1)
    balancer.report_failure("a", "unreachable: test")
    clock.now += 15.0
    assert "a" in picks(balancer, 2)


def test_timeout_deprioritises_without_banning():
    balancer, _ = make_balancer(["a", "b"])
    for peer in ["a", "b"]:
        balancer.report_success(peer, samples=1, seconds=1)
    picks(balancer, 10)
    balancer.report_timeout("a", seconds=10)  # charged 10 s ≈ 10 tasks of 1 s
    after = picks(balancer, 20)
    assert after[:9] == ["b"] * 9 and "a" in after


def test_no_live_replica():
    with pytest.raises(NoLiveReplica):
        make_balancer([])[0].choose()
    balancer, _ = make_balancer(["a", "b"])
    balancer.report_failure("a", "unreachable: test")
    balancer.report_failure("b", "unreachable: test")
    with pytest.raises(NoLiveReplica):
        balancer.choose()


def test_no_live_replica_names_each_excluded_server_with_the_last_error_that_excluded_it():
    balancer, _ = make_balancer(["a", "b", "c"])
    balancer.report_failure("a", "unreachable: P2PDaemonError: connection refused")
    balancer.report_timeout("b", seconds=30, reason="no reply within rpc_s = 30 s")
    with pytest.raises(NoLiveReplica) as error:
        balancer.choose(exclude={"b", "c"})
    assert str(error.value) == (
        "no live replica among 3 known (3 excluded): "
        "a: banned 15 s more, last error: unreachable: P2PDaemonError: connection refused; "
        "b: tried for this call, last error: no reply within rpc_s = 30 s; "
        "c: tried for this call, last error: none"
    )


def test_exclude_skips_tried_peers_and_keeps_their_place():
    balancer, _ = make_balancer(["a", "b", "c"])
    first = balancer.choose()
    others = picks(balancer, 10, exclude={first})
    assert first not in others
    with pytest.raises(NoLiveReplica):
        balancer.choose(exclude={"a", "b", "c"})
    assert balancer.choose() == first  # excluded, so not charged: it is now the least loaded


# ---- router ----------------------------------------------------------------------------------------


def test_router_routes_around_dead_stages():
    clock = FakeClock()
    router = Router(num_stages=3, rng=random.Random(0), clock=clock)
    router.update(1, ["a1", "b1"])
    router.update(3, ["a3"])
    assert router.live_stages() == [1, 3]
    assert router.draw_path(PathConfig()) == [1, 3]  # stage 2 has no replica: skipped
    router.report_failure(3, "a3", "unreachable: test")
    assert router.live_stages() == [1] and router.draw_path(PathConfig()) == [1]
    with pytest.raises(NoLiveReplica):
        router.choose(3)
    clock.now = 15.0
    assert router.choose(3) == "a3" and router.live_stages() == [1, 3]
    assert router.choose(1, exclude={"a1"}) == "b1"


def test_asking_which_replicas_are_live_charges_none_of_them() -> None:
    """A relayed hop asks whether a check could find another replica (``RemoteStages.has_other_replica``) on every
    forward: asking must not charge the load a choice charges, or the replica asked about is routed around."""
    asked, untouched = (Router(num_stages=1, rng=random.Random(3)) for _ in range(2))
    for router in (asked, untouched):
        router.update(1, ["a", "b", "c"])
    for _ in range(50):
        assert sorted(asked.live_peers(1)) == ["a", "b", "c"]
    assert [asked.choose(1) for _ in range(30)] == [untouched.choose(1) for _ in range(30)]
    asked.ban(1, "b", 60.0, reason="test")
    assert sorted(asked.live_peers(1)) == ["a", "c"]
