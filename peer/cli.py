"""The ``swarmloco`` command line (also ``python -m peer``).

$ swarmloco train-local --steps 300 --out runs/baseline
$ swarmloco eval --checkpoint runs/baseline/model.pt
$ swarmloco sample --checkpoint runs/baseline/model.pt --prompt "def " --tokens 200
$ swarmloco export --initial-peers /ip4/…/p2p/12D3… -o model.pt   # the model of a running swarm
"""

import asyncio
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import torch
import typer

from peer.config_options import ConfigOption, ConfigOverrides, config_options
from peer.data import DataError, decode, encode, load_corpus
from swarm.config import OuterChoice, SwarmConfig, derive_config, load_config
from swarm.errors import ConfigError
from swarm.recovery.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from peer.credentials import PeerCredentials  # loads hivemind: imported where used

app = typer.Typer(
    help="swarmloco: train a language model together over ordinary internet links.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="Swarm config TOML (default: the built-in tiny model).")
]
DataOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--data",
        help="Text files, directories or globs (.txt .md .py .rst .jsonl); repeatable. Default: this Python's standard-library sources.",
    ),
]
CheckpointOpt = Annotated[Path, typer.Option("--checkpoint", help="A model.pt written by train-local or export.")]

F = TypeVar("F", bound=Callable[..., Any])
USER_ERRORS = (ConfigError, DataError, CheckpointError)
VAL_BATCHES = 16


def fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def user_errors(fn: F) -> F:
    """Turn the errors a user can fix into one clear line and exit status 2, not a traceback."""

    @functools.wraps(fn)  # typer reads the options from the wrapped signature
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            fail(str(e))
        except (typer.Exit, typer.Abort):
            raise
        except Exception as e:
            if not isinstance(e, swarm_user_errors()):
                raise
            fail(str(e))

    return wrapper  # type: ignore[return-value]


def swarm_user_errors() -> tuple[type[Exception], ...]:
    """User errors of modules that load hivemind: looked up once something failed, so other commands start fast."""
    from swarm.dht.membership import MembershipError
    from swarm.rpc.admission import JoinError
    from swarm.rpc.auth import AccessDenied, CredentialError

    return JoinError, AccessDenied, CredentialError, MembershipError


def progress_line(step: int, total: int, record: dict[str, float]) -> str:
    width = 24
    filled = round(width * step / total)
    tok_s = record["tokens"] / max(record["elapsed_s"], 1e-9)
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{total}  train {record['train_loss']:.3f}  "
        f"val {record['val_loss']:.3f}  {tok_s / 1000:.1f}k tok/s  {record['elapsed_s']:.0f}s"
    )


def config_or_default(path: Path | None) -> SwarmConfig:
    return load_config(path) if path else SwarmConfig()


@app.command("train-local")
@user_errors
def train_local(
    config: ConfigOpt = None,
    data: DataOpt = None,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps (each inner_batch samples).")] = 300,
    out: Annotated[Path, typer.Option(help="Output directory for metrics.jsonl and model.pt.")] = Path(
        "runs/train-local"
    ),
    log_every: Annotated[int, typer.Option(min=1, help="Evaluate and log every N steps.")] = 25,
) -> None:
    """Train the swarm's model in one process: the centralized baseline every swarm run is compared to."""
    from swarm.sim.centralized import train_centralized

    cfg = derive_config(config_or_default(config), {"inner.total_steps": steps})
    torch.manual_seed(cfg.train.seed)
    corpus = load_corpus(data)
    batches = corpus.sample_batches(
        "train", batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, seed=cfg.train.seed
    )
    val = corpus.val_batches(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, num_batches=VAL_BATCHES)
    out.mkdir(parents=True, exist_ok=True)
    typer.echo(
        f"train-local: {len(corpus.train) / 1e6:.1f} MB train / {len(corpus.val) / 1e6:.2f} MB val text "
        f"from {corpus.num_files} files, {steps} steps → {out}"
    )
    with (out / "metrics.jsonl").open("w") as log:

        def on_log(record: dict[str, float]) -> None:
            log.write(json.dumps(record) + "\n")
            log.flush()
            typer.echo(progress_line(int(record["step"]), steps, record))

        model = train_centralized(cfg, batches, val, steps=steps, log_every=log_every, on_log=on_log)
    save_checkpoint(out / "model.pt", cfg, model, steps=steps)
    typer.echo(f"wrote {out / 'metrics.jsonl'} and {out / 'model.pt'}")


