"""The outer step on an in-memory network: the round protocol (who is in, who is late, one agreed set) and whole replicas (rounds, install, catch-up)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import msgpack
import pytest
import torch
from hivemind.p2p import P2P
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.config import TimeoutConfig
from swarm.dht.records import StageStatus
from swarm.errors import ConfigError
from swarm.events import OuterDeclared, OuterStrike, StateDownload, of_kind
from swarm.outer.accountability import OUTER_PEER_LIMITS
from swarm.outer.allgather import allgather_round
from swarm.outer.board import MAX_COMMIT_BYTES, Board, digest, parse_commit
from swarm.outer.claims import round_to_meet
from swarm.outer.group import P2PGroupNetwork, RoundKey, RoundResult, RoundTiming
from swarm.outer.matchmaking import RoundContext, window_opening
from swarm.outer.pairs import pair_round
from swarm.outer.replica import ReplicaSync
from swarm.outer.service import ServedState, StateChanged
from swarm.outer.state import StageState, StateDecoder, stream_state, weights_hash
from swarm.outer.threads import snapshot_weights
from swarm.rpc.blobs import BlobClient, BlobServicer, Sink, TransferError, feed
from swarmtest.clock import FakeClock, in_virtual_time
from swarmtest.configs import sync_config
from swarmtest.fakes import Hub, MemoryNet
from swarmtest.replicas import ReplicaGroup

TIMING = RoundTiming(window_s=0.3, timeout_s=0.4, settle_s=0.05)
KEY = RoundKey(stage=1, round=3)
Exchange = Callable[..., Awaitable[RoundResult]]  # allgather_round, or NoLoCo's PAIRS
PAIRS = pair_round


async def member(
    hub: Hub, name: str, delay: float, expected: frozenset[str] | None, timing: RoundTiming, exchange: Exchange
) -> RoundResult:
    await asyncio.sleep(delay)
    ctx = RoundContext(
        net=MemoryNet(hub, name), board=hub.boards[name], timing=timing, clock=asyncio.get_running_loop().time
    )
    return await exchange(ctx, KEY, f"payload of {name}".encode(), expected=expected)


def play(
    hub: Hub,
    delays: dict[str, float],
    kill: dict[str, float] | None = None,
    expected: dict[str, frozenset[str]] | None = None,
    timing: RoundTiming = TIMING,
    exchange: Exchange = allgather_round,
) -> tuple[dict[str, RoundResult | None], float]:
    """Run every member in virtual time (``VirtualClockLoop``); ``kill`` = {name: after seconds}: that member dies (its
    task is cancelled). The results (None for the dead) and the seconds the whole round took. ``exchange``: the group
    round (``allgather_round``) or NoLoCo's pairs (``PAIRS``)."""
    return in_virtual_time(_play(hub, delays, kill, expected, timing, exchange))


async def _play(
    hub: Hub,
    delays: dict[str, float],
    kill: dict[str, float] | None,
    expected: dict[str, frozenset[str]] | None,
    timing: RoundTiming,
    exchange: Exchange,
) -> dict[str, RoundResult | None]:
    for name in delays:
        hub.join(name)
    tasks = {
        name: asyncio.create_task(member(hub, name, delay, (expected or {}).get(name), timing, exchange))
        for name, delay in delays.items()
    }

    async def killer(name: str, after: float) -> None:
        await asyncio.sleep(after)
        hub.dead.add(name)
        tasks[name].cancel()

    killers = [asyncio.create_task(killer(name, after)) for name, after in (kill or {}).items()]
    results = await asyncio.gather(*tasks.values(), return_exceptions=True)
    await asyncio.gather(*killers)
    return {name: None if isinstance(r, asyncio.CancelledError) else r for name, r in zip(tasks, results)}


def test_members_that_arrive_together_apply_the_same_full_set() -> None:
    results, _ = play(Hub(), {"b": 0.0, "a": 0.05, "c": 0.1})
    expected = tuple(f"payload of {n}".encode() for n in "abc")
    for r in results.values():
        assert (
            r.outcome == "done"
            and r.contributors == ("a", "b", "c")
            and r.payloads == expected
            and r.group == ("a", "b", "c")
        )
    assert results["a"].received == 2 and results["a"].received_bytes == sum(len(p) for p in expected[1:])


def test_a_replica_expecting_nobody_leads_alone_and_later_members_take_its_set() -> None:
    # p2 arrives first, closes at once and leads itself; p0 and p1 see it arrived first and apply its set: no split
    results, _ = play(Hub(), {"p0": 0.1, "p1": 0.1, "p2": 0.0}, expected={"p2": frozenset()})
    assert {(r.outcome, r.contributors, r.leader) for r in results.values()} == {("done", ("p2",), "p2")}


def test_the_window_closes_as_soon_as_the_expected_members_are_in() -> None:
    slow = RoundTiming(window_s=3.0, timeout_s=0.4, settle_s=0.05)
    results, took_s = play(
        Hub(), {"a": 0.0, "b": 0.1}, expected={"a": frozenset("ab"), "b": frozenset("ab")}, timing=slow
    )
    assert took_s < 1.0  # not the 3 s window
    assert results["a"].contributors == results["b"].contributors == ("a", "b")


def test_a_group_of_one_applies_its_own_payload_and_expecting_nobody_does_not_wait() -> None:
    result = play(Hub(), {"solo": 0.0})[0]["solo"]
    assert result.outcome == "done" and result.payloads == (b"payload of solo",) and result.received == 0
    _, took_s = play(
        Hub(), {"solo": 0.0}, expected={"solo": frozenset()}, timing=RoundTiming(window_s=3.0, timeout_s=0.4)
    )
    assert took_s < 1.0


def test_a_replica_arriving_after_the_window_is_late_and_the_group_goes_on_without_it() -> None:
    results, _ = play(Hub(), {"a": 0.0, "b": 0.05, "z": TIMING.window_s + 0.15})
    assert results["z"].outcome == "late"
    assert results["a"].contributors == results["b"].contributors == ("a", "b")


def test_a_member_dying_after_it_declared_is_left_out_without_a_hang() -> None:
    results, took_s = play(Hub(), {"a": 0.0, "b": 0.0, "c": 0.0}, kill={"c": 0.1})
    assert results["c"] is None
    assert results["a"].outcome == results["b"].outcome == "done"
    assert results["a"].payloads == results["b"].payloads and results["a"].contributors == ("a", "b")
    assert took_s < TIMING.max_round_s


def test_a_member_that_never_answers_is_left_out_after_the_timeout() -> None:
    hub = Hub()
    hub.slow.add("c")
    results, took_s = play(hub, {"a": 0.0, "b": 0.0, "c": 0.0})
    assert results["a"].contributors == results["b"].contributors == ("a", "b")
    assert took_s < TIMING.max_round_s + 0.5
    # c fetched from a and b, but its leader a never got c's payload: c applies a's set too
    assert results["c"].outcome == "done" and results["c"].contributors == ("a", "b")


