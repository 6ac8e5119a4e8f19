"""The dashboard's memory across restarts: a History's series, events and live peers in one SQLite file.

``History`` hands its store each point, event and peer as it learns them and commits once per poll; a new
History loads the last ``max_points`` of each series (older ones are dropped from the file then, so it stays
about that size), the last events, the event totals and the peers that were live.

    >>> store = HistoryStore.open(Path("swarmloco-dashboard-swarmloco-1a2b3c4d5e6f7a8b.sqlite"), swarm_id="swarmloco-1a2b3c4d5e6f7a8b")
    >>> history = History(leave_after_s=3.0, stalled_after_s=60.0, store=store)  # where the last dashboard stopped
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter, deque
from pathlib import Path

import pydantic.v1 as pydantic

from peer.dashboard import DashboardError
from peer.dashboard.history import Event, PeerView, Point, Saved
from swarm.dht.records import PeerMetrics

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS points (series TEXT NOT NULL, key TEXT NOT NULL, point TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS points_by_series ON points (series, key);
CREATE TABLE IF NOT EXISTS events (time REAL NOT NULL, kind TEXT NOT NULL, peer TEXT NOT NULL, text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS event_counts (kind TEXT PRIMARY KEY, n INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS peers (peer TEXT PRIMARY KEY, view TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS labels (peer TEXT PRIMARY KEY, name TEXT NOT NULL);
"""


class HistoryError(DashboardError):
    """The history file cannot be used: not a dashboard's, another swarm's, or unreadable."""


class HistoryStore:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    @classmethod
    def open(cls, path: Path, *, swarm_id: str) -> HistoryStore:
        """The history at ``path`` (created if missing); a file of another swarm is a HistoryError."""
        try:
            db = sqlite3.connect(path)
            db.executescript(SCHEMA)
            db.execute("INSERT OR IGNORE INTO meta VALUES ('swarm_id', ?)", (swarm_id,))
            [(kept,)] = db.execute("SELECT value FROM meta WHERE key = 'swarm_id'").fetchall()
            db.commit()
        except sqlite3.Error as e:
            raise HistoryError(f"--history {path}: not a usable SQLite file ({e})") from None
        if kept != swarm_id:
            db.close()
            raise HistoryError(
                f"--history {path} holds the history of swarm {kept}, not of {swarm_id}: pass another file"
            )
        return cls(db)

    def load(self, *, max_points: int, max_events: int) -> Saved:
        """What the file holds, each series cut to its last ``max_points`` (the file too)."""
        saved = Saved()
        for series, key in self.db.execute("SELECT DISTINCT series, key FROM points").fetchall():
            rows = self.db.execute(
                "SELECT rowid, point FROM points WHERE series = ? AND key = ? ORDER BY rowid DESC LIMIT ?",
                (series, key, max_points),
            ).fetchall()
            self.db.execute("DELETE FROM points WHERE series = ? AND key = ? AND rowid < ?", (series, key, rows[-1][0]))
            saved.series.setdefault(series, {})[key] = [tuple(json.loads(point)) for _, point in reversed(rows)]
        events = self.db.execute(
            "SELECT rowid, time, kind, peer, text FROM events ORDER BY rowid DESC LIMIT ?", (max_events,)
        ).fetchall()
        saved.events = [Event(*row[1:]) for row in reversed(events)]
        if events:
            self.db.execute("DELETE FROM events WHERE rowid < ?", (events[-1][0],))
        saved.event_counts = Counter(dict(self.db.execute("SELECT kind, n FROM event_counts")))
        saved.labels = dict(self.db.execute("SELECT peer, name FROM labels"))
        for peer, view in self.db.execute("SELECT peer, view FROM peers").fetchall():
            if (loaded := _view(json.loads(view))) is not None:
                saved.peers[peer] = loaded
        self.db.commit()
        return saved

    def add_point(self, series: str, key: str, point: Point) -> None:
        self.db.execute("INSERT INTO points VALUES (?, ?, ?)", (series, key, json.dumps(point)))

    def add_event(self, event: Event) -> None:
        self.db.execute("INSERT INTO events VALUES (?, ?, ?, ?)", (event.time, event.kind, event.peer, event.text))
        self.db.execute(
            "INSERT INTO event_counts VALUES (?, 1) ON CONFLICT (kind) DO UPDATE SET n = n + 1", (event.kind,)
        )

    def save_peer(self, peer: str, view: PeerView) -> None:
        fields = {
            "metrics": view.metrics.dict(),
            "first_seen": view.first_seen,
            "last_seen": view.last_seen,
            "progressed_at": view.progressed_at,
            "address": view.address,
        }
        self.db.execute("INSERT OR REPLACE INTO peers VALUES (?, ?)", (peer, json.dumps(fields)))
        if view.metrics.name:
            self.db.execute("INSERT OR REPLACE INTO labels VALUES (?, ?)", (peer, view.metrics.name))

    def forget_peer(self, peer: str) -> None:
        self.db.execute("DELETE FROM peers WHERE peer = ?", (peer,))

    def commit(self) -> None:
        self.db.commit()

    def close(self) -> None:
        self.db.close()


def _view(fields: dict) -> PeerView | None:
    """A saved live peer; None if its record no longer parses (a file written by another release)."""
    try:
        metrics = PeerMetrics.parse_obj(fields["metrics"])
    except (pydantic.ValidationError, KeyError, TypeError):
        return None
    traffic = deque([(fields["last_seen"], metrics.bytes_sent, metrics.bytes_received)])
    return PeerView(
        metrics,
        first_seen=fields["first_seen"],
        last_seen=fields["last_seen"],
        progressed_at=fields.get("progressed_at"),
        address=fields.get("address"),
        traffic=traffic,
    )
