"""``swarmloco swarm create/identity/invite/revoke``: a swarm's config; private swarms, whose authority key admits peers.

$ swarmloco swarm create --name demo --private --out demo
$ swarmloco swarm create --name demo --out demo --tokenizer tok.json --data-shards 8   # a BPE swarm, sharded data
$ swarmloco swarm identity -o peer.id
$ swarmloco swarm invite --authority demo/authority.key --config demo/swarm.toml --peer-id 12D3… -o a.cert
$ swarmloco swarm revoke --authority demo/authority.key --config demo/swarm.toml --peer-id 12D3…
"""

from pathlib import Path
from typing import Annotated

import typer

from peer.cli_common import TokenizerOpt, app, user_errors
from swarm.config import SwarmConfig, derive_config
from swarm.config_toml import load_config

swarm_app = typer.Typer(
    help="Private swarms: an authority key admits peers by signed certificate.", no_args_is_help=True
)
app.add_typer(swarm_app, name="swarm")

AuthorityOpt = Annotated[
    Path, typer.Option("--authority", help="The swarm's authority.key (written by `swarm create --private`).")
]
SwarmTomlOpt = Annotated[
    Path, typer.Option("--config", help="The swarm's swarm.toml: names the swarm the certificate is for.")
]
PeerIdOpt = Annotated[
    str, typer.Option("--peer-id", help="The peer's libp2p id, as `swarmloco swarm identity` prints it.")
]


@swarm_app.command("create")
@user_errors
def swarm_create(
    name: Annotated[str, typer.Option(help="Swarm name: letters, digits, '-' and '_'.")],
    out: Annotated[Path, typer.Option(help="Directory for swarm.toml and, if private, the authority keys.")],
    private: Annotated[
        bool,
        typer.Option(
            "--private/--public", help="Private: only peers with a certificate from this swarm's authority may join."
        ),
    ] = False,
    tokenizer: TokenizerOpt = None,
    data_shards: Annotated[
        int,
        typer.Option(min=1, help="Trainers read 1/N of the training documents each (data.shards; 1: all of them)."),
    ] = 1,
) -> None:
    """Create a swarm: its config and, for a private swarm, the authority key that admits peers."""
    from peer.credentials import AUTHORITY_KEY, AUTHORITY_PUB, CONFIG_FILE, create_swarm
    from peer.tokenizer import load_tokenizer, with_tokenizer

    tok = load_tokenizer(tokenizer)
    base = derive_config(with_tokenizer(SwarmConfig(), tok), {"data.shards": data_shards})
    cfg = create_swarm(name, out, private=private, base=base)
    typer.echo(f"swarm {cfg.swarm_id}: wrote {out / CONFIG_FILE}")
    if tokenizer is not None:
        typer.echo(
            f"tokenizer: BPE of {tok.vocab_size} ids (model.vocab_size), sha256 {tok.sha256}; every trainer runs "
            f"with --tokenizer {tokenizer} (the same file)"
        )
    if private:
        typer.echo(
            f"authority: {out / AUTHORITY_KEY} (secret: keep it offline and backed up), {out / AUTHORITY_PUB}\n"
            f"admit a peer: swarmloco swarm invite --authority {out / AUTHORITY_KEY} --config {out / CONFIG_FILE} "
            f"--peer-id <its `swarmloco swarm identity`> -o peer.cert"
        )


@swarm_app.command("identity")
@user_errors
def swarm_identity(
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Identity file (libp2p private key): created if missing, else read.")
    ],
) -> None:
    """Print the peer id of an identity file, creating it first if needed; the swarm's authority invites this id."""
    from peer.credentials import new_identity, peer_id_of_identity

    if out.exists():
        typer.echo(peer_id_of_identity(out))
    else:
        typer.echo(new_identity(out))
        typer.echo(f"created {out}; run the peer with --identity {out}", err=True)


@swarm_app.command("invite")
@user_errors
def swarm_invite(
    authority: AuthorityOpt,
    config: SwarmTomlOpt,
    peer_id: PeerIdOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Certificate file to write (the peer's --credentials).")],
    days: Annotated[
        float, typer.Option(help="Validity in days, from one minute (0.0007) to 100 years (36525).")
    ] = 30.0,
) -> None:
    """Admit a peer to a private swarm: sign a certificate for its peer id."""
    from peer.credentials import invite
    from swarm.rpc.auth import format_time

    cert = invite(authority, load_config(config).swarm_id, peer_id, days=days, out=out)
    typer.echo(f"wrote {out}: peer {cert.peer_id} may join {cert.swarm_id} until {format_time(cert.expires_at)}")


@swarm_app.command("revoke")
@user_errors
def swarm_revoke(
    authority: AuthorityOpt,
    config: SwarmTomlOpt,
    peer_id: PeerIdOpt,
    revocations: Annotated[
        Path | None,
        typer.Option(
            "--list", help="Signed revocation list to extend (default: revocations.json beside the authority key)."
        ),
    ] = None,
) -> None:
    """Void a peer's certificates issued until now, in the swarm's signed revocation list."""
    from peer.credentials import REVOCATIONS, revoke

    path = revocations or authority.parent / REVOCATIONS
    updated = revoke(authority, load_config(config).swarm_id, peer_id, revocations=path)
    typer.echo(
        f"revoked {peer_id}: wrote {path} (list #{updated.sequence}, {len(updated.revoked)} peers); give it to one "
        f"running peer (replace its --revocations file) or start one with it: the swarm's peers pass it on"
    )
