"""Commands that join or start a swarm over the network: run, status, export, local.

$ swarmloco run --initial-peers /ip4/…/p2p/12D3… --role auto
$ swarmloco status --initial-peers /ip4/…/p2p/12D3…
$ swarmloco export --initial-peers /ip4/…/p2p/12D3… -o model.pt   # the model of a running swarm
$ swarmloco export --checkpoint runs/local/model.pt --format hf -o model-hf   # a folder transformers loads
$ swarmloco local --peers 3 --stages 2 --steps 100
"""

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

from peer.cli_common import (
    ConfigOpt,
    DataOpt,
    DeviceOpt,
    TokenizerOpt,
    app,
    config_with_tokenizer,
    fail,
    swarm_credentials,
    swarm_name,
    user_errors,
    watched_swarm,
)
from peer.export import ExportFormat
from swarm.config import SwarmConfig, sets_field
from swarm.dht.reachability import ReachabilityMode
from swarm.peer_config import Role
from swarm.pipeline.trainer import TrainerOptions

CredentialsOpt = Annotated[
    Path | None,
    typer.Option(
        "--credentials", help="Private swarms: this peer's certificate (`swarmloco swarm invite`); needs --identity."
    ),
]
# status and export look at a running swarm from outside
WatchedSwarmOpt = Annotated[
    list[str], typer.Option("--initial-peers", help="Multiaddr of a peer in the swarm; repeatable.")
]
SwarmNameOpt = Annotated[
    str | None,
    typer.Option(
        "--swarm",
        help="The swarm's name, as `swarmloco run --swarm` (default: from --config or --credentials, else swarmloco).",
    ),
]
CheckedConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="The swarm's swarm.toml: checked against the config the swarm runs.")
]
RevocationsOpt = Annotated[
    Path | None,
    typer.Option(
        "--revocations",
        help="Private swarms: the authority's signed revocation list (`swarmloco swarm revoke`); re-read while the "
        "peer runs, and passed on to the swarm through the DHT.",
    ),
]


