"""One stage server's time per microbatch, with its forward's graph kept for the backward and recomputed (issue 34).

In process, no network: a ``StageServer`` of stage 1 of the preset (bench_scale's config: 2 middle stages, an inner
step every microbatch) gets a forward and then its backward, microbatch after microbatch, their frames in the
config's starting boundary codecs (what a trainer sends before it has measured its link). For each mode — ``keep``
(``--keep-graph-mb`` large enough for one graph) and ``recompute`` (0) — the median wall time per microbatch
(forward + backward requests, decode and encode included) over ``--repeats`` after ``--warmup``, the modes' servers
taking turns, microbatch by microbatch (a shared machine's load falls on both alike), and each server's own time
split (``info()["time_split"]``: medians of decode, wait, copy, compute, encode per request).

    python scripts/bench_stage_step.py --json runs/stage-step.json      # 20m, 8 x 1024, 1 thread: ~4 min on a CPU
    python scripts/bench_stage_step.py --preset tiny --seq-len 128 --repeats 3   # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from swarm.cli_fields import add_field_arguments
from swarm.config import SwarmConfig
from swarm.hardware import resolve_device
from swarm.model.sizing import stage_parameters
from swarm.pipeline.boundary import boundary_codecs
from swarm.pipeline.protocol import Backward, Forward
from swarm.pipeline.server import StageServer
from swarmtest.bench import preset_config

MODES = {"keep": 1 << 20, "recompute": 0}  # --keep-graph-mb of each: a TiB budget keeps every graph


def bench_config(args: argparse.Namespace) -> SwarmConfig:
    """bench_scale's config at these shapes (its outer step does not run here)."""
    return preset_config(args.preset, seq_len=args.seq_len, microbatch=args.microbatch, precision=args.precision)


async def microbatch(server: StageServer, cfg: SwarmConfig, mb: str) -> tuple[float, float]:
    """One microbatch's forward, then its backward; its wall time and the process' CPU time (all threads: on a
    machine shared with other work, the CPU time is what the load does not stretch)."""
    act, grad = boundary_codecs(cfg)
    shape = (cfg.train.microbatch_size, cfg.train.seq_len, cfg.model.d_model)
    x, g = act.encode(torch.randn(shape)), grad.encode(torch.randn(shape) * 1e-3)
    started, cpu = time.perf_counter(), time.process_time()
    await server.forward("trainer", Forward(mb=mb, stage=1, prev_stage=0, x=x))
    await server.backward("trainer", Backward(mb=mb, stage=1, grad=g))
    return time.perf_counter() - started, time.process_time() - cpu


async def interleaved(
    servers: dict[str, StageServer], cfg: SwarmConfig, count: int
) -> dict[str, list[tuple[float, float]]]:
    """``count`` microbatches on each server, taking turns: a load that changes meanwhile (a shared machine) falls on
    every mode alike."""
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in servers}
    for k in range(count):
        for mode, server in servers.items():
            times[mode].append(await microbatch(server, cfg, str(k)))
    return times


def measure(cfg: SwarmConfig, modes: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    device = resolve_device(args.device)
    servers = {mode: StageServer(cfg, 1, device=device, keep_graph_mb=MODES[mode]) for mode in modes}
    try:
        times = asyncio.run(interleaved(servers, cfg, args.warmup + args.repeats))
        infos = {mode: server.info() for mode, server in servers.items()}
    finally:
        for server in servers.values():
            server.shutdown()
    keys = (
        "graph_kept_backward",
        "graph_budget_recompute",
        "graph_moved_recompute",
        "graph_step_due_recompute",
        "graphs",
    )
    results = []
    for mode in modes:
        measured = times[mode][args.warmup :]
        median = statistics.median(wall for wall, _ in measured)
        results.append(
            {
                "mode": mode,
                "microbatch_s": median,
                "microbatch_cpu_s": statistics.median(cpu for _, cpu in measured),
                "times_s": [wall for wall, _ in measured],
                "tokens_per_s": cfg.train.microbatch_size * cfg.train.seq_len / median,
                "time_split": infos[mode]["time_split"],  # medians over warm-up and measured microbatches alike
                **{key: infos[mode].get(key, 0) for key in keys},
            }
        )
    return results


def table(results: list[dict[str, Any]]) -> str:
    parts = ("decode_s", "wait_s", "copy_s", "compute_s", "encode_s")
    head = f"{'mode':<10} {'per mb s':>9} {'cpu s':>7} {'tok/s':>8}  " + " ".join(
        f"{'fwd ' + p[:-2]:>10}" for p in parts
    )
    head += "  " + " ".join(f"{'bwd ' + p[:-2]:>10}" for p in parts)
    rows = [head]
    for r in results:
        split = r["time_split"]
        row = f"{r['mode']:<10} {r['microbatch_s']:>9.3f} {r['microbatch_cpu_s']:>7.2f} {r['tokens_per_s']:>8.0f}  "
        row += " ".join(f"{split['forward'][p]:>10.4f}" for p in parts)
        row += "  " + " ".join(f"{split['backward'][p]:>10.4f}" for p in parts)
        rows.append(row)
    if len(results) == 2:
        keep, recompute = results
        ratio = keep["microbatch_s"] / recompute["microbatch_s"]
        cpu = keep["microbatch_cpu_s"] / recompute["microbatch_cpu_s"]
        rows.append(f"keep / recompute per microbatch: wall {ratio:.3f}, CPU {cpu:.3f}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = {"model.preset": "20m", "train.seq_len": 1024, "train.microbatch_size": 8}
    add_field_arguments(parser, SwarmConfig, *shape, "train.precision", defaults=shape)  # preset_config's shape
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: what swarmloco local gives a peer)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = bench_config(args)
    params = stage_parameters(cfg.model, cfg.stages.num_stages, 1)
    print(
        f"{args.preset} stage 1: {params / 1e6:.1f}M parameters, microbatch {args.microbatch} x {args.seq_len}, "
        f"{args.precision}, {args.device}, {args.threads} thread(s), median of {args.repeats} after {args.warmup}",
        flush=True,
    )
    results = measure(cfg, args.modes, args)
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {
            "preset": args.preset,
            "seq_len": args.seq_len,
            "microbatch": args.microbatch,
            "threads": args.threads,
        }
        args.json.write_text(json.dumps({"config": {**config, "device": args.device}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
