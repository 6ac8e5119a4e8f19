"""The swarm over time, from one metrics snapshot per poll: series, events, the per-peer table and a health verdict.

Pure: snapshots in, JSON-ready state out. Given a ``HistoryStore`` (``peer/dashboard/store.py``), a History starts
from what the store kept and hands it every point, event and peer it learns, so a restarted dashboard goes on
where the last one stopped (a peer seen then and gone now leaves, one still there does not join again).

    >>> history = History(leave_after_s=3.0, stalled_after_s=60.0)
    >>> history.update({"12D3…": PeerMetrics(role="stage", stage=1, state="serving", step=0, version=2)}, now=time.time())
    >>> history.state(time.time())["events"]  # [{"kind": "join", "text": "joined stage 1 (serving)", …}]
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from swarm.dht.records import PeerMetrics

# A series point starts with the time it was seen: (time, step, tokens, loss) for the losses, (time, tokens/s) for
# the swarm's throughput, (time, round) for a stage's outer rounds.
Point = tuple[float, ...]
SERIES = ("loss", "val_loss", "throughput", "rounds")
THROUGHPUT_KEY = ""  # the throughput series is the swarm's: one key
Verdict = Literal["green", "yellow", "red"]


@dataclass(frozen=True)
class Event:
    """A change the dashboard saw between two polls of the records (not a peer's logged ``swarm.events.Event``)."""

    time: float
    kind: str  # join | leave | move | state | recovery | ban
    peer: str
    text: str


@dataclass
class PeerView:
    metrics: PeerMetrics
    first_seen: float
    last_seen: float
    progressed_at: float | None = None  # the last poll at which its step or tokens went up
    address: str | None = None  # a multiaddr the dashboard's node reached it at, if it did
    # (time, bytes sent, bytes received) of the last polls
    traffic: deque[tuple[float, dict[str, int], dict[str, int]]] = field(default_factory=deque)


@dataclass(frozen=True)
class Health:
    verdict: Verdict
    reason: str


@dataclass
class Saved:
    """What a HistoryStore kept: a History's starting point."""

    peers: dict[str, PeerView] = field(default_factory=dict)
    series: dict[str, dict[str, list[Point]]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    event_counts: Counter[str] = field(default_factory=Counter)
    labels: dict[str, str] = field(default_factory=dict)


class Store(Protocol):
    """Where a History keeps what it learns, to start from it after a restart (``store.py``'s HistoryStore)."""

    def load(self, *, max_points: int, max_events: int) -> Saved: ...
    def add_point(self, series: str, key: str, point: Point) -> None: ...
    def add_event(self, event: Event) -> None: ...
    def save_peer(self, peer: str, view: PeerView) -> None: ...
    def forget_peer(self, peer: str) -> None: ...
    def commit(self) -> None: ...


def _where(metrics: PeerMetrics) -> str:
    return {"trainer": "as a trainer", "full": "as a full peer"}.get(metrics.role, f"stage {metrics.stage}")


def _rates(start: dict[str, int], end: dict[str, int], seconds: float) -> dict[str, float]:
    """Bytes/s by kind ({} over no time); a counter that went back (the peer restarted) counts from zero."""
    if seconds <= 0:
        return {}
    return {
        kind: (count - start.get(kind, 0) if count >= start.get(kind, 0) else count) / seconds
        for kind, count in end.items()
    }


def _progressed(old: PeerMetrics, new: PeerMetrics) -> bool:
    return new.step > old.step or new.tokens > old.tokens


class History:
    """The swarm over time; safe to read from the HTTP threads while the poller updates it."""

    def __init__(
        self,
        *,
        leave_after_s: float,
        stalled_after_s: float,
        num_stages: int | None = None,
        max_points: int = 2000,
        max_events: int = 500,
        rate_polls: int = 10,
        store: Store | None = None,
    ) -> None:
        self.leave_after_s = leave_after_s  # absent from the snapshots this long: the peer left
        self.stalled_after_s = stalled_after_s  # no trainer advanced this long: training stalled
        self.num_stages = num_stages  # middle stages, to tell an unserved one (None: unknown)
        self._max_points, self._rate_polls, self._store = max_points, rate_polls, store
        saved = store.load(max_points=max_points, max_events=max_events) if store else Saved()
        self.peers = saved.peers
        for view in self.peers.values():
            view.traffic = deque(view.traffic, maxlen=rate_polls)
        self.series: dict[str, dict[str, deque[Point]]] = {
            name: {key: deque(points, maxlen=max_points) for key, points in saved.series.get(name, {}).items()}
            for name in SERIES
        }
        self.events: deque[Event] = deque(saved.events, maxlen=max_events)
        self.event_counts = saved.event_counts
        self.labels = saved.labels  # peer id → its --name, kept for the curves of peers that left
        self._lock = threading.Lock()

    def update(self, snapshot: Mapping[str, PeerMetrics], now: float, addresses: Mapping[str, str] = {}) -> None:
        """Take a snapshot {peer id: its latest record}: series grow, changes become events.
        ``addresses``: {peer id: a multiaddr} of the peers the dashboard's node is connected to."""
        with self._lock:
            for peer, metrics in snapshot.items():
                self._observe(peer, metrics, now, addresses.get(peer))
            for peer, view in list(self.peers.items()):
                if peer not in snapshot and now - view.last_seen > self.leave_after_s:
                    del self.peers[peer]
                    self._event(now, "leave", peer, f"left {_where(view.metrics)}")
                    if self._store:
                        self._store.forget_peer(peer)
            trainers = [view.metrics.tokens_per_s for view in self.peers.values() if view.metrics.role == "trainer"]
            self._append("throughput", THROUGHPUT_KEY, (now, sum(trainers)))
            if self._store:
                self._store.commit()

    def _observe(self, peer: str, metrics: PeerMetrics, now: float, address: str | None) -> None:
        view = self.peers.get(peer)
        if view is None:
            view = self.peers[peer] = PeerView(
                metrics, first_seen=now, last_seen=now, traffic=deque(maxlen=self._rate_polls)
            )
            self._event(now, "join", peer, f"joined {_where(metrics)} ({metrics.state})")
        else:
            self._changes(peer, view.metrics, metrics, now)
            if _progressed(view.metrics, metrics):
                view.progressed_at = now
            view.metrics, view.last_seen = metrics, now
        view.address = address or view.address
        view.traffic.append((now, metrics.bytes_sent, metrics.bytes_received))
        if metrics.name and self.labels.get(peer) != metrics.name:
            self.labels[peer] = metrics.name
        if self._store:
            self._store.save_peer(peer, view)
        rounds = self.series["rounds"].get(str(metrics.stage))
        if rounds is None or metrics.outer_round > rounds[-1][1]:
            self._append("rounds", str(metrics.stage), (now, metrics.outer_round))
        for name in ("train_loss", "val_loss"):
            value = getattr(metrics, name)
            points = self.series[name.removeprefix("train_")].get(peer)
            # a record repeats its loss until the trainer logs again
            if value is not None and (not points or points[-1][3] != value):
                self._append(name.removeprefix("train_"), peer, (now, metrics.step, metrics.tokens, value))

    def _changes(self, peer: str, old: PeerMetrics, new: PeerMetrics, now: float) -> None:
        if new.stage != old.stage:
            self._event(now, "move", peer, f"moved from stage {old.stage} to stage {new.stage}")
        if new.state != old.state:
            self._event(now, "state", peer, f"{old.state} → {new.state}")
        if new.recoveries > old.recoveries:
            self._event(now, "recovery", peer, f"rebuilt stage {new.stage} from its neighbours")
        if new.bans > old.bans:
            banned = new.bans - old.bans
            self._event(now, "ban", peer, f"banned {banned} peer{'s' * (banned > 1)} ({new.bans} banned now)")

    def _append(self, series: str, key: str, point: Point) -> None:
        self.series[series].setdefault(key, deque(maxlen=self._max_points)).append(point)
        if self._store:
            self._store.add_point(series, key, point)

    def _event(self, now: float, kind: str, peer: str, text: str) -> None:
        event = Event(now, kind, peer, text)
        self.events.append(event)
        self.event_counts[kind] += 1
        if self._store:
            self._store.add_event(event)

    def health(self, now: float) -> Health:
        """Green only while training progresses: a trainer's step or tokens went up in the last ``stalled_after_s``."""
        views = list(self.peers.values())
        trainers = [view for view in views if view.metrics.role == "trainer"]
        if not views:
            return Health("red", "no peers: no metrics record found (is the swarm running, is --swarm its name?)")
        if not trainers:
            return Health("red", f"no trainer: nothing trains ({len(views)} stage server(s) wait)")
        advancing = [
            v for v in trainers if v.progressed_at is not None and now - v.progressed_at <= self.stalled_after_s
        ]
        if not advancing:
            if any(view.metrics.state == "joining" for view in trainers):
                return Health("yellow", "trainers are joining: no step yet")
            if all(now - view.first_seen < self.stalled_after_s for view in trainers):
                return Health("yellow", "waiting to see a trainer's step advance")
            return Health(
                "red", f"training stalled: no trainer's step advanced in the last {self.stalled_after_s:.0f} s"
            )
        served = {view.metrics.stage for view in views if view.metrics.role == "stage"}
        unserved = [stage for stage in range(1, (self.num_stages or 0) + 1) if stage not in served]
        if unserved:
            return Health("yellow", f"stage {', '.join(map(str, unserved))} has no server: trainers' paths skip it")
        if len(advancing) < len(trainers):
            return Health("yellow", f"{len(trainers) - len(advancing)} of {len(trainers)} trainers stalled")
        if recovering := [view for view in views if view.metrics.state == "recovering"]:
            return Health("yellow", f"{len(recovering)} peer(s) recovering a stage")
        tokens_per_s = sum(view.metrics.tokens_per_s for view in trainers)
        return Health("green", f"training: {len(trainers)} trainer(s) advancing, {tokens_per_s:.0f} tokens/s")

    def state(self, now: float) -> dict[str, Any]:
        """Everything the page draws, as JSON-ready data."""
        with self._lock:
            peers = sorted(self.peers.items(), key=lambda item: (item[1].metrics.stage, item[1].metrics.role, item[0]))
            return {
                "now": now,
                "health": asdict(self.health(now)),
                "peers": [self._peer_state(peer, view, now) for peer, view in peers],
                **{
                    name: {key: list(points) for key, points in sorted(self.series[name].items())}
                    for name in ("loss", "val_loss", "rounds")
                },
                "throughput": list(self.series["throughput"].get(THROUGHPUT_KEY, ())),
                "labels": dict(self.labels),
                "events": [asdict(event) for event in self.events],
                "event_counts": dict(self.event_counts),
            }

    @staticmethod
    def _peer_state(peer: str, view: PeerView, now: float) -> dict[str, Any]:
        (start, sent0, received0), (end, sent, received) = view.traffic[0], view.traffic[-1]  # over the last polls
        return {
            "id": peer,
            **view.metrics.dict(),
            "rate_sent": _rates(sent0, sent, end - start),
            "rate_received": _rates(received0, received, end - start),
            "first_seen": view.first_seen,
            "last_seen": view.last_seen,
            "progressed_at": view.progressed_at,
            "address": view.address,
        }
