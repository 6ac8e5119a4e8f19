"""``swarmloco status``: a snapshot of a running swarm, read from its DHT by a client-only node.

Every peer announces a stage record (trainers under stage 0) and a metrics record; this joins
the swarm's DHT in client mode (it serves nothing; joining re-publishes the swarm's config, which
only refreshes it), reads both records of every peer and prints peers per stage, throughput,
queues and rounds.

    $ swarmloco status --initial-peers /ip4/…/p2p/12D3… [--json]
"""

from __future__ import annotations

from typing import Any

from swarm.config import SwarmConfig
from swarm.dht.start import watch_swarm
from swarm.rpc.admission import Credentials


async def read_status(
    initial_peers: list[str],
    cfg: SwarmConfig | None,
    *,
    name: str,
    identity_path: str | None = None,
    credentials: Credentials | None = None,
) -> dict[str, Any]:
    """The swarm's state as plain data (``--json`` prints exactly this)."""
    async with watch_swarm(
        initial_peers, cfg, name=name, identity_path=identity_path, credentials=credentials
    ) as membership:
        cfg = membership.cfg
        replicas, metrics = await membership.all_replicas(), await membership.metrics()
    stages = []
    for stage, peers in replicas.items():
        rows = [
            {"peer": peer.to_base58(), **status.dict(), **_metrics_of(metrics.get(peer))}
            for peer, status in sorted(peers.items(), key=lambda item: str(item[0]))
        ]
        stages.append(
            {
                "stage": stage,
                "role": "trainers" if stage == 0 else "servers",
                "peers": rows,
                "samples_per_s": sum(row["samples_per_s"] for row in rows),
                "tokens_per_s": sum(row.get("tokens_per_s", 0.0) for row in rows),
            }
        )
    return {
        "swarm_id": cfg.swarm_id,
        "config_hash": cfg.hash(),
        "num_stages": cfg.stages.num_stages,
        "peers": sum(len(stage["peers"]) for stage in stages),
        "stages": stages,
    }


def _metrics_of(metrics: Any) -> dict[str, Any]:
    keys = ("tokens_per_s", "train_loss", "val_loss", "state")
    return {} if metrics is None else {key: getattr(metrics, key) for key in keys}


def format_status(status: dict[str, Any]) -> str:
    """Readable lines: one per stage, then one per peer."""
    lines = [
        f"swarm {status['swarm_id']}: {_count(status['num_stages'], 'middle stage')}, {_count(status['peers'], 'peer')}"
    ]
    for stage in status["stages"]:
        peers, label = stage["peers"], "stage 0 (trainers)" if stage["stage"] == 0 else f"stage {stage['stage']}"
        if not peers:
            lines.append(
                f"{label:<19} no peers" + ("" if stage["stage"] == 0 else ": trainers skip it until one joins")
            )
            continue
        rounds = sorted({peer["outer_round"] for peer in peers})
        throughput = (
            f"{stage['tokens_per_s'] / 1000:.1f}k tok/s"
            if stage["stage"] == 0
            else f"{stage['samples_per_s']:.1f} samples/s"
        )
        lines.append(
            f"{label:<19} {_count(len(peers), 'peer')}  {throughput}  outer round "
            f"{'-'.join(map(str, (rounds[0], rounds[-1]) if len(rounds) > 1 else rounds))}"
        )
        for peer in peers:
            loss = "" if peer.get("train_loss") is None else f"  loss {peer['train_loss']:.3f}"
            lines.append(
                f"  {peer['peer']}  {peer['samples_per_s']:.1f} samples/s  queue {peer['queue']}  "
                f"inner steps {peer['inner_steps']}  round {peer['outer_round']}{loss}{'  recovered' if peer.get('recovered') else ''}"
                f"{'  full peer (no pipeline traffic)' if peer.get('serves') is False else ''}"
            )
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"
