"""The throughput model (``swarm/plan``) against real swarms in the WAN lab, then projected to the reference GPU.

For each shape: the pipeline is timed in this process first (``swarm/plan/measure.py``: a real trainer and real stage
servers, one torch thread each as every lab peer has, real corpus tokens, so the frames are zstd's as in the swarm),
then a real swarm of 1 trainer and 2 stage servers runs in the WAN lab (``swarmtest/wanlab.py``) at each link cap,
every peer capped alike in both directions, and its trainer's tokens/s is set beside the model's prediction from the
measured compute and frames. All peers share this machine's cores, so the model is told so (``host_cores``). No outer
round runs (H is beyond the run): the model is of the pipeline. Each run's steps are sized from the prediction to train
for about ``--target-s`` seconds.

The projection: the model with the H200's measured one-process rates (docs/benchmarks.md, "The GPU check") for 125m
and 1b at 20, 100 and 1000 Mbit/s symmetric and a 100 down / 20 up home link, 50 ms round trips, int8 both ways.

    sudo python scripts/bench_plan.py --json docs/data/plan-wanlab.json       # ~12 min on 2 cores
    python scripts/bench_plan.py --projection-only                             # the projection alone, no lab
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from peer.data import load_corpus
from peer.launch import LocalSwarm, Placement, local_config
from swarm.config import SwarmConfig, TrainerOptions, derive_config
from swarm.events import Progress, of_kind, read_events
from swarm.node.config import PeerConfig
from swarm.plan.measure import Measured, measure
from swarm.plan.model import Compute, Frames, Link, Network, Route, Swarm, parse_rate, predict
from swarm.plan.shapes import REFERENCE_RATES, codec_frames, reference_compute
from swarmtest.bench import run_swarm
from swarmtest.wanlab import WanLab, unsupported_reason

LAYOUT = LocalSwarm(peers=3, stages=2, trainers=1, steps=1)  # steps: set per run
SHAPES: dict[str, dict[str, Any]] = {
    # the default model (d 128, 8 blocks, 4 × 128 tokens a microbatch, 4 microbatches an inner step)
    "tiny": {},
    # d 768 (125m's width) in 2 blocks: 125m's frames per token at a CPU's pace, 2 microbatches of 4 × 256 a step
    "wide": {
        "model.d_model": 768,
        "model.n_heads": 12,
        "model.n_layers": 2,
        "model.max_seq_len": 256,
        "train.seq_len": 256,
        "train.microbatch_size": 4,
        "train.inner_batch": 8,
    },
}
CAPS_MBIT = (5.0, 20.0, 100.0)
TARGET_RATIO = 0.2  # the issue's: predictions within 20% of the measurements
# zstd's compressed / raw on int8 boundary frames at 125m, 8 × 1024, the default corpus, after 2 AdamW steps
# (docs/benchmarks.md, "Every GPU busy": scripts/bench_wire_zstd.py); the gradient at the embedding saves 8%, under
# the wire's 10% rule, and goes raw. Taken as they are for 1b too (not measured there).
ZSTD_RATIOS = {"embedding": 0.038, "block": 0.587, "grad_block": 0.540, "grad_embedding": 1.0}
PROJECTION_LINKS = {  # name: (trainer down, trainer up, servers each way)
    "20 Mbit/s": ("20mbit", "20mbit", "20mbit"),
    "100 Mbit/s": ("100mbit", "100mbit", "100mbit"),
    "1000 Mbit/s": ("1gbit", "1gbit", "1gbit"),
    "home: 100 down / 20 up": ("100mbit", "20mbit", "100mbit"),
}


@dataclass(frozen=True, kw_only=True)
class Planned:
    shape: str
    cap_mbit: float
    steps: int
    predicted_tokens_per_s: float
    predicted_bytes_per_token: float  # the trainer's, sent + received
    bottleneck: str


def shape_config(shape: str) -> SwarmConfig:
    overrides = {
        "stages.num_stages": LAYOUT.stages,
        "codecs.activations": "int8",
        # no outer round within a run: the model is of the pipeline (the warm start too: a round after every inner
        # step of the first 100, which no lab run outlasts)
        "outer.inner_steps": 10_000,
        "outer.warm_start_steps": 0,
        **SHAPES[shape],
    }
    return derive_config(SwarmConfig(), overrides)


# one torch thread's matmuls, counted per phase from unix time ``start``: in each round a phase where only copy 0
# works, then one where every copy does (interleaved, so load from other work on the machine hits both alike)
PROBE = """import json, sys, time, torch
torch.set_num_threads(1)
print("ready", flush=True)
start = float(sys.stdin.readline())
phase_s, index, rounds = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
a, counts = torch.randn(384, 384), []
for phase in range(2 * rounds):
    begin, end = start + phase * phase_s, start + (phase + 1) * phase_s
    time.sleep(max(0.0, begin - time.time()))
    n = 0
    while time.time() < end and (index == 0 or phase % 2 == 1):
        a @ a
        n += 1
    counts.append(n)
