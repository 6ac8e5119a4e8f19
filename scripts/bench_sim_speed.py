"""The simulator's training speed against train-local's, at the same shapes on the same device (issue 34).

Both train the preset on the default corpus for the same training tokens, in this process, one after the other:
train-local's loop (``train_centralized``) and ``simulate`` with K replicas (SparseLoCo, random routing, every boundary
coded with the config's codecs, ``--no-wire-zstd`` by default: frames stay on the device). Validation is one
sequence of 8 tokens, so the times are training's. The ratio is simulate's tokens/s over train-local's (the issue's
target on a GPU: ≥ 0.5 at 125m; K microbatches per tick pass through the same stages, so the FLOPs per token match).

    python scripts/bench_sim_speed.py --preset 20m --seq-len 256 --steps 8 --json runs/sim-speed.json   # CPU, ~3 min
    python scripts/bench_sim_speed.py --preset 125m --device cuda --precision bf16 --compile on        # on a GPU
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from peer.data import load_corpus
from swarm.cli_fields import add_field_arguments, from_arguments
from swarm.config import SwarmConfig
from swarm.hardware import resolve_device
from swarm.sim.centralized import train_centralized
from swarm.sim.simulate import SimulationConfig, simulate
from swarmtest.bench import preset_config

SIM_FIELDS = ("replicas", "compile", "wire_zstd")  # SimulationConfig's, as options (swarm/sim/simulate.py)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cfg = preset_config(args.preset, seq_len=args.seq_len, microbatch=args.microbatch, precision=args.precision)
    device = resolve_device(args.device)
    corpus = load_corpus(None)
    shape = dict(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
    inputs, targets = corpus.val_batches(num_sequences=1, **shape)[0]
    val = [(inputs[:1, :8], targets[:1, :8])]  # validation measures nothing here
    tokens = args.steps * args.replicas * cfg.train.microbatch_size * cfg.train.seq_len
    started = time.perf_counter()
    train_centralized(
        cfg,
        corpus.sample_batches("train", seed=0, **shape),
        val,
        steps=args.steps * args.replicas,  # the same tokens
        log_every=args.steps * args.replicas,
        device=device,
        compile=args.compile,
    )
    local_s = time.perf_counter() - started
    sim = from_arguments(SimulationConfig, args, *SIM_FIELDS, tokens=tokens, log_every=10**9)
    streams = [corpus.sample_batches("train", seed=k, **shape) for k in range(args.replicas)]
    result = simulate(cfg, sim, streams, val, device=device)
    return {
        "preset": args.preset,
        "device": str(device),
        "shape": f"{cfg.train.microbatch_size} x {cfg.train.seq_len}",
        "tokens": tokens,
        "train_local_tokens_per_s": tokens / local_s,
        "simulate_tokens_per_s": result.tokens / result.wall_s,
        "ratio": (result.tokens / result.wall_s) / (tokens / local_s),
        "threads": torch.get_num_threads(),
        "args": vars(args),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = {"model.preset": "20m", "train.seq_len": 256, "train.microbatch_size": 8}
    add_field_arguments(parser, SwarmConfig, *shape, defaults=shape)  # one microbatch per inner step (preset_config)
    parser.add_argument("--steps", type=int, default=8, help="simulator ticks (train-local: K times as many steps)")
    add_field_arguments(parser, SimulationConfig, "replicas")
    parser.add_argument("--device", default="cpu")
    add_field_arguments(parser, SwarmConfig, "train.precision")
    add_field_arguments(parser, SimulationConfig, "compile", "wire_zstd", defaults={"wire_zstd": False})
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    row = measure(args)
    print(f"{'preset':<8} {'device':<8} {'shape':<10} {'train-local tok/s':>18} {'simulate tok/s':>15} {'ratio':>6}")
    print(
        f"{row['preset']:<8} {row['device']:<8} {row['shape']:<10} {row['train_local_tokens_per_s']:>18.0f} "
        f"{row['simulate_tokens_per_s']:>15.0f} {row['ratio']:>6.2f}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(row, indent=1, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
