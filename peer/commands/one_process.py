"""Commands that run in one process, no network: train-local, eval, sample, simulate.

$ swarmloco train-local --steps 300 --out runs/baseline   # --tokenizer tok.json: a BPE model
$ swarmloco eval --checkpoint runs/baseline/model.pt
$ swarmloco sample --checkpoint runs/baseline/model.pt --prompt "def " --tokens 200
$ swarmloco simulate --replicas 2 --outer sparseloco --tokens 400000
"""

import json
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

from peer.cli_common import (
    ConfigOpt,
    DataOpt,
    DeviceOpt,
    TokenizerOpt,
    app,
    config_with_tokenizer,
    fail,
    progress_line,
    user_errors,
)
from peer.config_options import ConfigOption, ConfigOverrides, config_options, field_options, from_options
from peer.data import decode, encode, load_corpus
from peer.progress import elapsed_and_eta
from peer.tokenizer import tokenizer_for
from swarm.config import OuterChoice, derive_config, follow_run
from swarm.config_toml import sets_field
from swarm.hardware import available_memory, describe, resolve_device
from swarm.model.sizing import StageFootprint, check_fits
from swarm.recovery.checkpoint import load_checkpoint, save_checkpoint
from swarm.sim.centralized import CentralizedRun
from swarm.sim.simulate import SimulationConfig

CheckpointOpt = Annotated[Path, typer.Option("--checkpoint", help="A model.pt written by train-local or export.")]


def fitting_device(spec: str, footprint: StageFootprint) -> torch.device:
    """The device ``spec`` names, after saying what the model needs there and refusing it if it does not fit."""
    device = resolve_device(spec)
    typer.echo(f"{describe(device)}: {footprint.describe()}")
    check_fits(footprint, available=available_memory(device), device=describe(device))
    return device


