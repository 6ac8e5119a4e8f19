"""The layout of a loopback swarm (``swarmloco local``'s own options) and the config of each peer it starts.

``LocalSwarm``'s fields are ``swarmloco local``'s options (their ``cli`` metadata); ``peer_roles`` gives each peer's
``PeerConfig``, which ``peer/launch.py`` hands to its process as the argv that recreates it (``PeerConfig.to_argv``).

    >>> [name for name, peer in peer_roles(LocalSwarm(peers=3, stages=2), SwarmConfig(), Path("runs/local"))]
    ['stage1-0', 'stage2-0', 'trainer-0']
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from pathlib import Path

from swarm.cli_fields import cli
from swarm.config import SwarmConfig, follow_run
from swarm.model.stages import StagesConfig
from swarm.node.config import PeerConfig


@dataclasses.dataclass(kw_only=True)
class LocalSwarm:
    """The process layout of a loopback swarm: ``peers`` pipeline processes, ``trainers`` of them trainers, and ``full``
    full peers besides (each the whole model, one more replica of every stage; ``swarm/node/roles/full.py``). A swarm of full peers
    only has no pipeline: no trainer, no server (``peers=0, trainers=0``).

    ``joiners`` more peers start with ``--role auto`` ``join_after_s`` seconds after the trainers start training:
    they join the running swarm, take the role it needs most and download their stage's state. Each field is a
    ``swarmloco local`` option (its ``cli`` metadata).
    """

    peers: int = field(
        default=3,
        metadata=cli(
            "Pipeline peer processes in all (trainers + stage servers; full peers extra; 0 with --trainers 0: "
            "full peers only).",
            min=0,
        ),
    )
    stages: int = field(default=2, metadata=cli("Middle stages S.", min=1))
    trainers: int = field(default=1, metadata=cli("How many of the peers are trainers.", min=0))
    steps: int = field(default=100, metadata=cli("Inner steps per trainer.", min=1))
    joiners: int = field(
        default=0,
        metadata=cli("Extra peers that join mid-run with --role auto (downloading their stage's state).", min=0),
    )
    join_after_s: float = field(
        default=30.0,
        metadata=cli("Seconds after the trainers start training that the joiners start.", flag="--join-after", min=0.0),
    )
    full: int = field(
        default=0,
        metadata=cli(
            "Extra full peers: each trains the whole model on its own data shard and joins every stage's outer rounds.",
            min=0,
        ),
    )

    def __post_init__(self) -> None:
        if self.stages < 1 or self.steps < 1:
            raise ValueError("stages and steps must be positive")
        if self.trainers < 0 or self.joiners < 0 or self.join_after_s < 0 or self.full < 0:
            raise ValueError("trainers, joiners, full and join_after_s must be non-negative")
        if self.trainers + self.full < 1:
            raise ValueError("a swarm needs a trainer or a full peer to train")
        if self.trainers == 0 and self.peers != 0:  # only full peers: no pipeline, so no server has anyone to serve
            raise ValueError(f"a swarm of full peers only has no pipeline: use --peers 0, not {self.peers}")
        if self.trainers and self.peers - self.trainers < self.stages:
            raise ValueError(
                f"{self.peers} peers with {self.trainers} trainer(s) leave {self.peers - self.trainers} servers "
                f"for {self.stages} stages; use --peers {self.trainers + self.stages} or more"
            )

    def servers(self) -> list[tuple[str, int]]:
        """(name, stage) of every stage server, replicas spread round-robin."""
        return [
            (f"stage{k % self.stages + 1}-{k // self.stages}", k % self.stages + 1)
            for k in range(self.peers - self.trainers)
        ]


def local_config(base: SwarmConfig, layout: LocalSwarm, *, schedule_set: bool = False) -> SwarmConfig:
    """``base`` with the layout's stages and steps (the cosine schedule as long as the run unless ``schedule_set``: the
    config sets ``inner.total_steps``); several trainers (and full peers) get a data shard each unless ``base`` shards."""
    shards = layout.trainers + layout.full if base.data.shards == 1 else base.data.shards
    return dataclasses.replace(
        follow_run(base, layout.steps, schedule_set=schedule_set),
        stages=StagesConfig(num_stages=layout.stages),
        data=dataclasses.replace(base.data, shards=shards),
    )


def peer_roles(
    layout: LocalSwarm, cfg: SwarmConfig, out: Path, base: PeerConfig | None = None
) -> list[tuple[str, PeerConfig]]:
    """(name, config) of every peer but the joiners, in start order: the stage servers, the trainers, the full peers,
    each ``base`` with its role's fields set. The first of them creates the swarm: a server, or with no pipeline the
    first full peer."""
    base = base or PeerConfig()
    roles = [(name, dataclasses.replace(base, role="stage", stage=stage)) for name, stage in layout.servers()]
    # each replica of stage 0 trains once all are listed: the first to start would run its first rounds alone
    replicas = layout.trainers + layout.full
    for i in range(replicas):  # trainers, then full peers with the shards and seeds after the trainers'
        trainer = i < layout.trainers
        name = f"trainer-{i}" if trainer else f"full-{i - layout.trainers}"
        role = dataclasses.replace(
            base,
            role="trainer" if trainer else "full",
            steps=layout.steps,
            seed=i,
            data_shard=i % cfg.data.shards,  # distinct shards: no two trainers share documents
            wait_for_replicas=replicas,
            stage_checkpoint=stage0_file(out, name) if trainer else base.stage_checkpoint,
        )
        roles.append((name, role))
    return roles


def stage0_file(out: Path, trainer: str) -> Path:
    """Where a local swarm's trainer saves stage 0 when it finishes."""
    return out / f"{trainer}.stage0"