@app.command("eval")
@user_errors
def eval_cmd(
    checkpoint: CheckpointOpt,
    data: DataOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
) -> None:
    """Validation loss of a checkpoint on the held-out split of the corpus."""
    from swarm.sim.centralized import evaluate

    cfg, model, _ = load_checkpoint(checkpoint)
    corpus = load_corpus(data)
    val = corpus.val_batches(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, num_batches=VAL_BATCHES)
    model.eval()
    started = time.perf_counter()
    loss = evaluate(model, val)
    result = {
        "checkpoint": str(checkpoint),
        "val_loss": loss,
        "val_tokens": sum(x.numel() for x, _ in val),
        "eval_s": time.perf_counter() - started,
    }
    typer.echo(json.dumps(result) if as_json else f"val_loss {loss:.4f} over {result['val_tokens']} tokens")


@app.command("sample")
@user_errors
def sample(
    checkpoint: CheckpointOpt,
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "def ",
    tokens: Annotated[int, typer.Option(min=1, help="Bytes to generate.")] = 200,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.8,
    seed: int = 0,
) -> None:
    """Generate text from a checkpoint."""
    from swarm.model.transformer import generate

    _, model, _ = load_checkpoint(checkpoint)
    model.eval()
    if not prompt:
        fail("--prompt must not be empty")
    out = generate(model, encode(prompt), tokens, temperature=temperature, seed=seed)
    typer.echo(decode(out))


SIMULATE_CONFIG_OPTIONS = (
    ConfigOption(
        field="outer.inner_steps",
        flags=("--inner-steps", "-H"),
        help="H: inner steps between outer steps (default: config).",
        limits={"min": 1},
    ),
    ConfigOption(field="codecs.activations", flags=("--act-codec",), help="Activation codec (default: config)."),
    ConfigOption(
        field="codecs.gradients",
        flags=("--grad-codec",),
        help="Activation-gradient codec (default: the activation codec).",
    ),
    ConfigOption(
        field="codecs.pseudo_gradients",
        flags=("--pg-codec",),
        help="DiLoCo pseudo-gradient codec (SparseLoCo sends its own).",
        default="fp32",
    ),
    ConfigOption(
        field="paths.skip_ratio",
        flags=("--skip",),
        help="Skip ratio r: paths visit round((1-r)·S) stages.",
        limits={"min": 0.0, "max": 0.99},
    ),
    ConfigOption(
        field="paths.max_swaps", flags=("--swaps",), help="Max adjacent stage swaps per path.", limits={"min": 0}
    ),
    ConfigOption(
        field="model.subspace_rank",
        flags=("--subspace-rank",),
        help="k of the subspace-constrained model (default d/8 when a subspace codec is chosen).",
        limits={"min": 0},
    ),
)


