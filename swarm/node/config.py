"""The per-peer configuration (``PeerConfig``): who this peer is, where it listens, which role it takes, what it writes.

The swarm-wide part (``SwarmConfig``, hashed and shared) is ``swarm/config.py``; this part never leaves the peer. Its
fields with ``cli`` metadata are ``swarmloco run``'s options (``peer/config_options.py``); ``from_flat`` builds it from
that flat namespace, routing each name to the level that owns it (the trainer's options are nested); ``to_argv``
turns it back into the options that recreate it.

    >>> PeerConfig.from_flat({"role": "trainer", "steps": 20, "eval_every": 5}).trainer.eval_every
    5
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from swarm.cli_fields import cli, config_argv
from swarm.config import SwarmConfig, TrainerOptions
from swarm.dht.reachability import REACHABILITY_MODES, Reachability, ReachabilityMode, choose_reachability
from swarm.dht.records import PEER_NAME_PATTERN
from swarm.errors import ConfigError
from swarm.faults import FaultSchedule
from swarm.hardware import DEVICE_HELP, device_spec_problem
from swarm.model.compiling import COMPILE_HELP, COMPILE_MODES, CompileMode
from swarm.model.reference import rate_spec_problem
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
    """This peer's own configuration (never shared); each field with ``cli`` metadata is a ``swarmloco run`` option."""

    role: Role = field(
        default="auto",
        metadata=cli(
            "auto (what the swarm needs most: a server of an unserved stage, else a trainer if there is none, "
            "else full if the whole model fits and every stage has two idle servers, else a server of the bottleneck "
            "stage), trainer (stage 0: data, embedding, loss), stage (a server of one middle stage) or full (the whole "
            "model trained on its own data, one more replica of every stage in the outer rounds, sent no microbatches "
            "unless it gives --serve)."
        ),
    )
    serve: bool = field(
        default=False,
        metadata=cli(
            "Full peers: also serve stages 1..S to trainers, on the weights it trains (routing then counts it as "
            "a server of each); stage 0 stays the trainers' own."
        ),
    )
    stage: int | None = field(
        default=None,
        metadata=cli(
            "Stage servers: the stage to serve, pinned there unless --rebalance-period is given (default: the one "
            "with fewest replicas).",
            min=1,
        ),
    )
    initial_peers: list[str] = field(
        default_factory=list,
        metadata=cli("Multiaddr of a peer in the swarm; repeatable. None: create a new swarm."),
    )
    host_maddrs: list[str] = field(
        default_factory=lambda: list(DEFAULT_HOST_MADDRS),
        metadata=cli("Multiaddrs to listen on (default /ip4/0.0.0.0/tcp/0)."),
    )
    announce_maddrs: list[str] = field(
        default_factory=list, metadata=cli("Public multiaddrs to announce (behind NAT with a forwarded port).")
    )
    reachability: ReachabilityMode = field(
        default="auto",
        metadata=cli(
            "How others reach this peer. public: at its addresses (a full DHT node, and a relay for peers behind "
            "NAT); relay: behind NAT, reached through a relay (the initial peers); client: behind NAT, a trainer that "
            "only calls out (its outer-round payloads leave through a relay); auto: relay when it listens only on "
            "private addresses, gives no --announce-maddrs and joins through peers on another network, else public."
        ),
    )
    identity: Path | None = field(
        default=None, metadata=cli("libp2p key file for a stable peer id (created if missing).")
    )
    credentials: Credentials | None = None  # private swarms: this peer's certificate, and the check of everyone else's
    swarm_name: str = SwarmConfig().name  # which published config to fetch when none is given
    name: str | None = field(
        default=None,
        metadata=cli("This peer's name in logs, metrics and fault schedules (default: its role and pid)."),
    )
    out: Path | None = field(
        default=None,
        metadata=cli("Append metrics to OUT/<name>.jsonl; a peer that rebuilds a stage saves the merge there too."),
    )
    data: list[str] = field(
        default_factory=list,
        metadata=cli(
            "Trainers: text files, directories or globs (.txt .md .py .rst .jsonl), parquet or arrow tables and "
            "`datasets` save_to_disk folders (a 'text' column; needs swarmloco\\[data]); repeatable. Default: this "
            "Python's standard-library sources."
        ),
    )
    tokenizer: Path | None = field(
        default=None,
        metadata=cli(
            "Trainers: the BPE tokenizer file the swarm config names (`swarmloco tokenizer train`); default: the "
            "byte tokenizer."
        ),
    )
    data_shard: int | None = field(
        default=None,
        metadata=cli(
            "Trainers: the data shard to read, 0..data.shards-1 (default: derived from the peer id; two trainers "
            "may then share one, with probability 1/data.shards).",
            min=0,
        ),
    )
    seed: int = field(default=0, metadata=cli("Trainers: data stream offset (give each trainer its own)."))
    threads: int = field(default=0, metadata=cli("torch threads (0: torch's default).", min=0))
    device: str = field(default="auto", metadata=cli(DEVICE_HELP))
    compile: CompileMode = field(default="auto", metadata=cli(COMPILE_HELP))  # per process: never in the swarm's hash
    steps: int = field(default=100, metadata=cli("Trainers: inner steps of stage 0 to run.", min=1))
    trainer: TrainerOptions = field(default_factory=TrainerOptions)
    max_pending: int = field(
        default=8, metadata=cli("Stage servers: requests held at once; more are refused as busy.", min=1)
    )
    keep_graph_mb: int | None = field(
        default=None,
        metadata=cli(
            "Stage servers and full peers that --serve: MiB of forward graphs kept in device memory for their "
            "backwards, which then skip recomputing the forward (the recompute adds a third to a stage's FLOPs); a "
            "forward whose graph does not fit, or whose weights an inner step will move before its backward, is "
            "recomputed. Default: a quarter of the device memory free once the stage is built (the rest left to "
            "peers sharing the device); 0: always recompute.",
            min=0,
        ),
    )
    wait_for_stages_s: float = field(
        default=120.0,
        metadata=cli(
            "Trainers: seconds to wait for every stage to have a replica (and for --wait-for-replicas) before "
            "training on with skips.",
            flag="--wait-for-stages",
            min=0.0,
        ),
    )
    wait_for_replicas: int = field(
        default=0,
        metadata=cli(
            "Trainers and full peers: start training once this many replicas of stage 0 (trainers and full "
            "peers, this one included) are listed, so replicas started together meet from their first round (at "
            "most --wait-for-stages).",
            min=0,
        ),
    )
    rebalance_period_s: float | None = field(
        default=None,
        metadata=cli(
            "Stage servers: seconds between rebalancing checks (± 20%); 0 never moves. Default: 30, or never for a "
            "server pinned with --stage.",
            flag="--rebalance-period",
            min=0.0,
        ),
    )
    stage_checkpoint: Path | None = field(
        default=None,
        metadata=cli(
            "Stage servers: a stage state file, written every --checkpoint-every inner steps and loaded on start "
            "when the stage has no live replica (rollback instead of a rebuild from the neighbours). Trainers and full "
            "peers: stage 0's weights are written there when training ends (what `swarmloco local` exports)."
        ),
    )
    checkpoint_every: int = field(
        default=0,
        metadata=cli("Stage servers: write --stage-checkpoint every N inner steps (0: never write).", min=0),
    )
    pace_as: str | None = field(
        default=None,
        metadata=cli(
            "Benchmarks: compute nothing, run at a reference device's pace (h200, or one process's tokens/s on the "
            "whole model): a stage server waits that device's time for each forward and backward and replies with "
            "recorded real tensors, a trainer the same for its head; frames, codecs, p2p and routing stay real. The "
            "weights do not train; a paced trainer checks and probes nothing and runs no validation pass. Trainers and "
            "stage servers (docs/architecture.md, the throughput model)."
        ),
    )
    pace_boundaries: Path | None = field(
        default=None,
        metadata=cli(
            "Benchmarks, with --pace-as: the recorded boundary tensors to replay (scripts/bench_gpu_pace.py writes "
            "them from real text); default: each peer records one random microbatch at start (the whole model's "
            "forward and backward once)."
        ),
    )
    faults: FaultSchedule = field(
        default_factory=FaultSchedule,
        metadata=cli(
            "Tests: PEER@step=N,… — the peer of that --name dies (SIGKILL) at its own inner step N.", as_text=True
        ),
    )

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
            "keep_graph_mb",
        ):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(name, f"must be non-negative, got {getattr(self, name)}")
        if (problem := device_spec_problem(self.device)) is not None:
            raise ConfigError("device", problem)
        if self.compile not in COMPILE_MODES:
            raise ConfigError("compile", f"must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.pace_as is not None and (problem := rate_spec_problem(self.pace_as)) is not None:
            raise ConfigError("pace_as", problem)
        if self.pace_as is not None and self.role == "full":
            raise ConfigError("pace_as", "a full peer trains on its own: pacing is for trainers and stage servers")
        if self.pace_boundaries is not None and self.pace_as is None:
            raise ConfigError("pace_boundaries", "replays boundaries for --pace-as, which is not given")
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

    def to_argv(self) -> list[str]:
        """The ``swarmloco run`` options that recreate this config: one per field (the trainer's options included) that
        differs from its default, and ``--swarm`` for another swarm name. Credentials come from files
        (``--credentials``, ``--identity``), so a config that holds them, or a field no option sets, is a ValueError.

            >>> PeerConfig(role="trainer", steps=30, trainer=TrainerOptions(in_flight=2)).to_argv()
            ['--role', 'trainer', '--steps', '30', '--in-flight', '2']
        """
        if self.credentials is not None:
            raise ValueError("credentials: give `swarmloco run --credentials FILE` the certificate file instead")
        default_name = PeerConfig().swarm_name
        swarm = [] if self.swarm_name == default_name else ["--swarm", self.swarm_name]
        return config_argv(dataclasses.replace(self, swarm_name=default_name)) + swarm

    @classmethod
    def from_flat(cls, options: Mapping[str, object]) -> PeerConfig:
        """A config from one flat namespace: each name is a field of this class or of ``trainer`` (also written
        ``trainer.<name>``, as ``peer/config_options.py`` does); None means "the default".

        An unknown name is a ConfigError, so a front end cannot silently drop an option.
        """
        options = {key.removeprefix("trainer."): value for key, value in options.items()}
        own = {f.name for f in dataclasses.fields(cls)} - {"trainer"}
        nested = {f.name for f in dataclasses.fields(TrainerOptions)}
        unknown = sorted(set(options) - own - nested)
        if unknown:
            raise ConfigError(unknown[0], "not a per-peer option")
        given: dict[str, Any] = {}  # each value checked by the dataclass it goes to
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
