"""The dashboard command: a live web page of a running swarm (``peer/dashboard/``).

$ swarmloco dashboard --initial-peers /ip4/…/p2p/12D3… [--port 8080]   # then open http://127.0.0.1:8080/
"""

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from peer.cli_common import app, fail, user_errors, watched_swarm
from peer.commands.swarm import CheckedConfigOpt, CredentialsOpt, RevocationsOpt, SwarmNameOpt, WatchedSwarmOpt


@app.command("dashboard")
@user_errors
def dashboard_cmd(
    initial_peers: WatchedSwarmOpt,
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="HTTP port (0: any free one; the URL is printed).")
    ] = 8080,
    host: Annotated[str, typer.Option(help="Address to serve on (0.0.0.0: every interface).")] = "127.0.0.1",
    swarm: SwarmNameOpt = None,
    config: CheckedConfigOpt = None,
    credentials: CredentialsOpt = None,
    identity: Annotated[
        Path | None,
        typer.Option(help="Private swarms: the identity the certificate names; not one a running peer uses."),
    ] = None,
    revocations: RevocationsOpt = None,
    history: Annotated[
        str | None,
        typer.Option(
            help="SQLite file that keeps the curves, events and peers across restarts "
            "(default: swarmloco-dashboard-<swarm id>.sqlite here; '' or none: memory only).",
        ),
    ] = None,
    poll: Annotated[
        float | None,
        typer.Option("--poll-s", min=0.1, help="Seconds between snapshots (default: the swarm's announce period)."),
    ] = None,
) -> None:
    """Serve a live web page of the swarm: loss against tokens, peers, traffic, events, a health verdict, /metrics."""
    from peer.dashboard import DashboardError
    from peer.dashboard.server import serve

    cfg, creds, name = watched_swarm(swarm, config, credentials, identity, revocations)
    try:
        asyncio.run(
            serve(
                initial_peers,
                cfg,
                name=name,
                identity_path=str(identity) if identity else None,
                credentials=creds,
                host=host,
                port=port,
                history_option=history,
                poll_s=poll,
                echo=lambda line: typer.echo(line),
            )
        )
    except DashboardError as e:
        fail(str(e))