@app.command("run")
@user_errors
def run_cmd(
    role: Annotated[
        Role,
        typer.Option(
            help="auto (what the swarm needs most: a server of an unserved stage, else a trainer if there is none, "
            "else full if the whole model fits and every stage has two idle servers, else a server of the bottleneck "
            "stage), trainer (stage 0: data, embedding, loss), stage (a server "
            "of one middle stage) or full (the whole model trained on its own data, one more replica of every stage in "
            "the outer rounds, sent no microbatches unless it gives --serve)."
        ),
    ] = "auto",
    serve: Annotated[
        bool,
        typer.Option(
            "--serve",
            help="Full peers: also serve stages 1..S to trainers, on the weights it trains (routing then counts it as "
            "a server of each); stage 0 stays the trainers' own.",
        ),
    ] = False,
    stage: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Stage servers: the stage to serve, pinned there unless --rebalance-period is given (default: the one with fewest replicas).",
        ),
    ] = None,
    initial_peers: Annotated[
        list[str] | None,
        typer.Option("--initial-peers", help="Multiaddr of a peer in the swarm; repeatable. None: create a new swarm."),
    ] = None,
    config: ConfigOpt = None,
    data: DataOpt = None,
    tokenizer: TokenizerOpt = None,
    data_shard: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Trainers: the data shard to read, 0..data.shards-1 (default: derived from the peer id; two trainers "
            "may then share one, with probability 1/data.shards).",
        ),
    ] = None,
    steps: Annotated[int, typer.Option(min=1, help="Trainers: inner steps of stage 0 to run.")] = 100,
    host_maddrs: Annotated[
        list[str] | None, typer.Option("--host-maddrs", help="Multiaddrs to listen on (default /ip4/0.0.0.0/tcp/0).")
    ] = None,
    announce_maddrs: Annotated[
        list[str] | None,
        typer.Option("--announce-maddrs", help="Public multiaddrs to announce (behind NAT with a forwarded port)."),
    ] = None,
    reachability: Annotated[
        ReachabilityMode,
        typer.Option(
            help="How others reach this peer. public: at its addresses (a full DHT node, and a relay for peers behind "
            "NAT); relay: behind NAT, reached through a relay (the initial peers); client: behind NAT, a trainer that "
            "only calls out (its outer-round payloads leave through a relay); auto: relay when it listens only on "
            "private addresses, gives no --announce-maddrs and joins through peers on another network, else public.",
        ),
    ] = "auto",
    identity: Annotated[
        Path | None, typer.Option(help="libp2p key file for a stable peer id (created if missing).")
    ] = None,
    credentials: CredentialsOpt = None,
    revocations: RevocationsOpt = None,
    swarm: Annotated[
        str, typer.Option(help="Name of the swarm whose config to fetch when --config is not given.")
    ] = SwarmConfig().name,
    out: Annotated[Path | None, typer.Option(help="Append metrics to OUT/<name>.jsonl.")] = None,
    name: Annotated[str | None, typer.Option(help="This peer's name in logs and metrics.")] = None,
    seed: Annotated[int, typer.Option(help="Trainers: data stream offset (give each trainer its own).")] = 0,
    threads: Annotated[int, typer.Option(min=0, help="torch threads (0: torch's default).")] = 0,
    device: DeviceOpt = "auto",
    rebalance_period_s: Annotated[
        float | None,
        typer.Option(
            "--rebalance-period",
            min=0.0,
            help="Stage servers: seconds between rebalancing checks (± 20%); 0 never moves. Default: 30, or never for a server pinned with --stage.",
        ),
    ] = None,
    stage_checkpoint: Annotated[
        Path | None,
        typer.Option(
            help="Stage servers: a stage state file, loaded on start when the stage has no live replica (rollback instead of a rebuild from the neighbours). "
            "Trainers: stage 0's weights are written there when training ends (what `swarmloco local` exports)."
        ),
    ] = None,
    checkpoint_every: Annotated[
        int, typer.Option(min=0, help="Stage servers: write --stage-checkpoint every N inner steps (0: never write).")
    ] = 0,
    eval_every: Annotated[
        int, typer.Option(min=0, help="Trainers: validation pass every N inner steps (0: only at the end).")
    ] = 0,
    in_flight: Annotated[
        int,
        typer.Option(
            min=1,
            help="Trainers: the most microbatches in flight at once, across inner steps (the window's cap; the window "
            "itself follows round trip × delivery rate); 1 is the synchronous pipeline.",
        ),
    ] = TrainerOptions().in_flight,
    max_staleness: Annotated[
        int,
        typer.Option(
            min=0,
            help="Trainers: inner steps a microbatch may land after its forward began; staler ones are not started, "
            "or their gradients are dropped (counted). 0 keeps the window within an inner step (no staleness); "
            "more lets it span steps: faster over slow links, at a quality cost (docs/benchmarks.md).",
        ),
    ] = TrainerOptions().max_staleness,
    wait_for_replicas: Annotated[
        int,
        typer.Option(
            min=0,
            help="Trainers and full peers: start training once this many replicas of stage 0 (trainers and full "
            "peers, this one included) are listed, so replicas started together meet from their first round (at "
            "most 120 s).",
        ),
    ] = 0,
    faults: Annotated[
        str | None,
        typer.Option(help="Tests: PEER@step=N,… — the peer of that --name dies (SIGKILL) at its own inner step N."),
    ] = None,
) -> None:
    """Start one peer of a swarm over the network; SIGINT/SIGTERM retire its DHT records and exit."""
    # every option but the swarm-wide ones is a PeerConfig field (or a trainer option) of the same name
    per_peer = {option: value for option, value in locals().items() if option not in ("config", "revocations", "swarm")}
    from peer.launch import run_peer
    from swarm.dht.membership import MembershipError
    from swarm.peer_config import PeerConfig

    creds = swarm_credentials(credentials, identity, revocations, config)
    try:
        peer = PeerConfig.from_flat({**per_peer, "credentials": creds, "swarm_name": swarm_name(creds, swarm)})
        run_peer(peer, config=config, echo=typer.echo)
    except (ValueError, MembershipError) as e:
        fail(str(e))


@app.command("status")
@user_errors
def status_cmd(
    initial_peers: WatchedSwarmOpt,
    swarm: SwarmNameOpt = None,
    config: CheckedConfigOpt = None,
    credentials: CredentialsOpt = None,
    identity: Annotated[
        Path | None,
        typer.Option(
            help="Private swarms: the identity the certificate names; not one a running peer uses (invite one for monitoring)."
        ),
    ] = None,
    revocations: RevocationsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
) -> None:
    """Peers per stage, their throughput, queues and outer rounds, read from the swarm's DHT."""
    from peer.status import format_status, read_status

    cfg, creds, name = watched_swarm(swarm, config, credentials, identity, revocations)
    status = asyncio.run(
        read_status(initial_peers, cfg, name=name, identity_path=str(identity) if identity else None, credentials=creds)
    )
    typer.echo(json.dumps(status) if as_json else format_status(status))


