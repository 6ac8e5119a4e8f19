"""The per-peer part of the configuration: who this peer is, where it listens, which role it takes, what it writes.

The swarm-wide part (``SwarmConfig``, hashed and shared by every peer) lives in ``swarm/config.py``;
this part is each peer's own and never leaves it. One keyword-only dataclass tree, the trainer's
options nested in it; ``from_flat`` builds it from one flat namespace (the command line's options),
routing each name to the level that owns it, so a front end maps nothing by hand:

    >>> PeerConfig(role="stage", stage=1, initial_peers=["/ip4/127.0.0.1/tcp/4100/p2p/12D3…"]).rebalance_every_s
    0.0
    >>> PeerConfig.from_flat({"role": "trainer", "steps": 20, "eval_every": 5}).trainer.eval_every
    5
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from swarm.config import SwarmConfig
from swarm.dht.reachability import REACHABILITY_MODES, Reachability, ReachabilityMode, choose_reachability
from swarm.dht.records import PEER_NAME_PATTERN
from swarm.errors import ConfigError
from swarm.faults import FaultSchedule
from swarm.hardware import device_spec_problem
from swarm.pipeline.trainer import TrainerOptions
from swarm.rpc.admission import Credentials

Role = Literal["auto", "trainer", "stage", "full"]
ROLES: tuple[str, ...] = get_args(Role)
REBALANCE_PERIOD_S = 30.0
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
# flat names given as text that a field holds as an object
_PARSE: dict[str, Callable[[object], object]] = {
    "faults": lambda spec: spec if isinstance(spec, FaultSchedule) else FaultSchedule.parse(str(spec))
}


@dataclass(kw_only=True)
class PeerConfig:
    # auto: what the swarm needs most (``swarm.node.choose_role``); full: the whole model (``swarm/full.py``)
    role: Role = "auto"
    # full peers: also serve stages 1..S to trainers (RPCs computed on the weights it trains, on its compute thread)
    serve: bool = False
    stage: int | None = None  # stage servers: the stage to serve; None = the one with fewest replicas
    initial_peers: list[str] = field(default_factory=list)  # none: this peer creates the swarm
    host_maddrs: list[str] = field(default_factory=lambda: list(DEFAULT_HOST_MADDRS))
    announce_maddrs: list[str] = field(default_factory=list)
    # how others reach this peer: public, through a relay (behind NAT), or a trainer that only calls out (client);
    # auto decides from the addresses (``swarm.dht.reachability``)
    reachability: ReachabilityMode = "auto"
    identity: Path | None = None  # libp2p key file (created if missing): a stable peer id
    credentials: Credentials | None = None  # private swarms: this peer's certificate, and the check of everyone else's
    swarm_name: str = SwarmConfig().name  # which published config to fetch when none is given
    name: str | None = None  # this peer's name in logs, metrics and fault schedules (None: its role and pid)
    out: Path | None = None  # metrics go to OUT/<name>.jsonl; a peer that rebuilds a stage saves the merge there too
    # trainers: corpus files, directories or globs (none: the default corpus)
    data: list[str] = field(default_factory=list)
    tokenizer: Path | None = None  # trainers: the tokenizer file the swarm config names (None: the byte tokenizer)
    data_shard: int | None = None  # trainers: the data shard to read, of data.shards (None: derived from the peer id)
    seed: int = 0  # trainers: data stream offset (give each trainer its own)
    threads: int = 0  # torch threads (0: torch's default)
    device: str = "auto"  # where this peer computes (``swarm/hardware.py``): auto, cpu, cuda, cuda:N or mps
    steps: int = 100  # trainers: inner steps of stage 0 to run
    trainer: TrainerOptions = field(default_factory=TrainerOptions)
    max_pending: int = 8  # stage servers: requests held at once; more are refused as busy
    wait_for_stages_s: float = 120.0  # trainers: how long to wait for every stage to have a replica (and for
    # wait_for_replicas)
    wait_for_replicas: int = 0  # trainers, full peers: train once this many replicas of stage 0 are listed (itself too)
    rebalance_period_s: float | None = None  # stage servers: seconds between rebalancing checks (± 20%); 0 = never move
    # stage servers: a state file written every checkpoint_every inner steps (0 = never), and loaded on start when the
    # stage has no live replica (rollback); trainers: stage 0's weights, written when training ends
    stage_checkpoint: Path | None = None
    checkpoint_every: int = 0
    # tests: this peer dies at its own step N (events naming it)
    faults: FaultSchedule = field(default_factory=FaultSchedule)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError("role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.reachability not in REACHABILITY_MODES:
            raise ConfigError(
                "reachability", f"must be one of {', '.join(REACHABILITY_MODES)}, got {self.reachability!r}"
            )
        if self.reachability == "client" and self.role == "stage":
            raise ConfigError(
                "reachability",
                "a client only calls out, and a stage server must be called: use --reachability relay (behind NAT) "
                "or public with --announce-maddrs",
            )
        if self.role != "stage" and self.stage is not None:
            raise ConfigError(
                "stage",
                "a trainer holds stage 0, a full peer every stage, --role auto picks its own; --stage is for --role stage",
            )
        if self.serve and self.role != "full":
            raise ConfigError(
                "serve",
                f"--serve is for --role full (a full peer that also serves its middle stages), not --role {self.role}: "
                "a stage server always serves, a trainer never does",
            )
        if self.stage is not None and self.stage < 1:
            raise ConfigError("stage", f"stage servers serve stages 1..S, got stage {self.stage}")
        if self.name is not None and not re.fullmatch(PEER_NAME_PATTERN, self.name):
            raise ConfigError(
                "name", f"1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit; got {self.name!r}"
            )
        for name in ("steps", "max_pending"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        for name in (
            "rebalance_period_s",
            "checkpoint_every",
            "threads",
            "wait_for_stages_s",
            "wait_for_replicas",
            "data_shard",
        ):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(name, f"must be non-negative, got {getattr(self, name)}")
        if (problem := device_spec_problem(self.device)) is not None:
            raise ConfigError("device", problem)
        if self.checkpoint_every and not self.stage_checkpoint:
            raise ConfigError("checkpoint_every", "needs a stage_checkpoint file to write")
        if any(event.at_s is not None for event in self.faults.events):
            raise ConfigError(
                "faults", "a peer injects its own faults by step (PEER@step=N); timed faults are for a supervisor"
            )

    @property
    def rebalance_every_s(self) -> float:
        """The rebalancing period; 0 = never. A server pinned to ``stage`` stays there unless a period is given."""
        if self.rebalance_period_s is not None:
            return self.rebalance_period_s
        return 0.0 if self.stage is not None else REBALANCE_PERIOD_S

    def chosen_reachability(self) -> Reachability:
        """How others reach this peer (``reachability`` with auto resolved) and why."""
        return choose_reachability(
            self.reachability,
            initial_peers=self.initial_peers,
            host_maddrs=self.host_maddrs,
            announce_maddrs=self.announce_maddrs,
        )

    def fault_step(self, name: str) -> int | None:
        """The first step at which the fault schedule kills the peer called ``name``; None: never."""
        return min(
            (event.step for event in self.faults.events if event.peer == name and event.step is not None), default=None
        )

    @classmethod
    def from_flat(cls, options: Mapping[str, object]) -> PeerConfig:
        """A config from one flat namespace: each name is a field of this class or of ``trainer``; None means "the default".

        An unknown name is a ConfigError, so a front end cannot silently drop an option.
        """
        own = {f.name for f in dataclasses.fields(cls)} - {"trainer"}
        nested = {f.name for f in dataclasses.fields(TrainerOptions)}
        unknown = sorted(set(options) - own - nested)
        if unknown:
            raise ConfigError(unknown[0], "not a per-peer option")
        given = {}
        for key, value in options.items():
            if value is not None:
                try:
                    given[key] = _PARSE[key](value) if key in _PARSE else value
                except ValueError as e:
                    raise ConfigError(key, str(e)) from None
        try:
            trainer = TrainerOptions(**{key: value for key, value in given.items() if key in nested})
        except ConfigError as e:
            raise e.within("trainer") from None
        except ValueError as e:
            raise ConfigError("trainer", str(e)) from None
        return cls(**{key: value for key, value in given.items() if key in own}, trainer=trainer)