print(json.dumps(counts))
"""


def parallel_capacity(cores: int, phase_s: float = 1.5, rounds: int = 3) -> float:
    """This machine's compute now, in cores running alone: ``cores`` one-thread torch loops at once against one alone
    (other work on the machine, and cores that slow each other, leave fewer than it has); the median of ``rounds``."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE, str(phase_s), str(i), str(rounds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(cores)
    ]
    for p in procs:  # every copy has imported torch
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    start = time.time() + 0.5
    for p in procs:  # the start to all before any is waited for
        assert p.stdin is not None
        p.stdin.write(f"{start}\n")
        p.stdin.flush()
    counts = [json.loads(p.communicate()[0]) for p in procs]
    ratios = [sum(c[2 * r + 1] for c in counts) / max(1, counts[0][2 * r]) for r in range(rounds)]
    return min(float(cores), statistics.median(ratios))


def lab_swarm(
    cfg: SwarmConfig,
    measured: Measured,
    cap_mbit: float,
    cores: int,
    effective: float,
    rtt_ms: float = 0.0,
    route: Route = "trainer",
) -> Swarm:
    """The model of the lab's swarm: its measured compute and frames, every link capped at ``cap_mbit``, all peers on
    ``cores`` cores worth ``effective`` cores alone (so each computation takes ``cores / effective`` times as long
    when they all compute, and the host's cores are a resource of their own)."""
    link = Link.symmetric(parse_rate(f"{cap_mbit}mbit"))
    slowdown = max(1.0, cores / effective)
    c = measured.compute
    return Swarm(
        tokens=cfg.train.microbatch_size * cfg.train.seq_len,
        frames=measured.frames,
        compute=replace(c, stages=tuple(slowdown * s for s in c.stages), trainer=slowdown * c.trainer),
        network=Network(trainer=link, server=link, rtt_s=rtt_ms / 1000),
        window=PeerConfig().trainer.in_flight,
        microbatches_per_step=cfg.train.inner_batch // cfg.train.microbatch_size,
        host_cores=effective * slowdown,  # the contended computations on ``cores`` cores: solo work / effective
        route=route,
    )


def served_compute(run: Path, stages: int) -> tuple[float, ...] | None:
    """Each stage's compute per microbatch as its server timed it during the run (the medians of its last requests'
    decode, copy, compute and encode, forward plus backward): the run's own load and contention in it. None where a
    server left no such record."""
    per_stage = []
    for stage in range(1, stages + 1):
        records = read_events(run / f"stage{stage}-0.jsonl")
        split = next((r["time_split"] for r in reversed(of_kind(records, Progress)) if "time_split" in r), None)
        if split is None or not {"forward", "backward"} <= split.keys():  # a server that never served a training hop
            return None
        parts = ("decode_s", "copy_s", "compute_s", "encode_s")
        per_stage.append(sum(split[kind][part] for kind in ("forward", "backward") for part in parts))
    return tuple(per_stage)


