"""``swarmloco plan``: what one trainer of a swarm will do over given links, and which link or stage to fix.

$ swarmloco plan --preset 125m --link 100mbit                        # H200 peers, 100 Mbit/s each way, 50 ms
$ swarmloco plan --preset 1b --link 100mbit --up 20mbit              # a home link: 100 down, 20 up
$ swarmloco plan --preset tiny --device cpu --link 20mbit --rtt-ms 0  # this machine's CPU, measured now
$ swarmloco plan --config swarm.toml --link 1gbit --json             # a swarm's own config; the numbers as JSON

The model and its assumptions: swarm/plan/model.py; checked against the WAN lab: docs/benchmarks.md, "The throughput
model".
"""

import dataclasses
import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from peer.cli_common import ConfigOpt, app, fail, user_errors
from peer.config_options import ConfigOption, ConfigOverrides, config_options
from swarm.config import SwarmConfig, derive_config
from swarm.config_toml import load_config
from swarm.node.config import PeerConfig
from swarm.plan.model import Compute, Link, Network, Prediction, Swarm, fix, mbit, parse_rate, predict
from swarm.plan.shapes import REFERENCE_RATES, REFERENCE_SHAPE, codec_frames, reference_compute

PlanDevice = Literal["h200", "cpu"]
# the shapes a plan takes unless --config or an option says otherwise: the GPU check's (docs/benchmarks.md), at which
# the reference rates were measured: 2 middle stages, microbatches of 8 × 1024 tokens, 16 samples an inner step
PLAN_SHAPE: dict[str, Any] = {
    "stages.num_stages": 2,
    "train.seq_len": REFERENCE_SHAPE[1],
    "train.microbatch_size": REFERENCE_SHAPE[0],
    "train.inner_batch": 16,
}
PLAN_PRESET = "125m"  # the model a plan takes unless --config or --preset says otherwise


def _shape(path: str, more: str = "") -> str:
    """The note after a field's help: plan's own default of it, from ``PLAN_SHAPE``."""
    return f"(default {PLAN_SHAPE[path]}{more})"


PLAN_OPTIONS = (  # the fields' own flags (--codec: plan's name), help, limits and choices; the notes: plan's defaults
    ConfigOption(field="model.preset", note=f"(default {PLAN_PRESET})"),
    ConfigOption(field="stages.num_stages", note=_shape("stages.num_stages")),
    ConfigOption(field="train.seq_len", note=_shape("train.seq_len", ", or the preset's longest")),
    ConfigOption(field="train.microbatch_size", note=_shape("train.microbatch_size")),
    ConfigOption(
        field="train.inner_batch",
        note=_shape("train.inner_batch") + ": with --max-staleness 0 the window drains at each step.",
    ),
    ConfigOption(field="codecs.activations", flags=("--codec",), note="(default int8)"),
    ConfigOption(field="codecs.gradients", note=""),  # its help names its default
)


def plan_config(config: Path | None, overrides: dict[str, Any]) -> SwarmConfig:
    """The config planned: --config's with the options over it, else the preset at ``PLAN_SHAPE`` and the options."""
    if config is not None:
        return derive_config(load_config(config), overrides)
    preset = derive_config(SwarmConfig(), {"model.preset": overrides.get("model.preset", PLAN_PRESET)})
    shape = PLAN_SHAPE | {"train.seq_len": min(PLAN_SHAPE["train.seq_len"], preset.model.max_seq_len)}
    return derive_config(preset, shape | overrides)


