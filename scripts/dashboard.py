"""Live web dashboard of a swarm: joins its DHT as a client, reads every peer's metrics record, serves a page.

    python scripts/dashboard.py --initial-peers /ip4/127.0.0.1/tcp/4100/p2p/12D3… [--port 8080]
    python scripts/dashboard.py --initial-peers … --identity me.id --credentials me.cert  # a private swarm (as `swarmloco run`)

Open http://127.0.0.1:8080/ for the loss and tokens/s over time, the pipeline map (stages × peers
and their state), bandwidth per peer by kind, outer rounds and an event log (joins, leaves, moves
between stages, recoveries, bans). The page polls ``/api/state``, which serves the same as JSON;
``/metrics`` serves it in Prometheus' text format. Events are derived from what changes between
two snapshots, so the dashboard sees what happens from the moment it starts.

Pure parts first (``History``: snapshots in, series and events out; ``prometheus_text``), then
the HTTP server, the DHT poller and the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import typer
from hivemind.p2p import PeerID

from peer.cli_common import swarm_credentials, swarm_name
from peer.credentials import PeerCredentials
from swarm.config import SwarmConfig, load_config
from swarm.dht.membership import MembershipError
from swarm.dht.records import PeerMetrics
from swarm.dht.start import JoinError, watch_swarm
from swarm.errors import ConfigError
from swarm.model.stages import split_layers
from swarm.rpc.auth import AccessDenied, CredentialError

logger = logging.getLogger("dashboard")
STATIC = Path(__file__).resolve().parent / "dashboard_static"
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Point = tuple[float, int, float]  # (unix time seen, inner step, value)


@dataclass(frozen=True)
class Event:
    time: float
    kind: str  # join | leave | move | state | recovery | ban
    peer: str
    text: str


@dataclass
class PeerView:
    metrics: PeerMetrics
    first_seen: float
    last_seen: float
    traffic: deque[tuple[float, dict[str, int], dict[str, int]]]  # (time, bytes sent, bytes received) of the last polls


def _where(metrics: PeerMetrics) -> str:
    return "as a trainer" if metrics.role == "trainer" else f"stage {metrics.stage}"


def _rates(start: dict[str, int], end: dict[str, int], seconds: float) -> dict[str, float]:
    """Bytes/s by kind ({} over no time); a counter that went back (the peer restarted) counts from zero."""
    if seconds <= 0:
        return {}
    return {
        kind: (count - start.get(kind, 0) if count >= start.get(kind, 0) else count) / seconds
        for kind, count in end.items()
    }


class History:
    """The swarm over time, from one metrics snapshot per poll; safe to read from the HTTP threads.

    >>> history = History(leave_after_s=3.0)
    >>> history.update({"12D3…": PeerMetrics(role="stage", stage=1, state="serving", step=0, version=1)}, now=time.time())
    >>> history.state(time.time())["events"]  # [{"kind": "join", "text": "joined stage 1 (serving)", …}]
    """

    def __init__(
        self, *, leave_after_s: float, max_points: int = 2000, max_events: int = 500, rate_polls: int = 10
    ) -> None:
        self.leave_after_s = leave_after_s  # absent from the snapshots this long: the peer left
        self.peers: dict[str, PeerView] = {}
        self.loss: dict[str, deque[Point]] = {}  # per trainer, a point whenever its published loss changes
        self.val_loss: dict[str, deque[Point]] = {}
        self.throughput: deque[tuple[float, float]] = deque(maxlen=max_points)  # (time, tokens/s of all trainers)
        self.rounds: dict[
            int, deque[tuple[float, int]]
        ] = {}  # stage → (time, round) whenever a replica first reports a higher round
        self.events: deque[Event] = deque(maxlen=max_events)
        self.event_counts: Counter[str] = Counter()
        self._max_points, self._rate_polls = max_points, rate_polls
        self._lock = threading.Lock()

    def update(self, snapshot: Mapping[str, PeerMetrics], now: float) -> None:
        """Take a snapshot {peer id: its latest record}: series grow, changes become events."""
        with self._lock:
            for peer, metrics in snapshot.items():
                self._observe(peer, metrics, now)
            for peer, view in list(self.peers.items()):
                if peer not in snapshot and now - view.last_seen > self.leave_after_s:
                    del self.peers[peer]
                    self._event(now, "leave", peer, f"left {_where(view.metrics)}")
            trainers = [view.metrics.tokens_per_s for view in self.peers.values() if view.metrics.role == "trainer"]
            self.throughput.append((now, sum(trainers)))

    def _observe(self, peer: str, metrics: PeerMetrics, now: float) -> None:
        view = self.peers.get(peer)
        if view is None:
            view = self.peers[peer] = PeerView(
                metrics, first_seen=now, last_seen=now, traffic=deque(maxlen=self._rate_polls)
            )
            self._event(now, "join", peer, f"joined {_where(metrics)} ({metrics.state})")
        else:
            old = view.metrics
            if metrics.stage != old.stage:
                self._event(now, "move", peer, f"moved from stage {old.stage} to stage {metrics.stage}")
            if metrics.state != old.state:
                self._event(now, "state", peer, f"{old.state} → {metrics.state}")
            if metrics.recoveries > old.recoveries:
                self._event(now, "recovery", peer, f"rebuilt stage {metrics.stage} from its neighbours")
            if metrics.bans > old.bans:
                banned = metrics.bans - old.bans
                self._event(now, "ban", peer, f"banned {banned} peer{'s' * (banned > 1)} ({metrics.bans} banned now)")
            view.metrics, view.last_seen = metrics, now
        view.traffic.append((now, metrics.bytes_sent, metrics.bytes_received))
        rounds = self.rounds.setdefault(metrics.stage, deque([(now, metrics.outer_round)], maxlen=self._max_points))
        if metrics.outer_round > rounds[-1][1]:
            rounds.append((now, metrics.outer_round))
        self._append(self.loss, peer, (now, metrics.step, metrics.train_loss))
        self._append(self.val_loss, peer, (now, metrics.step, metrics.val_loss))

    def _append(self, series: dict[str, deque[Point]], peer: str, point: tuple[float, int, float | None]) -> None:
        if point[2] is None:
            return
        points = series.setdefault(peer, deque(maxlen=self._max_points))
        if not points or points[-1][2] != point[2]:  # a record repeats its loss until the trainer logs again
            points.append(point)

    def _event(self, now: float, kind: str, peer: str, text: str) -> None:
        self.events.append(Event(now, kind, peer, text))
        self.event_counts[kind] += 1

    def state(self, now: float) -> dict[str, Any]:
        """Everything the page draws, as JSON-ready data."""
        with self._lock:
            peers = sorted(self.peers.items(), key=lambda item: (item[1].metrics.stage, item[1].metrics.role, item[0]))
            return {
                "now": now,
                "peers": [self._peer_state(peer, view) for peer, view in peers],
                "loss": {peer: list(points) for peer, points in self.loss.items()},
                "val_loss": {peer: list(points) for peer, points in self.val_loss.items()},
                "throughput": list(self.throughput),
                "rounds": {str(stage): list(points) for stage, points in sorted(self.rounds.items())},
                "events": [asdict(event) for event in self.events],
                "event_counts": dict(self.event_counts),
            }

    @staticmethod
    def _peer_state(peer: str, view: PeerView) -> dict[str, Any]:
        (start, sent0, received0), (end, sent, received) = view.traffic[0], view.traffic[-1]  # over the last polls
        return {
            "id": peer,
            **view.metrics.dict(),
            "rate_sent": _rates(sent0, sent, end - start),
            "rate_received": _rates(received0, received, end - start),
            "first_seen": view.first_seen,
            "last_seen": view.last_seen,
        }


def _labels(labels: Mapping[str, Any]) -> str:
    escape = lambda value: str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{name}="{escape(value)}"' for name, value in labels.items()) + "}"


PEER_GAUGES = {  # /api/state field → (Prometheus name, help)
    "train_loss": ("train_loss", "Mean training loss over a trainer's last logged steps."),
    "val_loss": ("val_loss", "A trainer's last validation loss."),
    "tokens_per_s": ("tokens_per_second", "Tokens a peer processed per second over its last period."),
    "step": ("inner_steps", "Inner optimizer steps of the peer's stage replica."),
    "outer_round": ("outer_round", "Outer round the peer's stage replica is in."),
    "bans": ("banned_peers", "Peers this one refuses to call right now."),
}


def prometheus_text(state: Mapping[str, Any]) -> str:
    """``/api/state`` in Prometheus' text exposition format (version 0.0.4)."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, Any], float]]) -> None:
        lines.extend([f"# HELP swarmloco_{name} {help_text}", f"# TYPE swarmloco_{name} {kind}"])
        lines.extend(f"swarmloco_{name}{_labels(labels)} {float(value)!r}" for labels, value in samples)

    peers = state["peers"]
    who = lambda peer: {"peer": peer["id"], "role": peer["role"], "stage": peer["stage"]}
    roles = Counter(peer["role"] for peer in peers)
    family("peers", "gauge", "Live peers by role.", [({"role": role}, roles[role]) for role in ("trainer", "stage")])
    for field, (name, help_text) in PEER_GAUGES.items():
        family(name, "gauge", help_text, [(who(peer), peer[field]) for peer in peers if peer[field] is not None])
    family(
        "recoveries_total",
        "counter",
        "Stages a peer rebuilt from their neighbours.",
        [(who(peer), peer["recoveries"]) for peer in peers],
    )
    for direction in ("sent", "received"):
        family(
            f"bytes_{direction}_total",
            "counter",
            f"Wire bytes {direction} since the peer started, by kind.",
            [
                ({**who(peer), "kind": kind}, count)
                for peer in peers
                for kind, count in sorted(peer[f"bytes_{direction}"].items())
            ],
        )
    family(
        "events_total",
        "counter",
        "Swarm events the dashboard saw, by kind.",
        [({"kind": kind}, n) for kind, n in sorted(state["event_counts"].items())],
    )
    return "\n".join(lines) + "\n"