def in_run_prediction(record: dict[str, Any], run: Path, cores: int) -> dict[str, Any]:
    """The model again with each stage's compute as its server measured it in the run (the trainer's as measured in
    process, slowed as the probe said): how far the model is off once the machine's load is known."""
    served = served_compute(run, record["shape_config"]["stages"])
    if served is None:
        return {}
    frames = Frames(**{k: tuple(v) for k, v in record["frames"].items()})
    c = record["compute"]
    slowdown = max(1.0, cores / record["effective_cores"])
    link = Link.symmetric(parse_rate(f"{record['cap_mbit']}mbit"))
    shape = record["shape_config"]
    swarm = Swarm(
        tokens=shape["microbatch"] * shape["seq_len"],
        frames=frames,
        compute=Compute(stages=served, trainer=slowdown * c["trainer"]),
        network=Network(trainer=link, server=link, rtt_s=record.get("rtt_ms", 0.0) / 1000),
        window=PeerConfig().trainer.in_flight,
        microbatches_per_step=shape["inner_batch"] // shape["microbatch"],
        host_cores=cores,
        route=record.get("route", "trainer"),
    )
    p = predict(swarm, steps=record["steps"])
    return {
        "served_compute_s": served,
        "in_run_predicted_tokens_per_s": p.tokens_per_s,
        "in_run_ratio": p.tokens_per_s / record["measured_tokens_per_s"],
        "in_run_bottleneck": p.bottleneck,
    }


def run_lab(
    cfg: SwarmConfig, steps: int, cap_mbit: float, out: Path, rtt_ms: float = 0.0, route: Route = "trainer"
) -> dict[str, Any]:
    layout = replace(LAYOUT, steps=steps)
    names = [name for name, _ in layout.servers()] + ["trainer-0"]
    with WanLab(caps_mbit=[cap_mbit] * len(names), rtts_ms=[rtt_ms] * len(names)) as lab:
        hosts = {
            name: Placement(prefix=tuple(lab.command(i, [])), host=lab.hosts[i].address) for i, name in enumerate(names)
        }
        trainer = TrainerOptions(relay=route == "relay")
        return run_swarm(local_config(cfg, layout), layout, None, out, place=hosts.__getitem__, trainer=trainer)


def projection() -> list[dict[str, Any]]:
    """The model at the H200's rates, int8 both ways, the plan's default shapes (``swarmloco plan``'s)."""
    from peer.commands.plan import plan_config, relay_what_if

    rows = []
    for preset, rate in REFERENCE_RATES["h200"].items():
        cfg = plan_config(None, {"model.preset": preset})
        for name, (down, up, server) in PROJECTION_LINKS.items():
            swarm = Swarm(
                tokens=cfg.train.microbatch_size * cfg.train.seq_len,
                frames=codec_frames(cfg),
                compute=reference_compute(cfg, tokens_per_s=rate),
                network=Network(
                    trainer=Link(up=parse_rate(up), down=parse_rate(down)),
                    server=Link.symmetric(parse_rate(server)),
                    rtt_s=0.05,
                ),
                window=PeerConfig().trainer.in_flight,
                microbatches_per_step=cfg.train.inner_batch // cfg.train.microbatch_size,
            )
            p = predict(swarm)
            spanning = predict(replace(swarm, max_staleness=1, window=16))  # no bubble, a window that fills the pipe
            zstd = predict(replace(swarm, frames=zstd_frames(swarm.frames)))
            relay = relay_what_if(swarm)  # frames server to server (--relay, issue 43 §3)
            rows.append(
                {
                    "preset": preset,
                    "link": name,
                    "command": f"swarmloco plan --preset {preset} --link {server}"
                    + ("" if up == server else f" --up {up}")
                    + ("" if down == server else f" --down {down}"),
                    "tokens_per_s": p.tokens_per_s,
                    "fraction": p.tokens_per_s / rate,
                    "bottleneck": p.bottleneck,
                    "spanning_tokens_per_s": spanning.tokens_per_s,
                    "spanning_fraction": spanning.tokens_per_s / rate,
                    "spanning_bottleneck": spanning.bottleneck,
                    "zstd_tokens_per_s": zstd.tokens_per_s,
                    "zstd_fraction": zstd.tokens_per_s / rate,
                    "zstd_bottleneck": zstd.bottleneck,
                    "one_process_tokens_per_s": rate,
                    "trainer_bytes_per_token_each_way": swarm.frames.trainer_sent / swarm.tokens,
                    **{f"relay_{key}": value for key, value in relay.items()},
                    "relay_fraction": relay["tokens_per_s"] / rate,
                    "relay_spanning_fraction": relay["spanning_tokens_per_s"] / rate,
                }
            )
    return rows


