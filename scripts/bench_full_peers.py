"""Full-model peers beside pipelines, in the simulator: validation loss and wire bytes per token by kind of replica.

Two replicas of every stage, SparseLoCo over all of them, at equal tokens: (a) both pipelined (their microbatches
hop between stage replicas through the activation codec), (b) one full peer (its own copy of every stage, no wire)
and one pipelined, (c) both full. Each with int8 and with subspace boundaries. The selective-compression row (b*)
is (b) with the full replica's boundaries compressed as well, as if every replica were compressed: the paper
"Heterogeneous Low-Bandwidth Pre-Training of LLMs" finds compressing only the pipelined replicas the better trade.
Bytes are the pipelined replicas' activation traffic and everyone's pseudo-gradients; a full replica sends no
activations.

    python scripts/bench_full_peers.py --seeds 3 --json docs/data/full-peers.json     # small model, ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_convergence import PRESETS  # noqa: E402  (this directory is on sys.path when run as a script)

from peer.data import load_corpus  # noqa: E402
from swarm.config import SwarmConfig, derive_config  # noqa: E402
from swarm.sim.simulate import SimulationConfig, simulate  # noqa: E402

ROWS: dict[str, dict[str, Any]] = {  # name: (full replicas of 2, compress the full one's boundaries too)
    "a: 2 pipelined": {"full": 0, "compress_full": False},
    "b: 1 full + 1 pipelined": {"full": 1, "compress_full": False},
    "b*: as b, full compressed too": {"full": 1, "compress_full": True},
    "c: 2 full": {"full": 2, "compress_full": False},
}


def run(codec: str, row: dict[str, Any], *, seed: int, args: argparse.Namespace, corpus: Any) -> dict[str, Any]:
    overrides = {**PRESETS["small"], "codecs.activations": codec, "outer.inner_steps": args.h, "train.seed": seed}
    cfg = derive_config(SwarmConfig(), overrides, outer="sparseloco")
    t = cfg.train
    streams = [
        corpus.sample_batches("train", batch_size=t.microbatch_size, seq_len=t.seq_len, seed=seed + 1000 * k)
        for k in range(2)
    ]
    val = corpus.val_batches(batch_size=t.microbatch_size, seq_len=t.seq_len, num_batches=8)
    sim = SimulationConfig(replicas=2, tokens=args.tokens, seed=seed, log_every=10**9, **row)
    result = simulate(cfg, sim, streams, val)
    per = result.bytes_per_token
    return {
        "val_loss": result.val_loss,
        "activation_bytes_per_token": per["activations"] + per["activation_gradients"],
        "pseudo_grad_bytes_per_token": per["pseudo_gradients"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=300_000, help="training tokens over both replicas")
    parser.add_argument("--h", type=int, default=10, help="inner steps between outer rounds")
    parser.add_argument("--codecs", nargs="+", default=["int8", "subspace"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    corpus = load_corpus()
    results: list[dict[str, Any]] = []
    header = f"{'codec':<9} {'row':<31} {'val loss (mean ± std)':>22} {'act B/token':>11} {'pseudo B/token':>14}"
    print(header)
    for codec in args.codecs:
        for name, row in ROWS.items():
            started = time.perf_counter()
            runs = [run(codec, row, seed=seed, args=args, corpus=corpus) for seed in range(args.seeds)]
            losses = [r["val_loss"] for r in runs]
            summary = {
                "codec": codec,
                "row": name,
                **row,
                "val_loss_mean": statistics.mean(losses),
                "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                "val_losses": losses,
                "activation_bytes_per_token": statistics.mean(r["activation_bytes_per_token"] for r in runs),
                "pseudo_grad_bytes_per_token": statistics.mean(r["pseudo_grad_bytes_per_token"] for r in runs),
                "wall_s": time.perf_counter() - started,
            }
            results.append(summary)
            print(
                f"{codec:<9} {name:<31} {summary['val_loss_mean']:>13.4f} ± {summary['val_loss_std']:.4f} "
                f"{summary['activation_bytes_per_token']:>11.1f} {summary['pseudo_grad_bytes_per_token']:>14.3f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1)
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