def test_a_payload_one_member_could_not_fetch_comes_from_the_leader() -> None:
    hub = Hub()
    hub.cut.add(("b", "c"))  # b cannot reach c, the leader a can
    results, _ = play(hub, {"a": 0.0, "b": 0.0, "c": 0.0})
    assert {r.contributors for r in results.values()} == {("a", "b", "c")}
    assert len({r.payloads for r in results.values()}) == 1
    assert results["b"].received == 2  # a's payload, then c's from a


def test_one_declaration_closes_no_window_and_times_no_round_can_have_are_ignored() -> None:
    now, window = 100.0, TIMING.window_s
    opening = lambda **declared: window_opening(declared, own=now, now=now, timing=TIMING)
    assert opening() == now
    assert opening(liar=now - 5 * window) == now  # one early declaration: this replica is not late
    assert opening(a=now - 2 * window, b=now - 1.5 * window) == now - 1.5 * window  # two: it is
    assert opening(a=0.0, b=0.0) == now  # long before any live round
    assert opening(a=now - 0.1, future=now + 1e6) == now  # beyond any clock skew
    assert window_opening({"a": now - 0.1}, own=now - 0.2, now=now, timing=TIMING) == now - 0.2  # never after its own


@pytest.mark.parametrize("declared_at", [0.0, -(TIMING.window_s + 0.05), 1e6])
def test_a_liar_declaring_a_time_that_would_close_the_window_stalls_no_round(declared_at: float) -> None:
    hub = Hub()
    # "0liar" sorts before every member: were it the leader, its missing commit would fail the round
    hub.declared[KEY] = {"0liar": declared_at if declared_at in (0.0, 1e6) else time.monotonic() + declared_at}
    results, _ = play(hub, {"a": 0.0, "b": 0.05})
    assert [(r.outcome, r.contributors, r.leader) for r in results.values()] == [("done", ("a", "b"), "a")] * 2


def stalled_round(delays: dict[str, float], sybils: dict[str, float]) -> tuple[dict[str, RoundResult], set[tuple]]:
    """Members arriving after ``delays`` (seconds) at round ``KEY``, which ``sybils`` declared for at (seconds from the
    start) without a payload; each member's result, and the (member, blamed peer) pairs."""
    hub, blamed = Hub(), set[tuple]()

    async def one(name: str, delay: float) -> RoundResult:
        await asyncio.sleep(delay)
        clock, net = asyncio.get_running_loop().time, MemoryNet(hub, name)
        blame = lambda peer, why: blamed.add((name, peer))  # noqa: E731
        ctx = RoundContext(net=net, board=hub.boards[name], timing=TIMING, clock=clock, blame=blame)
        return await allgather_round(ctx, KEY, name.encode())

    async def scenario() -> dict[str, RoundResult]:
        for name in delays:
            hub.join(name)
        now = asyncio.get_running_loop().time()
        hub.declared[KEY] = {peer: now + at for peer, at in sybils.items()}
        results = await asyncio.gather(*(one(name, delay) for name, delay in delays.items()))
        return dict(zip(delays, results))

    return in_virtual_time(scenario())[0], blamed


def test_declarations_long_opened_with_no_payload_make_nobody_late_and_their_declarers_are_blamed() -> None:
    # two identities declare a second before the round (a time a live round can have, older than any clock skew): the
    # window would have closed before a and b arrived, but neither shows a payload, so they close nothing
    sybils = {"0s1": -1.0, "0s2": -1.0}
    results, blamed = stalled_round({"a": 0.0, "b": 0.05}, sybils)
    assert [(r.outcome, r.contributors, r.leader) for r in results.values()] == [("done", ("a", "b"), "a")] * 2
    assert blamed == {(m, s) for m in ("a", "b") for s in sybils}


def test_a_replica_arriving_after_a_real_window_is_still_late_and_blames_nobody() -> None:
    # a and b declared and show their payloads: z, arriving after their window, is late as before (and downloads)
    results, blamed = stalled_round({"a": 0.0, "b": 0.05, "z": TIMING.window_s + 0.3}, {})
    assert results["z"].outcome == "late" and results["a"].contributors == ("a", "b")
    assert not blamed
    # with a sybil besides them: still late (a and b back the window), and only the sybil is blamed
    results, blamed = stalled_round({"a": 0.0, "b": 0.05, "z": TIMING.window_s + 0.3}, {"0s": -1.0})
    assert results["z"].outcome == "late" and results["a"].contributors == ("a", "b")
    assert {peer for _, peer in blamed} <= {"0s"}


def test_the_clock_skew_is_validated_and_bounded_by_half_the_window() -> None:
    with pytest.raises(ConfigError):
        TimeoutConfig(clock_skew_s=0.0)
    with pytest.raises(ValueError):
        RoundTiming(window_s=1, timeout_s=1, clock_skew_s=-1)
    assert RoundTiming.of(TimeoutConfig(matchmaking_s=1.0, clock_skew_s=5.0)).clock_skew_s == 0.5
    assert RoundTiming.of(TimeoutConfig()).clock_skew_s == 1.0


def test_a_member_that_dies_in_the_window_leads_nothing_and_the_others_go_on_without_it() -> None:
    results, _ = play(Hub(), {"a": 0.0, "b": 0.0, "c": 0.0}, kill={"a": 0.1})  # in the window
    assert results["b"].outcome == results["c"].outcome == "done"
    assert results["b"].contributors == results["c"].contributors == ("b", "c") and results["b"].leader == "b"


def test_when_the_leader_withholds_its_commit_the_others_fail_the_round_within_the_bound() -> None:
    class WithholdingHub(Hub):
        def join(self, me: str) -> None:
            super().join(me)
            if me == "a":
                self.boards[me].commit = lambda key, entries: None  # serves its payload, never its commit

    hub = WithholdingHub()
    results, took_s = play(hub, {"a": 0.0, "b": 0.0, "c": 0.0}, kill={"a": 2.0})
    assert results["b"].outcome == results["c"].outcome == "failed" and "leader a" in results["b"].reason
    assert took_s < TIMING.max_round_s + 0.5


