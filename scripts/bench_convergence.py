"""Convergence versus bandwidth: centralized AdamW, ddp, DiLoCo and SparseLoCo at equal tokens.

Every run trains the default model on the default corpus for the same number of tokens and
reports its full-pipeline validation loss and the bytes per token it would put on the wire.
Ratios are taken against the ddp run of the same activation codec, measured in the same
invocation.

    python scripts/bench_convergence.py --tokens 600000 --json bench-convergence.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from typing import Literal

import torch

from peer.data import Corpus, load_corpus
from swarm.config import OuterChoice, SwarmConfig, derive_config
from swarm.sim.centralized import train_centralized
from swarm.sim.simulate import SimulationConfig, simulate

VAL_BATCHES = 16


@dataclass(frozen=True)
class Run:
    name: str
    outer: OuterChoice | Literal["centralized"]
    act_codec: str = "int8"
    inner_steps: int = 0
    skip: float = 0.0
    swaps: int = 0
    routing: str = "random"


def plan(h1: int, h2: int) -> list[Run]:
    runs = [Run("centralized", "centralized", act_codec="none")]
    for codec in ("int8", "subspace"):
        runs.append(Run(f"ddp/{codec}", "ddp", codec))
        for outer in ("diloco", "sparseloco"):
            for h in (h1, h2) if codec == "int8" else (h1,):
                runs.append(Run(f"{outer}/H{h}/{codec}", outer, codec, h))
    runs.append(Run(f"sparseloco/H{h1}/int8/skip0.25+swaps", "sparseloco", "int8", h1, skip=0.25, swaps=1))
    runs.append(Run(f"diloco/H{h1}/int8/sticky", "diloco", "int8", h1, routing="sticky"))  # isolates replica mixing
    return runs


def run_config(base: SwarmConfig, run: Run) -> SwarmConfig:
    """The run's swarm config: its codec on both directions, its outer step, H and paths (the centralized run: no outer step)."""
    codec = "fp32" if run.act_codec == "none" else run.act_codec
    overrides = {
        "codecs.activations": codec,
        "codecs.pseudo_gradients": "fp32",
        "paths.skip_ratio": run.skip,
        "paths.max_swaps": run.swaps,
    }
    if run.inner_steps:
        overrides["outer.inner_steps"] = run.inner_steps
    return derive_config(base, overrides, outer="none" if run.outer == "centralized" else run.outer)


def measure(run: Run, base: SwarmConfig, corpus: Corpus, replicas: int, tokens: int, seed: int) -> dict:
    cfg = run_config(base, run)
    t = cfg.train
    val = corpus.val_batches(batch_size=t.microbatch_size, seq_len=t.seq_len, num_batches=VAL_BATCHES)
    started = time.perf_counter()
    if run.outer == "centralized":  # same global batch and steps as ddp: K microbatches per step
        global_batch = replicas * t.microbatch_size
        steps = tokens // (global_batch * t.seq_len)
        cfg = dataclasses.replace(
            cfg,
            train=dataclasses.replace(t, microbatch_size=global_batch, inner_batch=global_batch, seed=seed),
            inner=dataclasses.replace(cfg.inner, total_steps=steps),
        )
        batches = corpus.sample_batches("train", batch_size=global_batch, seq_len=t.seq_len, seed=seed)
        log: list[dict] = []
        train_centralized(cfg, batches, val, steps=steps, log_every=steps, on_log=log.append)
        return {
            "name": run.name,
            "val_loss": log[-1]["val_loss"],
            "tokens": log[-1]["tokens"],
            "wall_s": time.perf_counter() - started,
            "bytes_per_token": {"total": 0.0},
            "seed": seed,
        }
    streams = [
        corpus.sample_batches("train", batch_size=t.microbatch_size, seq_len=t.seq_len, seed=seed + 1000 * k)
        for k in range(replicas)
    ]
    sim = SimulationConfig(
        replicas=replicas,
        mode="ddp" if run.outer == "ddp" else "outer",
        tokens=tokens,
        seed=seed,
        log_every=10**9,
        routing=run.routing,
    )
    result = simulate(cfg, sim, streams, val)
    return {
        "name": run.name,
        "val_loss": result.val_loss,
        "tokens": result.tokens,
        "wall_s": result.wall_s,
        "bytes_per_token": result.bytes_per_token,
        "outer_rounds": result.outer_rounds,
        "seed": seed,
        "act_codec": run.act_codec,
        "inner_steps": run.inner_steps,
        "skip": run.skip,
        "swaps": run.swaps,
        "routing": run.routing,
    }


def median_record(records: list[dict]) -> dict:
    out = dict(records[0])
    out["val_loss"] = statistics.median(r["val_loss"] for r in records)
    out["wall_s"] = statistics.median(r["wall_s"] for r in records)
    out["val_loss_runs"] = [r["val_loss"] for r in records]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=600_000, help="training tokens per run (all trainers together)")
    parser.add_argument("--replicas", type=int, default=2, help="K replicas per stage")
    parser.add_argument("--h1", type=int, default=10, help="first outer interval H")
    parser.add_argument("--h2", type=int, default=25, help="second outer interval H")
    parser.add_argument("--seeds", type=int, default=1, help="repeats per run with different seeds (median reported)")
    parser.add_argument("--only", nargs="*", help="run only these names (substring match)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    base, corpus = SwarmConfig(), load_corpus()
    records = []
    for run in plan(args.h1, args.h2):
        if args.only and not any(s in run.name for s in args.only):
            continue
        rec = median_record(
            [measure(run, base, corpus, args.replicas, args.tokens, seed) for seed in range(args.seeds)]
        )
        records.append(rec)
        print(
            f"{rec['name']:<38} val {rec['val_loss']:.4f}  {rec['bytes_per_token']['total']:10.1f} B/token  {rec['wall_s']:6.0f}s",
            flush=True,
        )
    print_table(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"tokens": args.tokens, "replicas": args.replicas, "seeds": args.seeds, "records": records}, f, indent=1
            )
        print(f"wrote {args.json}")


def print_table(records: list[dict]) -> None:
    ddp = {r["act_codec"]: r for r in records if r["name"].startswith("ddp/")}
    header = f"{'run':<38} {'val_loss':>8} {'vs ddp':>7} {'B/token':>10} {'act':>8} {'act-grad':>8} {'pseudo':>8} {'ddp-grad':>9} {'bytes vs ddp':>12}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in records:
        ref = ddp.get(r.get("act_codec", ""))
        b = r["bytes_per_token"]
        loss_ratio = f"{r['val_loss'] / ref['val_loss']:.3f}" if ref else "-"
        bytes_ratio = f"{b['total'] / ref['bytes_per_token']['total']:.3f}" if ref and b["total"] else "-"
        print(
            f"{r['name']:<38} {r['val_loss']:8.4f} {loss_ratio:>7} {b['total']:10.1f} {b.get('activations', 0):8.1f} "
            f"{b.get('activation_gradients', 0):8.1f} {b.get('pseudo_gradients', 0):8.3f} {b.get('gradients', 0):9.1f} {bytes_ratio:>12}"
        )


if __name__ == "__main__":
    main()
