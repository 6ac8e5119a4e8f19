"""Routing: which middle stages a microbatch visits, and which replica serves each hop (pure code).

``Router.draw_path`` draws a SkipPipe path (skips, adjacent swaps) and ``Router.choose`` picks a replica per hop
by SWARM's interleaved weighted round-robin (one ``StageBalancer`` per stage) over measured throughput; time
and randomness are injected. More: docs/architecture.md, pipeline/.

    >>> peer = router.choose(router.draw_path(PathConfig(skip_ratio=0.25, max_swaps=1))[0], task_size=16)
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import time
from collections.abc import Callable, Container, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from swarm.config import PathConfig
from swarm.dht.records import StageStatus, serving

Peer = Hashable  # a libp2p PeerID in the swarm; any hashable, orderable id in tests

EMA_ALPHA = 0.1  # weight of the newest throughput measurement
BAN_S = 15.0  # first ban after a failure; doubles on each further failure until a success
DEFAULT_SAMPLES_PER_SEC = 1.0  # prior while no replica of the stage is measured; only ratios matter


def path_length(num_stages: int, cfg: PathConfig) -> int:
    """Number of middle stages a sampled path visits: round((1 − r)·S), at least 1 (Python's round)."""
    if num_stages < 1:
        raise ValueError(f"need at least one middle stage, got num_stages={num_stages}")
    return max(1, round((1.0 - cfg.skip_ratio) * num_stages))


def sample_path(num_stages: int, cfg: PathConfig, rng: random.Random) -> list[int]:
    """A fresh order of middle stages: a uniform subset of 1..S, sorted, then disjoint adjacent swaps.

    >>> sample_path(4, PathConfig(), random.Random(0))
    [1, 2, 3, 4]
    """
    path = sorted(rng.sample(range(1, num_stages + 1), path_length(num_stages, cfg)))
    free = list(range(len(path) - 1))  # positions i whose pair (path[i], path[i+1]) may still swap
    for _ in range(cfg.max_swaps):
        if free and rng.random() < cfg.swap_prob:
            i = rng.choice(free)
            path[i], path[i + 1] = path[i + 1], path[i]
            free = [j for j in free if abs(j - i) > 1]  # disjoint: each stage moves at most one place
    return path


def is_valid_path(path: Sequence[int], num_stages: int, cfg: PathConfig) -> bool:
    """Whether ``path`` is a sampled path with possibly some stages dropped.

    Trainers drop stages that have no live replica, so shorter paths are valid: distinct stages in
    1..S, at most ``path_length`` of them, in increasing order except for at most ``max_swaps``
    disjoint adjacent transpositions.
    """
    path = list(path)
    if len(set(path)) != len(path) or len(path) > path_length(num_stages, cfg):
        return False
    if not all(1 <= stage <= num_stages for stage in path):
        return False
    order, i, swaps = sorted(path), 0, 0
    while i < len(path):
        if path[i] == order[i]:
            i += 1
        elif path[i : i + 2] == order[i : i + 2][::-1]:
            swaps, i = swaps + 1, i + 2
        else:
            return False
    return swaps <= cfg.max_swaps


class NoLiveReplica(RuntimeError):
    """Every known replica of a stage is banned or excluded, or none is known."""


@dataclass
class _Replica:
    # ln(samples/s): a running mean (with the stage's median rate as one prior sample), an EMA after 1/EMA_ALPHA samples.
    # A replica is re-measured only when picked: one slow early call, counted in full, would price it out of picks
    # (and so out of being re-measured) for a long time, and in log space a call 20× slower than usual moves an
    # established estimate by 20^0.1 ≈ 1.35×, not 3×.
    log_rate: float = 0.0
    samples: int = 0  # measurements in log_rate, the prior included; 0: not measured yet
    backlog_s: float = 0.0  # its announced queue, in expected seconds: part of its heap key until the next announce
    warmed_up: bool = False  # its first success timed the dial and first allocations, not its throughput
    failures: int = 0  # consecutive failures; the next ban lasts BAN_S · 2^(failures − 1)
    banned_until: float | None = None
    last_error: str | None = None  # what its last failed or timed-out call said: why a trainer may be without it

    @property
    def samples_per_sec(self) -> float | None:
        return math.exp(self.log_rate) if self.samples else None


class StageBalancer:
    """SWARM's interleaved weighted round-robin over the replicas of one stage.

    The heap holds (accumulated expected seconds, random tie-break, peer) for every replica not
    banned. ``choose`` takes the minimum and charges it ``task_size / samples_per_sec``, so over
    many picks each replica gets work in proportion to its throughput. A replica that is new or
    back from a ban enters at the heap's minimum, so it is tried (and measured) soon. Reports about
    peers no longer known are ignored: the DHT may drop a peer while its RPC is in flight.

        >>> balancer = StageBalancer(random.Random(0))
        >>> balancer.update_peers(["a", "b"])
        >>> peer = balancer.choose(task_size=16)
        >>> balancer.report_success(peer, samples=16, seconds=0.5)
    """

    def __init__(self, rng: random.Random, clock: Callable[[], float] = time.monotonic) -> None:
        self._rng, self._clock = rng, clock
        self._replicas: dict[Peer, _Replica] = {}
        self._heap: list[tuple[float, float, Peer]] = []  # exactly the replicas not banned

    def update_peers(self, peers: Iterable[Peer]) -> None:
        """Sync with the peers the DHT lists for this stage: forget the missing, add the new."""
        listed = dict.fromkeys(peers)  # ordered, so runs are reproducible under a seeded rng
        for gone in [peer for peer in self._replicas if peer not in listed]:
            del self._replicas[gone]
        self._heap = [entry for entry in self._heap if entry[2] in listed]
        heapq.heapify(self._heap)
        for peer in listed:
            if peer not in self._replicas:
                self._replicas[peer] = _Replica()
                self._enter(peer)

    def update_queues(self, queues: Mapping[Peer, int], task_size: float) -> None:
        """The replicas' announced queues (requests waiting or running, from every trainer, as in SWARM's load
        balancing): each queued request of ``task_size`` samples adds its expected seconds to the replica's key until
        the next announce replaces it, so a replica busy with other trainers' work gets less of this one's."""
        for i, (load, tie, peer) in enumerate(self._heap):
            replica = self._replicas[peer]
            backlog = queues.get(peer, 0) * task_size / self.samples_per_sec(peer)
            self._heap[i], replica.backlog_s = (load - replica.backlog_s + backlog, tie, peer), backlog
        heapq.heapify(self._heap)

    def choose(self, task_size: float = 1.0, exclude: Container[Peer] = ()) -> Peer:
        """The replica to serve the next ``task_size`` samples; raises ``NoLiveReplica`` if none can."""
        self._readmit_expired()
        skipped = []  # excluded entries keep their place: they are pushed back unchanged
        while self._heap and self._heap[0][2] in exclude:
            skipped.append(heapq.heappop(self._heap))
        try:
            if not self._heap:
                raise NoLiveReplica(self._why_none(exclude))
            load, _, peer = self._heap[0]
            heapq.heapreplace(self._heap, (load + task_size / self.samples_per_sec(peer), self._rng.random(), peer))
            return peer
        finally:
            for entry in skipped:
                heapq.heappush(self._heap, entry)

    def _why_none(self, exclude: Container[Peer]) -> str:
        """Why no replica can be chosen: each known one, tried for this call or banned, with the last error it gave."""
        now, reasons = self._clock(), []
        for peer, replica in self._replicas.items():
            state = (
                f"banned {replica.banned_until - now:.0f} s more"
                if replica.banned_until is not None
                else "tried for this call"
                if peer in exclude
                else "available"
            )
            reasons.append(f"{peer}: {state}, last error: {replica.last_error or 'none'}")
        unavailable = sum(1 for peer, r in self._replicas.items() if peer in exclude or r.banned_until is not None)
        listed = "; ".join(reasons)
        return f"no live replica among {len(self._replicas)} known ({unavailable} excluded)" + (
            f": {listed}" if listed else ""
        )

    def samples_per_sec(self, peer: Peer) -> float:
        """Measured throughput, or the median of the measured replicas (a default if none is)."""
        measured = self._replicas[peer].samples_per_sec
        if measured is not None:
            return measured
        return self._median_rate(excluding=peer) or DEFAULT_SAMPLES_PER_SEC

    def _median_rate(self, excluding: Peer) -> float | None:
        known = [r.samples_per_sec for p, r in self._replicas.items() if p != excluding and r.samples_per_sec]
        return statistics.median(known) if known else None

    def live_peers(self) -> list[Peer]:
        """Known replicas that are not banned now."""
        self._readmit_expired()
        return [entry[2] for entry in self._heap]

    def report_success(self, peer: Peer, samples: float, seconds: float) -> None:
        """``samples`` were served in ``seconds``, timed over the whole RPC so the network counts; a replica's
        first success is its warm-up (connection, first allocations) and does not count towards its throughput."""
        if (replica := self._replicas.get(peer)) is None:
            return
        replica.failures = 0
        if not replica.warmed_up:
            replica.warmed_up = True
            return
        if not replica.samples and (prior := self._median_rate(excluding=peer)) is not None:
            replica.log_rate, replica.samples = math.log(prior), 1
        elif not replica.samples:
            # the stage's first measurement: the loads so far were charged at the guessed DEFAULT_SAMPLES_PER_SEC,
            # in other units than every charge from now on; whoever was picked early would carry them for good
            self._heap = [(0.0, tie, listed) for _, tie, listed in self._heap]
            heapq.heapify(self._heap)
            for other in self._replicas.values():
                other.backlog_s = 0.0  # backlogs were priced at that guess too, and left the keys with the loads
        weight = max(EMA_ALPHA, 1.0 / (replica.samples + 1))
        replica.log_rate += weight * (math.log(max(samples, 1e-9) / max(seconds, 1e-9)) - replica.log_rate)
        replica.samples += 1

    def report_timeout(self, peer: Peer, seconds: float, reason: str | None = None) -> None:
        """The peer did not answer within ``seconds`` (or answered ``reason``, a refusal that is no fault of its own):
        charge it that time, as if it had been busy."""
        if (replica := self._replicas.get(peer)) is not None:
            replica.last_error = reason or f"no reply within {seconds:.1f} s"
        for i, (load, tie, listed) in enumerate(self._heap):
            if listed == peer:
                self._heap[i] = (load + seconds, tie, peer)
                heapq.heapify(self._heap)
                return

    def report_failure(self, peer: Peer, reason: str) -> None:
        """Ban the peer for 15 s, doubling per consecutive failure (a success resets the count); ``reason``: the error,
        named when no replica is left (``NoLiveReplica``)."""
        self._readmit_expired()
        replica = self._replicas.get(peer)
        if replica is not None:
            replica.last_error = reason
        if replica is None or replica.banned_until is not None:
            return  # already banned: this failure comes from an RPC sent before the ban
        replica.failures += 1
        self._ban(peer, replica, BAN_S * 2 ** (replica.failures - 1))

    def ban(self, peer: Peer, seconds: float, reason: str) -> None:
        """Ban the peer for ``seconds`` from now (longer than a ban it has: the longer one stands), whatever its
        failures: a verdict on its work (``swarm/pipeline/checking.py``), not a call that failed."""
        self._readmit_expired()
        if (replica := self._replicas.get(peer)) is not None:
            replica.last_error = reason
            self._ban(peer, replica, seconds)

    def _ban(self, peer: Peer, replica: _Replica, seconds: float) -> None:
        replica.banned_until = max(replica.banned_until or 0.0, self._clock() + seconds)
        self._heap = [entry for entry in self._heap if entry[2] != peer]
        heapq.heapify(self._heap)

    def _enter(self, peer: Peer) -> None:
        self._replicas[peer].backlog_s = 0.0  # its key holds no backlog until the next announce
        load = self._heap[0][0] if self._heap else 0.0
        heapq.heappush(self._heap, (load, self._rng.random(), peer))

    def _readmit_expired(self) -> None:
        now = self._clock()
        for peer, replica in self._replicas.items():
            if replica.banned_until is not None and replica.banned_until <= now:
                replica.banned_until = None
                self._enter(peer)


class Router:
    """The trainer's routing state: one ``StageBalancer`` per middle stage 1..S.

    >>> router = Router(num_stages=2, rng=random.Random(0))
    >>> router.update(1, ["a"]); router.update(2, ["b"])
    >>> [router.choose(stage) for stage in router.draw_path(PathConfig())]
    ['a', 'b']
    """

    def __init__(self, num_stages: int, rng: random.Random, clock: Callable[[], float] = time.monotonic) -> None:
        self._rng = rng
        self.balancers = {stage: StageBalancer(rng, clock) for stage in range(1, num_stages + 1)}
        self._outer_rounds: dict[Peer, int] = {}  # each replica's outer round, as its last record read announced it

    def update(
        self, stage: int, peers: Iterable[Peer], *, queues: Mapping[Peer, int] | None = None, task_size: float = 1.0
    ) -> None:
        """The replicas of ``stage`` the DHT lists, and optionally their announced queue lengths."""
        self.balancers[stage].update_peers(peers)
        if queues is not None:
            self.balancers[stage].update_queues(queues, task_size)

    def update_records(self, stage: int, records: Mapping[Peer, StageStatus], *, task_size: float = 1.0) -> None:
        """The replicas of ``stage`` as their DHT records announce them, with their queues; a record that takes no
        pipeline traffic (a full peer's: it holds the stage only for the outer step) is left out."""
        served = serving(records)
        self._outer_rounds.update({peer: status.outer_round for peer, status in served.items()})
        self.update(
            stage, list(served), queues={peer: status.queue for peer, status in served.items()}, task_size=task_size
        )

    def outer_round(self, peer: Hashable) -> int | None:
        """``peer``'s outer round as its record last announced it (None: never read from a record)."""
        return self._outer_rounds.get(peer)

    def choose(self, stage: int, task_size: float = 1.0, exclude: Container[Peer] = ()) -> Peer:
        """A replica of ``stage``; ``exclude`` holds the replicas already tried for this hop."""
        return self.balancers[stage].choose(task_size, exclude)

    def report_success(self, stage: int, peer: Peer, samples: float, seconds: float) -> None:
        self.balancers[stage].report_success(peer, samples, seconds)

    def report_timeout(self, stage: int, peer: Peer, seconds: float, reason: str | None = None) -> None:
        self.balancers[stage].report_timeout(peer, seconds, reason)

    def report_failure(self, stage: int, peer: Peer, reason: str) -> None:
        self.balancers[stage].report_failure(peer, reason)

    def ban(self, stage: int, peer: Peer, seconds: float, reason: str) -> None:
        self.balancers[stage].ban(peer, seconds, reason)

    def live_peers(self, stage: int) -> list[Peer]:
        """The replicas of ``stage`` not banned now (asked without choosing one: a choice charges its load)."""
        return self.balancers[stage].live_peers()

    def live_stages(self) -> list[int]:
        """Middle stages with at least one replica that is not banned."""
        return [stage for stage, balancer in self.balancers.items() if balancer.live_peers()]

    def draw_path(self, cfg: PathConfig) -> list[int]:
        """A fresh path without the stages that have no live replica (skipped while recovery runs)."""
        live = set(self.live_stages())
        return [stage for stage in sample_path(len(self.balancers), cfg, self._rng) if stage in live]
