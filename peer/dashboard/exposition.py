"""``/metrics``: the dashboard's state in Prometheus' text exposition format (version 0.0.4).

Every sample carries the swarm's name and config hash; each peer's also its id, name, role and stage. What
only grows is a counter (tokens, bytes, recoveries, DHT stores, events), so Prometheus' ``rate()`` gives throughput and
bandwidth over any window and a missed scrape loses nothing; losses, steps and rounds are gauges.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
VERDICTS = ("green", "yellow", "red")
PEER_GAUGES = {  # /api/state peer field → (Prometheus name, help)
    "train_loss": ("train_loss", "Mean training loss over a trainer's last logged steps."),
    "val_loss": ("val_loss", "A trainer's last validation loss."),
    "step": ("inner_steps", "Inner optimizer steps of the peer's stage replica."),
    "outer_round": ("outer_round", "Outer round the peer's stage replica is in."),
    "bans": ("banned_peers", "Peers this one refuses to call right now."),
    "uptime_s": ("uptime_seconds", "Seconds since the peer started."),
}
PEER_COUNTERS = {
    "tokens": (
        "tokens_total",
        "Tokens the peer processed since it started (trainers: trained; servers: passed through).",
    ),
    "recoveries": ("recoveries_total", "Stages a peer rebuilt from their neighbours."),
    "dht_stores": (
        "dht_stores_total",
        "DHT records the peer stored since it started (stage records, config, metrics, round declarations, claims).",
    ),
}


def _labels(labels: Mapping[str, Any]) -> str:
    escape = lambda value: str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{name}="{escape(value)}"' for name, value in labels.items()) + "}"


def prometheus_text(state: Mapping[str, Any]) -> str:
    """``/api/state`` (with its ``swarm``) as Prometheus text."""
    lines: list[str] = []
    swarm = {"swarm": state["swarm"]["name"], "config_hash": state["swarm"]["config_hash"]}

    def family(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, Any], float]]) -> None:
        lines.extend([f"# HELP swarmloco_{name} {help_text}", f"# TYPE swarmloco_{name} {kind}"])
        lines.extend(f"swarmloco_{name}{_labels({**swarm, **labels})} {float(value)!r}" for labels, value in samples)

    peers = state["peers"]
    who = lambda peer: {"peer": peer["id"], "name": peer["name"] or "", "role": peer["role"], "stage": peer["stage"]}
    roles = Counter(peer["role"] for peer in peers)
    family(
        "peers",
        "gauge",
        "Live peers by role.",
        [({"role": role}, roles[role]) for role in ("trainer", "stage", "full")],
    )
    verdict = state["health"]["verdict"]
    family(
        "health",
        "gauge",
        "The dashboard's verdict (1 for the current one): green only while trainers advance.",
        [({"verdict": name}, name == verdict) for name in VERDICTS],
    )
    for field, (name, help_text) in PEER_GAUGES.items():
        family(name, "gauge", help_text, [(who(peer), peer[field]) for peer in peers if peer[field] is not None])
    for field, (name, help_text) in PEER_COUNTERS.items():
        family(name, "counter", help_text, [(who(peer), peer[field]) for peer in peers])
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
        "Swarm events the dashboard saw (over its restarts, with --history), by kind.",
        [({"kind": kind}, n) for kind, n in sorted(state["event_counts"].items())],
    )
    return "\n".join(lines) + "\n"