@app.command("simulate")
@user_errors
@config_options(*SIMULATE_CONFIG_OPTIONS)
def simulate_cmd(
    config: ConfigOpt = None,
    data: DataOpt = None,
    replicas: Annotated[int, typer.Option("--replicas", "-k", min=1, help="Replicas per stage (and trainers).")] = 2,
    outer: Annotated[
        OuterChoice,
        typer.Option(
            help="ddp (fp32 gradient all-reduce every step), diloco, sparseloco, or none (replicas never sync)."
        ),
    ] = "sparseloco",
    overrides: ConfigOverrides = None,
    tokens: Annotated[int, typer.Option(min=1, help="Training tokens over all trainers.")] = 400_000,
    routing: Annotated[
        str, typer.Option(help="random: any replica per hop (SWARM); sticky: trainer k always uses replica k.")
    ] = "random",
    seed: int = 0,
    log_every: Annotated[int, typer.Option(min=1, help="Log every N ticks (one microbatch per trainer).")] = 25,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the result as JSON here.")] = None,
) -> None:
    """An in-process swarm (no network): K replicas per stage, random routing, codecs at every hop, inner and outer steps; counts the bytes that would cross the wire."""
    from swarm.sim.simulate import SimulationConfig, simulate

    base = config_or_default(config)
    cfg = derive_config(base, overrides, outer=outer)
    if cfg.model.subspace_rank != base.model.subspace_rank or "model.subspace_rank" in (overrides or {}):
        rank = cfg.model.subspace_rank
        typer.echo(f"model: subspace-constrained residual stream, k={rank} (d/k={cfg.model.d_model / max(rank, 1):g})")
    sim = SimulationConfig(
        replicas=replicas,
        mode="ddp" if outer == "ddp" else "outer",
        tokens=tokens,
        seed=seed,
        log_every=log_every,
        routing=routing,
    )
    corpus = load_corpus(data)
    streams = [
        corpus.sample_batches(
            "train", batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, seed=cfg.train.seed + 1000 * k
        )
        for k in range(replicas)
    ]
    val = corpus.val_batches(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, num_batches=VAL_BATCHES)
    typer.echo(
        f"simulate: {replicas} replicas × {cfg.stages.num_stages + 1} stages, outer={outer} H={cfg.outer.inner_steps}, "
        f"codecs {cfg.codecs.activations}/{cfg.codecs.gradients}/{cfg.codecs.pseudo_gradients}, "
        f"skip={cfg.paths.skip_ratio} swaps={cfg.paths.max_swaps}, {tokens} tokens"
    )

    def on_log(record: dict[str, float]) -> None:
        typer.echo(
            f"tick {int(record['tick'])}  tokens {int(record['tokens'])}  train {record['train_loss']:.3f}  "
            f"val {record['val_loss']:.3f}  {record['bytes_per_token']:.1f} B/token  {record['elapsed_s']:.0f}s"
        )

    result = simulate(cfg, sim, streams, val, on_log=on_log)
    summary = {
        "val_loss": result.val_loss,
        "tokens": result.tokens,
        "ticks": result.ticks,
        "outer_rounds": result.outer_rounds,
        "wall_s": result.wall_s,
        "bytes_per_token": result.bytes_per_token,
        "bytes": result.bytes_by_kind,
        "skipped_stage_visits": result.skipped_stage_visits,
        "outer": outer,
        "replicas": replicas,
        "inner_steps": cfg.outer.inner_steps,
        "act_codec": cfg.codecs.activations,
        "skip": cfg.paths.skip_ratio,
        "swaps": cfg.paths.max_swaps,
        "config_hash": cfg.hash(),
        "log": result.log,
    }
    per = result.bytes_per_token
    typer.echo(
        f"val_loss {result.val_loss:.4f}  bytes/token: total {per['total']:.1f} = activations {per['activations']:.1f} "
        f"+ act-grads {per['activation_gradients']:.1f} + pseudo-grads {per['pseudo_gradients']:.3f} + ddp grads {per['gradients']:.1f}"
    )
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(summary, indent=1))
        typer.echo(f"wrote {json_out}")


CredentialsOpt = Annotated[
    Path | None,
    typer.Option(
        "--credentials", help="Private swarms: this peer's certificate (`swarmloco swarm invite`); needs --identity."
    ),
]
RevocationsOpt = Annotated[
    Path | None,
    typer.Option(
        "--revocations", help="Private swarms: the authority's signed revocation list (`swarmloco swarm revoke`)."
    ),
]


def swarm_credentials(
    certificate: Path | None, identity: Path | None, revocations: Path | None, config: Path | None
) -> "PeerCredentials | None":
    """A private-swarm peer's PeerCredentials, its own certificate checked before joining; None in a public swarm."""
    if certificate is None:
        if revocations is not None:
            fail("--revocations is for private swarms: pass --credentials too")
        return None
    if identity is None:
        fail("--credentials needs --identity: the identity file whose peer id the certificate names")
    if not certificate.is_file():
        fail(
            f"--credentials {certificate} does not exist: send your peer id (`swarmloco swarm identity --out {identity}`) "
            f"to the swarm's authority and run with the certificate it returns"
        )
    from peer.credentials import load_credentials
    from swarm.rpc.auth import Certificate

    # the certificate names its swarm: a peer joining without --config fetches that swarm's config
    swarm_id = load_config(config).swarm_id if config else Certificate.decode(certificate.read_bytes()).swarm_id
    return load_credentials(identity, certificate, swarm_id, revocations=revocations)


def swarm_name(credentials: "PeerCredentials | None", default: str) -> str:
    """The name of the swarm the credentials admit to (its id is ``<name>-<config hash>``), else ``default``."""
    return default if credentials is None else credentials.verifier.swarm_id.rsplit("-", 1)[0]


