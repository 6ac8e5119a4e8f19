"""What every ``swarmloco`` command shares: the typer app, common options and user-error handling.

The commands live in peer/commands/ and register on ``app`` when peer.cli imports them.
"""

import functools
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

from peer import logs
from peer.data import DataError
from peer.progress import elapsed_and_eta
from peer.tokenizer import Tokenizer, TokenizerError, config_and_tokenizer
from swarm.config import SwarmConfig
from swarm.config_toml import load_config
from swarm.errors import ConfigError
from swarm.hardware import DEVICE_HELP
from swarm.model.sizing import StageDoesNotFit
from swarm.recovery.checkpoint import CheckpointError

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
        help="Text files, directories or globs (.txt .md .py .rst .jsonl), parquet or arrow tables and `datasets` "
        "save_to_disk folders (a 'text' column; needs swarmloco\\[data]); repeatable. Default: this Python's "
        "standard-library sources.",
    ),
]
TokenizerOpt = Annotated[
    Path | None,
    typer.Option(
        "--tokenizer",
        help="The BPE tokenizer file the swarm config names (`swarmloco tokenizer train`); default: the byte tokenizer.",
    ),
]

DeviceOpt = Annotated[str, typer.Option("--device", help=DEVICE_HELP)]

LogLevelOpt = Annotated[
    logs.LogLevel,
    typer.Option(
        "--log-level",
        help="What to log to stderr: debug (hivemind's internals too), info (failed calls, bans, rebalancing, "
        "recoveries, outer rounds left out), warning, error.",
    ),
]

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger(__name__)
USER_ERRORS = (ConfigError, DataError, CheckpointError, StageDoesNotFit, TokenizerError)


def fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def user_errors(fn: F) -> F:
    """Give a command ``--log-level`` (configured before it runs) and turn the errors a user can fix into one clear
    line and exit status 2, not a traceback."""

    @functools.wraps(fn)  # typer reads the options from the wrapped signature
    def wrapper(*args: Any, log_level: logs.LogLevel = logs.DEFAULT_LEVEL, **kwargs: Any) -> Any:
        logs.configure(log_level)
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            fail(str(e))
        except (typer.Exit, typer.Abort):
            raise
        except Exception as e:
            # a path the user gave that cannot be used (a file where a folder must be, no permission); an OSError
            # about no path (a refused connection, a busy port) is a bug or the network's and keeps its traceback
            if isinstance(e, OSError) and e.filename is not None:
                logger.debug("%s failed on a path", fn.__name__, exc_info=True)  # the traceback, for --log-level debug
                fail(path_error(e))
            if not isinstance(e, swarm_user_errors()):
                raise
            fail(str(e))

    # the command's own options, then --log-level: one place gives it to every command
    signature = inspect.signature(fn)
    level = inspect.Parameter(
        "log_level", inspect.Parameter.KEYWORD_ONLY, default=logs.DEFAULT_LEVEL, annotation=LogLevelOpt
    )
    wrapper.__signature__ = signature.replace(parameters=[*signature.parameters.values(), level])  # type: ignore[attr-defined]  # typer reads it; typeshed's functions have no __signature__
    wrapper.__annotations__ = {**fn.__annotations__, "log_level": LogLevelOpt}
    return wrapper  # type: ignore[return-value]  # fn's own type: the same command, with --log-level added


def path_error(e: OSError) -> str:
    """An OSError about a path (a missing folder, a file where a folder must be, no permission) as one line."""
    reason = e.strerror or type(e).__name__
    if isinstance(e, FileExistsError) and Path(e.filename).exists() and not Path(e.filename).is_dir():
        return f"cannot create {e.filename}: a file of that name exists where a folder is needed"
    if e.filename2 is not None:
        return f"cannot move {e.filename} to {e.filename2}: {reason}"
    return f"cannot access {e.filename}: {reason}"


def swarm_user_errors() -> tuple[type[Exception], ...]:
    """User errors of modules that load hivemind: looked up once something failed, so other commands start fast."""
    from swarm.dht.membership import MembershipError
    from swarm.dht.start import JoinError
    from swarm.rpc.auth import AccessDenied, CredentialError

    return JoinError, AccessDenied, CredentialError, MembershipError


def progress_line(step: int, total: int, record: dict[str, float]) -> str:
    width = 24
    filled = round(width * step / total)
    tok_s = record["tokens"] / max(record["elapsed_s"], 1e-9)
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{total}  train {record['train_loss']:.3f}  "
        f"val {record['val_loss']:.3f}  {tok_s / 1000:.1f}k tok/s  "
        f"{elapsed_and_eta(record['elapsed_s'], done=step, total=total)}"
    )


def config_or_default(path: Path | None) -> SwarmConfig:
    return load_config(path) if path else SwarmConfig()


def config_with_tokenizer(path: Path | None, tokenizer: Path | None) -> tuple[SwarmConfig, Tokenizer]:
    """The config in ``path`` and the ``--tokenizer`` it names (checked), or the built-in config with that tokenizer."""
    return config_and_tokenizer(load_config(path) if path else None, tokenizer)


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


def watched_swarm(
    swarm: str | None, config: Path | None, credentials: Path | None, identity: Path | None, revocations: Path | None
) -> "tuple[SwarmConfig | None, PeerCredentials | None, str]":
    """What status, export and dashboard look at a running swarm with: the config to check it against (if given), a
    private swarm's credentials, and the swarm's name (``--swarm``, else from the config or credentials)."""
    cfg = load_config(config) if config else None
    creds = swarm_credentials(credentials, identity, revocations, config)
    return cfg, creds, swarm or (cfg.name if cfg else swarm_name(creds, SwarmConfig().name))


def swarm_name(credentials: "PeerCredentials | None", default: str) -> str:
    """The name of the swarm the credentials admit to (its id is ``<name>-<config hash>``), else ``default``."""
    return default if credentials is None else credentials.verifier.swarm_id.rsplit("-", 1)[0]