@app.command("train-local")
@user_errors
@config_options(*field_options(CentralizedRun), into="run_options")
def train_local(
    config: ConfigOpt = None,
    data: DataOpt = None,
    tokenizer: TokenizerOpt = None,
    run_options: ConfigOverrides = None,
    out: Annotated[Path, typer.Option(help="Output directory for metrics.jsonl and model.pt.")] = Path(
        "runs/train-local"
    ),
    device: DeviceOpt = "auto",
) -> None:
    """Train the swarm's model in one process: the centralized baseline every swarm run is compared to."""
    from swarm.sim.centralized import train_centralized

    run = from_options(CentralizedRun, run_options)  # its fields are the run's options (swarm/sim/centralized.py)
    steps, log_every = run.steps, run.log_every
    base, tok = config_with_tokenizer(config, tokenizer)
    cfg = follow_run(base, steps, schedule_set=sets_field(config, "inner.total_steps"))
    compute = fitting_device(device, StageFootprint.whole_model(cfg))
    torch.manual_seed(cfg.train.seed)
    corpus = load_corpus(data, tokenizer=tok)
    batches = corpus.sample_batches(
        "train", batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, seed=cfg.train.seed
    )
    val = corpus.val_batches(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
    out.mkdir(parents=True, exist_ok=True)
    typer.echo(
        f"train-local: {len(corpus.train) / 1e6:.1f}M train / {len(corpus.val) / 1e6:.2f}M val tokens ({tok.kind}) "
        f"from {corpus.num_files} files, {steps} steps → {out}"
    )
    with (out / "metrics.jsonl").open("w") as log:

        def on_log(record: dict[str, float]) -> None:
            log.write(json.dumps(record) + "\n")
            log.flush()
            if "compile_s" in record and record["step"] == min(log_every, steps):  # the first record
                typer.echo(f"train-local: torch.compile took {record['compile_s']:.1f}s (the blocks' first forward)")
            typer.echo(progress_line(int(record["step"]), steps, record))

        model = train_centralized(
            cfg, batches, val, steps=steps, log_every=log_every, on_log=on_log, device=compute, compile=run.compile
        )
    save_checkpoint(out / "model.pt", cfg, model, steps=steps)
    typer.echo(f"wrote {out / 'metrics.jsonl'} and {out / 'model.pt'}")


@app.command("eval")
@user_errors
def eval_cmd(
    checkpoint: CheckpointOpt,
    data: DataOpt = None,
    tokenizer: TokenizerOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
    device: DeviceOpt = "auto",
) -> None:
    """Validation loss of a checkpoint on the held-out split of the corpus."""
    from swarm.sim.centralized import evaluate

    cfg, model, _ = load_checkpoint(checkpoint)
    compute = resolve_device(device)
    model.to(compute)
    corpus = load_corpus(data, tokenizer=tokenizer_for(cfg, tokenizer))
    val = corpus.val_batches(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
    model.eval()
    started = time.perf_counter()
    loss = evaluate(model, val, device=compute, precision=cfg.train.precision)
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
    tokenizer: TokenizerOpt = None,
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "def ",
    tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")] = 200,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.8,
    seed: int = 0,
    device: DeviceOpt = "auto",
) -> None:
    """Generate text from a checkpoint."""
    from swarm.model.transformer import generate

    if not prompt:
        fail("--prompt must not be empty")
    cfg, model, _ = load_checkpoint(checkpoint)
    tok = tokenizer_for(cfg, tokenizer)
    model.to(resolve_device(device)).eval()
    out = generate(model, encode(prompt, tok), tokens, temperature=temperature, seed=seed)
    typer.echo(decode(out, tok))


SIMULATE_CONFIG_OPTIONS = (  # under the fields' own flags (-H, --act-codec, ...), help, limits and choices
    ConfigOption(field="outer.inner_steps"),
    ConfigOption(field="codecs.activations"),
    ConfigOption(field="codecs.gradients", note=""),  # its help names its default
    ConfigOption(field="codecs.pseudo_gradients", default="fp32"),
    ConfigOption(field="paths.skip_ratio"),
    ConfigOption(field="paths.max_swaps"),
    ConfigOption(field="model.subspace_rank", note="(default d/8 when a subspace codec is chosen, else the config's)"),
)


@app.command("simulate")
@user_errors
@config_options(*field_options(SimulationConfig), into="sim_options")
@config_options(*SIMULATE_CONFIG_OPTIONS)
def simulate_cmd(
    config: ConfigOpt = None,
    data: DataOpt = None,
    tokenizer: TokenizerOpt = None,
    outer: Annotated[
        OuterChoice,
        typer.Option(
            help="ddp: an fp32 gradient all-reduce every step; none: replicas never sync; else the outer step's method."
        ),
    ] = "sparseloco",
    overrides: ConfigOverrides = None,
    sim_options: ConfigOverrides = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the result as JSON here.")] = None,
    device: DeviceOpt = "auto",
) -> None:
    """An in-process swarm (no network): K replicas per stage, random routing, codecs at every hop, inner and outer steps; counts the bytes that would cross the wire."""
    from swarm.sim.simulate import simulate

    base, tok = config_with_tokenizer(config, tokenizer)
    cfg = derive_config(base, overrides, outer=outer)
    if cfg.model.subspace_rank != base.model.subspace_rank or "model.subspace_rank" in (overrides or {}):
        rank = cfg.model.subspace_rank
        typer.echo(f"model: subspace-constrained residual stream, k={rank} (d/k={cfg.model.d_model / max(rank, 1):g})")
    # its fields are the simulation's options (swarm/sim/simulate.py); the mode follows --outer
    sim = from_options(SimulationConfig, sim_options, mode="ddp" if outer == "ddp" else "outer")
    replicas, tokens = sim.replicas, sim.tokens
    corpus = load_corpus(data, tokenizer=tok)
    streams = [
        corpus.sample_batches(
            "train", batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, seed=cfg.train.seed + 1000 * k
        )
        for k in range(replicas)
    ]
    val = corpus.val_batches(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
    typer.echo(
        f"simulate: {replicas} replicas × {cfg.stages.num_stages + 1} stages, outer={outer} H={cfg.outer.inner_steps}, "
        f"codecs {cfg.codecs.activations}/{cfg.codecs.gradients}/{cfg.codecs.pseudo_gradients}, "
        f"skip={cfg.paths.skip_ratio} swaps={cfg.paths.max_swaps}, {tokens} tokens"
    )

    def on_log(record: dict[str, float]) -> None:
        typer.echo(
            f"tick {int(record['tick'])}  tokens {int(record['tokens'])}  train {record['train_loss']:.3f}  "
            f"val {record['val_loss']:.3f}  {record['bytes_per_token']:.1f} B/token  "
            f"{elapsed_and_eta(record['elapsed_s'], done=record['tokens'], total=tokens)}"
        )

    result = simulate(cfg, sim, streams, val, on_log=on_log, device=resolve_device(device))
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