@app.command("run")
@user_errors
def run_cmd(
    role: Annotated[
        str,
        typer.Option(
            help="auto (what the swarm needs most: a server of an unserved stage, else a trainer if there is none, "
            "else a server of the bottleneck stage), trainer (stage 0: data, embedding, loss) or stage (a server of one middle stage)."
        ),
    ] = "auto",
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
    steps: Annotated[int, typer.Option(min=1, help="Trainers: inner steps of stage 0 to run.")] = 100,
    host_maddrs: Annotated[
        list[str] | None, typer.Option("--host-maddrs", help="Multiaddrs to listen on (default /ip4/0.0.0.0/tcp/0).")
    ] = None,
    announce_maddrs: Annotated[
        list[str] | None, typer.Option("--announce-maddrs", help="Public multiaddrs to announce (behind NAT).")
    ] = None,
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
            help="Stage servers: a stage state file, loaded on start when the stage has no live replica (rollback instead of a rebuild from the neighbours)."
        ),
    ] = None,
    checkpoint_every: Annotated[
        int, typer.Option(min=0, help="Stage servers: write --stage-checkpoint every N inner steps (0: never write).")
    ] = 0,
    eval_every: Annotated[
        int, typer.Option(min=0, help="Trainers: validation pass every N inner steps (0: only at the end).")
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
    initial_peers: Annotated[
        list[str], typer.Option("--initial-peers", help="Multiaddr of a peer in the swarm; repeatable.")
    ],
    name: Annotated[
        str | None, typer.Option(help="The swarm's name (default: from --config or --credentials, else swarmloco).")
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", help="The swarm's swarm.toml: checked against the config the swarm runs.")
    ] = None,
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

    cfg = load_config(config) if config else None
    creds = swarm_credentials(credentials, identity, revocations, config)
    name = name or (cfg.name if cfg else swarm_name(creds, SwarmConfig().name))
    status = asyncio.run(
        read_status(initial_peers, cfg, name=name, identity_path=str(identity) if identity else None, credentials=creds)
    )
    typer.echo(json.dumps(status) if as_json else format_status(status))


@app.command("export")
@user_errors
def export_cmd(
    initial_peers: Annotated[
        list[str], typer.Option("--initial-peers", help="Multiaddr of a peer in the swarm; repeatable.")
    ],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Checkpoint file to write (what `swarmloco eval` and `sample` load).")
    ] = Path("model.pt"),
    name: Annotated[
        str | None, typer.Option(help="The swarm's name (default: from --config or --credentials, else swarmloco).")
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", help="The swarm's swarm.toml: checked against the config the swarm runs.")
    ] = None,
    credentials: CredentialsOpt = None,
    identity: Annotated[
        Path | None,
        typer.Option(help="Private swarms: the identity the certificate names; not one a running peer uses."),
    ] = None,
    revocations: RevocationsOpt = None,
    timeout: Annotated[float, typer.Option(min=1.0, help="Seconds allowed for each stage's download.")] = 60.0,
) -> None:
    """Download the running swarm's model (every middle stage from a live server, stage 0 from a trainer) into one checkpoint."""
    from peer.export import export_swarm
    from swarm.export import ExportError

    cfg = load_config(config) if config else None
    creds = swarm_credentials(credentials, identity, revocations, config)
    name = name or (cfg.name if cfg else swarm_name(creds, SwarmConfig().name))
    try:
        asyncio.run(
            export_swarm(
                initial_peers,
                cfg,
                out,
                name=name,
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
    peers: Annotated[int, typer.Option(min=2, help="Peer processes in all (trainers + stage servers).")] = 3,
    stages: Annotated[int, typer.Option(min=1, help="Middle stages S.")] = 2,
    trainers: Annotated[int, typer.Option(min=1, help="How many of the peers are trainers.")] = 1,
    steps: Annotated[int, typer.Option(min=1, help="Inner steps per trainer.")] = 100,
    config: ConfigOpt = None,
    data: DataOpt = None,
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
) -> None:
    """Run a whole swarm of separate peer processes on this machine (loopback) until its trainers finish."""
    from peer.launch import LocalSwarm, launch_local

    try:
        layout = LocalSwarm(
            peers=peers, stages=stages, trainers=trainers, steps=steps, joiners=joiners, join_after_s=join_after
        )
    except ValueError as e:
        fail(str(e))
    raise typer.Exit(launch_local(layout, out=out, config=config_or_default(config), data=data, echo=typer.echo))


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
) -> None:
    """Create a swarm: its config and, for a private swarm, the authority key that admits peers."""
    from peer.credentials import AUTHORITY_KEY, AUTHORITY_PUB, CONFIG_FILE, create_swarm

    cfg = create_swarm(name, out, private=private)
    typer.echo(f"swarm {cfg.swarm_id}: wrote {out / CONFIG_FILE}")
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
    days: Annotated[float, typer.Option(help="Validity in days.")] = 30.0,
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
        f"revoked {peer_id}: wrote {path} (list #{updated.sequence}, {len(updated.revoked)} peers); hand it to every peer"
    )


def main() -> None:
    app(prog_name="swarmloco")


if __name__ == "__main__":
    sys.exit(main())