@app.command("export")
@user_errors
def export_cmd(
    initial_peers: Annotated[
        list[str] | None,
        typer.Option("--initial-peers", help="Export a running swarm: multiaddr of a peer in it; repeatable."),
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint", help="Export a saved model instead: a model.pt of train-local, `swarmloco local` or export."
        ),
    ] = None,
    format: Annotated[
        ExportFormat,
        typer.Option(
            "--format",
            help="pt: one swarmloco checkpoint (what `swarmloco eval` and `sample` load); hf: a Hugging Face LLaMA "
            "folder (config.json, model.safetensors, the tokenizer if given) that transformers loads.",
        ),
    ] = "pt",
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="File (pt) or folder (hf) to write. Default: model.pt / model-hf."),
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            help="--format hf: the model's tokenizer file (tokenizers JSON), written as tokenizer.json. "
            "Without it (the default byte tokenizer) no tokenizer is written."
        ),
    ] = None,
    swarm: SwarmNameOpt = None,
    config: CheckedConfigOpt = None,
    credentials: CredentialsOpt = None,
    identity: Annotated[
        Path | None,
        typer.Option(help="Private swarms: the identity the certificate names; not one a running peer uses."),
    ] = None,
    revocations: RevocationsOpt = None,
    timeout: Annotated[float, typer.Option(min=1.0, help="Seconds allowed for each stage's download.")] = 60.0,
) -> None:
    """Write a model from a running swarm (every middle stage from a live server, stage 0 from a trainer) or from a
    saved checkpoint, as one checkpoint or a Hugging Face folder."""
    from peer.export import DEFAULT_OUT, export_checkpoint, export_swarm
    from swarm.errors import ExportError

    out = out or DEFAULT_OUT[format]
    try:
        if checkpoint is not None:
            watch_options = {"--initial-peers": initial_peers, "--swarm": swarm, "--config": config}
            watch_options |= {"--credentials": credentials, "--identity": identity, "--revocations": revocations}
            given = [option for option, value in watch_options.items() if value]
            if given:
                fail(
                    f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for a running swarm, not --checkpoint: give one source"
                )
            export_checkpoint(checkpoint, out, format=format, tokenizer=tokenizer, on_progress=typer.echo)
            return
        if not initial_peers:
            fail("nothing to export: give --initial-peers MADDR (a running swarm) or --checkpoint FILE (a saved model)")
        cfg, creds, name = watched_swarm(swarm, config, credentials, identity, revocations)
        asyncio.run(
            export_swarm(
                initial_peers,
                cfg,
                out,
                name=name,
                format=format,
                tokenizer=tokenizer,
                identity_path=str(identity) if identity else None,
                credentials=creds,
                timeout_s=timeout,
                on_progress=typer.echo,
            )
        )
    except ExportError as e:
        fail(f"cannot export: {e}")


@app.command("local")
@user_errors
def local_cmd(
    peers: Annotated[
        int,
        typer.Option(
            min=0,
            help="Pipeline peer processes in all (trainers + stage servers; full peers extra; 0 with --trainers 0: "
            "full peers only).",
        ),
    ] = 3,
    stages: Annotated[int, typer.Option(min=1, help="Middle stages S.")] = 2,
    trainers: Annotated[int, typer.Option(min=0, help="How many of the peers are trainers.")] = 1,
    steps: Annotated[int, typer.Option(min=1, help="Inner steps per trainer.")] = 100,
    config: ConfigOpt = None,
    data: DataOpt = None,
    tokenizer: TokenizerOpt = None,
    out: Annotated[Path, typer.Option(help="Logs, metrics (<peer>.jsonl) and swarm.toml go here.")] = Path(
        "runs/local"
    ),
    joiners: Annotated[
        int,
        typer.Option(min=0, help="Extra peers that join mid-run with --role auto (downloading their stage's state)."),
    ] = 0,
    join_after: Annotated[
        float, typer.Option(min=0.0, help="Seconds after the trainers start training that the joiners start.")
    ] = 30.0,
    full: Annotated[
        int,
        typer.Option(
            "--full",
            min=0,
            help="Extra full peers: each trains the whole model on its own data shard and joins every stage's outer "
            "rounds.",
        ),
    ] = 0,
    device: DeviceOpt = "auto",
) -> None:
    """Run a whole swarm of separate peer processes on this machine (loopback) until its trainers (and full peers)
    finish; trainers and full peers read distinct data shards."""
    from peer.launch import LocalSwarm, launch_local

    try:
        layout = LocalSwarm(
            peers=peers,
            stages=stages,
            trainers=trainers,
            steps=steps,
            joiners=joiners,
            join_after_s=join_after,
            full=full,
        )
    except ValueError as e:
        fail(str(e))
    cfg, _ = config_with_tokenizer(config, tokenizer)
    raise typer.Exit(
        launch_local(
            layout,
            out=out,
            config=cfg,
            data=data,
            tokenizer=tokenizer,
            extra_args=["--device", device],
            echo=typer.echo,
            schedule_set=sets_field(config, "inner.total_steps"),
        )
    )
