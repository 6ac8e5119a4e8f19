"""Commands that join or start a swarm over the network: run, status, export, local.

$ swarmloco run --initial-peers /ip4/…/p2p/12D3… --role auto
$ swarmloco status --initial-peers /ip4/…/p2p/12D3…
$ swarmloco export --initial-peers /ip4/…/p2p/12D3… -o model.pt   # the model of a running swarm
$ swarmloco export --checkpoint runs/local/model.pt --format hf -o model-hf   # a folder transformers loads
$ swarmloco local --peers 3 --stages 2 --steps 100
"""

import asyncio
import json
import typing
from pathlib import Path
from typing import Annotated

import typer

from peer.cli_common import (
    ConfigOpt,
    app,
    config_with_tokenizer,
    fail,
    swarm_credentials,
    swarm_name,
    user_errors,
    watched_swarm,
)
from peer.config_options import ConfigOverrides, config_options, field_options, from_options
from peer.export import ExportFormat
from peer.local_swarm import LocalSwarm
from swarm.config import SwarmConfig
from swarm.config_toml import sets_field
from swarm.node.config import PeerConfig

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
@config_options(*field_options(PeerConfig), into="options")
def run_cmd(
    config: ConfigOpt = None,
    credentials: CredentialsOpt = None,
    revocations: RevocationsOpt = None,
    swarm: Annotated[
        str, typer.Option(help="Name of the swarm whose config to fetch when --config is not given.")
    ] = SwarmConfig().name,
    options: ConfigOverrides = None,
) -> None:
    """Start one peer of a swarm over the network; SIGINT/SIGTERM retire its DHT records and exit."""
    from peer.launch import run_peer
    from swarm.dht.membership import MembershipError

    per_peer = dict(options or {})
    creds = swarm_credentials(credentials, typing.cast(Path | None, per_peer.get("identity")), revocations, config)
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


LOCAL_PEER_FIELDS = ("data", "tokenizer", "device", "compile")  # `swarmloco run` options every local peer is given


@app.command("local")
@user_errors
@config_options(*field_options(PeerConfig, only=LOCAL_PEER_FIELDS), into="peer_options")
@config_options(*field_options(LocalSwarm), into="layout_options")
def local_cmd(
    layout_options: ConfigOverrides = None,
    config: ConfigOpt = None,
    out: Annotated[Path, typer.Option(help="Logs, metrics (<peer>.jsonl) and swarm.toml go here.")] = Path(
        "runs/local"
    ),
    peer_options: ConfigOverrides = None,
) -> None:
    """Run a whole swarm of separate peer processes on this machine (loopback) until its trainers (and full peers)
    finish; trainers and full peers read distinct data shards."""
    from peer.launch import launch_local

    try:
        layout = from_options(LocalSwarm, layout_options)  # its fields are the layout options (peer/local_swarm.py)
        peer = PeerConfig.from_flat(peer_options or {})
    except ValueError as e:
        fail(str(e))
    cfg, _ = config_with_tokenizer(config, peer.tokenizer)
    raise typer.Exit(
        launch_local(
            layout,
            out=out,
            config=cfg,
            peer=peer,
            echo=typer.echo,
            schedule_set=sets_field(config, "inner.total_steps"),
        )
    )