@pytest.mark.parametrize("count", [4, 5])
def test_a_pair_round_fetches_only_the_partners_payload_and_pairs_are_mutual(count: int) -> None:
    hub, names = Hub(), [f"p{i}" for i in range(count)]
    results, _ = play(hub, dict.fromkeys(names, 0.0), exchange=PAIRS)
    pairs = {r.contributors for r in results.values()}
    assert all(r.outcome == "done" and r.leader is None for r in results.values())
    # every member is in exactly one pair (one triple when odd), and its partner's result names the same pair
    assert sorted(len(pair) for pair in pairs) == ([2, 2] if count == 4 else [2, 3])
    assert sorted(name for pair in pairs for name in pair) == names
    for name, r in results.items():
        assert name in r.contributors and r.payloads == tuple(f"payload of {n}".encode() for n in r.contributors)
        assert r.received == len(r.contributors) - 1 and r.group == tuple(names)
    # one payload transfer per member (two in the triple), no commit: the group round makes count·(count−1) and more
    assert sorted(name for _, _, name in hub.fetches) == sorted(
        KEY.blob(f"payload/{peer}") for pair in pairs for peer in pair for _ in range(len(pair) - 1)
    )
    # the next round pairs them differently: gossip reaches every replica through partners of partners
    later = play(Hub(), dict.fromkeys(names, 0.0), exchange=functools.partial(_pair_round_at, round_=KEY.round + 1))
    assert {r.contributors for r in later[0].values()} != pairs


async def _pair_round_at(ctx: RoundContext, key: RoundKey, *args, round_: int, **kwargs) -> RoundResult:
    return await PAIRS(ctx, dataclasses.replace(key, round=round_), *args, **kwargs)


def test_a_pair_round_whose_partner_dies_is_done_alone_within_the_bound() -> None:
    names = ["p0", "p1", "p2", "p3"]
    results, _ = play(Hub(), dict.fromkeys(names, 0.0), exchange=PAIRS)
    victim = next(name for name in names if name != "p0" and name in results["p0"].contributors)  # p0's partner
    results, took_s = play(Hub(), dict.fromkeys(names, 0.0), kill={victim: 0.1}, exchange=PAIRS)
    assert results["p0"].outcome == "done" and results["p0"].contributors == ("p0",) and results["p0"].received == 0
    assert took_s < TIMING.max_round_s
    others = [r for name, r in results.items() if name not in ("p0", victim)]
    assert all(len(r.contributors) == 2 for r in others)  # the other pair is untouched


@settings(deadline=None, max_examples=20)
@given(
    delays=st.lists(st.sampled_from([0.0, 0.1, 0.2, 0.45]), min_size=1, max_size=4),
    cuts=st.sets(st.tuples(st.integers(0, 3), st.integers(0, 3))),
    kill=st.one_of(st.none(), st.tuples(st.integers(0, 3), st.sampled_from([0.1, 0.4]))),
    expected=st.lists(
        st.one_of(st.none(), st.frozensets(st.sampled_from(["p0", "p1", "p2", "p3"]))), min_size=4, max_size=4
    ),
)
def test_every_member_that_finishes_applies_the_same_set(
    delays: list[float],
    cuts: set[tuple[int, int]],
    kill: tuple[int, float] | None,
    expected: list[frozenset[str] | None],
) -> None:
    names = [f"p{i}" for i in range(len(delays))]
    hub = Hub()
    hub.cut = {(names[i], names[j]) for i, j in cuts if max(i, j) < len(names)}
    killed = {names[kill[0]]: kill[1]} if kill and kill[0] < len(names) else {}
    results, took_s = play(hub, dict(zip(names, delays)), killed, dict(zip(names, expected)))
    assert took_s < max(delays) + TIMING.max_round_s + 0.5  # nobody hangs
    # a member killed after it finished took its result with it: the survivors are the swarm
    done = [r for name, r in results.items() if r is not None and r.outcome == "done" and name not in killed]
    for r in done:
        assert [digest(p) for p in r.payloads] == [digest(f"payload of {n}".encode()) for n in r.contributors]
    everyone_waited = all(
        expected[i] is None or expected[i] >= set(names) for i in range(len(names))
    )  # nobody closed early on a subset
    # An early close on a subset, or a cut link (the member behind it leads without the peer it cannot reach), may
    # split the group: ReplicaSync repairs that by download, to the copy more replicas hold.
    if everyone_waited and not hub.cut:
        assert len({(r.contributors, r.payloads) for r in done}) <= 1
    if (
        not hub.cut and not killed and max(delays) <= TIMING.window_s - 0.1 and everyone_waited
    ):  # nothing went wrong: everyone is in
        assert [r.contributors for r in results.values()] == [tuple(names)] * len(names)


def test_board_serves_payloads_and_waits_for_the_commit() -> None:
    async def scenario() -> None:
        board = Board(retention_s=60.0, clock=time.monotonic)
        with pytest.raises(LookupError):
            await board.get(KEY.blob("commit"))  # a round this peer takes no part in: no wait
        board.offer(KEY, "a", b"pa")
        assert await board.get(KEY.blob("payload/a")) == b"pa"
        with pytest.raises(LookupError):
            await board.get(KEY.blob("payload/b"))
        waiting = asyncio.create_task(board.get(KEY.blob("commit")))
        await asyncio.sleep(0.05)  # nothing to wait for: the getter must still be waiting a moment later
        assert not waiting.done()
        board.commit(KEY, [("a", digest(b"pa"))])
        assert parse_commit(await waiting) == [("a", digest(b"pa"))]
        other = RoundKey(stage=1, round=4)
        board.offer(other, "a", b"pa")
        board.commit(other, None)  # not its leader: askers learn it at once
        with pytest.raises(LookupError):
            await board.get(other.blob("commit"))
        with pytest.raises(LookupError):
            await board.get("outer/1/x/commit")

    asyncio.run(scenario())


def test_board_forgets_rounds_after_the_retention() -> None:
    clock = FakeClock(0.0)
    board = Board(retention_s=10.0, clock=clock)
    board.offer(KEY, "a", b"pa")
    clock.now = 11.0
    board.offer(RoundKey(stage=1, round=4), "a", b"pb")
    with pytest.raises(LookupError):
        asyncio.run(board.get(KEY.blob("payload/a")))


@pytest.mark.parametrize(
    "blob",
    [
        b"\xc1",
        msgpack.packb([]),
        msgpack.packb([["a", b"short"]]),
        msgpack.packb([["a", bytes(32)], ["a", bytes(32)]]),
        msgpack.packb({"a": bytes(32)}),
    ],
)
def test_malformed_commits_are_transfer_errors(blob: bytes) -> None:
    with pytest.raises(TransferError):
        parse_commit(blob)


def test_a_commit_holds_a_group_of_hundreds_and_one_over_the_bound_is_refused_unread() -> None:
    # A commit is one (peer id, SHA-256) pair per contributor, whatever the model's size (a 1B stage's is as long as a
    # tiny one's): 700 members with real 52-character peer ids fit the bound.
    members = [(f"12D3KooW{i:044d}", digest(bytes([i % 256]))) for i in range(700)]
    board = Board(retention_s=60.0, clock=time.monotonic)
    board.offer(KEY, members[0][0], b"pa")
    board.commit(KEY, members)
    commit = asyncio.run(board.get(KEY.blob("commit")))
    assert len(commit) <= MAX_COMMIT_BYTES and parse_commit(commit) == members
    with pytest.raises(TransferError, match=f"over the bound of {MAX_COMMIT_BYTES} bytes"):
        parse_commit(commit + bytes(MAX_COMMIT_BYTES))  # refused before it is decoded