def swarm_info(cfg: SwarmConfig) -> dict[str, Any]:
    blocks = split_layers(cfg.model.n_layers, cfg.stages.num_stages)
    return {
        "id": cfg.swarm_id,
        "name": cfg.name,
        "num_stages": cfg.stages.num_stages,
        "blocks": [[r.start, r.stop - 1] for r in blocks],
        "outer_method": cfg.outer.method,
        "inner_steps": cfg.outer.inner_steps,
    }


def make_handler(state: Callable[[], dict[str, Any]]) -> type[BaseHTTPRequestHandler]:
    """GET handler: the page and its assets (a fixed list: no path reaches the disk), /api/state and /metrics."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/api/state":
                body, content_type = json.dumps(state(), allow_nan=False).encode(), "application/json"
            elif path == "/metrics":
                body, content_type = prometheus_text(state()).encode(), PROMETHEUS_TYPE
            elif path in ASSETS:
                name, content_type = ASSETS[path]
                body = (STATIC / name).read_bytes()
            else:
                self.send_error(HTTPStatus.NOT_FOUND)
                return
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug(format % args)

    return Handler


async def watch(
    read: Callable[[], Awaitable[Mapping[PeerID, PeerMetrics]]], history: History, period_s: float, stop: asyncio.Event
) -> None:
    """Every ``period_s`` until ``stop``: ``await read()`` → {PeerID: PeerMetrics} into ``history``."""
    while not stop.is_set():
        try:
            found = await read()
        except Exception as e:  # a DHT hiccup: the next poll tries again
            logger.warning(f"reading metrics failed: {type(e).__name__}: {e}")
        else:
            history.update({peer.to_base58(): metrics for peer, metrics in found.items()}, time.time())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=period_s)


async def serve(args: argparse.Namespace, cfg: SwarmConfig | None, credentials: PeerCredentials | None) -> None:
    """Join as a client, serve the page, and poll the swarm until SIGINT/SIGTERM."""
    async with watch_swarm(
        args.initial_peers,
        cfg,
        name=swarm_name(credentials, args.name),
        identity_path=str(args.identity) if args.identity else None,
        credentials=credentials,
    ) as membership:
        cfg = membership.cfg
        period_s = args.poll_s or cfg.timeouts.announce_period_s
        history = History(leave_after_s=2.5 * period_s)
        info = swarm_info(cfg)
        server = ThreadingHTTPServer(
            (args.host, args.port), make_handler(lambda: {"swarm": info, **history.state(time.time())})
        )
        threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
        print(f"dashboard of swarm {cfg.swarm_id}: http://{args.host}:{server.server_port}/", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            await watch(membership.metrics, history, period_s, stop)
        finally:
            server.shutdown()
            server.server_close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--initial-peers", nargs="+", required=True, help="Multiaddrs of peers in the swarm.")
    parser.add_argument("--port", type=int, default=8080, help="HTTP port (0: any free one; the URL is printed).")
    parser.add_argument("--host", default="127.0.0.1", help="Address to serve on (0.0.0.0: every interface).")
    parser.add_argument(
        "--config", type=Path, help="The swarm's swarm.toml (default: fetch the config published under --name)."
    )
    parser.add_argument("--name", default=SwarmConfig().name, help="Name of the swarm whose config to fetch.")
    parser.add_argument(
        "--poll-s", type=float, help="Seconds between snapshots (default: the swarm's announce period)."
    )
    parser.add_argument(
        "--identity",
        type=Path,
        help="libp2p key file of this dashboard (a private swarm's certificate names its peer id).",
    )
    parser.add_argument(
        "--credentials",
        type=Path,
        help="Private swarms: this dashboard's certificate (`swarmloco swarm invite`); needs --identity.",
    )
    parser.add_argument("--revocations", type=Path, help="Private swarms: the authority's signed revocation list.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        credentials = swarm_credentials(
            args.credentials, args.identity, args.revocations, args.config
        )  # as `swarmloco run` checks them
        asyncio.run(serve(args, load_config(args.config) if args.config else None, credentials))
    except typer.Exit as e:  # swarm_credentials said what is wrong
        raise SystemExit(e.exit_code) from None
    except (ConfigError, CredentialError, AccessDenied, JoinError, MembershipError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
