"""The real swarm at an H200's pace in the WAN lab, against ``swarmloco plan``'s projection for H200 peers.

A swarm of 1 trainer and 2 stage servers at 125m's shapes (d 768, microbatches of 8 × 1024, 16 samples an inner step,
int8 boundaries both ways: ``swarmloco plan``'s default shapes) runs in the WAN lab with every peer paced as an H200
(``--pace-as h200``, swarm/pipeline/pacing.py): instead of computing, each waits the H200's time for its part of a
microbatch (its one-process rate split by FLOPs) and replies with real boundary tensors, recorded once from the real
model on real text (``--boundaries``, kept for later runs). Frames, codecs, zstd, hivemind p2p, routing, the window
and the deadlines are the real ones. Per link rate: the trainer's tokens/s and bytes per token, set beside

- ``plan``: ``swarmloco plan --preset 125m --link <rate>`` (H200 peers, the codec's own frame sizes, 50 ms, a long run);
- ``plan here``: the same model at the lab's round trip, over the run's steps (the window's start), with the frames
  the paced peers really send (zstd included: measured in process first, the same replayed tensors).

First the paced pipeline runs in this process (no network): what each peer spends beyond the H200's time is this
CPU's cost (decoding every frame, encoding each replayed tensor's frame once, Python): its share of a microbatch at
each link rate is reported.

    sudo python scripts/bench_gpu_pace.py --json docs/data/gpu-pace-wanlab.json    # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from peer.commands.plan import plan_config
from peer.data import load_corpus
from peer.launch import LocalSwarm, Placement, local_config
from swarm.config import SwarmConfig, derive_config
from swarm.events import Progress, of_kind, read_events
from swarm.node.config import PeerConfig
from swarm.pipeline.pacing import Boundaries, Pace, record_boundaries
from swarm.plan.measure import Measured, measure
from swarm.plan.model import Frames, Link, Network, Swarm, parse_rate, predict
from swarm.plan.shapes import codec_frames, reference_compute
from swarmtest.bench import run_swarm
from swarmtest.wanlab import WanLab, unsupported_reason

LAYOUT = LocalSwarm(peers=3, stages=2, trainers=1, steps=1)  # steps: set per run
DEVICE = "h200"
PRESET = "125m"
# (link rate, the lab's round trip): the lab's delay line is user-space Python, which cannot carry 1 Gbit/s
RUNS = ((20.0, 50.0), (100.0, 50.0), (1000.0, 0.0))
TARGET_RATIO = 0.2


def pace_config() -> SwarmConfig:
    """``swarmloco plan --preset 125m``'s swarm, with no outer round within a run (the model is of the pipeline): H
    beyond the run, and no warm start (whose rounds come after every inner step)."""
    overrides = {"outer.inner_steps": 10_000, "outer.warm_start_steps": 0}
    return derive_config(plan_config(None, {"model.preset": PRESET}), overrides)


def boundaries(cfg: SwarmConfig, path: Path) -> Boundaries:
    """The boundary tensors of one real microbatch of the default corpus at cfg's shapes: ``path`` if it holds them,
    else recorded now (the whole model's forward and backward once, on the CPU) and saved there."""
    if path.exists():
        bank = Boundaries.load(path)
        bank.check(cfg)
        return bank
    batches = load_corpus().sample_batches(
        "train", batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, seed=0
    )
    started = time.perf_counter()
    bank = record_boundaries(cfg, *next(batches))
    print(f"recorded the boundaries in {time.perf_counter() - started:.0f} s: {path}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    bank.save(path)
    return bank


def plan_command(cap_mbit: float) -> list[str]:
    return ["swarmloco", "plan", "--preset", PRESET, "--link", f"{cap_mbit:g}mbit"]


def plan_prediction(cap_mbit: float) -> dict[str, Any]:
    """What ``swarmloco plan --preset 125m --link <cap>mbit --json`` says (run as the user would)."""
    argv = [sys.executable, "-m", "peer", *plan_command(cap_mbit)[1:], "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out))


def lab_swarm(cfg: SwarmConfig, frames: Frames, cap_mbit: float, rtt_ms: float, tokens_per_s: float) -> Swarm:
    """The model of the lab's paced swarm: the reference device's compute (one process at ``tokens_per_s``),
    ``frames``, every link at ``cap_mbit``, the lab's round trip."""
    link = Link.symmetric(parse_rate(f"{cap_mbit}mbit"))
    return Swarm(
        tokens=cfg.train.microbatch_size * cfg.train.seq_len,
        frames=frames,
        compute=reference_compute(cfg, tokens_per_s=tokens_per_s),
        network=Network(trainer=link, server=link, rtt_s=rtt_ms / 1000),
        window=PeerConfig().trainer.in_flight,
        microbatches_per_step=cfg.train.inner_batch // cfg.train.microbatch_size,
    )


def cpu_costs(cfg: SwarmConfig, pace: Pace, measured: Measured) -> dict[str, Any]:
    """Seconds per microbatch each paced peer spends in this process beyond the H200's time: this CPU's cost."""
    c = measured.compute
    return {
        "trainer_s": c.trainer - pace.seconds[0],
        "stages_s": [s - ref for s, ref in zip(c.stages, pace.seconds[1:], strict=True)],
        "trainer_measured_s": c.trainer,
        "stages_measured_s": list(c.stages),
        "reference_s": list(pace.seconds),
    }


def served_split(run: Path, stages: int) -> dict[str, dict[str, float]]:
    """Per stage: its server's medians over its last requests, seconds, forward and backward summed (decode, compute
    (the H200's wait and this CPU's work around it), encode), as it timed them during the run."""
    split: dict[str, dict[str, float]] = {}
    for stage in range(1, stages + 1):
        records = read_events(run / f"stage{stage}-0.jsonl")
        last = next((r["time_split"] for r in reversed(of_kind(records, Progress)) if "time_split" in r), None)
        if last is None or not {"forward", "backward"} <= last.keys():
            continue
        split[str(stage)] = {
            part: sum(last[kind].get(part, 0.0) for kind in ("forward", "backward"))
            for part in ("decode_s", "copy_s", "compute_s", "encode_s")
        }
    return split


def run_lab(cfg: SwarmConfig, steps: int, cap_mbit: float, rtt_ms: float, bank_path: Path, out: Path) -> dict[str, Any]:
    layout = replace(LAYOUT, steps=steps)
    names = [name for name, _ in layout.servers()] + ["trainer-0"]
    peer = PeerConfig(pace_as=DEVICE, pace_boundaries=bank_path)
    with WanLab(caps_mbit=[cap_mbit] * len(names), rtts_ms=[rtt_ms] * len(names)) as lab:
        hosts = {
            name: Placement(prefix=tuple(lab.command(i, [])), host=lab.hosts[i].address) for i, name in enumerate(names)
        }
        return run_swarm(local_config(cfg, layout), layout, None, out, place=hosts.__getitem__, peer=peer)


def report(records: list[dict[str, Any]], costs: dict[str, Any]) -> None:
    print(
        f"\n{'Mbit/s':>6} {'rtt':>4} {'steps':>5} {'plan':>7} {'plan here':>9} {'measured':>8} {'plan/meas':>9} "
        f"{'here/meas':>9} {'B/tok plan':>10} {'here':>6} {'meas':>6} {'cpu share':>9} {'load':>5}"
    )
    for r in records:
        print(
            f"{r['cap_mbit']:6g} {r['rtt_ms']:4g} {r['steps']:5d} {r['plan_tokens_per_s']:7.0f} "
            f"{r['here_tokens_per_s']:9.0f} {r['measured_tokens_per_s']:8.0f} {r['plan_ratio']:9.2f} "
            f"{r['here_ratio']:9.2f} {r['plan_bytes_per_token']:10.0f} {r['here_bytes_per_token']:6.0f} "
            f"{r['measured_bytes_per_token']:6.0f} {r['cpu_share']:9.3f} {r['load_average'][0]:5.1f}"
        )
    stages = ", ".join(f"{1000 * s:.0f}" for s in costs["stages_s"])
    print(
        f"this CPU's cost beyond the H200's time, per microbatch: trainer {1000 * costs['trainer_s']:.0f} ms, "
        f"stages {stages} ms (the H200's: {', '.join(f'{1000 * s:.1f}' for s in costs['reference_s'])} ms)"
    )
    within = sum(abs(r["here_ratio"] - 1) <= TARGET_RATIO for r in records)
    print(f"plan here within {TARGET_RATIO:.0%} of the measurement: {within} of {len(records)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--runs",
        type=lambda t: [tuple(float(v) for v in run.split("@")) for run in t.split(",")],
        default=list(RUNS),
        help="link rates in Mbit/s, each @ its round trip in ms: 20@50,100@50,1000@0 (the default)",
    )
    parser.add_argument("--target-s", type=float, default=45.0, help="training seconds each run is sized for")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument(
        "--boundaries",
        type=Path,
        default=Path(tempfile.gettempdir()) / "swarmloco-pace" / "boundaries-125m.pt",
        help="the recorded boundary tensors: read if there, else recorded (a few minutes on 2 cores) and kept",
    )
    parser.add_argument("--out", type=Path, help="keep every run's logs here")
    parser.add_argument("--json", type=Path, help="write the records here")
    args = parser.parse_args()
    if (reason := unsupported_reason()) is not None:
        print(f"error: the WAN lab cannot run here: {reason}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    cfg = pace_config()
    bank = boundaries(cfg, args.boundaries)
    pace = Pace.of(cfg, DEVICE, bank)
    print(pace.describe(), flush=True)
    batches = load_corpus().sample_batches(
        "train", batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len, seed=1
    )
    measured = measure(cfg, batches, steps=2, warmup_steps=1, pace=pace)
    costs = cpu_costs(cfg, pace, measured)
    print(f"in process, paced: {costs}; frames {asdict(measured.frames)}", flush=True)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-pace-") as tmp:
        root = args.out or Path(tmp)
        for cap, rtt in args.runs:
            plan = plan_prediction(cap)
            swarm = lab_swarm(cfg, measured.frames, cap, rtt, pace.tokens_per_s)
            steps = max(2, min(args.max_steps, round(args.target_s / predict(swarm).step_s)))
            here = predict(swarm, steps=steps)
            load_before = os.getloadavg()
            print(
                f"{cap:g} Mbit/s, {rtt:g} ms: {steps} steps; plan {plan['tokens_per_s']:.0f} tok/s, plan here "
                f"{here.tokens_per_s:.0f}",
                flush=True,
            )
            run_started = time.perf_counter()
            run = root / f"pace-{cap:g}"
            result = run_lab(cfg, steps, cap, rtt, args.boundaries.resolve(), run)
            measured_tps = result["tokens_per_s"]
            microbatch_s = cfg.train.microbatch_size * cfg.train.seq_len / measured_tps
            busiest = max(costs["trainer_s"], *costs["stages_s"])
            frames = swarm.frames
            record = {
                "cap_mbit": cap,
                "rtt_ms": rtt,
                "steps": steps,
                "plan_command": " ".join(plan_command(cap)),
                "plan_tokens_per_s": plan["tokens_per_s"],
                "plan_bottleneck": plan["bottleneck"],
                "plan_bytes_per_token": sum(plan["frames"]["into"] + plan["frames"]["grad_into"])
                * 2
                / swarm.tokens,  # sent + received: the trainer's frames each way are alike
                "here_tokens_per_s": here.tokens_per_s,
                "here_bottleneck": here.bottleneck,
                "here_bytes_per_token": (frames.trainer_sent + frames.trainer_received) / swarm.tokens,
                "measured_tokens_per_s": measured_tps,
                "measured_bytes_per_token": result["bytes_per_token"]["total"],
                "plan_ratio": plan["tokens_per_s"] / measured_tps,
                "here_ratio": here.tokens_per_s / measured_tps,
                "fraction_of_one_h200": measured_tps / pace.tokens_per_s,
                "microbatch_s": microbatch_s,
                "cpu_share": busiest / microbatch_s,  # the busiest peer's CPU cost, of a microbatch's interval
                "host_cpu_share": (costs["trainer_s"] + sum(costs["stages_s"])) / 2 / microbatch_s,  # over 2 cores
                "served_split_s": served_split(run, cfg.stages.num_stages),
                "failed_hops": result["failed_hops"],
                "skipped_hops": result["skipped_hops"],
                "window_mean": result.get("window_mean"),
                "microbatches": result["microbatches"],
                "load_average": [load_before[0], os.getloadavg()[0]],  # before and after the run
                "wall_s": time.perf_counter() - run_started,
            }
            records.append(record)
            print(
                f"  measured {measured_tps:.0f} tok/s ({record['fraction_of_one_h200']:.4f} of one H200), "
                f"{record['measured_bytes_per_token']:.0f} B/token; plan/measured {record['plan_ratio']:.2f}, "
                f"plan here/measured {record['here_ratio']:.2f}; {record['wall_s']:.0f} s, load "
                f"{record['load_average'][0]:.1f} → {record['load_average'][1]:.1f}",
                flush=True,
            )
    report(records, costs)
    if args.json:
        data = {
            "device": DEVICE,
            "preset": PRESET,
            "pace": {"tokens_per_s": pace.tokens_per_s, "reference_s": list(pace.seconds)},
            "shape": {
                "d_model": cfg.model.d_model,
                "microbatch": cfg.train.microbatch_size,
                "seq_len": cfg.train.seq_len,
                "inner_batch": cfg.train.inner_batch,
                "stages": cfg.stages.num_stages,
                "codecs": [cfg.codecs.activations, cfg.codecs.gradients],
            },
            "frames": asdict(measured.frames),
            "codec_frames": asdict(codec_frames(cfg)),
            "recorded_loss": bank.loss,
            "cpu_costs": costs,
            "records": records,
            "cpus": os.cpu_count(),
            "wall_s": time.perf_counter() - started,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