def test_a_leader_serving_a_commit_over_the_bound_fails_the_round_for_its_members() -> None:
    class BloatedCommits(Board):
        async def get(self, name: str) -> bytes:
            blob = await super().get(name)
            return blob + bytes(MAX_COMMIT_BYTES) if name.endswith("commit") else blob

    class LeaderWithBloatedCommits(Hub):
        def join(self, me: str) -> None:
            super().join(me)
            if me == "a":
                self.boards[me] = BloatedCommits(retention_s=60.0, clock=time.monotonic)

    results, _ = play(LeaderWithBloatedCommits(), {"a": 0.0, "b": 0.05}, expected=dict.fromkeys("ab", frozenset("ab")))
    assert results["a"].outcome == "done" and results["a"].leader == "a"
    b = results["b"]
    # the fetch itself is bounded (a BlobClient refuses the announced size before reading a byte), not only the parse
    assert b.outcome == "failed" and b.leader == "a" and f"at most {MAX_COMMIT_BYTES} are accepted" in b.reason, b


def test_the_p2p_network_bounds_a_commit_fetch_by_its_announced_size() -> None:
    async def scenario() -> None:
        leader = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        me = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await leader.get_visible_maddrs())
        try:

            async def bloated(name: str) -> bytes:
                return bytes(MAX_COMMIT_BYTES + 1)

            servicer = BlobServicer()
            servicer.provide("outer", bloated)
            await servicer.add_p2p_handlers(leader, namespace="t")
            membership = SimpleNamespace(peer_id=me.peer_id)
            net = P2PGroupNetwork(membership, BlobClient(me, namespace="t"), max_payload_bytes=1 << 20)
            peer, name = leader.peer_id.to_base58(), KEY.blob("commit")
            assert len(await net.fetch(peer, name, 10)) == MAX_COMMIT_BYTES + 1  # within a payload's bound
            with pytest.raises(TransferError, match=f"at most {MAX_COMMIT_BYTES} are accepted"):
                await net.fetch(peer, name, 10, max_bytes=MAX_COMMIT_BYTES)
        finally:
            await asyncio.gather(leader.shutdown(), me.shutdown())

    asyncio.run(scenario())


def test_a_retry_that_meets_the_commit_of_its_earlier_try_is_late_and_blames_nobody() -> None:
    # Seen in an 8M-token run: b lost a's commit in transit, tried the round again with a new payload, met a's commit
    # of its first try and took it for a lie — a second strike that banned an honest a for the rest of the run.
    hub, both = Hub(), frozenset({"a", "b"})
    for name in both:
        hub.join(name)

    class LosesTheFirstCommit(MemoryNet):
        lost = False

        async def fetch(self, peer: str, name: str, timeout: float, *, max_bytes: int | None = None) -> bytes:
            if name.endswith("commit") and not self.lost:
                self.lost = True
                raise TransferError(f"{peer} ended the stream before its header")
            return await super().fetch(peer, name, timeout, max_bytes=max_bytes)

    async def scenario() -> tuple[RoundResult, RoundResult, RoundResult]:
        clock = asyncio.get_running_loop().time
        a_ctx = RoundContext(net=MemoryNet(hub, "a"), board=hub.boards["a"], timing=TIMING, clock=clock)
        b_ctx = RoundContext(net=LosesTheFirstCommit(hub, "b"), board=hub.boards["b"], timing=TIMING, clock=clock)
        a_result, b_result = await asyncio.gather(
            allgather_round(a_ctx, KEY, b"a's payload", expected=both),
            allgather_round(b_ctx, KEY, b"b's payload", expected=both),
        )
        retry = await allgather_round(b_ctx, KEY, b"b's payload, made again", expected=both)
        return a_result, b_result, retry

    (a_result, b_result, retry), _ = in_virtual_time(scenario())
    assert a_result.outcome == "done" and a_result.contributors == ("a", "b")
    assert b_result.outcome == "failed" and "ended the stream" in b_result.reason
    assert retry.outcome == "late" and retry.leader == "a" and "earlier try" in retry.reason, retry


def test_a_leader_whose_commit_was_lost_is_acquitted_when_it_next_leads_a_round_with_this_replica() -> None:
    swarm = ReplicaGroup(sync_config(), ["a", "b"])
    a = swarm.syncs["a"]
    lost = RoundResult(outcome="failed", group=("a", "b"), leader="b", reason="no usable commit from leader b")
    done = RoundResult(outcome="done", payloads=(b"", b""), contributors=("a", "b"), group=("a", "b"), leader="b")
    for _ in range(OUTER_PEER_LIMITS.strikes - 1):  # streams lost in transit, each followed by a round b led with a
        a.accountability.strike("b", lost.reason)
        a.accountability.unproven.add("b")
        a.accountability.acquit(done, a.round, me="a")
    a.accountability.strike("b", lost.reason)
    assert not a.excluded("b"), "strikes taken back count towards no ban"
    a.accountability.unproven.add("b")
    a.accountability.acquit(
        dataclasses.replace(done, contributors=("b",)), a.round, me="a"
    )  # b's alone: no proof, no pardon
    a.accountability.strike("b", lost.reason)
    assert a.excluded("b"), "a leader that withholds its commits round after round is banned"
    for sync in swarm.syncs.values():
        sync.close()


def test_round_timing_is_validated() -> None:
    with pytest.raises(ValueError):
        RoundTiming(window_s=0, timeout_s=1)
    assert RoundTiming(window_s=5, timeout_s=10, settle_s=1).max_round_s == 36


# --- ReplicaSync: rounds, install and catch-up of whole replicas, on the same in-memory network -----------------------


def count_catch_ups(sync: ReplicaSync) -> list[float]:
    """The times of ``sync``'s looks at the stage's records (``catch_up``), appended as they happen."""
    looks: list[float] = []
    original = sync.catch_up

    async def counted() -> bool:
        looks.append(time.monotonic())
        return await original()

    sync.catch_up = counted  # type: ignore[method-assign]  # the same look, timed
    return looks


def test_replicas_stepping_at_different_paces_hold_identical_global_weights_after_every_round() -> None:
    swarm = ReplicaGroup(sync_config(), ["a", "b", "c"])

    def three_rounds_two_with_everyone() -> bool:
        return len({e.round for e in swarm.rounds()}) >= 3 and sum(e.contributors == 3 for e in swarm.rounds()) >= 6

    asyncio.run(
        swarm.run({"a": 0.03, "b": 0.05, "c": 0.08}, three_rounds_two_with_everyone, 60)
    )  # c steps ~3x slower than a
    by_round: dict[int, set[str]] = {}
    for e in swarm.rounds():
        by_round.setdefault(e.round, set()).add(e.global_hash)
    assert len(by_round) >= 3, swarm.events
    assert all(len(hashes) == 1 for hashes in by_round.values()), by_round
    assert sum(e.contributors == 3 for e in swarm.rounds()) >= 6  # most rounds had everyone


