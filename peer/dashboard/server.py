"""The dashboard's HTTP server and the DHT poller that feeds it.

The page and its assets are package data (``peer/dashboard/static/``); ``/api/state`` serves what the page draws
as JSON and ``/metrics`` the same in Prometheus' text format (``peer/dashboard/exposition.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

from hivemind.p2p import PeerID

from peer.dashboard import DashboardError
from peer.dashboard.exposition import PROMETHEUS_TYPE, prometheus_text
from peer.dashboard.history import History
from peer.dashboard.store import HistoryStore
from swarm.config import SwarmConfig
from swarm.dht.records import PeerMetrics
from swarm.dht.start import watch_swarm
from swarm.model.stages import split_layers
from swarm.rpc.admission import Credentials

logger = logging.getLogger(__name__)
ASSETS = {  # a fixed list: no request path reaches the disk
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
IN_MEMORY = ("", "none")  # --history values that keep no file
STALLED_AFTER_POLLS = 20  # no trainer advanced over this many polls (and at least a minute): training stalled


def default_history(swarm_id: str) -> Path:
    return Path(f"swarmloco-dashboard-{swarm_id}.sqlite")


def history_path(option: str | None, swarm_id: str) -> Path | None:
    """``--history``: a file, the default file in the current directory (None given), or none ('' / none)."""
    if option is None:
        return default_history(swarm_id)
    return None if option.strip().lower() in IN_MEMORY else Path(option)


def asset(name: str) -> bytes:
    return resources.files("peer.dashboard").joinpath("static", name).read_bytes()


def swarm_info(cfg: SwarmConfig) -> dict[str, Any]:
    blocks = split_layers(cfg.model.n_layers, cfg.stages.num_stages)
    return {
        "id": cfg.swarm_id,
        "name": cfg.name,
        "config_hash": cfg.hash(),
        "num_stages": cfg.stages.num_stages,
        "blocks": [[r.start, r.stop - 1] for r in blocks],
        "outer_method": cfg.outer.method,
        "inner_steps": cfg.outer.inner_steps,
    }


def make_handler(state: Callable[[], dict[str, Any]]) -> type[BaseHTTPRequestHandler]:
    """GET handler: the page and its assets, /api/state and /metrics."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/api/state":
                body, content_type = json.dumps(state(), allow_nan=False).encode(), "application/json"
            elif path == "/metrics":
                body, content_type = prometheus_text(state()).encode(), PROMETHEUS_TYPE
            elif path in ASSETS:
                name, content_type = ASSETS[path]
                body = asset(name)
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


Snapshot = tuple[Mapping[PeerID, PeerMetrics], Mapping[str, str]]  # records, and addresses by peer id


async def watch(
    read: Callable[[], Awaitable[Snapshot]], history: History, period_s: float, stop: asyncio.Event
) -> None:
    """Every ``period_s`` until ``stop``: ``await read()`` → ({PeerID: PeerMetrics}, {peer id: maddr}) into ``history``."""
    while not stop.is_set():
        try:
            found, addresses = await read()
        except Exception as e:  # a DHT hiccup: the next poll tries again
            logger.warning(f"reading metrics failed: {type(e).__name__}: {e}")
        else:
            history.update({peer.to_base58(): metrics for peer, metrics in found.items()}, time.time(), addresses)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=period_s)


async def connected_addresses(p2p: Any) -> dict[str, str]:
    """{peer id: a multiaddr} of the peers the dashboard's node is connected to (only those: a record has none)."""
    return {info.peer_id.to_base58(): str(info.addrs[0]) for info in await p2p.list_peers() if info.addrs}


async def serve(
    initial_peers: list[str],
    cfg: SwarmConfig | None,
    *,
    name: str,
    identity_path: str | None,
    credentials: Credentials | None,
    host: str,
    port: int,
    history_option: str | None,
    poll_s: float | None = None,
    echo: Callable[[str], None] = print,
) -> None:
    """Join as a client, serve the page, and poll the swarm until SIGINT/SIGTERM."""
    async with watch_swarm(
        initial_peers, cfg, name=name, identity_path=identity_path, credentials=credentials
    ) as membership:
        cfg = membership.cfg
        period_s = poll_s or cfg.timeouts.announce_period_s
        path = history_path(history_option, cfg.swarm_id)
        store = HistoryStore.open(path, swarm_id=cfg.swarm_id) if path else None
        history = History(
            leave_after_s=2.5 * period_s,
            stalled_after_s=max(60.0, STALLED_AFTER_POLLS * period_s),
            num_stages=cfg.stages.num_stages,
            store=store,
        )
        info = swarm_info(cfg)
        try:
            server = ThreadingHTTPServer(
                (host, port), make_handler(lambda: {"swarm": info, **history.state(time.time())})
            )
        except OSError as e:
            raise DashboardError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
        threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
        kept = f"history in {path}" if path else "history in memory only"
        echo(f"dashboard of swarm {cfg.swarm_id}: http://{host}:{server.server_port}/ ({kept})")
        p2p = await membership.dht.replicate_p2p()

        async def read() -> Snapshot:
            return await membership.metrics(), await connected_addresses(p2p)

        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            await watch(read, history, period_s, stop)
        finally:
            server.shutdown()
            server.server_close()
            if store:
                store.close()