def zstd_frames(raw: Frames) -> Frames:
    """``raw`` as zstd shrinks real frames (``ZSTD_RATIOS``): the embedding's output into stage 1, a block's output
    everywhere else, the gradient at the embedding out of stage 1, a block's gradient everywhere else."""
    r, last = ZSTD_RATIOS, raw.stages - 1
    scale = lambda frames, ratios: tuple(round(f * q) for f, q in zip(frames, ratios))
    block, grad = [r["block"]] * raw.stages, [r["grad_block"]] * raw.stages
    return Frames(
        into=scale(raw.into, [r["embedding"], *block[1:]]),
        out=scale(raw.out, block),
        grad_into=scale(raw.grad_into, grad),
        grad_out=scale(raw.grad_out, [r["grad_embedding"], *grad[:last]]),
    )


def print_projection(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'preset':<6} {'link':<24} {'tok/s':>8} {'of 1 GPU':>8} {'spanning':>9} {'of 1 GPU':>8} {'zstd':>7} "
        f"{'of 1 GPU':>8} {'relay':>7} {'of 1 GPU':>8} {'relay spanning':>14} {'of 1 GPU':>8}  bottleneck"
    )
    for r in rows:
        print(
            f"{r['preset']:<6} {r['link']:<24} {r['tokens_per_s']:8.0f} {r['fraction']:8.3f} "
            f"{r['spanning_tokens_per_s']:9.0f} {r['spanning_fraction']:8.3f} {r['zstd_tokens_per_s']:7.0f} "
            f"{r['zstd_fraction']:8.3f} {r['relay_tokens_per_s']:7.0f} {r['relay_fraction']:8.3f} "
            f"{r['relay_spanning_tokens_per_s']:14.0f} {r['relay_spanning_fraction']:8.3f}  {r['bottleneck']}"
        )