def test_noloco_replicas_swap_payloads_with_one_partner_per_round_never_the_whole_group() -> None:
    names = ["a", "b", "c", "d"]
    swarm = ReplicaGroup(sync_config("noloco"), names)

    def four_paired_rounds_each() -> bool:
        return all(sum(e.contributors == 2 for e in swarm.rounds(n)) >= 4 for n in names)

    asyncio.run(swarm.run(dict.fromkeys(names, 0.03), four_paired_rounds_each, 60))
    # the largest payload any replica served, as the hub counted it: a round that received more than one of these per
    # partner fetched more than its partners' payloads (the whole group's, say)
    payload_bytes = max(size for blob, size in swarm.hub.fetched_bytes.items() if "/payload/" in blob)
    for name in names:
        mine = swarm.rounds(name)
        assert all(e.contributors <= 3 and e.leader is None for e in mine), mine  # a pair, or a triple
        partners_met = {p for e in mine for p in e.contributor_ids if p != name}
        assert len(partners_met) >= 2, mine  # rounds pair them differently
        assert all(e.received_bytes <= payload_bytes * (e.contributors - 1) for e in mine), (payload_bytes, mine)
    assert not any(name.endswith("commit") for _, _, name in swarm.hub.fetches)
    for sync in swarm.syncs.values():
        sync.close()


def test_a_round_waits_for_every_replica_at_its_round_or_one_behind_not_only_its_last_group() -> None:
    # Two halves that once met apart ({a, b} and {c, ...}) must not each close the window on their own half again:
    # a waits for b (last group), c (this round) and d (one behind, finishing its last round); not for e, two
    # behind (it catches up by download), nor f, ahead (a catches up to it), nor the banned g.
    swarm = ReplicaGroup(sync_config(), ["a"])
    a = swarm.syncs["a"]
    a.outer.round, a.state.last_group = 5, ("a", "b")
    rounds = {"b": 5, "c": 5, "d": 4, "e": 3, "f": 6, "g": 5}
    a.state.others = {peer: StageStatus(outer_round=r, global_hash="0" * 16) for peer, r in rounds.items()}
    for _ in range(OUTER_PEER_LIMITS.strikes):
        a.accountability.strike("g", "test")
    assert a.expected() == {"b", "c", "d"}
    a.state.others, a.state.last_group = {}, ()
    assert a.expected() == set()  # alone in its stage: nobody to wait for
    a.close()


def test_after_a_round_alone_with_others_listed_the_next_due_round_waits_until_one_reaches_it() -> None:
    swarm = ReplicaGroup(sync_config(), ["a", "b"])
    a, b = swarm.syncs["a"], swarm.syncs["b"]

    async def scenario() -> None:
        for _ in range(a.horizon):
            a.holder.train()
        a.state.others = await a.live_others()  # b listed at round 0, and never comes: a's round 0 is done alone
        assert (await a.step(refresh=False)).contributors == ("a",) and a.round == 1
        assert a.waits_for_others()  # b is a round behind: a holds its due round 1 back for it
        b.outer.round = 1
        a.state.others = await a.live_others()
        assert not a.waits_for_others() and a.state.alone_until is None  # b reached round 1: the wait is over
        swarm.hub.dead.add("b")
        a.state.others = await a.live_others()
        await a.step(refresh=False)
        assert a.state.alone_until is None  # alone with nobody listed: nobody to wait for

    asyncio.run(scenario())
    a.close()
    b.close()


def test_members_that_entered_a_round_from_other_weights_converge_after_it_by_download() -> None:
    """a and b meet at round 0 from different global weights (their records said so): the same set applied to
    different starting points ends apart. That is a split to converge on (b follows a: as many holders, the smaller
    id), not b's own doing, as it would be had they entered from the same weights."""
    swarm = ReplicaGroup(sync_config(), ["a", "b"])
    a, b = swarm.syncs["a"], swarm.syncs["b"]

    async def scenario() -> None:
        with torch.no_grad():  # b holds other global weights for round 0 (a state of its own, say)
            for t in b.outer.global_params.values():
                t.add_(0.01)
        b.state.global_hash = weights_hash(b.outer.global_params)
        for sync in (a, b):
            for _ in range(sync.horizon):
                sync.holder.train()
        a.state.others, b.state.others = await a.live_others(), await b.live_others()
        results = await asyncio.gather(a.step(refresh=False), b.step(refresh=False))
        assert all(r.contributors == ("a", "b") for r in results) and a.round == b.round == 1
        assert a.global_hash != b.global_hash
        assert not await a.catch_up() and await b.catch_up()
        assert b.global_hash == a.global_hash and b.round == 1

    asyncio.run(scenario())
    a.close()
    b.close()


def test_a_replica_due_for_a_round_others_have_passed_downloads_instead_of_opening_it() -> None:
    # A stale replica that opened its own round would meet the other stale ones there, and that half of the stage
    # would go on meeting apart, one download behind. Records are read every 30 s here: only the due-round check
    # can see that a and b have moved on.
    cfg = sync_config()
    cfg = dataclasses.replace(
        cfg, timeouts=dataclasses.replace(cfg.timeouts, announce_period_s=30.0, record_ttl_s=60.0)
    )
    swarm = ReplicaGroup(cfg, ["a", "b", "c"])
    c = swarm.syncs["c"]
    checks = count_catch_ups(c)

    async def scenario() -> None:
        task = asyncio.create_task(c.run())
        try:
            while not checks:  # c's first look at the records: all at round 0, nothing to catch up
                await asyncio.sleep(0.01)
            for name in ("a", "b"):  # a and b (identical weights: one vouched claim) are two rounds on
                swarm.syncs[name].outer.round = 2
            for _ in range(cfg.outer.inner_steps):
                c.holder.train()
            while not any(isinstance(e, (StateDownload, OuterDeclared)) for e in swarm.of("c")):
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 30))
    first = swarm.of("c")[0]
    assert isinstance(first, StateDownload) and first.reason == "behind" and c.round == 2, swarm.events


