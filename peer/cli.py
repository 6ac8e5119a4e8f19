"""The ``swarmloco`` command line (also ``python -m peer``).

    $ swarmloco train-local --steps 300 --out runs/baseline
    $ swarmloco eval --checkpoint runs/baseline/model.pt
    $ swarmloco sample --checkpoint runs/baseline/model.pt --prompt "def " --tokens 200
"""

import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import torch
import typer

from peer.data import DataError, decode, encode, load_corpus
from swarm.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from swarm.config import SwarmConfig, load_config
from swarm.errors import ConfigError

app = typer.Typer(
    help="swarmloco: train a language model together over ordinary internet links.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="Swarm config TOML (default: the built-in tiny model).")]
DataOpt = Annotated[list[str] | None, typer.Option("--data", help="Text files, directories or globs (.txt .md .py .rst .jsonl); repeatable. Default: this Python's standard-library sources.")]
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

    return wrapper  # type: ignore[return-value]


def progress_line(step: int, total: int, record: dict[str, float]) -> str:
    width = 24
    filled = round(width * step / total)
    tok_s = record["tokens"] / max(record["elapsed_s"], 1e-9)
    return (f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{total}  train {record['train_loss']:.3f}  "
            f"val {record['val_loss']:.3f}  {tok_s / 1000:.1f}k tok/s  {record['elapsed_s']:.0f}s")


def config_or_default(path: Path | None) -> SwarmConfig:
    return load_config(path) if path else SwarmConfig()


@app.command("train-local")
@user_errors
def train_local(
    config: ConfigOpt = None,
    data: DataOpt = None,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps (each inner_batch samples).")] = 300,
    out: Annotated[Path, typer.Option(help="Output directory for metrics.jsonl and model.pt.")] = Path("runs/train-local"),
    log_every: Annotated[int, typer.Option(min=1, help="Evaluate and log every N steps.")] = 25,
) -> None:
    """Train the swarm's model in one process: the centralized baseline every swarm run is compared to."""
    from swarm.centralized import train_centralized

    cfg = config_or_default(config)
    cfg = dataclasses.replace(cfg, inner=dataclasses.replace(cfg.inner, total_steps=steps))
    torch.manual_seed(cfg.train.seed)
    corpus = load_corpus(data)
    batches = corpus.sample_batches("train", batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, seed=cfg.train.seed)
    val = corpus.val_batches(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, num_batches=VAL_BATCHES)
    out.mkdir(parents=True, exist_ok=True)
    typer.echo(f"train-local: {len(corpus.train) / 1e6:.1f} MB train / {len(corpus.val) / 1e6:.2f} MB val text "
               f"from {corpus.num_files} files, {steps} steps → {out}")
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
    from swarm.centralized import evaluate

    cfg, model, _ = load_checkpoint(checkpoint)
    corpus = load_corpus(data)
    val = corpus.val_batches(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, num_batches=VAL_BATCHES)
    model.eval()
    started = time.perf_counter()
    loss = evaluate(model, val)
    result = {"checkpoint": str(checkpoint), "val_loss": loss, "val_tokens": sum(x.numel() for x, _ in val),
              "eval_s": time.perf_counter() - started}
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
    from swarm.model import generate

    _, model, _ = load_checkpoint(checkpoint)
    model.eval()
    if not prompt:
        fail("--prompt must not be empty")
    out = generate(model, encode(prompt), tokens, temperature=temperature, seed=seed)
    typer.echo(decode(out))


def main() -> None:
    app(prog_name="swarmloco")


if __name__ == "__main__":
    sys.exit(main())