def report(records: list[dict[str, Any]]) -> None:
    print(
        f"\n{'shape':<6} {'cap':>5} {'route':>7} {'predicted':>9} {'measured':>9} {'ratio':>6} {'in-run':>7} {'ratio':>6} {'cores':>5}"
        "  bottleneck"
    )
    for r in records:
        print(
            f"{r['shape']:<6} {r['cap_mbit']:5g} {r.get('route', 'trainer'):>7} {r['predicted_tokens_per_s']:9.0f} {r['measured_tokens_per_s']:9.0f} "
            f"{r['ratio']:6.2f} {r.get('in_run_predicted_tokens_per_s', float('nan')):7.0f} "
            f"{r.get('in_run_ratio', float('nan')):6.2f} {r['effective_cores']:5.2f}  {r['bottleneck']}"
        )
    skipped = [f"{r['shape']} at {r['cap_mbit']:g}" for r in records if r.get("skipped_hops")]
    if skipped:
        print(f"left out, their trainer skipped stages (not the path modelled): {', '.join(skipped)}")
    records = [r for r in records if not r.get("skipped_hops")]
    for key in ("ratio", "in_run_ratio"):
        within = sum(abs(r[key] - 1) <= TARGET_RATIO for r in records if key in r)
        print(f"{key}: {within} of {len(records)} predictions within {TARGET_RATIO:.0%} of the measurement")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--caps", type=lambda t: [float(c) for c in t.split(",")], default=list(CAPS_MBIT))
    parser.add_argument("--target-s", type=float, default=30.0, help="training seconds each run is sized for")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument(
        "--rtt-ms", type=float, default=0.0, help="every peer's round-trip delay (two peers' round trip is this)"
    )
    parser.add_argument(
        "--routes",
        nargs="+",
        default=["trainer"],
        choices=["trainer", "relay"],
        help="each cap once per route: the trainer calls every stage (today), or --relay (frames server to server)",
    )
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the lab's peers share")
    parser.add_argument("--projection-only", action="store_true", help="print the H200 projection, run no lab")
    parser.add_argument("--out", type=Path, help="keep every run's logs here")
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument(
        "--reanalyse", action="store_true", help="no runs: redo --json's in-run predictions from the logs in --out"
    )
    args = parser.parse_args()
    if args.reanalyse:
        data = json.loads(args.json.read_text())
        for r in data["records"]:
            run = f"{r['shape']}-{r['cap_mbit']:g}" + (
                "" if r.get("route", "trainer") == "trainer" else f"-{r['route']}"
            )
            r |= in_run_prediction(r, args.out / run, data["cores"])
        report(data["records"])
        args.json.write_text(json.dumps(data, indent=1))
        return 0
    rows = projection()
    print_projection(rows)
    if args.projection_only:
        if args.json:
            args.json.write_text(json.dumps({"projection": rows}, indent=1))
        return 0
    if (reason := unsupported_reason()) is not None:
        print(f"error: the WAN lab cannot run here: {reason}", file=sys.stderr)
        return 2
    corpus = load_corpus()
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        root = args.out or Path(tmp)
        for shape in args.shapes:
            cfg = shape_config(shape)
            batches = corpus.sample_batches(
                "train", batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, seed=0
            )
            started = time.perf_counter()
            measured = measure(cfg, batches, steps=3, warmup_steps=1)
            print(
                f"{shape}: measured in {time.perf_counter() - started:.0f} s: stages {measured.compute.stages} s, "
                f"trainer {measured.compute.trainer:.3f} s per microbatch; frames {asdict(measured.frames)}",
                flush=True,
            )
            for cap, route in [(cap, route) for cap in args.caps for route in args.routes]:
                effective = parallel_capacity(args.cores)
                swarm = lab_swarm(cfg, measured, cap, args.cores, effective, args.rtt_ms, route)
                steps = max(4, min(args.max_steps, round(args.target_s / predict(swarm).step_s)))
                p = predict(swarm, steps=steps)
                load = os.getloadavg()[0]
                print(
                    f"  {shape} at {cap:g} Mbit/s, {route}: {steps} steps, predicted {p.tokens_per_s:.0f} tok/s",
                    flush=True,
                )
                started = time.perf_counter()
                run_dir = root / (f"{shape}-{cap:g}" + ("" if route == "trainer" else f"-{route}"))
                result = run_lab(cfg, steps, cap, run_dir, args.rtt_ms, route)
                measured_tps = result["tokens_per_s"]
                record = {
                    "shape": shape,
                    "cap_mbit": cap,
                    "route": route,
                    "rtt_ms": args.rtt_ms,
                    "steps": steps,
                    "predicted_tokens_per_s": p.tokens_per_s,
                    "measured_tokens_per_s": measured_tps,
                    "ratio": p.tokens_per_s / measured_tps,
                    "bottleneck": p.bottleneck,
                    "predicted_bytes_per_token": sum(swarm.frames.trainer_link(route)) / swarm.tokens,
                    "measured_bytes_per_token": result["bytes_per_token"]["total"],
                    "codec_bytes_per_token": (lambda f: (f.trainer_sent + f.trainer_received) / swarm.tokens)(
                        codec_frames(cfg)
                    ),
                    "round_trip_s": p.round_trip_s,
                    "step_s": p.step_s,
                    "resources_s": {r.name: r.seconds for r in p.resources},
                    "load_average": load,
                    "effective_cores": effective,
                    "failed_hops": result["failed_hops"],
                    "skipped_hops": result["skipped_hops"],  # > 0: not the path modelled, the run does not count
                    "window_mean": result.get("window_mean"),
                    "wall_s": time.perf_counter() - started,
                    "compute": asdict(measured.compute),
                    "frames": asdict(measured.frames),
                    "shape_config": {
                        "d_model": cfg.model.d_model,
                        "n_layers": cfg.model.n_layers,
                        "seq_len": cfg.train.seq_len,
                        "microbatch": cfg.train.microbatch_size,
                        "inner_batch": cfg.train.inner_batch,
                        "stages": cfg.stages.num_stages,
                    },
                }
                record |= in_run_prediction(record, run_dir, args.cores)
                records.append(record)
                print(
                    f"    measured {measured_tps:.0f} tok/s (ratio {record['ratio']:.2f}), "
                    f"{record['measured_bytes_per_token']:.0f} B/token (predicted {record['predicted_bytes_per_token']:.0f}); "
                    f"load {load:.1f}, {effective:.2f} effective cores; {record['wall_s']:.0f} s",
                    flush=True,
                )
    report(records)
    print_projection(rows)
    if args.json:
        args.json.write_text(
            json.dumps({"records": records, "projection": rows, "cores": args.cores, "target": TARGET_RATIO}, indent=1)
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