def test_after_a_failed_round_a_replica_waits_for_progress_only_while_a_replica_could_make_it() -> None:
    swarm = ReplicaGroup(sync_config(), ["a", "b", "c"])
    a = swarm.syncs["a"]
    looks = count_catch_ups(a)
    a.outer.round = swarm.syncs["b"].outer.round = 1  # a's round 1 failed; c, listed at 0, cannot get past it first
    # b is at round 1 and alive, so it may yet get past it: a waits out the bound, looking again and again
    assert asyncio.run(a.await_progress(1)) is False and len(looks) > 3
    looks.clear()
    swarm.hub.dead.add("b")  # b left: nobody listed at round 1 or later, so a keeps its round after one look
    assert asyncio.run(a.await_progress(1)) is False and len(looks) == 1
    for sync in swarm.syncs.values():
        sync.close()


def test_after_a_failed_round_a_replica_waits_for_its_leader_whose_record_lags() -> None:
    swarm = ReplicaGroup(sync_config(), ["a", "b"])
    a = swarm.syncs["a"]
    looks = count_catch_ups(a)
    a.outer.round = 1  # a's round 1 failed; b, listed at round 0, cannot get past it first: one look
    assert asyncio.run(a.await_progress(1)) is False and len(looks) == 1
    looks.clear()  # but if b led that round, it has likely finished it, and its record is older than that
    assert asyncio.run(a.await_progress(1, leader="b")) is False and len(looks) > 3
    for sync in swarm.syncs.values():
        sync.close()


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
def test_a_member_left_out_of_the_set_keeps_its_own_progress_for_its_next_round(method: str) -> None:
    # c arrived after the leader's window closed: it applies the leader's set of a's and b's payloads, without its
    # own. Its global weights must be the group's; its Δ must stay in its local weights (and, for SparseLoCo, its
    # error buffer must be as before it encoded that Δ), so the next round sends it instead of dropping it.
    swarm_cfg = sync_config(method)
    swarm = ReplicaGroup(swarm_cfg, ["a", "b", "c"])
    a, b, c = (swarm.syncs[name] for name in "abc")

    async def scenario() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        for sync in (a, b, c):
            for _ in range(swarm_cfg.outer.inner_steps):
                sync.holder.train()
        snapshots = {name: await snapshot_weights(sync.holder) for name, sync in (("a", a), ("b", b), ("c", c))}
        payloads = tuple(sync.outer.make_payload(snapshots[name]) for name, sync in (("a", a), ("b", b)))
        errors_before = dict(c.outer._error.errors) if method == "sparseloco" else {}
        c.outer.make_payload(snapshots["c"])  # made and offered, but not in the leader's set
        old_global = {name: g.clone() for name, g in c.outer.global_params.items()}
        await a._install(payloads, snapshots["a"])
        await c._install(payloads, snapshots["c"], keep_own=True)
        if method == "sparseloco":
            after = c.outer._error.errors
            assert after.keys() == errors_before.keys()
            assert all(torch.equal(after[k], errors_before[k]) for k in after)
        return snapshots["c"], old_global

    snapshot, old_global = asyncio.run(scenario())
    assert c.global_hash == a.global_hash and c.round == a.round == 1  # the group's global weights
    for name, p in c.params.items():
        kept = c.outer.global_params[name] + (snapshot[name] - old_global[name])
        assert torch.allclose(p.detach(), kept, atol=1e-6), name  # its own Δ, on top of the group's step
    a.close(), b.close(), c.close()


def test_an_idle_replica_catches_up_by_state_download() -> None:
    swarm = ReplicaGroup(sync_config(), ["a", "b", "c"])

    def c_downloaded_round_2() -> bool:
        return any(e.outer_round >= 2 for e in of_kind(swarm.of("c"), StateDownload))

    asyncio.run(swarm.run({"a": 0.03, "b": 0.03}, c_downloaded_round_2, 60))  # c takes no step: it never joins a round
    downloads = of_kind(swarm.events, StateDownload)
    from_c = of_kind(swarm.of("c"), StateDownload)
    assert [e for e in from_c if e.reason == "behind"]
    # every download holds the weights some replica reached in that round (under load a and b may split a round
    # for a while, each with its own weights, before one adopts the other's: either copy is a real round's)
    hashes_at: dict[int, set[str]] = {}
    for e in swarm.rounds():
        hashes_at.setdefault(e.outer_round, set()).add(e.global_hash)
    checked = [e for e in downloads if e.outer_round in hashes_at]  # rounds with no round record yet: nothing to check
    assert [e for e in checked if e in from_c], (downloads, hashes_at)  # c's catch-ups are among those checked
    assert all(e.global_hash in hashes_at[e.outer_round] for e in checked), (checked, hashes_at)
    assert max(e.outer_round for e in from_c) >= 2


def test_groups_split_by_a_race_converge_on_the_smallest_peer_id() -> None:
    async def scenario() -> tuple[ReplicaGroup, ReplicaGroup]:
        left, right = (
            ReplicaGroup(sync_config(), ["a"]),
            ReplicaGroup(sync_config(), ["b"]),
        )  # two hubs: neither sees the other's round
        for swarm in (left, right):
            swarm.syncs[next(iter(swarm.syncs))].holder.train()
        await asyncio.gather(left.syncs["a"].step(), right.syncs["b"].step())
        return left, right

    left, right = asyncio.run(scenario())
    a, b = left.syncs["a"], right.syncs["b"]
    assert a.round == b.round == 1 and a.global_hash != b.global_hash
    both = ReplicaGroup(sync_config(), [])
    both.syncs = {"a": a, "b": b}
    for name, sync in both.syncs.items():
        sync.replicas = functools.partial(both.others, name)
        sync.fetch = both.fetch_state
    assert not asyncio.run(a.catch_up())  # a has the smallest id: it keeps its weights
    assert asyncio.run(b.catch_up()) and b.global_hash == a.global_hash and b.round == 1


class WithColluders(ReplicaGroup):
    """Replicas, and two identities x and y that announce ``lie``'s round and weights hash and serve it (once set)."""

    colluders = ("x", "y")
    lie: StageState | None = None

    async def others(self, me: str) -> dict[str, StageStatus]:
        found = await super().others(me)
        if self.lie is not None:
            claim = StageStatus(outer_round=self.lie.round, global_hash=weights_hash(self.lie.params))
            found |= dict.fromkeys(self.colluders, claim)
        return found

    async def fetch_state(self, peer: str, name: str, sink: Sink) -> str:
        if peer in self.colluders and self.lie is not None:
            return await feed(stream_state(self.lie), sink)
        return await super().fetch_state(peer, name, sink)


def garbage_like(params: dict[str, torch.Tensor], round_: int) -> StageState:
    """Random weights with the norms of ``params``, tensor by tensor: every norm check passes them."""
    weights = {n: (r := torch.randn_like(t)) * (t.norm() / r.norm()) for n, t in params.items()}
    return StageState(stage=1, round=round_, schedule_step=0, params=weights, optimizer=None)