@app.command("plan")
@user_errors
@config_options(*PLAN_OPTIONS)
def plan_cmd(
    config: ConfigOpt = None,
    link: Annotated[
        str,
        typer.Option(
            help="Every peer's link, each direction (the trainer's unless --up/--down, the servers' unless --server-link)."
        ),
    ] = "100mbit",
    up: Annotated[str | None, typer.Option(help="The trainer's uplink (default --link), e.g. 20mbit.")] = None,
    down: Annotated[str | None, typer.Option(help="The trainer's downlink (default --link).")] = None,
    server_link: Annotated[
        str | None, typer.Option(help="Each stage server's link, each direction (default --link).")
    ] = None,
    rtt_ms: Annotated[float, typer.Option(min=0.0, help="Round trip between the trainer and a server, ms.")] = 50.0,
    device: Annotated[
        PlanDevice,
        typer.Option(
            help="Every peer's device: h200 (one process's measured rate, docs/benchmarks.md; 125m and 1b) or cpu "
            "(this machine, measured now with one thread a peer: slow at real shapes)."
        ),
    ] = "h200",
    tokens_per_s: Annotated[
        float | None,
        typer.Option(
            min=0.0, help="Instead of --device: the tokens/s one process trains the whole model at on your device."
        ),
    ] = None,
    in_flight: Annotated[
        int, typer.Option(min=1, help="The trainer's window cap (its --in-flight): microbatches in flight at once.")
    ] = PeerConfig().trainer.in_flight,
    max_staleness: Annotated[
        int, typer.Option(min=0, help="The trainer's --max-staleness: 0 drains the window at every inner step.")
    ] = PeerConfig().trainer.max_staleness,
    trainers: Annotated[int, typer.Option(min=1, help="Trainers sharing each stage's server.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON instead of a table.")] = False,
    overrides: ConfigOverrides = None,
) -> None:
    """Predict one trainer's tokens/s from every link's bytes per token, each stage's compute, the round trip and the
    trainer's window, and name the bottleneck: what your swarm will do and which link to fix."""
    cfg = plan_config(config, dict(overrides or {}))
    try:
        every = parse_rate(link)
        rate = lambda text: parse_rate(text) if text is not None else every
        trainer_link, server = Link(up=rate(up), down=rate(down)), Link.symmetric(rate(server_link))
        frames = codec_frames(cfg)
    except ValueError as e:
        fail(str(e))
    compute, alone, device_name = plan_compute(cfg, device, tokens_per_s)
    n = max(1, cfg.train.inner_batch // cfg.train.microbatch_size)
    swarm = Swarm(
        tokens=cfg.train.microbatch_size * cfg.train.seq_len,
        frames=frames,
        compute=compute,
        network=Network(trainer=trainer_link, server=server, rtt_s=rtt_ms / 1000),
        window=in_flight,
        microbatches_per_step=n,
        max_staleness=max_staleness,
        trainers=trainers,
    )
    prediction = predict(swarm)
    what, better = fix(swarm, prediction)
    if as_json:
        typer.echo(json.dumps(plan_record(cfg, swarm, prediction, alone, device_name, what, better), indent=1))
        return
    print_plan(cfg, swarm, prediction, alone, device_name, what, better)


def plan_compute(cfg: SwarmConfig, device: str, tokens_per_s: float | None) -> tuple[Compute, float, str]:
    """Each stage's compute, one process's tokens/s on the device, and the device's name."""
    if tokens_per_s:
        return reference_compute(cfg, tokens_per_s=tokens_per_s), tokens_per_s, f"{tokens_per_s:,.0f} tokens/s alone"
    if device == "cpu":
        from swarm.plan.measure import measure, random_batches

        typer.echo("measuring this CPU: 2 inner steps of the pipeline in this process, 1 thread ...", err=True)
        measured = measure(cfg, random_batches(cfg), steps=1, warmup_steps=1)
        total = measured.compute.trainer + sum(measured.compute.stages)
        return measured.compute, cfg.train.microbatch_size * cfg.train.seq_len / total, "this CPU (1 thread a peer)"
    rates = REFERENCE_RATES[device]
    if cfg.model.preset not in rates:
        fail(f"{device} was measured at presets {', '.join(rates)} only: give --tokens-per-s for {cfg.model.preset}")
    if (cfg.train.microbatch_size, cfg.train.seq_len) != REFERENCE_SHAPE:
        typer.secho(
            f"note: {device}'s rate was measured at microbatches of {REFERENCE_SHAPE[0]} × {REFERENCE_SHAPE[1]}",
            err=True,
        )
    rate = rates[cfg.model.preset]
    return reference_compute(cfg, tokens_per_s=rate), rate, f"{device} ({rate:,.0f} tokens/s alone)"


def link_rows(swarm: Swarm, prediction: Prediction) -> list[dict[str, Any]]:
    """Per resource: bytes per token and per microbatch, rate, seconds per microbatch, busy fraction of a step."""
    return [
        {
            "resource": r.name,
            "bytes_per_token": r.bytes / swarm.tokens if r.rate else None,
            "bytes_per_microbatch": r.bytes if r.rate else None,
            "mbit_s": mbit(r.rate) if r.rate else None,
            "s_per_microbatch": r.seconds,
            "busy": prediction.busy(r),
        }
        for r in prediction.resources
    ]


def plan_record(
    cfg: SwarmConfig, swarm: Swarm, p: Prediction, alone: float, device: str, what: str, better: Prediction
) -> dict[str, Any]:
    return {
        "preset": cfg.model.preset,
        "shape": {
            "stages": cfg.stages.num_stages,
            "seq_len": cfg.train.seq_len,
            "microbatch": cfg.train.microbatch_size,
            "inner_batch": cfg.train.inner_batch,
            "d_model": cfg.model.d_model,
        },
        "codecs": {"activations": cfg.codecs.activations, "gradients": cfg.codecs.gradients},
        "device": device,
        "network": {
            "trainer_up_mbit": mbit(swarm.network.trainer.up),
            "trainer_down_mbit": mbit(swarm.network.trainer.down),
            "server_mbit": mbit(swarm.network.server.up),
            "rtt_ms": swarm.network.rtt_s * 1000,
        },
        "window": {"cap": swarm.window, "in_effect": p.window, "max_staleness": swarm.max_staleness},
        "frames": dataclasses.asdict(swarm.frames),
        "resources": link_rows(swarm, p),
        "round_trip_s": p.round_trip_s,
        "step_s": p.step_s,
        "tokens_per_s": p.tokens_per_s,
        "one_process_tokens_per_s": alone,
        "fraction_of_one_process": p.tokens_per_s / alone,
        "bottleneck": p.bottleneck,
        "fix": {"what": what, "tokens_per_s": better.tokens_per_s, "bottleneck": better.bottleneck},
        "relay": relay_what_if(swarm),
    }


def relay_what_if(swarm: Swarm) -> dict[str, Any]:
    """The same swarm with frames sent server to server (`--relay`, issue 43 §3): tokens/s with the window as set and
    with one spanning inner steps (enough in flight to fill the pipe), and what limits each."""
    relayed = replace(swarm, route="relay")
    p = predict(relayed)
    spanning = predict(replace(relayed, max_staleness=max(1, swarm.max_staleness), window=max(16, swarm.window)))
    return {
        "tokens_per_s": p.tokens_per_s,
        "bottleneck": p.bottleneck,
        "spanning_tokens_per_s": spanning.tokens_per_s,
        "spanning_bottleneck": spanning.bottleneck,
        "trainer_bytes_per_token_each_way": max(relayed.frames.trainer_link("relay")) / swarm.tokens,
    }


def print_plan(
    cfg: SwarmConfig, swarm: Swarm, p: Prediction, alone: float, device: str, what: str, better: Prediction
) -> None:
    from rich.console import Console
    from rich.table import Table

    net = swarm.network
    title = (
        f"{cfg.model.preset} (d {cfg.model.d_model}), {cfg.stages.num_stages} stages, microbatches of "
        f"{cfg.train.microbatch_size} × {cfg.train.seq_len}, {cfg.codecs.activations}/{cfg.codecs.gradients} on "
        f"{device}; trainer {mbit(net.trainer.down):g} down / {mbit(net.trainer.up):g} up, servers "
        f"{mbit(net.server.up):g} Mbit/s, {net.rtt_s * 1000:g} ms round trip"
    )
    table = Table()
    for column in ("resource", "bytes/token", "MB/microbatch", "Mbit/s", "s/microbatch", "busy"):
        table.add_column(column, justify="left" if column == "resource" else "right")
    for row in link_rows(swarm, p):
        link = row["mbit_s"] is not None
        table.add_row(
            row["resource"],
            f"{row['bytes_per_token']:,.0f}" if link else "",
            f"{row['bytes_per_microbatch'] / 1e6:.2f}" if link else "",
            f"{row['mbit_s']:g}" if link else "",
            f"{row['s_per_microbatch']:.3f}",
            f"{row['busy']:.0%}",
            style="bold" if row["resource"] == p.bottleneck else None,
        )
    console = Console(width=max(100, min(160, len(title))))
    console.print(title)
    console.print(table)
    console.print(
        f"one microbatch's round trip {p.round_trip_s:.3f} s; window {p.window} in flight; inner step "
        f"{p.step_s:.3f} s ({p.microbatches_per_step} microbatches)"
    )
    console.print(
        f"[bold]predicted: {p.tokens_per_s:,.0f} tokens/s per trainer[/bold], {p.tokens_per_s / alone:.3f} of one "
        f"process alone ({alone:,.0f})"
    )
    console.print(f"bottleneck: {bottleneck_line(swarm, p)}")
    console.print(
        f"fix: {what} → {better.tokens_per_s:,.0f} tokens/s ({better.tokens_per_s / alone:.3f}); then {better.bottleneck}"
    )
    relay = relay_what_if(swarm)
    console.print(
        f"frames server to server (--relay): {relay['tokens_per_s']:,.0f} tokens/s ({relay['bottleneck']}); "
        f"with a window spanning inner steps {relay['spanning_tokens_per_s']:,.0f} ({relay['spanning_bottleneck']})"
    )


def bottleneck_line(swarm: Swarm, p: Prediction) -> str:
    """The bottleneck, with what it carries or does per microbatch."""
    r = next((r for r in p.resources if r.name == p.bottleneck), None)
    if r is None:
        return p.bottleneck
    if r.rate:
        return (
            f"{r.name}: {mbit(r.rate):g} Mbit/s carries {r.bytes / 1e6:.2f} MB per microbatch "
            f"({r.bytes / swarm.tokens:,.0f} bytes/token) in {r.seconds:.3f} s"
        )
    return f"{r.name}: {r.seconds:.3f} s per microbatch"