@pytest.mark.parametrize("ahead", [10**6, 1])
def test_two_colluders_vouching_for_garbage_take_over_no_replica_and_are_struck(ahead: int) -> None:
    swarm = WithColluders(sync_config(), ["a", "b"])
    a, b = swarm.syncs["a"], swarm.syncs["b"]
    together = lambda: all(len(swarm.rounds(n)) >= 2 for n in "ab")  # noqa: E731
    asyncio.run(swarm.run({"a": 0.03, "b": 0.03}, together, 60))
    before = (a.round, a.global_hash)
    swarm.lie = garbage_like(dict(a.outer.global_params), a.round + ahead)
    swarm.hub.dead.add("b")  # b gone (its claim would vouch for a's own, and a would follow no lone claim at all)
    for _ in range(2):  # x and y vouch for each other, but took part in none of a's rounds: their word is theirs alone
        assert not asyncio.run(a.catch_up())
    assert (a.round, a.global_hash) == before and not of_kind(swarm.of("a"), StateDownload)
    strikes = of_kind(swarm.of("a"), OuterStrike)
    why = "beyond reach" if ahead > 1 else "from this replica's global ones"  # never downloaded; downloaded, refused
    assert {e.peer for e in strikes} == {"x", "y"} and all(why in e.reason for e in strikes), strikes
    assert a.excluded("x") and a.excluded("y") and not a.excluded("b")
    b.close(), a.close()


def test_two_identities_declaring_every_round_long_opened_stall_no_round_and_are_banned() -> None:
    cfg = sync_config()
    swarm = ReplicaGroup(cfg, ["a", "b"])
    sybils = ("0s1", "0s2")  # sorted first: were one the leader, its missing commit would fail the round
    skew = RoundTiming.of(cfg.timeouts).clock_skew_s

    async def stall() -> None:  # each round a and b are at, declared for at twice the skew ago (a live round's time)
        while True:
            now = asyncio.get_running_loop().time()
            for r in {s.round for s in swarm.syncs.values()}:
                swarm.hub.declared.setdefault(RoundKey(1, r), {}).update(dict.fromkeys(sybils, now - 2 * skew - 0.3))
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        staller = asyncio.create_task(stall())
        try:
            done = lambda: all(len(swarm.rounds(n)) >= 4 for n in "ab")  # noqa: E731
            await swarm.run({"a": 0.03, "b": 0.03}, done, 60)
        finally:
            staller.cancel()

    asyncio.run(scenario())
    for name in "ab":
        sync = swarm.syncs[name]
        assert all(sync.excluded(s) for s in sybils), swarm.of(name)
        assert len(swarm.rounds(name)) >= 4 and sync.counters["outer_late"] <= 1, sync.counters
        banned = {e.peer for e in of_kind(swarm.of(name), OuterStrike) if e.banned}
        assert banned == set(sybils)
        sync.close()


class PausedNet(MemoryNet):
    """A network on which a round pauses right after this replica declares: between its snapshot and its install."""

    def __init__(self, hub: Hub, me: str) -> None:
        super().__init__(hub, me)
        self.declared, self.resume = asyncio.Event(), asyncio.Event()

    async def declare(self, key: RoundKey, opened_at: float, expiration: float) -> None:
        await super().declare(key, opened_at, expiration)
        self.declared.set()
        await self.resume.wait()


def test_progress_made_during_the_exchange_survives_the_install() -> None:
    swarm = ReplicaGroup(
        sync_config(diloco_lr=1.0, diloco_momentum=0.0), ["solo"]
    )  # a group of one with lr 1: θ_global ← θ_snapshot
    sync = swarm.syncs["solo"]
    params = dict(sync.holder.module.named_parameters())

    async def scenario() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        net = PausedNet(swarm.hub, "solo")
        sync.rounds = dataclasses.replace(sync.rounds, net=net)
        sync.holder.train()
        snapshot = {n: p.detach().clone() for n, p in params.items()}
        round_ = asyncio.create_task(sync.step())
        await asyncio.wait_for(
            net.declared.wait(), timeout=10
        )  # the round has taken its snapshot and is in the exchange
        sync.holder.train()
        assert not round_.done() and sync.round == 0  # this step is inside the round: nothing is installed yet
        progress = {n: p.detach() - snapshot[n] for n, p in params.items()}
        net.resume.set()
        await round_
        return snapshot, progress

    snapshot, progress = asyncio.run(scenario())
    assert sync.round == 1 and sync.global_hash == weights_hash(
        snapshot
    )  # the step inside the round is not in the global weights
    assert all(bool(d.abs().sum() > 0) for d in progress.values())  # that step moved every weight
    for name, p in params.items():  # and the install kept it: θ = θ_global + the progress made during the exchange
        torch.testing.assert_close(p.detach(), snapshot[name] + progress[name])


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
def test_a_replica_alone_crosses_rounds_without_losing_progress(method: str) -> None:
    swarm = ReplicaGroup(sync_config(method), ["solo"])
    sync = swarm.syncs["solo"]
    params = dict(sync.holder.module.named_parameters())
    seen: list[dict[str, torch.Tensor]] = []

    async def scenario() -> None:
        for _ in range(2):
            for _ in range(3):  # H = 3
                sync.holder.train()
            seen.append({n: p.detach().clone() for n, p in params.items()})
            await sync.step()

    asyncio.run(scenario())
    assert sync.round == 2 and [e.contributors for e in swarm.rounds()] == [1, 1]
    assert sync.global_hash == weights_hash(seen[-1])  # what a newcomer downloads is the replica's own progress
    assert all(torch.equal(p.detach(), seen[-1][n]) for n, p in params.items())


def test_adopted_state_matches_its_source_but_keeps_its_own_hyper_parameters() -> None:
    nesterov = sync_config(diloco_lr=0.7, diloco_momentum=0.9)  # an outer optimizer with state to carry
    swarm = ReplicaGroup(nesterov, ["a", "c"])
    a, c = swarm.syncs["a"], swarm.syncs["c"]
    b = ReplicaGroup(nesterov, ["b"]).syncs["b"]

    async def scenario() -> StageState:
        a.holder.train()
        c.holder.train()
        await asyncio.gather(a.step(), c.step())  # a round of two: round 1, with a momentum buffer
        decoder = StateDecoder(stage=1, template=a.params)
        await feed(await swarm.serving("a").export_state("state/1"), decoder)
        state = decoder.result()
        state.optimizer["param_groups"].append({"lr": 1e9})  # a hostile sender's (the stream carries none)
        await b.adopt(state)
        return state

    state = asyncio.run(scenario())
    assert (b.round, b.global_hash) == (a.round, a.global_hash) == (1, weights_hash(state.params))
    assert all(torch.equal(p, a.outer.global_params[n]) for n, p in b.params.items())
    assert b.outer.optimizer.param_groups[0]["lr"] == 0.7
    momentum = [s["momentum_buffer"] for s in b.outer.optimizer.state.values()]
    assert momentum and all(
        torch.equal(m, n) for m, n in zip(momentum, [s["momentum_buffer"] for s in a.outer.optimizer.state.values()])
    )
    with pytest.raises(LookupError):
        asyncio.run(swarm.serving("a").export_state("state/2"))


def test_a_state_served_while_a_round_changes_it_is_cut_short() -> None:
    a = ReplicaGroup(sync_config(), ["a"]).syncs["a"]

    async def scenario() -> None:
        chunks = (await ServedState(a).export_state("state/1")).chunks
        await anext(chunks)  # the header
        await anext(chunks)  # a first chunk of values
        await a.thread.change(lambda: None)  # a round applied (or a state adopted) meanwhile
        with pytest.raises(StateChanged, match="changed while it was sent"):
            await anext(chunks)

    asyncio.run(scenario())


class LaggingRecords(ReplicaGroup):
    """Replicas whose DHT records are not their live status but ``records`` (name → status), as set: a record lags its
    replica by up to an announce period, and rounds on a busy machine come faster than that."""

    records: dict[str, StageStatus] = {}

    async def others(self, me: str) -> dict[str, StageStatus]:
        return {name: status for name, status in self.records.items() if name != me}


def noloco_replica_behind(records: dict[str, StageStatus]) -> tuple[LaggingRecords, ReplicaSync]:
    """NoLoCo replicas a, b, d: a and b (identical weights: a pair's members end on the same ones) have done round 2
    together since the round 1 that all three did, and serve round 3's state; their ``records`` may still say
    otherwise. d is at round 1."""
    swarm = LaggingRecords(sync_config("noloco"), ["a", "b", "d"])
    swarm.records = records
    a, b, d = (swarm.syncs[name] for name in "abd")
    b.outer.load_state_dict(a.outer.state_dict())
    a.outer.round = b.outer.round = 3
    d.outer.round = 1
    return swarm, d


def test_a_noloco_replica_behind_moves_to_the_others_round_where_their_records_lag_their_state() -> None:
    # CI (tests/test_swarm_outer.py, the NoLoCo pairs): a trainer late for one round tried to catch up by download;
    # the claim was vouched (a pair's members hold the same weights), so only exactly the claimed round would do, and
    # the holders, a round every second, had always done one or two more than their records said (RecordBehind). It
    # stayed behind, and the three others met as a triple round after round. NoLoCo replicas never agree: what d lacks
    # is the round, not anyone's weights.
    lagging = StageStatus(outer_round=2, global_hash="2" * 16)  # both holders' records: one round behind their state
    swarm, d = noloco_replica_behind({"a": lagging, "b": lagging})
    weights = {name: g.clone() for name, g in d.outer.global_params.items()}

    async def scenario() -> bool:
        now = asyncio.get_running_loop().time()
        d.trust.did_round(1, ("a", "b", "d"), now=now, inner_steps=0, moved=0.0, steps=0)  # round 1 with a and b
        return await d.catch_up()

    assert asyncio.run(scenario())
    assert d.round == 2 and d.counters["outer_rounds_skipped"] == 1  # the others' round, as far as their records say
    assert all(torch.equal(g, weights[name]) for name, g in d.outer.global_params.items())  # its own weights kept
    assert d.global_hash == weights_hash(weights) and not of_kind(swarm.of("d"), StateDownload)
    assert not [blob for _, _, blob in swarm.hub.fetches if blob.startswith("state/")]  # nothing downloaded
    for sync in swarm.syncs.values():
        sync.close()


def test_a_noloco_replica_moves_its_round_no_further_than_its_reach_and_with_no_history_downloads() -> None:
    far = StageStatus(outer_round=5, global_hash="5" * 16)  # 4 rounds on: beyond the reach of d's round 1 just now
    swarm, d = noloco_replica_behind({"a": far, "b": far})

    async def scenario() -> bool:
        now = asyncio.get_running_loop().time()
        d.trust.did_round(1, ("a", "b", "d"), now=now, inner_steps=0, moved=0.0, steps=0)
        return await d.catch_up()

    assert not asyncio.run(scenario()) and d.round == 1
    for sync in swarm.syncs.values():
        sync.close()
    # a replica with no round or state of its own yet (just started) downloads a claim's state, as in every stage
    swarm, d = noloco_replica_behind({})
    swarm.records = {"a": StageStatus(**swarm.syncs["a"].status_fields())}  # round 3, as a is
    assert asyncio.run(d.catch_up()) and d.round == 3 and d.global_hash == swarm.syncs["a"].global_hash
    assert [e.reason for e in of_kind(swarm.of("d"), StateDownload)] == ["behind"]
    for sync in swarm.syncs.values():
        sync.close()


def test_a_noloco_half_behind_moves_to_the_round_of_the_half_ahead_on_a_known_peers_word() -> None:
    # A late round split four NoLoCo replicas into halves (seen on loopback, a trainer paused for 3 s): a and b are two
    # rounds on, c and d, a pair (the same weights: a vouched claim of their own), behind. d met b and c in its recent
    # rounds, never a: the half ahead's claim is vouched by one peer d knows, and its own half's vouched claim kept d
    # off it. c and d waited out each late round (20 s) and went on alone, rounds behind for good.
    swarm = LaggingRecords(sync_config("noloco"), ["a", "b", "c", "d"])
    a, b, c, d = (swarm.syncs[name] for name in "abcd")
    b.outer.load_state_dict(a.outer.state_dict())
    c.outer.load_state_dict(d.outer.state_dict())
    a.outer.round = b.outer.round = 5
    c.outer.round = d.outer.round = 3
    swarm.records = {name: StageStatus(**sync.status_fields()) for name, sync in swarm.syncs.items()}

    async def scenario() -> bool:
        earlier = asyncio.get_running_loop().time() - 1.0  # d's last round with others (b, c), a second ago
        d.trust.did_round(3, ("b", "c", "d"), now=earlier, inner_steps=0, moved=0.0, steps=0)
        return await d.catch_up()

    assert asyncio.run(scenario()) and d.round == 5 and d.global_hash == c.global_hash  # a's round, its own weights
    assert not of_kind(swarm.of("d"), StateDownload)
    for sync in swarm.syncs.values():
        sync.close()


def test_a_noloco_replica_meets_at_a_known_peers_round_within_reach_never_on_a_strangers_word() -> None:
    others = {
        "known": StageStatus(outer_round=6),
        "stranger": StageStatus(outer_round=8),  # in none of its recent rounds: its word counts for nothing alone
        "far": StageStatus(outer_round=30),  # known, but beyond reach
    }
    assert round_to_meet([], others, round_=4, known={"known", "far"}, reach=10) == 6
    assert round_to_meet([], others, round_=6, known={"known", "far"}, reach=10) is None  # nobody further within reach
